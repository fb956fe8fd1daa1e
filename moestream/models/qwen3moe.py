"""Qwen3-MoE: the Qwen3 block with a routed-experts FFN in every layer."""

from __future__ import annotations

from moestream.layers.moe import SparseMoE, StackedExperts
from moestream.models.base import FFN, CausalLM


class Qwen3MoeCausalLM(CausalLM):
    """Each layer's FFN is a `SparseMoE`; its `experts` attribute is the seam where the
    expert-tier system replaces the resident stacks (`StackedExperts`)."""

    def build_ffn(self, layer: int) -> FFN:
        c, b = self.config, f"blk.{layer}."
        experts = StackedExperts(
            self.weight(b + "ffn_gate_exps.weight"),  # [E, F, H]
            self.weight(b + "ffn_up_exps.weight"),  # [E, F, H]
            self.weight(b + "ffn_down_exps.weight"),  # [E, H, F]
        )
        return SparseMoE(
            self.weight(b + "ffn_gate_inp.weight"), experts, c.n_experts_used, c.norm_topk_prob
        )

    def moe_layers(self) -> list[SparseMoE]:
        """The MoE FFN of every layer, in layer order."""
        return [layer.ffn for layer in self.layers]  # type: ignore[misc]

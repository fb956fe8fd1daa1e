"""Dense decoders of the llama family: llama (adjacent-pair RoPE on GGUF-permuted Q/K), qwen2
(Q/K/V biases) and qwen3 (per-head q/k RMSNorm). The differences are config-driven in
`CausalLM`; what is left here is the dense SiLU-gated FFN."""

from __future__ import annotations

from moestream.layers.mlp import GatedMLP
from moestream.models.base import FFN, CausalLM


class LlamaCausalLM(CausalLM):
    """llama, qwen2, qwen3."""

    def build_ffn(self, layer: int) -> FFN:
        b = f"blk.{layer}."
        return GatedMLP(
            self.weight(b + "ffn_gate.weight"),
            self.weight(b + "ffn_up.weight"),
            self.weight(b + "ffn_down.weight"),
        )

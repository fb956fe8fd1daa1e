"""`CausalLM`: the decoder-only transformer every supported architecture shares.

Embedding -> n x [RMSNorm -> attention -> residual -> RMSNorm -> FFN -> residual] -> RMSNorm;
`compute_logits` applies the output head (the embedding table when tied). Subclasses only say
what the FFN of a layer is. Per-step inputs (positions, attention metadata, KV cache) are
arguments, never state, so several models can run in one process.

Weights stay QTensors in their GGUF block format, moved to the device once at build; every
matmul goes through `layers.linear.linear` (batch-invariant on the CPU, `kernels.ops` on a
GPU). Activations are in `dtype`; norms, RoPE, attention
softmax and routing compute in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from moestream.cache.kv_cache import PagedKVCache
from moestream.config import ModelConfig
from moestream.errors import ModelFormatError
from moestream.kernels.ops import embedding
from moestream.layers.attention import Attention, AttentionMetadata
from moestream.layers.linear import Linear, linear
from moestream.layers.norm import RMSNorm, vector_weight
from moestream.layers.rope import RotaryEmbedding
from moestream.weights.qtensor import QTensor

FFN = Callable[[torch.Tensor], torch.Tensor]  # [T, H] -> [T, H]
WeightGetter = Callable[[str], QTensor]


class DecoderLayer:
    """Pre-norm block: x + attn(norm(x)), then h + ffn(norm(h))."""

    def __init__(self, attn_norm: RMSNorm, attn: Attention, ffn_norm: RMSNorm, ffn: FFN):
        self.attn_norm, self.attn, self.ffn_norm, self.ffn = attn_norm, attn, ffn_norm, ffn

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), cos, sin, attn, k_cache, v_cache)  # [T, H]
        return h + self.ffn(self.ffn_norm(h))


class CausalLM:
    """A decoder-only LM over GGUF-named weights. Subclasses implement `build_ffn`."""

    def __init__(
        self,
        config: ModelConfig,
        tensors: Mapping[str, QTensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self._tensors = tensors
        c = config

        self.embed_tokens = self.weight("token_embd.weight")  # [V, H]
        rope_freqs = (
            vector_weight(tensors["rope_freqs.weight"], "cpu")
            if "rope_freqs.weight" in tensors
            else None
        )
        self.rope = RotaryEmbedding(c, self.device, rope_freqs)
        self.layers = [self._build_layer(i) for i in range(c.n_layers)]
        self.norm = RMSNorm(self.weight("output_norm.weight"), c.rms_eps, self.device)
        untied = not c.tie_embeddings and "output.weight" in tensors
        self.lm_head = self.weight("output.weight") if untied else self.embed_tokens  # [V, H]
        del self._tensors  # build-time only

    # ---- build -------------------------------------------------------------------------------
    def weight(self, name: str) -> QTensor:
        """Tensor `name` of the model file, on the model's device (build time only)."""
        if name not in self._tensors:
            raise ModelFormatError(f"{self.config.arch} model is missing tensor {name}")
        return self._tensors[name].to(self.device)

    def optional_weight(self, name: str) -> QTensor | None:
        return self.weight(name) if name in self._tensors else None

    def build_ffn(self, layer: int) -> FFN:
        """The feed-forward part of block `layer`."""
        raise NotImplementedError

    def _build_layer(self, i: int) -> DecoderLayer:
        c, b = self.config, f"blk.{i}."
        qk_norm = c.has_qk_norm
        attn = Attention(
            c,
            q_proj=self._linear(b + "attn_q"),
            k_proj=self._linear(b + "attn_k"),
            v_proj=self._linear(b + "attn_v"),
            o_proj=self._linear(b + "attn_output"),
            rope=self.rope,
            q_norm=self._norm(b + "attn_q_norm.weight") if qk_norm else None,
            k_norm=self._norm(b + "attn_k_norm.weight") if qk_norm else None,
        )
        return DecoderLayer(
            self._norm(b + "attn_norm.weight"),
            attn,
            self._norm(b + "ffn_norm.weight"),
            self.build_ffn(i),
        )

    def _linear(self, prefix: str) -> Linear:
        return Linear(self.weight(prefix + ".weight"), self.optional_weight(prefix + ".bias"))

    def _norm(self, name: str) -> RMSNorm:
        return RMSNorm(self.weight(name), self.config.rms_eps, self.device)

    # ---- run ---------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv: PagedKVCache,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 (the flattened batch) -> final-normed hidden [T, H].

        Writes the new tokens' K/V into `kv` at `attn.slot_mapping`.
        """
        x = embedding(input_ids, self.embed_tokens).to(self.dtype)  # [T, H]
        cos, sin = self.rope.cos_sin(positions)  # [T, R/2]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn, kv.k[i], kv.v[i])
        return self.norm(x)

    __call__ = forward

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32."""
        return linear(hidden, self.lm_head).float()

    def make_kv_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None
    ) -> PagedKVCache:
        c = self.config
        return PagedKVCache(
            c.n_layers,
            num_blocks,
            block_size,
            c.n_kv_heads,
            c.head_dim,
            dtype or self.dtype,
            self.device,
        )

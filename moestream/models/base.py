"""`CausalLM`: the decoder-only transformer every supported architecture shares.

Embedding -> n x [RMSNorm -> attention -> residual -> RMSNorm -> FFN -> residual] -> RMSNorm;
`compute_logits` applies the output head (the embedding table when tied). Subclasses only say
what the FFN of a layer is. Per-step inputs (positions, attention metadata, KV cache) are
arguments, never state, so several models can run in one process.

Each residual add is taken together with the norm that follows it (`RMSNorm.add_norm`: one
launch on the kernel path); the values are those of the plain order above. When the matmuls
after a norm round their input to q8 blocks (decode-sized steps: `kernels.ops.takes_q8`), the
norm does it in the same launch and its output carries the result (`layers.norm.q8_of`).

Weights stay QTensors in their GGUF block format, moved to the device once at build; every
matmul goes through `layers.linear.linear` (batch-invariant on the CPU, `kernels.ops` on a
GPU). Activations are in `dtype`; norms, RoPE, attention
softmax and routing compute in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext

import torch

from moestream.cache.kv_cache import PagedKVCache
from moestream.config import ModelConfig
from moestream.errors import ModelFormatError
from moestream.kernels import ops
from moestream.kernels.ops import HAS_TRITON, KERNEL_DTYPES, batch_invariant, embedding
from moestream.layers.attention import Attention, AttentionMetadata
from moestream.layers.linear import HOST_TABLE_QTYPES, Linear, linear, needs_host_table
from moestream.layers.mlp import GatedMLP
from moestream.layers.norm import RMSNorm, vector_weight
from moestream.layers.rope import RotaryEmbedding
from moestream.weights.qtensor import QTensor

FFN = Callable[[torch.Tensor], torch.Tensor]  # [T, H] -> [T, H]
WeightGetter = Callable[[str], QTensor]


class DecoderLayer:
    """Pre-norm block on the residual stream r: h = r + attn(attn_norm(r)), then
    r' = h + ffn(ffn_norm(h)). It takes attn_norm(r) already computed and hands back
    next_norm(r') (the next layer's attn_norm, or the final norm), each norm fused with the
    residual add before it."""

    def __init__(self, attn_norm: RMSNorm, attn: Attention, ffn_norm: RMSNorm, ffn: FFN):
        self.attn_norm, self.attn, self.ffn_norm, self.ffn = attn_norm, attn, ffn_norm, ffn

    def attn_takes_q8(self, x: torch.Tensor) -> bool:
        """Whether a Q/K/V projection of attn_norm's output (shaped as x [T, H]) rounds it to q8
        blocks: attn_norm then does it (`RMSNorm(q8=True)`) and the projections share it."""
        return any(ops.takes_q8(x, w) for w in self.attn.qkv_weights())

    def ffn_takes_q8(self, x: torch.Tensor) -> bool:
        """Whether the FFN rounds ffn_norm's output (shaped as x [T, H]) to q8 blocks: the MoE's
        fused integer-dot path, or a dense FFN's gate / up matmul."""
        ffn = self.ffn
        if isinstance(ffn, GatedMLP):
            return ops.takes_q8(x, ffn.gate) or ops.takes_q8(x, ffn.up)
        takes_q8 = getattr(ffn, "takes_q8", None)
        return bool(takes_q8(x)) if takes_q8 is not None else False

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        next_norm: RMSNorm,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        next_q8: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x = attn_norm(residual) [T, H] -> (next_norm(r'), r'); `residual` may be updated in
        place (the kernel path). `next_q8`: next_norm's output is to carry its q8 rounding (the
        next layer's `attn_takes_q8`)."""
        a = self.attn(x, cos, sin, attn, k_cache, v_cache)  # [T, H]
        h, residual = self.ffn_norm.add_norm(a, residual, self.ffn_takes_q8(a))  # norm(r + a)
        return next_norm.add_norm(self.ffn(h), residual, next_q8)


class CausalLM:
    """A decoder-only LM over GGUF-named weights. Subclasses implement `build_ffn`."""

    # Q6_K weights in the padded layout (`QTensor.aligned`): None on a GPU only, else as set.
    # The values, hence the logits, are the same either way.
    pad_q6_k: bool | None = None

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
        # Batch-invariant kernels on a GPU (`kernels.ops.batch_invariant`; `--deterministic`).
        self.batch_invariant = False
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
        """Tensor `name` of the model file, on the model's device (build time only); on a GPU,
        Q6_K in the padded layout its kernels read in 32-bit words (`QTensor.aligned`;
        `pad_q6_k`)."""
        if name not in self._tensors:
            raise ModelFormatError(f"{self.config.arch} model is missing tensor {name}")
        aligned = self.device.type == "cuda" if self.pad_q6_k is None else self.pad_q6_k
        return self._tensors[name].to(self.device, aligned=aligned)

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

        Writes the new tokens' K/V into `kv` at `attn.slot_mapping`. On the kernel path with
        decode metadata (`attn.is_decode`) or verification metadata (`for_verify`: a fixed
        number of tokens per sequence) it makes no host synchronisation and allocates only
        through the caching allocator: a CUDA graph can capture it (`supports_cuda_graphs`).
        """
        with self._invariance():
            residual = embedding(input_ids, self.embed_tokens).to(self.dtype)  # [T, H]
            cos, sin = self.rope.cos_sin(positions)  # [T, R/2]
            if not self.layers:
                return self.norm(residual)
            x = self.layers[0].attn_norm(residual, self.layers[0].attn_takes_q8(residual))
            for i, layer in enumerate(self.layers):
                last = i + 1 == len(self.layers)
                nxt = None if last else self.layers[i + 1]
                x, residual = layer(
                    x, residual, self.norm if nxt is None else nxt.attn_norm, cos, sin, attn,
                    kv.k[i], kv.v[i], nxt is not None and nxt.attn_takes_q8(residual),
                )  # fmt: skip
            return x

    __call__ = forward

    def _invariance(self) -> AbstractContextManager[None]:
        """Batch-invariant kernels when the model asks for them; else whatever the caller set."""
        return batch_invariant() if self.batch_invariant else nullcontext()

    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether decode steps can run as CUDA graphs: a CUDA model on the Triton kernel path
        whose every layer is capturable (no host sync, no host copies: resident experts on the
        fused MoE kernel, no weight type that dequantizes through a host table)."""
        return self._graphable_outside_ffns() and all(
            getattr(layer.ffn, "capturable", False) for layer in self.layers
        )

    @property
    def piecewise_graph_tokens(self) -> int:
        """The most tokens a decode step can take as a chain of CUDA graphs cut at host points
        (runner/piecewise.py): where some layer's FFN cannot be captured whole but can be cut
        (`graph_tokens`: streamed experts), the least of those layers' limits; 0 where a chain
        cannot run or a whole graph can (`supports_cuda_graphs`)."""
        if not self._graphable_outside_ffns():
            return 0
        limit, cut = 1 << 30, False
        for layer in self.layers:
            if getattr(layer.ffn, "capturable", False):
                continue
            tokens = getattr(layer.ffn, "graph_tokens", 0)
            if not tokens:
                return 0
            limit, cut = min(limit, tokens), True
        return limit if cut else 0

    def _graphable_outside_ffns(self) -> bool:
        return (
            self.device.type == "cuda"
            and HAS_TRITON
            and self.dtype in KERNEL_DTYPES
            and self.embed_tokens.qtype not in HOST_TABLE_QTYPES
            and not needs_host_table(self.lm_head)
            and all(layer.attn.capturable for layer in self.layers)
        )

    def cache_weight_values(self, budget_bytes: int) -> int:
        """Keep dequantized copies of quantized weights within `budget_bytes`: on the CPU for
        every matmul (`_cache_cpu_values`), elsewhere for the kernel path's prefill-size
        matmuls (`cache_kernel_values`). Returns the bytes used."""
        if self.device.type == "cpu":
            return self._cache_cpu_values(budget_bytes)
        return self.cache_kernel_values(budget_bytes)

    def cache_kernel_values(self, budget_bytes: int) -> int:
        """Keep bf16 (the model's dtype) copies of quantized weights for matmuls of many rows
        (`ops.CACHED_MIN_M` and up: prefill chunks and batched decode), while `budget_bytes`
        lasts: first every layer's attention and dense FFN weights (small, and read by every
        such step), then the resident expert stacks layer by layer (the MoE's grouped GEMM then
        skips dequantizing them each prefill step). Only weights on the CUDA kernel path; the
        output head is left out (it sees one row per request). Steps of fewer rows keep reading
        the quantized weights. Returns the bytes used."""
        if budget_bytes <= 0:
            return 0
        from moestream.kernels.dequant_mm import cache_values
        from moestream.kernels.ops import _use_kernels
        from moestream.layers.moe import StackedExperts

        dense: list[QTensor] = []
        stacks: list[QTensor] = []
        for layer in self.layers:
            ffn, attn = layer.ffn, layer.attn
            dense += attn.weights()
            if isinstance(ffn, GatedMLP):
                dense += [ffn.gate, ffn.up, ffn.down]
            experts = getattr(ffn, "experts", None)
            if isinstance(experts, StackedExperts):
                stacks += experts.stacked()
        probe = torch.empty((1, 1), dtype=self.dtype, device=self.device)
        used = 0
        for w in dense + stacks:
            size = math.prod(w.shape) * probe.element_size()
            if w.values is None and _use_kernels(probe, w) and used + size <= budget_bytes:
                used += cache_values(w, self.dtype)
        return used

    def _cache_cpu_values(self, budget_bytes: int) -> int:
        """The CPU's every matmul dequantizes its weight (the reference dequantization, then a
        float product): keep the dequantized values instead, in the model's dtype, layer by
        layer while `budget_bytes` lasts (experts, router, dense FFN, attention), then the
        output head.
        The products read the same values, so every result keeps its bits. Returns the bytes
        used."""
        from moestream.layers.moe import StackedExperts

        used = 0
        if budget_bytes <= 0:
            return used

        def keep(w: QTensor) -> bool:
            nonlocal used
            size = math.prod(w.shape) * self.dtype.itemsize
            if w.is_float or w.values is not None or used + size > budget_bytes:
                return False
            w.values = w.dequantize(self.dtype)
            used += size
            return True

        for layer in self.layers:
            ffn, attn = layer.ffn, layer.attn
            experts = getattr(ffn, "experts", None)
            if isinstance(experts, StackedExperts) and any([keep(w) for w in experts.stacked()]):
                experts.refresh_views()  # the per-expert views share what the stacks got
            router = getattr(ffn, "router", None)
            if isinstance(router, QTensor):
                keep(router)
            if isinstance(ffn, GatedMLP):
                for w in (ffn.gate, ffn.up, ffn.down):
                    keep(w)
            for w in attn.weights():
                keep(w)
        keep(self.lm_head)
        return used

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32."""
        with self._invariance():
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

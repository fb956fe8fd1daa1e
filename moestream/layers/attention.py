"""Causal self-attention over the paged KV cache, for a flattened batch of sequences.

A step carries B sequences with T new tokens in all, laid end to end ([T, ...] tensors). Each
sequence's new tokens are the last `query_lens[b]` of its `seq_lens[b]` context tokens; their
K/V are written to the cache at `slot_mapping` first, then every query attends to its own
sequence's cached context up to and including its position (GQA: query head h reads KV head
h // (n_heads / n_kv_heads)).

Letters: T new tokens, B sequences, L context length, H hidden, n/g query/KV heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moestream.config import ModelConfig
from moestream.kernels.ops import batch_invariant_enabled, takes_q8
from moestream.layers.linear import Linear, PairedLinear, fuse_linears, needs_host_table
from moestream.layers.norm import RMSNorm, on_kernel_path, rms_norm, with_q8
from moestream.layers.rope import RotaryEmbedding, apply_rope
from moestream.weights.qtensor import QTensor

if TYPE_CHECKING:
    from moestream.kernels.mmvq import Q8Act

# Contexts up to which the decode kernel keeps its least split count whatever the batch. H200,
# 30B-A3B heads (bench/attention_gpu.py, 2026-11-30), batch 1: 16 splits 7.7 us at 512 tokens
# against 8.4 with the batch rule's 66, but 13.9 against 11.2 at 4k and 65.7 against 28.7 at 32k.
SHORT_DECODE_CONTEXT = 2048
# Whether the decode kernel also writes the q8 rounding of its output for the output projection
# (`Attention._o_proj_q8`); off only to measure what it saves.
DECODE_OUT_Q8 = True


@dataclass
class AttentionMetadata:
    """Per-step attention inputs; built by the runner, read by every attention layer.

    query_start_loc [B+1] int32: new tokens of sequence b are rows query_start_loc[b]:[b+1].
    seq_lens [B] int32: context length of each sequence after this step (new tokens included).
    block_tables [B, max_blocks] int32: block ids of each sequence, padded with 0.
    slot_mapping [T] int64: flat cache slot (block_id * block_size + offset) of each new token.
    query_lens_cpu, seq_lens_cpu: host copies, so the reference path never synchronizes (None
    in metadata made by `for_decode` and `for_verify`, whose values live on the device only).
    is_decode: every sequence has exactly one new token (the decode kernel's case).
    max_query_len: a host bound on any sequence's new tokens (sizes the prefill kernel's grid);
    None: take it from query_lens_cpu.

    max_seq_len: a host bound on every seq_lens entry, or None (the decode kernel then assumes
    contexts may be long: `SHORT_DECODE_CONTEXT`).

    A slot_mapping entry < 0 (padding rows of a CUDA graph bucket) writes no K/V; only the CUDA
    kernel paths accept such rows.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens_cpu: list[int] | None
    seq_lens_cpu: list[int] | None
    block_size: int
    is_decode: bool = False
    max_query_len: int | None = None
    max_seq_len: int | None = None  # a host bound on seq_lens; None: unknown

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def query_len_bound(self) -> int | None:
        """`max_query_len`, else the longest of `query_lens_cpu`; None when neither is known."""
        if self.max_query_len is not None:
            return self.max_query_len
        return max(self.query_lens_cpu) if self.query_lens_cpu else None

    @classmethod
    def for_decode(
        cls,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        block_size: int,
        max_seq_len: int | None = None,
    ) -> AttentionMetadata:
        """Decode metadata over device tensors only (static buffers of a CUDA graph): one new
        token per sequence, no host copies, so only the CUDA decode path can read it;
        `max_seq_len` a bound every step run with it keeps (None: none)."""
        return cls(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            query_lens_cpu=None,
            seq_lens_cpu=None,
            block_size=block_size,
            is_decode=True,
            max_query_len=1,
            max_seq_len=max_seq_len,
        )

    @classmethod
    def for_verify(
        cls,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        block_size: int,
        tokens_per_seq: int,
    ) -> AttentionMetadata:
        """Metadata over device tensors only (static buffers of a CUDA graph) for steps of
        `tokens_per_seq` rows per sequence: query_start_loc [B+1] = 0, K, 2K, ...; sequence
        b's new tokens are the last K of its seq_lens[b] (0: a padding sequence). No host
        copies, so only the CUDA prefill-kernel path can read it."""
        return cls(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            query_lens_cpu=None,
            seq_lens_cpu=None,
            block_size=block_size,
            is_decode=False,
            max_query_len=tokens_per_seq,
        )

    @classmethod
    def build(
        cls,
        seqs: list[tuple[int, int, list[int]]],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Metadata for sequences given as (start position = tokens already cached, number of
        new tokens, block ids covering start + new tokens)."""
        if not seqs:
            raise ValueError("a step needs at least one sequence")
        query_lens, seq_lens, slots = [], [], []
        for i, (start, n_new, blocks) in enumerate(seqs):
            if start < 0 or n_new <= 0:
                raise ValueError(f"sequence {i}: start {start}, new tokens {n_new}")
            if len(blocks) * block_size < start + n_new:
                raise ValueError(
                    f"sequence {i}: {len(blocks)} blocks of {block_size} cannot hold "
                    f"{start + n_new} tokens"
                )
            query_lens.append(n_new)
            seq_lens.append(start + n_new)
            slots.extend(
                blocks[p // block_size] * block_size + p % block_size
                for p in range(start, start + n_new)
            )
        max_blocks = max(len(blocks) for _, _, blocks in seqs)
        table = [list(blocks) + [0] * (max_blocks - len(blocks)) for _, _, blocks in seqs]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(table, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_size=block_size,
            is_decode=all(n == 1 for n in query_lens),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k, v [T, g, D] at flat slots [T] of caches [num_blocks, block_size, g, D]."""
    k_cache.flatten(0, 1).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.flatten(0, 1).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _host_lens(attn: AttentionMetadata) -> tuple[list[int], list[int]]:
    """(query_lens_cpu, seq_lens_cpu), which the reference paths need."""
    if attn.query_lens_cpu is None or attn.seq_lens_cpu is None:
        raise ValueError("this attention path needs host copies of the lengths (for_decode)")
    return attn.query_lens_cpu, attn.seq_lens_cpu


def _gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata, b: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's cached K and V, float32 [L, g, D] each (L = its context length)."""
    ctx = _host_lens(attn)[1][b]
    table = attn.block_tables[b, : -(-ctx // attn.block_size)]  # [nb]
    k = k_cache[table].flatten(0, 1)[:ctx].float()
    v = v_cache[table].flatten(0, 1)[:ctx].float()
    return k, v


def paged_attention_per_query(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention with each query computed on its own: batch-invariant (the CPU reference).

    For the query at position p: softmax(q k[0..p]^T * scale) v[0..p] over exactly its p + 1
    visible keys (no mask), so its result is the same bits whether it comes alone (decode), in
    a prefill chunk of any size, or next to other sequences: the shapes and values of every op
    depend only on p and the K/V of positions 0..p.
    """
    n_heads, n_kv, d = q.shape[1], k_cache.shape[2], q.shape[2]
    n_rep = n_heads // n_kv
    out = torch.empty_like(q)
    row = 0
    for b, (n_new, ctx) in enumerate(zip(*_host_lens(attn), strict=True)):
        k, v = _gather_kv(k_cache, v_cache, attn, b)  # [L, g, D]
        k_t = k.permute(1, 2, 0)  # [g, D, L]
        v_h = v.transpose(0, 1)  # [g, L, D]
        for i in range(n_new):
            visible = ctx - n_new + i + 1  # positions 0..p
            qi = q[row + i].float().reshape(n_kv, n_rep, d)  # [g, r, D]: head h -> KV h // r
            scores = torch.matmul(qi, k_t[:, :, :visible]) * scale  # [g, r, p+1]
            probs = torch.softmax(scores, dim=-1)
            o = torch.matmul(probs, v_h[:, :visible])  # [g, r, D]
            out[row + i] = o.reshape(n_heads, d).to(q.dtype)
        row += n_new
    return out


def paged_attention_per_sequence(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention with each sequence's queries computed together under a causal mask (few
    launches: the GPU reference). A sequence's result does not depend on its neighbours, but a
    query's may depend (in the last bits) on how many queries share its step."""
    n_heads, n_kv = q.shape[1], k_cache.shape[2]
    n_rep = n_heads // n_kv
    out = torch.empty_like(q)
    row = 0
    for b, (n_new, ctx) in enumerate(zip(*_host_lens(attn), strict=True)):
        k, v = _gather_kv(k_cache, v_cache, attn, b)  # [L, g, D]
        k = k.repeat_interleave(n_rep, dim=1).transpose(0, 1)  # [n, L, D]
        v = v.repeat_interleave(n_rep, dim=1).transpose(0, 1)
        qb = q[row : row + n_new].float().transpose(0, 1)  # [n, Tb, D]
        scores = torch.matmul(qb, k.transpose(1, 2)) * scale  # [n, Tb, L]
        q_pos = torch.arange(ctx - n_new, ctx, device=q.device)  # [Tb]
        k_pos = torch.arange(ctx, device=q.device)  # [L]
        visible = k_pos[None, :] <= q_pos[:, None]  # [Tb, L]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[row : row + n_new] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)
        row += n_new
    return out


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Reference attention: q [T, n, D] against each sequence's cached context -> [T, n, D],
    in float32. CPU: `paged_attention_per_query` (batch-invariant); other devices:
    `paged_attention_per_sequence` (one launch per op and sequence, not per query)."""
    if q.device.type == "cpu":
        return paged_attention_per_query(q, k_cache, v_cache, attn, scale)
    return paged_attention_per_sequence(q, k_cache, v_cache, attn, scale)


def paged_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference of `kernels.paged_attention.paged_decode_attention` (same signature): one query
    per sequence, q [B, n, D] at position seq_lens[b] - 1 against keys 0 .. seq_lens[b] - 1 of
    caches [num_blocks, block_size, g, D] through block_tables [B, max_blocks] int32 ->
    [B, n, D] in q's dtype, float32 math; seq_lens[b] == 0 gives zeros. Device tensors only (no
    host sync): every sequence gathers all max_blocks blocks and masks past its length."""
    b, n, d = q.shape
    g, bs = k_cache.shape[2], k_cache.shape[1]
    tables = block_tables.long()  # [B, nb]
    k = k_cache[tables].flatten(1, 2).float()  # [B, L, g, D]
    v = v_cache[tables].flatten(1, 2).float()
    k = k.repeat_interleave(n // g, dim=2).permute(0, 2, 3, 1)  # [B, n, D, L]
    v = v.repeat_interleave(n // g, dim=2).transpose(1, 2)  # [B, n, L, D]
    scores = torch.matmul(q.float()[:, :, None, :], k)[:, :, 0] * scale  # [B, n, L]
    visible = torch.arange(tables.shape[1] * bs, device=q.device)[None, :] < seq_lens[:, None]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty rows -> 0
    return torch.matmul(probs[:, :, None, :], v)[:, :, 0].to(q.dtype)


def qk_norm_rope_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    neox: bool,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Reference of `kernels.norm_rope.qk_norm_rope_kv` (same signature): per-head RMSNorm of
    q [T, n, D] and k [T, g, D] where a weight is given, RoPE on both (NeoX or adjacent-pair
    layout); q is overwritten with the result, k and v [T, g, D] go to the caches at
    slot_mapping [T] (rows with a negative slot are skipped)."""
    if q_weight is not None:
        q = q.copy_(rms_norm(q, q_weight, eps))
    if k_weight is not None:
        k = rms_norm(k, k_weight, eps)
    q.copy_(apply_rope(q, cos, sin, neox))
    k = apply_rope(k, cos, sin, neox)
    keep = slot_mapping >= 0
    write_kv(k[keep], v[keep], k_cache, v_cache, slot_mapping[keep])


class Attention:
    """One layer's self-attention: QKV projections (+ biases), per-head q/k RMSNorm (Qwen3),
    RoPE, cache write, paged attention, output projection.

    On the kernel path (CUDA, triton) Q/K/V projections of one weight type are merged into one
    matmul, norm + RoPE + cache write are one launch, and decode steps (one token per sequence)
    use the split-context paged-attention kernel, steps with several tokens per sequence the
    paged prefill kernel (its grid from `max_query_len`): no host sync, capturable in a CUDA
    graph.
    Elsewhere the torch references run (per-query attention on the CPU, batch-invariant)."""

    def __init__(
        self,
        config: ModelConfig,
        q_proj: Linear,
        k_proj: Linear,
        v_proj: Linear,
        o_proj: Linear,
        rope: RotaryEmbedding,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ):
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.o_proj = o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.rope = rope
        parts = [q_proj, k_proj, v_proj]
        if q_proj.weight.device.type == "cuda":
            self.projections = fuse_linears(parts)
        else:
            self.projections = [(p, [p.out_features]) for p in parts]

    def qkv_weights(self) -> list[QTensor]:
        """The q, k and v projections' weights (as merged or paired)."""
        out: list[QTensor] = []
        for p, _ in self.projections:
            out.extend(p.weights if isinstance(p, PairedLinear) else (p.weight,))
        return out

    def weights(self) -> list[QTensor]:
        """Every projection's weight: `qkv_weights`, then o."""
        return [*self.qkv_weights(), self.o_proj.weight]

    @property
    def capturable(self) -> bool:
        """No weight of this layer needs a host copy to dequantize (`needs_host_table`)."""
        return not any(needs_host_table(w) for w in self.weights())

    def _o_proj_q8(self, o: torch.Tensor) -> Q8Act | None:
        """An empty Q8Act for the decode kernel to fill with the q8 rounding of its output o
        [T, n * D], where the output projection's integer-dot GEMV would round o itself
        (`kernels.ops.takes_q8`): one launch less a layer. None where it would not, or where
        the head dim cannot hold whole q8 blocks."""
        from moestream.kernels.mmvq import QBLOCK, empty_q8

        d = self.head_dim
        if not DECODE_OUT_Q8 or d < QBLOCK or d & (d - 1) or not takes_q8(o, self.o_proj.weight):
            return None
        return empty_q8(o.shape[0], o.shape[1], o.device)

    def _project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> q [T, n, D], k [T, g, D], v [T, g, D] (views of merged outputs)."""
        outs: list[torch.Tensor] = []
        for proj, sizes in self.projections:
            if isinstance(proj, PairedLinear):
                outs.extend(proj.outputs(x))
                continue
            y = proj(x)  # [T, sum(sizes)]
            outs.extend(y.split(sizes, dim=-1) if len(sizes) > 1 else (y,))
        t, d = x.shape[0], self.head_dim
        q, k, v = outs
        return q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """x [T, H], cos/sin [T, R/2] -> [T, H]; writes this step's K/V into the caches."""
        t = x.shape[0]
        q, k, v = self._project_qkv(x)  # [T, n, D], [T, g, D], [T, g, D]
        kernels = on_kernel_path(q)
        if kernels:
            from moestream.kernels.norm_rope import qk_norm_rope_kv

            qn, kn = self.q_norm, self.k_norm
            qk_norm_rope_kv(
                q, k, v, cos, sin, None if qn is None else qn.weight,
                None if kn is None else kn.weight, (qn or kn).eps if (qn or kn) else 0.0,
                self.rope.neox, attn.slot_mapping, k_cache, v_cache,
            )  # fmt: skip
        else:
            if self.q_norm is not None:
                q = self.q_norm(q)
            if self.k_norm is not None:
                k = self.k_norm(k)
            q = self.rope.apply(q, cos, sin)
            k = self.rope.apply(k, cos, sin)
            write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
        # Batch-invariant mode runs every step's attention through the several-token kernel
        # (one token per sequence included), so a token's bits never depend on whether it came
        # in a decode step, a prefill chunk or a verification.
        if kernels and attn.is_decode and not batch_invariant_enabled():
            from moestream.kernels import paged_attention as pa

            splits = pa.NUM_SPLITS  # short contexts: more splits only cost launch width
            if attn.max_seq_len is None or attn.max_seq_len > SHORT_DECODE_CONTEXT:
                splits = pa.decode_num_splits(t, k_cache.shape[2], pa.device_num_sms(q.device))
            o2 = q.new_empty(t, self.n_heads * self.head_dim)
            xa = self._o_proj_q8(o2)
            pa.paged_decode_attention(
                q, k_cache, v_cache, attn.block_tables, attn.seq_lens, self.scale,
                out=o2.view(t, self.n_heads, self.head_dim), num_splits=splits, q8=xa,
            )  # fmt: skip
            return self.o_proj(o2 if xa is None else with_q8(o2, xa))
        elif kernels and (attn.query_len_bound is not None or attn.is_decode):
            from moestream.kernels.prefill_attention import paged_prefill_attention

            o = paged_prefill_attention(
                q, k_cache, v_cache, attn.block_tables, attn.query_start_loc, attn.seq_lens,
                self.scale, 1 if attn.is_decode else attn.query_len_bound,
            )  # [T, n, D]  # fmt: skip
        else:
            o = paged_attention_ref(q, k_cache, v_cache, attn, self.scale)  # [T, n, D]
        return self.o_proj(o.reshape(t, self.n_heads * self.head_dim))

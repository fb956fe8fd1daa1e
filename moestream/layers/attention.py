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

import torch

from moestream.config import ModelConfig
from moestream.layers.linear import Linear
from moestream.layers.norm import RMSNorm
from moestream.layers.rope import RotaryEmbedding


@dataclass
class AttentionMetadata:
    """Per-step attention inputs; built by the runner, read by every attention layer.

    query_start_loc [B+1] int32: new tokens of sequence b are rows query_start_loc[b]:[b+1].
    seq_lens [B] int32: context length of each sequence after this step (new tokens included).
    block_tables [B, max_blocks] int32: block ids of each sequence, padded with 0.
    slot_mapping [T] int64: flat cache slot (block_id * block_size + offset) of each new token.
    query_lens_cpu, seq_lens_cpu: host copies, so the reference path never synchronizes.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

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


def _gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata, b: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's cached K and V, float32 [L, g, D] each (L = its context length)."""
    ctx = attn.seq_lens_cpu[b]
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
    for b, (n_new, ctx) in enumerate(zip(attn.query_lens_cpu, attn.seq_lens_cpu, strict=True)):
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
    for b, (n_new, ctx) in enumerate(zip(attn.query_lens_cpu, attn.seq_lens_cpu, strict=True)):
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


class Attention:
    """One layer's self-attention: QKV projections (+ biases), per-head q/k RMSNorm (Qwen3),
    RoPE, cache write, paged attention, output projection."""

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
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.rope = rope

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
        q = self.q_proj(x).view(t, self.n_heads, self.head_dim)  # [T, n, D]
        k = self.k_proj(x).view(t, self.n_kv_heads, self.head_dim)  # [T, g, D]
        v = self.v_proj(x).view(t, self.n_kv_heads, self.head_dim)  # [T, g, D]
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        q = self.rope.apply(q, cos, sin)
        k = self.rope.apply(k, cos, sin)
        write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
        o = paged_attention_ref(q, k_cache, v_cache, attn, self.scale)  # [T, n, D]
        return self.o_proj(o.reshape(t, self.n_heads * self.head_dim))

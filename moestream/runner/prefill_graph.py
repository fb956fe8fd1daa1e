"""Prefill chunks of one sequence as CUDA graphs, one per token bucket, captured on first use.

Why: an eager prefill step launches ~50 kernels and torch ops per layer from Python, and on an
H200 the host needs longer to issue them than the GPU to run them: a 512-token prefill of
Qwen3-30B-A3B kept the GPU busy 22% of its wall time, a 2048-token one 37% (`python
bench/profile_steps.py MODEL --prefill 512,2048`, bench/RESULTS.md). Replaying a graph issues
the whole forward at once.

A step qualifies when it holds exactly one request, feeding a prompt (or recompute) chunk of
n > 1 tokens without drafts, and n fits the largest bucket. The chunk runs as the graph of the
smallest bucket T >= n (powers of two below the scheduler's token budget, then the budget),
with the verify graphs' layout (runner/cuda_graph.py) for one sequence: rows 0 .. n-1 are the
real tokens at positions start .. start+n-1, rows n .. T-1 pad rows that repeat the last real
token and position and write no K/V (slot -1); seq_lens =
start + T, so the attention kernel, which takes a sequence's new tokens to be the last T of its
seq_lens, gives real row i position start + i and sees exactly what the eager step sees. Pad
rows' keys may lie past the sequence's blocks: the table has spare columns, every entry a valid
block id and the pool finite, so those reads are in bounds and their results are dropped.

Only one row of logits leaves the graph: the last real token's (a static row index), so the
output head runs on one row and the output is [1, V] at every bucket. A chunk that does not
end its prompt is not sampled; its logits are ignored.

Numerics: a graph runs the forward at T rows where the eager step runs it at n, so where a
kernel's choice depends on the row count (cuBLAS tiles, the MoE path by assignments) the real
rows' values may differ in the last bits from the eager step's. In batch-invariant mode
(`--deterministic`) no kernel's result depends on the row count, so they agree exactly.

Memory: the graphs share the decode graphs' private pool, which then holds the temporaries of
the largest prefill bucket (one step's activations at the scheduler's token budget; the
engine's activation reserve counts them).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import numpy as np
import torch

from moestream.cache.kv_cache import PagedKVCache
from moestream.layers.attention import AttentionMetadata
from moestream.models.base import CausalLM
from moestream.runner.cuda_graph import GraphBackend, capturing_phase

# ids [T] int64, positions [T] int64, metadata, rows [1] int64 -> logits [1, V] float32
PrefillForward = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor
]


def prefill_buckets(max_tokens: int, least: int = 16) -> tuple[int, ...]:
    """Token buckets for chunks of up to `max_tokens` (the scheduler's token budget): the powers
    of two from `least` below it, then max_tokens itself (no graph is larger than the step the
    engine's activation reserve counts)."""
    if max_tokens < 2:
        return ()
    out = []
    b = least
    while b < max_tokens:
        out.append(b)
        b *= 2
    return (*out, max_tokens)


class PrefillGraphs:
    """Bucketed replay of a one-sequence prefill forward over static input buffers (see the
    module docstring). `max_blocks` bounds the block-table columns a sequence can use; the
    table has `cdiv(max bucket - 1, block_size)` spare columns for the pad rows."""

    def __init__(
        self,
        forward: PrefillForward,
        block_size: int,
        max_blocks: int,
        device: torch.device | str,
        buckets: Sequence[int],
        backend: GraphBackend,
    ):
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 2:
            raise ValueError(f"buckets must be increasing sizes >= 2, got {tuple(buckets)}")
        self.forward = forward
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.buckets = tuple(buckets)
        self.device = torch.device(device)
        self.backend = backend
        rows = self.buckets[-1]
        self.table_width = max_blocks + -(-(rows - 1) // block_size)
        cuda = self.device.type == "cuda"
        with torch.inference_mode():
            # static inputs: [ids | positions | slots | sample row] int64, [seq_len | table] int32
            self._dev64 = torch.zeros(3 * rows + 1, dtype=torch.int64, device=self.device)
            self._dev32 = torch.zeros(1 + self.table_width, dtype=torch.int32, device=self.device)
            self._host64 = torch.zeros(3 * rows + 1, dtype=torch.int64, pin_memory=cuda)
            self._host32 = torch.zeros(1 + self.table_width, dtype=torch.int32, pin_memory=cuda)
            self._qsl = {
                t: torch.tensor([0, t], dtype=torch.int32, device=self.device) for t in self.buckets
            }
        self.input_ids = self._dev64[:rows]
        self.positions = self._dev64[rows : 2 * rows]
        self.slot_mapping = self._dev64[2 * rows : 3 * rows]
        self.sample_row = self._dev64[3 * rows :]
        self.seq_lens = self._dev32[:1]
        self.block_tables = self._dev32[1:].view(1, self.table_width)
        h64, h32 = self._host64.numpy(), self._host32.numpy()
        self._h_ids, self._h_pos = h64[:rows], h64[rows : 2 * rows]
        self._h_slots, self._h_row = h64[2 * rows : 3 * rows], h64[3 * rows :]
        self._h_seq_len, self._h_table = h32[:1], h32[1:]
        self._h_slots.fill(-1)
        self._copied = torch.cuda.Event() if cuda else None
        # bucket -> (replay, static logits [1, V])
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}

    def drop(self) -> None:
        """Forget every captured graph (as `DecodeGraphs.drop`)."""
        self._graphs.clear()

    @property
    def captured(self) -> tuple[int, ...]:
        """Buckets captured so far, in increasing order."""
        return tuple(sorted(self._graphs))

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def bucket_for(self, num_tokens: int) -> int | None:
        """The smallest bucket that holds a chunk of `num_tokens` tokens, or None (one token:
        a decode step; more than the largest bucket)."""
        if not 1 < num_tokens <= self.buckets[-1]:
            return None
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def _attn(self, t: int) -> AttentionMetadata:
        return AttentionMetadata.for_verify(
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping[:t],
            query_start_loc=self._qsl[t],
            block_size=self.block_size,
            tokens_per_seq=t,
        )

    def _capture(self, t: int) -> None:
        self.slot_mapping[:t].fill_(-1)  # warm-up and capture write no K/V, read no context
        self.seq_lens.fill_(0)
        self.sample_row.fill_(0)
        attn = self._attn(t)
        ids, pos = self.input_ids[:t], self.positions[:t]
        with capturing_phase("prefill"):  # (device counters: the steps it runs are prefill)
            self._graphs[t] = self.backend.capture(
                lambda: self.forward(ids, pos, attn, self.sample_row)
            )

    @torch.inference_mode()
    def run(self, token_ids: Sequence[int], start: int, block_ids: Sequence[int]) -> torch.Tensor:
        """Logits [1, V] of the last of `token_ids` (fed at positions start ..), from host data;
        writes their K/V like the eager forward. `block_ids` covers every fed position. The
        result is a view of a static buffer, valid until the next run. ValueError when no
        bucket holds the chunk."""
        n = len(token_ids)
        t = self.bucket_for(n)
        if t is None:
            raise ValueError(f"no prefill graph for a chunk of {n} tokens")
        bs = self.block_size
        if start < 0 or start + n > len(block_ids) * bs:
            raise ValueError(f"{len(block_ids)} blocks do not cover positions {start}..{start + n}")
        if t not in self._graphs:
            self._capture(t)
        if self._copied is not None:
            self._copied.synchronize()  # the previous run's copy has left the host buffers
        end = start + n
        self._h_ids[:n] = token_ids
        self._h_ids[n:t] = token_ids[-1]  # pad rows repeat the last real token and position
        pos = np.arange(start, end, dtype=np.int64)
        self._h_pos[:n] = pos
        self._h_pos[n:t] = end - 1
        blocks = np.asarray(block_ids[: self.max_blocks], dtype=np.int64)
        self._h_slots[:n] = blocks[pos // bs] * bs + pos % bs
        self._h_slots[n:t] = -1  # pad rows write no K/V
        self._h_row[0] = n - 1
        self._h_seq_len[0] = start + t  # the new tokens are the last t of seq_lens
        self._h_table[: len(blocks)] = blocks  # columns past them keep valid ids (0 or stale)
        self._dev64.copy_(self._host64, non_blocking=True)
        self._dev32[: 1 + len(blocks)].copy_(self._host32[: 1 + len(blocks)], non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        replay, logits = self._graphs[t]
        replay()
        return logits


def prefill_graphs_for(
    model: CausalLM, kv: PagedKVCache, block_size: int, max_tokens: int, backend: GraphBackend
) -> PrefillGraphs | None:
    """Prefill graphs over `model` and its KV pool for chunks of up to `max_tokens` tokens (the
    scheduler's token budget), in `backend`'s pool (the decode graphs'), or None where the model
    cannot be captured (`CausalLM.supports_cuda_graphs`) or max_tokens < 2."""
    if not model.supports_cuda_graphs:
        return None
    return build_prefill_graphs(model, kv, block_size, max_tokens, backend)


def build_prefill_graphs(
    model: CausalLM, kv: PagedKVCache, block_size: int, max_tokens: int, backend: GraphBackend
) -> PrefillGraphs | None:
    """`prefill_graphs_for` without the capture check (tests replay by recomputation on the
    CPU): the forward is the model's, then the output head on the sample row."""
    buckets = prefill_buckets(max_tokens)
    if not buckets:
        return None
    context_blocks = -(-model.config.context_length // block_size)

    def forward(
        ids: torch.Tensor, pos: torch.Tensor, attn: AttentionMetadata, rows: torch.Tensor
    ) -> torch.Tensor:
        hidden = model.forward(ids, pos, attn, kv)  # [T, H]
        return model.compute_logits(hidden.index_select(0, rows))  # [1, V]

    max_blocks = min(context_blocks, kv.num_blocks)
    return PrefillGraphs(forward, block_size, max_blocks, model.device, buckets, backend)

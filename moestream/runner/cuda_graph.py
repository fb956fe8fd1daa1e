"""Decode steps as CUDA graphs: one graph per bucketed batch size, captured on first use.

Everything that knows about CUDA graphs lives here. A pure decode step (every request feeds one
token and samples it) of B <= max(buckets) sequences runs as the graph of the smallest bucket
>= B: the step's inputs go to static buffers, rows B .. bucket-1 are padding (slot -1: no KV
write; seq_len 0: attention reads nothing), the graph replays the model forward and the output
head, and the first B rows of its static logits come back. The sampler stays outside.

Inputs reach the graph in one or two copies: the static buffers are typed views of one device
buffer, mirrored by one host buffer (pinned on CUDA). `run_decode` writes a step's inputs into
the host mirror with numpy, then copies the token ids, positions, slots and lengths (a few
hundred bytes) with one non-blocking copy and the block-table rows that changed with a second.
A row changes when another request takes it or its request's table grows by a block (a table
only grows while its request holds its blocks; see `ScheduledRequest.block_ids`), so most steps
copy no table at all. `run` takes tensors instead (checks, benchmarks).

Capture of a bucket happens on its first step: one eager warm-up run on the static buffers (it
compiles the Triton kernels) and the capture, both with every row padded so neither touches
the KV cache; then the step's inputs are copied in and the graph replays. All graphs share one
private memory pool: they replay one at a time on one stream, and each graph's output buffer
stays allocated, so their temporaries may overlap safely.

The forward must make no host synchronisation and no host -> device copy, and must read its
inputs only from the buffers it is given (`CausalLM.supports_cuda_graphs` says when a model's
does); `decode_graphs_for` returns None where graphs cannot run (CPU, streamed experts, ...).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from moestream.cache.kv_cache import PagedKVCache
from moestream.layers.attention import AttentionMetadata
from moestream.models.base import CausalLM

BUCKETS = (1, 2, 4, 8, 16, 32)

# input_ids [B] int64, positions [B] int64, decode metadata -> logits [B, V] float32
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class GraphBackend(Protocol):
    """How a forward becomes replayable: `capture(fn)` returns (replay, output) where `output`
    is the tensor `fn` returned while captured and each `replay()` recomputes it in place from
    the current contents of the buffers `fn` read."""

    def capture(
        self, fn: Callable[[], torch.Tensor]
    ) -> tuple[Callable[[], None], torch.Tensor]: ...


class CudaGraphBackend:
    """`torch.cuda.CUDAGraph` capture into one private memory pool shared by all graphs."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        # Warm up on a side stream (as torch's capture docs ask): kernels compile and the
        # allocator sees the shapes before capture.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a server's) cannot invalidate the capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        return graph.replay, out


class DecodeGraphs:
    """Bucketed replay of a decode forward over static input buffers (module docstring).

    `max_blocks` bounds the block-table columns a sequence can use (its context over the block
    size); wider tables are cut to it, which loses nothing since no sequence is that long.
    """

    def __init__(
        self,
        forward: DecodeForward,
        block_size: int,
        max_blocks: int,
        device: torch.device | str,
        buckets: Sequence[int] = BUCKETS,
        backend: GraphBackend | None = None,
    ):
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be increasing positive sizes, got {buckets}")
        self.forward = forward
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.device = torch.device(device)
        self.buckets = tuple(buckets)
        self.backend = backend if backend is not None else CudaGraphBackend(self.device)
        self._alloc_inputs()
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        # Host block-table rows as last written: (the request's block list, entries written).
        self._rows: list[tuple[list[int] | None, int]] = [(None, 0)] * self.max_batch

    def _alloc_inputs(self) -> None:
        """The static inputs as views of one device buffer, and its host mirror as numpy views.
        The block tables come last: the fields before them are copied whole each step, the
        table rows that changed apart."""
        b, mb = self.max_batch, self.max_blocks
        fields = (
            ("input_ids", torch.int64, (b,)),
            ("positions", torch.int64, (b,)),
            ("slot_mapping", torch.int64, (b,)),
            ("seq_lens", torch.int32, (b,)),
            ("block_tables", torch.int32, (b, mb)),
        )
        sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in fields]
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + -(-size // 16) * 16)  # every field 16-byte aligned
        cuda = self.device.type == "cuda"
        with torch.inference_mode():  # the runner steps in inference mode
            device_bytes = torch.zeros(offsets[-1], dtype=torch.uint8, device=self.device)
            host_bytes = torch.zeros(offsets[-1], dtype=torch.uint8, pin_memory=cuda)
            for (name, dtype, shape), size, at in zip(fields, sizes, offsets, strict=False):
                view = device_bytes[at : at + size].view(dtype).view(shape)
                setattr(self, name, view)
                host = host_bytes[at : at + size].view(dtype).view(shape)
                setattr(self, "_host_" + name, host.numpy())
            self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=self.device)
            self.slot_mapping.fill_(-1)  # no row writes K/V before a step says where
        self._device_bytes, self._host_bytes = device_bytes, host_bytes
        self._table_offset = offsets[-2]
        self._host_slot_mapping.fill(-1)
        # Set after each host -> device copy: the host mirror may be rewritten once it is done.
        self._copied = torch.cuda.Event() if cuda else None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def captured(self) -> tuple[int, ...]:
        """Buckets captured so far, in increasing order."""
        return tuple(sorted(self._graphs))

    def bucket_for(self, num_seqs: int) -> int:
        """The smallest bucket that holds `num_seqs` sequences (ValueError past the largest)."""
        if not 0 < num_seqs <= self.max_batch:
            raise ValueError(f"{num_seqs} sequences: graphs take 1 .. {self.max_batch}")
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    def can_run(self, attn: AttentionMetadata, num_sampled: int) -> bool:
        """Whether a step with this metadata is a pure decode step the graphs can run: one new
        token per sequence, every sequence sampled, at most `max_batch` of them."""
        return attn.is_decode and num_sampled == attn.num_seqs and attn.num_seqs <= self.max_batch

    def _static_attn(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata.for_decode(
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            block_size=self.block_size,
        )

    def _capture(self, bucket: int) -> tuple[Callable[[], None], torch.Tensor]:
        self.slot_mapping[:bucket].fill_(-1)  # warm-up and capture run on padding rows only
        self.seq_lens[:bucket].fill_(0)
        attn = self._static_attn(bucket)
        ids, pos = self.input_ids[:bucket], self.positions[:bucket]
        graph = self.backend.capture(lambda: self.forward(ids, pos, attn))
        self._graphs[bucket] = graph
        return graph

    @torch.inference_mode()
    def run_decode(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        block_ids: Sequence[list[int]],
    ) -> torch.Tensor:
        """Logits [B, V] of one decode step from host data: per sequence its one new token,
        that token's position and the sequence's block table (covering the position). Writes
        the tokens' K/V like the eager forward. One host -> device copy; the result is a view
        of a static buffer, valid until the next run."""
        n = len(token_ids)
        bucket = self.bucket_for(n)
        if bucket not in self._graphs:
            self._capture(bucket)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host mirror
        bs, mb = self.block_size, self.max_blocks
        slots = []
        rows, table = self._rows, self._host_block_tables
        first, last = n, -1  # block-table rows rewritten on the host
        for i, (p, blocks) in enumerate(zip(positions, block_ids, strict=True)):
            slots.append(blocks[p // bs] * bs + p % bs)
            known, written = rows[i]
            width = min(len(blocks), mb)
            if known is not blocks:
                table[i, :width] = blocks[:width]
            elif width > written:
                table[i, written:width] = blocks[written:width]
            else:
                continue
            rows[i] = (blocks, width)
            first, last = min(first, i), i
        self._host_input_ids[:n] = token_ids
        self._host_positions[:n] = positions
        self._host_slot_mapping[:n] = slots
        self._host_slot_mapping[n:bucket] = -1  # padding rows: no KV write, no attention
        self._host_seq_lens[:n] = self._host_positions[:n] + 1
        self._host_seq_lens[n:bucket] = 0
        # Everything but the tables (a few hundred bytes), then the table rows that changed.
        head = self._table_offset
        self._device_bytes[:head].copy_(self._host_bytes[:head], non_blocking=True)
        if last >= first:
            start, end = head + first * mb * 4, head + (last + 1) * mb * 4
            self._device_bytes[start:end].copy_(self._host_bytes[start:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        return self.replay(bucket)[:n]

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [B, V] of one decode step from tensors: input_ids, positions [B] (the one new
        token of each sequence), block_tables [B, nb], seq_lens [B] (context after this token),
        slot_mapping [B]. Writes the tokens' K/V like the eager forward. The result is a view of
        a static buffer, valid until the next run."""
        n = input_ids.shape[0]
        bucket = self.bucket_for(n)
        if bucket not in self._graphs:
            self._capture(bucket)
        self._rows = [(None, 0)] * self.max_batch  # the device tables no longer mirror the host
        width = min(block_tables.shape[1], self.max_blocks)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(block_tables[:, :width], non_blocking=True)
        if n < bucket:  # padding rows: no KV write, no attention (stale ids/positions are valid)
            self.slot_mapping[n:bucket].fill_(-1)
            self.seq_lens[n:bucket].fill_(0)
        return self.replay(bucket)[:n]

    def replay(self, bucket: int) -> torch.Tensor:
        """Replay bucket's graph on whatever its static buffers hold, returning all `bucket`
        rows of logits. The runs call it after copying their inputs in; on its own (the last
        step's inputs: it rewrites the same K/V) it times the graph alone."""
        replay, logits = self._graphs[bucket]
        replay()
        return logits


def decode_graphs_for(
    model: CausalLM,
    kv: PagedKVCache,
    block_size: int,
    buckets: Sequence[int] = BUCKETS,
) -> DecodeGraphs | None:
    """Decode graphs over `model` and its KV pool, or None where the model cannot be captured
    (`CausalLM.supports_cuda_graphs`: not CUDA, no triton, streamed experts, ...). Each graph
    computes the forward and the output head: logits [B, V] float32."""
    if not model.supports_cuda_graphs:
        return None
    context_blocks = -(-model.config.context_length // block_size)
    max_blocks = min(context_blocks, kv.num_blocks)

    def forward(ids: torch.Tensor, pos: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        return model.compute_logits(model.forward(ids, pos, attn, kv))  # [B, V]

    return DecodeGraphs(forward, block_size, max_blocks, model.device, buckets)

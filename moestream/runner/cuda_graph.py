"""Decode and verify steps as CUDA graphs: one graph per (batch bucket, tokens per request),
captured on first use.

Everything that knows about CUDA graphs lives here. A step in which every request feeds its
last sampled token and d_i >= 0 drafted tokens, and is sampled, runs as a graph when it fits:

- Decode (no drafts): B <= max(buckets) sequences run as the graph of the smallest bucket >= B,
  one row per sequence. Rows B .. bucket-1 are padding (slot -1: no KV write; seq_len 0:
  attention reads nothing). Attention is the split-context decode kernel, whose split count is
  fixed at capture: each bucket has two graphs, one for steps whose contexts all fit
  `SHORT_DECODE_CONTEXT` (the least split count) and one for longer contexts (more splits).
- Verify (some drafts): K = the smallest of `verify_tokens` >= max d_i + 1, B <= the largest
  of `verify_buckets`. Each sequence owns K rows, its d_i + 1 real tokens first, then pad rows
  (slot -1, the last real token and position repeated); padding sequences own K pad rows and
  seq_len 0. Static metadata: query_start_loc = arange(0, B*K + 1, K), seq_lens[b] =
  start_b + K (the attention kernel takes a sequence's new tokens to be the last K of its
  seq_lens), max_query_len = K, so `paged_prefill_attention` needs no host list. Real queries
  see only their own causal past (all written by this or earlier steps): the pad rows sit after
  them. The pad rows' own keys may lie past the sequence's blocks: the table has spare columns
  (`table_width`) and every entry is a valid block id (0 or a stale id), and the pool is
  zero-initialised and only ever holds finite K/V, so those reads are in bounds and finite;
  their results are dropped. The real rows' logits come back in the verifier's order (per
  request its last token's row, then one per draft) through a static row index.
The sampler and the verifier stay outside the graphs.

Inputs reach the graphs in one or two copies: the static buffers are typed views of one device
buffer, mirrored by one host buffer (pinned on CUDA). A run writes a step's inputs into the
host mirror with numpy, then copies token ids, positions, slots, row index and lengths (a few
KB) with one non-blocking copy and the block-table rows that changed with a second. A row
changes when another request takes it or its request's table grows by a block (a table only
grows while its request holds its blocks; see `ScheduledRequest.block_ids`), so most steps copy
no table at all. `run` takes tensors instead (checks, benchmarks).

Capture of a graph happens on its first step: one eager warm-up run on the static buffers (it
compiles the Triton kernels) and the capture, both with every row padded so neither touches
the KV cache; then the step's inputs are copied in and the graph replays. All graphs share one
private memory pool: they replay one at a time on one stream, and each graph's output buffer
stays allocated, so their temporaries may overlap safely. Memory: the outputs are float32
logits, rows x vocabulary x 4 bytes per graph; with the default buckets at most 63 decode rows
and 31 * 30 = 930 verify rows (all 26 graphs; a Qwen3 vocabulary of 151,936: ~38 MB and
~565 MB), plus one step's temporaries at the largest graph (256 rows) in the shared pool.

The forward must make no host synchronisation and no host -> device copy, and must read its
inputs only from the buffers it is given (`CausalLM.supports_cuda_graphs` says when a model's
does; runner/piecewise.py cuts a forward with streamed experts into a chain of graphs);
`decode_graphs_for` returns None where graphs cannot run (CPU, ...).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from moestream.cache.kv_cache import PagedKVCache
from moestream.layers.attention import SHORT_DECODE_CONTEXT, AttentionMetadata
from moestream.models.base import CausalLM

BUCKETS = (1, 2, 4, 8, 16, 32)  # decode batch sizes
VERIFY_BUCKETS = (1, 2, 4, 8, 16)  # batch sizes of steps with drafts
VERIFY_TOKENS = (2, 4, 8, 16)  # tokens per request (K) of steps with drafts

# input_ids [N] int64, positions [N] int64, metadata -> logits [N, V] float32 (N = B * K rows)
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class GraphBackend(Protocol):
    """How a forward becomes replayable: `capture(fn)` returns (replay, output) where `output`
    is the tensor `fn` returned while captured and each `replay()` recomputes it in place from
    the current contents of the buffers `fn` read."""

    def capture(
        self, fn: Callable[[], torch.Tensor]
    ) -> tuple[Callable[[], None], torch.Tensor]: ...


class RecomputeBackend:
    """A `GraphBackend` without CUDA: capture runs the forward once and keeps its output
    buffer, replay recomputes into it. The graphs' buffer and bucket logic then runs anywhere
    (the CPU tests use it); `captures` counts the captures."""

    def __init__(self) -> None:
        self.captures = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        self.captures += 1
        out = fn()
        return (lambda: out.copy_(fn())), out


class CudaGraphBackend:
    """`torch.cuda.CUDAGraph` capture into one private memory pool shared by all graphs."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        self.warm_up(fn)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a server's) cannot invalidate the capture.
        with (
            collector_off(),
            torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"),
        ):
            out = fn()
        return graph.replay, out

    def warm_up(self, fn: Callable[[], torch.Tensor]) -> None:
        """Run `fn` once on a side stream (as torch's capture docs ask): kernels compile and the
        allocator sees the shapes before capture. `warming_up()` is true meanwhile (in this
        thread)."""
        current = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(current)
        _capture.warming_up = True
        try:
            with torch.cuda.stream(stream):
                fn()
        finally:
            _capture.warming_up = False
        current.wait_stream(stream)


class _CaptureState(threading.local):
    """What this thread's capture is doing (each engine thread captures its own graphs)."""

    warming_up = False
    phase = "decode"


_capture = _CaptureState()


def warming_up() -> bool:
    """Whether the forward running now is a capture's warm-up on padding rows (not a step):
    counters kept on the device leave it out (`experts.paged`)."""
    return _capture.warming_up


def captured_phase() -> str:
    """The phase ("decode" or "prefill", `experts.counters.phase_of`) of the steps that the
    graph being captured now will run: decode and verify graphs, or a prefill graph's
    (`capturing_phase`). Counters kept on the device pick their row by it."""
    return _capture.phase


@contextlib.contextmanager
def capturing_phase(phase: str) -> Iterator[None]:
    """Graphs captured inside (in this thread) run steps of `phase` (`captured_phase`)."""
    before, _capture.phase = _capture.phase, phase
    try:
        yield
    finally:
        _capture.phase = before


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """No garbage collection inside a capture: collecting an unreachable CUDA graph there
    destroys its executable, a call that invalidates the capture (the driver: "API call
    conflicts with a stream capture sequence", from cuGraphExecDestroy; seen on the H200 when an
    earlier LLM's graphs were collected mid-capture). `torch.cuda.graph` collects on entry;
    other captures collect first themselves."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _check_buckets(name: str, buckets: Sequence[int], least: int) -> tuple[int, ...]:
    if list(buckets) != sorted(set(buckets)) or (buckets and buckets[0] < least):
        raise ValueError(f"{name} must be increasing sizes >= {least}, got {tuple(buckets)}")
    return tuple(buckets)


class DecodeGraphs:
    """Bucketed replay of a forward over static input buffers, for decode steps (one token per
    sequence) and verify steps (K tokens per sequence); see the module docstring.

    `max_blocks` bounds the block-table columns a sequence can use (its context over the block
    size); wider tables are cut to it, which loses nothing since no sequence is that long.
    `verify_buckets` or `verify_tokens` empty: no verify graphs.
    """

    def __init__(
        self,
        forward: DecodeForward,
        block_size: int,
        max_blocks: int,
        device: torch.device | str,
        buckets: Sequence[int] = BUCKETS,
        backend: GraphBackend | None = None,
        verify_buckets: Sequence[int] = VERIFY_BUCKETS,
        verify_tokens: Sequence[int] = VERIFY_TOKENS,
    ):
        if not buckets:
            raise ValueError("buckets must be increasing positive sizes, got ()")
        self.buckets = _check_buckets("buckets", buckets, 1)
        self.verify_buckets = _check_buckets("verify_buckets", verify_buckets, 1)
        self.verify_tokens = _check_buckets("verify_tokens", verify_tokens, 2)
        if not (self.verify_buckets and self.verify_tokens):
            self.verify_buckets, self.verify_tokens = (), ()
        self.forward = forward
        self.block_size = block_size
        self.max_blocks = max_blocks
        # Spare columns: a verify step's pad rows reach K - 1 positions past a full table.
        most = self.max_tokens_per_seq
        self.table_width = max_blocks + -(-(most - 1) // block_size)
        self.device = torch.device(device)
        self.backend = backend if backend is not None else CudaGraphBackend(self.device)
        self._alloc_inputs()
        # (bucket, tokens per sequence, short) -> (replay, static logits [bucket * tokens, V]);
        # short: a decode graph for contexts up to SHORT_DECODE_CONTEXT (the attention kernel's
        # split count is chosen by context class at capture; verify graphs are never short).
        self._graphs: dict[tuple[int, int, bool], tuple[Callable[[], None], torch.Tensor]] = {}
        self._last_short: dict[tuple[int, int], bool] = {}  # the class each graph last ran
        # Host block-table rows as last written: (the request's block list, entries written).
        self._rows: list[tuple[list[int] | None, int]] = [(None, 0)] * self.max_seqs

    @property
    def max_batch(self) -> int:
        """Most sequences of a decode step."""
        return self.buckets[-1]

    @property
    def max_verify_batch(self) -> int:
        """Most sequences of a verify step (0: no verify graphs)."""
        return self.verify_buckets[-1] if self.verify_buckets else 0

    @property
    def max_tokens_per_seq(self) -> int:
        """Most tokens per sequence of any graph (1: decode graphs only)."""
        return self.verify_tokens[-1] if self.verify_tokens else 1

    @property
    def max_seqs(self) -> int:
        return max(self.max_batch, self.max_verify_batch)

    @property
    def max_rows(self) -> int:
        return max(self.max_batch, self.max_verify_batch * self.max_tokens_per_seq)

    def _alloc_inputs(self) -> None:
        """The static inputs as views of one device buffer, and its host mirror as numpy views.
        The block tables come last: the fields before them are copied whole each step, the
        table rows that changed apart."""
        rows, seqs, width = self.max_rows, self.max_seqs, self.table_width
        fields = (
            ("input_ids", torch.int64, (rows,)),
            ("positions", torch.int64, (rows,)),
            ("slot_mapping", torch.int64, (rows,)),
            ("sample_rows", torch.int64, (rows,)),  # verify: real rows in the verifier's order
            ("seq_lens", torch.int32, (seqs,)),
            ("block_tables", torch.int32, (seqs, width)),
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
            # query_start_loc per tokens per sequence: static, never copied.
            self._query_start_loc = {
                k: torch.arange(0, n * k + 1, k, dtype=torch.int32, device=self.device)
                for k, n in [(1, self.max_batch)]
                + [(k, self.max_verify_batch) for k in self.verify_tokens]
            }
            self.slot_mapping.fill_(-1)  # no row writes K/V before a step says where
        self.query_start_loc = self._query_start_loc[1]
        self._device_bytes, self._host_bytes = device_bytes, host_bytes
        self._table_offset = offsets[-2]
        self._host_slot_mapping.fill(-1)
        # Set after each host -> device copy: the host mirror may be rewritten once it is done.
        self._copied = torch.cuda.Event() if cuda else None

    def drop(self) -> None:
        """Forget every captured graph (the next steps capture anew): for a change that the
        graphs hold as nodes, such as `HostCompute.set_poll`. The caller has synchronised."""
        self._graphs.clear()
        self._last_short.clear()

    @property
    def captured(self) -> tuple[int, ...]:
        """Decode buckets captured so far, in increasing order."""
        return tuple(sorted({b for b, k, _ in self._graphs if k == 1}))

    @property
    def num_captured(self) -> int:
        """Graphs captured so far, decode and verify."""
        return len(self._graphs)

    @property
    def captured_decode(self) -> tuple[tuple[int, bool], ...]:
        """(bucket, short context) of the decode graphs captured so far, sorted."""
        return tuple(sorted((b, short) for b, k, short in self._graphs if k == 1))

    @property
    def captured_verify(self) -> tuple[tuple[int, int], ...]:
        """(bucket, tokens per sequence) of the verify graphs captured so far, sorted."""
        return tuple(sorted((b, k) for b, k, _ in self._graphs if k > 1))

    def bucket_for(self, num_seqs: int) -> int:
        """The smallest decode bucket that holds `num_seqs` sequences (ValueError past the
        largest)."""
        if not 0 < num_seqs <= self.max_batch:
            raise ValueError(f"{num_seqs} sequences: graphs take 1 .. {self.max_batch}")
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    def graph_for(self, num_seqs: int, tokens: int) -> tuple[int, int] | None:
        """(bucket, tokens per sequence) of the graph that runs a step of `num_seqs` sequences
        feeding at most `tokens` tokens each (1: a decode step), or None when none fits."""
        if tokens == 1:
            return (self.bucket_for(num_seqs), 1) if 0 < num_seqs <= self.max_batch else None
        if not (0 < num_seqs <= self.max_verify_batch and 1 < tokens <= self.max_tokens_per_seq):
            return None
        b = self.verify_buckets[bisect.bisect_left(self.verify_buckets, num_seqs)]
        return b, self.verify_tokens[bisect.bisect_left(self.verify_tokens, tokens)]

    def can_run(self, attn: AttentionMetadata, num_sampled: int) -> bool:
        """Whether a step with this metadata is a pure decode step the decode graphs can run:
        one new token per sequence, every sequence sampled, at most `max_batch` of them."""
        return attn.is_decode and num_sampled == attn.num_seqs and attn.num_seqs <= self.max_batch

    def _static_attn(self, bucket: int, k: int, short: bool = False) -> AttentionMetadata:
        args = dict(
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            slot_mapping=self.slot_mapping[: bucket * k],
            query_start_loc=self._query_start_loc[k][: bucket + 1],
            block_size=self.block_size,
        )
        if k == 1:
            bound = SHORT_DECODE_CONTEXT if short else None
            return AttentionMetadata.for_decode(**args, max_seq_len=bound)
        return AttentionMetadata.for_verify(**args, tokens_per_seq=k)

    def _capture(
        self, bucket: int, k: int = 1, short: bool = False
    ) -> tuple[Callable[[], None], torch.Tensor]:
        rows = bucket * k
        self.slot_mapping[:rows].fill_(-1)  # warm-up and capture run on padding rows only
        self.seq_lens[:bucket].fill_(0)
        attn = self._static_attn(bucket, k, short)
        ids, pos = self.input_ids[:rows], self.positions[:rows]
        graph = self.backend.capture(lambda: self.forward(ids, pos, attn))
        self._graphs[bucket, k, short] = graph
        return graph

    # ---- steps from host data ------------------------------------------------------------
    def _stage_tables(self, block_ids: Sequence[list[int]]) -> tuple[int, int]:
        """Write the block-table rows that changed into the host mirror: (first, last) row
        rewritten (last < first: none)."""
        mb = self.max_blocks
        rows, table = self._rows, self._host_block_tables
        first, last = len(block_ids), -1
        for i, blocks in enumerate(block_ids):
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
        return first, last

    def _send(self, first: int, last: int) -> None:
        """Copy the host mirror to the device: everything but the tables (a few KB), then the
        table rows first .. last."""
        head = self._table_offset
        self._device_bytes[:head].copy_(self._host_bytes[:head], non_blocking=True)
        if last >= first:
            row = self.table_width * 4
            start, end = head + first * row, head + (last + 1) * row
            self._device_bytes[start:end].copy_(self._host_bytes[start:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))

    def _prepare(self, bucket: int, k: int, short: bool = False) -> None:
        """Capture the graph if new; wait until the host mirror may be rewritten."""
        if (bucket, k, short) not in self._graphs:
            self._capture(bucket, k, short)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host mirror

    @torch.inference_mode()
    def run_decode(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        positions: Sequence[int],
        block_ids: Sequence[list[int]],
    ) -> torch.Tensor:
        """Logits [B, V] of one decode step from host data: per sequence its one new token,
        that token's position and the sequence's block table (covering the position). Writes
        the tokens' K/V like the eager forward. One host -> device copy; the result is a view
        of a static buffer, valid until the next run.

        `token_ids` may be a tensor [B] int64 on the graphs' device instead (a step launched
        before the host has read the tokens it feeds: `ModelRunner`'s run-ahead); it is copied
        into the static input after the host data, on the same stream."""
        n = len(positions)
        on_device = isinstance(token_ids, torch.Tensor)
        bucket = self.bucket_for(n)
        short = max(positions) < SHORT_DECODE_CONTEXT  # every context <= the bound
        self._prepare(bucket, 1, short)
        bs = self.block_size
        slots = [b[p // bs] * bs + p % bs for p, b in zip(positions, block_ids, strict=True)]
        first, last = self._stage_tables(block_ids)
        if not on_device:
            self._host_input_ids[:n] = token_ids
        self._host_positions[:n] = positions
        self._host_slot_mapping[:n] = slots
        self._host_slot_mapping[n:bucket] = -1  # padding rows: no KV write, no attention
        self._host_seq_lens[:n] = self._host_positions[:n] + 1
        self._host_seq_lens[n:bucket] = 0
        self._send(first, last)
        if on_device:
            self.input_ids[:n].copy_(token_ids, non_blocking=True)  # after the host copy
        return self.replay(bucket, 1, short)[:n]

    @torch.inference_mode()
    def run_verify(
        self,
        token_ids: Sequence[int],
        draft_token_ids: Sequence[Sequence[int]],
        positions: Sequence[int],
        block_ids: Sequence[list[int]],
    ) -> torch.Tensor:
        """Logits [R, V] of one verify step from host data: per sequence its last sampled
        token at `positions[i]`, then its drafts at the positions after it, and its block
        table (covering them all). R = sum of (drafts + 1): per sequence its token's row, then
        one per draft, as `ModelRunner.verify` takes them. Writes the K/V of every fed token
        like the eager forward. ValueError when no verify graph fits the step."""
        n = len(token_ids)
        key = self.graph_for(n, max(len(d) for d in draft_token_ids) + 1)
        if key is None or key[1] == 1:
            raise ValueError(f"no verify graph for {n} sequences with drafts {draft_token_ids}")
        bucket, k = key
        self._prepare(bucket, k, False)
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        seq_lens: list[int] = []
        for i, (t, drafts, start, blocks) in enumerate(
            zip(token_ids, draft_token_ids, positions, block_ids, strict=True)
        ):
            pad = k - 1 - len(drafts)
            end = start + len(drafts) + 1  # real tokens at start .. end - 1
            ids.append(t)
            ids += drafts
            ids += [ids[-1]] * pad  # pad rows repeat the last real token and position
            pos += range(start, end)
            pos += [end - 1] * pad
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            slots += [-1] * pad
            rows += range(i * k, i * k + k - pad)
            seq_lens.append(start + k)  # the new tokens are the last k of seq_lens
        first, last = self._stage_tables(block_ids)
        used = n * k
        self._host_input_ids[:used] = ids
        self._host_positions[:used] = pos
        self._host_slot_mapping[:used] = slots
        self._host_slot_mapping[used : bucket * k] = -1  # padding sequences: no KV write
        self._host_sample_rows[: len(rows)] = rows
        self._host_seq_lens[:n] = seq_lens
        self._host_seq_lens[n:bucket] = 0  # padding sequences: no attention
        self._send(first, last)
        logits = self.replay(bucket, k, False)  # [bucket * k, V]
        return logits.index_select(0, self.sample_rows[: len(rows)])  # [R, V]

    # ---- steps from tensors --------------------------------------------------------------
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
        if (bucket, 1, False) not in self._graphs:
            self._capture(bucket)
        self._rows = [(None, 0)] * self.max_seqs  # the device tables no longer mirror the host
        width = min(block_tables.shape[1], self.max_blocks)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(block_tables[:, :width], non_blocking=True)
        if n < bucket:  # padding rows: no KV write, no attention (stale ids/positions are valid)
            self.slot_mapping[n:bucket].fill_(-1)
            self.seq_lens[n:bucket].fill_(0)
        return self.replay(bucket, 1, False)[:n]

    def replay(self, bucket: int, tokens: int = 1, short: bool | None = None) -> torch.Tensor:
        """Replay the graph of (bucket, tokens per sequence, context class) on whatever its
        static buffers hold, returning all bucket * tokens rows of logits. The runs call it
        after copying their inputs in; on its own (the last step's inputs: it rewrites the same
        K/V) it times the graph alone, of the class that last ran when `short` is None."""
        if short is None:
            short = self._last_short.get((bucket, tokens), False)
        self._last_short[bucket, tokens] = short
        replay, logits = self._graphs[bucket, tokens, short]
        replay()
        return logits


def buckets_up_to(buckets: Sequence[int], most: int) -> list[int]:
    """The batch buckets a chain of graphs may take when its layers take at most `most` tokens
    (`CausalLM.piecewise_graph_tokens`; `moestream info`'s placement says the same)."""
    return [b for b in buckets if b <= most]


def decode_graphs_for(
    model: CausalLM,
    kv: PagedKVCache,
    block_size: int,
    buckets: Sequence[int] = BUCKETS,
    verify_buckets: Sequence[int] = VERIFY_BUCKETS,
    verify_tokens: Sequence[int] = VERIFY_TOKENS,
) -> DecodeGraphs | None:
    """Decode and verify graphs over `model` and its KV pool, or None where the model cannot
    be captured (`CausalLM.supports_cuda_graphs`: not CUDA, no triton, ...; with streamed
    experts, decode graphs in pieces, `CausalLM.piecewise_graph_tokens`).
    Each graph computes the forward and the output head: logits [B * K, V] float32."""
    backend: GraphBackend | None = None
    if not model.supports_cuda_graphs:
        # Streamed experts: a chain of graphs cut where each streamed layer reads its routing
        # (runner/piecewise.py), at the batch sizes whose routed experts fit every layer's
        # slots; no verify graphs (drafted steps run eagerly).
        buckets = buckets_up_to(buckets, model.piecewise_graph_tokens)
        if not buckets:
            return None
        from moestream.runner.piecewise import PiecewiseCudaGraphBackend

        backend = PiecewiseCudaGraphBackend(model.device)
        verify_buckets = verify_tokens = ()
    context_blocks = -(-model.config.context_length // block_size)
    max_blocks = min(context_blocks, kv.num_blocks)

    def forward(ids: torch.Tensor, pos: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        return model.compute_logits(model.forward(ids, pos, attn, kv))  # [B * K, V]

    return DecodeGraphs(
        forward,
        block_size,
        max_blocks,
        model.device,
        buckets,
        backend=backend,
        verify_buckets=verify_buckets,
        verify_tokens=verify_tokens,
    )

"""Decode graphs cut at host points: CUDA graphs for a forward that must read something on the
host part way through (streamed experts: each streamed MoE layer reads its routing to load the
experts it names).

Without graphs such a step runs eagerly, and on the H200 an eager decode step of the 30B costs
~46 ms of Python and launches where its graph replays in ~2 ms (bench/RESULTS.md, nineteenth
session): with the experts streamed, the host, not the copies, was the bottleneck. Here the
forward is captured as a chain of graphs, one piece from one host point to the next. A layer
that needs the host calls `cut(before, after)` while it is being captured (`active()` returns
the cutter then, None otherwise): the piece captured so far ends; at replay `before()` runs once
that piece is queued (it may synchronise: it reads what the piece copied to pinned host memory
and prepares what the next piece reads, e.g. loads experts and updates a slot table on the
device), then the next piece replays, then `after()` (e.g. unpins what the piece's kernels
read: their work is queued, and later loads order their copies after it).

Every piece is captured into the backend's one memory pool, in order, and replays in that
order, so the tensors one piece leaves for the next (the hidden state, the routing) keep their
addresses, as in torch's own chains of graphs (`torch.cuda.make_graphed_callables`). The
kernels and their launch shapes are those of the eager forward on the same inputs, so the
logits are the same bits (tests/runner/test_piecewise.py, on a GPU).
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

from moestream.runner.cuda_graph import CudaGraphBackend, collector_off

Hook = Callable[[], None]

_active: Cutter | None = None


class Cutter:
    """Collects the pieces of one capture: graphs g_0 .. g_n and the host hooks between them."""

    def __init__(self, pool: tuple[int, int]):
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.hooks: list[tuple[Hook, Hook]] = []

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (the expert store's copies, a server's)
        # cannot invalidate the capture.
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self.graphs.append(graph)

    def cut(self, before: Hook, after: Hook) -> None:
        """End the piece being captured and start the next; `before` and `after` run around
        the next piece at replay (module doc)."""
        self.graphs[-1].capture_end()
        self.hooks.append((before, after))
        self.begin()

    def finish(self) -> None:
        self.graphs[-1].capture_end()

    def replay(self) -> None:
        self.graphs[0].replay()
        for (before, after), graph in zip(self.hooks, self.graphs[1:], strict=True):
            before()
            graph.replay()
            after()


def active() -> Cutter | None:
    """The cutter of the capture in progress on this thread's current stream, if any."""
    if _active is not None and torch.cuda.is_current_stream_capturing():
        return _active
    return None


class PiecewiseCudaGraphBackend(CudaGraphBackend):
    """A `GraphBackend` whose capture may be cut at host points (module doc)."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        global _active
        self.warm_up(fn)  # also runs the host points for real once
        current = torch.cuda.current_stream(self.device)
        torch.cuda.synchronize(self.device)
        gc.collect()  # before the collector is off (as torch.cuda.graph does on entry)
        cutter = Cutter(self.pool)
        capture_stream = torch.cuda.Stream(self.device)
        capture_stream.wait_stream(current)
        _active = cutter
        try:
            with collector_off(), torch.cuda.stream(capture_stream):
                cutter.begin()
                try:
                    out = fn()
                finally:
                    if torch.cuda.is_current_stream_capturing():
                        cutter.finish()
        finally:
            _active = None
        current.wait_stream(capture_stream)
        return cutter.replay, out

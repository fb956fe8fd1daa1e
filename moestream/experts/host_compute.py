"""Experts computed by the host's cores: the part of zero-copy placement's host tier that the CPU
computes instead of the GPU reading it across the host link.

Under zero-copy placement (`experts.zero_copy`) an expert in pinned host memory costs its bytes
over the host link on every use: ~50 GB/s on the H200's PCIe 5.0 link, which caps the 30B's
decode near 85 tok/s with half its experts there. The host's cores read that memory at their
own bandwidth, so splitting the host-placed experts between the link and the cores adds the two.
`ZeroCopyExperts(n_cpu=...)` marks its first `n_cpu` host slots "computed by the host" (the
marks move with the experts when promotion swaps them); every "mmvq" launch of the layer then
takes a `LayerHostWork` (`kernels.moe_mmvq.HostWork`):

1. `begin`, after x's q8 rounding is queued: the routing (ids, weights) and the q8 activations
   are copied into pinned buffers on the current stream and an event is recorded. The GPU goes
   on with the gate/up of the experts it reads (device slots and the link).
2. `rows`, after the gate/up launch is queued: the host waits for the event (the layer's one
   host synchronisation), computes every assignment whose expert is marked with
   `native.moe_host_rows` (the kernels' operation order: the GPU's bits), writes the rows into a
   pinned buffer and queues their copy to the device; the down kernel, queued next, adds each
   where it would have added the expert's own sums.

So the output of a token does not depend on which experts the host computed (bit for bit;
`tests/experts/test_host_compute.py`), and a step with host work makes one host synchronisation
per MoE layer (no CUDA graph). Buffers are shared by the layers: a layer's `begin` is queued
after the previous layer's row copy, and its `rows` waits for the event behind both, so no
buffer is reused while a copy may still read it (one stream). Off CUDA (tests under the Triton
interpreter) the copies are plain copies and there is no event.

Counters (`HostCompute.counters`): assignments computed, their expert bytes, the time the host
waited for the GPU and the time it computed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from moestream import native
from moestream.kernels.mmvq import Q8Act


def default_threads() -> int:
    """Threads for the host experts: the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class HostCompute:
    """What the layers' host work shares: pinned buffers, threads, counters."""

    def __init__(self, device: torch.device, threads: int | None = None):
        if threads is not None and threads < 1:
            raise ValueError(f"host expert threads must be >= 1, got {threads}")
        native.library()  # build (or fail with NativeUnavailable) now, not in the first step
        self.device = device
        self.threads = threads or default_threads()
        self._cuda = device.type == "cuda"
        self._event = torch.cuda.Event() if self._cuda else None
        self._buffers: dict[str, torch.Tensor] = {}
        self.counters = {"assignments": 0, "bytes": 0, "wait_s": 0.0, "compute_s": 0.0}

    def buffer(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer (pinned on CUDA) of `shape`, grown as needed and reused."""
        n = int(np.prod(shape))
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf = torch.empty(max(n, 1), dtype=dtype, pin_memory=self._cuda)
            self._buffers[name] = buf
        return buf[:n].view(*shape)

    def record(self) -> None:
        if self._event is not None:
            self._event.record()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


class LayerHostWork:
    """One layer's `HostWork` (module docstring). `experts(e)` gives expert e's host arrays
    (gate, up, down as uint8 rows in the file's layout, down is Q6_K) for the experts that
    `marked` says the host computes; `up_groups`/`down_groups` the launch's groups per step."""

    def __init__(self, compute: HostCompute, provider: object, up_groups: int, down_groups: int):
        self.compute = compute
        self.provider = provider
        self.up_groups = up_groups
        self.down_groups = down_groups
        self._pending: tuple[torch.Tensor, ...] | None = None

    def begin(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor, xa: Q8Act) -> None:
        c = self.compute
        t, k = topk_ids.shape
        ids = c.buffer("ids", (t, k), topk_ids.dtype)
        weights = c.buffer("weights", (t, k), torch.float32)
        xq = c.buffer("xq", tuple(xa.q.shape), xa.q.dtype)
        xd = c.buffer("xd", tuple(xa.d.shape), xa.d.dtype)
        xs = c.buffer("xs", tuple(xa.s.shape), xa.s.dtype)
        for dst, src in ((ids, topk_ids), (weights, topk_weights), (xq, xa.q), (xd, xa.d),
                         (xs, xa.s)):  # fmt: skip
            dst.copy_(src, non_blocking=True)
        c.record()
        self._pending = (ids, weights, xq, xd, xs)

    def rows(self) -> torch.Tensor:
        if self._pending is None:
            raise RuntimeError("LayerHostWork.rows before begin")
        ids, weights, xq, xd, xs = self._pending
        self._pending = None
        c = self.compute
        t0 = time.perf_counter()
        c.wait()
        t1 = time.perf_counter()
        k = ids.shape[1]
        h = xq.shape[1] * 4
        flat = ids.numpy().reshape(-1)
        marked = self.provider.host_marked  # type: ignore[attr-defined]  # numpy bool [E]
        sel = np.flatnonzero(marked[flat])
        out = torch.empty((flat.size, h), dtype=torch.float32, device=c.device)
        if sel.size:
            experts = [self.provider.host_arrays(int(e)) for e in flat[sel]]  # type: ignore[attr-defined]
            rows = native.moe_host_rows(
                experts, (sel // k).tolist(), weights.numpy().reshape(-1)[sel].tolist(),
                xq.numpy().view(np.int8), xd.numpy(), xs.numpy(), self.up_groups,
                self.down_groups, c.threads,
            )  # fmt: skip
            staged = c.buffer("rows", (flat.size, h), torch.float32)
            staged.numpy()[sel] = rows
            out.copy_(staged, non_blocking=True)
            c.counters["assignments"] += int(sel.size)
            c.counters["bytes"] += int(sel.size) * self.provider.expert_bytes  # type: ignore[attr-defined]
        c.counters["wait_s"] += t1 - t0
        c.counters["compute_s"] += time.perf_counter() - t1
        return out

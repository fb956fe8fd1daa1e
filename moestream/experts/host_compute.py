"""Experts computed by the host's cores: the part of zero-copy placement's host tier that the CPU
computes instead of the GPU reading it across the host link.

Under zero-copy placement (`experts.zero_copy`) an expert in pinned host memory costs its bytes
over the host link on every use: ~50 GB/s on the H200's PCIe 5.0 link, which caps the 30B's
decode near 85 tok/s with half its experts there. The host's cores read that memory at their
own bandwidth, so splitting the host-placed experts between the link and the cores adds the two.
`ZeroCopyExperts(n_cpu=...)` marks its first `n_cpu` host slots "computed by the host" (the
marks move with the experts when promotion swaps them); every "mmvq" launch of the layer then
takes a `LayerHostWork` (`kernels.moe_mmvq.HostWork`):

1. `begin`, after x's q8 rounding is queued: one kernel on the current stream stores the
   routing (ids, weights) and the q8 activations into pinned buffers (`_pack_kernel`); a side
   stream waits for it and runs `experts.c`'s `host_layer` as a CUDA host function
   (`cuLaunchHostFunc`): it computes every assignment whose expert is marked
   (`native.moe_host_rows`, the kernels' operation order: the GPU's bits) into a pinned
   buffer, which the side stream then copies to the device. Meanwhile the current stream runs
   the gate/up and down of the experts the GPU reads, the down kernel storing each expert's
   sums apart. (The inputs went by copies on the side stream until the sixteenth session;
   there they waited behind the gate/up's reads of host memory, so the host started when the
   GPU's experts were done: bench/RESULTS.md.)
2. `rows`, after the down launch is queued: the current stream waits for the side stream; a
   last kernel, queued next, adds each token's expert sums in order, the host's rows in place
   of its experts' (`moe_mmvq._add_rows_kernel`).

No Python runs per layer on the host's side, and the host never waits for the GPU: a step stays
one CUDA graph (the host functions and copies are nodes of it), and the GPU waits for the host
only where the host's experts take longer than its own gate/up and down. The output of a token
does not depend on which experts the host computed (bit for bit;
`tests/experts/test_host_compute.py`). Buffers are allocated once at the largest launch (graphs
hold their addresses) and shared by the layers: a layer's copies are queued after the previous
layer's last kernel, which waited for the previous host function and row copy. Off CUDA (tests
under the Triton interpreter) `rows` calls `host_layer` directly.

Counters (`HostCompute.counters`): host-function calls, assignments computed, their expert bytes
and the time the host spent on them; in poll mode also the poller's failures that `check` has
not yet raised (reported, not cleared).

Poll mode (the default on CUDA; `MOESTREAM_HOST_POLL=0` or `HostCompute(poll=False)` turns it
off): instead of a CUDA host function, whose dispatch and return cost ~70-100 us a layer on the
H200 (bench/RESULTS.md, fifteenth session), the pack kernel ends by posting the layer's job with
one 8-byte store into mapped pinned memory (go = seq << 16 | job, seq from a device counter, so
graph replays post new numbers), and in `rows` a one-thread kernel on the current stream waits
for the host's done = seq (`_wait_kernel`) before the rows' copy: no side stream. A thread of
`experts.c` (`host_poller`) spins on go for `POLL_SPIN_US` after each job, then polls every 20
us (every millisecond once idle for a second), and runs the job's `host_layer`. Its errors (a
job naming no table entry) and the wait's timeouts (no answer in `WAIT_POLLS` reads) fail the
step that read those rows (`check`, called after every step: `ModelRunner.checks`).
"""

from __future__ import annotations

import ctypes
import os
import weakref
from typing import Any

import torch
import triton
import triton.language as tl

from moestream import native
from moestream.kernels.mmvq import Q8Act

# The largest launch (`kernels.moe.MMVQ_MAX_ASSIGNMENTS`: `ops.moe_forward_addr` runs larger
# batches in chunks of at most this many assignments).
MAX_ASSIGNMENTS = 256
# Poll mode (module docstring): jobs in the poller's table (a layer's launch shapes: up to
# MAX_ASSIGNMENTS / k token counts a layer, 64 x 94 layers for a top-4 model of 94; the post's
# 16-bit job field holds them all), the poller's spin after a job, the wait kernel's reads of
# done before it gives up.
POLL_JOBS = 1 << 16
POLL_SPIN_US = 2000
WAIT_POLLS = 1 << 23


@triton.jit
def _copy_to(src, dst_addr, n, DT: tl.constexpr, BLOCK: tl.constexpr):
    """dst[:n] = src[:n] as DT, dst a host address (mapped pinned memory)."""
    dst = dst_addr.to(tl.pointer_type(DT))
    i = 0
    while i < n:  # not `range(0, n, BLOCK)`: Triton 3.6's interpreter cannot index by n
        o = i + tl.arange(0, BLOCK)
        tl.store(dst + o, tl.load(src + o, mask=o < n).to(DT), mask=o < n)
        i += BLOCK


@triton.jit
def _pack_kernel(ids_ptr, w_ptr, xq_ptr, xd_ptr, xs_ptr, ids_addr, w_addr, xq_addr, xd_addr,
                 xs_addr, a, nq, nd, seq_ptr, flags_addr, job, POST: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    """A layer's host inputs (the routing ids and weights of `a` assignments, the q8
    activations: `nq` words, `nd` scales and as many sums) stored into their pinned buffers by
    one program; with POST, then go = seq << 16 | job: after every store a barrier, then a
    release at system scope, so that the poller which sees go sees the inputs."""
    _copy_to(ids_ptr, ids_addr, a, tl.int64, BLOCK)
    _copy_to(w_ptr, w_addr, a, tl.float32, BLOCK)
    _copy_to(xq_ptr, xq_addr, nq, tl.int32, BLOCK)
    _copy_to(xd_ptr, xd_addr, nd, tl.float32, BLOCK)
    _copy_to(xs_ptr, xs_addr, nd, tl.float32, BLOCK)
    if POST:
        tl.debug_barrier()
        s = tl.atomic_add(seq_ptr, 1) + 1
        flags = flags_addr.to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(flags, (s << 16) | job, sem="release", scope="sys")


@triton.jit
def _wait_kernel(seq_ptr, flags_addr, limit):
    """Until done >= seq, or `limit` reads (then timeouts += 1)."""
    s = tl.load(seq_ptr)
    flags = flags_addr.to(tl.pointer_type(tl.int64))
    done = tl.load(flags + 1, volatile=True)
    n = 0
    while (done < s) & (n < limit):
        done = tl.load(flags + 1, volatile=True)
        n += 1
    if done < s:
        tl.atomic_add(flags + 3, 1)


def default_threads() -> int:
    """Threads for the host experts: one fewer than the cores this process may run on, where
    it may run on 8 or more (the step's thread and the driver's threads need a core: on the
    H200's 16-core host, 15 threads against 16 at batch 1 gave 71.7 against 58.8 tok/s with
    half the 30B's experts on the device, 49.8 against 42.6 with a quarter, 50.9 against 52.0
    with a tenth; and a team of 16 beside one busy process took 15.9 ms a call where 15 took
    0.23: bench/RESULTS.md, seventeenth session); all of them below 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    return cores - 1 if cores >= 8 else cores


def _cu_launch_host_func() -> Any:
    """The CUDA driver's cuLaunchHostFunc(stream, fn, user_data) -> CUresult."""
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def _halt(poller: native.HostPoller, *memory: object) -> None:
    """Stop the poller thread; `memory` (what it reads) lives until then."""
    poller.halt()


class HostCompute:
    """What the layers' host work shares: the buffers, the side stream, threads, the layers."""

    def __init__(self, device: torch.device, threads: int | None = None, poll: bool | None = None):
        if threads is not None and threads < 1:
            raise ValueError(f"host expert threads must be >= 1, got {threads}")
        native.library()  # build (or fail with NativeUnavailable) now, not in the first step
        self.device = device
        self.threads = threads or default_threads()
        self._cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self._cuda else None
        self._launch = _cu_launch_host_func() if self._cuda else None
        self._fn = native.host_layer_fn()
        self._buffers: dict[str, torch.Tensor] = {}
        self.layers: list[LayerHostWork] = []
        if poll is None:  # the default on CUDA (bench/RESULTS.md, sixteenth session)
            poll = self._cuda and os.environ.get("MOESTREAM_HOST_POLL", "1") != "0"
        self.poll = False
        self._poller: native.HostPoller | None = None
        self.set_poll(poll)

    def set_poll(self, poll: bool) -> None:
        """Poll mode on or off (the poller thread starts at the first "on"). Captured graphs
        hold the mode's nodes: the caller has synchronised the device and drops them
        (`DecodeGraphs.drop`); benchmarks put both modes side by side in one process."""
        if poll and self._poller is None:
            # go, done, errors, timeouts: mapped pinned memory the kernels reach by address
            self._flags = torch.zeros(4, dtype=torch.int64, pin_memory=self._cuda)
            self._flags_np = self._flags.numpy()  # the same memory, read without torch
            self._seq = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._table = (ctypes.c_void_p * POLL_JOBS)()
            self._jobs = 0
            self._poller = native.HostPoller(
                flags=self._flags.data_ptr(), table=ctypes.addressof(self._table), n=POLL_JOBS,
                spin_ns=POLL_SPIN_US * 1000, sleep_ns=20_000,
            )  # fmt: skip
            self._poller.start()
            # the thread stops before the memory it reads goes
            weakref.finalize(self, _halt, self._poller, self._flags, self._table)
        self.poll = poll

    def post(self, args: native.HostLayerArgs) -> int:
        """Poll mode: the poller's job number of `args` (kept alive by its layer)."""
        if self._jobs >= POLL_JOBS:
            raise RuntimeError(f"the host poller takes at most {POLL_JOBS} launch shapes")
        self._table[self._jobs] = ctypes.addressof(args)
        self._jobs += 1
        return self._jobs - 1

    def post_and_wait(self, job: int) -> None:
        """Poll mode, on the current stream: post `job` with no inputs (the pack kernel storing
        nothing), wait for the host's answer."""
        seq, flags = self._seq, self._flags.data_ptr()  # any valid addresses: none is stored
        _pack_kernel[(1,)](
            seq, seq, seq, seq, seq, flags, flags, flags, flags, flags, 0, 0, 0, seq, flags, job,
            POST=True, BLOCK=1024, num_warps=4,
        )  # fmt: skip
        self.wait()

    def wait(self) -> None:
        """Poll mode, on the current stream: wait for the answer to the last post."""
        _wait_kernel[(1,)](self._seq, self._flags.data_ptr(), WAIT_POLLS, num_warps=1)

    def pack(self, b: dict[str, torch.Tensor], ids: torch.Tensor, weights: torch.Tensor,
             xa: Q8Act, job: int | None) -> None:  # fmt: skip
        """On the current stream, one kernel: the routing and q8 activations into the pinned
        buffers `b`, then (poll mode) the post of `job`. Queued before the layer's gate/up:
        the host starts while the GPU runs its own experts (copies on a side stream waited
        behind the gate/up's reads of host memory, bench/RESULTS.md, sixteenth session)."""
        q, d, s = (v.contiguous() for v in (xa.q, xa.d, xa.s))
        post = job is not None
        _pack_kernel[(1,)](
            ids.contiguous(), weights.contiguous(), q, d, s, b["ids"].data_ptr(),
            b["weights"].data_ptr(), b["xq"].data_ptr(), b["xd"].data_ptr(), b["xs"].data_ptr(),
            ids.numel(), q.numel(), d.numel(), self._seq if post else ids,
            self._flags.data_ptr() if post else 0, job or 0, POST=post, BLOCK=1024, num_warps=4,
        )  # fmt: skip

    def buffers(self, h: int) -> dict[str, torch.Tensor]:
        """The launch buffers for hidden size h, allocated once at the largest launch."""
        if not self._buffers:
            a, pin = MAX_ASSIGNMENTS, self._cuda

            def host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
                return torch.empty(shape, dtype=dtype, pin_memory=pin)

            self._buffers = {
                "ids": host((a,), torch.int64),
                "weights": host((a,), torch.float32),
                "xq": host((a, h // 4), torch.int32),  # up to a tokens (k = 1)
                "xd": host((a, h // 32), torch.float32),
                "xs": host((a, h // 32), torch.float32),
                "rows": host((a, h), torch.float32),
            }
            if self._cuda:
                self._buffers["rows_dev"] = torch.empty((a, h), device=self.device)
        if self._buffers["rows"].shape[1] != h:
            raise ValueError("host experts of one model share one hidden size")
        return self._buffers

    def launch(self, args: native.HostLayerArgs) -> None:
        """Queue `host_layer(args)` on the side stream (CUDA), or run it now (CPU)."""
        if self._launch is None:
            native.library().host_layer(ctypes.byref(args))
            return
        rc = self._launch(self.stream.cuda_stream, self._fn, ctypes.addressof(args))
        if rc != 0:
            raise RuntimeError(f"cuLaunchHostFunc failed (CUresult {rc})")

    def set_threads(self, threads: int) -> None:
        """Threads for later host functions (every layer's launch arguments; graphs keep their
        addresses). The caller has synchronised the device, as for `set_cpu_slots`."""
        if threads < 1:
            raise ValueError(f"host expert threads must be >= 1, got {threads}")
        self.threads = threads
        for layer in self.layers:
            for args in layer.launch_args():
                args.threads = threads

    def check(self) -> None:
        """Raise if the poller answered a post that named no job or a wait gave up since the
        last check (the rows of that step are not the host's): called after every step's
        results are read (`ModelRunner.checks`), so that the step fails instead of
        returning them. The counts are cleared: later steps run again."""
        if self._poller is None:
            return
        bad, late = self._poll_failures()
        if bad or late:
            self._flags_np[2:4] = 0
            raise RuntimeError(
                f"the host experts' poller failed: {bad} posts named no job, {late} waits "
                f"for the host's rows timed out"
            )

    def _poll_failures(self) -> tuple[int, int]:
        """Posts that named no job, waits that timed out: counted since the last `check`."""
        return int(self._flags_np[2]), int(self._flags_np[3])

    @property
    def counters(self) -> dict[str, float]:
        """Host-function calls, assignments computed, their expert bytes, seconds spent, and
        the poller's failures not yet raised by `check` (read, never cleared here: a metrics
        read between a failed wait and its step's check must not take the failure away)."""
        out = {"calls": 0, "assignments": 0, "bytes": 0, "compute_s": 0.0}
        if self._poller is not None:
            out["poll_bad_posts"], out["poll_timeouts"] = self._poll_failures()
        for layer in self.layers:
            for args in layer.launch_args():
                if args.status:
                    raise RuntimeError("a host expert computation failed (bad shapes)")
                out["calls"] += args.calls
                out["assignments"] += args.assignments
                out["bytes"] += args.assignments * layer.provider.expert_bytes  # type: ignore[attr-defined]
                out["compute_s"] += args.nanoseconds * 1e-9
        return out


class LayerHostWork:
    """One layer's `HostWork` (module docstring). The provider's `host_tables()` give the
    layer's marks (int8 [E], nonzero: the host's), its experts' host addresses (uint64 [3, E])
    and the row bytes of gate/up and of down, whether down is Q6_K; `up_groups`/`down_groups`
    are the launch's groups per step."""

    def __init__(self, compute: HostCompute, provider: Any, up_groups: int, down_groups: int):
        self.compute = compute
        self.provider = provider
        self.up_groups = up_groups
        self.down_groups = down_groups
        self._args: dict[tuple[int, int], native.HostLayerArgs] = {}  # per launch shape (t, k)
        self._job: dict[tuple[int, int], int] = {}  # poll mode: the poller's job per shape
        self._pending: tuple[native.HostLayerArgs, dict[str, torch.Tensor], int] | None = None
        compute.layers.append(self)

    def launch_args(self) -> list[native.HostLayerArgs]:
        return list(self._args.values())

    def _args_for(self, t: int, k: int, b: dict[str, torch.Tensor]) -> native.HostLayerArgs:
        args = self._args.get((t, k))
        if args is None:
            marked, addr, gu_row_bytes, down_row_bytes, q6 = self.provider.host_tables()
            f, h = self.provider.stacked()[0].shape[1:]
            args = native.HostLayerArgs(
                marked=marked.ctypes.data, gate=addr[0].ctypes.data, up=addr[1].ctypes.data,
                down=addr[2].ctypes.data, gu_row_bytes=gu_row_bytes,
                down_row_bytes=down_row_bytes, q6=int(q6), h=h, f=f, up_g=self.up_groups,
                down_g=self.down_groups, threads=self.compute.threads, t=t, k=k,
                ids=b["ids"].data_ptr(), weights=b["weights"].data_ptr(),
                xq=b["xq"].data_ptr(), xd=b["xd"].data_ptr(), xs=b["xs"].data_ptr(),
                rows=b["rows"].data_ptr(),
            )  # fmt: skip
            self._args[(t, k)] = args  # kept: a CUDA graph may call host_layer with it
        if self.compute.poll and (t, k) not in self._job:
            self._job[(t, k)] = self.compute.post(args)
        return args

    def begin(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor, xa: Q8Act) -> None:
        t, k = topk_ids.shape
        a = t * k
        if a > MAX_ASSIGNMENTS:
            raise ValueError(f"host experts take at most {MAX_ASSIGNMENTS} assignments a launch")
        b = self.compute.buffers(xa.q.shape[1] * 4)
        args = self._args_for(t, k, b)
        stream = self.compute.stream
        if stream is None and not self.compute.poll:
            self._read_back(b, topk_ids, topk_weights, xa)  # `rows` calls host_layer
        else:  # the inputs on the current stream, before the gate/up
            job = self._job[(t, k)] if self.compute.poll else None
            self.compute.pack(b, topk_ids, topk_weights, xa, job)
            if stream is not None and not self.compute.poll:  # a host function, side stream
                stream.wait_stream(torch.cuda.current_stream(self.compute.device))
                with torch.cuda.stream(stream):
                    self.compute.launch(args)
                    b["rows_dev"][:a].copy_(b["rows"][:a], non_blocking=True)
        self._pending = (args, b, a)

    @staticmethod
    def _read_back(b: dict[str, torch.Tensor], ids: torch.Tensor, weights: torch.Tensor,
                   xa: Q8Act) -> None:  # fmt: skip
        """The routing and q8 activations into the buffers (off CUDA, without poll mode)."""
        t, k = ids.shape
        b["ids"][: t * k].view(t, k).copy_(ids, non_blocking=True)
        b["weights"][: t * k].view(t, k).copy_(weights, non_blocking=True)
        for name, src in (("xq", xa.q), ("xd", xa.d), ("xs", xa.s)):
            b[name][:t].copy_(src, non_blocking=True)

    def rows(self) -> torch.Tensor:
        if self._pending is None:
            raise RuntimeError("LayerHostWork.rows before begin")
        args, b, a = self._pending
        self._pending = None
        stream = self.compute.stream
        if self.compute.poll:  # the current stream waits for the poller's answer
            self.compute.wait()
            if stream is not None:
                b["rows_dev"][:a].copy_(b["rows"][:a], non_blocking=True)
                return b["rows_dev"][:a]
        elif stream is not None:
            torch.cuda.current_stream(self.compute.device).wait_stream(stream)
            return b["rows_dev"][:a]
        else:
            self.compute.launch(args)
        if args.status:
            raise RuntimeError("a host expert computation failed (bad shapes)")
        return b["rows"][:a]

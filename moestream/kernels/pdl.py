"""Programmatic dependent launch (PDL, sm_90 and up) for the decode step's kernels.

A decode step is a chain of ~10 small kernels per layer, each of a few microseconds; between
two of them the GPU drains the first one's last programs, then launches and ramps up the next.
Launched with PDL (`launch_pdl`), a kernel's programs may be scheduled while the kernel before
it in the stream still runs; each program then waits for that kernel to finish and its writes
to be visible (`griddepcontrol.wait`) before it touches global memory, so the launch and the
ramp-up overlap the previous kernel's tail instead of following it.

Weights do not depend on the kernel before, so a kernel that knows its weight addresses early
prefetches them into L2 before it waits (`prefetch_l2`, a hint: `pdl_args(device, prefetch=
True)` sets its PREFETCH flag, off with MOESTREAM_PREFETCH=0): the previous kernel's tail and
this one's weight reads overlap. The dense decode GEMVs and the router prefetch their rows; the
MoE down projection its experts' rows, from the router's expert ids (complete before the gate/up
kernel ahead of it passed its wait; a prefetch address never changes a result, only timing).

Contract: a kernel launched with `launch_pdl` must call `pdl_start(PDL)` before its first global
load or store; `pdl_args(device)` gives both the constexpr and the launch option, so they are
never set apart. `pdl_start` also lets the next kernel launch (`griddepcontrol.launch_dependents`)
only after the wait: the next kernel's programs never sit on SMs while two kernels are still
ahead of them. Reading stays ordered through the whole chain: every kernel waits for the one
before, which waited for the one before it. A kernel launched without PDL (a torch op between
two Triton kernels) is ordered by the stream as usual. Off on CPU tensors (the interpreter),
below sm_90, and with MOESTREAM_PDL=0 (for A/B timings).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (see the module docstring)."""
    if device.type != "cuda" or os.environ.get("MOESTREAM_PDL", "1") == "0":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(device: torch.device, prefetch: bool = False) -> dict[str, bool]:
    """Keyword arguments of a launch of a kernel that takes `PDL: tl.constexpr` (and, with
    `prefetch`, `PREFETCH: tl.constexpr`): the kernel's flag and Triton's `launch_pdl` option,
    always equal; PREFETCH only with PDL (before the wait is the point)."""
    on = pdl_enabled(device)
    args = {"PDL": on, "launch_pdl": on}
    if prefetch:
        args["PREFETCH"] = on and os.environ.get("MOESTREAM_PREFETCH", "1") != "0"
    return args


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """First statement of a kernel that takes PDL: wait for the kernel before to finish, then
    let the next one launch. Nothing when PDL is off."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def group_bytes(QTYPE: tl.constexpr):
    """Bytes of 256 weights of a decode GEMV type (GGML type ids: Q8_0 8, Q4_K 12, Q5_K 13,
    Q6_K 14): 8 x 34, 144, 176, 210."""
    return 272 if QTYPE == 8 else (144 if QTYPE == 12 else (176 if QTYPE == 13 else 210))


def group_bytes_of(qtype: int) -> int:
    """`group_bytes` on the host."""
    return {8: 272, 12: 144, 13: 176, 14: 210}[int(qtype)]


@triton.jit
def prefetch_l2(ptrs):
    """Prefetch the 128-byte lines holding `ptrs` (any shape, valid addresses) into L2: one
    `prefetch.global.L2` per element, kept although nothing reads its result. GPU only."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def prefetch_rows(base, stride, n_rows, row_bytes, ROWS: tl.constexpr, LINES: tl.constexpr):
    """`prefetch_l2` of n_rows (<= ROWS) rows of row_bytes bytes (<= LINES lines of 128), the
    first at byte pointer `base`, `stride` bytes apart."""
    r = tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, LINES)[None, :] * 128
    off = tl.where((r < n_rows) & (c < row_bytes), r.to(tl.int64) * stride + c, 0)
    prefetch_l2(base + off)

"""Programmatic dependent launch (PDL, sm_90 and up) for the decode step's kernels.

A decode step is a chain of ~10 small kernels per layer, each of a few microseconds; between
two of them the GPU drains the first one's last programs, then launches and ramps up the next.
Launched with PDL (`launch_pdl`), a kernel's programs may be scheduled while the kernel before
it in the stream still runs; each program then waits for that kernel to finish and its writes
to be visible (`griddepcontrol.wait`) before it touches global memory, so the launch and the
ramp-up overlap the previous kernel's tail instead of following it.

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


def pdl_args(device: torch.device) -> dict[str, bool]:
    """Keyword arguments of a launch of a kernel that takes `PDL: tl.constexpr`: the kernel's
    flag and Triton's `launch_pdl` option, always equal (one dict per device and setting, made
    once: this runs at every eager launch)."""
    return _launch_args(device, os.environ.get("MOESTREAM_PDL", "1"))


@functools.cache
def _launch_args(device: torch.device, _setting: str) -> dict[str, bool]:
    on = pdl_enabled(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """First statement of a kernel that takes PDL: wait for the kernel before to finish, then
    let the next one launch. Nothing when PDL is off."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

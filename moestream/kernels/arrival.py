""" "Last program to arrive": a launch's programs each store a partial result, and the one that
arrives last at a shared counter combines them, in the same launch (no second kernel).

Used where a second launch would cost more than the combining work: the router's top-k over
its programs' logits (`router.py`), the MoE gate/up K split (`moe_mmvq.py`), the decode
attention's split merge (`paged_attention.py`, an option). The counters are int32 zeros that
every launch leaves at zero (the last program resets its counter), so one buffer made once
serves every launch in stream order and CUDA-graph replays; launches that may run concurrently
need one each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def last_to_arrive(counter, arrivals):
    """After this program's stores: True in the program that is the `arrivals`-th to reach
    `counter` (a scalar int32 pointer), which then sees every earlier program's stores (a CTA
    barrier orders this program's threads' stores before the acquire-release atomic) and
    resets the counter to 0. Loads of the others' results should bypass L1 (".cg")."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    last = arrived == arrivals - 1
    if last:
        tl.store(counter, 0)  # ready for the next launch (and CUDA-graph replays)
    return last


def arrival_counters(n: int, device: torch.device | str) -> torch.Tensor:
    """n arrival counters: int32 zeros."""
    return torch.zeros(n, dtype=torch.int32, device=device)


def check_counters(counters: torch.Tensor, n: int, device: torch.device) -> None:
    """ValueError unless `counters` is a contiguous int32 tensor of at least n on `device`."""
    if (
        counters.dtype != torch.int32
        or not counters.is_contiguous()
        or counters.numel() < n
        or counters.device != device
    ):
        raise ValueError(f"counters must be a contiguous int32 tensor of >= {n} on {device}")

"""Group MoE assignments by expert into blocks of BLOCK_M rows in one Triton launch.

`align_blocks` has the contract and the exact outputs of `moe.align_assignments` (its torch
reference: stable argsort, scatter_add, cumsum, searchsorted and index ops, ~12 launches, the
radix sort alone 27 us on an H200 at A = 256). Here one program does it all, in four passes
over small tiles:
1. counts per expert: the ids, CHUNK at a time, compared with every expert ([CHUNK, E_PAD]),
   summed once after the loop (skipped when the caller passes `counts`);
2. padded blocks per expert, their cumulative sum block_end, first_row = the row where each
   expert's run starts; block_expert[b] = the number of experts whose run ends at or before
   block b (searchsorted, right side), E for spare blocks;
3. every row of sorted_ids set to the sentinel A, then a CTA barrier (the next pass's stores
   to the same rows come from other threads);
4. each assignment i written at first_row[e] + rank, rank = the assignments before i with the
   same expert e: those of earlier chunks (a running count per expert) plus those earlier in
   its chunk (a [CHUNK, CHUNK] comparison). Ascending order within an expert, as a stable sort.
No host synchronisation: shapes depend on (A, E, block_m) only, so CUDA graphs capture it.

Letters: T tokens, k experts per token, A = T*k assignments, E experts (E_PAD its power of 2).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Above, the torch version. H200, E=128, k=8, in CUDA graphs (`python bench/kernels_gpu.py
# --time-align`, 2026-11-30): one launch 3.0 / 12.4 / 20.0 / 35.9 / 64.7 us at A = 8 / 128 /
# 256 / 512 / 1024 against torch's 43 / 45 / 65 / 71 / 74 us, but 247 against 80 at A = 4096.
ALIGN_MAX_ASSIGNMENTS = 1024
ALIGN_MAX_EXPERTS = 512
_TILE = 8192  # elements of a [rows, E_PAD] comparison tile: 32 int32 a thread at ALIGN_WARPS 8
ALIGN_WARPS = 8  # (a tile of 16,384 needs 16 warps not to spill: 128 registers in the sm_90 build)
_FILL = 1024  # sentinel rows stored per step


@triton.jit
def _align_kernel(
    ids_ptr, counts_ptr, sorted_ids_ptr, block_expert_ptr, A, E, block_m, num_blocks,
    E_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_B: tl.constexpr, FILL: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
):  # fmt: skip
    # while loops: the interpreter cannot range() over run-time ints (scalars are 1-element arrays)
    e = tl.arange(0, E_PAD)
    e_ok = e < E
    ii = tl.arange(0, CHUNK)
    if HAS_COUNTS:
        counts = tl.load(counts_ptr + e, mask=e_ok, other=0).to(tl.int32)  # [E_PAD]
    else:
        hits = tl.zeros([CHUNK, E_PAD], tl.int32)
        c = 0
        while c < A:
            i = c + ii
            ids = tl.load(ids_ptr + i, mask=i < A, other=-1).to(tl.int32)  # [CHUNK]
            hits += (ids[:, None] == e[None, :]).to(tl.int32)
            c += CHUNK
        counts = tl.where(e_ok, tl.sum(hits, axis=0), 0)  # [E_PAD]
    blocks = (counts + block_m - 1) // block_m  # [E_PAD], 0 past E
    block_end = tl.cumsum(blocks, axis=0)  # [E_PAD]
    first_row = (block_end - blocks) * block_m  # [E_PAD]

    bb = tl.arange(0, BLOCK_B)
    b0 = 0
    while b0 < num_blocks:
        b = b0 + bb
        ended = (block_end[None, :] <= b[:, None]) & e_ok[None, :]  # [BLOCK_B, E_PAD]
        tl.store(block_expert_ptr + b, tl.sum(ended.to(tl.int32), axis=1), mask=b < num_blocks)
        b0 += BLOCK_B

    rows = num_blocks * block_m
    rr = tl.arange(0, FILL)
    sentinel = tl.zeros([FILL], tl.int32) + A
    r0 = 0
    while r0 < rows:
        tl.store(sorted_ids_ptr + r0 + rr, sentinel, mask=r0 + rr < rows)
        r0 += FILL
    tl.debug_barrier()  # the sentinels are out before any thread overwrites one

    next_row = first_row  # [E_PAD] where each expert's next assignment goes
    c = 0
    while c < A:
        i = c + ii
        raw = tl.load(ids_ptr + i, mask=i < A, other=-1)  # [CHUNK]
        ok = (i < A) & (raw >= 0) & (raw < E)
        ids = tl.where(ok, raw, -1).to(tl.int32)
        hit = (ids[:, None] == e[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
        base = tl.sum(hit * next_row[None, :], axis=1)  # [CHUNK]
        same_before = (ids[:, None] == ids[None, :]) & (ii[None, :] < ii[:, None])
        rank = tl.sum(same_before.to(tl.int32), axis=1)  # [CHUNK] earlier in the chunk
        tl.store(sorted_ids_ptr + base + rank, i, mask=ok)
        next_row += tl.sum(hit, axis=0)
        c += CHUNK


def max_blocks(assignments: int, num_experts: int, block_m: int) -> int:
    """The most blocks of `block_m` rows that A assignments over E experts can fill: an expert
    of c assignments takes ceil(c / block_m) <= (c + block_m - 1) / block_m blocks and at most
    min(E, A) experts hold any, so the sum is at most (A + (block_m - 1) min(E, A)) / block_m,
    reached when each holds 1 more than a multiple of block_m. The grouped MoE kernels launch
    a program per bound block (those past the real ones return at once): at A = 128, E = 128,
    block_m = 2 (16 tokens of the 30B) 128 blocks, where cdiv(A, block_m) + min(E, A) gave 192."""
    return (assignments + (block_m - 1) * min(num_experts, assignments)) // block_m


def _kernel_runs_here(device: torch.device) -> bool:
    """CUDA, or the CPU under the Triton interpreter (tests)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def align_blocks(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly `moe.align_assignments`, in one launch for A <= ALIGN_MAX_ASSIGNMENTS and
    E <= ALIGN_MAX_EXPERTS (the torch version above them, and on the CPU without the Triton
    interpreter).

    topk_ids [T, k] (any shape; read in row-major order) int32 or int64, ids in [0, E) ->
    (sorted_ids [num_blocks * block_m] int32: assignment ids, expert by expert in ascending
    order, ascending within an expert, each expert's run padded to whole blocks with the
    sentinel A; block_expert [num_blocks] int32: each block's expert, E for spare blocks past
    the end), num_blocks = `max_blocks(A, E, block_m)`. `counts` [E] (any integer dtype), when
    given, must be the assignments per expert; they are then not counted again. Every output
    element is written; no host synchronisation.
    """
    a = topk_ids.numel()
    if (
        a == 0
        or a > ALIGN_MAX_ASSIGNMENTS
        or num_experts > ALIGN_MAX_EXPERTS
        or not _kernel_runs_here(topk_ids.device)
    ):
        from moestream.kernels.moe import align_assignments  # moe imports this module

        return align_assignments(topk_ids, num_experts, block_m, counts)
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"num_experts and block_m must be positive, got {num_experts} {block_m}")
    if counts is not None and (
        counts.shape != (num_experts,)
        or counts.is_floating_point()
        or counts.device != topk_ids.device
        or counts.stride(0) != 1
    ):
        raise ValueError(f"counts must be an integer [{num_experts}] on {topk_ids.device}")
    device = topk_ids.device
    num_blocks = max_blocks(a, num_experts, block_m)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    flat = topk_ids.reshape(-1)  # [A], a view when contiguous
    e_pad = triton.next_power_of_2(num_experts)
    chunk = max(16, min(64, _TILE // e_pad, triton.next_power_of_2(a)))
    block_b = max(16, min(1024, _TILE // e_pad, triton.next_power_of_2(num_blocks)))
    _align_kernel[(1,)](
        flat, flat if counts is None else counts, sorted_ids, block_expert,
        a, num_experts, block_m, num_blocks,
        E_PAD=e_pad, CHUNK=chunk, BLOCK_B=block_b, FILL=_FILL, HAS_COUNTS=counts is not None,
        num_warps=ALIGN_WARPS,
    )  # fmt: skip
    return sorted_ids, block_expert

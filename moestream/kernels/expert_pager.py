"""Expert paging on the device: which routed experts move into device slots, and the copies.

Under paged placement (`experts.paged`) every expert of a layer sits in pinned host memory and
`S` of them also in device slots; the fused MoE kernel finds each expert's bytes through an
address table (`expert_addr` [3, E]: a slot's address, or the host copy's, which the GPU reads
across the host link). Before each decode forward of the layer, two launches keep the slots
following the routing with no host involvement, so a whole step stays one CUDA graph:

`page`'s first kernel (one program) reads the forward's routed ids, decays every expert's
`heat` by `decay` and adds its reads (frequency over a sliding window of recent forwards),
and admits the routed experts missing from the slots, hottest first, each into the slot of the
coldest expert that this forward does not route (an empty slot first); it rewrites the slot
and address tables of both and writes the list of copies. When fewer slots are free than
experts are missing, the rest stay in host memory for this forward and the kernel reads them
across the link. The second kernel (a grid over the GPU) copies each admitted expert's three
weights from host memory into its slot. The MoE kernel launched after them reads the new table.
Every expert's bytes are the same wherever they are read, so results never depend on paging.

The choice is vectorised over a [E, E] and an [S, E] comparison (ranks instead of a loop), so
one program decides in a few microseconds for E <= `PAGER_MAX_EXPERTS`.

Counters, on the device (`stats` [5] int64): reads served by slots that already held the
expert, reads of experts admitted this forward, reads across the host link, admissions, and
reads from the prefill stage (forwards that do not page; `experts.paged`).

`page_ref` is the same decision in torch (the CPU's path, and the kernel's test oracle).

Letters: E experts, S device slots, N routed assignments (tokens x k).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moestream.kernels.pdl import pdl_args, pdl_start

PAGER_MAX_EXPERTS = 256  # the [E, E] rank comparison in one program's registers
STATS = ("slot_reads", "admitted_reads", "link_reads", "admissions", "stage_reads")
# The copy kernel's launch: programs per SM and words (int32) a program moves per iteration.
# Loads from pinned host memory go across the link, whose latency wants many bytes in flight.
COPY_PROGRAMS_PER_SM = 4
COPY_BLOCK = 1024
COPY_WARPS = 4


@triton.jit
def _pager_kernel(
    ids_ptr, N, heat_ptr, slot_of_ptr, owner_ptr, addr_ptr, host_addr_ptr, slot_addr_ptr,
    copy_ptr, stats_ptr, decay,
    E: tl.constexpr, S: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr, ADMIT: tl.constexpr, STAGED: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(PDL)
    e = tl.arange(0, BLOCK_E)
    emask = e < E
    cnt = tl.zeros([BLOCK_E], dtype=tl.int32)  # this forward's reads of each expert
    for j0 in range(0, N, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        ids = tl.load(ids_ptr + j, mask=j < N, other=-1).to(tl.int32)
        cnt += tl.sum((ids[None, :] == e[:, None]).to(tl.int32), axis=1)
    slot_of = tl.load(slot_of_ptr + e, mask=emask, other=-1)
    on_slot = slot_of >= 0
    slot_reads = tl.sum(tl.where(on_slot, cnt, 0))
    missing = (cnt > 0) & ~on_slot
    n_missing = tl.sum(missing.to(tl.int32))
    stats = tl.arange(0, 8)
    add = tl.where(stats == 0, slot_reads, 0)
    if ADMIT:
        heat = tl.load(heat_ptr + e, mask=emask, other=0.0) * decay + cnt.to(tl.float32)
        tl.store(heat_ptr + e, heat, mask=emask)
        n = n_missing * 0
        admitted = n
        if n_missing > 0:  # the rest only when some routed expert is not in a slot
            s = tl.arange(0, BLOCK_S)
            owner = tl.load(owner_ptr + s, mask=s < S, other=-1)
            held = owner[:, None] == e[None, :]  # [BS, BE]: slot s holds expert e
            owner_heat = tl.sum(tl.where(held, heat[None, :], 0.0), axis=1)
            owner_routed = tl.sum((held & (cnt[None, :] > 0)).to(tl.int32), axis=1) > 0
            free = (s < S) & ~owner_routed  # slots this forward may give up
            score = tl.where(owner < 0, -1.0, owner_heat)  # empty slots first, then the coldest
            # rank of each missing expert, hottest first (ties: lower id), and of each free
            # slot, coldest first (ties: lower slot): the i-th of one goes to the i-th of the other
            ahead = missing[None, :] & (
                (heat[None, :] > heat[:, None])
                | ((heat[None, :] == heat[:, None]) & (e[None, :] < e[:, None]))
            )  # [BE, BE]
            rank_e = tl.sum(ahead.to(tl.int32), axis=1)
            colder = free[None, :] & (
                (score[None, :] < score[:, None])
                | ((score[None, :] == score[:, None]) & (s[None, :] < s[:, None]))
            )  # [BS, BS]
            rank_s = tl.sum(colder.to(tl.int32), axis=1)
            n = tl.minimum(n_missing, tl.sum(free.to(tl.int32)))
            take = missing & (rank_e < n)  # [BE] admitted now
            give = free & (rank_s < n)  # [BS] slots they go to
            pair = take[:, None] & give[None, :] & (rank_e[:, None] == rank_s[None, :])
            new_slot = tl.sum(tl.where(pair, s[None, :], 0), axis=1)  # [BE]
            new_owner = tl.sum(tl.where(pair, e[:, None], 0), axis=0)  # [BS]
            leaving = give & (owner >= 0)
            tl.store(slot_of_ptr + owner, tl.full([BLOCK_S], -1, tl.int32), mask=leaving)
            tl.store(slot_of_ptr + e, new_slot, mask=take)
            tl.store(owner_ptr + s, new_owner, mask=give)
            for k in tl.static_range(3):
                back = tl.load(host_addr_ptr + k * E + owner, mask=leaving, other=0)
                tl.store(addr_ptr + k * E + owner, back, mask=leaving)
                into = tl.load(slot_addr_ptr + k * S + new_slot, mask=take, other=0)
                tl.store(addr_ptr + k * E + e, into, mask=take)
            tl.store(copy_ptr + 1 + 2 * rank_e, e, mask=take)
            tl.store(copy_ptr + 2 + 2 * rank_e, new_slot, mask=take)
            admitted = tl.sum(tl.where(take, cnt, 0))
        tl.store(copy_ptr, n)
        link = tl.sum(tl.where(missing, cnt, 0)) - admitted
        add += tl.where(stats == 1, admitted, 0) + tl.where(stats == 2, link, 0)
        add += tl.where(stats == 3, n, 0)
    else:
        tl.store(copy_ptr, 0)
        rest = tl.sum(tl.where(missing, cnt, 0))
        add += tl.where(stats == (4 if STAGED else 2), rest, 0)
    ok = stats < 5
    old = tl.load(stats_ptr + stats, mask=ok, other=0)
    tl.store(stats_ptr + stats, old + add.to(tl.int64), mask=ok)


@triton.jit
def _copy_words(src_addr, dst_addr, n_words, pid, programs, BLOCK: tl.constexpr):
    """Words [0, n_words) from byte address src_addr to dst_addr (both 16-byte aligned), this
    program's share of a grid-stride copy; the loads bypass L1 (host memory). Offsets are
    multiples of BLOCK (not a loop variable's start) so that the loads stay 16 bytes wide."""
    src = tl.multiple_of(src_addr.to(tl.pointer_type(tl.int32)), 16)
    dst = tl.multiple_of(dst_addr.to(tl.pointer_type(tl.int32)), 16)
    offs = tl.arange(0, BLOCK)
    for i in range(0, tl.cdiv(n_words, programs * BLOCK)):
        o = (pid + i * programs).to(tl.int64) * BLOCK + offs
        ok = o < n_words
        tl.store(dst + o, tl.load(src + o, mask=ok, cache_modifier=".cg"), mask=ok)


@triton.jit
def _copy_kernel(
    copy_ptr, host_addr_ptr, slot_addr_ptr, W0, W1, W2,
    E: tl.constexpr, S: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    n = tl.load(copy_ptr)
    for c in range(0, n):
        ex = tl.load(copy_ptr + 1 + 2 * c)
        sl = tl.load(copy_ptr + 2 + 2 * c)
        for k in tl.static_range(3):
            words = W0 if k == 0 else (W1 if k == 1 else W2)
            src = tl.load(host_addr_ptr + k * E + ex)
            dst = tl.load(slot_addr_ptr + k * S + sl)
            _copy_words(src, dst, words, pid, programs, BLOCK)


@functools.cache
def _copy_grid(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: a grid stride all the same
    return torch.cuda.get_device_properties(device).multi_processor_count * COPY_PROGRAMS_PER_SM


def page(
    ids: torch.Tensor,
    heat: torch.Tensor,
    slot_of: torch.Tensor,
    owner: torch.Tensor,
    addr: torch.Tensor,
    host_addr: torch.Tensor,
    slot_addr: torch.Tensor,
    copies: torch.Tensor,
    stats: torch.Tensor,
    words: tuple[int, int, int],
    decay: float,
    admit: bool = True,
    staged: bool = False,
) -> None:
    """Queue the paging of one forward of a layer (module docstring) on the current stream:
    ids [T, k] routed experts; heat [E] float32, slot_of [E] int32 (-1: not in a slot), owner
    [S] int32 (-1: empty), addr / host_addr [3, E] and slot_addr [3, S] int64 byte addresses,
    copies [1 + 2 * S] int32 scratch, stats [5] int64, `words` each weight's int32 words.
    Without `admit` (long forwards) only the read counters move, as `staged` reads or across
    the link."""
    e, s = slot_of.numel(), owner.numel()
    if e > PAGER_MAX_EXPERTS:
        raise ValueError(f"device paging handles up to {PAGER_MAX_EXPERTS} experts, not {e}")
    flat = ids.reshape(-1)
    pdl = pdl_args(ids.device)
    _pager_kernel[(1,)](
        flat, flat.numel(), heat, slot_of, owner, addr, host_addr, slot_addr, copies, stats,
        decay, E=e, S=s, BLOCK_E=triton.next_power_of_2(e), BLOCK_S=triton.next_power_of_2(s),
        BLOCK_N=32, ADMIT=admit, STAGED=staged, num_warps=4, **pdl,
    )  # fmt: skip
    if not admit:
        return
    grid = _copy_grid(ids.device)
    _copy_kernel[(grid,)](
        copies, host_addr, slot_addr, *words, E=e, S=s, BLOCK=COPY_BLOCK, num_warps=COPY_WARPS,
        **pdl,
    )  # fmt: skip


def page_ref(
    ids: torch.Tensor,
    heat: torch.Tensor,
    slot_of: torch.Tensor,
    owner: torch.Tensor,
    stats: torch.Tensor,
    decay: float,
    admit: bool = True,
    staged: bool = False,
) -> list[tuple[int, int]]:
    """`page`'s decision in torch, updating heat, slot_of, owner and stats in place; returns
    the admissions as (expert, slot), in the kernel's copy order. The caller moves the bytes
    and the address table."""
    e = slot_of.numel()
    cnt = torch.bincount(ids.reshape(-1).long(), minlength=e)[:e].to(torch.int32)
    on_slot = slot_of >= 0
    stats[0] += int(cnt[on_slot].sum())
    missing = (cnt > 0) & ~on_slot
    if not admit:
        stats[4 if staged else 2] += int(cnt[missing].sum())
        return []
    heat.mul_(decay).add_(cnt.float())
    hot = sorted(torch.nonzero(missing).flatten().tolist(), key=lambda x: (-float(heat[x]), x))
    routed = cnt > 0
    free = [
        (-1.0 if o < 0 else float(heat[o]), i)
        for i, o in enumerate(owner.tolist())
        if o < 0 or not bool(routed[o])
    ]
    free.sort()
    moves = list(zip(hot, (i for _, i in free)))
    for x, i in moves:
        old = int(owner[i])
        if old >= 0:
            slot_of[old] = -1
        slot_of[x] = i
        owner[i] = x
    admitted = {x for x, _ in moves}
    stats[1] += sum(int(cnt[x]) for x in admitted)
    stats[2] += sum(int(cnt[x]) for x in hot if x not in admitted)
    stats[3] += len(moves)
    return moves

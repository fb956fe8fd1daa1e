"""Expert paging on the device: which routed experts move into device slots, and the copies.

Under paged placement (`experts.paged`) every expert of a layer sits in pinned host memory and
`S` of them also in device slots, found through an expert-to-slot table (`slot_of`, -1: not in
a slot) and an address table (`addr` [3, E]: a slot's bytes, or the host copy's). Before a
forward of the layer, launches with no host involvement (a whole step stays one CUDA graph):

`page`: one program reads the forward's routed ids, decays every expert's `heat` by `decay` and
adds its reads (frequency over a sliding window of recent forwards), and admits the routed
experts missing from the slots, hottest first, each into the slot of the coldest expert that
this forward does not route (an empty slot first); it rewrites both experts' table entries
and writes the list of copies, which a grid then makes from host memory into the slots. When
fewer slots are free than experts are missing, the rest stay out of the slots.

`page(..., predict=True)`: the ids are a prediction of the layer's next forward (made by the
layer before). The same program marks the experts it names outside the slots (`mark`) and,
while the decayed counts in `gate` say that at least `min_precision` of what predictions named
was then routed, admits them (by heat, which a prediction does not change) into the slots of
the coldest experts it does not name; the copies follow. The layer's own next paging counts
the marked experts it routes, updates `gate` and clears the marks.

`gather`: one program lists the forward's routed experts in ascending order (expert e to stage
slot p, its rank; `stage_slot[e] = p`), and the same grid copies each from `addr` (a slot, at
device speed, or host memory, across the link) into a stage stack, for forwards whose routed
experts do not all fit the slots.

The admission is vectorised over [E, E] and [S, E] comparisons (ranks instead of a loop), so
one program decides in microseconds for E <= `MAX_EXPERTS`, and the comparisons run only when
some routed expert is missing. The copies are cut into chunks dealt to a grid, all in flight
at once; their loads bypass L1 and are 16 bytes wide.

Counters, on the device (`stats` [8] int64, `experts.paged.STATS`): reads served by slots that
already held the expert, reads of experts admitted this forward, reads of experts left out of
the slots (from host memory), admissions; experts a prediction named outside the slots and of
those routed, experts prefetched and of those routed. `experts.paged.page_ref` is the same
decision in torch (the CPU's path, and the kernel's test oracle).

Letters: E experts, S device slots, N routed assignments (tokens x k).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moestream.kernels.pdl import pdl_args, pdl_start

MAX_EXPERTS = 256  # the [E, E] rank comparison in one program's registers
# The copy kernel's launch: programs per SM and words (int32) a program moves per iteration.
# Loads from pinned host memory go across the link, whose latency wants many bytes in flight.
COPY_PROGRAMS_PER_SM = 4
COPY_BLOCK = 1024
COPY_WARPS = 4
PAGER_WARPS = 8  # the one program that decides (bench/paging.py: 8 took 6 us off 4's)


@triton.jit
def _reads(ids_ptr, N, e, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_E] int32: how many of the N routed ids at ids_ptr name each expert e."""
    cnt = tl.zeros([BLOCK_E], dtype=tl.int32)
    for j0 in range(0, N, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        ids = tl.load(ids_ptr + j, mask=j < N, other=-1).to(tl.int32)
        cnt += tl.sum((ids[None, :] == e[:, None]).to(tl.int32), axis=1)
    return cnt


@triton.jit
def _admit(
    e, cnt, missing, n_missing, heat, slot_of_ptr, owner_ptr, addr_ptr, host_addr_ptr,
    slot_addr_ptr, copy_ptr, E: tl.constexpr, S: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Admit the `missing` experts (hottest first by `heat`; ties: lower id) into the slots of
    the coldest experts that `cnt` does not name (an empty slot first; ties: lower slot):
    rewrite slot_of, owner and addr, write the copy list. Returns ([BLOCK_E] admitted, n)."""
    s = tl.arange(0, BLOCK_S)
    owner = tl.load(owner_ptr + s, mask=s < S, other=-1)
    held = owner[:, None] == e[None, :]  # [BS, BE]: slot s holds expert e
    owner_heat = tl.sum(tl.where(held, heat[None, :], 0.0), axis=1)
    owner_named = tl.sum((held & (cnt[None, :] > 0)).to(tl.int32), axis=1) > 0
    free = (s < S) & ~owner_named  # slots this forward may give up
    score = tl.where(owner < 0, -1.0, owner_heat)  # empty slots first, then the coldest
    # rank of each missing expert, hottest first (ties: lower id), and of each free slot,
    # coldest first (ties: lower slot): the i-th of one goes to the i-th of the other
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
    return take, n


@triton.jit
def _pager_kernel(
    ids_ptr, N, heat_ptr, slot_of_ptr, owner_ptr, addr_ptr, host_addr_ptr, slot_addr_ptr,
    copy_ptr, stats_ptr, mark_ptr, gate_ptr, decay, min_precision,
    E: tl.constexpr, S: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr, ADMIT: tl.constexpr, PREDICT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(PDL)
    e = tl.arange(0, BLOCK_E)
    emask = e < E
    cnt = _reads(ids_ptr, N, e, BLOCK_E, BLOCK_N)  # this forward's reads (or predicted reads)
    slot_of = tl.load(slot_of_ptr + e, mask=emask, other=-1)
    on_slot = slot_of >= 0
    missing = (cnt > 0) & ~on_slot
    n_missing = tl.sum(missing.to(tl.int32))
    stats = tl.arange(0, 8)
    g = tl.arange(0, 2)
    gate = tl.load(gate_ptr + g)  # [named, then routed] over recent forwards (decayed)
    if PREDICT:  # the next forward's experts, named by a prediction: no reads, no heat
        heat = tl.load(heat_ptr + e, mask=emask, other=0.0)
        tl.store(mark_ptr + e, missing.to(tl.int8), mask=emask)  # 1: named outside the slots
        add = tl.where(stats == 4, n_missing, 0)
        n = n_missing * 0
        named, routed = tl.sum(tl.where(g == 0, gate, 0.0)), tl.sum(tl.where(g == 1, gate, 0.0))
        if (n_missing > 0) & (routed >= min_precision * named):
            take, n = _admit(
                e, cnt, missing, n_missing, heat, slot_of_ptr, owner_ptr, addr_ptr,
                host_addr_ptr, slot_addr_ptr, copy_ptr, E, S, BLOCK_S,
            )  # fmt: skip
            tl.store(mark_ptr + e, tl.full([BLOCK_E], 2, tl.int8), mask=take)  # 2: copied
        tl.store(copy_ptr, n)
        add += tl.where(stats == 6, n, 0)
    else:
        # score the prediction that named experts for this forward (marks), then clear it
        mark = tl.load(mark_ptr + e, mask=emask, other=0)
        used = (cnt > 0) & (mark > 0)
        n_named = tl.sum((mark > 0).to(tl.int32))
        n_used = tl.sum(used.to(tl.int32))
        tl.store(gate_ptr + g, gate * decay + tl.where(g == 0, n_named, n_used).to(tl.float32))
        tl.store(mark_ptr + e, tl.zeros([BLOCK_E], tl.int8), mask=emask)
        add = tl.where(stats == 5, n_used, 0)
        add += tl.where(stats == 7, tl.sum((used & (mark == 2)).to(tl.int32)), 0)
        add += tl.where(stats == 0, tl.sum(tl.where(on_slot, cnt, 0)), 0)
        if ADMIT:
            heat = tl.load(heat_ptr + e, mask=emask, other=0.0) * decay + cnt.to(tl.float32)
            tl.store(heat_ptr + e, heat, mask=emask)
            n = n_missing * 0
            admitted = n
            if n_missing > 0:  # the rest only when some routed expert is not in a slot
                take, n = _admit(
                    e, cnt, missing, n_missing, heat, slot_of_ptr, owner_ptr, addr_ptr,
                    host_addr_ptr, slot_addr_ptr, copy_ptr, E, S, BLOCK_S,
                )  # fmt: skip
                admitted = tl.sum(tl.where(take, cnt, 0))
            tl.store(copy_ptr, n)
            link = tl.sum(tl.where(missing, cnt, 0)) - admitted
            add += tl.where(stats == 1, admitted, 0) + tl.where(stats == 2, link, 0)
            add += tl.where(stats == 3, n, 0)
        else:
            tl.store(copy_ptr, 0)
            add += tl.where(stats == 2, tl.sum(tl.where(missing, cnt, 0)), 0)
    old = tl.load(stats_ptr + stats)
    tl.store(stats_ptr + stats, old + add.to(tl.int64))


@triton.jit
def _copy_kernel(
    copy_ptr, src_ptr, dst_ptr, W0, W1, W2, E_SRC, E_DST,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The list copy_ptr = [n, (a_0, b_0), ...]: for each entry and weight k, words W_k from
    byte address src[k, a] to dst[k, b] ([3, E_SRC] and [3, E_DST] int64 tables; addresses
    16-byte aligned). The work is cut into chunks of BLOCK words (an entry's weights one after
    the other) dealt to the programs in turn, so that all of a forward's copies are in flight
    at once rather than an entry's weights one after another; the loads bypass L1 (host
    memory) and, chunks starting at multiples of BLOCK, stay 16 bytes wide."""
    pdl_start(PDL)
    n = tl.load(copy_ptr)
    c0, c1 = tl.cdiv(W0, BLOCK), tl.cdiv(W1, BLOCK)
    per = c0 + c1 + tl.cdiv(W2, BLOCK)  # chunks of one entry
    offs = tl.arange(0, BLOCK)
    for chunk in range(tl.program_id(0), n * per, tl.num_programs(0)):
        c = chunk // per
        r = chunk - c * per  # the chunk within the entry: weight k, chunk r - first
        k = tl.where(r < c0, 0, tl.where(r < c0 + c1, 1, 2))
        first = tl.where(k == 0, 0, tl.where(k == 1, c0, c0 + c1))
        words = tl.where(k == 0, W0, tl.where(k == 1, W1, W2))
        a = tl.load(copy_ptr + 1 + 2 * c)
        b = tl.load(copy_ptr + 2 + 2 * c)
        src = tl.load(src_ptr + k * E_SRC + a).to(tl.pointer_type(tl.int32))
        dst = tl.load(dst_ptr + k * E_DST + b).to(tl.pointer_type(tl.int32))
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        o = (r - first).to(tl.int64) * BLOCK + offs
        ok = o < words
        tl.store(dst + o, tl.load(src + o, mask=ok, cache_modifier=".cg"), mask=ok)


@triton.jit
def _gather_list_kernel(
    ids_ptr, N, list_ptr, stage_slot_ptr,
    E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The routed experts of ids [N] in ascending order: expert e at stage slot p (its rank):
    stage_slot[e] = p and list = [n, (e, p), ...] for `_copy_kernel`."""
    pdl_start(PDL)
    e = tl.arange(0, BLOCK_E)
    cnt = _reads(ids_ptr, N, e, BLOCK_E, BLOCK_N)
    routed = (cnt > 0) & (e < E)
    flag = routed.to(tl.int32)
    pos = tl.cumsum(flag, axis=0) - flag
    tl.store(stage_slot_ptr + e, pos, mask=routed)
    tl.store(list_ptr + 1 + 2 * pos, e, mask=routed)
    tl.store(list_ptr + 2 + 2 * pos, pos, mask=routed)
    tl.store(list_ptr, tl.sum(flag))


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
    mark: torch.Tensor,
    gate: torch.Tensor,
    words: tuple[int, int, int],
    decay: float,
    admit: bool = True,
    predict: bool = False,
    min_precision: float = 0.5,
    copy_programs: int | None = None,
) -> None:
    """Queue the paging of one forward of a layer (module docstring) on the current stream:
    ids [T, k] routed experts; heat [E] float32, slot_of [E] int32 (-1: not in a slot), owner
    [S] int32 (-1: empty), addr / host_addr [3, E] and slot_addr [3, S] int64 byte addresses,
    copies [1 + 2 * S] int32 scratch, stats [8] int64 (`experts.paged.STATS`), mark [E] int8
    and gate [2] float32 (the prediction's marks and its decayed named / routed counts),
    `words` each weight's int32 words. Without `admit` (long forwards) only the read counters
    move. With `predict`, ids are a prediction of the layer's next forward: the experts it
    names outside the slots are marked and, while at least `min_precision` of what predictions
    named was then routed (`gate`), paged in (a prefetch; the layer's next paging scores and
    clears the marks). `copy_programs`: the copy grid (default `COPY_PROGRAMS_PER_SM` a SM)."""
    e, s = slot_of.numel(), owner.numel()
    if e > MAX_EXPERTS:
        raise ValueError(f"device paging handles up to {MAX_EXPERTS} experts, not {e}")
    flat = ids.reshape(-1)
    pdl = pdl_args(ids.device)
    _pager_kernel[(1,)](
        flat, flat.numel(), heat, slot_of, owner, addr, host_addr, slot_addr, copies, stats,
        mark, gate, decay, min_precision, E=e, S=s, BLOCK_E=triton.next_power_of_2(e),
        BLOCK_S=triton.next_power_of_2(s), BLOCK_N=32, ADMIT=admit, PREDICT=predict,
        num_warps=PAGER_WARPS, **pdl,
    )  # fmt: skip
    if admit or predict:
        _copy_kernel[(copy_programs or _copy_grid(ids.device),)](
            copies, host_addr, slot_addr, *words, e, s, BLOCK=COPY_BLOCK,
            num_warps=COPY_WARPS, **pdl,
        )  # fmt: skip


def gather(
    ids: torch.Tensor,
    addr: torch.Tensor,
    stage_addr: torch.Tensor,
    stage_slot: torch.Tensor,
    copies: torch.Tensor,
    words: tuple[int, int, int],
) -> None:
    """Queue copies of the experts that ids [T, k] route to, wherever they are now (addr [3, E]:
    a device slot or host memory), into a stage stack in ascending expert order (stage_addr
    [3, E] its slots' addresses); stage_slot [E] int32 then maps each routed expert to its
    stage slot. copies: [1 + 2 * E] int32 scratch."""
    e = stage_slot.numel()
    flat = ids.reshape(-1)
    pdl = pdl_args(ids.device)
    _gather_list_kernel[(1,)](
        flat, flat.numel(), copies, stage_slot, E=e, BLOCK_E=triton.next_power_of_2(e),
        BLOCK_N=32, num_warps=4, **pdl,
    )  # fmt: skip
    _copy_kernel[(_copy_grid(ids.device),)](
        copies, addr, stage_addr, *words, e, e, BLOCK=COPY_BLOCK, num_warps=COPY_WARPS, **pdl
    )

"""The "gmmvq" path of the fused MoE FFN (`moe.fused_moe`): batched decode (about 9-128 tokens)
with the "mmq" path's grouping and the "mmvq" path's integer-dot inner loop, for
Q4_K/Q5_K/Q6_K/Q8_0 experts (`mmvq.MMVQ_QTYPES`).

out[t] = sum_j w[t, j] * down_s(silu(gate_s x[t]) * up_s x[t]),  s = expert_slot[topk_ids[t, j]]

Why: "mmvq" reads an expert once per assignment, so its time grows with A; "mmq" reads it once
per block of assignments but its int8 `tl.dot` per 32-value sub-block runs far below the
bandwidth. Here the assignments are grouped by expert into blocks of up to M_BLOCK
(`moe_align.align_blocks`, on the device), and each weight word, unpacked once per K step, meets
the q8 activations of the block's M_BLOCK assignments in `dp4a`s (`mmvq.acc_runs` over an
[MB, rows, runs, 8 words] tile whose activation pointers are gathered per assignment).

Launches: x rounded to q8 blocks (`mmvq.quantize_q8`, or the caller's `xa`); gate/up per
(block, 32 F rows, K split), the last split to arrive (`kernels.arrival`) adding the partials
in split order and fusing SiLU and h's q8 rounding; down per (block, BLOCK_N rows of H), each
assignment's row times its routing weight into y [A, H] float32; the k rows of each token
summed in selection order into out (`_sum_topk_kernel`). No host sync (CUDA-graph capturable):
every shape depends on (A, E, config) only.

Numerics are those of `moe_mmvq.moe_mmvq_ref` (x and h rounded to q8 blocks). A token's bits
may differ from the "mmvq" path's, but not with the batch: a K step's products are reduced by
`mmvq.tree_sum` (a fixed tree over the step's values of one row, whatever M_BLOCK and the
row's position in its block), the steps, splits and the k experts are summed in fixed orders,
and rows past a block's assignments repeat its first one and are not stored.

Letters: T tokens, H hidden, F expert FFN, E experts, S weight slots, k experts per token,
A = T*k assignments, MB = M_BLOCK, NB blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moestream.kernels.arrival import arrival_counters, check_counters, last_to_arrive
from moestream.kernels.mmvq import MMVQ_QTYPES, Q8Act, acc_runs, quantize_q8, tree_sum, use_asm
from moestream.kernels.moe_align import align_blocks
from moestream.weights.qtensor import QTensor


@dataclass(frozen=True)
class GmmvqConfig:
    """Launch shape of the "gmmvq" path. `m_block`: assignments of one expert per block.
    gate/up kernel (32 F rows per program): `up_groups` groups of 256 per K step, `up_warps`,
    `up_split` K splits (partials summed by the last program to arrive; 1: none; where it does
    not divide H / 256, the largest divisor below it), `up_tree` each K step's sums as
    `mmvq.tree_sum`'s pairwise tree (else a plain `tl.sum`, whose order follows the tile's
    register layout: the same for every row of a build, so still batch invariant, but the bits
    then depend on m_block and warps too; it saves the tree's layout conversions). down kernel:
    `down_block_n` H rows per program, `down_groups` groups per K step, `down_warps`. With
    trees a row's bits depend on up_groups, up_split, up_tree and down_groups, never on m_block
    or the batch."""

    # A best guess before the GPU sweep (`bench/kernels_gpu.py --sweep-gmmvq`): the "mmvq"
    # path's gate/up shape (2 groups per step, 4-way split) and down groups, 4 assignments per
    # block (about 2 per used expert at T = 32, 4 at T = 64).
    m_block: int = 4
    up_groups: int = 2
    up_warps: int = 4
    up_split: int = 4
    up_tree: bool = True
    down_block_n: int = 8
    down_groups: int = 4
    down_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("m_block", "up_groups", "up_split", "down_block_n", "down_groups"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GmmvqConfig.{name} must be a power of two, got {v}")
        if self.m_block > 16:
            raise ValueError(f"GmmvqConfig.m_block must be at most 16, got {self.m_block}")
        for name in ("up_warps", "down_warps"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"GmmvqConfig.{name} must be 1, 2, 4, 8 or 16")


@triton.jit
def _block_rows(sorted_ptr, b, A, MB: tl.constexpr):
    """(assignment ids [MB] int64, valid [MB]) of block b: rows past the block's assignments
    (sentinel A) repeat its first row, which always holds one (an expert's run starts a block)."""
    assign = tl.load(sorted_ptr + b * MB + tl.arange(0, MB))  # [MB]
    valid = assign < A
    first = tl.load(sorted_ptr + b * MB)
    return tl.where(valid, assign, first).to(tl.int64), valid


@triton.jit
def _step_sums(part, MB: tl.constexpr, BN: tl.constexpr, N: tl.constexpr, TREE: tl.constexpr):
    """part [MB, BN, R, 8] -> [MB, BN]: `tree_sum` (a fixed pairwise tree) or, not TREE, a
    plain `tl.sum` (an order that follows the layout, the same for every row of one build)."""
    if TREE:
        y = tree_sum(part, MB, BN, N)
    else:
        y = tl.sum(tl.sum(part, axis=3), axis=2)
    return y


@triton.jit
def _store_h_q8_rows(g, u, hq_ptr, hd_ptr, hs_ptr, a, valid, blk, F: tl.constexpr,
                     MB: tl.constexpr):  # fmt: skip
    """h = silu(g) * u ([MB, 32], F rows blk * 32 ..) rounded per row to one q8 block, stored
    for the valid rows at assignment a[m]'s row of hq [A, F/4], hd and hs [A, F/32] (the
    rounding of `moe_mmvq._store_h_q8` and `mmvq.quantize_q8_ref`)."""
    h = g * tl.sigmoid(g) * u  # [MB, 32]
    amax = tl.max(tl.abs(h), axis=1)  # [MB]
    c127 = tl.full(amax.shape, 127.0, tl.float32)
    inv = tl.where(amax > 0, tl.math.div_rn(c127, tl.where(amax > 0, amax, 1.0)), 0.0)
    q = tl.floor(h * inv[:, None] + 0.5).to(tl.int32)  # [MB, 32]
    d = tl.math.div_rn(amax, c127)  # [MB]
    i = tl.arange(0, 4)[None, None, :]
    words = tl.sum((tl.reshape(q, (MB, 8, 4)) & 0xFF) << (8 * i), axis=2)  # [MB, 8]
    w = tl.arange(0, 8)[None, :]
    tl.store(hq_ptr + a[:, None] * (F // 4) + blk * 8 + w, words, mask=valid[:, None])
    tl.store(hd_ptr + a * (F // 32) + blk, d, mask=valid)
    tl.store(hs_ptr + a * (F // 32) + blk, d * tl.sum(q, axis=1).to(tl.float32), mask=valid)


@triton.jit(do_not_specialize=["A", "E"])  # one build at every T
def _gate_up_gmmvq_kernel(
    xq_ptr, xd_ptr, xs_ptr, sorted_ptr, block_expert_ptr, slot_ptr, g_ptr, u_ptr,
    hq_ptr, hd_ptr, hs_ptr, part_ptr, count_ptr,
    A, E, stride_xq, stride_xd, stride_ge, stride_gn, stride_ue, stride_un,
    F: tl.constexpr, QG: tl.constexpr, QU: tl.constexpr, H_GROUPS: tl.constexpr,
    TOPK: tl.constexpr, MB: tl.constexpr, G: tl.constexpr, SPLIT: tl.constexpr,
    TREE: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Program (block b of MB assignments of one expert, 32 F rows, K split s): the expert's
    gate and up rows against the block's tokens' q8 activations, G groups of gate and of up
    loaded per K step, each weight word unpacked once for the MB tokens; h = silu(g) * u
    written per assignment as one q8 block.

    SPLIT > 1: split s covers H_GROUPS / SPLIT groups and stores its float32 sums of the
    valid rows in part [SPLIT, 2, A, F]; the last of the SPLIT programs to arrive (an arrival
    counter per (block's first assignment, 32 rows), count [A, F/32], zero before the launch
    and reset by that program) adds them in split order and writes h."""
    b = tl.program_id(0)
    blk = tl.program_id(1)
    s = tl.program_id(2)
    expert = tl.load(block_expert_ptr + b)
    if expert >= E:  # a spare block past the last expert's
        return
    slot = tl.load(slot_ptr + expert).to(tl.int64)
    a, valid = _block_rows(sorted_ptr, b, A, MB)  # [MB]
    t = (a // TOPK)[:, None, None, None]  # [MB, 1, 1, 1] the rows' tokens
    xq, xd, xs = xq_ptr + t * stride_xq, xd_ptr + t * stride_xd, xs_ptr + t * stride_xd
    n = (blk * 32 + tl.arange(0, 32)).to(tl.int64)  # F is a multiple of 256: no tail
    rg = (g_ptr + slot * stride_ge + n * stride_gn)[None, :, None, None]  # [1, 32, 1, 1]
    ru = (u_ptr + slot * stride_ue + n * stride_un)[None, :, None, None]
    SUB_G: tl.constexpr = 8 if QG == 8 else 4  # runs of 8 words per group (Q8_0: 8 blocks)
    SUB_U: tl.constexpr = 8 if QU == 8 else 4
    cg = tl.arange(0, SUB_G * G)[None, None, :, None]  # (group, run)
    cu = tl.arange(0, SUB_U * G)[None, None, :, None]
    GPS: tl.constexpr = H_GROUPS // SPLIT
    g_lo = s * GPS
    g = tl.zeros([MB, 32], tl.float32)
    u = tl.zeros([MB, 32], tl.float32)
    for i in range(0, GPS, G):
        sbg = g_lo + i + cg // SUB_G
        sbu = g_lo + i + cu // SUB_U
        pg = tl.zeros([MB, 32, SUB_G * G, 8], tl.float32)
        pu = tl.zeros([MB, 32, SUB_U * G, 8], tl.float32)
        pg = acc_runs(pg, rg, sbg, cg % SUB_G, sbg < g_lo + GPS, 1.0, xq, xd, xs, QG, ASM)
        pu = acc_runs(pu, ru, sbu, cu % SUB_U, sbu < g_lo + GPS, 1.0, xq, xd, xs, QU, ASM)
        g += _step_sums(pg, MB, 32, SUB_G * G * 8, TREE)  # a fixed order: batch invariant
        u += _step_sums(pu, MB, 32, SUB_U * G * 8, TREE)
    if SPLIT == 1:
        _store_h_q8_rows(g, u, hq_ptr, hd_ptr, hs_ptr, a, valid, blk, F, MB)
    else:
        cols = n[None, :]  # [1, 32]
        rows = a[:, None]  # [MB, 1]
        ok = valid[:, None]
        tl.store(part_ptr + ((2 * s) * A + rows) * F + cols, g, mask=ok)
        tl.store(part_ptr + ((2 * s + 1) * A + rows) * F + cols, u, mask=ok)
        first = tl.load(sorted_ptr + b * MB).to(tl.int64)  # unique to the block
        if last_to_arrive(count_ptr + first * (F // 32) + blk, SPLIT):
            g = tl.zeros([MB, 32], tl.float32)
            u = tl.zeros([MB, 32], tl.float32)
            for j in tl.static_range(SPLIT):  # split order: the same bits whoever arrives last
                pg_ptr = part_ptr + ((2 * j) * A + rows) * F + cols
                pu_ptr = part_ptr + ((2 * j + 1) * A + rows) * F + cols
                g += tl.load(pg_ptr, mask=ok, other=0.0, cache_modifier=".cg")
                u += tl.load(pu_ptr, mask=ok, other=0.0, cache_modifier=".cg")
            _store_h_q8_rows(g, u, hq_ptr, hd_ptr, hs_ptr, a, valid, blk, F, MB)


@triton.jit(do_not_specialize=["A", "E"])
def _down_gmmvq_kernel(
    hq_ptr, hd_ptr, hs_ptr, sorted_ptr, block_expert_ptr, slot_ptr, d_ptr, weights_ptr, y_ptr,
    A, E, H, stride_de, stride_dn,
    QD: tl.constexpr, F: tl.constexpr, MB: tl.constexpr, BLOCK_N: tl.constexpr,
    G: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Program (block b of MB assignments of one expert, BLOCK_N rows of H): the expert's down
    rows against the assignments' q8 h, G groups per K step, each times its routing weight:
    y[a] = w[a] * down(h_a), stored for the valid rows into y [A, H] float32."""
    b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + b)
    if expert >= E:
        return
    slot = tl.load(slot_ptr + expert).to(tl.int64)
    a, valid = _block_rows(sorted_ptr, b, A, MB)  # [MB]
    a4 = a[:, None, None, None]  # [MB, 1, 1, 1]
    xq, xd, xs = hq_ptr + a4 * (F // 4), hd_ptr + a4 * (F // 32), hs_ptr + a4 * (F // 32)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nr = tl.minimum(n, H - 1).to(tl.int64)
    rows = (d_ptr + slot * stride_de + nr * stride_dn)[None, :, None, None]  # [1, BN, 1, 1]
    SUB: tl.constexpr = 8 if QD == 8 else 4
    r = tl.arange(0, SUB * G)[None, None, :, None]
    y = tl.zeros([MB, BLOCK_N], tl.float32)
    for i in range(0, F // 256, G):
        sb = i + r // SUB
        part = tl.zeros([MB, BLOCK_N, SUB * G, 8], tl.float32)
        part = acc_runs(part, rows, sb, r % SUB, sb < F // 256, 1.0, xq, xd, xs, QD, ASM)
        y += tree_sum(part, MB, BLOCK_N, SUB * G * 8)
    wt = tl.load(weights_ptr + a).to(tl.float32)  # [MB]
    dst = y_ptr + a[:, None] * H + n[None, :]
    tl.store(dst, y * wt[:, None], mask=valid[:, None] & (n[None, :] < H))


@triton.jit
def _sum_topk_kernel(y_ptr, out_ptr, H, stride_ot, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (token t, BLOCK columns): out[t] = y[t k] + y[t k + 1] + ... in selection order."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < H
    row = y_ptr + t * TOPK * H + n
    acc = tl.load(row, mask=ok, other=0.0)
    for j in tl.static_range(1, TOPK):
        acc += tl.load(row + j * H, mask=ok, other=0.0)
    tl.store(out_ptr + t * stride_ot + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


def gmmvq_counters(assignments: int, f: int, device: torch.device | str) -> torch.Tensor:
    """The arrival counters of the gate/up split (`GmmvqConfig.up_split` > 1): int32
    [assignments * F / 32], zero (one per block's first assignment and 32 rows, so the size of
    `moe_mmvq.mmvq_counters`). Every launch leaves them at zero: one buffer serves every launch
    of up to `assignments` pairs in stream order."""
    return arrival_counters(assignments * (f // 32), device)


def _divisor_at_most(n: int, most: int) -> int:
    return max(c for c in range(1, min(n, most) + 1) if n % c == 0)


def fused_moe_gmmvq(
    x: torch.Tensor,
    xa: Q8Act | None,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate: QTensor,
    up: QTensor,
    down: QTensor,
    expert_slot: torch.Tensor,
    out: torch.Tensor,
    cfg: GmmvqConfig,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """The "gmmvq" path of `moe.fused_moe` (its other arguments checked there) -> out [T, H].

    `xa`: x's q8 blocks when the caller has them (`mmvq.quantize_q8(x)`; x then gives only
    shapes, dtype and device), else quantized here. `expert_slot` [E] int32 (required: the
    blocks are found by expert). `counters`: zero arrival counters of a gate/up split
    (`gmmvq_counters`, left zero; a fresh buffer per call when None)."""

    if expert_slot is None:
        raise ValueError("gmmvq needs expert_slot")
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        if w.qtype not in MMVQ_QTYPES:
            raise ValueError(f"gmmvq: {name} is {w.qtype.name}, not one of MMVQ_QTYPES")
    t, h = x.shape
    k = topk_ids.shape[1]
    f = gate.shape[1]
    a = t * k
    if t == 0:
        return out
    if xa is None:
        xa = quantize_q8(x)  # [T, H] -> q8 blocks
    elif (
        xa.rows != t
        or xa.k != h
        or xa.d.shape != (t, h // 32)
        or xa.s.shape != xa.d.shape
        or xa.s.stride(0) != xa.d.stride(0)
        or any(v.stride(-1) != 1 or v.device != x.device for v in xa)
    ):
        raise ValueError(f"xa must be the q8 blocks of x [{t}, {h}] (quantize_q8) on x's device")
    num_experts = expert_slot.shape[0]
    mb = cfg.m_block
    sorted_ids, block_expert = align_blocks(topk_ids, num_experts, mb)  # [NB * MB], [NB]
    num_blocks = block_expert.shape[0]
    split = _divisor_at_most(h // 256, cfg.up_split)  # K splits of whole groups
    dev = x.device
    hq = torch.empty((a, f // 4), dtype=torch.int32, device=dev)  # [A, F/4]
    hd = torch.empty((a, f // 32), dtype=torch.float32, device=dev)  # [A, F/32]
    hs = torch.empty_like(hd)
    part = count = hd  # unused pointers without a split
    if split > 1:
        part = torch.empty((split, 2, a, f), dtype=torch.float32, device=dev)
        if counters is None:
            counters = gmmvq_counters(a, f, dev)
        check_counters(counters, a * (f // 32), dev)
        count = counters
    asm = use_asm(dev)
    _gate_up_gmmvq_kernel[(num_blocks, f // 32, split)](
        xa.q, xa.d, xa.s, sorted_ids, block_expert, expert_slot, gate.data, up.data,
        hq, hd, hs, part, count,
        a, num_experts, xa.q.stride(0), xa.d.stride(0),
        gate.data.stride(0), gate.data.stride(1), up.data.stride(0), up.data.stride(1),
        F=f, QG=int(gate.qtype), QU=int(up.qtype), H_GROUPS=h // 256, TOPK=k, MB=mb,
        G=min(cfg.up_groups, triton.next_power_of_2(h // 256 // split)), SPLIT=split,
        TREE=cfg.up_tree, ASM=asm, num_warps=cfg.up_warps,
    )  # fmt: skip
    y = torch.empty((a, h), dtype=torch.float32, device=dev)  # [A, H]
    _down_gmmvq_kernel[(num_blocks, triton.cdiv(h, cfg.down_block_n))](
        hq, hd, hs, sorted_ids, block_expert, expert_slot, down.data, topk_weights, y,
        a, num_experts, h, down.data.stride(0), down.data.stride(1),
        QD=int(down.qtype), F=f, MB=mb, BLOCK_N=cfg.down_block_n,
        G=min(cfg.down_groups, triton.next_power_of_2(f // 256)), ASM=asm,
        num_warps=cfg.down_warps,
    )  # fmt: skip
    block = min(1024, triton.next_power_of_2(h))
    _sum_topk_kernel[(t, triton.cdiv(h, block))](
        y, out, h, out.stride(0), TOPK=k, BLOCK=block, num_warps=4
    )  # [T, H], j in order
    return out

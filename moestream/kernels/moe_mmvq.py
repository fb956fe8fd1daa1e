"""The "mmvq" path of the fused MoE FFN (`moe.fused_moe`): decode with integer dot products on
q8 activations, for Q4_K/Q5_K/Q6_K/Q8_0 experts (`mmvq.MMVQ_QTYPES`).

out[t] = sum_j w[t, j] * down_s(silu(gate_s x[t]) * up_s x[t]),  s = expert_slot[topk_ids[t, j]]

Three launches: x rounded to q8 blocks (`mmvq.quantize_q8`, or the caller's); one program per
(assignment, 32 F rows, K split) for gate and up loaded in the same K steps, the last split to
arrive adding the partials in split order and fusing SiLU and h's q8 rounding
(`_gate_up_mmvq_kernel`); then one program per (token, block of H rows) that walks the token's
k experts a few at a time (scalar ids and pointers), routing weight folded into the block
scales, written straight into out [T, H] (`_down_mmvq_kernel`; with experts computed by the
host, each expert's sums apart and a fourth launch adding them, `_add_rows_kernel`). Experts
are found through the device-side `expert_slot` table or a [3, E] table of byte addresses.
Launch variants in `MoeMmvqConfig`; every one keeps a token's bits independent of the batch
(one build at every T, fixed-order sums, no atomics in the sums). `moe_mmvq_ref` is the torch
reference.

Letters: T tokens, H hidden, F expert FFN, E experts, S weight slots, k experts per token,
A = T*k assignments.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from moestream.kernels._triton_dequant import Q6_K, Q6_KP, kernel_qtype
from moestream.kernels.arrival import arrival_counters, check_counters, last_to_arrive
from moestream.kernels.exact import FP_EXACT, silu_rn
from moestream.kernels.mmvq import (
    MMVQ_QTYPES,
    Q8Act,
    acc_runs,
    dp4a,
    i2f,
    mmvq_rows,
    q6_k_fields,
    quantize_q8,
    tree_sum,
    use_asm,
)
from moestream.kernels.mmvq_once import _once_step, capped_warps, runs_per_group
from moestream.kernels.pdl import pdl_args, pdl_start
from moestream.kernels.tuning import MoeShape, next_power_of_2, tuned, weight_label
from moestream.weights.qtensor import QTensor


class HostWork(Protocol):
    """Experts that the host computes during one "mmvq" launch (`fused_moe_mmvq`'s
    `host_rows`; `experts.host_compute`): their slots are marked negative."""

    def begin(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor, xa: Q8Act) -> None:
        """Called after x's q8 rounding is queued, before the gate/up launch: start reading
        the routing and the activations back (the GPU goes on meanwhile)."""

    def rows(self) -> torch.Tensor:
        """Called after the down launch is queued: the host experts' weighted down sums,
        float32 [A, H] on the device (rows of other assignments are not read)."""


@dataclass(frozen=True)
class MoeMmvqConfig:
    """Launch shape of the "mmvq" path (independent of T: a token's bits must not depend on the
    batch). gate/up kernel (32 F rows per program): `up_groups` groups of 256 per K step,
    `up_warps`, `up_split` K splits (partials summed by the last program to arrive; 1: none),
    `up_fused` gate and up loaded in the same K step (else one after the other). down kernel:
    `down_block_n` H rows per program, `down_groups` groups per step, `down_warps`,
    `down_experts` experts unrolled per step of the runtime loop over the token's k (k or
    more: all unrolled), `down_rows` the [runs, words, rows] tile with activations loaded once
    per program for a Q6_K down (`_acc_q6_k_rows`; other types take the [1, rows, runs, words]
    tile of `mmvq.acc_runs`). Where a split or chunk does not divide H / 256 or k, the largest
    divisor below it is taken. `up_tree`, `down_tree`: a kernel's per-step reductions as
    `mmvq.tree_sum`'s pairwise tree, else a plain `tl.sum` (`_row_sums`; both batch
    invariant; the unfused gate/up always takes trees, the "rows" tile always plain sums).
    `up_once`: gate/up by `_gate_up_once_kernel` instead (activations loaded once per K step
    and shared by `up_block_n` gate and as many up rows, the dense "once" kernel's step;
    `up_groups` groups per step, `up_warps` capped by `mmvq_once.capped_warps`;
    `up_split` and `up_fused` unused). `down_split`: the token's k experts spread over that many
    programs per block of rows (k / down_split each, `down_experts` at a time), each storing
    its partial sums; the last to arrive adds them in order (1: one program walks all k).
    `down_each`: each expert of a step reduced on its own and added in turn (the runs tile; all
    of F in one step, `down_groups` raised to it): a token's output is then
    ((0 + T_0) + T_1) + ... at any `down_experts`, which the CPU can follow."""

    # H200, Qwen3-30B-A3B layer, Q4_K/Q6_K (`bench/kernels_gpu.py --sweep-moe`, 2026-11-30,
    # bench/RESULTS.md): 26.7 us at T = 1 and 123.2 us at T = 8, against 34.5 / 172.9 for the
    # shape before the variants (gate then up, 8 warps, no split; all 8 experts unrolled in
    # down). Within 1% of the fastest of 44 shapes at both T.
    up_groups: int = 2
    up_warps: int = 4
    up_split: int = 4
    up_fused: bool = True
    down_block_n: int = 4
    down_groups: int = 4
    down_warps: int = 4
    down_experts: int = 8
    down_rows: bool = True
    up_tree: bool = False
    down_tree: bool = False
    up_once: bool = False
    up_block_n: int = 4
    down_split: int = 1
    down_each: bool = False

    def __post_init__(self) -> None:
        if self.up_block_n not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"MoeMmvqConfig.up_block_n must divide 32, got {self.up_block_n}")
        for name in ("up_groups", "up_split", "down_block_n", "down_groups", "down_experts",
                     "down_split"):  # fmt: skip
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"MoeMmvqConfig.{name} must be a power of two, got {v}")
        for name in ("up_warps", "down_warps"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"MoeMmvqConfig.{name} must be 1, 2, 4, 8 or 16")


@triton.jit
def _row_sums(part, BN: tl.constexpr, N: tl.constexpr, TREE: tl.constexpr):
    """part [1, BN, R, 8] -> [1, BN]: `tree_sum` (a pairwise tree by index) or, not TREE, a
    plain `tl.sum` whose order follows the register layout. Both are batch invariant here:
    the tile's shape, hence its layout, is the same at every T (one token or one assignment
    per program), so a token's sums run in the same order whatever the batch; the plain sum
    needs no layout conversions between tree levels."""
    if TREE:
        y = tree_sum(part, 1, BN, N)
    else:
        y = tl.sum(tl.sum(part, axis=3), axis=2)
    return y


@triton.jit
def _gate_up_rows(g_rows, u_rows, xq, xd, xs, g_lo, GROUPS: tl.constexpr, QG: tl.constexpr,
                  QU: tl.constexpr, G: tl.constexpr, FUSED: tl.constexpr, TREE: tl.constexpr,
                  ASM: tl.constexpr):  # fmt: skip
    """(g, u) float32 [1, 32]: 32 gate rows and 32 up rows (`g_rows`, `u_rows`: [32] byte
    pointers) against one token's q8 activations over groups g_lo .. g_lo + GROUPS - 1.

    FUSED: a K step loads G groups of gate and of up together (one round trip per step for
    both), each step reduced by `_row_sums` (TREE) and the steps summed in order; else gate's
    steps run, then up's (`mmvq_rows`: `tree_sum`, the same bits as FUSED with TREE)."""
    if FUSED:
        SUB_G: tl.constexpr = 8 if QG == 8 else 4  # runs of 8 words per group (Q8_0: 8)
        SUB_U: tl.constexpr = 8 if QU == 8 else 4
        rg = g_rows[None, :, None, None]  # [1, 32, 1, 1]
        ru = u_rows[None, :, None, None]
        cg = tl.arange(0, SUB_G * G)[None, None, :, None]  # (group, run)
        cu = tl.arange(0, SUB_U * G)[None, None, :, None]
        g = tl.zeros([1, 32], tl.float32)
        u = tl.zeros([1, 32], tl.float32)
        for i in range(0, GROUPS, G):
            sbg = g_lo + i + cg // SUB_G
            sbu = g_lo + i + cu // SUB_U
            pg = tl.zeros([1, 32, SUB_G * G, 8], tl.float32)
            pu = tl.zeros([1, 32, SUB_U * G, 8], tl.float32)
            pg = acc_runs(pg, rg, sbg, cg % SUB_G, sbg < g_lo + GROUPS, 1.0, xq, xd, xs, QG, ASM)
            pu = acc_runs(pu, ru, sbu, cu % SUB_U, sbu < g_lo + GROUPS, 1.0, xq, xd, xs, QU, ASM)
            g += _row_sums(pg, 32, SUB_G * G * 8, TREE)
            u += _row_sums(pu, 32, SUB_U * G * 8, TREE)
    else:
        g = mmvq_rows(g_rows, xq, xd, xs, 0, 0, 1, g_lo, GROUPS, QG, 32, 1, G, ASM)  # [1, 32]
        u = mmvq_rows(u_rows, xq, xd, xs, 0, 0, 1, g_lo, GROUPS, QU, 32, 1, G, ASM)
    return g, u


@triton.jit
def _store_h_q8(g, u, hq_ptr, hd_ptr, hs_ptr, a, blk, F: tl.constexpr):
    """h = silu(g) * u ([1, 32], F rows blk * 32 ..) rounded to one q8 block of assignment a's
    row of hq [A, F/4], hd and hs [A, F/32] (`mmvq.quantize_q8_ref`)."""
    _store_q8(silu_rn(g) * u, hq_ptr, hd_ptr, hs_ptr, a, blk, F)


@triton.jit
def _store_q8(h, hq_ptr, hd_ptr, hs_ptr, a, blk, F: tl.constexpr):
    """h [1, 32] (F rows blk * 32 ..) rounded to one q8 block, as `_store_h_q8`."""
    amax = tl.max(tl.abs(h))
    inv = tl.where(amax > 0, tl.math.div_rn(127.0, tl.where(amax > 0, amax, 1.0)), 0.0)
    q = tl.floor(h * inv + 0.5).to(tl.int32)  # [1, 32]
    d = tl.math.div_rn(amax, 127.0)
    i = tl.arange(0, 4)[None, :]
    words = tl.sum((tl.reshape(q, (8, 4)) & 0xFF) << (8 * i), axis=1)  # [8] (disjoint bytes)
    a64 = a.to(tl.int64)
    tl.store(hq_ptr + a64 * (F // 4) + blk * 8 + tl.arange(0, 8), words)
    tl.store(hd_ptr + a64 * (F // 32) + blk, d)
    tl.store(hs_ptr + a64 * (F // 32) + blk, d * tl.sum(q).to(tl.float32))


@triton.jit
def _aligned_address(addr):
    """The uint8 pointer at byte address `addr` (int64), 16-byte aligned by the caller's
    contract. The hint goes on the pointer: put on the integer, the cast drops it and the
    weight loads shrink to 32 bits (sm_90 build of the gate/up kernel as zero-copy placement
    launches it: 2 128-bit and 16 32-bit loads instead of 6 128-bit)."""
    return tl.multiple_of(addr.to(tl.pointer_type(tl.uint8)), 16)


@triton.jit
def _pair_operands(a, ids_ptr, slot_ptr, addr_ptr, E_ADDR, g_ptr, u_ptr, stride_ge, stride_ue,
                   xq_ptr, xd_ptr, xs_ptr, stride_xq, stride_xd, TOPK: tl.constexpr,
                   ADDR: tl.constexpr):  # fmt: skip
    """(gate base, up base, xq, xd, xs) of assignment a: its expert's weights at slot
    expert_slot[e] of the stacks, or with ADDR at the byte addresses addr[0, e] and
    addr[1, e] of an [3, E_ADDR] int64 table; its token's q8 activation rows."""
    eid = tl.load(ids_ptr + a)
    if ADDR:
        g_base = _aligned_address(tl.load(addr_ptr + eid))
        u_base = _aligned_address(tl.load(addr_ptr + E_ADDR + eid))
    else:
        slot = tl.load(slot_ptr + eid).to(tl.int64)
        g_base = g_ptr + slot * stride_ge
        u_base = u_ptr + slot * stride_ue
    t = (a // TOPK).to(tl.int64)
    return g_base, u_base, xq_ptr + t * stride_xq, xd_ptr + t * stride_xd, xs_ptr + t * stride_xd


@triton.jit(do_not_specialize=["A"])  # one build at every T: see `_row_sums`
def _gate_up_mmvq_kernel(
    xq_ptr, xd_ptr, xs_ptr, ids_ptr, slot_ptr, g_ptr, u_ptr, hq_ptr, hd_ptr, hs_ptr, addr_ptr,
    part_ptr, count_ptr,
    E_ADDR, A, stride_xq, stride_xd, stride_ge, stride_gn, stride_ue, stride_un,
    F: tl.constexpr, QG: tl.constexpr, QU: tl.constexpr, H_GROUPS: tl.constexpr,
    TOPK: tl.constexpr, G: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr,
    TREE: tl.constexpr, ADDR: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (assignment a, block of 32 F rows, K split s): gate and up rows against token
    a // TOPK's quantized activations, h = silu(g) * u, written quantized (one 32-value q8
    block). Expert e's weights are at slot expert_slot[e] of the stacks, or with ADDR at the
    byte addresses addr[0, e] (gate) and addr[1, e] (up) of an [3, E_ADDR] int64 table
    (device or mapped host memory).

    SPLIT > 1: split s covers H_GROUPS / SPLIT groups and stores its float32 sums in
    part [SPLIT, 2, A, F]; the last of the block's SPLIT programs to arrive (an arrival
    counter per (a, block), count [A, F/32], zero before the launch and reset by that
    program) adds the partials in split order (fixed: no dependence on arrival order) and
    writes h. More, smaller programs for the few assignments of a decode step."""
    pdl_start(PDL)
    a = tl.program_id(0)
    blk = tl.program_id(1)
    s = tl.program_id(2)
    n = (blk * 32 + tl.arange(0, 32)).to(tl.int64)  # F is a multiple of 256: no tail
    g_base, u_base, xq, xd, xs = _pair_operands(
        a, ids_ptr, slot_ptr, addr_ptr, E_ADDR, g_ptr, u_ptr, stride_ge, stride_ue,
        xq_ptr, xd_ptr, xs_ptr, stride_xq, stride_xd, TOPK, ADDR,
    )  # fmt: skip
    g_rows = g_base + n * stride_gn  # [32]
    u_rows = u_base + n * stride_un
    GPS: tl.constexpr = H_GROUPS // SPLIT
    g, u = _gate_up_rows(g_rows, u_rows, xq, xd, xs, s * GPS, GPS, QG, QU, G, FUSED, TREE, ASM)
    if SPLIT == 1:
        _store_h_q8(g, u, hq_ptr, hd_ptr, hs_ptr, a, blk, F)
    else:
        cols = n[None, :]  # [1, 32]
        a64 = a.to(tl.int64)
        tl.store(part_ptr + ((2 * s) * A + a64) * F + cols, g)
        tl.store(part_ptr + ((2 * s + 1) * A + a64) * F + cols, u)
        # the block's last program: every split's sums are out
        if last_to_arrive(count_ptr + a64 * (F // 32) + blk, SPLIT):
            g = tl.zeros([1, 32], tl.float32)
            u = tl.zeros([1, 32], tl.float32)
            for j in tl.static_range(SPLIT):  # split order: the same bits whoever arrives last
                g += tl.load(part_ptr + ((2 * j) * A + a64) * F + cols, cache_modifier=".cg")
                u += tl.load(part_ptr + ((2 * j + 1) * A + a64) * F + cols, cache_modifier=".cg")
            _store_h_q8(g, u, hq_ptr, hd_ptr, hs_ptr, a, blk, F)


@triton.jit
def _once_rows(parts, rows0, stride_n, QTYPE: tl.constexpr, G: tl.constexpr,
               H_GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, xq, xd, xs,
               ASM: tl.constexpr):  # fmt: skip
    """parts [R, 2, 1, BLOCK_N] plus the K steps of BLOCK_N rows (rows0 + i * stride_n) of one
    token's activations: `mmvq_once._once_step` at M = 1, G groups per step."""
    SUB: tl.constexpr = 8 if QTYPE == 8 else 4
    R: tl.constexpr = SUB * G
    r = tl.arange(0, R)[:, None, None, None]  # [R, 1, 1, 1]
    h = tl.arange(0, 2)[None, :, None, None]  # [1, 2, 1, 1]
    m = tl.arange(0, 1)[None, None, :, None]  # [1, 1, 1, 1]
    j = tl.arange(0, 4)[None, None, None, :]  # [1, 1, 1, 4]
    for i in tl.static_range(0, H_GROUPS, G):
        sb = i + r // SUB
        parts = _once_step(parts, rows0, BLOCK_N - 1, stride_n, sb, r, h, m, j, sb < H_GROUPS,
                           xq + m, xd + m, xs + m, QTYPE, BLOCK_N, ASM)  # fmt: skip
    return parts


@triton.jit(do_not_specialize=["A"])  # one build at every T: a token's bits must not depend on T
def _gate_up_once_kernel(
    xq_ptr, xd_ptr, xs_ptr, ids_ptr, slot_ptr, g_ptr, u_ptr, hq_ptr, hd_ptr, hs_ptr, addr_ptr,
    hf_ptr, count_ptr,
    E_ADDR, A, stride_xq, stride_xd, stride_ge, stride_gn, stride_ue, stride_un,
    F: tl.constexpr, QG: tl.constexpr, QU: tl.constexpr, H_GROUPS: tl.constexpr,
    TOPK: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr, ADDR: tl.constexpr,
    ASM: tl.constexpr, PDL: tl.constexpr, HOST: tl.constexpr = False,
):  # fmt: skip
    """Program (assignment a, block of BLOCK_N F rows): the block's gate and up rows over the
    whole of K against token a // TOPK's activations, loaded once per K step and shared by
    the rows (`mmvq_once._once_step`), each row's partials summed by `mmvq.tree_sum`; then
    h = silu(g) * u. With BLOCK_N = 32, h is written quantized (one q8 block); with fewer rows
    the program stores h as float32 in hf [A, F], and the last of the 32 / BLOCK_N programs of
    a q8 block to arrive (an arrival counter per (a, block), count [A, F/32], zero before the
    launch and reset by that program) reads the block back and writes it quantized. Experts as
    in `_gate_up_mmvq_kernel` (slot table, or ADDR byte addresses). With HOST an expert whose
    slot is negative is computed by the host (`host_rows` of `fused_moe_mmvq`): its programs
    return at once."""
    pdl_start(PDL)
    a = tl.program_id(0)
    nb = tl.program_id(1)
    if HOST:  # noqa: SIM102 (a constexpr first: no load without HOST)
        if tl.load(slot_ptr + tl.load(ids_ptr + a)) < 0:
            return
    g_base, u_base, xq, xd, xs = _pair_operands(
        a, ids_ptr, slot_ptr, addr_ptr, E_ADDR, g_ptr, u_ptr, stride_ge, stride_ue,
        xq_ptr, xd_ptr, xs_ptr, stride_xq, stride_xd, TOPK, ADDR,
    )  # fmt: skip
    n0 = (nb * BLOCK_N).to(tl.int64)  # F is a multiple of 256: no tail
    RG: tl.constexpr = (8 if QG == 8 else 4) * G
    RU: tl.constexpr = (8 if QU == 8 else 4) * G
    pg = _once_rows(tl.zeros([RG, 2, 1, BLOCK_N], tl.float32), g_base + n0 * stride_gn,
                    stride_gn, QG, G, H_GROUPS, BLOCK_N, xq, xd, xs, ASM)  # fmt: skip
    pu = _once_rows(tl.zeros([RU, 2, 1, BLOCK_N], tl.float32), u_base + n0 * stride_un,
                    stride_un, QU, G, H_GROUPS, BLOCK_N, xq, xd, xs, ASM)  # fmt: skip
    g = tree_sum(tl.permute(pg, (2, 3, 0, 1)), 1, BLOCK_N, 2 * RG)  # [1, BLOCK_N]
    u = tree_sum(tl.permute(pu, (2, 3, 0, 1)), 1, BLOCK_N, 2 * RU)
    h = silu_rn(g) * u
    blk = (nb * BLOCK_N) // 32
    if BLOCK_N == 32:
        _store_q8(h, hq_ptr, hd_ptr, hs_ptr, a, blk, F)
    else:
        a64 = a.to(tl.int64)
        tl.store(hf_ptr + a64 * F + n0 + tl.arange(0, BLOCK_N)[None, :], h)
        if last_to_arrive(count_ptr + a64 * (F // 32) + blk, 32 // BLOCK_N):
            cols = blk * 32 + tl.arange(0, 32)[None, :]  # [1, 32]
            h32 = tl.load(hf_ptr + a64 * F + cols, cache_modifier=".cg")
            _store_q8(h32, hq_ptr, hd_ptr, hs_ptr, a, blk, F)


@triton.jit
def _acc_q6_k_rows(acc, rows, sb, c, ok, wt, xq, xd, PADDED: tl.constexpr, ASM: tl.constexpr):
    """Add Q6_K runs to acc [R, 8, BN] ("rows" tile: run r, word w, weight row; the layout of
    `mmvq._acc_q6_k` otherwise, words in the same permuted order). rows [1, 1, BN] byte
    pointers to row starts; sb, c, ok [R, 1, 1]. The activation words and scales are loaded
    once as [R, 8, 1] and broadcast over the rows: in the sm_90 build that load gets the
    tile's layout (runs and words on the lanes, rows in registers), so the broadcast is free
    and no shared-memory conversion is needed, where the [1, BN, R, 8] tile of `acc_runs`
    loads them per row. PADDED: 224-byte blocks (`QTensor.aligned`), weight words read as 32-bit
    loads and the scales as one 8-byte load (`mmvq.q6_k_fields`), words in the same permuted
    order (the tile is summed by position: the same bits either way, see `mmvq._acc_q6_k`)."""
    zx = tl.zeros([acc.shape[0], 8, 1], tl.int32)
    w = (tl.arange(0, 8)[None, :, None] * 3) % 8 + zx  # [R, 8, 1] permuted: see mmvq._acc_q6_k
    okx = ok & (w >= 0)
    n = c // 2
    t = c % 2
    xw = xq + sb * 64 + 32 * n + 8 * t + w
    x0 = tl.load(xw, mask=okx, other=0)  # [R, 8, 1]
    x1 = tl.load(xw + 16, mask=okx, other=0)
    b0 = sb * 8 + 4 * n + t + zx  # activation block of quarter t (2 + t: b0 + 2)
    xd0 = tl.load(xd + b0, mask=okx, other=0.0)
    xd1 = tl.load(xd + b0 + 2, mask=okx, other=0.0)
    z = tl.zeros(acc.shape, tl.int32)
    okf = okx & (z >= 0)  # [R, 8, BN]
    wf = w + z
    ql, qh, sc0, sc1, d = q6_k_fields(rows + z, sb, n, t, wf, okf, PADDED)  # [R, 8, BN]
    v0 = (ql & 0x0F0F0F0F) | (((qh >> (2 * t)) & 0x03030303) << 4)  # quarter t
    v1 = ((ql >> 4) & 0x0F0F0F0F) | (((qh >> (2 * t + 4)) & 0x03030303) << 4)  # 2 + t
    m32 = z - 522133280  # bytes 0xE0 = -32: the quants' offset, as one more dp4a
    x0f = x0 + z
    x1f = x1 + z
    f0 = i2f(sc0 * dp4a(m32, x0f, dp4a(v0, x0f, z, ASM), ASM))
    f1 = i2f(sc1 * dp4a(m32, x1f, dp4a(v1, x1f, z, ASM), ASM))
    d = d * wt
    acc = tl.fma(d * xd0, f0, acc)  # explicit FMAs: see `mmvq._acc_q4_k`
    return tl.fma(d * xd1, f1, acc)


@triton.jit
def _down_mmvq_kernel(
    hq_ptr, hd_ptr, hs_ptr, ids_ptr, weights_ptr, slot_ptr, d_ptr, out_ptr, addr_ptr, part_ptr,
    count_ptr, E_ADDR, H, stride_de, stride_dn, stride_ot,
    QD: tl.constexpr, F: tl.constexpr, TOPK: tl.constexpr, BLOCK_N: tl.constexpr,
    G: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr, TREE: tl.constexpr,
    ROWS: tl.constexpr, ADDR: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
    each_ptr=None, HOST: tl.constexpr = False, EACH: tl.constexpr = False,
):  # fmt: skip
    """Program (token t, block of H rows, expert split s): out[t] = sum_j weight_j *
    down_slot_j(h_{t,j}).

    With SPLIT > 1 program s takes the experts s * k / SPLIT .. (s + 1) * k / SPLIT - 1, stores
    its partial sums in part[t, s] and bumps the block's counter; the last of the SPLIT to
    arrive adds the partials in split order (from 0.0, as one program adds its chunks) and
    stores out[t]: with CHUNK = k / SPLIT the bits equal SPLIT = 1's at that CHUNK.
    The experts are taken CHUNK at a time (a runtime loop over chunks, so only one
    chunk's loads are live: registers, hence occupancy); a chunk's experts are unrolled (a
    static loop) over one tile per K step that accumulates them in selection order and is
    reduced once (`_row_sums`, or a plain sum with ROWS); the (chunk, step) sums are added in
    order. The tile is [1, BN, SUB*G, 8] (`mmvq.acc_runs`, any type) or with ROWS (Q6_K)
    [SUB*G, 8, BN] (`_acc_q6_k_rows`: activations loaded once for all BN rows). Each
    expert's id, weight and base pointer are scalars: had they been a tensor dimension, their
    loads would have had a register layout of their own, and moving the pointers derived from
    them into the tile's layout cost a shared-memory conversion (and a barrier) per load (seen
    in the sm_90 build). The routing weight scales each expert's block scales. With ADDR,
    expert e's down weight is at byte address addr[2, e]. F // 256 groups per step of G.

    EACH (the runs tile, all of F in one step): each expert of a chunk gets a tile of its own,
    reduced on its own and added to y in selection order, so y = ((0 + T_0) + T_1) + ... with
    T_j one expert's sum, at any CHUNK (the chunk's loads still in flight together).

    HOST (EACH or one expert a chunk, tree sums, no split: `REPRODUCIBLE_DOWN`): an expert
    whose slot is negative (with ADDR too: the slot table then marks host experts only) is
    computed by the host. The program stores each other expert's sums T_j in each [A, H]
    float32 (row a for assignment a; nothing in out, nothing for host experts, their loads
    masked off), and `_add_rows_kernel` adds T_0, T_1, ... in order once the host's rows are
    in: the token's bits are those of the sum here, and the down kernel need not wait for the
    host."""
    pdl_start(PDL)
    if EACH:
        tl.static_assert(not ROWS and G * 256 >= F, "EACH: the runs tile, all of F in one step")
    if HOST:
        tl.static_assert((CHUNK == 1 or EACH) and TREE and not ROWS and SPLIT == 1)
        tl.static_assert(G * 256 >= F, "HOST: all of F in one step")
    SUB: tl.constexpr = 8 if QD == 8 else 4  # runs of 8 words per group (Q8_0: 8 blocks)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nr = tl.minimum(n, H - 1).to(tl.int64)
    if ROWS:
        tl.static_assert((QD == Q6_K) or (QD == Q6_KP), "the rows tile is for Q6_K")  # noqa: SIM109
        nc = nr[None, None, :]  # [1, 1, BN]
        r = tl.arange(0, SUB * G)[:, None, None]  # (group, run) [R, 1, 1]
    else:
        nc = nr[None, :, None, None]  # [1, BN, 1, 1]
        r = tl.arange(0, SUB * G)[None, None, :, None]
    y = tl.zeros([BLOCK_N], tl.float32)
    PER: tl.constexpr = TOPK // SPLIT  # experts of this program
    c0 = tl.program_id(2) * PER
    for cc in tl.range(0, PER, CHUNK, loop_unroll_factor=1):  # from 0: Triton 3.6's interpreter
        c = c0 + cc  # cannot range from a program id
        for i in range(0, F // 256, G):
            sb = i + r // SUB
            ok = sb < F // 256
            if ROWS:
                part = tl.zeros([SUB * G, 8, BLOCK_N], tl.float32)
            else:
                part = tl.zeros([1, BLOCK_N, SUB * G, 8], tl.float32)
            for jj in tl.static_range(CHUNK):
                a = t * TOPK + c + jj  # the assignment (scalar)
                eid = tl.load(ids_ptr + a)
                if HOST:
                    mark = tl.load(slot_ptr + eid)  # negative: a host expert
                if ADDR:
                    d_base = _aligned_address(tl.load(addr_ptr + 2 * E_ADDR + eid))
                else:
                    d_base = d_ptr + tl.load(slot_ptr + eid).to(tl.int64) * stride_de
                mine = ok
                if HOST:
                    # a host expert: nothing to load (the mark as a tensor: Triton 3.9's
                    # interpreter takes no scalar term in a load mask)
                    mine = ok & (sb * 0 + mark >= 0)
                if EACH:
                    part = tl.zeros([1, BLOCK_N, SUB * G, 8], tl.float32)
                wt = tl.load(weights_ptr + a).to(tl.float32)
                rows = d_base + nc * stride_dn
                xq, xd, xs = hq_ptr + a * (F // 4), hd_ptr + a * (F // 32), hs_ptr + a * (F // 32)
                if ROWS:
                    part = _acc_q6_k_rows(part, rows, sb, r % SUB, mine, wt, xq, xd, QD == Q6_KP,
                                          ASM)  # fmt: skip
                else:
                    part = acc_runs(part, rows, sb, r % SUB, mine, wt, xq, xd, xs, QD, ASM)
                if HOST:  # one expert a chunk, or EACH: T_j to each[a] (a device expert)
                    sums = tl.reshape(_row_sums(part, BLOCK_N, SUB * G * 8, TREE), [BLOCK_N])
                    tl.store(each_ptr + a * H + n, sums, mask=(n < H) & (n * 0 + mark >= 0))
                elif EACH:
                    y += tl.reshape(_row_sums(part, BLOCK_N, SUB * G * 8, TREE), [BLOCK_N])
            if ROWS:  # one layout at every T: batch invariant (see `_row_sums`)
                y += tl.sum(tl.sum(part, axis=0), axis=0)  # [BN]
            elif not (EACH or HOST):
                y += tl.reshape(_row_sums(part, BLOCK_N, SUB * G * 8, TREE), [BLOCK_N])
    if HOST:  # the sums are added by `_add_rows_kernel`
        return
    if SPLIT > 1:  # the last of the SPLIT programs to arrive adds their partials in order
        parts = part_ptr + t * SPLIT * H + n  # [BN] of split 0
        tl.store(parts + tl.program_id(2) * H, y, mask=n < H)
        if not last_to_arrive(count_ptr + t * tl.num_programs(1) + tl.program_id(1), SPLIT):
            return
        y = tl.zeros([BLOCK_N], tl.float32)
        for j in tl.static_range(SPLIT):
            y += tl.load(parts + j * H, mask=n < H, other=0.0, cache_modifier=".cg")
    tl.store(out_ptr + t * stride_ot + n, y.to(out_ptr.dtype.element_ty), mask=n < H)


@triton.jit
def _add_rows_kernel(each_ptr, host_ptr, ids_ptr, slot_ptr, out_ptr, H, stride_ot,
                     TOPK: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Program (token t, block of H rows): out[t] = ((0 + R_0) + R_1) + ... + R_{k-1}, R_j the
    host's row of assignment a = t * k + j where its expert's slot is negative, else the down
    kernel's (each[a]): the sums the down kernel adds in the same order (`EACH`), so the
    token's bits do not depend on which experts the host computed."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    y = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOPK):
        a = t * TOPK + j
        host = n * 0 + tl.load(slot_ptr + tl.load(ids_ptr + a)) < 0
        mine = tl.load(each_ptr + a * H + n, mask=(n < H) & ~host, other=0.0)
        y += tl.where(host, tl.load(host_ptr + a * H + n, mask=(n < H) & host, other=0.0), mine)
    tl.store(out_ptr + t * stride_ot + n, y.to(out_ptr.dtype.element_ty), mask=n < H)


# The launch shape `moe.fused_moe` takes when given none: gate/up by the "once" kernel, 4 rows a
# program, all 8 groups of H = 2048 in one step, 1 warp. H200, Qwen3-30B-A3B layer, Q4_K/Q6_K,
# T = 1 (`bench/kernels_gpu.py --sweep-moe-once`, 2026-11-30): 26.7 us for the layer with 8 rows
# and 2 warps against 29.8 for the tile kernel's default shape, 4 rows 27.1, 4 rows and 1 warp
# 27.6. In the model the ranking differs (bench/RESULTS.md, tenth session): Nsight Compute put
# both MoE decode kernels under half a wave at T = 1 (768 gate/up programs, 14 us at 21% of DRAM
# throughput), and the 30B's batch-1 decode ran +2.8% with 4 rows (twice the programs), +4.5%
# more with one warp each (456-457 -> 469-470 -> 490-493 tok/s; 8 requests unchanged), while
# halving the down kernel's rows lost 8%. Warps and rows per program leave a row's arithmetic
# as it is (tests: rows under the interpreter; the dense once kernel's warps on the H200), so
# `moestream tune` may cache other gate/up rows and warps per device and shape (`tuned_config`).
DEFAULT_CONFIG = MoeMmvqConfig(up_once=True, up_block_n=4, up_groups=8, up_warps=1)

# Down-kernel fields that make a token's output reproducible on the CPU (`moestream.native`):
# each expert's tile reduced on its own by `tree_sum` in the [1, rows, runs, words] tile, so
# that y = ((0 + T_0) + T_1) + ... with T_j one expert's sum, which the CPU can compute for the
# experts it holds. With one expert a chunk instead of `down_each` (the same bits), the 30B's
# batch-1 decode lost 17.5% on the H200 (bench/RESULTS.md, thirteenth session).
REPRODUCIBLE_DOWN = {"down_each": True, "down_tree": True, "down_rows": False}

# The launch shape of the zero-copy placement (`experts.zero_copy`: experts read by address,
# some of them across the host link). H200, 30B layer with half its experts in pinned host memory
# (`python bench/kernels_gpu.py --sweep-moe-host`, 2026-11-30): one group per K step and 8 warps
# for gate/up, 399 / 3,543 us at T = 1 / 8 against 426 / 4,060 for the device default; the host
# link delivered 27-29 GB/s of expert bytes at T = 1 in every shape tried (16).
ZERO_COPY_CONFIG = MoeMmvqConfig(up_groups=1, up_warps=8)
# The launch shape of zero-copy placement with experts computed by the host
# (`experts.host_compute`): the default "once" gate/up, the reproducible down.
HYBRID_CONFIG = replace(DEFAULT_CONFIG, **REPRODUCIBLE_DOWN)


def tuned_config(
    device: torch.device, gate: QTensor, up: QTensor, down: QTensor, tokens: int, top_k: int
) -> MoeMmvqConfig:
    """DEFAULT_CONFIG with the gate/up rows per program and warps that `moestream tune` cached
    for this device and shape (`kernels.tuning`; tokens rounded up to a power of two), if any:
    they leave every row's arithmetic, hence every bit, as it is. The down kernel's launch is
    never tuned (its per-step `tl.sum` order follows its rows and warps: `_row_sums`)."""
    h, f = gate.shape[2], gate.shape[1]
    shape = MoeShape(
        weight_label(gate.qtype, gate.padded), weight_label(up.qtype, up.padded),
        weight_label(down.qtype, down.padded), h, f, top_k, next_power_of_2(tokens),
    )  # fmt: skip
    return tuned(device, shape, DEFAULT_CONFIG)


def moe_mmvq_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate: QTensor,
    up: QTensor,
    down: QTensor,
    expert_slot: torch.Tensor,
) -> torch.Tensor:
    """Reference of the "mmvq" path (same contract as `ops.moe_forward_ref`) -> float32 [T, H]:
    x and each h = silu(gate x) * up x are rounded to q8 blocks as the kernels do, the
    products computed in float64 from those values."""
    from moestream.kernels.mmvq import dequantize_q8, quantize_q8_ref

    xs = dequantize_q8(quantize_q8_ref(x.float())).double()  # [T, H]
    out = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            s = int(expert_slot[int(topk_ids[t, j])])
            g = (xs[t] @ gate[s].dequantize(torch.float32).double().t()).float()  # [F]
            u = (xs[t] @ up[s].dequantize(torch.float32).double().t()).float()
            h = dequantize_q8(quantize_q8_ref((g * torch.sigmoid(g) * u)[None])).double()[0]
            y = h @ down[s].dequantize(torch.float32).double().t()  # [H]
            out[t] += float(topk_weights[t, j]) * y
    return out.float()


def mmvq_counters(
    assignments: int, f: int, device: torch.device | str, h: int = 0, top_k: int = 1
) -> torch.Tensor:
    """The arrival counters of the "mmvq" path's epilogues: int32 zeros, [assignments * F / 32]
    for the gate/up's (K split, or the "once" kernel's q8 blocks), at least (assignments /
    top_k) * H for the down's expert split (`MoeMmvqConfig.down_split` > 1: a token's blocks
    of rows; H = 0: none). Every launch leaves them at zero, so one buffer serves every launch
    of up to `assignments` pairs in stream order (the two kernels run one after the other;
    launches that may run concurrently need one each)."""
    return arrival_counters(max(assignments * (f // 32), assignments // top_k * h), device)


def _arrivals(counters: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """n arrival counters for a kernel's epilogue: the caller's, checked, or fresh ones."""
    if counters is None:
        counters = arrival_counters(n, device)
    check_counters(counters, n, device)
    return counters


def _divisor_at_most(n: int, most: int) -> int:
    return max(c for c in range(1, min(n, most) + 1) if n % c == 0)


def check_xa(xa: Q8Act, x: torch.Tensor) -> None:
    """That `xa` can stand for x [T, H] in the MoE kernels: its q8 blocks' shapes, the d and s
    row strides they share, unit last strides, x's device."""
    t, h = x.shape
    if (
        xa.rows != t
        or xa.k != h
        or xa.d.shape != (t, h // 32)
        or xa.s.shape != xa.d.shape
        or xa.s.stride(0) != xa.d.stride(0)
        or any(v.stride(-1) != 1 or v.device != x.device for v in xa)
    ):
        raise ValueError(f"xa must be the q8 blocks of x [{t}, {h}] (quantize_q8) on x's device")


def _expert_tables(
    topk_ids: torch.Tensor, expert_slot: torch.Tensor | None, expert_addr: torch.Tensor | None
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(addr, its experts, slot) as the kernels take them: the table in use, and topk_ids as an
    unused pointer in place of the other."""
    slot = expert_slot if expert_slot is not None else topk_ids
    if expert_addr is not None:  # a slot table beside it marks host experts (`host_rows`)
        return expert_addr, expert_addr.shape[1], slot
    return topk_ids, 0, slot


def gate_up_q8(
    xa: Q8Act,
    topk_ids: torch.Tensor,
    gate: QTensor,
    up: QTensor,
    expert_slot: torch.Tensor | None,
    expert_addr: torch.Tensor | None,
    cfg: MoeMmvqConfig,
    counters: torch.Tensor | None,
    hf: torch.Tensor | None = None,
    host: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The "mmvq" path's gate/up launch: h = silu(gate x) * up x of every assignment (token
    a // k against expert topk_ids[a]), rounded to q8 blocks -> (hq [A, F/4] int32 words,
    hd [A, F/32], hs [A, F/32] float32), as the down kernel reads them. `hf` (float32 [A, F]):
    the "once" kernel's buffer for h before rounding where it takes fewer than 32 rows a
    program (tests read it). `host`: experts whose slot is negative are computed by the host
    (their rows of the outputs are left as they are; the "once" kernel only)."""
    if host and (not cfg.up_once or expert_slot is None):
        raise ValueError("host experts need the once gate/up and a slot table (or marks)")
    a, k, h, f = topk_ids.numel(), topk_ids.shape[1], gate.shape[2], gate.shape[1]
    hq = torch.empty((a, f // 4), dtype=torch.int32, device=xa.q.device)  # [A, F/4]
    hd = torch.empty((a, f // 32), dtype=torch.float32, device=xa.q.device)  # [A, F/32]
    hs = torch.empty_like(hd)
    addr, n_addr, slot = _expert_tables(topk_ids, expert_slot, expert_addr)
    use_addr = expert_addr is not None
    asm = use_asm(xa.q.device)
    strides = (gate.data.stride(0), gate.data.stride(1), up.data.stride(0), up.data.stride(1))
    if cfg.up_once:
        block_n = cfg.up_block_n
        count = hd  # unused pointers when a program writes whole q8 blocks
        if block_n < 32:
            if hf is None:
                hf = torch.empty((a, f), dtype=torch.float32, device=xa.q.device)
            count = _arrivals(counters, a * (f // 32), xa.q.device)
        else:
            hf = hd
        groups = up_groups(cfg, h)
        _gate_up_once_kernel[(a, f // block_n)](
            xa.q, xa.d, xa.s, topk_ids, slot, gate.data, up.data, hq, hd, hs, addr, hf, count,
            n_addr, a, xa.q.stride(0), xa.d.stride(0), *strides,
            F=f, QG=kernel_qtype(gate), QU=kernel_qtype(up), H_GROUPS=h // 256, TOPK=k, G=groups,
            BLOCK_N=block_n, ADDR=use_addr, ASM=asm, HOST=host,
            num_warps=capped_warps(cfg.up_warps, runs_per_group(gate.qtype, up.qtype), groups),
            **pdl_args(xa.q.device), **FP_EXACT,
        )  # fmt: skip
    else:
        split = _divisor_at_most(h // 256, cfg.up_split)  # K splits of whole groups
        part = count = hd  # unused pointers without a split
        if split > 1:
            part = torch.empty((split, 2, a, f), dtype=torch.float32, device=xa.q.device)
            count = _arrivals(counters, a * (f // 32), xa.q.device)
        _gate_up_mmvq_kernel[(a, f // 32, split)](
            xa.q, xa.d, xa.s, topk_ids, slot, gate.data, up.data, hq, hd, hs, addr, part, count,
            n_addr, a, xa.q.stride(0), xa.d.stride(0), *strides,
            F=f, QG=kernel_qtype(gate), QU=kernel_qtype(up), H_GROUPS=h // 256, TOPK=k,
            G=min(cfg.up_groups, triton.next_power_of_2(h // 256 // split)), SPLIT=split,
            FUSED=cfg.up_fused, TREE=cfg.up_tree, ADDR=use_addr, ASM=asm,
            num_warps=cfg.up_warps, **pdl_args(xa.q.device), **FP_EXACT,
        )  # fmt: skip
    return hq, hd, hs


def up_groups(cfg: MoeMmvqConfig, h: int) -> int:
    """Groups of 256 per K step of the "once" gate/up kernel for hidden size h."""
    return min(cfg.up_groups, triton.next_power_of_2(h // 256))


def down_groups(cfg: MoeMmvqConfig, f: int) -> int:
    """Groups of 256 per step of the down kernel for FFN width f: `cfg.down_groups` capped at
    f's, raised to all of f with `down_each` (the host tier computes that step)."""
    g = triton.next_power_of_2(f // 256)
    return g if cfg.down_each else min(cfg.down_groups, g)


def fused_moe_mmvq(
    x: torch.Tensor,
    xa: Q8Act | None,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate: QTensor,
    up: QTensor,
    down: QTensor,
    expert_slot: torch.Tensor | None,
    expert_addr: torch.Tensor | None,
    out: torch.Tensor,
    cfg: MoeMmvqConfig,
    counters: torch.Tensor | None,
    host_rows: torch.Tensor | HostWork | None = None,
) -> torch.Tensor:
    """The "mmvq" path of `moe.fused_moe` (the other arguments checked there; `xa` and
    `counters` here) -> out: three launches (x's quantization unless `xa` is given, gate/up,
    down).

    `host_rows` (float32 [A, H]): the experts whose slot is negative were computed by the host
    (`moestream.native`: gate/up, SiLU, h's rounding and the weighted down sum of each, with
    this path's bits), row a for assignment a; the kernels skip those experts and add their
    rows in their place. With `expert_addr`, `expert_slot` only marks them (negative: the
    host's). Needs `cfg` with `REPRODUCIBLE_DOWN`'s fields and the "once" gate/up: the output
    then has the bits it has with every expert here. A `HostWork` instead of the rows: its
    `begin` is called before the gate/up launch and its `rows` after the down launch, so
    that the host computes while the GPU runs the other experts' gate/up and down; a fourth
    launch then adds each token's rows in order (`_add_rows_kernel`)."""
    if not all(w.qtype in MMVQ_QTYPES for w in (gate, up, down)):
        raise ValueError("mmvq: gate, up and down must be of MMVQ_QTYPES")
    t, h = x.shape
    k = topk_ids.shape[1]
    f = gate.shape[1]
    if xa is None:
        xa = quantize_q8(x)  # [T, H] -> q8 blocks
    else:
        check_xa(xa, x)
    addr, n_addr, slot = _expert_tables(topk_ids, expert_slot, expert_addr)
    use_addr = expert_addr is not None
    asm = use_asm(x.device)
    host = host_rows is not None
    if host:
        fields = {name: getattr(cfg, name) for name in REPRODUCIBLE_DOWN}
        if fields != REPRODUCIBLE_DOWN or cfg.down_split != 1 or expert_slot is None:
            raise ValueError("host_rows need REPRODUCIBLE_DOWN, no down split, a slot table")
    work = None if isinstance(host_rows, torch.Tensor) else host_rows
    if work is None:
        _check_host_rows(host_rows, topk_ids, h)
    else:
        work.begin(topk_ids, topk_weights, xa)
    hq, hd, hs = gate_up_q8(
        xa, topk_ids, gate, up, expert_slot, expert_addr, cfg, counters, host=host
    )
    split = _divisor_at_most(k, cfg.down_split)  # experts spread over programs
    chunk = _divisor_at_most(k // split, cfg.down_experts)
    blocks = triton.cdiv(h, cfg.down_block_n)
    part = count = hd  # unused pointers without a split
    each = torch.empty((t * k, h), dtype=torch.float32, device=x.device) if host else None
    if split > 1:
        part = torch.empty((t, split, h), dtype=torch.float32, device=x.device)
        count = _arrivals(counters, t * blocks, x.device)
    _down_mmvq_kernel[(t, blocks, split)](
        hq, hd, hs, topk_ids, topk_weights, slot, down.data, out, addr, part, count,
        n_addr, h, down.data.stride(0), down.data.stride(1), out.stride(0),
        QD=kernel_qtype(down), F=f, TOPK=k, BLOCK_N=cfg.down_block_n,
        G=down_groups(cfg, f), CHUNK=chunk, SPLIT=split, TREE=cfg.down_tree,
        ROWS=cfg.down_rows and down.qtype == GGMLQuantizationType.Q6_K and not cfg.down_each,
        ADDR=use_addr, ASM=asm, num_warps=cfg.down_warps, **pdl_args(out.device), **FP_EXACT,
        each_ptr=each, HOST=host, EACH=cfg.down_each,
    )  # fmt: skip
    if host:
        if work is not None:
            host_rows = work.rows()
            _check_host_rows(host_rows, topk_ids, h)
        _add_rows_kernel[(t, triton.cdiv(h, ADD_BLOCK_N))](
            each, host_rows, topk_ids, slot, out, h, out.stride(0), TOPK=k,
            BLOCK_N=ADD_BLOCK_N, **FP_EXACT,
        )  # fmt: skip
    return out


# Rows a program of `_add_rows_kernel` adds (k rows of 1 KiB each).
ADD_BLOCK_N = 256


def _check_host_rows(rows: torch.Tensor | None, topk_ids: torch.Tensor, h: int) -> None:
    if rows is not None and (rows.shape != (topk_ids.numel(), h) or rows.dtype != torch.float32):
        raise ValueError(f"host_rows must be float32 [{topk_ids.numel()}, {h}]")

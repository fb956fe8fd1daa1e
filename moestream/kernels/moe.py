"""Fused MoE FFN over stacked quantized experts: one launch per stage for all experts of a layer.

out[t] = sum_j w[t, j] * down_s(silu(gate_s x[t]) * up_s x[t]),  s = expert_slot[topk_ids[t, j]]

Expert weights are found through the device-side `expert_slot` table, so no host round trip is
needed when the experts are in place. Five paths (`default_method` picks by A, types, device):
- decode, integer dots ("mmvq", T*k <= MMVQ_DEFAULT_MAX_ASSIGNMENTS by default and at most
  MMVQ_MAX_ASSIGNMENTS, Q4_K/Q5_K/Q6_K/Q8_0): x rounded
  to q8 blocks (`kernels.mmvq`, one launch, or the caller's), then one program per
  (assignment, 32 F rows, K split) for gate and up loaded in the same K steps, the last split
  to arrive adding the partials in split order and fusing SiLU and h's q8 rounding; then one
  program per (token, block of H rows) that walks the token's k experts a few at a time
  (scalar ids and pointers), routing weight folded into the block scales, written straight
  into out [T, H]: three launches. Launch variants in `MoeMmvqConfig`; every one keeps a
  token's bits independent of the batch (one build at every T, fixed-order sums, no atomics
  in the sums).
- batched decode, int8 tensor cores ("mmq", up to MMQ_MAX_ASSIGNMENTS, same types;
  `kernels.mmq.moe_mmq`): assignments grouped by expert, weights unpacked to int8 and
  multiplied with q8 activations by `tl.dot` per sub-block of 32, block scales in float32.
- large batches and prefill with bf16 activations on sm_90 ("dequant", `kernels.dequant_mm`):
  the routed experts dequantized to bf16, torch's grouped GEMM for gate+up and for down.
- decode, float ("gemv", T*k <= GEMV_MAX_ASSIGNMENTS, other types): GEMV-style, two launches.
  Stage 1 runs one program per (assignment, block of F rows) for gate and up together, SiLU
  fused, h [T*k, F] float32;
  stage 2 one program per (token, block of H rows) that walks the token's k experts in selection
  order and writes the routing-weighted sum straight into out [T, H].
- other prefill cases ("gemm", two launches): tokens grouped by expert (`align_assignments`,
  device-side torch ops, no sync) into blocks of BLOCK_M assignments of one expert; stage 1 is
  a grouped GEMM with gate and up dequantized per tile and `tl.dot`, SiLU fused, h [T*k, F] in
  x's dtype; stage 2 a grouped GEMM whose rows are scaled by their routing weight into
  y [T*k, H] float32, summed
  over k in a fixed order afterwards (deterministic, no atomics).

Letters: T tokens, H hidden, F expert FFN, E experts, S weight slots, k experts per token,
A = T*k assignments.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from moestream.kernels._triton_dequant import ACTIVATION_DTYPES, MAGIC, check_weight
from moestream.kernels.mmvq import (
    MMVQ_QTYPES,
    Q8Act,
    _f16,
    _i2f,
    _word16,
    acc_runs,
    dp4a,
    mmvq_rows,
    quantize_q8,
    tree_sum,
    use_asm,
)
from moestream.kernels.quant_gemm import dot_precision, dot_superblock
from moestream.kernels.quant_gemv import gemv_rows
from moestream.weights.qtensor import QTensor

GEMV_MAX_ASSIGNMENTS = 64  # the float GEMV path's limit
# The integer-dot path's limit. H200, Qwen3-30B-A3B layer (bench/kernels_gpu.py, bench/RESULTS.md):
# mmvq 34.6 us at T=1 and 179 us at T=8 (A=64); the grouped GEMM 787 us at T=16 and 1,012 us at
# T=32. mmvq was not timed above A=64; its time is expected to grow at most linearly in A
# (each assignment reads its expert once; distinct experts grow slower), which would keep it
# under 4 x 179 = 716 us up to A=256, below the GEMM. To confirm on a GPU.
MMVQ_MAX_ASSIGNMENTS = 256
# The default path by assignments A, for MMVQ_QTYPES. H200, Qwen3-30B-A3B layer, Q4_K/Q6_K
# (bench/mmq_gpu.py, bench/kernels_gpu.py): mmvq / mmq / dequantize + grouped GEMM at T=8
# 172 / 251 / - us, T=16 316 / 333 / -, T=32 597 / 459 / 990, T=64 1145 / 517 / 1088,
# T=512 - / - / 1213. mmq was not timed above T=64: its limit of A=1024 (T=128) is an estimate
# (it grew 459 -> 517 us from T=32 to 64, with every expert already read).
MMVQ_DEFAULT_MAX_ASSIGNMENTS = 128
MMQ_MAX_ASSIGNMENTS = 1024
# The "dequant" path writes every routed expert of the layer as bf16 at once (1.2 GB for
# Qwen3-30B-A3B); a layer whose copies would exceed this takes the grouped Triton GEMM instead.
DEQUANT_MAX_SCRATCH_BYTES = 4 << 30


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr, ids_ptr, slot_ptr, g_ptr, u_ptr, h_ptr,
    F, stride_xt, stride_ge, stride_gn, stride_ue, stride_un, magic,
    QG: tl.constexpr, QU: tl.constexpr, H_GROUPS: tl.constexpr, TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    a = tl.program_id(0)  # assignment t * TOPK + j
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, F - 1).to(tl.int64)
    slot = tl.load(slot_ptr + tl.load(ids_ptr + a)).to(tl.int64)
    g_rows = g_ptr + slot * stride_ge + nc * stride_gn  # [BLOCK_N]
    u_rows = u_ptr + slot * stride_ue + nc * stride_un
    x_row = x_ptr + (a // TOPK).to(tl.int64) * stride_xt
    g = gemv_rows(g_rows, x_row, 0, magic, H_GROUPS, UNROLL, QG, BLOCK_N)  # [BLOCK_N]
    u = gemv_rows(u_rows, x_row, 0, magic, H_GROUPS, UNROLL, QU, BLOCK_N)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + a.to(tl.int64) * F + n, h.to(h_ptr.dtype.element_ty), mask=n < F)


@triton.jit
def _down_gemv_kernel(
    h_ptr, ids_ptr, weights_ptr, slot_ptr, d_ptr, out_ptr,
    H, stride_de, stride_dn, stride_ot, magic,
    QD: tl.constexpr, F_GROUPS: tl.constexpr, TOPK: tl.constexpr, BLOCK_N: tl.constexpr,
    UNROLL: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, H - 1).to(tl.int64)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for j in range(TOPK):
        a = t * TOPK + j
        slot = tl.load(slot_ptr + tl.load(ids_ptr + a)).to(tl.int64)
        weight = tl.load(weights_ptr + a).to(tl.float32)
        rows = d_ptr + slot * stride_de + nc * stride_dn
        h_row = h_ptr + a.to(tl.int64) * (F_GROUPS * 256)
        acc += weight * gemv_rows(rows, h_row, 0, magic, F_GROUPS, UNROLL, QD, BLOCK_N)
    dst = out_ptr + t.to(tl.int64) * stride_ot + n
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=n < H)


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
    h = g * tl.sigmoid(g) * u  # [1, 32]
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


@triton.jit(do_not_specialize=["A"])  # one build at every T: see `_row_sums`
def _gate_up_mmvq_kernel(
    xq_ptr, xd_ptr, xs_ptr, ids_ptr, slot_ptr, g_ptr, u_ptr, hq_ptr, hd_ptr, hs_ptr, addr_ptr,
    part_ptr, count_ptr,
    E_ADDR, A, stride_xq, stride_xd, stride_ge, stride_gn, stride_ue, stride_un,
    F: tl.constexpr, QG: tl.constexpr, QU: tl.constexpr, H_GROUPS: tl.constexpr,
    TOPK: tl.constexpr, G: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr,
    TREE: tl.constexpr, ADDR: tl.constexpr, ASM: tl.constexpr,
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
    a = tl.program_id(0)
    blk = tl.program_id(1)
    s = tl.program_id(2)
    n = (blk * 32 + tl.arange(0, 32)).to(tl.int64)  # F is a multiple of 256: no tail
    eid = tl.load(ids_ptr + a)
    if ADDR:
        # 16-byte aligned (the caller's contract): lets the weight loads stay vectorized
        g_base = tl.multiple_of(tl.load(addr_ptr + eid), 16).to(tl.pointer_type(tl.uint8))
        u_base = tl.multiple_of(tl.load(addr_ptr + E_ADDR + eid), 16).to(tl.pointer_type(tl.uint8))
    else:
        slot = tl.load(slot_ptr + eid).to(tl.int64)
        g_base = g_ptr + slot * stride_ge
        u_base = u_ptr + slot * stride_ue
    t = (a // TOPK).to(tl.int64)
    xq, xd, xs = xq_ptr + t * stride_xq, xd_ptr + t * stride_xd, xs_ptr + t * stride_xd
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
        # Every thread's partials stored before the release below (the "last block" pattern).
        tl.debug_barrier()
        counter = count_ptr + a64 * (F // 32) + blk
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:  # the block's last program: every split's sums are out
            tl.store(counter, 0)  # ready for the next launch (and CUDA-graph replays)
            g = tl.zeros([1, 32], tl.float32)
            u = tl.zeros([1, 32], tl.float32)
            for j in tl.static_range(SPLIT):  # split order: the same bits whoever arrives last
                g += tl.load(part_ptr + ((2 * j) * A + a64) * F + cols, cache_modifier=".cg")
                u += tl.load(part_ptr + ((2 * j + 1) * A + a64) * F + cols, cache_modifier=".cg")
            _store_h_q8(g, u, hq_ptr, hd_ptr, hs_ptr, a, blk, F)


@triton.jit
def _acc_q6_k_rows(acc, rows, sb, c, ok, wt, xq, xd, ASM: tl.constexpr):
    """Add Q6_K runs to acc [R, 8, BN] ("rows" tile: run r, word w, weight row; the layout of
    `mmvq._acc_q6_k` otherwise, words in the same permuted order). rows [1, 1, BN] byte
    pointers to row starts; sb, c, ok [R, 1, 1]. The activation words and scales are loaded
    once as [R, 8, 1] and broadcast over the rows: in the sm_90 build that load gets the
    tile's layout (runs and words on the lanes, rows in registers), so the broadcast is free
    and no shared-memory conversion is needed, where the [1, BN, R, 8] tile of `acc_runs`
    loads them per row."""
    zx = tl.zeros([acc.shape[0], 8, 1], tl.int32)
    w = (tl.arange(0, 8)[None, :, None] * 3) % 8 + zx  # [R, 8, 1], permuted: see _acc_q6_k
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
    base = rows + sb * 210 + z  # [R, 8, BN]
    h = base.to(tl.pointer_type(tl.int16))
    ql = _word16(h + 32 * n + 16 * t + 2 * wf, okf)
    qh = _word16(h + 64 + 16 * n + 2 * wf, okf)
    v0 = (ql & 0x0F0F0F0F) | (((qh >> (2 * t)) & 0x03030303) << 4)  # quarter t
    v1 = ((ql >> 4) & 0x0F0F0F0F) | (((qh >> (2 * t + 4)) & 0x03030303) << 4)  # 2 + t
    m32 = z - 522133280  # bytes 0xE0 = -32: the quants' offset, as one more dp4a
    sp = (base + 192 + 8 * n + 2 * t + wf // 4).to(tl.pointer_type(tl.int8))
    sc0 = tl.load(sp, mask=okf, other=0).to(tl.int32)
    sc1 = tl.load(sp + 4, mask=okf, other=0).to(tl.int32)
    x0f = x0 + z
    x1f = x1 + z
    f0 = _i2f(sc0 * dp4a(m32, x0f, dp4a(v0, x0f, z, ASM), ASM))
    f1 = _i2f(sc1 * dp4a(m32, x1f, dp4a(v1, x1f, z, ASM), ASM))
    d = _f16(base + 208, okf) * wt
    acc = tl.fma(d * xd0, f0, acc)  # explicit FMAs: see `mmvq._acc_q4_k`
    return tl.fma(d * xd1, f1, acc)


@triton.jit
def _down_mmvq_kernel(
    hq_ptr, hd_ptr, hs_ptr, ids_ptr, weights_ptr, slot_ptr, d_ptr, out_ptr, addr_ptr,
    E_ADDR, H, stride_de, stride_dn, stride_ot,
    QD: tl.constexpr, F: tl.constexpr, TOPK: tl.constexpr, BLOCK_N: tl.constexpr,
    G: tl.constexpr, CHUNK: tl.constexpr, TREE: tl.constexpr, ROWS: tl.constexpr,
    ADDR: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Program (token t, block of H rows): out[t] = sum_j weight_j * down_slot_j(h_{t,j}).

    The token's k experts are taken CHUNK at a time (a runtime loop over chunks, so only one
    chunk's loads are live: registers, hence occupancy); a chunk's experts are unrolled (a
    static loop) over one tile per K step that accumulates them in selection order and is
    reduced once (`_row_sums`, or a plain sum with ROWS); the (chunk, step) sums are added in
    order. The tile is [1, BN, SUB*G, 8] (`mmvq.acc_runs`, any type) or with ROWS (Q6_K)
    [SUB*G, 8, BN] (`_acc_q6_k_rows`: activations loaded once for all BN rows). Each
    expert's id, weight and base pointer are scalars: had they been a tensor dimension, their
    loads would have had a register layout of their own, and moving the pointers derived from
    them into the tile's layout cost a shared-memory conversion (and a barrier) per load (seen
    in the sm_90 build). The routing weight scales each expert's block scales. With ADDR,
    expert e's down weight is at byte address addr[2, e]. F // 256 groups per step of G."""
    SUB: tl.constexpr = 8 if QD == 8 else 4  # runs of 8 words per group (Q8_0: 8 blocks)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nr = tl.minimum(n, H - 1).to(tl.int64)
    if ROWS:
        tl.static_assert(QD == 14, "the rows tile is for Q6_K")
        nc = nr[None, None, :]  # [1, 1, BN]
        r = tl.arange(0, SUB * G)[:, None, None]  # (group, run) [R, 1, 1]
    else:
        nc = nr[None, :, None, None]  # [1, BN, 1, 1]
        r = tl.arange(0, SUB * G)[None, None, :, None]
    y = tl.zeros([BLOCK_N], tl.float32)
    for c in tl.range(0, TOPK, CHUNK, loop_unroll_factor=1):
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
                if ADDR:
                    d_base = tl.multiple_of(tl.load(addr_ptr + 2 * E_ADDR + eid), 16)
                    d_base = d_base.to(tl.pointer_type(tl.uint8))
                else:
                    d_base = d_ptr + tl.load(slot_ptr + eid).to(tl.int64) * stride_de
                wt = tl.load(weights_ptr + a).to(tl.float32)
                rows = d_base + nc * stride_dn
                xq, xd, xs = hq_ptr + a * (F // 4), hd_ptr + a * (F // 32), hs_ptr + a * (F // 32)
                if ROWS:
                    part = _acc_q6_k_rows(part, rows, sb, r % SUB, ok, wt, xq, xd, ASM)
                else:
                    part = acc_runs(part, rows, sb, r % SUB, ok, wt, xq, xd, xs, QD, ASM)
            if ROWS:  # one layout at every T: batch invariant (see `_row_sums`)
                y += tl.sum(tl.sum(part, axis=0), axis=0)  # [BN]
            else:
                y += tl.reshape(_row_sums(part, BLOCK_N, SUB * G * 8, TREE), [BLOCK_N])
    tl.store(out_ptr + t * stride_ot + n, y.to(out_ptr.dtype.element_ty), mask=n < H)


@triton.jit
def _gate_up_gemm_kernel(
    x_ptr, sorted_ptr, block_expert_ptr, slot_ptr, g_ptr, u_ptr, h_ptr,
    A, E, F, stride_xt, stride_ge, stride_gn, stride_ue, stride_un, magic,
    QG: tl.constexpr, QU: tl.constexpr, H_GROUPS: tl.constexpr, TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    pid_b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_b)
    if expert >= E:  # a spare block past the last expert's
        return
    slot = tl.load(slot_ptr + expert).to(tl.int64)
    assign = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    valid = assign < A
    token = tl.where(valid, assign // TOPK, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, F - 1).to(tl.int64)
    x_rows = x_ptr + token * stride_xt  # [BLOCK_M]
    g_rows = g_ptr + slot * stride_ge + nc * stride_gn  # [BLOCK_N]
    u_rows = u_ptr + slot * stride_ue + nc * stride_un
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for sb in range(H_GROUPS):
        acc_g = dot_superblock(
            acc_g, x_rows, g_rows, sb, magic, QG, BLOCK_M, BLOCK_N, PRECISION, DOT_F32
        )
        acc_u = dot_superblock(
            acc_u, x_rows, u_rows, sb, magic, QU, BLOCK_M, BLOCK_N, PRECISION, DOT_F32
        )
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    dst = h_ptr + assign[:, None].to(tl.int64) * F + n[None, :]
    tl.store(dst, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & (n[None, :] < F))


@triton.jit
def _down_gemm_kernel(
    h_ptr, sorted_ptr, block_expert_ptr, slot_ptr, d_ptr, weights_ptr, y_ptr,
    A, E, H, stride_de, stride_dn, magic,
    QD: tl.constexpr, F_GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    pid_b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_b)
    if expert >= E:
        return
    slot = tl.load(slot_ptr + expert).to(tl.int64)
    assign = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    valid = assign < A
    ac = tl.where(valid, assign, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, H - 1).to(tl.int64)
    h_rows = h_ptr + ac * (F_GROUPS * 256)  # [BLOCK_M]
    d_rows = d_ptr + slot * stride_de + nc * stride_dn  # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for sb in range(F_GROUPS):
        acc = dot_superblock(
            acc, h_rows, d_rows, sb, magic, QD, BLOCK_M, BLOCK_N, PRECISION, DOT_F32
        )
    weight = tl.load(weights_ptr + ac).to(tl.float32)  # [BLOCK_M]
    dst = y_ptr + ac[:, None] * H + n[None, :]
    tl.store(dst, acc * weight[:, None], mask=valid[:, None] & (n[None, :] < H))


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
    invariant; the unfused gate/up always takes trees, the "rows" tile always plain sums)."""

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

    def __post_init__(self) -> None:
        for name in ("up_groups", "up_split", "down_block_n", "down_groups", "down_experts"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"MoeMmvqConfig.{name} must be a power of two, got {v}")
        for name in ("up_warps", "down_warps"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"MoeMmvqConfig.{name} must be 1, 2, 4, 8 or 16")


def default_method(
    a: int,
    gate: QTensor,
    up: QTensor,
    down: QTensor,
    x: torch.Tensor | None = None,
    num_experts: int | None = None,
) -> str:
    """The path for A assignments: where all three types are MMVQ_QTYPES, integer-dot "mmvq" up
    to MMVQ_DEFAULT_MAX_ASSIGNMENTS and int8 tensor-core "mmq" up to MMQ_MAX_ASSIGNMENTS; else
    the float "gemv" up to GEMV_MAX_ASSIGNMENTS; above, "dequant" (bf16 weights and torch's
    grouped GEMM) where `dequant_mm.grouped_mm_available` for x (bfloat16 on CUDA) and the
    layer's bf16 copies (`num_experts` experts, default the stacks' slots) fit
    DEQUANT_MAX_SCRATCH_BYTES, else the grouped Triton GEMM. With cached bf16 copies of all
    three stacks (`--weight-cache-gib`), "dequant" from MMVQ_DEFAULT_MAX_ASSIGNMENTS + 1 on (no
    dequantizing left: the grouped GEMM reads the copies). Depends on (A, types, device, dtype,
    caches) only, never on the routing (row results stay independent of other tokens' experts).
    """
    if (
        a > MMVQ_DEFAULT_MAX_ASSIGNMENTS
        and x is not None
        and _dequant_ok(x)
        and all(w.values_in(x.dtype) is not None for w in (gate, up, down))
    ):
        return "dequant"
    if all(w.qtype in MMVQ_QTYPES for w in (gate, up, down)):
        if a <= MMVQ_DEFAULT_MAX_ASSIGNMENTS:
            return "mmvq"
        if a <= MMQ_MAX_ASSIGNMENTS:
            return "mmq"
    if a <= GEMV_MAX_ASSIGNMENTS:
        return "gemv"
    if x is not None and _dequant_ok(x):
        experts = num_experts if num_experts is not None else gate.shape[0]
        if (
            experts * 3 * gate.shape[1] * gate.shape[2] * x.element_size()
            <= DEQUANT_MAX_SCRATCH_BYTES
        ):
            return "dequant"  # every routed expert's bf16 copy at once: small enough
    return "gemm"


def _dequant_ok(x: torch.Tensor) -> bool:
    from moestream.kernels.dequant_mm import grouped_mm_available

    return grouped_mm_available(x.device) and (x.dtype == torch.bfloat16 or not x.is_cuda)


def unroll_for(groups: int) -> int:
    """Groups per loop step of the GEMV kernels: the largest of 4, 3, 2, 1 that divides."""
    return next(u for u in (4, 3, 2, 1) if groups % u == 0)


def moe_gemm_config(
    assignments_per_expert: float, dtype: torch.dtype
) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, gate/up BLOCK_N, down BLOCK_N, num_warps, num_stages) of the grouped GEMMs.

    BLOCK_M follows the mean rows per expert (16, 32, 64); gate/up holds two accumulators and
    two dequantized tiles, so it takes 32-wide tiles from BLOCK_M 32 up (no register spills at
    8 warps); float32 activations take at most 32 rows and 2 stages (shared memory).
    """
    per = assignments_per_expert
    block_m = 16 if per <= 16 else 32 if per <= 32 else 64
    stages = 3
    if dtype == torch.float32:
        block_m, stages = min(block_m, 32), 2
    gu_block_n = 64 if block_m == 16 else 32
    return block_m, gu_block_n, 64, 8, stages


def align_assignments(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the A = T*k assignments by expert into blocks of `block_m` rows, on the device.

    Returns (sorted_ids [num_blocks * block_m] int32: assignment ids, expert by expert in
    ascending order, each expert's run padded to whole blocks with the sentinel A;
    block_expert [num_blocks] int32: the expert of each block, `num_experts` for spare blocks
    past the end). num_blocks = cdiv(A, block_m) + min(E, A) bounds the blocks needed, so the
    shapes depend on (A, E, block_m) only and no count comes back to the host. `counts` [E],
    when the caller has them, are the assignments per expert (not counted again).
    """
    a = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [A]
    order = torch.argsort(flat, stable=True)  # [A] assignments grouped by expert
    if counts is None:
        counts = torch.zeros(num_experts, dtype=torch.long, device=device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E] (bincount would sync on CUDA)
    counts = counts.long()
    blocks = (counts + block_m - 1) // block_m  # [E]
    block_end = torch.cumsum(blocks, 0)  # [E]
    num_blocks = triton.cdiv(a, block_m) + min(num_experts, a)
    block_expert = torch.searchsorted(
        block_end, torch.arange(num_blocks, device=device), right=True
    )  # [num_blocks], E past the end
    expert_of = flat[order]  # [A]
    first_assign = torch.cumsum(counts, 0) - counts  # [E] position of expert e's run in `order`
    first_row = (block_end - blocks) * block_m  # [E] padded row where expert e's run starts
    rank = torch.arange(a, device=device) - first_assign[expert_of]
    sorted_ids = torch.full((num_blocks * block_m,), a, dtype=torch.int32, device=device)
    sorted_ids[first_row[expert_of] + rank] = order.to(torch.int32)
    return sorted_ids, block_expert.to(torch.int32)


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


def check_moe_args(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate: QTensor,
    up: QTensor,
    down: QTensor,
    expert_slot: torch.Tensor | None,
) -> None:
    """Shapes, strides, dtypes and devices the fused kernels need (ValueError otherwise);
    `expert_slot` None (experts found by address) is not checked."""
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be [T, H] float with unit last stride, got {x.dtype} {x.shape}")
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        check_weight(w, 3, name)
        if w.device != x.device:
            raise ValueError(f"{name} on {w.device}, x on {x.device}")
    t, h = x.shape
    s, f = gate.shape[0], gate.shape[1]
    if gate.shape != (s, f, h) or up.shape != (s, f, h) or down.shape != (s, h, f):
        raise ValueError(f"expert shapes {gate.shape} {up.shape} {down.shape} do not fit H={h}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be a contiguous [T={t}, k], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_contiguous():
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} != topk_ids' shape")
    if not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    for name, t_ in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t_.device != x.device:
            raise ValueError(f"{name} on {t_.device}, x on {x.device}")
    if expert_slot is None:
        return
    if expert_slot.dim() != 1 or expert_slot.dtype != torch.int32 or expert_slot.stride(0) != 1:
        raise ValueError(f"expert_slot must be a contiguous int32 [E], got {expert_slot.dtype}")
    if expert_slot.device != x.device:
        raise ValueError(f"expert_slot on {expert_slot.device}, x on {x.device}")


def mmvq_counters(assignments: int, f: int, device: torch.device | str) -> torch.Tensor:
    """The arrival counters of the "mmvq" gate/up split (`MoeMmvqConfig.up_split` > 1): int32
    [assignments * F / 32], zero. Every launch leaves them at zero, so one buffer serves every
    launch of up to `assignments` pairs in stream order (launches that may run concurrently
    need one each)."""
    return torch.zeros(assignments * (f // 32), dtype=torch.int32, device=device)


def _divisor_at_most(n: int, most: int) -> int:
    return max(c for c in range(1, min(n, most) + 1) if n % c == 0)


def _fused_moe_mmvq(
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
) -> torch.Tensor:
    """The "mmvq" path of `fused_moe` (arguments checked there): three launches (x's
    quantization unless `xa` is given, gate/up, down)."""
    if not all(w.qtype in MMVQ_QTYPES for w in (gate, up, down)):
        raise ValueError("mmvq: gate, up and down must be of MMVQ_QTYPES")
    t, h = x.shape
    k = topk_ids.shape[1]
    f = gate.shape[1]
    a = t * k
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
    split = _divisor_at_most(h // 256, cfg.up_split)  # K splits of whole groups
    hq = torch.empty((a, f // 4), dtype=torch.int32, device=x.device)  # [A, F/4]
    hd = torch.empty((a, f // 32), dtype=torch.float32, device=x.device)  # [A, F/32]
    hs = torch.empty_like(hd)
    part = count = hd  # unused pointers without a split
    if split > 1:
        part = torch.empty((split, 2, a, f), dtype=torch.float32, device=x.device)
        if counters is None:
            counters = mmvq_counters(a, f, x.device)
        elif (
            counters.dtype != torch.int32
            or counters.numel() < a * (f // 32)
            or not counters.is_contiguous()
            or counters.device != x.device
        ):
            raise ValueError(f"counters must be contiguous int32 of {a * (f // 32)}+ on x's device")
        count = counters
    use_addr = expert_addr is not None
    addr = expert_addr if use_addr else topk_ids  # an unused pointer otherwise
    n_addr = expert_addr.shape[1] if use_addr else 0
    slot = expert_slot if expert_slot is not None else topk_ids  # likewise
    asm = use_asm(x.device)
    strides = (gate.data.stride(0), gate.data.stride(1), up.data.stride(0), up.data.stride(1))
    _gate_up_mmvq_kernel[(a, f // 32, split)](
        xa.q, xa.d, xa.s, topk_ids, slot, gate.data, up.data, hq, hd, hs, addr, part, count,
        n_addr, a, xa.q.stride(0), xa.d.stride(0), *strides,
        F=f, QG=int(gate.qtype), QU=int(up.qtype), H_GROUPS=h // 256, TOPK=k,
        G=min(cfg.up_groups, triton.next_power_of_2(h // 256 // split)), SPLIT=split,
        FUSED=cfg.up_fused, TREE=cfg.up_tree, ADDR=use_addr, ASM=asm, num_warps=cfg.up_warps,
    )  # fmt: skip
    chunk = _divisor_at_most(k, cfg.down_experts)
    _down_mmvq_kernel[(t, triton.cdiv(h, cfg.down_block_n))](
        hq, hd, hs, topk_ids, topk_weights, slot, down.data, out, addr,
        n_addr, h, down.data.stride(0), down.data.stride(1), out.stride(0),
        QD=int(down.qtype), F=f, TOPK=k, BLOCK_N=cfg.down_block_n,
        G=min(cfg.down_groups, triton.next_power_of_2(f // 256)), CHUNK=chunk,
        TREE=cfg.down_tree, ROWS=cfg.down_rows and down.qtype == GGMLQuantizationType.Q6_K,
        ADDR=use_addr, ASM=asm, num_warps=cfg.down_warps,
    )  # fmt: skip
    return out


def fused_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate: QTensor,
    up: QTensor,
    down: QTensor,
    expert_slot: torch.Tensor | None,
    out: torch.Tensor | None = None,
    method: str | None = None,
    block_n: int | None = None,
    mmvq_cfg: MoeMmvqConfig | None = None,
    expert_addr: torch.Tensor | None = None,
    xa: Q8Act | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton MoE FFN: same contract as `ops.moe_forward_ref`, -> [T, H] in x's dtype.

    gate, up: QTensor [S, F, H]; down [S, H, F] (H and F multiples of 256, kernel types);
    expert_slot [E] int32 maps every expert that `topk_ids` names to a slot in [0, S) (not
    checked on the device: a bad slot reads out of bounds). `out`, when given, is a [T, H]
    tensor of x's dtype with unit last stride. `method` ("mmvq", "gemv" or "gemm") and `block_n`
    (a power of two; at least 16 for "gemm") override the heuristics (`default_method`).

    `expert_addr` [3, E] int64 (contiguous, on x's device), when given, replaces the stacks'
    slots: row e holds the byte addresses of expert e's gate, up and down weights (each laid
    out as one slot of `gate`/`up`/`down`, which then only give types, shapes and row strides),
    in device memory or in pinned host memory the GPU reads directly (mapped under unified
    addressing), each 16-byte aligned (not checked here: that would need a sync). It needs the
    "mmvq" path, and `expert_slot` may be None (it is not read).

    "mmvq" only: `mmvq_cfg` its launch shape (default `MoeMmvqConfig()`); `xa` x's q8 blocks
    when the caller already has them (`mmvq.quantize_q8(x)`; x then gives only shapes, dtype
    and device); `counters` the zero arrival counters of a gate/up split (`mmvq_counters`,
    left zero; a fresh buffer per call when None).
    """
    check_moe_args(x, topk_ids, topk_weights, gate, up, down, expert_slot)
    if expert_slot is None and expert_addr is None:
        raise ValueError("fused_moe needs expert_slot or expert_addr")
    if expert_addr is not None and (
        expert_addr.dtype != torch.int64
        or expert_addr.dim() != 2
        or expert_addr.shape[0] != 3
        or not expert_addr.is_contiguous()
        or expert_addr.device != x.device
    ):
        raise ValueError("expert_addr must be a contiguous int64 [3, E] on x's device")
    t, h = x.shape
    k = topk_ids.shape[1]
    f = gate.shape[1]
    a = t * k
    if out is None:
        out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    elif out.shape != (t, h) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [{t}, {h}] {x.dtype} with unit last stride")
    if t == 0:
        return out
    if method is None:
        experts = expert_slot.shape[0] if expert_slot is not None else None
        method = default_method(a, gate, up, down, x, experts)
    if method == "mmvq":
        cfg = mmvq_cfg or MoeMmvqConfig()
        if block_n:
            cfg = replace(cfg, down_block_n=block_n)
        return _fused_moe_mmvq(
            x, xa, topk_ids, topk_weights, gate, up, down, expert_slot, expert_addr, out, cfg,
            counters,
        )  # fmt: skip
    if expert_addr is not None:
        raise ValueError("expert_addr needs the mmvq path (at most 256 assignments)")
    strides = (gate.data.stride(0), gate.data.stride(1), up.data.stride(0), up.data.stride(1))
    if method == "gemv":
        block_n = block_n or 16
        hidden = torch.empty((a, f), dtype=torch.float32, device=x.device)  # [A, F]
        _gate_up_gemv_kernel[(a, triton.cdiv(f, block_n))](
            x, topk_ids, expert_slot, gate.data, up.data, hidden,
            f, x.stride(0), *strides, MAGIC,
            QG=int(gate.qtype), QU=int(up.qtype), H_GROUPS=h // 256, TOPK=k, BLOCK_N=block_n,
            UNROLL=unroll_for(h // 256), num_warps=4,
        )  # fmt: skip
        _down_gemv_kernel[(t, triton.cdiv(h, block_n))](
            hidden, topk_ids, topk_weights, expert_slot, down.data, out,
            h, down.data.stride(0), down.data.stride(1), out.stride(0), MAGIC,
            QD=int(down.qtype), F_GROUPS=f // 256, TOPK=k, BLOCK_N=block_n,
            UNROLL=unroll_for(f // 256), num_warps=4,
        )  # fmt: skip
        return out
    if method == "mmq":
        from moestream.kernels.moe_mmq import moe_mmq

        return moe_mmq(x, topk_ids, topk_weights, gate, up, down, expert_slot, out=out)
    if method == "dequant":
        from moestream.kernels.dequant_mm import moe_dequant_grouped

        if not _dequant_ok(x):
            raise ValueError(f"dequant: no grouped GEMM for {x.dtype} on {x.device}")
        return moe_dequant_grouped(x, topk_ids, topk_weights, gate, up, down, expert_slot, out)
    if method != "gemm":
        raise ValueError(f"method must be mmvq, mmq, gemv, gemm or dequant, got {method!r}")
    num_experts = expert_slot.shape[0]
    block_m, gu_block_n, down_block_n, num_warps, num_stages = moe_gemm_config(
        a / num_experts, x.dtype
    )
    gu_block_n = block_n or gu_block_n
    down_block_n = block_n or down_block_n
    sorted_ids, block_expert = align_assignments(topk_ids, num_experts, block_m)
    num_blocks = block_expert.shape[0]
    precision = dot_precision(x.dtype)
    dot_f32 = x.device.type != "cuda"
    hidden = torch.empty((a, f), dtype=x.dtype, device=x.device)  # [A, F]
    _gate_up_gemm_kernel[(num_blocks, triton.cdiv(f, gu_block_n))](
        x, sorted_ids, block_expert, expert_slot, gate.data, up.data, hidden,
        a, num_experts, f, x.stride(0), *strides, MAGIC,
        QG=int(gate.qtype), QU=int(up.qtype), H_GROUPS=h // 256, TOPK=k,
        BLOCK_M=block_m, BLOCK_N=gu_block_n, PRECISION=precision, DOT_F32=dot_f32,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    y = torch.empty((a, h), dtype=torch.float32, device=x.device)  # [A, H]
    _down_gemm_kernel[(num_blocks, triton.cdiv(h, down_block_n))](
        hidden, sorted_ids, block_expert, expert_slot, down.data, topk_weights, y,
        a, num_experts, h, down.data.stride(0), down.data.stride(1), MAGIC,
        QD=int(down.qtype), F_GROUPS=f // 256, BLOCK_M=block_m, BLOCK_N=down_block_n,
        PRECISION=precision, DOT_F32=dot_f32, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    out.copy_(y.view(t, k, h).sum(dim=1))  # [T, H], j in order
    return out

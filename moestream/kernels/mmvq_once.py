"""The "once" variant of `mmvq` (`MmvqConfig.variant == "once"`, the default): a program loads
its activations once per K step and walks its BLOCK_N weight rows in a static loop, where the
"tile" kernel of `mmvq` re-reads them for every row.

The tile is [R, 2, M_BLOCK, 4] (R runs of 8 words per step, a run's words split 4 + 4 along
dimensions 1 and 3): a program loads its activation words and scales in that tile once per
step and reuses them for each of its BLOCK_N rows (a static loop, so every row's loads are in
flight together). Weight-only values (words, block headers) are loaded as [R, 2, 1, 4] and
broadcast over M. The four words of a (run, half) are summed as integers first (exact) and
scaled once per 16 values (the Q6_K scale spacing), so the float work is per 16 weights, not
per word. Batch invariant: nothing depends on M, and the final sum is `mmvq.tree_sum`.

Types: Q4_K, Q5_K, Q6_K and Q8_0 here (the dense and the MoE kernels step them); the 4-bit code
types Q4_0, IQ4_NL, IQ4_XS and MXFP4 in `mmvq_codes` (the dense kernel only).

Weight layouts, activation layout (`Q8Act`) and letters are those of `mmvq`; this module
imports its low-level helpers (`mmvq` imports this one lazily, in `mmvq.mmvq`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from moestream.kernels._triton_dequant import (
    IQ4_NL,
    IQ4_XS,
    MXFP4,
    Q4_0,
    Q6_KP,
    Q6_KP_BYTES,
    kernel_qtype,
)
from moestream.kernels.mmvq import (
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    MmvqConfig,
    Q8Act,
    dp4a,
    f16_at,
    i2f,
    k_scale_min_words,
    q4_k_nibbles,
    tree_sum,
    use_asm,
    word16,
)
from moestream.kernels.mmvq_codes import once_step_codes
from moestream.kernels.pdl import pdl_args, pdl_start
from moestream.weights.qtensor import QTensor


@triton.jit
def _act_scales(p, b0, ok, j):
    """Two float32 activation scales p[b0] (at j == 0) and p[b0 + 1] (j == 1) of each
    (m, run, half) of a [R, 2, MB, 4] tile, from one load in the tile's shape, picked out by
    where-sums over j (exact: one nonzero term)."""
    v = tl.load(p + b0 + j, mask=ok & (j < 2), other=0.0)
    v0 = tl.sum(tl.where(j == 0, v, 0.0), axis=3)[:, :, :, None]
    v1 = tl.sum(tl.where(j == 1, v, 0.0), axis=3)[:, :, :, None]
    return v0, v1


@triton.jit
def _once_q4_k(rows, sb, c, ok, h, j, xa, xb, xd0, xd1, xs0, xs1, Q5: tl.constexpr,
               ASM: tl.constexpr):  # fmt: skip
    """Partial sums float32 [R, 2, MB, 1] of one Q4_K (Q5_K when Q5) row (`rows` a scalar byte
    pointer) over runs (sb, c) [R, 1, 1, 1]: word w = 4h + j of run c (as `mmvq._acc_q4_k`); xa, xb
    [R, 2, MB, 4] the activation words of the low and high nibbles; xd*, xs* [R, 2, MB, 1] the
    scales of activation blocks 2c and 2c + 1. The min term goes to half 0."""
    BLK: tl.constexpr = 176 if Q5 else 144
    w = 4 * h + j  # [1, 1, 2, 4]
    okw = ok & (w >= 0)  # [R, 2, 1, 4]
    blk = rows + sb * BLK  # [R, 1, 1, 1]
    lo, hi = q4_k_nibbles(blk, c, w, okw, Q5)
    z = tl.zeros(xa.shape, tl.int32)
    s0 = tl.sum(dp4a(lo, xa, z, ASM), axis=3)[:, :, :, None]  # [R, 2, MB, 1], |s| < 2^17
    s1 = tl.sum(dp4a(hi, xb, z, ASM), axis=3)[:, :, :, None]
    # header words 0..3 (d|dmin, 12 scale bytes) at j = 0..3, the same for both halves
    hdr = tl.load(blk.to(tl.pointer_type(tl.int32)) + j + 0 * h, mask=okw, other=0)
    h0 = tl.sum(tl.where(j == 0, hdr, 0), axis=3)[:, :, :, None]
    h1 = tl.sum(tl.where(j == 1, hdr, 0), axis=3)[:, :, :, None]
    h2 = tl.sum(tl.where(j == 2, hdr, 0), axis=3)[:, :, :, None]
    h3 = tl.sum(tl.where(j == 3, hdr, 0), axis=3)[:, :, :, None]
    sc0, mn0 = k_scale_min_words(h1, h2, h3, 2 * c)
    sc1, mn1 = k_scale_min_words(h1, h2, h3, 2 * c + 1)
    d = (h0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((h0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    part = (d * sc1 * xd1) * i2f(s1)
    part = tl.fma(d * sc0 * xd0, i2f(s0), part)  # explicit FMAs: see `mmvq._acc_q4_k`
    # the min term as an fma as well (see `mmvq._acc_q4_k`: a foldable select let the
    # compiler contract it in some layouts and not others)
    return tl.fma(tl.where(h == 0, -dmin, 0.0), tl.fma(mn0, xs0, mn1 * xs1), part)


@triton.jit
def _once_q6_k(rows, sb, c, ok, h, jw, x0, x1, xd0, xd1, PADDED: tl.constexpr,
               ASM: tl.constexpr):  # fmt: skip
    """As `_once_q4_k` for Q6_K (layout of `mmvq._acc_q6_k`): word w = 4h + jw. File blocks
    (210 bytes, 2-byte aligned) are read as 16-bit halves with jw a permutation of 0..3 (no
    load may be contiguous along the tile, so that all share one layout); padded ones (224
    bytes, `QTensor.aligned`) with jw = j in order (16-byte loads), the 16 scales as four words.
    x0, x1 the activation words of quarters t and 2 + t; xd0, xd1 their blocks' scales. Scale
    8n + 2t + h serves half h. The integer sums over jw are exact: the same bits either way."""
    w = 4 * h + jw
    okw = ok & (w >= 0)
    n = c // 2
    t = c % 2
    if PADDED:
        base = rows + sb * Q6_KP_BYTES  # [R, 1, 1, 1]
        p = base.to(tl.pointer_type(tl.int32))
        ql = tl.load(p + 16 * n + 8 * t + w, mask=okw, other=0)  # [R, 2, 1, 4]
        qh = tl.load(p + 32 + 8 * n + w, mask=okw, other=0)
    else:
        base = rows + sb * 210
        hp = base.to(tl.pointer_type(tl.int16))
        ql = word16(hp + 32 * n + 16 * t + 2 * w, okw)
        qh = word16(hp + 64 + 16 * n + 2 * w, okw)
    v0 = (ql & 0x0F0F0F0F) | (((qh >> (2 * t)) & 0x03030303) << 4)
    v1 = ((ql >> 4) & 0x0F0F0F0F) | (((qh >> (2 * t + 4)) & 0x03030303) << 4)
    z = tl.zeros(x0.shape, tl.int32)
    m32 = z - 522133280  # bytes 0xE0 = -32: the quants' offset
    s0 = tl.sum(dp4a(m32, x0, dp4a(v0, x0, z, ASM), ASM), axis=3)[:, :, :, None]  # |s| < 2^16
    s1 = tl.sum(dp4a(m32, x1, dp4a(v1, x1, z, ASM), ASM), axis=3)[:, :, :, None]
    # Scales and d from loads in the tile's shape (the same for both halves: a load contiguous
    # along h would get a layout of its own), half h's picked out by where-sums.
    if PADDED:
        # scale words 48 + jw (bytes 192 + 4jw); half h takes byte 2t + h of words 2n, 2n + 1
        sw = tl.load(p + 48 + jw + 0 * h, mask=okw, other=0)
        sh = 24 - 8 * (2 * t + h)
        sc0 = i2f((tl.sum(tl.where(jw == 2 * n, sw, 0), axis=3)[:, :, :, None] << sh) >> 24)
        sc1 = i2f((tl.sum(tl.where(jw == 2 * n + 1, sw, 0), axis=3)[:, :, :, None] << sh) >> 24)
    else:
        # the four scales 8n + 2t + (0, 1, 4, 5) of the run at jw = 0, 1, 2, 3
        sp = base + 192 + 8 * n + 2 * t + (jw % 2) + 4 * (jw // 2) + 0 * h
        sc = tl.load(sp.to(tl.pointer_type(tl.int8)), mask=okw, other=0).to(tl.int32)
        sc0 = i2f(tl.sum(tl.where(jw == h, sc, 0), axis=3)[:, :, :, None])
        sc1 = i2f(tl.sum(tl.where(jw == 2 + h, sc, 0), axis=3)[:, :, :, None])
    dv = f16_at(base + 208 + 0 * w, okw & (jw == 2))
    d = tl.sum(tl.where(jw == 2, dv, 0.0), axis=3)[:, :, :, None]
    part = (d * sc1 * xd1) * i2f(s1)
    return tl.fma(d * sc0 * xd0, i2f(s0), part)


@triton.jit
def _once_q8_0(rows, blk, ok, h, jp, x, xd, ASM: tl.constexpr):
    """As `_once_q6_k` for Q8_0, as a (scale, integer sum) pair [R, 2, MB, 1]: run = 34-byte
    block `blk` [R, 1, 1, 1] of the row, word w = 4h + jp of its 32 int8 quants; x its
    activation words, xd [R, 2, MB, 1] its scale."""
    w = 4 * h + jp
    okw = ok & (w >= 0)
    hp = (rows + blk * 34).to(tl.pointer_type(tl.int16))  # [R, 1, 1, 1]
    q = word16(hp + 1 + 2 * w, okw)
    s = tl.sum(dp4a(q, x, tl.zeros(x.shape, tl.int32), ASM), axis=3)[:, :, :, None]
    d = tl.load((hp + 0 * h).to(tl.pointer_type(tl.float16)), mask=ok & (h >= 0), other=0.0)
    return d.to(tl.float32) * xd, i2f(s)  # the caller adds their product in one explicit FMA


@triton.jit
def _once_step(parts, rows0, rows_last, stride_wn, sb, r, h, m, j, ok, xq, xd, xs,
               QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """parts [R, 2, MB, BN] plus one step: the activations of runs r [R, 1, 1, 1] (group sb)
    loaded once, then each of the BLOCK_N rows (row i at rows0 + min(i, rows_last) * stride_wn)
    added to its column."""
    col = tl.arange(0, BLOCK_N)[None, None, None, :]  # [1, 1, 1, BN]
    jp = (3 * j) % 4  # see `_once_q6_k`
    okx = ok & (m >= 0) & (h >= 0) & (j >= 0)  # [R, 2, MB, 4]
    if QTYPE == Q8_0:
        blk = sb * 8 + (r % 8 * 3) % 8  # blocks permuted: no contiguity along R
        x = tl.load(xq + blk * 8 + 4 * h + jp, mask=okx, other=0)
        xdv = tl.load(xd + blk + 0 * h + 0 * jp, mask=okx & (jp == 0), other=0.0)
        xdv = tl.sum(xdv, axis=3)[:, :, :, None]  # [R, 2, MB, 1]
        for i in tl.static_range(BLOCK_N):
            row = rows0 + tl.minimum(i, rows_last).to(tl.int64) * stride_wn
            scale, f = _once_q8_0(row, blk, ok, h, jp, x, xdv, ASM)
            parts = tl.where(col == i, tl.fma(scale, f, parts), parts)  # `mmvq._acc_q4_k`
    elif QTYPE == Q6_K or QTYPE == Q6_KP:  # noqa: SIM109
        c = r % 4
        n = c // 2
        t = c % 2
        jw = j if QTYPE == Q6_KP else jp  # the word order of `_once_q6_k`'s two layouts
        xw = xq + sb * 64 + 32 * n + 8 * t + 4 * h + jw
        x0 = tl.load(xw, mask=okx, other=0)
        x1 = tl.load(xw + 16, mask=okx, other=0)
        b0 = sb * 8 + 4 * n + t  # activation block of quarter t (2 + t: b0 + 2)
        xdv = tl.load(xd + b0 + 2 * (jw % 2) + 0 * h, mask=okx & (jw < 2), other=0.0)
        xd0 = tl.sum(tl.where(jw == 0, xdv, 0.0), axis=3)[:, :, :, None]
        xd1 = tl.sum(tl.where(jw == 1, xdv, 0.0), axis=3)[:, :, :, None]
        for i in tl.static_range(BLOCK_N):
            row = rows0 + tl.minimum(i, rows_last).to(tl.int64) * stride_wn
            part = _once_q6_k(row, sb, c, ok, h, jw, x0, x1, xd0, xd1, QTYPE == Q6_KP, ASM)
            parts = tl.where(col == i, parts + part, parts)
    elif (QTYPE == Q4_0) or (QTYPE == IQ4_NL) or (QTYPE == IQ4_XS) or (QTYPE == MXFP4):  # noqa: SIM109
        parts = once_step_codes(parts, rows0, rows_last, stride_wn, sb, r, h, m, j, ok, xq, xd,
                                QTYPE, BLOCK_N, ASM)  # fmt: skip
    else:
        tl.static_assert((QTYPE == Q4_K) or (QTYPE == Q5_K), "mmvq: unsupported type")  # noqa: SIM109
        c = r % 4
        xw = xq + sb * 64 + 16 * c + 4 * h + j
        xa = tl.load(xw, mask=okx, other=0)
        xb = tl.load(xw + 8, mask=okx, other=0)
        b0 = sb * 8 + 2 * c + 0 * h  # activation blocks 2c, 2c + 1
        xd0, xd1 = _act_scales(xd, b0, okx, j)
        xs0, xs1 = _act_scales(xs, b0, okx, j)
        for i in tl.static_range(BLOCK_N):
            row = rows0 + tl.minimum(i, rows_last).to(tl.int64) * stride_wn
            part = _once_q4_k(row, sb, c, ok, h, j, xa, xb, xd0, xd1, xs0, xs1, QTYPE == Q5_K, ASM)
            parts = tl.where(col == i, parts + part, parts)
    return parts


@triton.jit
def _once_rows(q_ptr, d_ptr, s_ptr, w_ptr, out_ptr, M, N, pid_n, stride_qm, stride_dm,
               stride_wn, stride_os, stride_om, GROUPS_PER_SPLIT: tl.constexpr,
               QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, M_BLOCK: tl.constexpr,
               G: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """Rows pid_n * BLOCK_N .. of w (N rows) against the activations, K split
    `tl.program_id(1)`: the body of `_mmvq_once_kernel` (see there)."""
    SUB: tl.constexpr = 8 if QTYPE == Q8_0 else 4  # runs per group
    R: tl.constexpr = SUB * G
    g_lo = tl.program_id(1) * GROUPS_PER_SPLIT
    g_end = g_lo + GROUPS_PER_SPLIT
    rows0 = w_ptr + (pid_n * BLOCK_N).to(tl.int64) * stride_wn
    rows_last = N - 1 - pid_n * BLOCK_N  # rows past N repeat row N - 1
    r = tl.arange(0, R)[:, None, None, None]  # [R, 1, 1, 1]
    h = tl.arange(0, 2)[None, :, None, None]  # [1, 2, 1, 1]
    m = tl.minimum(tl.arange(0, M_BLOCK), M - 1)[None, None, :, None]  # [1, 1, MB, 1]
    j = tl.arange(0, 4)[None, None, None, :]  # [1, 1, 1, 4]
    xq = q_ptr + m * stride_qm
    xd = d_ptr + m * stride_dm
    xs = s_ptr + m * stride_dm
    parts = tl.zeros([R, 2, M_BLOCK, BLOCK_N], tl.float32)
    if GROUPS_PER_SPLIT <= 2 * G and M_BLOCK <= 2:
        for i in tl.static_range(0, GROUPS_PER_SPLIT, G):
            sb = g_lo + i + r // SUB
            parts = _once_step(parts, rows0, rows_last, stride_wn, sb, r, h, m, j, sb < g_end,
                               xq, xd, xs, QTYPE, BLOCK_N, ASM)  # fmt: skip
    else:
        for i in range(0, GROUPS_PER_SPLIT, G):
            sb = g_lo + i + r // SUB
            parts = _once_step(parts, rows0, rows_last, stride_wn, sb, r, h, m, j, sb < g_end,
                               xq, xd, xs, QTYPE, BLOCK_N, ASM)  # fmt: skip
    # [MB, BN, R, 2]: a row's elements in (run, half) order, as `tree_sum` takes them
    out = tree_sum(tl.permute(parts, (2, 3, 0, 1)), M_BLOCK, BLOCK_N, 2 * R)
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    mm = tl.arange(0, M_BLOCK)[:, None]
    dst = out_ptr + tl.program_id(1) * stride_os + mm * stride_om + nn
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=(mm < M) & (nn < N))


@triton.jit
def _mmvq_once_kernel(q_ptr, d_ptr, s_ptr, w_ptr, out_ptr, M, N, stride_qm, stride_dm,
                      stride_wn, stride_os, stride_om, GROUPS_PER_SPLIT: tl.constexpr,
                      QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, M_BLOCK: tl.constexpr,
                      G: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Program (BLOCK_N rows, K split): the "once" variant (module docstring). The tile is ordered
    [R, 2, MB, 4] so that M comes last among the non-contiguous dimensions: the layout gives
    the lanes to the runs, M goes to registers, and the activation tile and the weight tiles
    [R, 2, 1, 4] share one layout at any M. Each row's [R, 2, MB, 1] partials are added to
    column `row` of one [R, 2, MB, BN] tile (a select in registers); the steps' partials are
    summed per element in step order, then reduced once by `tree_sum` (the only layout
    conversion, one barrier). A fixed order: a row's bits do not depend on M (rows past M
    repeat row M - 1). Up to two steps are unrolled at M <= 2 (their loads can all be in
    flight); more run as a loop (unrolling six steps of 16 rows took minutes to compile; two
    steps at M = 8 spilled). Unrolled or not, the arithmetic is the same."""
    pdl_start(PDL)
    _once_rows(q_ptr, d_ptr, s_ptr, w_ptr, out_ptr, M, N, tl.program_id(0), stride_qm,
               stride_dm, stride_wn, stride_os, stride_om, GROUPS_PER_SPLIT, QTYPE, BLOCK_N,
               M_BLOCK, G, ASM)  # fmt: skip


@triton.jit
def _mmvq_once_pair_kernel(q_ptr, d_ptr, s_ptr, w_ptr, w2_ptr, out_ptr, M, N, N2, P1,
                           stride_qm, stride_dm, stride_wn, stride_wn2, stride_om,
                           GROUPS: tl.constexpr, QTYPE: tl.constexpr, QTYPE2: tl.constexpr,
                           BLOCK_N: tl.constexpr, M_BLOCK: tl.constexpr, G: tl.constexpr,
                           ASM: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Two weights of possibly different types against the same activations in one launch
    (e.g. a Q4_K q/k stack and a Q6_K v): programs below P1 take w's N rows into columns
    0 .. N - 1 of out, the others w2's N2 rows into columns N ..; each row computed as
    `_mmvq_once_kernel` computes it (no K split)."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    if pid < P1:
        _once_rows(q_ptr, d_ptr, s_ptr, w_ptr, out_ptr, M, N, pid, stride_qm, stride_dm,
                   stride_wn, 0, stride_om, GROUPS, QTYPE, BLOCK_N, M_BLOCK, G, ASM)  # fmt: skip
    else:
        _once_rows(q_ptr, d_ptr, s_ptr, w2_ptr, out_ptr + N, M, N2, pid - P1, stride_qm,
                   stride_dm, stride_wn2, 0, stride_om, GROUPS, QTYPE2, BLOCK_N, M_BLOCK, G,
                   ASM)  # fmt: skip


def runs_per_group(*qtypes: GGMLQuantizationType) -> int:
    """Runs of 8 words in a group of 256 values of the "once" step (Q8_0: 8 blocks, else 4);
    for several types stepped together, the fewest."""
    return min(8 if q == GGMLQuantizationType.Q8_0 else 4 for q in qtypes)


def capped_warps(warps: int, sub: int, groups: int) -> int:
    """Warps of a launch of the "once" step: `warps`, but at most runs per step / 16 (sub runs
    per group, `groups` groups a step), so that each lane holds 4 words of a run (16-byte loads;
    the activation and weight tiles then share one layout at any M, no layout conversion
    between the loads in the sm_90 build)."""
    return max(1, min(warps, sub * groups // 16))


def once_warps(cfg: MmvqConfig, sub: int) -> int:
    """Warps of a dense "once" launch (`capped_warps` of cfg's warps and groups)."""
    return capped_warps(cfg.num_warps, sub, cfg.groups)


def launch_mmvq_once(
    a: Q8Act, w: QTensor, dst: torch.Tensor, stride_os: int, cfg: MmvqConfig, m_block: int
) -> None:
    """Launch `_mmvq_once_kernel` for `mmvq.mmvq` (arguments checked there): a.rows rows of `a`
    against w's rows into dst ([M, N], or [split_k, M, N] partials `stride_os` apart), with
    `cfg`'s rows per program, K splits and groups per step, M_BLOCK = m_block."""
    m, n, groups = a.rows, w.shape[0], a.k // 256
    sub = 8 if kernel_qtype(w) == Q8_0.value else 4
    _mmvq_once_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        a.q, a.d, a.s, w.data, dst, m, n, a.q.stride(0), a.d.stride(0), w.data.stride(0),
        stride_os, dst.stride(-2), groups // cfg.split_k, QTYPE=kernel_qtype(w),
        BLOCK_N=cfg.block_n, M_BLOCK=m_block, G=cfg.groups,
        ASM=use_asm(dst.device), num_warps=once_warps(cfg, sub), **pdl_args(dst.device),
    )  # fmt: skip


def launch_mmvq_once_pair(
    a: Q8Act, w: QTensor, w2: QTensor, out: torch.Tensor, cfg: MmvqConfig, m_block: int
) -> None:
    """Launch `_mmvq_once_pair_kernel` for `mmvq.mmvq_pair` (arguments checked there): out
    [M, N + N2] = a against w's rows, then w2's, with `cfg` (no K split)."""
    m, n, n2, groups = a.rows, w.shape[0], w2.shape[0], a.k // 256
    sub = runs_per_group(w.qtype, w2.qtype)
    p1 = triton.cdiv(n, cfg.block_n)
    _mmvq_once_pair_kernel[(p1 + triton.cdiv(n2, cfg.block_n),)](
        a.q, a.d, a.s, w.data, w2.data, out, m, n, n2, p1, a.q.stride(0), a.d.stride(0),
        w.data.stride(0), w2.data.stride(0), out.stride(0), groups, QTYPE=kernel_qtype(w),
        QTYPE2=kernel_qtype(w2), BLOCK_N=cfg.block_n, M_BLOCK=m_block, G=cfg.groups,
        ASM=use_asm(out.device), num_warps=once_warps(cfg, sub), **pdl_args(out.device),
    )  # fmt: skip

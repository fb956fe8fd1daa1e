"""Quantized matmul on the int8 tensor cores (MMQ) for batched decode: dense and fused MoE.

y [M, N] = x [M, K] @ dequant(W [N, K]).T, computed as llama.cpp's CUDA MMQ does: x is rounded
to 8 bits per block of 32 (`mmvq.quantize_q8`: int8 q, float scale d, s = d * sum(q)), each
weight sub-block of 32 values is unpacked in registers to int8 (Q4_K nibbles 0..15, Q5_K 5-bit
0..31, Q6_K 6-bit minus 32, Q8_0 as is) and multiplied with `tl.dot` on int8 operands (int32
accumulation, exact; `wgmma ... s8` on sm_90), one dot per 32-value sub-block (the int8 MMA's
k), and the scales applied per (row, sub-block) x (column, sub-block) in float32:

    acc[n, m] += (d * sc[n, b]) * xd[m, b] * dot - (dmin * mn[n, b]) * xs[m, b]

(the min term for Q4_K/Q5_K; Q6_K's two 16-value scales per sub-block are combined in int32
from a full and a half-masked dot). The weights are the dot's first operand (rows N are the
MMA's M: 64 per warp group) and the activations its second (M rows, 16..64 columns): the weight
tile goes global -> shared (cp.async, pipelined) -> registers in the operand layout, where it is
unpacked a 32-bit word (4 quants) at a time by inline PTX (shifts that would cross bytes are
masked by the caller), so no layout conversion of the big int8 tiles is needed; the
activations stay in shared memory as wgmma's B operand.

Numerics are those of `mmvq` (same activation rounding, exact integer parts, float32 scales);
`mmvq.mmvq_ref` is the reference (the same product); the fused MoE on these tiles is
`moe_mmq.py`. Under the Triton interpreter the byte-packed PTX is emulated per byte (ASM
False).

Letters: M activation rows, N output features, K input features (multiple of 256); MoE: T
tokens, H hidden, F expert FFN, E experts, S slots, k experts per token, A = T*k assignments.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moestream.kernels._triton_dequant import (
    Q6_KP,
    Q6_KP_BYTES,
    kernel_qtype,
    num_sms,
    reduce_split_k,
    split_k_target,
)
from moestream.kernels.arrival import arrival_counters, last_to_arrive
from moestream.kernels.mmvq import MMVQ_QTYPES, Q8Act, i2f, q8_matmul_out, use_asm
from moestream.weights.qtensor import QTensor

MMQ_QTYPES = MMVQ_QTYPES  # Q4_K, Q5_K, Q6_K, Q8_0

Q8_0 = tl.constexpr(8)
Q4_K = tl.constexpr(12)
Q5_K = tl.constexpr(13)
Q6_K = tl.constexpr(14)


# ---- byte-packed integer ops (4 int8 per 32-bit register) ------------------------------------


@triton.jit
def _packed(x, asm: tl.constexpr):
    return tl.inline_asm_elementwise(asm, "=r,r", [x], dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def _shr(x, S: tl.constexpr, ASM: tl.constexpr):
    """x >> S on uint8 [.., 32] tiles, S in 1..4. On the GPU one 32-bit shift of 4 bytes at a
    time: bits shifted in from the next byte are garbage, so callers mask them off."""
    if not ASM:
        return x >> S
    elif S == 1:
        return _packed(x, "shr.b32 $0, $1, 1;")
    elif S == 2:
        return _packed(x, "shr.b32 $0, $1, 2;")
    elif S == 3:
        return _packed(x, "shr.b32 $0, $1, 3;")
    else:
        tl.static_assert(S == 4)
        return _packed(x, "shr.b32 $0, $1, 4;")


@triton.jit
def _shl(x, S: tl.constexpr, ASM: tl.constexpr):
    """x << S on uint8 tiles, S in 1..4 (bits shifted into the next byte: masked by callers)."""
    if not ASM:
        return x << S
    elif S == 1:
        return _packed(x, "shl.b32 $0, $1, 1;")
    elif S == 2:
        return _packed(x, "shl.b32 $0, $1, 2;")
    elif S == 3:
        return _packed(x, "shl.b32 $0, $1, 3;")
    else:
        tl.static_assert(S == 4)
        return _packed(x, "shl.b32 $0, $1, 4;")


@triton.jit
def _bit_to(x, SRC: tl.constexpr, DST: tl.constexpr, ASM: tl.constexpr):
    """Bits SRC.. of each byte of x moved to DST.. (the caller masks the field)."""
    if SRC > DST:
        x = _shr(x, SRC - DST, ASM)
    elif SRC < DST:
        x = _shl(x, DST - SRC, ASM)
    return x


@triton.jit
def _minus32(v, ASM: tl.constexpr):
    """int8(v - 32) of 6-bit v, bytewise: ((v | 0x80) - 0x20) ^ 0x80 never borrows across."""
    if ASM:
        out = _packed(
            v,
            "{ .reg .b32 t; or.b32 t, $1, 0x80808080; sub.u32 t, t, 0x20202020; "
            "xor.b32 $0, t, 0x80808080; }",
        )
    else:
        out = (v.to(tl.int32) - 32).to(tl.uint8)
    return out.to(tl.int8, bitcast=True)


# ---- one 256-value group of BN weight rows against BM activation rows --------------------------


@triton.jit
def _f16(p):
    return tl.load(p.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _load32(p):
    """The 32 bytes at each of p [BN, 1] (uint8 pointers, 2-byte aligned: Q6_K and Q8_0 blocks)
    as uint8 [BN, 32], from 16-bit loads (byte loads would be one instruction per byte)."""
    h = tl.load(p.to(tl.pointer_type(tl.int16)) + tl.arange(0, 16)[None, :])  # [BN, 16]
    lo = (h & 0xFF).to(tl.uint8)
    hi = ((h >> 8) & 0xFF).to(tl.uint8)
    return tl.reshape(tl.join(lo, hi), [p.shape[0], 32])


@triton.jit
def _k_scale_min(h1, h2, h3, S: tl.constexpr):
    """Q4_K/Q5_K 6-bit (scale, min) of sub-block S from the scale bytes as words h1, h2, h3
    (bytes 0-3, 4-7, 8-11; layout of `mmvq.k_scale_min_words`), float32."""
    if S < 4:
        sc = (h1 >> (8 * S)) & 63
        mn = (h2 >> (8 * S)) & 63
    else:
        a = h1 >> (8 * (S - 4))
        b = h2 >> (8 * (S - 4))
        pk = h3 >> (8 * (S - 4))
        sc = (pk & 15) | ((a >> 2) & 48)
        mn = ((pk >> 4) & 15) | ((b >> 2) & 48)
    return i2f(sc), i2f(mn)


@triton.jit
def _group_q4_k(acc, blk, xk, xd, xs, j, Q5: tl.constexpr, ASM: tl.constexpr):
    """Add group sb of Q4_K (Q5_K when Q5) rows to acc [BN, BM]. blk [BN] uint8 pointers to
    the rows' blocks of the group, xk [1, BM] int8 pointers to the activations' first value of
    the group, xd/xs [BM] to their first block scale, j [32] = arange(32)."""
    QS: tl.constexpr = 48 if Q5 else 16
    hdr = blk.to(tl.pointer_type(tl.int32))
    h0 = tl.load(hdr)
    h1 = tl.load(hdr + 1)
    h2 = tl.load(hdr + 2)
    h3 = tl.load(hdr + 3)
    d = (h0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((h0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    rows = blk[:, None] + j[None, :]  # [BN, 32]
    if Q5:
        qh = tl.load(rows + 16)  # [BN, 32] bit s: sub-block s
    for c in tl.static_range(4):
        qs = tl.load(rows + QS + 32 * c)  # [BN, 32] uint8: sub-blocks 2c (low), 2c + 1 (high)
        lo = qs & 0x0F
        hi = _shr(qs, 4, ASM) & 0x0F
        if Q5:
            lo = lo | (_bit_to(qh, 2 * c, 4, ASM) & 0x10)
            hi = hi | (_bit_to(qh, 2 * c + 1, 4, ASM) & 0x10)
        x = xk + 64 * c + j[:, None]  # [32, BM]
        p0 = tl.dot(lo.to(tl.int8, bitcast=True), tl.load(x), out_dtype=tl.int32)  # [BN, BM]
        p1 = tl.dot(hi.to(tl.int8, bitcast=True), tl.load(x + 32), out_dtype=tl.int32)
        sc0, mn0 = _k_scale_min(h1, h2, h3, 2 * c)
        sc1, mn1 = _k_scale_min(h1, h2, h3, 2 * c + 1)
        xd0 = tl.load(xd + 2 * c)[None, :]  # [1, BM]
        xd1 = tl.load(xd + 2 * c + 1)[None, :]
        xs0 = tl.load(xs + 2 * c)[None, :]
        xs1 = tl.load(xs + 2 * c + 1)[None, :]
        acc = tl.fma((d * sc0)[:, None] * xd0, i2f(p0), acc)
        acc = tl.fma((d * sc1)[:, None] * xd1, i2f(p1), acc)
        acc = tl.fma(-(dmin * mn0)[:, None], xs0, acc)
        acc = tl.fma(-(dmin * mn1)[:, None], xs1, acc)
    return acc


@triton.jit
def _group_q6_k(acc, blk, xk, xd, j, PADDED: tl.constexpr, ASM: tl.constexpr):
    """Add group sb of Q6_K rows (210-byte blocks; 224 and 16-byte aligned when PADDED) to acc
    [BN, BM]; arguments as `_group_q4_k`. Half n (128 values): ql bytes 64n + l and
    64n + 32 + l, qh byte 128 + 32n + l hold values 128n + 32r + l (r = 0..3: low/high nibble
    of either ql byte, qh bits 2r); int8 scale 192 + 8n + 2r + l // 16 per 16 values; d
    float16 at 208."""
    d = _f16(blk + 208)
    for n in tl.static_range(2):
        if PADDED:  # aligned: plain byte loads, which the compiler widens
            ql0 = tl.load(blk[:, None] + 64 * n + j[None, :])  # [BN, 32] uint8
            ql1 = tl.load(blk[:, None] + 64 * n + 32 + j[None, :])
            qh = tl.load(blk[:, None] + 128 + 32 * n + j[None, :])
        else:
            ql0 = _load32(blk[:, None] + 64 * n)
            ql1 = _load32(blk[:, None] + 64 * n + 32)
            qh = _load32(blk[:, None] + 128 + 32 * n)
        for r in tl.static_range(4):
            ql = ql0 if r % 2 == 0 else ql1
            low = ql & 0x0F if r < 2 else _shr(ql, 4, ASM) & 0x0F
            v = _minus32(low | (_bit_to(qh, 2 * r, 4, ASM) & 0x30), ASM)  # [BN, 32] int8
            xp = xk + 128 * n + 32 * r + j[:, None]  # [32, BM]
            full = tl.dot(v, tl.load(xp), out_dtype=tl.int32)  # [BN, BM]
            # values 0..15 alone: the activations' rows 16..31 zeroed (a masked load, so the
            # weight tile keeps its one path into the operand layout)
            part = tl.dot(v, tl.load(xp, mask=j[:, None] < 16, other=0), out_dtype=tl.int32)
            sp = (blk + 192 + 8 * n + 2 * r).to(tl.pointer_type(tl.int8))
            sa = tl.load(sp).to(tl.int32)[:, None]  # [BN, 1] scale of values 0..15
            sb = tl.load(sp + 1).to(tl.int32)[:, None]  # 16..31
            comb = sb * full + (sa - sb) * part  # exact: |comb| < 2^24
            xd_r = tl.load(xd + 4 * n + r)[None, :]  # [1, BM]
            acc = tl.fma(d[:, None] * xd_r, comb.to(tl.float32), acc)
    return acc


@triton.jit
def _group_q8_0(acc, blk, xk, xd, j):
    """Add group sb of Q8_0 rows (eight 34-byte blocks: float16 d, int8 q[32]) to acc
    [BN, BM]; arguments as `_group_q4_k`."""
    for b in tl.static_range(8):
        q = _load32(blk[:, None] + 34 * b + 2).to(tl.int8, bitcast=True)  # [BN, 32]
        p = tl.dot(q, tl.load(xk + 32 * b + j[:, None]), out_dtype=tl.int32)  # [BN, BM]
        dw = _f16(blk + 34 * b)  # [BN]
        acc = tl.fma(dw[:, None] * tl.load(xd + b)[None, :], i2f(p), acc)
    return acc


@triton.jit
def mmq_tile(w_rows, x_rows, xd_rows, xs_rows, g_lo, GROUPS: tl.constexpr, QTYPE: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """float32 [BLOCK_N, BLOCK_M]: weight rows `w_rows` ([BN] uint8 pointers to row starts)
    against activation rows (x_rows [BM] int8 pointers to q, xd_rows/xs_rows [BM] float32
    pointers to d/s) over groups g_lo .. g_lo + GROUPS - 1, summed in order."""
    GB: tl.constexpr = (
        272 if QTYPE == Q8_0 else 144 if QTYPE == Q4_K else 176 if QTYPE == Q5_K
        else Q6_KP_BYTES if QTYPE == Q6_KP else 210
    )  # fmt: skip
    j = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for i in range(0, GROUPS):
        g = g_lo + i
        blk = w_rows + g * GB  # [BN]
        xk = x_rows[None, :] + g * 256  # [1, BM]
        xd = xd_rows + g * 8  # [BM]
        if QTYPE == Q8_0:
            acc = _group_q8_0(acc, blk, xk, xd, j)
        elif QTYPE == Q6_K or QTYPE == Q6_KP:  # noqa: SIM109
            acc = _group_q6_k(acc, blk, xk, xd, j, QTYPE == Q6_KP, ASM)
        else:
            tl.static_assert((QTYPE == Q4_K) or (QTYPE == Q5_K), "mmq: unsupported type")  # noqa: SIM109
            acc = _group_q4_k(acc, blk, xk, xd, xs_rows + g * 8, j, QTYPE == Q5_K, ASM)
    return acc


# ---- dense ------------------------------------------------------------------------------------


@triton.jit
def _mmq_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, out_ptr, M, N, stride_xm, stride_dm, stride_wn,
                stride_os, stride_om, GROUPS_PER_SPLIT: tl.constexpr, QTYPE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr,
                final_ptr=None, stride_fm=0, count_ptr=None, FUSED_SUM: tl.constexpr = False,
                SPLIT: tl.constexpr = 1):  # fmt: skip
    """out (or, with a K split, its float32 partials [split, M, N]) = the tile's product; with
    FUSED_SUM the last program of a tile's split to arrive adds the partials in split order
    and stores the sum into final [M, N] (`FUSED_SPLIT_SUM`)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_k = tl.program_id(2)
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64) * stride_wn  # [BN]
    mc = tl.minimum(m, M - 1).to(tl.int64)  # rows past M repeat row M - 1 (not stored)
    acc = mmq_tile(
        w_rows, xq_ptr + mc * stride_xm, xd_ptr + mc * stride_dm, xs_ptr + mc * stride_dm,
        pid_k * GROUPS_PER_SPLIT, GROUPS_PER_SPLIT, QTYPE, BLOCK_N, BLOCK_M, ASM,
    )  # [BN, BM]  # fmt: skip
    ok = (m[None, :] < M) & (n[:, None] < N)
    dst = out_ptr + pid_k * stride_os + m[None, :] * stride_om + n[:, None]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=ok)
    if FUSED_SUM:
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        if last_to_arrive(count_ptr + tile, SPLIT):
            part = out_ptr + m[None, :] * stride_om + n[:, None]
            total = tl.load(part, mask=ok, other=0.0, cache_modifier=".cg")
            for k in tl.static_range(1, SPLIT):
                total += tl.load(part + k * stride_os, mask=ok, other=0.0, cache_modifier=".cg")
            fin = final_ptr + m[None, :] * stride_fm + n[:, None]
            tl.store(
                fin, total.to(final_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=ok
            )


class MmqConfig(NamedTuple):
    """Launch shape of the MMQ kernels: activation rows and weight rows per program (BLOCK_M a
    power of two >= 16, BLOCK_N a multiple of 64), K splits (dense only), warps, pipeline
    stages, and `maxnreg`: registers per thread at most (Triton's launch option; ptxas spills
    what does not fit, for more resident warps per SM), None for no cap."""

    block_m: int = 16
    block_n: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    maxnreg: int | None = None

    @property
    def launch_options(self) -> dict[str, int]:
        """Triton launch options: warps, stages, and the register cap when there is one."""
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        return options


def warps_for(block_m: int) -> int:
    """4 warps (one warp group) for 16 activation rows, 8 above: with 4, the float32 scale
    arithmetic of 32 or 64 columns spilled registers in the sm_90 build (Q6_K at 32, Q4_K at
    64); with 8 it did not."""
    return 4 if block_m <= 16 else 8


# With a K split, the last program of each tile to arrive adds the partials in split order and
# stores the output (`arrival.last_to_arrive`), in place of two torch launches (the sum over
# splits, the cast-copy): ~10 us a layer-step of the 30B at 16 requests by a profile's counts.
# Off until timed on a GPU (bench/RESULTS.md, twenty-third session; `gpu_figures.sh s35f`).
# Its counters are one buffer per device (`split_counters`): launches on one stream only.
FUSED_SPLIT_SUM = False
SPLIT_COUNTERS = 1 << 14  # tiles a fused launch may have (more: the unfused sum)
_split_counters: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device) -> torch.Tensor | None:
    """The fused split sum's arrival counters on `device` (int32 zeros, left zero by every
    launch), made on first use outside CUDA-graph capture; None while capturing before that."""
    counters = _split_counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _split_counters[device] = arrival_counters(SPLIT_COUNTERS, device)
    return counters


# K is split (in two, again and again) while a launch's programs fill under SPLIT_WAVES waves of
# the SMs and each split keeps at least SPLIT_MIN_GROUPS groups of 256. H200, the 30B's
# projections at M = 16 (`python bench/mmq_gpu.py --split`, 2026-12-02): v (Q6_K, N=512, K=2048)
# 21.7 us at the old rule's split 2 against 13.6 at 8, o (N=2048, K=4096) 16.1 at 4 against
# 15.0 at 16, q+k+v (N=5120) 19.4 at 2 against 18.0 at 4: splits down to one group pay.
SPLIT_WAVES = 2
SPLIT_MIN_GROUPS = 1


def mmq_config(m: int, n: int, k: int, sms: int) -> MmqConfig:
    """BLOCK_M the power of two >= M in 16..64, BLOCK_N 64, `warps_for`; K split in two while
    the column blocks fill under SPLIT_WAVES waves of the SMs and each split keeps at least
    SPLIT_MIN_GROUPS groups.
    The split does not depend on M, so a row's result should not depend on the batch: every
    (row, column) runs the same float operations in the same order whatever tile holds it,
    the integer dots being exact (tested under the interpreter; to confirm on the GPU).
    Untuned: to sweep on the GPU (`bench/mmq_gpu.py`)."""
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n = 64
    programs = triton.cdiv(n, block_n)
    groups = k // 256
    split = 1
    while (
        programs * split < SPLIT_WAVES * sms
        and groups % (2 * split) == 0
        and groups // (2 * split) >= SPLIT_MIN_GROUPS
    ):
        split *= 2
    return MmqConfig(block_m, block_n, split, warps_for(block_m), 3)


def _check_config(cfg: MmqConfig) -> None:
    if cfg.block_m < 16 or cfg.block_m & (cfg.block_m - 1) or cfg.block_n % 64:
        raise ValueError(f"{cfg}: BLOCK_M must be a power of two >= 16, BLOCK_N a multiple of 64")
    # Registers are allocated 8 per thread (256 per warp), so other caps buy no more warps;
    # a thread has 255 at most, and below 28-38 (by tile shape) ptxas cannot fit these
    # kernels' MMA instructions (fatal error C7602).
    if cfg.maxnreg is not None and (cfg.maxnreg % 8 or not 40 <= cfg.maxnreg <= 248):
        raise ValueError(f"{cfg}: maxnreg must be None or a multiple of 8 from 40 to 248")


def mmq(
    a: Q8Act,
    w: QTensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    config: MmqConfig | None = None,
) -> torch.Tensor:
    """y [M, N] = x @ dequant(w).T for activations quantized by `quantize_q8` -> out_dtype.

    `w` a 2-D QTensor of a type in MMQ_QTYPES with K = a.k (a multiple of 256); any M. Q4_K and
    Q5_K rows whose bytes start 16-byte aligned (as stacked GGUF tensors do) are copied with
    16-byte cp.async; Q6_K and Q8_0 blocks are 2-byte aligned and read 16 bits at a time (Q6_K
    padded, `QTensor.aligned`: as bytes the compiler widens).
    `out`, when given, is an [M, N] tensor with unit last stride that receives the result.
    With a K split the float32 partial sums are added in split order (deterministic)."""
    out = q8_matmul_out(a, w, MMQ_QTYPES, "mmq", out, out_dtype)
    m, k, n = a.rows, a.k, w.shape[0]
    if m == 0:
        return out
    cfg = config or mmq_config(m, n, k, num_sms(a.q.device))
    _check_config(cfg)
    groups = k // 256
    if groups % cfg.split_k:
        raise ValueError(f"{cfg} does not fit the {groups} groups of K={k}")
    dst, stride_os = split_k_target(out, cfg.split_k)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), cfg.split_k)
    counters = None
    if FUSED_SPLIT_SUM and dst is not out and grid[0] * grid[1] <= SPLIT_COUNTERS:
        counters = split_counters(out.device)
    fused = {} if counters is None else {
        "final_ptr": out, "stride_fm": out.stride(0), "count_ptr": counters, "FUSED_SUM": True,
        "SPLIT": cfg.split_k,
    }  # fmt: skip
    _mmq_kernel[grid](
        a.q.view(torch.int8), a.d, a.s, w.data, dst, m, n, 4 * a.q.stride(0), a.d.stride(0),
        w.data.stride(0), stride_os, dst.stride(-2), GROUPS_PER_SPLIT=groups // cfg.split_k,
        QTYPE=kernel_qtype(w), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ASM=use_asm(out.device),
        **fused, **cfg.launch_options,
    )  # fmt: skip
    if counters is None:
        reduce_split_k(out, dst)
    return out

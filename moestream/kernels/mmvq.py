"""Decode-path quantized matmul with 8-bit activations and integer dot products (MMVQ).

y [M, N] = x [M, K] @ dequant(W [N, K]).T for small M, computed as llama.cpp's CUDA backend does
for decode: the activations are first quantized to 8 bits in blocks of 32 (`quantize_q8`: a
scale d and 32 int8 q per block, q = round(x / d), d = max|x| / 127), then every weight word
(4 packed quants) meets 4 activation quants in one `dp4a` (a 4-way int8 dot product with int32
accumulation, exact), and the block scales are applied once per 16 or 32 weights in float32.

Why: a bandwidth-bound GEMV on an H200 has about 4 instructions per weight to spend (4.8 TB/s of
4.5-bit weights over 132 SMs x 128 lanes); unpacking each quant to float and multiplying costs
8-13 (`quant_gemv`, 10-32% of the bandwidth). Unpacked a word at a time (mask/shift on 4 or 8
quants at once) and multiplied 4 at a time, a weight costs under one instruction.

Numerics: x is rounded to 8 bits per block of 32 (relative error about 1/254 of the block's
largest value), as llama.cpp does on the GPU; the weights are exact. `quantize_q8_ref` and
`mmvq_ref` are the torch references (the same integer quants, float32 scale arithmetic).

Activation layout (`Q8Act`): q int32 [M, K/4] (4 int8 per word, element 4w + i in byte i), d
float32 [M, K/32], s float32 [M, K/32] = d * sum(q) of the block (for types with a min).

Weights are read in their GGUF block format (DESIGN invariant 1). Types whose blocks are 4-byte
aligned (Q4_K 144 bytes, Q5_K 176) are read a 32-bit word at a time; Q6_K (210) and Q8_0 (34)
blocks are only 2-byte aligned and are read as 16-bit halves joined into words.

Under the Triton interpreter (CPU tests) `dp4a` is emulated with shifts and multiplies (ASM
False); on CUDA it is one PTX instruction.

Letters: M activation rows (<= MAX_M), N output features, K input features (multiple of 256).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moestream.kernels._triton_dequant import _k_scale_min, check_weight, num_sms
from moestream.kernels.ops import MMVQ_QTYPES
from moestream.weights.qtensor import QTensor

MAX_M = 8
QBLOCK = 32  # activation values per scale

Q8_0 = tl.constexpr(8)
Q4_K = tl.constexpr(12)
Q5_K = tl.constexpr(13)
Q6_K = tl.constexpr(14)


class Q8Act(NamedTuple):
    """Activations quantized for `mmvq`: q int32 [M, K/4], d and s float32 [M, K/32]."""

    q: torch.Tensor
    d: torch.Tensor
    s: torch.Tensor

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1] * 4


# ---- references (torch) ----------------------------------------------------------------------


def quantize_q8_ref(x: torch.Tensor) -> Q8Act:
    """x [M, K] float (K a multiple of 32) -> Q8Act. Per block of 32: amax = max|x|,
    inv = 127 / amax (0 when amax is 0), q = floor(x * inv + 0.5) (in [-127, 127]),
    d = amax / 127, s = d * sum(q); all float32, correctly rounded."""
    m, k = x.shape
    xb = x.float().reshape(m, k // QBLOCK, QBLOCK)  # [M, B, 32]
    amax = xb.abs().amax(dim=-1)  # [M, B]
    c127 = torch.full_like(amax, 127.0)  # tensor / tensor: torch's scalar forms may use 1 / b
    inv = torch.where(amax > 0, c127 / amax, torch.zeros_like(amax))
    q = torch.floor(xb * inv[..., None] + 0.5).to(torch.int32)  # [M, B, 32]
    d = amax / c127
    s = d * q.sum(dim=-1).float()
    b = (q & 0xFF).reshape(m, k // 4, 4)  # [M, K/4, 4] bytes
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return Q8Act(words.to(torch.int32).contiguous(), d.contiguous(), s.contiguous())


def dequantize_q8(a: Q8Act) -> torch.Tensor:
    """Q8Act -> float32 [M, K]: the values the integer dot products see (q * d)."""
    m = a.rows
    shift = torch.tensor([24, 16, 8, 0], dtype=torch.int32, device=a.q.device)
    q = (a.q[..., None] << shift) >> 24  # [M, K/4, 4] sign-extended bytes
    return q.reshape(m, -1, QBLOCK).float().mul(a.d[..., None]).reshape(m, -1)


def mmvq_ref(a: Q8Act, w: QTensor) -> torch.Tensor:
    """Reference of `mmvq`: float32 [M, N] = dequantize_q8(a) @ dequant(w).T in float64, rounded
    to float32 (the kernel's sums run in another order; tests compare with a tolerance)."""
    x = dequantize_q8(a).double()
    return (x @ w.dequantize(torch.float32).double().t()).float()


# ---- Triton ----------------------------------------------------------------------------------


@triton.jit
def dp4a(a, b, c, ASM: tl.constexpr):
    """c + sum_i int8(a byte i) * int8(b byte i), int32 tensors (PTX dp4a on the GPU)."""
    if ASM:
        out = tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;",
            "=r,r,r,r",
            [a, b, c],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        out = c
        for i in tl.static_range(4):
            out += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
    return out


@triton.jit
def _word16(p):
    """The int32 at byte pointer(s) `p` (2-byte aligned), from two 16-bit loads."""
    h = p.to(tl.pointer_type(tl.int16))
    lo = tl.load(h).to(tl.int32) & 0xFFFF
    hi = tl.load(h + 1).to(tl.int32)
    return lo | (hi << 16)


@triton.jit
def _f16(p):
    return tl.load(p.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _dot_q4_k(rows, sb, xq, xd, xs, Q5: tl.constexpr, ASM: tl.constexpr):
    """Group `sb` of rows [BN] (Q4_K, or Q5_K when Q5) against the activation row (xq words,
    xd/xs scales) -> float32 [BN]. Word (c, w): bytes 32c + 4w of qs; its low nibbles are
    sub-block 2c, elements 4w..4w+3 (k = 64c + 4w + i), its high nibbles sub-block 2c + 1."""
    BLK: tl.constexpr = 176 if Q5 else 144
    QS: tl.constexpr = 48 if Q5 else 16
    blk = rows[:, None, None] + sb * BLK  # [BN, 1, 1]
    c = tl.arange(0, 4)[None, :, None]
    w = tl.arange(0, 8)[None, None, :]
    qs = tl.load((blk + QS + 32 * c + 4 * w).to(tl.pointer_type(tl.int32)))  # [BN, 4, 8]
    lo = qs & 0x0F0F0F0F
    hi = (qs >> 4) & 0x0F0F0F0F
    if Q5:
        qh = tl.load((blk + 16 + 4 * w).to(tl.pointer_type(tl.int32)))  # [BN, 1, 8]
        lo = lo | (((qh >> (2 * c)) & 0x01010101) << 4)
        hi = hi | (((qh >> (2 * c + 1)) & 0x01010101) << 4)
    xw = xq + sb * 64 + 16 * c + w  # [1, 4, 8]
    zero = tl.zeros(qs.shape, tl.int32)
    i0 = tl.sum(dp4a(lo, tl.load(xw), zero, ASM), axis=2)  # [BN, 4] sub-block 2c
    i1 = tl.sum(dp4a(hi, tl.load(xw + 8), zero, ASM), axis=2)  # [BN, 4] sub-block 2c + 1
    blk2 = rows[:, None] + sb * BLK  # [BN, 1]
    c2 = tl.arange(0, 4)[None, :]  # [1, 4]
    sc0, mn0 = _k_scale_min(blk2 + 4, 2 * c2)  # [BN, 4]
    sc1, mn1 = _k_scale_min(blk2 + 4, 2 * c2 + 1)
    d = _f16(blk2)
    dmin = _f16(blk2 + 2)
    b0 = sb * 8 + 2 * c2  # [1, 4] activation block of sub-block 2c
    xd0, xs0 = tl.load(xd + b0), tl.load(xs + b0)
    xd1, xs1 = tl.load(xd + b0 + 1), tl.load(xs + b0 + 1)
    part = d * (sc0 * xd0 * i0.to(tl.float32) + sc1 * xd1 * i1.to(tl.float32))
    part -= dmin * (mn0 * xs0 + mn1 * xs1)
    return tl.sum(part, axis=1)


@triton.jit
def _dot_q6_k(rows, sb, xq, xd, xs, ASM: tl.constexpr):
    """Group `sb` (Q6_K, 210 bytes) -> float32 [BN]. Half n (128 values), quarter r = 2p + t,
    word w = 4e + j: ql word at 64n + 32t + 4w (nibble p), qh word at 128 + 32n + 4w (bits 2r);
    values k = 128n + 32r + 4w + i, minus 32; int8 scale 8n + 2r + e (one per 16 values)."""
    blk = rows[:, None, None, None, None] + sb * 210  # [BN, 1, 1, 1, 1]
    n = tl.arange(0, 2)[None, :, None, None, None]
    t = tl.arange(0, 2)[None, None, :, None, None]
    e = tl.arange(0, 2)[None, None, None, :, None]
    j = tl.arange(0, 4)[None, None, None, None, :]
    w = 4 * e + j
    ql = _word16(blk + 64 * n + 32 * t + 4 * w)  # [BN, 2, 2, 2, 4]
    qh = _word16(blk + 128 + 32 * n + 4 * w)  # [BN, 2, 1, 2, 4]
    v0 = (ql & 0x0F0F0F0F) | (((qh >> (2 * t)) & 0x03030303) << 4)  # r = t
    v1 = ((ql >> 4) & 0x0F0F0F0F) | (((qh >> (2 * t + 4)) & 0x03030303) << 4)  # r = 2 + t
    xw = xq + sb * 64 + 32 * n + 8 * t + w  # [1, 2, 2, 2, 4]
    x0 = tl.load(xw)
    x1 = tl.load(xw + 16)
    zero = tl.zeros(ql.shape, tl.int32)
    m32 = zero - 522133280  # bytes 0xE0 = -32: the quants' offset, as one more dp4a
    s0 = tl.sum(dp4a(m32, x0, dp4a(v0, x0, zero, ASM), ASM), axis=4)  # [BN, 2, 2, 2]
    s1 = tl.sum(dp4a(m32, x1, dp4a(v1, x1, zero, ASM), ASM), axis=4)
    n4 = tl.arange(0, 2)[None, :, None, None]
    t4 = tl.arange(0, 2)[None, None, :, None]
    e4 = tl.arange(0, 2)[None, None, None, :]
    sp = rows[:, None, None, None] + sb * 210 + 192 + 8 * n4 + 2 * t4 + e4  # [BN, 2, 2, 2]
    sp = sp.to(tl.pointer_type(tl.int8))  # the scale of quarter r = t, run e
    i0 = tl.sum(tl.load(sp).to(tl.int32) * s0, axis=3)  # [BN, 2, 2]
    i1 = tl.sum(tl.load(sp + 4).to(tl.int32) * s1, axis=3)
    n3 = tl.arange(0, 2)[None, :, None]
    t3 = tl.arange(0, 2)[None, None, :]
    b0 = sb * 8 + 4 * n3 + t3  # [1, 2, 2] activation block of quarter r = t
    part = tl.load(xd + b0) * i0.to(tl.float32) + tl.load(xd + b0 + 2) * i1.to(tl.float32)
    d = _f16(rows + sb * 210 + 208)  # [BN]
    return d * tl.sum(tl.sum(part, axis=2), axis=1)


@triton.jit
def _dot_q8_0(rows, sb, xq, xd, xs, ASM: tl.constexpr):
    """Group `sb` (eight Q8_0 blocks of 34 bytes: f16 d, int8 q[32]) -> float32 [BN]."""
    b = tl.arange(0, 8)[None, :, None]
    w = tl.arange(0, 8)[None, None, :]
    blk = rows[:, None, None] + sb * 272 + 34 * b  # [BN, 8, 1]
    q = _word16(blk + 2 + 4 * w)  # [BN, 8, 8]
    xw = tl.load(xq + sb * 64 + 8 * b + w)  # [1, 8, 8]
    idot = tl.sum(dp4a(q, xw, tl.zeros(q.shape, tl.int32), ASM), axis=2)  # [BN, 8]
    b2 = tl.arange(0, 8)[None, :]
    d = _f16(rows[:, None] + sb * 272 + 34 * b2)  # [BN, 8]
    part = d * tl.load(xd + sb * 8 + b2) * idot.to(tl.float32)
    return tl.sum(part, axis=1)


@triton.jit
def _dot_group(rows, sb, xq, xd, xs, QTYPE: tl.constexpr, ASM: tl.constexpr):
    if QTYPE == Q4_K:
        part = _dot_q4_k(rows, sb, xq, xd, xs, False, ASM)
    elif QTYPE == Q5_K:
        part = _dot_q4_k(rows, sb, xq, xd, xs, True, ASM)
    elif QTYPE == Q6_K:
        part = _dot_q6_k(rows, sb, xq, xd, xs, ASM)
    else:
        tl.static_assert(QTYPE == Q8_0, "mmvq: unsupported GGML type")
        part = _dot_q8_0(rows, sb, xq, xd, xs, ASM)
    return part


@triton.jit
def mmvq_rows(rows, xq, xd, xs, stride_q, stride_d, g_lo, GROUPS: tl.constexpr,
              UNROLL: tl.constexpr, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
              M_ROWS: tl.constexpr, M_BLOCK: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """Dot products float32 [M_BLOCK, BLOCK_N] (M_BLOCK = next power of two of M_ROWS; rows
    past M_ROWS are zero) of weight rows `rows` ([BLOCK_N] uint8 pointers) with M_ROWS
    quantized activation rows (xq: the first row's int32 words, xd/xs: its block scales; rows
    `stride_q` words / `stride_d` blocks apart) over groups g_lo .. g_lo + GROUPS - 1 (GROUPS
    a multiple of UNROLL). Each group's weight words are loaded once for all rows
    (the per-row calls read the same addresses in one loop body; the compiler merges them), and
    each row's sums run in the same order whatever M_BLOCK is (batch invariance)."""
    acc = tl.zeros([M_BLOCK, BLOCK_N], tl.float32)
    m = tl.arange(0, M_BLOCK)[:, None]
    for i in range(0, GROUPS, UNROLL):
        for u in tl.static_range(UNROLL):
            sb = g_lo + i + u
            if M_ROWS == 1:
                acc += _dot_group(rows, sb, xq, xd, xs, QTYPE, ASM)[None, :]
            else:
                for mi in tl.static_range(M_ROWS):
                    part = _dot_group(rows, sb, xq + mi * stride_q, xd + mi * stride_d,
                                      xs + mi * stride_d, QTYPE, ASM)  # fmt: skip
                    acc += tl.where(m == mi, part[None, :], 0.0)
    return acc


@triton.jit
def _quantize_q8_kernel(x_ptr, q_ptr, d_ptr, s_ptr, NB, stride_xm, stride_qm, stride_dm,
                        BLOCKS: tl.constexpr):  # fmt: skip
    """Program (row m, BLOCKS activation blocks): see `quantize_q8_ref`."""
    m = tl.program_id(0)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)  # [BLOCKS]
    bc = tl.minimum(b, NB - 1)[:, None, None]
    w = tl.arange(0, 8)[None, :, None]
    i = tl.arange(0, 4)[None, None, :]
    x = tl.load(x_ptr + m * stride_xm + bc * 32 + 4 * w + i).to(tl.float32)  # [BLOCKS, 8, 4]
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)  # [BLOCKS]
    c127 = tl.full(amax.shape, 127.0, tl.float32)
    inv = tl.where(amax > 0, tl.math.div_rn(c127, tl.where(amax > 0, amax, 1.0)), 0.0)
    q = tl.floor(x * inv[:, None, None] + 0.5).to(tl.int32)  # [BLOCKS, 8, 4]
    d = tl.math.div_rn(amax, c127)
    s = d * tl.sum(tl.sum(q, axis=2), axis=1).to(tl.float32)
    words = tl.sum((q & 0xFF) << (8 * i), axis=2)  # [BLOCKS, 8] (disjoint bytes: sum == or)
    ok = b < NB
    w2 = tl.arange(0, 8)[None, :]
    tl.store(q_ptr + m * stride_qm + b[:, None] * 8 + w2, words, mask=ok[:, None])
    tl.store(d_ptr + m * stride_dm + b, d, mask=ok)
    tl.store(s_ptr + m * stride_dm + b, s, mask=ok)


def quantize_q8(x: torch.Tensor, blocks: int = 8) -> Q8Act:
    """x [M, K] float (unit stride along K, K a multiple of 32) -> Q8Act (`quantize_q8_ref`)."""
    if x.dim() != 2 or x.shape[1] % QBLOCK or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with K % 32 == 0 and unit stride, got {x.shape}")
    m, k = x.shape
    nb = k // QBLOCK
    q = torch.empty((m, k // 4), dtype=torch.int32, device=x.device)
    d = torch.empty((m, nb), dtype=torch.float32, device=x.device)
    s = torch.empty((m, nb), dtype=torch.float32, device=x.device)
    if m:
        _quantize_q8_kernel[(m, triton.cdiv(nb, blocks))](
            x, q, d, s, nb, x.stride(0), q.stride(0), d.stride(0), BLOCKS=blocks, num_warps=4
        )
    return Q8Act(q, d, s)


@triton.jit
def _mmvq_kernel(q_ptr, d_ptr, s_ptr, w_ptr, out_ptr, M: tl.constexpr, N, stride_qm, stride_dm,
                 stride_wn, stride_os, stride_om, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
                 M_BLOCK: tl.constexpr, GROUPS_PER_SPLIT: tl.constexpr, UNROLL: tl.constexpr,
                 ASM: tl.constexpr):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64) * stride_wn  # [BLOCK_N]
    g_lo = pid_k * GROUPS_PER_SPLIT
    acc = mmvq_rows(
        rows,
        q_ptr,
        d_ptr,
        s_ptr,
        stride_qm,
        stride_dm,
        g_lo,
        GROUPS_PER_SPLIT,
        UNROLL,
        QTYPE,
        BLOCK_N,
        M,
        M_BLOCK,
        ASM,
    )  # [M_BLOCK, BLOCK_N]
    m = tl.arange(0, M_BLOCK)[:, None]
    dst = out_ptr + pid_k * stride_os + m * stride_om + n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=(m < M) & (n[None, :] < N))


class MmvqConfig(NamedTuple):
    """Launch shape of `_mmvq_kernel`: rows per program, K splits, groups per loop step, warps."""

    block_n: int = 16
    split_k: int = 1
    unroll: int = 1
    num_warps: int = 4


def mmvq_config(n: int, k: int, sms: int) -> MmvqConfig:
    """Row block 16 down to 4 while that leaves fewer than two programs per SM; K split (a power
    of two, >= 2 groups per split) while programs are fewer than the SMs; two groups per loop
    step where they divide. Independent of M (a row's result never depends on the batch)."""
    block_n = 16
    while block_n > 4 and triton.cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    programs = triton.cdiv(n, block_n)
    groups = k // 256
    split_k = 1
    while programs * split_k < sms and groups % (split_k * 2) == 0 and groups // split_k >= 4:
        split_k *= 2
    unroll = 2 if (groups // split_k) % 2 == 0 else 1
    return MmvqConfig(block_n, split_k, unroll, 4)


def use_asm(device: torch.device) -> bool:
    """PTX dp4a on CUDA; the emulation under the interpreter (CPU tensors)."""
    return device.type == "cuda"


def mmvq(
    a: Q8Act,
    w: QTensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    config: MmvqConfig | None = None,
) -> torch.Tensor:
    """y [M, N] = x @ dequant(w).T for quantized activations `a` (M <= MAX_M) -> out_dtype.

    `w` a 2-D QTensor of a type in MMVQ_QTYPES with K = a.k a multiple of 256. `out`, when
    given, is an [M, N] tensor with unit last stride that receives the result."""
    check_weight(w, 2)
    if w.qtype not in MMVQ_QTYPES:
        raise ValueError(f"mmvq: no kernel for {w.qtype.name}")
    m, k = a.rows, a.k
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"activations have K={k}, weight {w.shape}")
    if m > MAX_M:
        raise ValueError(f"mmvq takes at most {MAX_M} rows, got {m}")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.q.device)
    elif out.shape != (m, n) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{m}, {n}] with unit last stride")
    if m == 0:
        return out
    cfg = config or mmvq_config(n, k, num_sms(a.q.device))
    groups = k // 256
    if groups % cfg.split_k or (groups // cfg.split_k) % cfg.unroll:
        raise ValueError(f"{cfg} does not divide the {groups} groups of K={k}")
    if cfg.split_k == 1:
        dst, stride_os = out, 0
    else:
        dst = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=out.device)
        stride_os = dst.stride(0)
    _mmvq_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        a.q, a.d, a.s, w.data, dst, m, n, a.q.stride(0), a.d.stride(0), w.data.stride(0),
        stride_os, dst.stride(-2), QTYPE=int(w.qtype), BLOCK_N=cfg.block_n,
        M_BLOCK=triton.next_power_of_2(m), GROUPS_PER_SPLIT=groups // cfg.split_k,
        UNROLL=cfg.unroll, ASM=use_asm(out.device), num_warps=cfg.num_warps,
    )  # fmt: skip
    if cfg.split_k > 1:
        out.copy_(dst.sum(dim=0))  # [M, N], fixed order
    return out


__all__ = [
    "MAX_M",
    "MMVQ_QTYPES",
    "MmvqConfig",
    "Q8Act",
    "dequantize_q8",
    "mmvq",
    "mmvq_config",
    "mmvq_ref",
    "quantize_q8",
    "quantize_q8_ref",
]

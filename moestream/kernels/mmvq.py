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
blocks are only 2-byte aligned and are read as 16-bit halves joined into words (`WORD_BYTES`;
Q6_K padded to 224-byte blocks, `QTensor.aligned`, is read a 32-bit word at a time;
the 4-bit code types of the "once" variant, `mmvq_codes`: Q4_0 and IQ4_NL as 16-bit halves,
IQ4_XS as words, MXFP4 as bytes).

Two kernels (`MmvqConfig.variant`): "tile" (`_mmvq_kernel` here, over `mmvq_rows`/`acc_runs`,
which the fused MoE shares) loads every operand in one [M, rows, runs, 8 words] tile, so
activations and scales are re-read for every row; "once" (`mmvq_once`, the default) loads a
program's activations once and walks its rows in a static loop, sums each 4 words' dp4a
results as integers and scales once per 16 values. Both are batch invariant (fixed-order
`tree_sum`). This file holds the activation quantization (`quantize_q8`, `store_q8_blocks`),
the low-level jitted helpers the other integer-dot kernels import (`dp4a`, `i2f`, `word16`,
`f16_at`, `k_scale_min_words`, `acc_runs`, `tree_sum`, `mmvq_rows`), the "tile" kernel, the
launch configuration and `mmvq` itself.

Under the Triton interpreter (CPU tests) `dp4a` is emulated with shifts and multiplies (ASM
False); on CUDA it is one PTX instruction.

Letters: M activation rows (<= MAX_M), N output features, K input features (multiple of 256).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from moestream.kernels._triton_dequant import (
    Q6_KP,
    Q6_KP_BYTES,
    check_weight,
    kernel_qtype,
    num_sms,
    reduce_split_k,
    split_k_target,
)
from moestream.kernels.exact import FP_EXACT
from moestream.kernels.ops import MMVQ_DENSE_QTYPES, MMVQ_QTYPES
from moestream.kernels.pdl import pdl_args, pdl_start
from moestream.kernels.tuning import DenseShape, PairShape, tuned, weight_label
from moestream.weights.qtensor import QTensor

MAX_M = 8
QBLOCK = 32  # activation values per scale

Q8_0 = tl.constexpr(8)
Q4_K = tl.constexpr(12)
Q5_K = tl.constexpr(13)
Q6_K = tl.constexpr(14)
_T = GGMLQuantizationType
# Widest load (bytes) the kernels issue on a weight's rows, which `mmvq` checks the rows' start
# and stride against: the alignment of every block in a row that starts so aligned (a row holds
# whole 256-value groups: 144, 176, 210, 8 x 34, 8 x 18, 136 and 8 x 17 bytes).
WORD_BYTES = {_T.Q4_K: 4, _T.Q5_K: 4, _T.Q6_K: 2, _T.Q8_0: 2, _T.Q4_0: 2, _T.IQ4_NL: 2}
WORD_BYTES.update({_T.IQ4_XS: 4, _T.MXFP4: 1})


def check_rows_aligned(w: QTensor, who: str) -> None:
    """That the rows of `w` (2-D, or a stack of them) start `WORD_BYTES` aligned: its data and
    every stride but the last, in bytes."""
    align = 16 if w.padded else WORD_BYTES[w.qtype]  # padded Q6_K: 8-byte scale loads
    if w.data.data_ptr() % align or any(st % align for st in w.data.stride()[:-1]):
        raise ValueError(f"{who}: {w.qtype.name} rows must be {align}-byte aligned")


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


def empty_q8(m: int, k: int, device: torch.device | str) -> Q8Act:
    """An uninitialised Q8Act for m rows of k values (k a multiple of 32), for a kernel to fill."""
    nb = k // QBLOCK
    return Q8Act(
        torch.empty((m, k // 4), dtype=torch.int32, device=device),
        torch.empty((m, nb), dtype=torch.float32, device=device),
        torch.empty((m, nb), dtype=torch.float32, device=device),
    )


def check_q8_out(a: Q8Act, m: int, k: int, device: torch.device, who: str) -> None:
    """ValueError unless `a` has the shapes, dtypes, unit last strides and device of
    `empty_q8(m, k, device)` (its d and s rows with one stride, as the kernels take them)."""
    shapes = ((m, k // 4), (m, k // QBLOCK), (m, k // QBLOCK))
    dtypes = (torch.int32, torch.float32, torch.float32)
    if (
        k % QBLOCK
        or any(t.shape != sh or t.dtype != dt for t, sh, dt in zip(a, shapes, dtypes))
        or any(t.device != device or t.stride(1) != 1 for t in a)
        or a.d.stride(0) != a.s.stride(0)
    ):
        raise ValueError(f"{who}: q8 output must be empty_q8({m}, {k}) on {device}")


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
def i2f(i):
    """float32(i) for int32 |i| < 2^22 in two full-rate ops (an int-to-float conversion runs at
    a fraction of the rate): the bits of 1.5 * 2^23 + i, minus 1.5 * 2^23."""
    return (i + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def word16(h, ok):
    """The int32 at int16 pointer(s) `h` (2-byte aligned), from two 16-bit loads (0 where not
    `ok`)."""
    lo = tl.load(h, mask=ok, other=0).to(tl.int32) & 0xFFFF
    return lo | (tl.load(h + 1, mask=ok, other=0).to(tl.int32) << 16)


@triton.jit
def f16_at(p, ok):
    """The float16 at byte pointer(s) `p` (2-byte aligned) as float32 (0 where not `ok`)."""
    return tl.load(p.to(tl.pointer_type(tl.float16)), mask=ok, other=0.0).to(tl.float32)


@triton.jit
def k_scale_min_words(w1, w2, w3, s):
    """Q4_K/Q5_K 6-bit (scale, min) of sub-block `s` (0..7) from the 12 scale bytes as three
    little-endian words: bytes 0-3 scales 0-3, 4-7 mins 0-3; byte 8+i low nibble scale 4+i,
    high nibble min 4+i, whose top two bits are bits 6-7 of bytes i and 4+i."""
    low = s < 4
    sh = 8 * tl.where(low, s, s - 4)
    a = (w1 >> sh) & 0xFF
    b = (w2 >> sh) & 0xFF
    pk = (w3 >> sh) & 0xFF
    sc = tl.where(low, a & 63, (pk & 15) | ((a >> 2) & 48))
    mn = tl.where(low, b & 63, (pk >> 4) | ((b >> 2) & 48))
    return i2f(sc), i2f(mn)


@triton.jit
def q4_k_nibbles(blk, c, w, ok, Q5: tl.constexpr):
    """(low, high) int32 words of 4 quants each (0..15, Q5_K: 0..31) of word w of 32-byte qs run
    c of the Q4_K (Q5_K when Q5) blocks at byte pointers `blk` (0 where not `ok`): low nibbles
    are sub-block 2c (k = 64c + 4w + i), high nibbles sub-block 2c + 1."""
    QS: tl.constexpr = 48 if Q5 else 16
    qs = tl.load((blk + QS).to(tl.pointer_type(tl.int32)) + 8 * c + w, mask=ok, other=0)
    lo = qs & 0x0F0F0F0F
    hi = (qs >> 4) & 0x0F0F0F0F
    if Q5:
        qh = tl.load((blk + 16).to(tl.pointer_type(tl.int32)) + w, mask=ok, other=0)
        lo = lo | (((qh >> (2 * c)) & 0x01010101) << 4)
        hi = hi | (((qh >> (2 * c + 1)) & 0x01010101) << 4)
    return lo, hi


@triton.jit
def _acc_q4_k(acc, rows, sb, c, ok, wt, xq, xd, xs, Q5: tl.constexpr, ASM: tl.constexpr):
    """Add Q4_K (Q5_K when Q5) runs to acc [MB, BN, R, 8]. Along R, element r is group sb[r],
    32-byte run c[r] (0..3) of qs, where ok[r]; word w of a run: low nibbles sub-block 2c
    (k = 64c + 4w + i), high nibbles sub-block 2c + 1; the run's min term goes to w = 0.
    rows [1, BN, R or 1, 1] byte pointers to row starts; xq (int32), xd, xs (float32)
    [MB, 1, R or 1, 1] pointers to activation rows; wt multiplies the scales (a routing
    weight, or 1.0). Every load has acc's full shape, so it lands in acc's register layout:
    a smaller tile would be moved there through shared memory behind a barrier, and the
    barriers would serialise the loads (seen in the sm_90 SASS)."""
    BLK: tl.constexpr = 176 if Q5 else 144
    z = tl.zeros(acc.shape, tl.int32)
    w = tl.arange(0, 8)[None, None, None, :] + z
    okf = ok & (w >= 0)  # [MB, BN, R, 8]
    blk = rows + sb * BLK + z  # [MB, BN, R, 8]
    lo, hi = q4_k_nibbles(blk, c, w, okf, Q5)
    xw = xq + sb * 64 + 16 * c + w  # [MB, BN, R, 8]
    f0 = i2f(dp4a(lo, tl.load(xw, mask=okf, other=0), z, ASM))
    f1 = i2f(dp4a(hi, tl.load(xw + 8, mask=okf, other=0), z, ASM))
    # Scales, from loads contiguous along w (so they share qs's layout): words 0..3 of the
    # block (d|dmin, 12 scale bytes) and the run's two activation blocks, each picked out by
    # a where-sum over w (exact, and it keeps the parent layout).
    hdr = tl.load(blk.to(tl.pointer_type(tl.int32)) + w, mask=okf & (w < 4), other=0)
    h0 = tl.sum(tl.where(w == 0, hdr, 0), axis=3)[:, :, :, None]  # d | dmin << 16
    h1 = tl.sum(tl.where(w == 1, hdr, 0), axis=3)[:, :, :, None]  # scale bytes 0-3
    h2 = tl.sum(tl.where(w == 2, hdr, 0), axis=3)[:, :, :, None]  # 4-7
    h3 = tl.sum(tl.where(w == 3, hdr, 0), axis=3)[:, :, :, None]  # 8-11
    cc = tl.sum(tl.where(w == 0, c, 0), axis=3)[:, :, :, None]  # the run, 0..3
    sc0, mn0 = k_scale_min_words(h1, h2, h3, 2 * cc)
    sc1, mn1 = k_scale_min_words(h1, h2, h3, 2 * cc + 1)
    d = (h0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * wt
    dmin = ((h0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * wt
    b0 = sb * 8 + 2 * c + w  # activation blocks 2c, 2c + 1 at w = 0, 1
    xdv = tl.load(xd + b0, mask=okf & (w < 2), other=0.0)
    xsv = tl.load(xs + b0, mask=okf & (w < 2), other=0.0)
    xd0 = tl.sum(tl.where(w == 0, xdv, 0.0), axis=3)[:, :, :, None]
    xd1 = tl.sum(tl.where(w == 1, xdv, 0.0), axis=3)[:, :, :, None]
    xs0 = tl.sum(tl.where(w == 0, xsv, 0.0), axis=3)[:, :, :, None]
    xs1 = tl.sum(tl.where(w == 1, xsv, 0.0), axis=3)[:, :, :, None]
    # Explicit FMAs: left to the compiler, which multiply-add pairs get contracted depends on
    # how many uses a product has, which changes with M_BLOCK (the sm_90 build differed in
    # the last bit between M = 1 and M = 2); products that feed only an fma or a select leave
    # it nothing to choose.
    acc = tl.fma(d * sc0 * xd0, f0, acc)
    acc = tl.fma(d * sc1 * xd1, f1, acc)
    # The min term as an fma too: `acc - where(w == 0, dmin * m, 0)` left the compiler a
    # multiply and a subtract to contract wherever it folded the select (a register holding
    # only w == 0 lanes), which depends on the layout: the sm_90 builds of the grouped MoE
    # gate/up rounded it once with one warp and twice with two (PTX: neg + fma.rn against
    # selp + sub), and its bits differed on the H200.
    acc = tl.fma(tl.where(w == 0, -dmin, 0.0), tl.fma(mn0, xs0, mn1 * xs1), acc)
    return acc


@triton.jit
def q6_k_fields(rows, sb, n, t, w, ok, PADDED: tl.constexpr):
    """(ql, qh, sc0, sc1, d) of word w of run c = 2n + t of groups sb of Q6_K rows (byte
    pointers `rows`, all tensors in the tile's shape; 0 where not `ok`): the ql and qh words
    (int32; `_acc_q6_k` says which values they hold), the int8 scales 8n + 2t + w // 4 and
    + 4 as int32, d as float32. File blocks (210 bytes, 2-byte aligned) are read as 16-bit
    halves and bytes; padded ones (224 bytes, `QTensor.aligned`) as 32-bit words and one 8-byte
    load of scales 8n .. 8n + 7."""
    if PADDED:
        base = rows + sb * Q6_KP_BYTES
        p = base.to(tl.pointer_type(tl.int32))
        ql = tl.load(p + 16 * n + 8 * t + w, mask=ok, other=0)  # byte 64n + 32t + 4w
        qh = tl.load(p + 32 + 8 * n + w, mask=ok, other=0)  # byte 128 + 32n + 4w
        s = tl.load((base + 192 + 8 * n).to(tl.pointer_type(tl.int64)), mask=ok, other=0)
        sh = 24 - 8 * (2 * t + w // 4)
        sc0 = (s.to(tl.int32) << sh) >> 24  # sign-extended byte of scales 8n .. 8n + 3
        sc1 = ((s >> 32).to(tl.int32) << sh) >> 24  # of 8n + 4 .. 8n + 7
    else:
        base = rows + sb * 210
        h = base.to(tl.pointer_type(tl.int16))
        ql = word16(h + 32 * n + 16 * t + 2 * w, ok)
        qh = word16(h + 64 + 16 * n + 2 * w, ok)
        sp = (base + 192 + 8 * n + 2 * t + w // 4).to(tl.pointer_type(tl.int8))
        sc0 = tl.load(sp, mask=ok, other=0).to(tl.int32)
        sc1 = tl.load(sp + 4, mask=ok, other=0).to(tl.int32)
    return ql, qh, sc0, sc1, f16_at(base + 208, ok)


@triton.jit
def _acc_q6_k(acc, rows, sb, c, ok, wt, xq, xd, PADDED: tl.constexpr, ASM: tl.constexpr):
    """Add Q6_K runs (210-byte blocks; 224 when PADDED, `QTensor.aligned`) to acc
    [MB, BN, R, 8]; arguments as `_acc_q4_k`, with c = 2n + t: half n (128 values), quarter
    r = 2p + t; ql word at 64n + 32t + 4w (nibble p), qh word at 128 + 32n + 4w (bits 2r);
    values k = 128n + 32r + 4w + i, minus 32; int8 scale 8n + 2r + w // 4 (one per 16 values);
    d float16 at 208. File blocks are read as 16-bit halves and bytes, padded ones as 32-bit
    words and one 8-byte scale load; the arithmetic is the same, so are the bits (an expert
    read from a host tier, unpadded, must give what a resident one gives)."""
    z = tl.zeros(acc.shape, tl.int32)
    # Words in a permuted order (3w mod 8): file blocks are 2-byte aligned, so the weight
    # words come from 16-bit loads with no contiguity; a permuted index gives every other
    # load no contiguity either, so all loads get one register layout (no shared-memory
    # conversions, no barriers between the loads in the sm_90 build). Padded blocks keep the
    # order: the tile is summed by position.
    w = (tl.arange(0, 8)[None, None, None, :] * 3) % 8 + z
    okf = ok & (w >= 0)
    n = c // 2
    t = c % 2
    ql, qh, sc0, sc1, d = q6_k_fields(rows + z, sb, n, t, w, okf, PADDED)  # [MB, BN, R, 8]
    v0 = (ql & 0x0F0F0F0F) | (((qh >> (2 * t)) & 0x03030303) << 4)  # r = t
    v1 = ((ql >> 4) & 0x0F0F0F0F) | (((qh >> (2 * t + 4)) & 0x03030303) << 4)  # r = 2 + t
    xw = xq + sb * 64 + 32 * n + 8 * t + w
    x0 = tl.load(xw, mask=okf, other=0)
    x1 = tl.load(xw + 16, mask=okf, other=0)
    m32 = z - 522133280  # bytes 0xE0 = -32: the quants' offset, as one more dp4a
    f0 = i2f(sc0 * dp4a(m32, x0, dp4a(v0, x0, z, ASM), ASM))
    f1 = i2f(sc1 * dp4a(m32, x1, dp4a(v1, x1, z, ASM), ASM))
    b0 = sb * 8 + 4 * n + t + z  # activation block of quarter r = t
    d = d * wt
    xd0 = tl.load(xd + b0, mask=okf, other=0.0)
    xd1 = tl.load(xd + b0 + 2, mask=okf, other=0.0)
    acc = tl.fma(d * xd0, f0, acc)  # explicit FMAs: see `_acc_q4_k`
    return tl.fma(d * xd1, f1, acc)


@triton.jit
def _acc_q8_0(acc, rows, sb, b, ok, wt, xq, xd, ASM: tl.constexpr):
    """Add Q8_0 blocks to acc [MB, BN, R, 8]: element r is block b[r] (0..7) of group sb[r]
    (eight 34-byte blocks: f16 d, int8 q[32]); other arguments as `_acc_q4_k`."""
    z = tl.zeros(acc.shape, tl.int32)
    w = (tl.arange(0, 8)[None, None, None, :] * 3) % 8 + z  # permuted: see `_acc_q6_k`
    okf = ok & (w >= 0)
    blk = sb * 8 + (b * 3) % 8 + z  # block index within the row (blocks permuted likewise)
    h = (rows + blk * 34).to(tl.pointer_type(tl.int16))  # [MB, BN, R, 8]
    q = word16(h + 1 + 2 * w, okf)
    x = tl.load(xq + blk * 8 + w, mask=okf, other=0)
    f = i2f(dp4a(q, x, z, ASM))
    d = tl.load(h.to(tl.pointer_type(tl.float16)), mask=okf, other=0.0).to(tl.float32) * wt
    return tl.fma(d * tl.load(xd + blk, mask=okf, other=0.0), f, acc)  # see `_acc_q4_k`


@triton.jit
def acc_runs(acc, rows, sb, c, ok, wt, xq, xd, xs, QTYPE: tl.constexpr, ASM: tl.constexpr):
    """Add runs of any MMVQ type to acc [MB, BN, R, 8] (see `_acc_q4_k`); c is the run within
    its group (0..3, or the block 0..7 for Q8_0)."""
    if QTYPE == Q8_0:
        acc = _acc_q8_0(acc, rows, sb, c, ok, wt, xq, xd, ASM)
    elif QTYPE == Q6_K or QTYPE == Q6_KP:  # noqa: SIM109
        acc = _acc_q6_k(acc, rows, sb, c, ok, wt, xq, xd, QTYPE == Q6_KP, ASM)
    else:
        tl.static_assert((QTYPE == Q4_K) or (QTYPE == Q5_K), "mmvq: unsupported type")  # noqa: SIM109
        acc = _acc_q4_k(acc, rows, sb, c, ok, wt, xq, xd, xs, QTYPE == Q5_K, ASM)
    return acc


@triton.jit
def tree_sum(x, MB: tl.constexpr, BN: tl.constexpr, N: tl.constexpr):
    """x [MB, BN, ...] with N trailing elements per (m, n) -> [MB, BN], summed as a
    fixed pairwise tree: the same bits whatever layout the compiler gives x (a plain tl.sum's
    order follows the layout, which depends on MB: batch invariance needs this). N is a power
    of two, at most 2^16."""
    y = tl.reshape(x, [MB, BN, N])
    for i in tl.static_range(16):
        if (N >> i) > 1:
            a, b = tl.split(tl.reshape(y, [MB, BN, N >> (i + 1), 2]))
            y = a + b
    return tl.reshape(y, [MB, BN])


@triton.jit
def mmvq_rows(rows, xq, xd, xs, stride_q, stride_d, M, g_lo, GROUPS: tl.constexpr,
              QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, M_BLOCK: tl.constexpr,
              G: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """Dot products float32 [M_BLOCK, BLOCK_N] of weight rows `rows` ([BLOCK_N] uint8 pointers)
    with M quantized activation rows (xq: row 0's int32 words, xd/xs: its block scales; rows
    `stride_q` words / `stride_d` blocks apart; M <= M_BLOCK, a power of two; rows past M
    repeat row M - 1) over groups g_lo .. g_lo + GROUPS - 1, G (a power of two) per step.

    A step loads G groups of every row at once (a tensor dimension, so all their loads are in
    flight together: a decode GEMV is latency-bound otherwise). Every weight word is unpacked
    once for all M rows; a step's products are reduced by `tree_sum` (a fixed order) and the
    steps summed in order, so a row's result has the same bits at any M (batch invariance).
    No 4-D tensor is carried across steps: a loop-carried tile got a layout of its own and a
    shared-memory conversion per step in the sm_90 build."""
    SUB: tl.constexpr = 8 if QTYPE == Q8_0 else 4  # runs of 8 words per group
    m = tl.minimum(tl.arange(0, M_BLOCK), M - 1)[:, None, None, None]  # [MB, 1, 1, 1]
    xq4 = xq + m * stride_q
    xd4 = xd + m * stride_d
    xs4 = xs + m * stride_d
    r4 = rows[None, :, None, None]  # [1, BN, 1, 1]
    gc = tl.arange(0, SUB * G)[None, None, :, None]
    out = tl.zeros([M_BLOCK, BLOCK_N], tl.float32)
    for i in range(0, GROUPS, G):
        sb = g_lo + i + gc // SUB
        ok = sb < g_lo + GROUPS
        part = tl.zeros([M_BLOCK, BLOCK_N, SUB * G, 8], tl.float32)
        part = acc_runs(part, r4, sb, gc % SUB, ok, 1.0, xq4, xd4, xs4, QTYPE, ASM)
        out += tree_sum(part, M_BLOCK, BLOCK_N, SUB * G * 8)
    return out


@triton.jit
def store_q8_blocks(x, b, NB, q_row, d_row, s_row):
    """Round blocks of one activation row to q8 (`quantize_q8_ref`) and store them: x
    [BLOCKS, 8, 4] float32 holds blocks b [BLOCKS] (value 32 b + 4 w + i at [., w, i]); the
    words go to q_row + 8 b (int32), d and s to d_row + b, s_row + b, where b < NB. The one
    place the rounding is written: `quantize_q8` and the fused norm (`norm_rope`) both call it,
    so their bits agree."""
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)  # [BLOCKS]
    c127 = tl.full(amax.shape, 127.0, tl.float32)
    inv = tl.where(amax > 0, tl.math.div_rn(c127, tl.where(amax > 0, amax, 1.0)), 0.0)
    q = tl.floor(x * inv[:, None, None] + 0.5).to(tl.int32)  # [BLOCKS, 8, 4]
    d = tl.math.div_rn(amax, c127)
    s = d * tl.sum(tl.sum(q, axis=2), axis=1).to(tl.float32)
    i = tl.arange(0, 4)[None, None, :]
    words = tl.sum((q & 0xFF) << (8 * i), axis=2)  # [BLOCKS, 8] (disjoint bytes: sum == or)
    ok = b < NB
    w2 = tl.arange(0, 8)[None, :]
    tl.store(q_row + b[:, None] * 8 + w2, words, mask=ok[:, None])
    tl.store(d_row + b, d, mask=ok)
    tl.store(s_row + b, s, mask=ok)


@triton.jit
def _quantize_q8_kernel(x_ptr, q_ptr, d_ptr, s_ptr, NB, stride_xm, stride_qm, stride_dm,
                        BLOCKS: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Program (row m, BLOCKS activation blocks): see `quantize_q8_ref`."""
    pdl_start(PDL)
    m = tl.program_id(0)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)  # [BLOCKS]
    bc = tl.minimum(b, NB - 1)[:, None, None]
    w = tl.arange(0, 8)[None, :, None]
    i = tl.arange(0, 4)[None, None, :]
    x = tl.load(x_ptr + m * stride_xm + bc * 32 + 4 * w + i).to(tl.float32)  # [BLOCKS, 8, 4]
    store_q8_blocks(x, b, NB, q_ptr + m * stride_qm, d_ptr + m * stride_dm, s_ptr + m * stride_dm)


def quantize_q8(x: torch.Tensor, blocks: int = 8) -> Q8Act:
    """x [M, K] float (unit stride along K, K a multiple of 32) -> Q8Act (`quantize_q8_ref`)."""
    if x.dim() != 2 or x.shape[1] % QBLOCK or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with K % 32 == 0 and unit stride, got {x.shape}")
    m, k = x.shape
    nb = k // QBLOCK
    q, d, s = empty_q8(m, k, x.device)
    if m:
        _quantize_q8_kernel[(m, triton.cdiv(nb, blocks))](
            x,
            q,
            d,
            s,
            nb,
            x.stride(0),
            q.stride(0),
            d.stride(0),
            BLOCKS=blocks,
            num_warps=4,
            **pdl_args(x.device),
            **FP_EXACT,  # x * inv + 0.5 rounded twice, as quantize_q8_ref
        )
    return Q8Act(q, d, s)


@triton.jit
def _mmvq_kernel(q_ptr, d_ptr, s_ptr, w_ptr, out_ptr, M, N, stride_qm, stride_dm, stride_wn,
                 stride_os, stride_om, GROUPS_PER_SPLIT: tl.constexpr, QTYPE: tl.constexpr,
                 BLOCK_N: tl.constexpr, M_BLOCK: tl.constexpr, G: tl.constexpr,
                 ASM: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    pdl_start(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64) * stride_wn  # [BLOCK_N]
    g_lo = pid_k * GROUPS_PER_SPLIT
    acc = mmvq_rows(
        rows, q_ptr, d_ptr, s_ptr, stride_qm, stride_dm, M, g_lo, GROUPS_PER_SPLIT,
        QTYPE, BLOCK_N, M_BLOCK, G, ASM,
    )  # [M_BLOCK, BLOCK_N]  # fmt: skip
    m = tl.arange(0, M_BLOCK)[:, None]
    dst = out_ptr + pid_k * stride_os + m * stride_om + n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=(m < M) & (n[None, :] < N))


VARIANTS = ("tile", "once")
# The kernel `mmvq_config` picks. H200 (`bench/mmvq_sweep.py`, 2026-11-30): "once" was faster
# on all 14 decode cases (Qwen3-30B-A3B and Qwen3-8B, M = 1 and 2), e.g. 30B q/k/v 4.9 us
# against 6.2, 8B gate+up 20.5 against 39.9, the 30B output head 124 against 174.
DEFAULT_VARIANT = "once"


class MmvqConfig(NamedTuple):
    """Launch shape of `mmvq`: rows per program, K splits, groups per step (a power of two),
    warps, and the kernel: "tile" (`_mmvq_kernel`: [M, rows, runs, 8] tile, activations loaded
    per row) or "once" (`mmvq_once`: activations loaded once per program, rows walked by a
    static loop; its warps are capped by `mmvq_once.once_warps`)."""

    block_n: int = 16
    split_k: int = 1
    groups: int = 4
    num_warps: int = 4
    variant: str = "tile"


def groups_per_step(groups: int, m_block: int, block_n: int, budget: int = 32) -> int:
    """Groups loaded per step: all of a row's (up to 8) while M_BLOCK x BLOCK_N x G stays within
    `budget` (registers), at least 1; a power of two."""
    g = 1
    while g < min(groups, 8) and m_block * block_n * g * 2 <= budget:
        g *= 2
    return g


# H200, Qwen3-8B's Q4_K decode GEMVs at M = 1 (`bench/kernels_gpu.py --sweep-once-8b`,
# 2026-11-30, one sample each, us): one warp a program where its K holds >= 16 groups (K >=
# 4096) beat two or four on every shape: q/k/v 6144 x 4096 7.6 against 8.0, o 4096 x 4096 6.0 /
# 6.4, gate/up 24576 x 4096 19.9 / 21.8 (67% of copy bandwidth), down 4096 x 12288 (4 rows, 16
# groups a step) 12.7 / 14.1. At M = 1 only: the sm_90 builds of one warp spill from M = 2
# (16 groups a step) or M = 8 (8 groups). Warps and rows per program do not change a row's
# arithmetic, so the bits stay those of the other M. Off only to compare. From K = 2048 (8
# groups: the 30B's q/k/v) since 2026-12-01: the 30B's batch-1 decode 499.8 -> 503.5 tok/s
# (+0.7%, medians of two arms each, interleaved, the arms' ranges apart).
LONG_K_ONE_WARP = True
ONE_WARP_MIN_GROUPS = 8


def _one_warp_groups() -> int:
    """Groups from which M = 1 "once" GEMVs take one warp (0: never), read at each call so that
    a patched `LONG_K_ONE_WARP` / `ONE_WARP_MIN_GROUPS` is a key of the memoized configs."""
    return ONE_WARP_MIN_GROUPS if LONG_K_ONE_WARP else 0


def mmvq_config(
    n: int,
    k: int,
    sms: int,
    m_block: int = 1,
    variant: str = DEFAULT_VARIANT,
    padded: bool = False,
    qtype: GGMLQuantizationType | None = None,
    device: torch.device | None = None,
) -> MmvqConfig:
    """The hand-made launch shape (`_default_config`, memoized: `mmvq` asks on every call);
    for the "once" variant, given the weight's `qtype` and the `device`, with the rows per
    program and warps that `moestream tune` cached for that device and shape
    (`kernels.tuning`: they leave a row's arithmetic, hence its bits, as they are)."""
    cfg = _default_config(n, k, sms, m_block, variant, padded, _one_warp_groups())
    if qtype is None or device is None or cfg.variant != "once":
        return cfg
    return tuned(device, DenseShape(weight_label(qtype, padded), n, k, m_block), cfg)


@lru_cache(maxsize=4096)
def _default_config(
    n: int, k: int, sms: int, m_block: int, variant: str, padded: bool, one_warp_groups: int
) -> MmvqConfig:
    """4 rows per program (2 while that leaves fewer than two programs per SM); a K split (a
    power of two, >= 8 groups per split; its partials cost two more launches) only while the
    programs would fill under half the SMs. "tile": groups per step from `groups_per_step`
    (which depends on M: a row's bits can then differ between M = 1 and M >= 2 once a row takes
    three or more steps, e.g. K >= 2048 at M = 4); from the H200 sweep
    (`bench/kernels_gpu.py --sweep`): 4 rows and 8 groups per step were fastest or within 3% on
    every decode shape of Qwen3-30B-A3B and Qwen3-8B. "once": up to 8 groups per step, 2 warps
    (capped by `mmvq_once.once_warps`; one at M = 1 with a long K, `LONG_K_ONE_WARP`); the
    groups per step and the K split, which fix a row's arithmetic, do not depend on M, so a
    row's bits do not either.
    `padded` (Q6_K in 224-byte blocks) has shapes of its own for the head and K >= 8192."""
    block_n = 4
    if triton.cdiv(n, block_n) < 2 * sms:
        block_n = 2
    programs = triton.cdiv(n, block_n)
    groups = k // 256
    split_k = 1
    while 2 * programs * split_k < sms and groups % (split_k * 2) == 0 and groups // split_k >= 8:
        split_k *= 2
    if variant == "once" and padded:
        # H200, padded Q6_K (`bench/kernels_gpu.py --sweep-q6k-padded`, 2026-11-30): the
        # 151936 x 2048 head 74.3 us with 4 rows and 4 groups a step (80.6 with the 16 rows
        # below), the 4096 x 12288 8B down 16.7 us with 4 rows, 8 groups, 2 warps (22.4).
        if n >= 1 << 16 and split_k == 1:
            return MmvqConfig(4, 1, min(4, groups), 4, "once")
        if groups // split_k >= 32:
            return MmvqConfig(4, split_k, 8, 2, "once")
    if variant == "once":
        # From the same sweep: 16 rows per program for an output head (N >= 64k rows: 124 us
        # against 145 with 4), 8 rows and 16 groups per step for K >= 8192 (8B down: 27.7
        # against 30.2 us); 4 rows and up to 8 groups elsewhere. One warp where a program's K
        # holds `one_warp_groups` groups or more (`ONE_WARP_MIN_GROUPS`; 0: `LONG_K_ONE_WARP` off).
        if n >= 1 << 16 and split_k == 1:
            return MmvqConfig(16, 1, 1 << (min(groups, 8).bit_length() - 1), 4, "once")
        long_k = one_warp_groups > 0 and m_block == 1 and groups // split_k >= one_warp_groups
        if groups // split_k >= 32:
            return (
                MmvqConfig(4, split_k, 16, 1, "once")
                if long_k
                else MmvqConfig(8, split_k, 16, 4, "once")
            )
        g = 1 << (min(groups // split_k, 8).bit_length() - 1)  # a power of two <= 8
        return MmvqConfig(block_n, split_k, g, 1 if long_k else 2, "once")
    return MmvqConfig(block_n, split_k, groups_per_step(groups // split_k, m_block, block_n), 4)


def use_asm(device: torch.device) -> bool:
    """PTX dp4a on CUDA; the emulation under the interpreter (CPU tensors)."""
    return device.type == "cuda"


def q8_matmul_out(
    a: Q8Act,
    w: QTensor,
    qtypes: frozenset,
    name: str,
    out: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The checks of a matmul on activations quantized by `quantize_q8` (`mmvq`, `mmq`): w 2-D
    of a type in `qtypes` with K = a.k; returns `out` ([M, N], unit last stride) or a new
    [M, N] of out_dtype."""
    check_weight(w, 2)
    if w.qtype not in qtypes:
        raise ValueError(f"{name}: no kernel for {w.qtype.name}")
    m, n = a.rows, w.shape[0]
    if w.shape[1] != a.k:
        raise ValueError(f"activations have K={a.k}, weight {w.shape}")
    if out is None:
        return torch.empty((m, n), dtype=out_dtype, device=a.q.device)
    if out.shape != (m, n) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{m}, {n}] with unit last stride")
    return out


def mmvq(
    a: Q8Act,
    w: QTensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    config: MmvqConfig | None = None,
) -> torch.Tensor:
    """y [M, N] = x @ dequant(w).T for quantized activations `a` (M <= MAX_M) -> out_dtype.

    `w` a 2-D QTensor of a type in MMVQ_DENSE_QTYPES (the "tile" variant: MMVQ_QTYPES) with
    K = a.k a multiple of 256. `out`, when given, is an [M, N] tensor with unit last stride that
    receives the result."""
    out = q8_matmul_out(a, w, MMVQ_DENSE_QTYPES, "mmvq", out, out_dtype)
    m, k, n = a.rows, a.k, w.shape[0]
    if m > MAX_M:
        raise ValueError(f"mmvq takes at most {MAX_M} rows, got {m}")
    if m == 0:
        return out
    m_block = triton.next_power_of_2(m)
    dev = a.q.device
    cfg = config or mmvq_config(
        n, k, num_sms(dev), m_block, padded=w.padded, qtype=w.qtype, device=dev
    )
    groups = k // 256
    if groups % cfg.split_k or cfg.groups & (cfg.groups - 1):
        raise ValueError(f"{cfg} does not fit the {groups} groups of K={k}")
    if cfg.variant not in VARIANTS or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"{cfg}: variant must be one of {VARIANTS}, block_n a power of two")
    if cfg.variant == "tile" and w.qtype not in MMVQ_QTYPES:
        raise ValueError(f'mmvq: no "tile" kernel for {w.qtype.name}')
    check_rows_aligned(w, "mmvq")
    dst, stride_os = split_k_target(out, cfg.split_k)
    if cfg.variant == "once":
        from moestream.kernels.mmvq_once import launch_mmvq_once  # it imports this module

        launch_mmvq_once(a, w, dst, stride_os, cfg, m_block)
    else:
        _mmvq_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
            a.q, a.d, a.s, w.data, dst, m, n, a.q.stride(0), a.d.stride(0), w.data.stride(0),
            stride_os, dst.stride(-2), groups // cfg.split_k, QTYPE=kernel_qtype(w),
            BLOCK_N=cfg.block_n, M_BLOCK=m_block, G=cfg.groups,
            ASM=use_asm(out.device), num_warps=cfg.num_warps, **pdl_args(out.device),
        )  # fmt: skip
    reduce_split_k(out, dst)
    return out


def default_pair_config(n: int, k: int, sms: int, m_block: int) -> MmvqConfig:
    """`mmvq_pair`'s launch shape for N + N2 = n rows: `mmvq_config`'s default "once" shape,
    without its K split (then up to 8 groups a step). Memoized."""
    return _pair_config(n, k, sms, m_block, _one_warp_groups())


@lru_cache(maxsize=1024)
def _pair_config(n: int, k: int, sms: int, m_block: int, one_warp_groups: int) -> MmvqConfig:
    cfg = _default_config(n, k, sms, m_block, "once", False, one_warp_groups)
    if cfg.split_k != 1 or cfg.variant != "once":
        g = 1 << (min(k // 256, 8).bit_length() - 1)
        cfg = MmvqConfig(cfg.block_n, 1, g, cfg.num_warps, "once")
    return cfg


def mmvq_pair(
    a: Q8Act,
    w: QTensor,
    w2: QTensor,
    out_dtype: torch.dtype = torch.float32,
    config: MmvqConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[M, N + N2]: `mmvq` of `a` with w, then with w2 (both 2-D, types in MMVQ_DENSE_QTYPES,
    the same K), in one launch of the "once" kernel: one launch less where a layer's
    projections over one input do not share a type (Qwen3's Q4_K q/k and Q6_K v in the
    Q4_K_M mix). `config` (variant "once", no K split) serves both; by default
    `default_pair_config`'s, with the rows per program and warps `moestream tune` cached for
    the device and shape (`kernels.tuning`). `out`, when given, is a contiguous
    [M, N + N2] tensor that receives the result."""
    for x in (w, w2):
        check_weight(x, 2)
        if x.qtype not in MMVQ_DENSE_QTYPES:
            raise ValueError(f"mmvq_pair: no kernel for {x.qtype.name}")
        if x.shape[1] != a.k:
            raise ValueError(f"activations have K={a.k}, weight {x.shape}")
    m, k, n, n2 = a.rows, a.k, w.shape[0], w2.shape[0]
    if m > MAX_M:
        raise ValueError(f"mmvq_pair takes at most {MAX_M} rows, got {m}")
    if out is None:
        out = torch.empty((m, n + n2), dtype=out_dtype, device=a.q.device)
    elif out.shape != (m, n + n2) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{m}, {n + n2}]")
    if m == 0:
        return out
    m_block = triton.next_power_of_2(m)
    if config is None:
        dev = a.q.device
        shape = PairShape(
            weight_label(w.qtype, w.padded), weight_label(w2.qtype, w2.padded), n, n2, k, m_block
        )
        cfg = tuned(dev, shape, default_pair_config(n + n2, k, num_sms(dev), m_block))
    elif config.split_k != 1 or config.variant != "once":
        raise ValueError(f"mmvq_pair: {config} must be the once variant without a K split")
    else:
        cfg = config
    if cfg.groups & (cfg.groups - 1) or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"{cfg}: groups and block_n must be powers of two")
    check_rows_aligned(w, "mmvq_pair")
    check_rows_aligned(w2, "mmvq_pair")
    from moestream.kernels.mmvq_once import launch_mmvq_once_pair  # it imports this module

    launch_mmvq_once_pair(a, w, w2, out, cfg, m_block)
    return out


__all__ = [
    "MAX_M",
    "MMVQ_DENSE_QTYPES",
    "MMVQ_QTYPES",
    "MmvqConfig",
    "VARIANTS",
    "Q8Act",
    "dequantize_q8",
    "empty_q8",
    "check_q8_out",
    "mmvq",
    "mmvq_pair",
    "mmvq_config",
    "default_pair_config",
    "mmvq_ref",
    "quantize_q8",
    "quantize_q8_ref",
]

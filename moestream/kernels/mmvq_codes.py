"""The "once" step of `mmvq` (`mmvq_once`) for the 4-bit code types Q4_0, IQ4_NL, IQ4_XS and
MXFP4: dense decode matmuls, and the grouped MoE path (`moe_grouped`, through the same step);
the other MoE kernels and `mmq` keep `ops.MMVQ_QTYPES`.

All four hold 32 values per (sub-)block as 16 bytes of nibbles, value i in the low nibble of
byte i and value 16 + i in the high nibble, with one scale per 32 values: Q4_0 d * (q - 8),
IQ4_NL d * IQ4_NL_VALUES[q], IQ4_XS d * (ls - 32) * IQ4_NL_VALUES[q] (ls the 6-bit scale of
the sub-block) and MXFP4 2^(e - 127) / 2 * FP4_E2M1_X2_VALUES[q]. Every value is an int8, so a
block is one integer dot product with its 32 int8 activations (dp4a, exact) and one float
scale, as Q8_0.

Tile (`mmvq_once`): [R, 2, MB, 4]; element (r, h, ., j) is nibble word jp = 3j mod 4 (bytes
4jp .. 4jp + 3: values 4jp + i and 16 + 4jp + i) of block `code_block(r, h)` of its group, so
a (run, half) is one block and its four words sit in one lane. The blocks are permuted along
runs and halves, as Q8_0's (`mmvq_once._once_step`), so that no load is contiguous along the
tile and all loads share one register layout.

Unpacking: Q4_0 takes the nibbles as they are (q & 0x0F0F0F0F, (q >> 4) & 0x0F0F0F0F) and adds
the -8 offset as -8 * sum(x) per block, computed once per step from the activations alone.
The table types look their codes up in a 16-entry int8 table with byte permutes (`lookup16`,
PTX prmt: llama.cpp's get_int_from_table_16), four codes at a time in the order of the word's
nibbles (low, high, low, high), so their activation words are interleaved to match, once per
step (`interleave`). Sums stay below 2^22 (32 x 127 x 127), as `mmvq.i2f` needs.

Alignment: Q4_0 and IQ4_NL blocks (18 bytes) are read as 16-bit halves (`mmvq.word16`),
IQ4_XS super-blocks (136 bytes, 8-byte aligned in a row of them) as int32 words, MXFP4 blocks
(17 bytes, no alignment) a byte at a time. Under the Triton interpreter prmt is emulated.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moestream.kernels._triton_dequant import IQ4_NL, IQ4_XS, MXFP4, Q4_0, _e8m0_half
from moestream.kernels.mmvq import dp4a, f16_at, i2f, word16
from moestream.weights.dequant_blocks import FP4_E2M1_X2_VALUES, IQ4_NL_VALUES


def _int8_table(values: tuple[int, ...]) -> tuple[tl.constexpr, ...]:
    """A 16-entry int8 table as four int32 words: byte i % 4 of word i // 4 is entry i."""
    chunks = (bytes(v & 0xFF for v in values[i : i + 4]) for i in range(0, 16, 4))
    return tuple(tl.constexpr(int.from_bytes(c, "little", signed=True)) for c in chunks)


IQ4_T0, IQ4_T1, IQ4_T2, IQ4_T3 = _int8_table(IQ4_NL_VALUES)
FP4_T0, FP4_T1, FP4_T2, FP4_T3 = _int8_table(FP4_E2M1_X2_VALUES)


@triton.jit
def prmt(a, b, c, ASM: tl.constexpr):
    """Byte permute (PTX prmt.b32, default mode): byte i of the result is byte s of the 8 bytes
    {b, a} (a bytes 0-3, b bytes 4-7), s = bits 4i .. 4i + 2 of c, whose bit 4i + 3 must be 0
    (it would replicate the sign)."""
    if ASM:
        out = tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        out = tl.zeros(c.shape, tl.int32)
        for i in tl.static_range(4):
            s = (c >> (4 * i)) & 7
            byte = (tl.where(s < 4, a, b) >> (8 * (s & 3))) & 0xFF
            out = out | (byte << (8 * i))
    return out


@triton.jit
def lookup16(codes, T0, T1, T2, T3, ASM: tl.constexpr):
    """Int8 table entries (table in T0..T3: `_int8_table`) of the eight 4-bit codes of the int32
    `codes`, as two int32 of four bytes each: codes 0-3 (bits 0..15; code i -> byte i), then
    codes 4-7. Per four codes, the entry from the low and from the high half of the table, then
    per byte the one that bit 3 of the code picks (prmt reads bits 0..15 of its selector, so
    each mask serves both halves of the word, shifted)."""
    sel = codes & 0x77777777
    pick = ((codes >> 1) & 0x44444444) | 0x32103210  # byte i of lo, or of hi where bit 3
    z = tl.zeros(codes.shape, tl.int32)
    t0, t1, t2, t3 = z + T0, z + T1, z + T2, z + T3
    e = prmt(prmt(t0, t1, sel, ASM), prmt(t2, t3, sel, ASM), pick, ASM)
    sel = sel >> 16
    o = prmt(prmt(t0, t1, sel, ASM), prmt(t2, t3, sel, ASM), pick >> 16, ASM)
    return e, o


@triton.jit
def interleave(xa, xb, ASM: tl.constexpr):
    """Activation words (xa: values 4w + i, xb: 16 + 4w + i of a block) in the order `lookup16`
    gives a nibble word's values: [xa0, xb0, xa1, xb1] and [xa2, xb2, xa3, xb3]."""
    z = tl.zeros(xa.shape, tl.int32)
    return prmt(xa, xb, z + 0x5140, ASM), prmt(xa, xb, z + 0x7362, ASM)


@triton.jit
def word8(p, ok):
    """The little-endian int32 at byte pointer(s) `p` (any alignment), from four byte loads."""
    w = tl.load(p, mask=ok, other=0).to(tl.int32) & 0xFF
    for i in tl.static_range(1, 4):
        w = w | ((tl.load(p + i, mask=ok, other=0).to(tl.int32) & 0xFF) << (8 * i))
    return w


@triton.jit
def code_block(r, h):
    """Block (IQ4_XS: sub-block) 0..7 of its group that (run r, half h) holds: blocks c' and
    c' + 4 of run r, c' = 3 (r mod 4) mod 4 (a permutation: no load is contiguous)."""
    return (3 * (r % 4)) % 4 + 4 * h


@triton.jit
def _pick(v, jp, k):
    """v [R, 2, ., 4] at jp == k, as [R, 2, ., 1] (a where-sum: exact, keeps the layout)."""
    return tl.sum(tl.where(jp == k, v, 0), axis=3)[:, :, :, None]


@triton.jit
def _code_row(rows, sb, b, okw, jp, x0, x1, QTYPE: tl.constexpr, ASM: tl.constexpr):
    """(weight scale [R, 2, 1, 1] float32, integer dot [R, 2, MB, 1] int32) of the blocks of one
    row (`rows` a byte pointer) at groups sb [R, 1, 1, 1], blocks b [R, 2, 1, 1]; x0, x1
    [R, 2, MB, 4] the activation words of the row's two unpacked words: Q4_0 the words of the
    low and the high nibbles (its dot without the -8 offset), the table types the words of
    `interleave`."""
    blk = sb * 8 + b  # block of the row
    z = tl.zeros(x0.shape, tl.int32)
    if QTYPE == Q4_0:  # 18 bytes: d f16 | qs[16]
        hp = (rows + blk * 18).to(tl.pointer_type(tl.int16))
        q = word16(hp + 1 + 2 * jp, okw)  # [R, 2, 1, 4]
        s = dp4a(q & 0x0F0F0F0F, x0, dp4a((q >> 4) & 0x0F0F0F0F, x1, z, ASM), ASM)
        dv = f16_at(rows + blk * 18 + 0 * jp, okw & (jp == 0))
    elif QTYPE == IQ4_NL:  # as Q4_0, codes into IQ4_NL_VALUES
        hp = (rows + blk * 18).to(tl.pointer_type(tl.int16))
        q = word16(hp + 1 + 2 * jp, okw)
        e, o = lookup16(q, IQ4_T0, IQ4_T1, IQ4_T2, IQ4_T3, ASM)
        s = dp4a(e, x0, dp4a(o, x1, z, ASM), ASM)
        dv = f16_at(rows + blk * 18 + 0 * jp, okw & (jp == 0))
    elif QTYPE == MXFP4:  # 17 bytes: E8M0 e | qs[16], codes into FP4_E2M1_X2_VALUES
        p = rows + blk * 17
        q = word8(p + 1 + 4 * jp, okw)
        e, o = lookup16(q, FP4_T0, FP4_T1, FP4_T2, FP4_T3, ASM)
        s = dp4a(e, x0, dp4a(o, x1, z, ASM), ASM)
        ev = tl.load(p + 0 * jp, mask=okw & (jp == 0), other=0).to(tl.int32)
        dv = tl.where(jp == 0, _e8m0_half(ev), 0.0)
    else:
        tl.static_assert(QTYPE == IQ4_XS, "mmvq: unsupported code type")
        # 136 bytes: d f16 | scales_h u16 | scales_l u8[4] | qs[128] (16 bytes a sub-block);
        # sub-block b's 6-bit scale: nibble b of scales_l | bits 2b, 2b + 1 of scales_h << 4.
        wp = (rows + sb * 136).to(tl.pointer_type(tl.int32))  # [R, 1, 1, 1]
        q = tl.load(wp + 2 + 4 * b + jp, mask=okw, other=0)
        e, o = lookup16(q, IQ4_T0, IQ4_T1, IQ4_T2, IQ4_T3, ASM)
        s = dp4a(e, x0, dp4a(o, x1, z, ASM), ASM)
        hdr = tl.load(wp + jp, mask=okw & (jp < 2), other=0)  # words 0, 1 at jp = 0, 1
        w0 = _pick(hdr, jp, 0)  # d | scales_h << 16
        w1 = _pick(hdr, jp, 1)  # scales_l
        ls = ((w1 >> (4 * b)) & 15) | (((w0 >> (16 + 2 * b)) & 3) << 4)
        d = (w0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dv = tl.where(jp == 0, d * i2f(ls - 32), 0.0)
    d = tl.sum(dv, axis=3)[:, :, :, None]  # [R, 2, 1, 1]: the jp == 0 term alone
    return d, tl.sum(s, axis=3)[:, :, :, None]


@triton.jit
def once_step_codes(parts, rows0, rows_last, stride_wn, sb, r, h, m, j, ok, xq, xd,
                    QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """`mmvq_once._once_step` for the code types: parts [R, 2, MB, BN] plus one step, the
    activations of runs r (group sb, where ok) loaded once, then each of the BLOCK_N rows (row i
    at rows0 + min(i, rows_last) * stride_wn) added to its column as one FMA per block."""
    col = tl.arange(0, BLOCK_N)[None, None, None, :]  # [1, 1, 1, BN]
    jp = (3 * j) % 4
    okx = ok & (m >= 0) & (h >= 0) & (j >= 0)  # [R, 2, MB, 4]
    okw = ok & (h >= 0) & (j >= 0)  # [R, 2, 1, 4]
    b = code_block(r, h)  # [R, 2, 1, 1]
    xw = xq + (sb * 8 + b) * 8 + jp  # [R, 2, MB, 4]
    xa = tl.load(xw, mask=okx, other=0)  # values 4jp + i of the block
    xb = tl.load(xw + 4, mask=okx, other=0)  # 16 + 4jp + i
    xdv = tl.load(xd + sb * 8 + b + 0 * jp, mask=okx & (jp == 0), other=0.0)
    xdb = tl.sum(xdv, axis=3)[:, :, :, None]  # [R, 2, MB, 1]
    z = tl.zeros(xa.shape, tl.int32)
    if QTYPE == Q4_0:
        x0, x1 = xa, xb
        m8 = z - 117901064  # bytes 0xF8 = -8: the quants' offset, -8 * sum(x) per block
        off = tl.sum(dp4a(m8, xa, dp4a(m8, xb, z, ASM), ASM), axis=3)[:, :, :, None]
    else:
        x0, x1 = interleave(xa, xb, ASM)
        off = tl.sum(z, axis=3)[:, :, :, None]  # zeros [R, 2, MB, 1]
    for i in tl.static_range(BLOCK_N):
        row = rows0 + tl.minimum(i, rows_last).to(tl.int64) * stride_wn
        d, s = _code_row(row, sb, b, okw, jp, x0, x1, QTYPE, ASM)
        parts = tl.where(col == i, tl.fma(d * xdb, i2f(s + off), parts), parts)  # `mmvq._acc_q4_k`
    return parts

"""Triton helpers that unpack GGUF blocks inside a kernel: one 256-value group of BN rows at a time.

Imported only where triton is available (by the kernel modules, which `ops` imports lazily).
This module holds the per-plane family (`unpack_superblock`, `dequant_superblock`,
`plane_k_offsets`: the GEMV/GEMM kernels), the pieces shared with the k-order family of
`_triton_dequant_groups` (`dequant_groups`, `group_k_offsets`: the dequantize-to-bf16 kernel
of `dequant_mm`) and the launchers' checks.

Types (`GROUP_BYTES`): the 32-value block types Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL and MXFP4,
eight blocks to a group, and the 256-value super-blocks Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS.

Contract shared by every kernel: a weight row is a run of GGUF blocks; `unpack_superblock(rows,
sb, magic, QTYPE)` reads group `sb` (super-block `sb` for K-quants and IQ4_XS, blocks 8sb..8sb+7
for the 32-value types) of each row as two "planes" [BN, NG, G] of exact integer quants in
float32, with the scale s and min m [BN, NG, 1] of each run of G (values = q * s - m;
`dequant_superblock` applies them). Each byte is loaded once and its two fields feed the two
planes. The lookup types (IQ4_NL, IQ4_XS, MXFP4) hold table values as their quants: an int8 from a
4-bit code through four packed int32 words (`_table_byte`); MXFP4's table is E2M1 doubled and
its scale the E8M0 exponent halved, as gguf decodes it. A plane is in a permuted k order;
`plane_k_offsets(p, QTYPE)` [NG, G] gives the k offset (within the 256) of each element, so a
kernel loads activations with the same offsets (contiguous runs of G) and either multiplies
elementwise (GEMV) or reshapes both to [., 128] for `tl.dot` (GEMM): a permutation of k applied
to both operands leaves the dot product unchanged.

Integer to float: a field u < 2^23 OR-ed into the bits of 2^23 (`magic` = 0x4B000000) is the
float 2^23 + u, so u = that - 2^23, exactly; a field left at bit 4 gives 2^23 + 16u, and
(v * 1/16 - 2^19) recovers u in one FMA, saving the shift. This costs full-rate ops where an
int-to-float conversion runs at a quarter rate. `magic` is a kernel argument (a register, not an
immediate) so that mask-and-OR compiles to a single LOP3.

Values are computed with gguf's float32 operations in its order (`moestream.weights.dequant_k`
and `dequant_blocks` document the layouts): s = d * sc, then q * s (- dmin * m). The GPU
compiler may contract a multiply and a subtract into one FMA, so results can differ from the
reference by an ulp.

Rows are given as uint8 pointers [BN] to their first byte; callers clamp out-of-range rows to a
valid one (no masks here) and mask the store instead. The planes read each field with loads no
wider than its alignment in a 2-byte aligned row (MXFP4's 17-byte blocks: bytes only; Q5_0's
and Q5_1's u32 high bits: two int16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from moestream.weights.dequant_blocks import FP4_E2M1_X2_VALUES, IQ4_NL_VALUES
from moestream.weights.qtensor import PADDED_BLOCK_BYTES, QTensor

# GGML type ids (constexpr so @jit code can compare against them).
Q4_0 = tl.constexpr(2)
Q4_1 = tl.constexpr(3)
Q5_0 = tl.constexpr(6)
Q5_1 = tl.constexpr(7)
Q8_0 = tl.constexpr(8)
Q2_K = tl.constexpr(10)
Q3_K = tl.constexpr(11)
Q4_K = tl.constexpr(12)
Q5_K = tl.constexpr(13)
Q6_K = tl.constexpr(14)
# Kernel type id of Q6_K in the padded layout (`QTensor.aligned`: 224-byte blocks, every
# section 16-byte aligned); `kernel_qtype` gives it. Not a GGML type. Q6_KP_BYTES: its block.
Q6_KP = tl.constexpr(270)
Q6_KP_BYTES = tl.constexpr(PADDED_BLOCK_BYTES[GGMLQuantizationType.Q6_K])
IQ4_NL = tl.constexpr(20)
IQ4_XS = tl.constexpr(23)
MXFP4 = tl.constexpr(39)

GROUP = 256  # values per `unpack_superblock` call
MAGIC = 0x4B000000  # float32 bits of 2^23: pass as the `magic` kernel argument
# Bytes of a 256-value group, per supported type.
GROUP_BYTES: dict[GGMLQuantizationType, int] = {
    GGMLQuantizationType.Q4_0: 8 * 18,
    GGMLQuantizationType.Q4_1: 8 * 20,
    GGMLQuantizationType.Q5_0: 8 * 22,
    GGMLQuantizationType.Q5_1: 8 * 24,
    GGMLQuantizationType.Q8_0: 8 * 34,
    GGMLQuantizationType.IQ4_NL: 8 * 18,
    GGMLQuantizationType.Q2_K: 84,
    GGMLQuantizationType.Q3_K: 110,
    GGMLQuantizationType.Q4_K: 144,
    GGMLQuantizationType.Q5_K: 176,
    GGMLQuantizationType.Q6_K: 210,
    GGMLQuantizationType.IQ4_XS: 136,
    GGMLQuantizationType.MXFP4: 8 * 17,
}


def kernel_qtype(w: QTensor) -> int:
    """The QTYPE constexpr a kernel takes for `w`: its GGML type, or Q6_KP when padded."""
    return Q6_KP.value if w.padded else int(w.qtype)


def _table_words(values: tuple[int, ...], bias: int) -> tuple[tl.constexpr, ...]:
    """A 16-entry table of small ints as four int32 words: byte i % 4 of word i // 4 holds
    entry i + bias (0..255) (`_table_byte`)."""
    chunks = (bytes(v + bias for v in values[i : i + 4]) for i in range(0, 16, 4))
    return tuple(tl.constexpr(int.from_bytes(c, "little", signed=True)) for c in chunks)


IQ4_W0, IQ4_W1, IQ4_W2, IQ4_W3 = _table_words(IQ4_NL_VALUES, 128)
FP4_W0, FP4_W1, FP4_W2, FP4_W3 = _table_words(FP4_E2M1_X2_VALUES, 12)


@triton.jit
def _f16(ptr):
    """The little-endian float16 at `ptr` (2-byte aligned) as float32."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _word(ptr, TY: tl.constexpr):
    """The little-endian TY (uint8/int16/int32) at `ptr` (uint8 pointers, aligned), as int32."""
    return tl.load(ptr.to(tl.pointer_type(TY))).to(tl.int32)


@triton.jit
def _low(bits, OFFSET: tl.constexpr):
    """float32(u - OFFSET) from bits = magic | u (u in bits 0..22)."""
    return bits.to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def _high(bits, OFFSET: tl.constexpr):
    """float32(u - OFFSET) from bits = magic | (u << 4), in one FMA: (2^23 + 16u) / 16 is exact."""
    return bits.to(tl.float32, bitcast=True) * 0.0625 - (524288.0 + OFFSET)


@triton.jit
def _table_byte(code, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr):
    """Entry `code` (int32, 0..15) of the table packed in W0..W3 (`_table_words`): a word picked
    by two selects, then a shift and a mask."""
    w = tl.where(code < 8, tl.where(code < 4, W0, W1), tl.where(code < 12, W2, W3))
    return (w >> (8 * (code & 3))) & 0xFF


@triton.jit
def _iq4_nl_value(code, magic):
    """IQ4_NL_VALUES[code] as float32 (exact)."""
    return _low(_table_byte(code, IQ4_W0, IQ4_W1, IQ4_W2, IQ4_W3) | magic, 128)


@triton.jit
def _fp4_value(code, magic):
    """FP4_E2M1_X2_VALUES[code] (the E2M1 value doubled) as float32 (exact; code 8 gives +0)."""
    return _low(_table_byte(code, FP4_W0, FP4_W1, FP4_W2, FP4_W3) | magic, 12)


@triton.jit
def _e8m0_half(e):
    """E8M0 exponent byte e (int32) -> 2^(e - 127) / 2 as float32 from its bits (subnormal for
    e < 2), as `dequant_blocks.e8m0_to_float_half`."""
    return tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _k_scale_min(sp, s):
    """Q4_K/Q5_K 6-bit (scale, min) of sub-block `s` (int tensor, 0..7) from the 12 scale bytes
    at `sp`: bytes 0-3 scales 0-3, 4-7 mins 0-3; byte 8+i low nibble scale 4+i, high nibble min
    4+i, whose top two bits are bits 6-7 of bytes i and 4+i."""
    low = s < 4
    i = tl.where(low, s, s - 4)
    a = tl.load(sp + i).to(tl.int32)
    b = tl.load(sp + 4 + i).to(tl.int32)
    pk = tl.load(sp + 8 + i).to(tl.int32)
    sc = tl.where(low, a & 63, (pk & 15) | ((a >> 2) & 48))
    mn = tl.where(low, b & 63, (pk >> 4) | ((b >> 2) & 48))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _q4_k(rows, sb, magic):
    # Plane p, element (c, j): sub-block 2c + p, nibble p of qs[32c + j]; k = 64c + 32p + j.
    blk = rows[:, None, None] + sb * 144  # [BN, 1, 1]
    c = tl.arange(0, 4)[None, :, None]
    j = tl.arange(0, 32)[None, None, :]
    qs = tl.load(blk + 16 + c * 32 + j).to(tl.int32)  # [BN, 4, 32]
    d = _f16(blk)
    dmin = _f16(blk + 2)
    sc0, mn0 = _k_scale_min(blk + 4, 2 * c)  # [BN, 4, 1]
    sc1, mn1 = _k_scale_min(blk + 4, 2 * c + 1)
    q0 = _low((qs & 0x0F) | magic, 0)
    q1 = _high((qs & 0xF0) | magic, 0)
    return q0, q1, d * sc0, d * sc1, dmin * mn0, dmin * mn1


@triton.jit
def _q5_k(rows, sb, magic):
    # As Q4_K with qs at byte 48; bit 4 of sub-block s's value j is bit s of qh[j] (byte 16).
    blk = rows[:, None, None] + sb * 176
    c = tl.arange(0, 4)[None, :, None]
    j = tl.arange(0, 32)[None, None, :]
    qs = tl.load(blk + 48 + c * 32 + j).to(tl.int32)  # [BN, 4, 32]
    qh = tl.load(blk + 16 + j).to(tl.int32)  # [BN, 1, 32]
    d = _f16(blk)
    dmin = _f16(blk + 2)
    sc0, mn0 = _k_scale_min(blk + 4, 2 * c)
    sc1, mn1 = _k_scale_min(blk + 4, 2 * c + 1)
    q0 = _low((qs & 0x0F) | (((qh >> (2 * c)) & 1) << 4) | magic, 0)
    q1 = _high((qs & 0xF0) | (((qh >> (2 * c + 1)) & 1) << 8) | magic, 0)
    return q0, q1, d * sc0, d * sc1, dmin * mn0, dmin * mn1


@triton.jit
def _q6_k(rows, sb, magic, BLK: tl.constexpr):
    # Element (g, jj) of plane p, with h = g // 4, m = g // 2 % 2, t = g % 2, j = 16t + jj:
    # value v = 128h + 64p + 32m + j; low nibble p of ql[16g + jj], high 2 bits are bits
    # 2(2p + m) of qh[32h + j]; q = that - 32; scale int8 sc[v // 16] (byte 192), d f16 at 208.
    blk = rows[:, None, None] + sb * BLK  # 210, or 224 padded
    g = tl.arange(0, 8)[None, :, None]
    jj = tl.arange(0, 16)[None, None, :]
    h = g // 4
    m = (g // 2) % 2
    t = g % 2
    ql = tl.load(blk + 16 * g + jj).to(tl.int32)  # [BN, 8, 16]
    qh = tl.load(blk + 128 + 32 * h + 16 * t + jj).to(tl.int32)  # [BN, 8, 16]
    d = _f16(blk + 208)
    sp = (blk + 192 + 8 * h + 2 * m + t).to(tl.pointer_type(tl.int8))  # [BN, 8, 1]
    sc0 = tl.load(sp).to(tl.float32)
    sc1 = tl.load(sp + 4).to(tl.float32)
    q0 = _low((ql & 0x0F) | (((qh >> (2 * m)) & 3) << 4) | magic, 32)
    q1 = _high((ql & 0xF0) | (((qh >> (2 * m + 4)) & 3) << 8) | magic, 32)
    return q0, q1, d * sc0, d * sc1, 0.0, 0.0


@triton.jit
def _q2_k(rows, sb, magic):
    # Same (g, jj) layout as Q6_K. q = bits 2(2p + m) of qs[32h + j] (qs at byte 16); the
    # scale byte 8h + 4p + 2m + t holds the scale (low nibble) and min (high); d, dmin at 80, 82.
    blk = rows[:, None, None] + sb * 84
    g = tl.arange(0, 8)[None, :, None]
    jj = tl.arange(0, 16)[None, None, :]
    h = g // 4
    m = (g // 2) % 2
    t = g % 2
    qs = tl.load(blk + 16 + 32 * h + 16 * t + jj).to(tl.int32)  # [BN, 8, 16]
    d = _f16(blk + 80)
    dmin = _f16(blk + 82)
    s0 = tl.load(blk + 8 * h + 2 * m + t).to(tl.int32)  # [BN, 8, 1]
    s1 = tl.load(blk + 8 * h + 2 * m + t + 4).to(tl.int32)
    q0 = _low(((qs >> (2 * m)) & 3) | magic, 0)
    q1 = _low(((qs >> (2 * m + 4)) & 3) | magic, 0)
    dl0 = d * (s0 & 15).to(tl.float32)
    dl1 = d * (s1 & 15).to(tl.float32)
    return q0, q1, dl0, dl1, dmin * (s0 >> 4).to(tl.float32), dmin * (s1 >> 4).to(tl.float32)


@triton.jit
def _q3_k_scale(sp, i):
    """Q3_K's signed 6-bit scale `i` (int tensor, 0..15) from the 12 scale bytes at `sp`."""
    lo = tl.load(sp + i % 8).to(tl.int32)
    lo = tl.where(i < 8, lo & 15, lo >> 4)
    hi = (tl.load(sp + 8 + i % 4).to(tl.int32) >> (2 * (i // 4))) & 3
    return (lo | (hi << 4)).to(tl.float32) - 32.0


@triton.jit
def _q3_k(rows, sb, magic):
    # Same (g, jj) layout as Q6_K. Low 2 bits as Q2_K from qs at byte 32; bit 2 is bit
    # 4h + 2p + m of hmask[j] (byte 0); q = low + 4 * bit - 4; scales at 96, d at 108.
    blk = rows[:, None, None] + sb * 110
    g = tl.arange(0, 8)[None, :, None]
    jj = tl.arange(0, 16)[None, None, :]
    h = g // 4
    m = (g // 2) % 2
    t = g % 2
    qs = tl.load(blk + 32 + 32 * h + 16 * t + jj).to(tl.int32)  # [BN, 8, 16]
    hm = tl.load(blk + 16 * t + jj).to(tl.int32)  # [BN, 8, 16]
    d = _f16(blk + 108)
    i0 = 8 * h + 2 * m + t  # [1, 8, 1]
    sc0 = _q3_k_scale(blk + 96, i0)
    sc1 = _q3_k_scale(blk + 96, i0 + 4)
    q0 = _low(((qs >> (2 * m)) & 3) | (((hm >> (4 * h + m)) & 1) << 2) | magic, 4)
    q1 = _low(((qs >> (2 * m + 4)) & 3) | (((hm >> (4 * h + m + 2)) & 1) << 2) | magic, 4)
    return q0, q1, d * sc0, d * sc1, 0.0, 0.0


@triton.jit
def _q8_0(rows, sb, magic):
    # Plane p, element (c, j): block 8sb + 4p + c (34 bytes: d f16 | int8 qs[32]);
    # k = 128p + 32c + j. The int8 q is (byte ^ 0x80) - 128.
    c = tl.arange(0, 4)[None, :, None]
    j = tl.arange(0, 32)[None, None, :]
    blk0 = rows[:, None, None] + sb * 272 + c * 34  # [BN, 4, 1]
    blk1 = blk0 + 4 * 34
    q0 = _low((tl.load(blk0 + 2 + j).to(tl.int32) | magic) ^ 0x80, 128)  # [BN, 4, 32]
    q1 = _low((tl.load(blk1 + 2 + j).to(tl.int32) | magic) ^ 0x80, 128)
    return q0, q1, _f16(blk0), _f16(blk1), 0.0, 0.0


# The split-nibble types below share one plane layout: plane p, element (c, j) is nibble p of
# byte j of run c of 16 quant bytes, k = 32c + 16p + j (`plane_k_offsets`). For the 32-value
# types run c is block 8sb + c.


@triton.jit
def _blocks_of_32(rows, sb, BYTES: tl.constexpr):
    """uint8 pointers [BN, 8, 1] to blocks 8sb .. 8sb + 7 (BYTES each) of rows `rows`."""
    return rows[:, None, None] + sb * (8 * BYTES) + BYTES * tl.arange(0, 8)[None, :, None]


@triton.jit
def _split_planes(blk, magic, QS: tl.constexpr, QH: tl.constexpr, OFFSET: tl.constexpr):
    """(q0, q1) [BN, 8, 16] of the blocks at `blk` ([BN, 8, 1]): the split nibbles at byte QS,
    with bit 4 of value j from bit j of the u32 at byte QH (read as two int16: bytes QH, QH + 1
    for plane 0) where QH >= 0, minus OFFSET."""
    j = tl.arange(0, 16)[None, None, :]
    qs = tl.load(blk + QS + j).to(tl.int32)  # [BN, 8, 16]
    lo = qs & 0x0F
    hi = qs & 0xF0
    if QH >= 0:
        lo = lo | (((_word(blk + QH, tl.int16) >> j) & 1) << 4)
        hi = hi | (((_word(blk + QH + 2, tl.int16) >> j) & 1) << 8)
    return _low(lo | magic, OFFSET), _high(hi | magic, OFFSET)


@triton.jit
def _q4_0(rows, sb, magic):
    # 18 bytes: d f16 | qs[16]; q = code - 8.
    blk = _blocks_of_32(rows, sb, 18)
    q0, q1 = _split_planes(blk, magic, 2, -1, 8)
    d = _f16(blk)
    return q0, q1, d, d, 0.0, 0.0


@triton.jit
def _q4_1(rows, sb, magic):
    # 20 bytes: d f16 | m f16 | qs[16]; values q * d + m, so the min term is -m.
    blk = _blocks_of_32(rows, sb, 20)
    q0, q1 = _split_planes(blk, magic, 4, -1, 0)
    d = _f16(blk)
    m = -_f16(blk + 2)
    return q0, q1, d, d, m, m


@triton.jit
def _q5_0(rows, sb, magic):
    # 22 bytes: d f16 | qh u32 (bit 4 of each value) | qs[16]; q = that - 16.
    blk = _blocks_of_32(rows, sb, 22)
    q0, q1 = _split_planes(blk, magic, 6, 2, 16)
    d = _f16(blk)
    return q0, q1, d, d, 0.0, 0.0


@triton.jit
def _q5_1(rows, sb, magic):
    # 24 bytes: d f16 | m f16 | qh u32 | qs[16]; values q * d + m.
    blk = _blocks_of_32(rows, sb, 24)
    q0, q1 = _split_planes(blk, magic, 8, 4, 0)
    d = _f16(blk)
    m = -_f16(blk + 2)
    return q0, q1, d, d, m, m


@triton.jit
def _iq4_nl(rows, sb, magic):
    # 18 bytes: d f16 | qs[16], codes into IQ4_NL_VALUES.
    blk = _blocks_of_32(rows, sb, 18)
    qs = tl.load(blk + 2 + tl.arange(0, 16)[None, None, :]).to(tl.int32)  # [BN, 8, 16]
    d = _f16(blk)
    return _iq4_nl_value(qs & 0x0F, magic), _iq4_nl_value(qs >> 4, magic), d, d, 0.0, 0.0


@triton.jit
def _iq4_xs(rows, sb, magic):
    # Run s: qs[16s:16s+16] (byte 8), codes into IQ4_NL_VALUES. 6-bit scale s: nibble s % 2 of
    # scales_l[s // 2] (byte 4) | bits 2s of scales_h (u16 at 2) << 4, minus 32; d f16 at 0.
    blk = rows[:, None, None] + sb * 136
    s = tl.arange(0, 8)[None, :, None]
    qs = tl.load(blk + 8 + 16 * s + tl.arange(0, 16)[None, None, :]).to(tl.int32)  # [BN, 8, 16]
    lo = (tl.load(blk + 4 + s // 2).to(tl.int32) >> (4 * (s % 2))) & 15  # [BN, 8, 1]
    hi = (_word(blk + 2, tl.int16) >> (2 * s)) & 3
    dl = _f16(blk) * ((lo | (hi << 4)).to(tl.float32) - 32.0)
    return _iq4_nl_value(qs & 0x0F, magic), _iq4_nl_value(qs >> 4, magic), dl, dl, 0.0, 0.0


@triton.jit
def _mxfp4(rows, sb, magic):
    # 17 bytes: E8M0 e | qs[16], codes into FP4_E2M1_X2_VALUES; the scale is e halved
    # (`_e8m0_half`). Bytes only: blocks have no alignment.
    blk = _blocks_of_32(rows, sb, 17)
    qs = tl.load(blk + 1 + tl.arange(0, 16)[None, None, :]).to(tl.int32)  # [BN, 8, 16]
    d = _e8m0_half(tl.load(blk).to(tl.int32))
    return _fp4_value(qs & 0x0F, magic), _fp4_value(qs >> 4, magic), d, d, 0.0, 0.0


@triton.jit
def unpack_superblock(rows, sb, magic, QTYPE: tl.constexpr):
    """Group `sb` of rows `rows` ([BN] uint8 pointers), factored: (q0, q1, s0, s1, m0, m1)
    with the integer quants of each plane as float32 [BN, NG, G] (exact), their sub-block
    scales s and mins m as float32 [BN, NG, 1] (m is 0.0 for types without a min); the values
    are q * s - m. Planes are [4, 32] for Q4_K, Q5_K, Q8_0 and [8, 16] for the others.
    `magic` is the int32 MAGIC, passed in as a kernel argument."""
    if QTYPE == Q4_K:
        out = _q4_k(rows, sb, magic)
    elif QTYPE == Q5_K:
        out = _q5_k(rows, sb, magic)
    elif QTYPE == Q6_K:
        out = _q6_k(rows, sb, magic, 210)
    elif QTYPE == Q6_KP:
        out = _q6_k(rows, sb, magic, Q6_KP_BYTES)
    elif QTYPE == Q8_0:
        out = _q8_0(rows, sb, magic)
    elif QTYPE == Q2_K:
        out = _q2_k(rows, sb, magic)
    elif QTYPE == Q3_K:
        out = _q3_k(rows, sb, magic)
    elif QTYPE == IQ4_XS:
        out = _iq4_xs(rows, sb, magic)
    elif QTYPE == Q4_0:
        out = _q4_0(rows, sb, magic)
    elif QTYPE == Q4_1:
        out = _q4_1(rows, sb, magic)
    elif QTYPE == Q5_0:
        out = _q5_0(rows, sb, magic)
    elif QTYPE == Q5_1:
        out = _q5_1(rows, sb, magic)
    elif QTYPE == IQ4_NL:
        out = _iq4_nl(rows, sb, magic)
    else:
        tl.static_assert(QTYPE == MXFP4, "unsupported GGML type")
        out = _mxfp4(rows, sb, magic)
    return out


@triton.jit
def dequant_superblock(rows, sb, magic, QTYPE: tl.constexpr):
    """Values of group `sb` of rows `rows` ([BN] uint8 pointers) as two float32 planes
    [BN, NG, G], computed as the reference does: q * (d * sc) - dmin * m."""
    q0, q1, s0, s1, m0, m1 = unpack_superblock(rows, sb, magic, QTYPE)
    return q0 * s0 - m0, q1 * s1 - m1


@triton.jit
def plane_k_offsets(P: tl.constexpr, QTYPE: tl.constexpr):
    """k offsets [NG, G] (within the 256-value group) of plane P's elements."""
    if QTYPE == Q4_K or QTYPE == Q5_K:  # noqa: SIM109 (`in` on constexprs: not in Triton)
        c = tl.arange(0, 4)[:, None]
        offs = 64 * c + 32 * P + tl.arange(0, 32)[None, :]
    elif QTYPE == Q8_0:
        c = tl.arange(0, 4)[:, None]
        offs = 128 * P + 32 * c + tl.arange(0, 32)[None, :]
    elif QTYPE == Q2_K or QTYPE == Q3_K or QTYPE == Q6_K or QTYPE == Q6_KP:  # noqa: SIM109
        g = tl.arange(0, 8)[:, None]
        offs = 128 * (g // 4) + 64 * P + 16 * (g % 4) + tl.arange(0, 16)[None, :]
    else:  # split nibbles
        c = tl.arange(0, 8)[:, None]
        offs = 32 * c + 16 * P + tl.arange(0, 16)[None, :]
    return offs


# ---- launcher checks shared by the kernel modules (plain Python) ----

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_weight(w: QTensor, ndim: int, name: str = "w") -> None:
    """A QTensor the kernels can read: a supported type, `ndim` dims, K a multiple of 256 and
    rows of bytes with unit stride (outer dims may be strided)."""
    if w.qtype not in GROUP_BYTES:
        raise ValueError(f"{name}: no kernel for {w.qtype.name}")
    if len(w.shape) != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {w.shape}")
    if w.shape[-1] % GROUP:
        raise ValueError(f"{name}: K={w.shape[-1]} is not a multiple of {GROUP}")
    if w.data.stride(-1) != 1:
        raise ValueError(f"{name}: row bytes must be contiguous, stride {w.data.stride()}")


def check_activation(x: torch.Tensor, w: QTensor) -> None:
    """x [M, K] with unit stride along K, a float dtype, on w's device; w a 2-D kernel weight."""
    check_weight(w, 2)
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not match weight {w.shape}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x dtype {x.dtype} not in {ACTIVATION_DTYPES}")
    if x.stride(1) != 1:
        raise ValueError(f"x must have unit stride along K, got strides {x.stride()}")
    if x.device != w.device:
        raise ValueError(f"x on {x.device}, weight on {w.device}")


def split_k_target(out: torch.Tensor, split_k: int) -> tuple[torch.Tensor, int]:
    """Where a matmul kernel with `split_k` partial sums over K writes: `out` itself (partial
    stride 0), or a float32 [split_k, M, N] buffer that `reduce_split_k` sums into `out`."""
    if split_k == 1:
        return out, 0
    dst = torch.empty((split_k, *out.shape), dtype=torch.float32, device=out.device)
    return dst, dst.stride(0)


def reduce_split_k(out: torch.Tensor, dst: torch.Tensor) -> None:
    """out = the sum of `split_k_target`'s partials, in split order (deterministic)."""
    if dst is not out:
        out.copy_(dst.sum(dim=0))  # [M, N]


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: the CPU interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count

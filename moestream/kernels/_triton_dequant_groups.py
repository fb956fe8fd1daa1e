"""Triton helpers that unpack GGUF blocks inside a kernel in k order: [BR, GS, NS, SUB] tiles
for wide stores (the dequantize-to-bf16 kernel, `dequant_mm`).

Imported only where triton is available. The supported types, the `magic` integer-to-float
trick, gguf's float32 operations and the uint8 row pointers are the contract of
`_triton_dequant` (its module docstring); its shared pieces (type ids, `_f16`, `_word`, `_low`,
the lookup tables) are imported from there, and so are the names in backquotes below that this
module does not define (`dequant_superblock`, `_k_scale_min`, `_iq4_xs`, `_split_planes`: the
per-plane family that the GEMV/GEMM kernels use).

`dequant_groups(rows, sb, magic, QTYPE)` returns the values of groups `sb` ([GS]) of rows
`rows` ([BR]) as float32 [BR, GS, NS, SUB] whose last two dims are the group's 256 values in
k order (k = SUB * s + j; `group_k_offsets`), so a thread holding 8 consecutive values along
SUB stores them with one 16-byte store. Each value is computed with the float32 operations of
`dequant_superblock` (bit for bit the same). Layout rules that keep the tile in the one
8-per-thread layout of the stores (no shared-memory round trip; check the sm_90 build with
bench/dequant_sweep.py --sass):
- quant bytes are addressed in runs of 8 (`_runs_of_8`), so their loads are 8 bytes wide;
- a load of the tile's shape may repeat bytes (qh of Q5_K: one row of bytes for all s);
- sub-block scales come from loads of one value per (row, group) [BR, GS, 1, 1] (cheap for
  the compiler to repeat in any layout), picked per sub-block by shifts and selects; a
  [BR, GS, NS, 1] load would fix a layout of its own and force a conversion of the tile.
Scale words are read as int32 (Q4_K, Q5_K, Q2_K: 4-byte aligned blocks), int16 (Q6_K, Q3_K,
IQ4_XS and the 32-value types but MXFP4) or bytes (MXFP4); `dequantize_rows` takes this path
only for data aligned to them (`dequant_mm.WORD_ALIGN`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moestream.kernels._triton_dequant import (
    IQ4_NL,
    IQ4_XS,
    MXFP4,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q6_KP,
    Q6_KP_BYTES,
    Q8_0,
    _e8m0_half,
    _f16,
    _fp4_value,
    _iq4_nl_value,
    _low,
    _word,
)


@triton.jit
def _runs_of_8(N: tl.constexpr):
    """arange(0, N) as the compiler sees runs of 8 (contiguity 8): byte loads then take the
    8-per-thread layout of the bfloat16 stores."""
    j = tl.arange(0, N)
    return j // 8 * 8 + j % 8


@triton.jit
def _byte(word, b):
    """Byte b (int tensor) of little-endian int32 words (uint8 value, as int32)."""
    return (word >> (8 * b)) & 0xFF


@triton.jit
def _block_word(blk, s, BYTES: tl.constexpr, OFF: tl.constexpr, TY: tl.constexpr):
    """`_word` at byte OFF of block s (int [NS, 1], 0..7) of the blocks of BYTES at `blk`
    ([BR, GS, 1, 1]) as int32 [BR, GS, NS, 1]: one load per block, picked by s."""
    w = _word(blk + OFF, TY) + tl.zeros_like(s)
    for i in tl.static_range(1, 8):
        w = tl.where(s == i, _word(blk + BYTES * i + OFF, TY), w)
    return w


@triton.jit
def _block_f16(blk, s, BYTES: tl.constexpr, OFF: tl.constexpr):
    """As `_block_word` for the float16 at byte OFF of each block, as float32."""
    d = _f16(blk + OFF) + tl.zeros_like(s).to(tl.float32)
    for i in tl.static_range(1, 8):
        d = tl.where(s == i, _f16(blk + BYTES * i + OFF), d)
    return d


@triton.jit
def _split_nibble(qs, g, jj):
    """Codes [BR, GS, 16, 16] of the split-nibble types (`dequant_groups`): value 16g + jj is
    nibble g % 2 of byte jj of the run of 16 bytes at `qs` ([BR, GS, 16, 1], one run per g)."""
    return (tl.load(qs + jj).to(tl.int32) >> (4 * (g % 2))) & 0x0F


@triton.jit
def _k_scale_min_words(sp, s):
    """`_k_scale_min` from three int32 loads per (row, group) at `sp` ([BR, GS, 1, 1])."""
    i = s % 4
    a = _byte(_word(sp, tl.int32), i)  # [BR, GS, NS, 1]
    b = _byte(_word(sp + 4, tl.int32), i)
    pk = _byte(_word(sp + 8, tl.int32), i)
    low = s < 4
    sc = tl.where(low, a & 63, (pk & 15) | ((a >> 2) & 48))
    mn = tl.where(low, b & 63, (pk >> 4) | ((b >> 2) & 48))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _tile(ptr, like):
    """`ptr` broadcast to the shape of `like` (a load then takes the tile's layout)."""
    return tl.broadcast_to(ptr, like.shape)


@triton.jit
def _q4_k_groups(blk, magic):
    # value 32s + j: nibble s % 2 of qs[32(s // 2) + j]; (scale, min) s.
    s = tl.arange(0, 8)[:, None]  # [8, 1]
    j = _runs_of_8(32)[None, :]  # [1, 32]
    qs = tl.load(blk + 16 + 32 * (s // 2) + j).to(tl.int32)  # [BR, GS, 8, 32]
    sc, mn = _k_scale_min_words(blk + 4, s)  # [BR, GS, 8, 1]
    q = _low(((qs >> (4 * (s % 2))) & 0x0F) | magic, 0)
    return q * (_f16(blk) * sc) - _f16(blk + 2) * mn


@triton.jit
def _q5_k_groups(blk, magic):
    # As Q4_K with qs at byte 48; bit 4 of value 32s + j is bit s of qh[j] (byte 16).
    s = tl.arange(0, 8)[:, None]
    j = _runs_of_8(32)[None, :]
    qs = tl.load(blk + 48 + 32 * (s // 2) + j).to(tl.int32)  # [BR, GS, 8, 32]
    qh = tl.load(_tile(blk + 16 + j, qs)).to(tl.int32)  # [BR, GS, 8, 32], rows repeated
    sc, mn = _k_scale_min_words(blk + 4, s)
    q = _low(((qs >> (4 * (s % 2))) & 0x0F) | (((qh >> s) & 1) << 4) | magic, 0)
    return q * (_f16(blk) * sc) - _f16(blk + 2) * mn


@triton.jit
def _q6_k_groups(blk, magic):
    # value 16g + jj, with h = g // 8, p = g // 4 % 2, m = g // 2 % 2, t = g % 2: nibble p of
    # ql[64h + 32m + 16t + jj], high 2 bits are bits 2(g // 2 % 4) of qh[32h + 16t + jj]
    # (byte 128); q = that - 32; scale int8 sc[g] (byte 192, read as 8 int16), d f16 at 208.
    g = tl.arange(0, 16)[:, None]  # [16, 1]
    jj = _runs_of_8(16)[None, :]  # [1, 16]
    h = g // 8
    t = g % 2
    ql = tl.load(blk + 64 * h + 32 * (g // 2 % 2) + 16 * t + jj).to(tl.int32)  # [BR, GS, 16, 16]
    qh = tl.load(blk + 128 + 32 * h + 16 * t + jj).to(tl.int32)
    pair = _word(blk + 192, tl.int16) + tl.zeros_like(g)  # [BR, GS, 16, 1]
    for i in tl.static_range(1, 8):
        pair = tl.where(g // 2 == i, _word(blk + 192 + 2 * i, tl.int16), pair)
    sc = ((_byte(pair, t) ^ 0x80) - 0x80).to(tl.float32)  # int8
    lo = (ql >> (4 * (g // 4 % 2))) & 0x0F
    q = _low(lo | (((qh >> (2 * (g // 2 % 4))) & 3) << 4) | magic, 32)
    return q * (_f16(blk + 208) * sc)


@triton.jit
def _q2_k_groups(blk, magic):
    # value 16g + jj (h, t as Q6_K): bits 2(g // 2 % 4) of qs[32h + 16t + jj] (byte 16); byte g
    # holds the scale (low nibble) and min (high); d, dmin at 80, 82.
    g = tl.arange(0, 16)[:, None]
    jj = _runs_of_8(16)[None, :]
    qs = tl.load(blk + 16 + 32 * (g // 8) + 16 * (g % 2) + jj).to(tl.int32)  # [BR, GS, 16, 16]
    word = _word(blk, tl.int32) + tl.zeros_like(g)  # [BR, GS, 16, 1]
    for i in tl.static_range(1, 4):
        word = tl.where(g // 4 == i, _word(blk + 4 * i, tl.int32), word)
    s = _byte(word, g % 4)
    q = _low(((qs >> (2 * (g // 2 % 4))) & 3) | magic, 0)
    dl = _f16(blk + 80) * (s & 15).to(tl.float32)
    return q * dl - _f16(blk + 82) * (s >> 4).to(tl.float32)


@triton.jit
def _q3_k_groups(blk, magic):
    # value 16g + jj (h, t as Q6_K): low 2 bits as Q2_K from qs at byte 32; bit 2 is bit g // 2
    # of hmask[16t + jj] (byte 0); q = low + 4 * bit - 4; d f16 at 108. Scale g (6 bits, -32):
    # nibble g // 8 of byte g % 8 of the 12 at byte 96, high 2 bits field g // 4 of byte
    # 8 + g % 4 (the bytes read as 6 int16).
    g = tl.arange(0, 16)[:, None]
    jj = _runs_of_8(16)[None, :]
    t = g % 2
    qs = tl.load(blk + 32 + 32 * (g // 8) + 16 * t + jj).to(tl.int32)  # [BR, GS, 16, 16]
    hm = tl.load(blk + 16 * t + jj).to(tl.int32)
    lo = _word(blk + 96, tl.int16) + tl.zeros_like(g)  # [BR, GS, 16, 1]: bytes 2i, 2i + 1
    for i in tl.static_range(1, 4):
        lo = tl.where(g % 8 // 2 == i, _word(blk + 96 + 2 * i, tl.int16), lo)
    hi = tl.where(g % 4 < 2, _word(blk + 104, tl.int16), _word(blk + 106, tl.int16))
    lo = (_byte(lo, g % 2) >> (4 * (g // 8))) & 15
    hi = (_byte(hi, g % 2) >> (2 * (g // 4))) & 3
    sc = (lo | (hi << 4)).to(tl.float32) - 32.0
    q = _low(((qs >> (2 * (g // 2 % 4))) & 3) | (((hm >> (g // 2)) & 1) << 2) | magic, 4)
    return q * (_f16(blk + 108) * sc)


@triton.jit
def _q8_0_groups(blk, magic):
    # value 32s + j: block 8sb + s (34 bytes: d f16 | int8 qs[32]), q = (byte ^ 0x80) - 128.
    s = tl.arange(0, 8)[:, None]
    j = _runs_of_8(32)[None, :]
    q = _low((tl.load(blk + 34 * s + 2 + j).to(tl.int32) | magic) ^ 0x80, 128)  # [BR, GS, 8, 32]
    return q * _block_f16(blk, s, 34, 0)  # [BR, GS, 8, 1] scales


# The split-nibble types take [16, 16] tiles: value 16g + jj is nibble g % 2 of byte jj of run
# g // 2 of 16 quant bytes (block 8sb + g // 2 for the 32-value types), so the byte addresses
# are runs of 8 and a block's fields are picked per g // 2.


@triton.jit
def _iq4_xs_groups(blk, magic):
    # run g // 2 is qs[16s:16s+16] (byte 8), s = g // 2; scale s as `_iq4_xs`, with scales_l
    # read as two int16 (bytes 4-5: s < 4, 6-7).
    g = tl.arange(0, 16)[:, None]
    jj = _runs_of_8(16)[None, :]
    q = _iq4_nl_value(_split_nibble(blk + 8 + 16 * (g // 2), g, jj), magic)  # [BR, GS, 16, 16]
    lo = tl.where(g < 8, _word(blk + 4, tl.int16), _word(blk + 6, tl.int16))  # [BR, GS, 16, 1]
    lo = (lo >> (4 * (g // 2 % 4))) & 15
    hi = (_word(blk + 2, tl.int16) >> (2 * (g // 2))) & 3
    return q * (_f16(blk) * ((lo | (hi << 4)).to(tl.float32) - 32.0))


@triton.jit
def _split_groups(blk, g, jj, magic, BYTES: tl.constexpr, QS: tl.constexpr, QH: tl.constexpr,
                  OFFSET: tl.constexpr):  # fmt: skip
    """Quants [BR, GS, 16, 16] of the blocks of BYTES at `blk` as `_split_planes`: split nibbles
    at byte QS, bit 4 from the u32 at byte QH (its int16 half g % 2) where QH >= 0."""
    s = g // 2
    code = _split_nibble(blk + BYTES * s + QS, g, jj)
    if QH >= 0:
        lo = _block_word(blk, s, BYTES, QH, tl.int16)  # [BR, GS, 16, 1]
        half = tl.where(g % 2 == 0, lo, _block_word(blk, s, BYTES, QH + 2, tl.int16))
        code = code | (((half >> jj) & 1) << 4)
    return _low(code | magic, OFFSET)


@triton.jit
def _q4_0_groups(blk, magic):
    # 18 bytes: d f16 | qs[16]; q = code - 8.
    g = tl.arange(0, 16)[:, None]
    jj = _runs_of_8(16)[None, :]
    return _split_groups(blk, g, jj, magic, 18, 2, -1, 8) * _block_f16(blk, g // 2, 18, 0)


@triton.jit
def _q4_1_groups(blk, magic):
    # 20 bytes: d f16 | m f16 | qs[16]; q * d + m.
    g = tl.arange(0, 16)[:, None]
    jj = _runs_of_8(16)[None, :]
    q = _split_groups(blk, g, jj, magic, 20, 4, -1, 0)
    return q * _block_f16(blk, g // 2, 20, 0) + _block_f16(blk, g // 2, 20, 2)


@triton.jit
def _q5_0_groups(blk, magic):
    # 22 bytes: d f16 | qh u32 | qs[16]; q = that - 16.
    g = tl.arange(0, 16)[:, None]
    jj = _runs_of_8(16)[None, :]
    return _split_groups(blk, g, jj, magic, 22, 6, 2, 16) * _block_f16(blk, g // 2, 22, 0)


@triton.jit
def _q5_1_groups(blk, magic):
    # 24 bytes: d f16 | m f16 | qh u32 | qs[16]; q * d + m.
    g = tl.arange(0, 16)[:, None]
    jj = _runs_of_8(16)[None, :]
    q = _split_groups(blk, g, jj, magic, 24, 8, 4, 0)
    return q * _block_f16(blk, g // 2, 24, 0) + _block_f16(blk, g // 2, 24, 2)


@triton.jit
def _iq4_nl_groups(blk, magic):
    # 18 bytes: d f16 | qs[16], codes into IQ4_NL_VALUES.
    g = tl.arange(0, 16)[:, None]
    jj = _runs_of_8(16)[None, :]
    q = _iq4_nl_value(_split_nibble(blk + 18 * (g // 2) + 2, g, jj), magic)  # [BR, GS, 16, 16]
    return q * _block_f16(blk, g // 2, 18, 0)


@triton.jit
def _mxfp4_groups(blk, magic):
    # 17 bytes: E8M0 e | qs[16], codes into FP4_E2M1_X2_VALUES; bytes only.
    g = tl.arange(0, 16)[:, None]
    jj = _runs_of_8(16)[None, :]
    q = _fp4_value(_split_nibble(blk + 17 * (g // 2) + 1, g, jj), magic)  # [BR, GS, 16, 16]
    return q * _e8m0_half(_block_word(blk, g // 2, 17, 0, tl.uint8))


@triton.jit
def dequant_groups(rows, sb, magic, QTYPE: tl.constexpr):
    """Values of groups `sb` ([GS] int) of rows `rows` ([BR] uint8 pointers, 16-byte aligned
    rows) as float32 [BR, GS, NS, SUB] in k order (`group_k_offsets`): [8, 32] for Q4_K, Q5_K,
    Q8_0 and [16, 16] for the others. The same bits as `dequant_superblock`."""
    if QTYPE == Q4_K:
        out = _q4_k_groups(rows[:, None, None, None] + sb[None, :, None, None] * 144, magic)
    elif QTYPE == Q5_K:
        out = _q5_k_groups(rows[:, None, None, None] + sb[None, :, None, None] * 176, magic)
    elif QTYPE == Q6_K:
        out = _q6_k_groups(rows[:, None, None, None] + sb[None, :, None, None] * 210, magic)
    elif QTYPE == Q6_KP:
        out = _q6_k_groups(rows[:, None, None, None] + sb[None, :, None, None] * Q6_KP_BYTES, magic)
    elif QTYPE == Q8_0:
        out = _q8_0_groups(rows[:, None, None, None] + sb[None, :, None, None] * 272, magic)
    elif QTYPE == Q2_K:
        out = _q2_k_groups(rows[:, None, None, None] + sb[None, :, None, None] * 84, magic)
    elif QTYPE == Q3_K:
        out = _q3_k_groups(rows[:, None, None, None] + sb[None, :, None, None] * 110, magic)
    elif QTYPE == IQ4_XS:
        out = _iq4_xs_groups(rows[:, None, None, None] + sb[None, :, None, None] * 136, magic)
    elif QTYPE == Q4_0:
        out = _q4_0_groups(rows[:, None, None, None] + sb[None, :, None, None] * 144, magic)
    elif QTYPE == Q4_1:
        out = _q4_1_groups(rows[:, None, None, None] + sb[None, :, None, None] * 160, magic)
    elif QTYPE == Q5_0:
        out = _q5_0_groups(rows[:, None, None, None] + sb[None, :, None, None] * 176, magic)
    elif QTYPE == Q5_1:
        out = _q5_1_groups(rows[:, None, None, None] + sb[None, :, None, None] * 192, magic)
    elif QTYPE == IQ4_NL:
        out = _iq4_nl_groups(rows[:, None, None, None] + sb[None, :, None, None] * 144, magic)
    else:
        tl.static_assert(QTYPE == MXFP4, "unsupported GGML type")
        out = _mxfp4_groups(rows[:, None, None, None] + sb[None, :, None, None] * 136, magic)
    return out


@triton.jit
def group_k_offsets(QTYPE: tl.constexpr):
    """k offsets [NS, SUB] (within the 256-value group) of `dequant_groups`' last two dims."""
    if QTYPE == Q4_K or QTYPE == Q5_K or QTYPE == Q8_0:  # noqa: SIM109
        offs = 32 * tl.arange(0, 8)[:, None] + tl.arange(0, 32)[None, :]
    else:
        offs = 16 * tl.arange(0, 16)[:, None] + tl.arange(0, 16)[None, :]
    return offs

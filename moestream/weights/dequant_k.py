"""Torch dequantization of GGML's 256-value super-block types: Q2_K ... Q6_K and IQ4_XS.

Same contract as `dequant_blocks`: uint8 blocks [N, type_size] -> float32 [N, 256], with the
float32 operations of `gguf.quants` in its order (the sub-block scale `d * sc` is rounded to
float32 first, then multiplied by the quant; a min term is subtracted last).
Value index v of a super-block is written as (sub-block, position) below; "split" nibble and
bit-field layouts are those of `dequant_blocks.split_bits`.
"""

from __future__ import annotations

import torch

from moestream.weights.dequant_blocks import IQ4_NL_VALUES, f16_field, lookup, split_bits


# Q2_K (256 values, 84 bytes): scales[16] (low nibble: scale, high nibble: min of each
# 16-value sub-block) | qs[64] | d f16 | dmin f16.
# qs as [2, 32]: value v = 128h + 32k + j is bits 2k..2k+1 of qs[32h + j].
# x = (d * sc) * q - (dmin * m)
def dequant_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    d, dmin = f16_field(blocks, 80), f16_field(blocks, 82)
    dl = (d * (scales & 0xF).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = split_bits(blocks[:, 16:80].reshape(n, 2, 32), 2, 4, dim=-2)  # [N, 2, 4, 32]
    q = q.reshape(n, 16, 16).to(torch.float32)
    return (dl * q).sub_(ml).reshape(n, 256)


def _q3_k_scales(scales: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 scale bytes -> 16 signed 6-bit scales as float32 [N, 16].

    Scale i: low 4 bits are nibble i of the split scales[0:8]; high 2 bits are field i // 4
    (2 bits each) of scales[8 + i % 4]; the result is offset by -32.
    """
    n = scales.shape[0]
    low = split_bits(scales[:, 0:8], 4, 2, dim=-2).reshape(n, 16)
    high = split_bits(scales[:, 8:12], 2, 4, dim=-2).reshape(n, 16)
    return (low | (high << 4)).to(torch.float32) - 32


# Q3_K (256 values, 110 bytes): hmask[32] | qs[64] | scales[12] (16 6-bit scales) | d f16.
# Low 2 bits of value v = 128h + 32k + j: bits 2k..2k+1 of qs[32h + j]; bit 2 of value v is
# bit v // 32 of hmask[j], and a CLEAR bit subtracts 4 (q = low - 4 * !hbit, in -4..3).
# x = (d * sc) * q
def dequant_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 108)
    dl = (d * _q3_k_scales(blocks[:, 96:108])).reshape(n, 16, 1)
    low = split_bits(blocks[:, 32:96].reshape(n, 2, 32), 2, 4, dim=-2).reshape(n, 16, 16)
    hbit = split_bits(blocks[:, 0:32], 1, 8, dim=-2).reshape(n, 16, 16)
    q = low.to(torch.float32) - ((hbit ^ 1) << 2).to(torch.float32)
    return (dl * q).reshape(n, 256)


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes -> (scale, min), each uint8 [N, 8] of 6 bits.

    Bytes 0-3 hold scales 0-3 in bits 0-5, bytes 4-7 mins 0-3 likewise; byte 8+i holds the low
    4 bits of scale 4+i (low nibble) and of min 4+i (high nibble), whose top 2 bits are bits 6-7
    of bytes i (scale) and 4+i (min).
    """
    sc_lo, mn_lo, packed = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([sc_lo & 0x3F, (packed & 0x0F) | ((sc_lo >> 2) & 0x30)], dim=-1)
    mn = torch.cat([mn_lo & 0x3F, (packed >> 4) | ((mn_lo >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scaled(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d * sc, dmin * m) of a Q4_K/Q5_K super-block, float32 [N, 8, 1] each."""
    n = blocks.shape[0]
    d, dmin = f16_field(blocks, 0), f16_field(blocks, 2)
    sc, mn = k_scale_min(blocks[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    return dl, ml


# Q4_K (256 values, 144 bytes): d f16 | dmin f16 | scales[12] (k_scale_min: 8 6-bit scales and
# mins, one per 32-value sub-block) | qs[128]: sub-block s = 2c + i is nibble i of qs[32c:32c+32].
# x = (d * sc[s]) * q - (dmin * m[s])
def dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    dl, ml = _k_scaled(blocks)
    q = split_bits(blocks[:, 16:144].reshape(n, 4, 32), 4, 2, dim=-2)  # [N, 4, 2, 32]
    q = q.reshape(n, 8, 32).to(torch.float32)
    return q.mul_(dl).sub_(ml).reshape(n, 256)


# Q5_K (256 values, 176 bytes): d f16 | dmin f16 | scales[12] | qh[32] | qs[128].
# Low 4 bits as Q4_K; bit 4 of sub-block s's value j is bit s of qh[j].
# x = (d * sc[s]) * q - (dmin * m[s])
def dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    dl, ml = _k_scaled(blocks)
    low = split_bits(blocks[:, 48:176].reshape(n, 4, 32), 4, 2, dim=-2).reshape(n, 8, 32)
    high = split_bits(blocks[:, 16:48], 1, 8, dim=-2)  # [N, 8, 32]
    q = (low | (high << 4)).to(torch.float32)
    return q.mul_(dl).sub_(ml).reshape(n, 256)


# Q6_K (256 values, 210 bytes): ql[128] | qh[64] | scales int8[16] (one per 16 values) | d f16.
# Value v = 128h + 32k + j (k = 0..3): low 4 bits are nibble k // 2 of ql[64h + 32(k % 2) + j],
# high 2 bits are bits 2k..2k+1 of qh[32h + j]; q = that 6-bit value - 32.
# x = (d * sc[v // 16]) * q
def dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    sc = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = f16_field(blocks, 208)
    dl = (d * sc).reshape(n, 16, 1)
    low = split_bits(blocks[:, 0:128].reshape(n, 2, 64), 4, 2, dim=-2).reshape(n, 8, 32)
    high = split_bits(blocks[:, 128:192].reshape(n, 2, 32), 2, 4, dim=-2).reshape(n, 8, 32)
    q = (low | (high << 4)).reshape(n, 16, 16).to(torch.float32) - 32
    return (dl * q).reshape(n, 256)


# IQ4_XS (256 values, 136 bytes): d f16 | scales_h u16 | scales_l[4] | qs[128].
# Sub-block s (32 values) has the 6-bit scale (nibble s % 2 of scales_l[s // 2]) |
# (bits 2s..2s+1 of scales_h) << 4, offset by -32; its codes are the split nibbles of
# qs[16s:16s+16], indexing IQ4_NL_VALUES.
# x = (d * sc[s]) * IQ4_NL_VALUES[q]
def dequant_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    high = split_bits(blocks[:, 2:4], 2, 4, dim=-1).reshape(n, 8)
    low = split_bits(blocks[:, 4:8], 4, 2, dim=-1).reshape(n, 8)
    sc = (low | (high << 4)).to(torch.float32) - 32
    dl = (d * sc).reshape(n, 8, 1)
    q = split_bits(blocks[:, 8:136].reshape(n, 8, 16), 4, 2, dim=-2).reshape(n, 8, 32)
    return (dl * lookup(IQ4_NL_VALUES, q)).reshape(n, 256)

"""Torch dequantization of GGML's 32-value block types (Q4_0 ... Q8_0, IQ4_NL) and FP4 types.

Each `dequant_<type>(blocks)` maps uint8 blocks [N, type_size] (contiguous) to float32 values
[N, block_size] and performs the float32 operations of `gguf.quants` in the same order, so the
results match it bit for bit: one rounding per multiply or add, never a fused multiply-add.
All multi-byte fields are little-endian; `f16` is an IEEE half.

Shared nibble layout ("split"): a run of n bytes `qs` holds 2n 4-bit values; value j < n is
`qs[j] & 0xF`, value n + j is `qs[j] >> 4`. The helpers below are reused by `dequant_k`.
"""

from __future__ import annotations

import torch

# IQ4_NL / IQ4_XS: 4-bit index -> int8 value (a non-uniform grid; llama.cpp `kvalues_iq4nl`).
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# MXFP4 / NVFP4: E2M1 code -> value times 2 (bit 3 is the sign; llama.cpp `kvalues_mxfp4`).
FP4_E2M1_X2_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian float16 at byte `start` of each block, as float32 [N, 1].

    Exact for every finite value; a NaN scale gives NaN values (payload bits unspecified).
    """
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def split_bits(x: torch.Tensor, bits: int, count: int, dim: int) -> torch.Tensor:
    """Split each byte of uint8 `x` [..., n] into `count` fields of `bits` bits, low bits first.

    The fields are stacked along `dim`: dim=-2 gives [..., count, n] (field i of all bytes,
    then field i + 1: the "split" layouts), dim=-1 gives [..., n, count] (all fields of a byte
    together: bit j of a little-endian bit mask is field j % 8 of byte j // 8).
    """
    mask = (1 << bits) - 1
    return torch.stack([(x >> (bits * i)) & mask for i in range(count)], dim=dim)


def lookup(table: tuple[int, ...], index: torch.Tensor) -> torch.Tensor:
    """`table[index]` as float32, for a small integer table and a uint8 index tensor."""
    values = torch.tensor(table, dtype=torch.float32, device=index.device)
    return values[index.long()]


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [N, n] -> uint8 [N, 2n] in the "split" layout: low nibbles, then high nibbles."""
    return split_bits(qs, 4, 2, dim=-2).reshape(qs.shape[0], -1)


# Q4_0 (32 values, 18 bytes): d f16 | qs[16] split nibbles.  x = d * (q - 8)
def dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 0)  # [N, 1]
    q = nibbles(blocks[:, 2:]).to(torch.float32) - 8  # [N, 32]
    return d * q


# Q4_1 (32 values, 20 bytes): d f16 | m f16 | qs[16] split nibbles.  x = d * q + m
def dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = f16_field(blocks, 0), f16_field(blocks, 2)
    q = nibbles(blocks[:, 4:]).to(torch.float32)
    return (d * q).add_(m)


def _q5_values(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit values [N, 32]: low 4 bits from split nibbles `qs`, bit 4 of value j is bit j of
    the little-endian u32 `qh`."""
    high = split_bits(qh, 1, 8, dim=-1).reshape(qh.shape[0], 32)
    return nibbles(qs) | (high << 4)


# Q5_0 (32 values, 22 bytes): d f16 | qh u32 (bit 4 of each value) | qs[16] split nibbles.
# x = d * (q - 16)
def dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 0)
    q = _q5_values(blocks[:, 2:6], blocks[:, 6:]).to(torch.float32) - 16
    return d * q


# Q5_1 (32 values, 24 bytes): d f16 | m f16 | qh u32 | qs[16] split nibbles.  x = d * q + m
def dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = f16_field(blocks, 0), f16_field(blocks, 2)
    q = _q5_values(blocks[:, 4:8], blocks[:, 8:]).to(torch.float32)
    return (d * q).add_(m)


# Q8_0 (32 values, 34 bytes): d f16 | qs int8[32].  x = q * d
def dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 0)
    q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return q * d


# IQ4_NL (32 values, 18 bytes): d f16 | qs[16] split nibbles indexing IQ4_NL_VALUES.
# x = d * IQ4_NL_VALUES[q]
def dequant_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 0)
    return d * lookup(IQ4_NL_VALUES, nibbles(blocks[:, 2:]))


def e8m0_to_float_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent byte -> 2^(e - 127) / 2 as float32 (ggml_e8m0_to_fp32_half), built from
    bits: for e < 2 the result is a float32 subnormal."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


# MXFP4 (32 values, 17 bytes): e u8 (E8M0 shared exponent) | qs[16] split nibbles of E2M1 codes.
# x = e8m0_half(e) * FP4_E2M1_X2_VALUES[q]   (the halving undoes the doubled table)
def dequant_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    d = e8m0_to_float_half(blocks[:, 0:1])  # [N, 1]
    return d * lookup(FP4_E2M1_X2_VALUES, nibbles(blocks[:, 1:]))


def ue4m3_to_float_half(x: torch.Tensor) -> torch.Tensor:
    """Unsigned E4M3 scale byte (bias 7) -> value / 2 as float32, as gguf's NVFP4 decodes it.

    Bit 7 is ignored, except that bytes 0x00 and 0x7F decode to 0. Exponent 0 is subnormal
    (m * 2^-9); else (1 + m/8) * 2^(exp-7). Built from float32 bits, so it is exact.
    """
    x = x.to(torch.int32)
    exp, man = (x >> 3) & 0xF, x & 0x7
    normal = (((exp + 119) << 23) | (man << 20)).view(torch.float32)  # (1 + m/8) * 2^(exp-8)
    subnormal = man.to(torch.float32) * 2.0**-10
    half = torch.where(exp == 0, subnormal, normal)
    return torch.where((x == 0) | (x == 0x7F), 0.0, half)


# NVFP4 (64 values, 36 bytes): d u8[4] (UE4M3 scale of each 16-value sub-block) |
# qs[32]: sub-block s uses qs[8s:8s+8] as split nibbles of E2M1 codes.
# x = ue4m3_half(d[s]) * FP4_E2M1_X2_VALUES[q]
def dequant_nvfp4(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = ue4m3_to_float_half(blocks[:, 0:4]).reshape(n, 4, 1)
    q = split_bits(blocks[:, 4:].reshape(n, 4, 8), 4, 2, dim=-2).reshape(n, 4, 16)
    return (d * lookup(FP4_E2M1_X2_VALUES, q)).reshape(n, 64)

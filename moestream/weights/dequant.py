"""The reference dequantization: GGUF weights -> float32, bit for bit as `gguf.quants.dequantize`.

Pure, vectorized torch (no loops over blocks, no numpy), so it runs on CPU and CUDA tensors alike
and serves as the specification the Triton kernels are tested against. The block layouts are
documented beside each type's function: 32-value blocks and FP4 in `dequant_blocks`, 256-value
super-blocks in `dequant_k`.

Exactness: every type reproduces gguf-py's float32 operations in its order, one rounding per
operation. Keep the ops separate (no addcmul, no fused multiply-add) when editing.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moestream.errors import UnsupportedError
from moestream.weights import dequant_blocks as blk
from moestream.weights import dequant_k as kq

T = GGMLQuantizationType

# Quantized types: uint8 blocks [N, type_size] -> float32 [N, block_size].
_BLOCK_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q4_0: blk.dequant_q4_0,
    T.Q4_1: blk.dequant_q4_1,
    T.Q5_0: blk.dequant_q5_0,
    T.Q5_1: blk.dequant_q5_1,
    T.Q8_0: blk.dequant_q8_0,
    T.IQ4_NL: blk.dequant_iq4_nl,
    T.MXFP4: blk.dequant_mxfp4,
    T.NVFP4: blk.dequant_nvfp4,
    T.Q2_K: kq.dequant_q2_k,
    T.Q3_K: kq.dequant_q3_k,
    T.Q4_K: kq.dequant_q4_k,
    T.Q5_K: kq.dequant_q5_k,
    T.Q6_K: kq.dequant_q6_k,
    T.IQ4_XS: kq.dequant_iq4_xs,
}

# F32, F16, BF16: little-endian IEEE float32 / float16 and bfloat16 (the top half of a float32).
_FLOAT_DTYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}

SUPPORTED_QTYPES: frozenset[GGMLQuantizationType] = frozenset(_FLOAT_DTYPES) | frozenset(
    _BLOCK_DEQUANT
)


def dequantize(
    data: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """Dequantize a GGUF tensor to float32 of the logical `shape` (torch order), on data's device.

    `data` for a quantized type is uint8 [*outer, row_bytes] (any layout, strided slices
    included) or a flat uint8 buffer of the same size; blocks run along the last dimension of
    `shape`. For F32/F16/BF16 it is a tensor of that dtype, or the raw bytes as uint8 (or int16
    for F16/BF16), of `prod(shape)` elements. For F32 input the result may share memory with
    `data`. Raises UnsupportedError for a type outside SUPPORTED_QTYPES, ValueError when data's
    dtype or size does not fit `shape`.
    """
    qtype = _check_qtype(qtype)
    shape = tuple(int(s) for s in shape)
    if qtype in _FLOAT_DTYPES:
        return _dequantize_float(data, qtype, shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    numel = math.prod(shape)
    if not shape or shape[-1] % block_size:
        raise ValueError(f"{qtype.name} shape {shape}: last dim is not a multiple of {block_size}")
    n_blocks = numel // block_size
    if data.dtype != torch.uint8 or data.numel() != n_blocks * type_size:
        raise ValueError(
            f"{qtype.name} shape {shape} needs {n_blocks * type_size} uint8 bytes, "
            f"got {data.dtype} {tuple(data.shape)}"
        )
    blocks = data.reshape(n_blocks, type_size).contiguous()  # [N, type_size]
    values = _BLOCK_DEQUANT[qtype](blocks)  # [N, block_size]
    return values.reshape(shape)


def _check_qtype(qtype: GGMLQuantizationType | int) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise UnsupportedError(f"unknown GGML quantization type {qtype!r}") from None
    if qtype not in SUPPORTED_QTYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_QTYPES))
        raise UnsupportedError(
            f"GGML quantization type {qtype.name} is not supported (supported: {names})"
        )
    return qtype


def _dequantize_float(
    data: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    dtype = _FLOAT_DTYPES[qtype]
    if data.dtype == torch.uint8 or (data.dtype == torch.int16 and qtype != T.F32):
        data = _reinterpret(data, dtype)
    elif data.dtype != dtype:
        raise ValueError(f"{qtype.name} data must be {dtype} or raw bytes, got {data.dtype}")
    if data.numel() != math.prod(shape):
        raise ValueError(f"{qtype.name} shape {shape} does not fit data {tuple(data.shape)}")
    if qtype == T.BF16:
        # bfloat16 is the high half of a float32: shift the bits, as gguf does (keeps NaN bits).
        bits = data.view(torch.int16).to(torch.int32) << 16
        return bits.view(torch.float32).reshape(shape)
    if qtype == T.F16:
        return _f16_to_float(data).reshape(shape)
    return data.reshape(shape)


def _f16_to_float(data: torch.Tensor) -> torch.Tensor:
    """float16 -> float32 as numpy converts it: exact, and NaNs keep their payload bits (torch's
    conversion sets the quiet bit of a signaling NaN)."""
    out = data.to(torch.float32)
    half = data.view(torch.int16).to(torch.int32)
    nan_bits = ((half & 0x8000) << 16) | 0x7F800000 | ((half & 0x03FF) << 13)
    return torch.where(torch.isnan(out), nan_bits.view(torch.float32), out)


def _reinterpret(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes (uint8) or bits (int16) of `data` read as a flat tensor of `dtype`."""
    flat = data.contiguous().reshape(-1)
    itemsize = dtype.itemsize
    if flat.numel() * flat.element_size() % itemsize:
        raise ValueError(f"{flat.numel() * flat.element_size()} bytes are not whole {dtype}")
    if flat.storage_offset() * flat.element_size() % itemsize:
        flat = flat.clone()  # a view into the middle of a buffer, not aligned to the dtype
    return flat.view(dtype)

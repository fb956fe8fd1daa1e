"""The torch dequantization matches `gguf.quants.dequantize` bit for bit, on random blocks."""

from __future__ import annotations

import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moestream.errors import UnsupportedError
from moestream.weights.dequant import SUPPORTED_QTYPES, dequantize

T = GGMLQuantizationType

# Byte offsets of the float16 scale fields of each block (d, dmin, m), which are given finite
# values; every other byte (quants, packed scales, E8M0/E4M3 scales) is random.
F16_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.IQ4_NL: (0,),
    T.MXFP4: (),
    T.NVFP4: (),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.IQ4_XS: (0,),
}
FLOAT_TYPES = (T.F32, T.F16, T.BF16)


def random_blocks(qtype: GGMLQuantizationType, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random uint8 [*shape[:-1], row_bytes] with finite float16 scales of mixed magnitude
    (2^-16 .. 2^2, so float16 subnormals occur too)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scale = rng.choice([-1.0, 1.0], n_blocks) * 2.0 ** rng.uniform(-16, 2, n_blocks)
        blocks[:, offset : offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block_size * type_size)


def reference(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    with np.errstate(over="ignore"):  # MXFP4 exponent 255 times 12 overflows to inf in both
        return gguf.quants.dequantize(raw, qtype)


def assert_bits_equal(ours: torch.Tensor, ref: np.ndarray) -> None:
    """Equal as float32 bit patterns (tells -0 from +0 and NaN payloads apart)."""
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == ref.shape
    ours_bits = ours.cpu().contiguous().view(torch.int32).numpy()
    np.testing.assert_array_equal(ours_bits, ref.astype(np.float32).view(np.int32))


def shapes_for(qtype: GGMLQuantizationType) -> list[tuple[int, ...]]:
    block = GGML_QUANT_SIZES[qtype][0]
    return [(5, 3 * block), (3, 2, 2 * block)]  # [out, in] and [E, out, in]


QUANT_CASES = [
    pytest.param(qtype, shape, id=f"{qtype.name}-{'x'.join(map(str, shape))}")
    for qtype in F16_FIELDS
    for shape in shapes_for(qtype)
]


def test_supported_qtypes() -> None:
    assert frozenset(F16_FIELDS) | frozenset(FLOAT_TYPES) == SUPPORTED_QTYPES


@pytest.mark.parametrize(("qtype", "shape"), QUANT_CASES)
def test_quantized_matches_gguf(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> None:
    raw = random_blocks(qtype, shape, seed=int(qtype) * 31 + len(shape))
    ref = reference(raw, qtype)
    assert_bits_equal(dequantize(torch.from_numpy(raw), qtype, shape), ref)
    # The same bytes as a flat buffer.
    assert_bits_equal(dequantize(torch.from_numpy(raw.reshape(-1)), qtype, shape), ref)


@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda t: t.name)
def test_float_matches_gguf(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(int(qtype))
    shape = (3, 4, 8)
    itemsize = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] * itemsize), dtype=np.uint8)
    ref = reference(raw, qtype)
    typed = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[qtype]
    as_bytes = torch.from_numpy(raw)
    inputs = [as_bytes, as_bytes.reshape(-1), as_bytes.view(typed)]
    if qtype != T.F32:
        inputs.append(as_bytes.view(torch.int16))
    for data in inputs:
        assert_bits_equal(dequantize(data, qtype, shape), ref)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_0, T.Q6_K, T.BF16], ids=lambda t: t.name)
def test_slices_and_strided_views(qtype: GGMLQuantizationType) -> None:
    shape = (4, 3, 2 * GGML_QUANT_SIZES[qtype][0])
    raw = torch.from_numpy(random_blocks(qtype, shape, seed=7)) if qtype in F16_FIELDS else None
    if raw is None:
        raw = torch.randn(shape).to(torch.bfloat16)
    full = dequantize(raw, qtype, shape)
    # One expert of a stacked tensor (contiguous, nonzero storage offset).
    assert torch.equal(dequantize(raw[2], qtype, shape[1:]), full[2])
    # Every other expert (non-contiguous).
    assert torch.equal(dequantize(raw[::2], qtype, (2, *shape[1:])), full[::2])
    # Experts and rows swapped (non-contiguous, blocks still along the last dim).
    swapped = raw.transpose(0, 1)
    assert not swapped.is_contiguous()
    assert torch.equal(dequantize(swapped, qtype, (3, 4, shape[2])), full.transpose(0, 1))


@pytest.mark.parametrize(
    "qtype", [T.IQ2_XXS, T.TQ1_0, T.Q8_1, T.Q8_K, 9999], ids=lambda t: getattr(t, "name", str(t))
)
def test_unsupported_type_raises(qtype: GGMLQuantizationType | int) -> None:
    with pytest.raises(UnsupportedError, match=getattr(qtype, "name", str(qtype))):
        dequantize(torch.zeros(64, dtype=torch.uint8), qtype, (1, 256))


def test_size_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="Q4_0"):
        dequantize(torch.zeros(17, dtype=torch.uint8), T.Q4_0, (1, 32))
    with pytest.raises(ValueError, match="multiple of 256"):
        dequantize(torch.zeros(144, dtype=torch.uint8), T.Q4_K, (2, 128))
    with pytest.raises(ValueError, match="F16"):
        dequantize(torch.zeros(4, dtype=torch.float32), T.F16, (4,))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("qtype", "shape"), QUANT_CASES)
def test_cuda_matches_gguf(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> None:
    raw = random_blocks(qtype, shape, seed=int(qtype) + 1)
    out = dequantize(torch.from_numpy(raw).cuda(), qtype, shape)
    assert out.is_cuda
    assert_bits_equal(out, reference(raw, qtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda t: t.name)
def test_cuda_float_matches_gguf(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(int(qtype) + 1)
    itemsize = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(6, 16 * itemsize), dtype=np.uint8)
    out = dequantize(torch.from_numpy(raw).cuda(), qtype, (6, 16))
    assert out.is_cuda
    assert_bits_equal(out, reference(raw, qtype))

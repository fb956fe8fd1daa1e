"""quantize(): GGUF block layout, round trip through gguf.quants.dequantize, edge cases."""

import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from moestream.errors import UnsupportedError
from moestream.weights.qtensor import row_bytes
from moestream.weights.quantize import QUANTIZABLE_TYPES, can_quantize, quantize

# RMSE of the round trip on N(0, 1) data, 64 x 1024, seed 0: measured values (see
# docs/quantization.md) times ~1.1, so a regression in the scale search fails here.
RMSE_BOUND = {
    Q.F16: 0.00024,  # measured 0.00021
    Q.BF16: 0.0019,  # 0.00166
    Q.Q8_0: 0.0059,  # 0.00532
    Q.Q6_K: 0.0194,  # 0.01757
    Q.Q5_K: 0.0395,  # 0.03589
    Q.Q5_1: 0.0415,  # 0.03770
    Q.Q5_0: 0.0467,  # 0.04245
    Q.Q4_K: 0.0781,  # 0.07096
    Q.Q4_1: 0.0855,  # 0.07771
    Q.Q4_0: 0.0941,  # 0.08552
    Q.Q3_K: 0.165,  # 0.14988
    Q.Q2_K: 0.327,  # 0.29656
}
BLOCK_TYPES = [t for t in QUANTIZABLE_TYPES if t not in (Q.F32, Q.F16, Q.BF16)]


def gaussian(rows: int = 64, n: int = 1024, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, n), dtype=np.float32)


def round_trip(x: np.ndarray, qtype: Q) -> np.ndarray:
    q = quantize(x, qtype)
    assert q.dtype == np.uint8
    assert q.shape == (*x.shape[:-1], row_bytes(qtype, x.shape[-1]))
    y = dequantize(q, qtype)
    assert y.shape == x.shape
    assert np.isfinite(y).all()
    return y


def rmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a.astype(np.float64) - b) ** 2)))


@pytest.fixture(scope="module")
def measured_rmse() -> dict[Q, float]:
    x = gaussian()
    return {t: rmse(round_trip(x, t), x) for t in RMSE_BOUND}


@pytest.mark.parametrize("qtype", list(RMSE_BOUND), ids=lambda t: t.name)
def test_round_trip_rmse_within_bound(measured_rmse, qtype):
    assert measured_rmse[qtype] < RMSE_BOUND[qtype]


def test_rmse_ordered_by_bits(measured_rmse):
    order = [Q.Q8_0, Q.Q6_K, Q.Q5_K, Q.Q4_K, Q.Q3_K, Q.Q2_K]
    errors = [measured_rmse[t] for t in order]
    assert errors == sorted(errors), dict(zip([t.name for t in order], errors, strict=True))
    # the K-quants' scale search beats the legacy types of the same width
    assert measured_rmse[Q.Q5_K] < measured_rmse[Q.Q5_1] < measured_rmse[Q.Q5_0]
    assert measured_rmse[Q.Q4_K] < measured_rmse[Q.Q4_1] < measured_rmse[Q.Q4_0]


def test_f32_is_exact_and_float_types_match_numpy():
    x = gaussian(4, 64)
    assert quantize(x, Q.F32).tobytes() == x.tobytes()
    assert quantize(x, Q.F16).tobytes() == x.astype(np.float16).tobytes()
    bf16 = torch.from_numpy(x).to(torch.bfloat16).view(torch.uint8).numpy()
    np.testing.assert_array_equal(quantize(x, Q.BF16), bf16.reshape(4, 128))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_zero_and_constant_rows(qtype):
    x = np.zeros((4, 512), np.float32)
    x[1], x[2], x[3, :256] = 0.5, -2.0, 1.0  # row 3: one constant block, one zero block
    y = round_trip(x, qtype)
    np.testing.assert_array_equal(y[0], 0)
    np.testing.assert_array_equal(y[3, 256:], 0)
    np.testing.assert_allclose(y[1:], x[1:], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_outlier_stays_in_its_block(qtype):
    x = gaussian(4, 1024, seed=1)
    x[:, 300] = 50.0
    x[1, 700] = -80.0
    y = round_trip(x, qtype)
    np.testing.assert_allclose(y[:, 300], 50.0, rtol=0.01)
    np.testing.assert_allclose(y[1, 700], -80.0, rtol=0.01)
    # super-blocks without an outlier (values 768..1023) keep the Gaussian error
    assert rmse(y[:, 768:], x[:, 768:]) < RMSE_BOUND[qtype]


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_power_of_two_scaling_commutes(qtype):
    # every step of the algorithms is scale-equivariant and a power of two scales exactly
    x = gaussian(4, 512, seed=2)
    y = round_trip(x, qtype)
    np.testing.assert_array_equal(round_trip(x * 4, qtype), y * 4)
    np.testing.assert_array_equal(round_trip(x / 8, qtype), y / 8)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.BF16], ids=lambda t: t.name)
def test_torch_input_and_leading_dims(qtype):
    x = gaussian(6, 512, seed=3).reshape(2, 3, 512)
    q = quantize(torch.from_numpy(x), qtype)
    assert q.shape == (2, 3, row_bytes(qtype, 512))
    np.testing.assert_array_equal(q, quantize(x.reshape(6, 512), qtype).reshape(q.shape))
    np.testing.assert_array_equal(quantize(x[0, 0], qtype), q[0, 0])  # a 1-D row


def test_k_quant_blocks_are_independent_of_chunking():
    # more super-blocks than one chunk: results must not depend on where chunks split
    x = gaussian(3, 256 * 400, seed=4)  # 1200 super-blocks
    q = quantize(x, Q.Q4_K)
    np.testing.assert_array_equal(q[1:2], quantize(x[1:2], Q.Q4_K))


def test_errors():
    x = gaussian(2, 256)
    with pytest.raises(UnsupportedError, match="IQ2_XXS"):
        quantize(x, Q.IQ2_XXS)
    with pytest.raises(UnsupportedError, match="rows of 96 values"):
        quantize(x[:, :96], Q.Q4_K)
    x[1, 7] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        quantize(x, Q.Q6_K)
    assert can_quantize(Q.Q4_K, 512) and not can_quantize(Q.Q4_K, 96)
    assert not can_quantize(Q.IQ4_XS, 256)
    assert quantize(np.zeros((0, 256), np.float32), Q.Q4_K).shape == (0, 144)


def test_q4_k_speed():
    # 30M weights to Q4_K take ~2 s on one core; 1M must stay far below a second even on a
    # loaded machine (a per-block Python loop would take minutes)
    x = gaussian(512, 2048, seed=5)
    start = time.perf_counter()
    quantize(x, Q.Q4_K)
    assert time.perf_counter() - start < 2.0

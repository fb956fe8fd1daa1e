"""Triton quantized matmul kernels (GEMV, GEMM, block unpacking) against the torch reference,
with fresh random weights and activations. Without CUDA the Triton interpreter runs them on the
CPU; on a CUDA machine the same tests run the compiled kernels on the GPU."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moestream.kernels import ops
from moestream.weights.qtensor import QTensor
from moestream.weights.quantize import quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # the modules above do not import triton; the kernel modules below do
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported


triton = pytest.importorskip("triton", reason="triton is not installed")
tl = pytest.importorskip("triton.language")

from moestream.kernels._triton_dequant import (  # noqa: E402
    MAGIC,
    dequant_superblock,
    plane_k_offsets,
)
from moestream.kernels.quant_gemm import GemmConfig, gemm_config, quant_gemm  # noqa: E402
from moestream.kernels.quant_gemv import GemvConfig, gemv_config, quant_gemv  # noqa: E402

T = GGMLQuantizationType
KERNEL_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q2_K, T.Q3_K, T.IQ4_XS, T.MXFP4)
KERNEL_TYPES += (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL)
# Byte offsets of each block's float16 scales (given finite values; all other bytes random).
F16_FIELDS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q8_0: (0,), T.Q2_K: (80, 82)}
F16_FIELDS.update({T.Q3_K: (108,), T.IQ4_XS: (0,), T.MXFP4: (), T.IQ4_NL: (0,)})
F16_FIELDS.update({T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2)})
# Byte offsets of E8M0 exponents, kept to 110..140 (scales 2^-18 .. 2^12).
E8M0_FIELDS = {T.MXFP4: (0,)}


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int) -> QTensor:
    """[n, k] of random bytes with finite float16 scales of mixed magnitude (and E8M0 exponents
    in a bounded range): every bit pattern of the quants and packed sub-block scales occurs."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = rng.choice([-1.0, 1.0], len(blocks)) * 2.0 ** rng.uniform(-12, 0, len(blocks))
        blocks[:, off : off + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    for off in E8M0_FIELDS.get(qtype, ()):
        blocks[:, off] = rng.integers(110, 141, len(blocks), dtype=np.uint8)
    return QTensor(torch.from_numpy(blocks.reshape(n, -1)).to(DEVICE), qtype, (n, k))


def quantized(qtype: GGMLQuantizationType, shape: tuple[int, ...], seed: int) -> QTensor:
    """Random weights (std 0.05) quantized to `qtype`, as a model file holds them."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=g) * 0.05
    return QTensor(torch.from_numpy(quantize(values, qtype)).to(DEVICE), qtype, shape)


def activations(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(DEVICE, dtype)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "output has NaN/inf: some element was not written"
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


@triton.jit
def _dequant_rows_kernel(w_ptr, out_ptr, N, stride_wn, magic, K: tl.constexpr, QTYPE: tl.constexpr,
                         BLOCK_N: tl.constexpr):  # fmt: skip
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w_ptr + tl.minimum(n, N - 1) * stride_wn
    mask = (n < N)[:, None, None]
    for sb in range(K // 256):
        w0, w1 = dequant_superblock(rows, sb, magic, QTYPE)
        base = out_ptr + n[:, None, None] * K + sb * 256
        tl.store(base + plane_k_offsets(0, QTYPE)[None, :, :], w0, mask=mask)
        tl.store(base + plane_k_offsets(1, QTYPE)[None, :, :], w1, mask=mask)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_block_unpacking_is_bit_exact(qtype):
    """The in-kernel unpacking reproduces the reference dequantization bit for bit, planes and
    k offsets included (in the interpreter; compiled, q * s - m may become one FMA: 1 ulp)."""
    n, k = 5, 512
    w = random_blocks(qtype, n, k, seed=int(qtype))
    out = torch.full((n, k), float("nan"), device=DEVICE)
    _dequant_rows_kernel[(1,)](
        w.data, out, n, w.data.stride(0), MAGIC, K=k, QTYPE=int(qtype), BLOCK_N=8
    )
    ref = w.dequantize()
    if DEVICE == "cpu":
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32))
    else:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m, split_k, unroll", [(1, 1, 2), (1, 2, 1), (3, 2, 1)])
def test_gemv_matches_reference(qtype, m, split_k, unroll):
    n, k = 40, 512  # 3 row blocks of 16, the last one partial
    w = random_blocks(qtype, n, k, seed=100 + int(qtype))
    x = activations(m, k, torch.float32, seed=m)
    out = torch.full((m, n), float("nan"), device=DEVICE)
    quant_gemv(x, w, out=out, config=GemvConfig(block_n=16, split_k=split_k, unroll=unroll))
    assert rel_err(out, ops.quant_matmul_ref(x, w)) < 1e-5


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 8])
def test_gemv_bfloat16(qtype, m):
    n, k = 24, 512
    w = quantized(qtype, (n, k), seed=7)
    x = activations(m, k, torch.bfloat16, seed=8)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    quant_gemv(x, w, out=out, config=GemvConfig(block_n=32, unroll=2))
    ref = x.float() @ w.dequantize().t()  # float32 reference
    assert rel_err(out, ref) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_gemm_matches_reference(qtype):
    m, n, k = 17, 40, 512  # partial tiles along M and N
    w = random_blocks(qtype, n, k, seed=200 + int(qtype))
    x = activations(m, k, torch.float32, seed=3)
    out = torch.full((m, n), float("nan"), device=DEVICE)
    quant_gemm(x, w, out=out, config=GemmConfig(16, 32, split_k=2, num_warps=4))
    assert rel_err(out, ops.quant_matmul_ref(x, w)) < 1e-5


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_gemm_bfloat16(qtype):
    m, n, k = 33, 32, 256
    w = quantized(qtype, (n, k), seed=11)
    x = activations(m, k, torch.bfloat16, seed=12)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    quant_gemm(x, w, out=out, config=GemmConfig(32, 32, num_warps=4))
    ref = x.float() @ w.dequantize().t()
    assert rel_err(out, ref) < tolerance(torch.bfloat16)


def test_strided_rows_and_activations():
    """Weight rows taken from a larger buffer and activations with a row stride > K."""
    n, k = 16, 256
    big = quantized(T.Q4_K, (2 * n, k), seed=5)
    w = QTensor(big.data[::2], T.Q4_K, (n, k))  # every other row
    x = activations(4, 2 * k, torch.float32, seed=6)[:, :k]
    ref = ops.quant_matmul_ref(x, w)
    assert rel_err(quant_gemv(x, w, config=GemvConfig(block_n=16)), ref) < 1e-5
    assert rel_err(quant_gemm(x, w, config=GemmConfig(16, 16, num_warps=4)), ref) < 1e-5


def test_launchers_reject_bad_arguments():
    w = quantized(T.Q4_K, (16, 256), seed=1)
    x = torch.zeros(2, 256, device=DEVICE)
    with pytest.raises(ValueError, match="does not match"):
        quant_gemv(torch.zeros(2, 512, device=DEVICE), w)
    with pytest.raises(ValueError, match="at most 8"):
        quant_gemv(torch.zeros(9, 256, device=DEVICE), w)
    with pytest.raises(ValueError, match="unit stride"):
        quant_gemm(torch.zeros(256, 2, device=DEVICE).t(), w)
    with pytest.raises(ValueError, match="dtype"):
        quant_gemm(x.double(), w)
    with pytest.raises(ValueError, match="no kernel for NVFP4"):
        nvfp4 = QTensor(torch.zeros(1, 36, dtype=torch.uint8), T.NVFP4, (1, 64))
        quant_gemv(torch.zeros(1, 64), nvfp4)
    with pytest.raises(ValueError, match="out must be"):
        quant_gemv(x, w, out=torch.empty(2, 16, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="does not divide"):
        quant_gemv(x, w, config=GemvConfig(split_k=2))  # one 256-value group cannot be split


@pytest.mark.parametrize("n, k", [(512, 2048), (128, 4096), (4096, 2048), (151936, 2048)])
def test_launch_configs_fill_the_gpu(n, k):
    """Decode shapes get enough programs for 132 SMs, or as many K splits as allowed."""
    sms, groups = 132, k // 256
    cfg = gemv_config(1, n, k, sms)
    assert cfg.block_n in (4, 8, 16) and groups % cfg.split_k == 0
    assert (groups // cfg.split_k) % cfg.unroll == 0
    programs = triton.cdiv(n, cfg.block_n) * cfg.split_k
    assert programs >= sms or groups % (2 * cfg.split_k) or groups // cfg.split_k < 4
    for m in (2, 8):
        gcfg = gemm_config(m, n, k, torch.bfloat16, sms)
        assert gcfg.block_m == 16 and groups % gcfg.split_k == 0
        programs = triton.cdiv(n, gcfg.block_n) * gcfg.split_k
        assert programs >= sms or groups % (2 * gcfg.split_k) or groups // gcfg.split_k < 4
    big = gemm_config(4096, n, k, torch.bfloat16, sms)
    assert (big.block_m, big.split_k) == (64, 1)


def test_ops_quant_matmul_uses_reference_on_cpu():
    w = quantized(T.Q6_K, (8, 256), seed=2).to("cpu")
    x = activations(6, 256, torch.float32, seed=2).cpu().reshape(2, 3, 256)
    y = ops.quant_matmul(x, w)
    assert y.shape == (2, 3, 8)
    assert torch.equal(y, ops.quant_matmul_ref(x, w))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("m", [1, 3, 40])
def test_ops_quant_matmul_dispatches_to_kernels_on_cuda(m):
    """GEMV for one row, GEMM beyond; leading dims flattened; float weights stay on cuBLAS."""
    w = quantized(T.Q4_K, (96, 512), seed=m)
    x = activations(m, 512, torch.bfloat16, seed=m).reshape(1, m, 512)
    y = ops.quant_matmul(x, w)
    assert y.shape == (1, m, 96) and y.dtype == torch.bfloat16
    assert rel_err(y[0], x[0].float() @ w.dequantize().t()) < tolerance(torch.bfloat16)
    dense = QTensor.from_float(torch.randn(96, 512, device=DEVICE))
    torch.testing.assert_close(ops.quant_matmul(x.float(), dense), x.float() @ dense.data.t())

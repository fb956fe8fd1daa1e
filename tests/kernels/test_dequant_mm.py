"""The prefill path that dequantizes weights and hands the product to a library GEMM
(`kernels.dequant_mm`): the dequantizing kernel bit-exact against gguf's float32 values, the dense
and MoE products against the torch references. Without CUDA the Triton interpreter runs the
kernel on the CPU; on a CUDA machine the same tests run on the GPU."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from moestream.kernels import ops
from moestream.weights.qtensor import QTensor
from moestream.weights.quantize import quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

pytest.importorskip("triton", reason="triton is not installed")

from moestream.kernels import dequant_mm  # noqa: E402
from moestream.kernels.dequant_mm import (  # noqa: E402
    DequantShape,
    dequant_matmul,
    dequantize_rows,
    grouped_mm_available,
    moe_dequant_grouped,
)
from moestream.kernels.moe import default_method, fused_moe  # noqa: E402
from tests.kernels.test_quant_matmul import random_blocks  # noqa: E402

T = GGMLQuantizationType
TYPES = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q2_K, T.Q3_K, T.IQ4_XS, T.MXFP4)
TYPES += (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL)


def random_raw(qtype: GGMLQuantizationType, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """uint8 [*outer, row_bytes] of `test_quant_matmul.random_blocks` (random bytes with finite
    float16 scales: every quant pattern)."""
    rows = int(np.prod(shape[:-1]))
    w = random_blocks(qtype, rows, shape[-1], seed)
    return w.data.cpu().numpy().reshape(*shape[:-1], -1)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_rows_is_bit_exact(qtype):
    """Rows 40..89 of a [96, 512] weight (two row blocks, the second partial) equal gguf's."""
    raw = random_raw(qtype, (96, 512), seed=int(qtype))
    w = QTensor(torch.from_numpy(raw).to(DEVICE), qtype, (96, 512))
    out = torch.full((50, 512), float("nan"), device=DEVICE)
    dequantize_rows(w, out, row_start=40)
    expect = torch.from_numpy(gguf_dequantize(raw, qtype)[40:90].astype(np.float32))
    assert torch.equal(out.cpu(), expect)


def test_dequantize_rows_through_slots_skips_unused_experts():
    """Expert e reads slot SLOT[e]; an expert with no tokens is left untouched (poison stays)."""
    qtype, s, n, k = T.Q4_K, 3, 40, 256
    raw = random_raw(qtype, (s, n, k), seed=5)
    w = QTensor(torch.from_numpy(raw).to(DEVICE), qtype, (s, n, k))
    slot = torch.tensor([2, 0, 1, 0], dtype=torch.int32, device=DEVICE)
    counts = torch.tensor([1, 0, 3, 2], dtype=torch.int32, device=DEVICE)
    out = torch.full((4, n, k), float("nan"), device=DEVICE)
    dequantize_rows(w, out, slot, counts)
    values = gguf_dequantize(raw.reshape(s * n, -1), qtype).reshape(s, n, k)
    for e, (sl, c) in enumerate(zip([2, 0, 1, 0], [1, 0, 3, 2], strict=True)):
        if c:
            assert torch.equal(out[e].cpu(), torch.from_numpy(values[sl].astype(np.float32)))
        else:
            assert out[e].isnan().all()


# Launch shapes of `_dequant_kernel`: k order with 1, 2 and 4 groups per program (4 and 2 run
# past a 3-group row: masked), streaming stores, and the older per-plane order.
SHAPES = (
    DequantShape(8, 2, 4),
    DequantShape(16, 4, 4, stream=True),
    DequantShape(4, 1, 2),
    DequantShape(8, 2, 4, planes=True),
)
# The interpreter rounds float32 to bfloat16 by truncation (the GPU to nearest even, as torch):
# bfloat16 outputs are compared on CUDA only.
OUT_DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", TYPES)
def test_every_launch_shape_is_bit_exact(qtype, shape):
    """Rows 3..22 of a [24, 768] weight (3 groups a row, a partial row block) in float32 (and
    bfloat16 on CUDA) equal the reference dequantization (bfloat16: rounded from it)."""
    raw = random_raw(qtype, (24, 768), seed=int(qtype) + 7)
    w = QTensor(torch.from_numpy(raw).to(DEVICE), qtype, (24, 768))
    expect = w.to("cpu").dequantize()[3:23]
    assert torch.equal(expect, torch.from_numpy(gguf_dequantize(raw, qtype)[3:23]))
    for dtype in {torch.float32, OUT_DTYPE}:
        out = torch.full((20, 768), float("nan"), dtype=dtype, device=DEVICE)
        dequantize_rows(w, out, row_start=3, shape=shape)
        assert torch.equal(out.cpu(), expect.to(dtype)), dtype


@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[3:], ids=str)
@pytest.mark.parametrize("qtype", TYPES)
def test_expert_stack_into_half_of_a_stacked_buffer(qtype, shape):
    """A 3-D stack through a slot table into the second half of an [E, 2F, H] buffer (a strided
    view): experts with counts 0 and the other half keep their poison."""
    s, f, k = 3, 12, 512
    raw = random_raw(qtype, (s, f, k), seed=int(qtype) + 11)
    w = QTensor(torch.from_numpy(raw).to(DEVICE), qtype, (s, f, k))
    values = w.to("cpu").dequantize().to(OUT_DTYPE)  # [S, F, K]
    slot, counts = [1, 2, 0, 2, 1], [4, 0, 1, 2, 0]
    buf = torch.full((5, 2 * f, k), float("nan"), dtype=OUT_DTYPE, device=DEVICE)
    dequantize_rows(
        w, buf[:, f:], torch.tensor(slot, dtype=torch.int32, device=DEVICE),
        torch.tensor(counts, dtype=torch.int32, device=DEVICE), shape=shape,
    )  # fmt: skip
    buf = buf.cpu()
    assert buf[:, :f].isnan().all()
    for e, (sl, c) in enumerate(zip(slot, counts, strict=True)):
        if c:
            assert torch.equal(buf[e, f:], values[sl]), e
        else:
            assert buf[e, f:].isnan().all(), e


@pytest.mark.parametrize("qtype, offset", [(T.Q4_K, 2), (T.Q6_K, 2), (T.MXFP4, 1)])
def test_unaligned_data_takes_the_plane_order(qtype, offset):
    """Rows at an odd-halfword address (the k order reads aligned words) still come out exact:
    the launcher switches to the per-plane order. MXFP4, read a byte at a time, at an odd
    address."""
    raw = random_raw(qtype, (8, 256), seed=3)
    buf = torch.zeros(raw.size + offset, dtype=torch.uint8, device=DEVICE)
    data = buf[offset:].view(8, -1)
    data.copy_(torch.from_numpy(raw))
    w = QTensor(data, qtype, (8, 256))
    out = torch.full((8, 256), float("nan"), device=DEVICE)
    dequantize_rows(w, out, shape=DequantShape(8, 2, 4))
    assert torch.equal(out.cpu(), torch.from_numpy(gguf_dequantize(raw, qtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_matmul_matches_reference_in_chunks(monkeypatch, dtype):
    """A scratch of 64 rows forces three chunks of N=160 (the last partial)."""
    monkeypatch.setattr(dequant_mm, "SCRATCH_BYTES", 64 * 512 * torch.finfo(dtype).bits // 8)
    values = torch.randn(160, 512, generator=torch.Generator().manual_seed(1)) * 0.05
    w = QTensor(torch.from_numpy(quantize(values, T.Q6_K)).to(DEVICE), T.Q6_K, (160, 512))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    out = torch.full((5, 160), float("nan"), dtype=dtype, device=DEVICE)
    dequant_matmul(x, w, out=out)
    ref = ops.quant_matmul_ref(x.float(), w)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < tol


def stack(qtype: GGMLQuantizationType, shape: tuple[int, int, int], seed: int) -> QTensor:
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.05
    return QTensor(torch.from_numpy(quantize(values, qtype)).to(DEVICE), qtype, shape)


@pytest.mark.skipif(not grouped_mm_available(torch.device(DEVICE)), reason="no grouped GEMM")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_dequant_grouped_matches_reference(dtype):
    """5 experts in 4 slots (expert 4 never chosen, expert 2 chosen by most tokens, so its group
    spans several padded blocks), 9 tokens of k=3."""
    if DEVICE == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA grouped GEMM takes bfloat16")
    h, f, t, k = 256, 256, 9, 3
    gate, up = stack(T.Q4_K, (4, f, h), 1), stack(T.Q5_K, (4, f, h), 2)
    down = stack(T.Q6_K, (4, h, f), 3)
    slot = torch.tensor([3, 0, 2, 1, -1], dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(t)])  # [T, k]
    ids[:, 0] = 2
    weights = torch.softmax(torch.randn(t, k, generator=g), -1)
    x = torch.randn(t, h, generator=g).to(DEVICE, dtype)
    ids, weights = ids.to(DEVICE), weights.to(DEVICE)
    out = torch.full((t, h), float("nan"), dtype=dtype, device=DEVICE)
    moe_dequant_grouped(x, ids, weights, gate, up, down, slot, out=out)
    ref = ops.moe_forward_ref(x, ids, weights, gate, up, down, slot)
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    # bfloat16: a few ulps (2^-8 of the largest value each); the Triton interpreter truncates
    # float32 to bfloat16 where the GPU rounds to nearest, so the CPU run sits a little higher
    assert err < (1e-5 if dtype == torch.float32 else 3e-2)
    again = fused_moe(x, ids, weights, gate, up, down, slot, method="dequant")
    assert torch.equal(again, out)  # deterministic: no atomics
    assert default_method(1025, gate, up, down, x) == "dequant"
    assert default_method(1025, gate, up, down) == "gemm"  # no activation: no device to ask


def test_cached_values_give_the_same_products():
    """`cache_values`: the dense product bit for bit; the MoE grouped by slot (a permuted
    table) equal to the one that dequantizes per call, within float32 rounding."""
    from moestream.kernels.dequant_mm import cache_values

    values = torch.randn(96, 256, generator=torch.Generator().manual_seed(5)) * 0.05
    w = QTensor(torch.from_numpy(quantize(values, T.Q4_K)).to(DEVICE), T.Q4_K, (96, 256))
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    plain = dequant_matmul(x, w)
    assert cache_values(w, torch.float32) == 96 * 256 * 4
    assert torch.equal(dequant_matmul(x, w), plain)
    if not grouped_mm_available(torch.device(DEVICE)) or DEVICE == "cuda":
        return  # the MoE half runs in float32 on the CPU (the CUDA grouped GEMM takes bf16)
    h, f, t, k = 256, 256, 6, 2
    gate, up = stack(T.Q4_K, (3, f, h), 7), stack(T.Q6_K, (3, f, h), 8)
    down = stack(T.Q4_K, (3, h, f), 9)
    slot = torch.tensor([2, 0, 1], dtype=torch.int32)
    ids = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [1, 0], [2, 1]])
    weights = torch.softmax(torch.randn(t, k, generator=torch.Generator().manual_seed(10)), -1)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(11))
    plain = moe_dequant_grouped(x, ids, weights, gate, up, down, slot)
    for w3 in (gate, up, down):
        cache_values(w3, torch.float32)
    got = moe_dequant_grouped(x, ids, weights, gate, up, down, slot)
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-6)
    ref = ops.moe_forward_ref(x, ids, weights, gate, up, down, slot)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_cached_stacks_take_the_grouped_gemm_from_129_pairs():
    """With bf16 (here float32) copies of all three stacks the grouped GEMM replaces mmvq/mmq
    above 128 pairs; without them, or with one stack uncached, the integer paths keep them."""
    from moestream.kernels.dequant_mm import cache_values

    gate, up = stack(T.Q4_K, (2, 256, 256), 1), stack(T.Q4_K, (2, 256, 256), 2)
    down = stack(T.Q6_K, (2, 256, 256), 3)
    x = torch.zeros(1, 256, device=DEVICE)
    assert default_method(129, gate, up, down, x) == "grouped"
    cache_values(gate, torch.float32)
    cache_values(up, torch.float32)
    assert default_method(129, gate, up, down, x) == "grouped"  # down still uncached
    cache_values(down, torch.float32)
    expect = "dequant" if grouped_mm_available(x.device) and DEVICE == "cpu" else "grouped"
    assert default_method(129, gate, up, down, x) == expect
    assert default_method(128, gate, up, down, x) == "grouped"
    assert default_method(63, gate, up, down, x) == "mmvq"


def test_large_layers_skip_the_uncached_bf16_copies(monkeypatch):
    """Above DEQUANT_MAX_SCRATCH_BYTES of bf16 copies per layer the grouped Triton GEMM runs
    instead (no large scratch); cached copies need no scratch and keep the grouped GEMM."""
    from moestream.kernels import moe

    gate, up = stack(T.Q4_K, (2, 256, 256), 1), stack(T.Q4_K, (2, 256, 256), 2)
    down = stack(T.Q6_K, (2, 256, 256), 3)
    x = torch.zeros(1, 256, device=DEVICE)
    if not moe._dequant_ok(x):
        pytest.skip("no grouped GEMM for float32 here")
    assert default_method(1025, gate, up, down, x, num_experts=2) == "dequant"
    monkeypatch.setattr(moe, "DEQUANT_MAX_SCRATCH_BYTES", 3 * 256 * 256 * 4 * 2 - 1)
    assert default_method(1025, gate, up, down, x, num_experts=2) == "gemm"
    assert default_method(1025, gate, up, down, x, num_experts=1) == "dequant"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_combine_sums_each_tokens_rows_in_order(dtype):
    """out[t] = sum_j w[t, j] * y[rows[t k + j]]: against torch in float64; the rows are a
    permutation with padding rows y never names, H not a power of two (masked columns)."""
    from moestream.kernels.dequant_mm import moe_combine

    g = torch.Generator().manual_seed(12)
    t, k, h = 5, 3, 200
    y = torch.randn(t * k + 4, h, generator=g).to(DEVICE, dtype)
    rows = torch.randperm(t * k + 4, generator=g)[: t * k].to(DEVICE)
    w = torch.softmax(torch.randn(t, k, generator=g), -1).to(DEVICE)
    out = torch.full((t, h), float("nan"), dtype=dtype, device=DEVICE)
    moe_combine(y, rows, w, out)
    ref = (y.double()[rows].view(t, k, h) * w.double()[..., None]).sum(1)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="moe_combine"):
        moe_combine(y, rows[:-1], w, out)


def test_moe_gather_takes_each_assignments_token_and_zeros_padding():
    from moestream.kernels.dequant_mm import moe_gather

    t, k, h = 4, 2, 200
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    ids = torch.tensor([3, 8, 0, 7, 8, 8, 5, 1, 2], dtype=torch.int32, device=DEVICE)  # 8: pad
    got = moe_gather(x, ids, k)
    want = torch.where((ids < t * k)[:, None], x[(ids.long() % (t * k)) // k], 0.0)
    assert torch.equal(got, want)

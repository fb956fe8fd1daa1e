"""MMVQ (8-bit activations, integer dot products) against its torch references: the activation
quantizer bit for bit, the GEMV to float rounding, on random blocks (every bit pattern of the
quants and packed scales) and on real quantized weights. Without CUDA the Triton interpreter
runs the kernels on the CPU (dp4a emulated); on a CUDA machine the compiled kernels run."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from moestream.kernels import ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

pytest.importorskip("triton", reason="triton is not installed")

from moestream.kernels.mmvq import (  # noqa: E402
    MmvqConfig,
    dequantize_q8,
    mmvq,
    mmvq_ref,
    quantize_q8,
    quantize_q8_ref,
)
from moestream.weights.qtensor import QTensor  # noqa: E402
from tests.kernels.test_quant_matmul import activations, quantized, random_blocks  # noqa: E402

T = GGMLQuantizationType
TYPES = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0)
CODE_TYPES = (T.Q4_0, T.IQ4_NL, T.IQ4_XS, T.MXFP4)  # dense "once" kernel only (`mmvq_codes`)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_q8_matches_reference_bitwise(dtype: torch.dtype) -> None:
    x = activations(3, 320, dtype, seed=1)
    x[1, 32:64] = 0.0  # an all-zero block: d = 0, q = 0
    x[2, 5] = 1e4  # one outlier block
    got, ref = quantize_q8(x), quantize_q8_ref(x)
    assert torch.equal(got.q, ref.q)
    assert torch.equal(got.d, ref.d)
    assert torch.equal(got.s, ref.s)
    err = (dequantize_q8(ref) - x.float()).abs().reshape(3, -1, 32)
    assert (err <= ref.d[..., None] * 0.5001).all()  # round to nearest


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [1, 3])
def test_mmvq_random_blocks(qtype: GGMLQuantizationType, m: int) -> None:
    w = random_blocks(qtype, 20, 512, seed=int(qtype) + m)
    a = quantize_q8(activations(m, 512, torch.float32, seed=m))
    out = torch.full((m, 20), float("nan"), device=DEVICE)
    y = mmvq(a, w, out=out, config=MmvqConfig(block_n=8, split_k=1, groups=2))
    ref = mmvq_ref(a, w)
    assert torch.isfinite(y).all()
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 2e-5


@pytest.mark.parametrize("qtype", TYPES)
def test_mmvq_split_k_and_close_to_float_matmul(qtype: GGMLQuantizationType) -> None:
    w = quantized(qtype, (12, 1024), seed=3)
    x = activations(5, 1024, torch.float32, seed=4)
    cfg = MmvqConfig(block_n=4, split_k=2, groups=1)
    y = mmvq(quantize_q8(x), w, config=cfg)
    exact = x @ w.dequantize(torch.float32).t()
    # 8-bit activations: about 1/254 of each block's max per value, averaged over K
    assert ((y - exact).abs().max() / exact.abs().max()).item() < 2e-2
    # a row gives the same bits alone, among 2 or among 5 (batch invariance)
    for rows in (slice(1, 2), slice(0, 2)):
        assert torch.equal(mmvq(quantize_q8(x[rows]), w, config=cfg)[-1], y[1])


def test_mmvq_rejects_bad_input() -> None:
    w = quantized(T.Q4_K, (8, 256), seed=0)
    with pytest.raises(ValueError, match="at most"):
        mmvq(quantize_q8(activations(9, 256, torch.float32, 0)), w)
    with pytest.raises(ValueError, match="K="):
        mmvq(quantize_q8(activations(1, 512, torch.float32, 0)), w)
    with pytest.raises(ValueError, match="no kernel"):
        mmvq(quantize_q8(activations(1, 256, torch.float32, 0)), quantized(T.Q2_K, (8, 256), 0))
    with pytest.raises(ValueError, match="tile"):  # the code types have the "once" kernel only
        mmvq(quantize_q8(activations(1, 256, torch.float32, 0)), quantized(T.Q4_0, (8, 256), 0),
             config=MmvqConfig(variant="tile"))  # fmt: skip
    w = random_blocks(T.IQ4_NL, 2, 256, seed=0)
    odd = torch.zeros(w.data.numel() + 1, dtype=torch.uint8, device=DEVICE)[1:].view(2, -1)
    with pytest.raises(ValueError, match="2-byte aligned"):  # read as 16-bit halves
        mmvq(quantize_q8(activations(1, 256, torch.float32, 0)), QTensor(odd, T.IQ4_NL, w.shape))


# ---- the "once" variant (activations loaded once per program) ---------------------------------


def once(block_n: int = 4, split_k: int = 1, groups: int = 2) -> MmvqConfig:
    return MmvqConfig(block_n, split_k, groups, 2, "once")


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_mmvq_once_random_blocks(qtype: GGMLQuantizationType, m: int) -> None:
    w = random_blocks(qtype, 5, 768, seed=int(qtype) + 10 * m)  # odd N; 3 groups, 2 a step
    a = quantize_q8(activations(m, 768, torch.float32, seed=m))
    out = torch.full((m, 5), float("nan"), device=DEVICE)
    y = mmvq(a, w, out=out, config=once())
    ref = mmvq_ref(a, w)
    assert torch.isfinite(y).all()
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 2e-5


@pytest.mark.parametrize("qtype", TYPES)
def test_mmvq_once_split_k_and_batch_invariance(qtype: GGMLQuantizationType) -> None:
    w = random_blocks(qtype, 3, 1024, seed=int(qtype) + 5)
    x = activations(4, 1024, torch.float32, seed=6) * 50.0  # large sums: rounding shows
    cfg = once(block_n=4, split_k=2, groups=1)  # 2 steps of 1 group per split
    y = mmvq(quantize_q8(x), w, config=cfg)  # [4, 3]
    ref = mmvq_ref(quantize_q8_ref(x), w)
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 2e-5
    # a row's bits alone and among 4, and rows 2-3 as a pair: the same (batch invariance)
    assert torch.equal(mmvq(quantize_q8(x[:1]), w, config=cfg)[0], y[0])
    assert torch.equal(mmvq(quantize_q8(x[2:4]), w, config=cfg), y[2:4])


def test_mmvq_once_batch_invariance_over_many_steps() -> None:
    """4 steps of one group each (the tile variant's default changes its steps with M)."""
    w = random_blocks(T.Q4_K, 2, 1024, seed=7)
    x = activations(8, 1024, torch.float32, seed=8) * 50.0
    cfg = once(block_n=2, groups=1)
    y = mmvq(quantize_q8(x), w, config=cfg)  # [8, 2]
    for rows in (slice(0, 1), slice(0, 2), slice(0, 4)):
        assert torch.equal(mmvq(quantize_q8(x[rows]), w, config=cfg), y[rows])


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K])
def test_mmvq_once_bits_do_not_depend_on_warps_or_rows(qtype: GGMLQuantizationType) -> None:
    """Warps and rows per program (what `mmvq_config` picks by M) leave every row's bits as
    they are: on a GPU each warp count compiles its own layout; the groups per step stay 2."""
    w = random_blocks(qtype, 13, 1024, seed=int(qtype))
    for m in (1, 3):
        a = quantize_q8(activations(m, 1024, torch.float32, seed=m + 20))
        outs = [mmvq(a, w, config=MmvqConfig(b, 1, 2, warps, "once"))
                for b, warps in ((4, 1), (4, 2), (8, 4), (2, 2))]  # fmt: skip
        assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_mmvq_once_default_config_does_not_depend_on_m() -> None:
    from moestream.kernels.mmvq import mmvq_config
    from moestream.kernels.mmvq_once import once_warps

    for n, k in ((5120, 4096), (4096, 12288), (5120, 2048)):
        cfgs = [mmvq_config(n, k, 132, mb, variant="once") for mb in (1, 2, 4, 8)]
        assert len({(c.split_k, c.groups, c.variant) for c in cfgs}) == 1  # what sets the bits
        for cfg in cfgs:
            assert cfg.variant == "once" and once_warps(cfg, 4) * 16 <= 4 * cfg.groups
    assert mmvq_config(5120, 4096, 132, 1, variant="once").num_warps == 1  # LONG_K_ONE_WARP
    assert mmvq_config(5120, 4096, 132, 2, variant="once").num_warps == 2
    assert mmvq_config(5120, 2048, 132, 1, variant="once").num_warps == 1  # ONE_WARP_MIN_GROUPS
    assert mmvq_config(5120, 1024, 132, 1, variant="once").num_warps == 2
    with pytest.raises(ValueError, match="variant"):
        mmvq(quantize_q8(activations(1, 256, torch.float32, 0)), quantized(T.Q4_K, (8, 256), 0),
             config=MmvqConfig(variant="rows"))  # fmt: skip


# ---- the 4-bit code types (`mmvq_codes`: dense "once" kernel only) -----------------------------


@pytest.mark.parametrize("qtype", CODE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3])
def test_mmvq_once_code_types_random_blocks(qtype: GGMLQuantizationType, m: int) -> None:
    """Every code, sub-block scale and exponent occurs; N = 5 leaves a ragged second program
    (4 rows each); 2 groups, one a step. The reference dequantizes as gguf does (checked)."""
    w = random_blocks(qtype, 5, 512, seed=int(qtype) + m)
    gguf_values = dequantize(w.data.cpu().numpy(), qtype)
    assert torch.equal(w.dequantize().cpu(), torch.from_numpy(gguf_values).float())
    a = quantize_q8(activations(m, 512, torch.float32, seed=m))
    out = torch.full((m, 5), float("nan"), device=DEVICE)
    y = mmvq(a, w, out=out, config=once(block_n=4, groups=1))
    ref = mmvq_ref(a, w)
    assert torch.isfinite(y).all()
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 2e-5


@pytest.mark.parametrize("qtype", CODE_TYPES, ids=lambda t: t.name)
def test_mmvq_once_code_types_batch_invariance(qtype: GGMLQuantizationType) -> None:
    """A row's bits alone (M_BLOCK 1: two steps unrolled), as a pair and among 8 (M_BLOCK 8:
    the step loop) are the same; 2 K splits."""
    w = random_blocks(qtype, 2, 1024, seed=int(qtype) + 5)
    x = activations(8, 1024, torch.float32, seed=6) * 50.0  # large sums: rounding shows
    cfg = once(block_n=2, split_k=2, groups=1)
    y = mmvq(quantize_q8(x), w, config=cfg)  # [8, 2]
    ref = mmvq_ref(quantize_q8_ref(x), w)
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 2e-5
    assert torch.equal(mmvq(quantize_q8(x[5:6]), w, config=cfg)[0], y[5])
    assert torch.equal(mmvq(quantize_q8(x[2:4]), w, config=cfg), y[2:4])


@pytest.mark.parametrize("qtype", CODE_TYPES, ids=lambda t: t.name)
def test_code_types_take_mmvq_for_dense_decode_and_grouped_moe(monkeypatch, qtype) -> None:
    """Dense matmuls of 1-8 rows take mmvq on the norm's q8 rows (the default config: once),
    9 rows the float GEMM, 32 the bf16 copy; the MoE takes the grouped path."""
    from moestream.kernels import moe

    monkeypatch.setattr(ops, "_use_kernels", lambda x, *ws: True)  # CPU tensors: interpreter
    w = random_blocks(qtype, 6, 256, seed=1)
    x = activations(9, 256, torch.float32, seed=2)
    paths = [ops._matmul_path(x[:m], w) for m in (1, 2, 3, 8, 9)]
    assert paths == ["mmvq"] * 4 + ["gemm"]
    assert ops._matmul_path(torch.zeros(ops.DEQUANT_MIN_M, 256), w) == "dequant"
    assert ops.takes_q8(x[:8], w) and not ops.takes_q8(x, w)
    assert torch.equal(ops.quant_matmul(x[:2], w), mmvq(quantize_q8(x[:2]), w))
    with ops.batch_invariant():
        assert ops.takes_q8(x, w)
    stack = random_blocks(qtype, 6, 256, seed=3)
    stack = QTensor(stack.data.view(2, 3, -1), qtype, (2, 3, 256))
    # the MoE: the grouped path (tests/kernels/test_moe_grouped.py), on the norm's q8 rows
    assert ops.moe_takes_q8(x, 2, stack, stack, stack, 2)
    assert moe.default_method(4, stack, stack, stack) == "grouped"


def test_other_types_keep_their_paths(monkeypatch) -> None:
    monkeypatch.setattr(ops, "_use_kernels", lambda x, *ws: True)
    x = activations(3, 256, torch.float32, seed=2)
    assert ops._matmul_path(x[:1], random_blocks(T.Q4_1, 4, 256, seed=1)) == "gemv"
    assert ops._matmul_path(x, random_blocks(T.Q4_K, 4, 256, seed=1)) == "mmq"
    assert {T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0} == ops.MMVQ_QTYPES  # the MoE and mmq kernels' types

"""Q6_K in the padded layout (`QTensor.aligned`: 224-byte blocks) gives every kernel the same bits
as the file's 210-byte blocks: the dense GEMVs (tile and "once"), the integer-dot GEMM, the
dequantizing paths, every fused-MoE path, the embedding lookup and the reference dequantization.
Outputs are poisoned (NaN) before each run. Without CUDA the Triton interpreter runs them."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType

from moestream.weights.qtensor import QTensor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

pytest.importorskip("triton", reason="triton is not installed")

from moestream.kernels import ops  # noqa: E402
from moestream.kernels.dequant_mm import dequantize_rows  # noqa: E402
from moestream.kernels.mmq import MmqConfig, mmq  # noqa: E402
from moestream.kernels.mmvq import MmvqConfig, mmvq, quantize_q8  # noqa: E402
from moestream.kernels.moe import fused_moe  # noqa: E402
from moestream.kernels.moe_grouped import MoeGroupedConfig, moe_grouped  # noqa: E402
from moestream.kernels.moe_mmvq import MoeMmvqConfig  # noqa: E402
from moestream.kernels.quant_gemm import quant_gemm  # noqa: E402
from moestream.kernels.quant_gemv import quant_gemv  # noqa: E402
from tests.kernels.test_moe_kernel import FF, RESIDENT, SLOT, H, S, routing, stacked  # noqa: E402
from tests.kernels.test_quant_matmul import activations, random_blocks  # noqa: E402

T = GGMLQuantizationType


def padded(w: QTensor) -> QTensor:
    p = w.aligned()
    assert p.padded and p.block_bytes == 224 and p.data.shape[-1] == w.shape[-1] // 256 * 224
    return p


def test_aligned_layout_round_trips_and_dequantizes_the_same() -> None:
    w = random_blocks(T.Q6_K, 6, 768, seed=1)
    p = padded(w)
    blocks = p.data.reshape(6, 3, 224)
    assert torch.equal(blocks[..., :210].reshape(6, -1), w.data)
    assert not blocks[..., 210:].any()  # zero padding
    assert torch.equal(p.native(), w.data)
    assert torch.equal(p.dequantize(), w.dequantize())
    assert torch.equal(p[2].dequantize(), w.dequantize()[2])  # a slice keeps the layout
    assert p.aligned() is p
    q4 = random_blocks(T.Q4_K, 2, 256, seed=2)
    assert q4.aligned() is q4  # no padded layout for Q4_K: unchanged
    with pytest.raises(ValueError, match="no padded layout"):
        QTensor(q4.data, T.Q4_K, q4.shape, padded=True)
    ids = torch.tensor([4, 0, 4], device=DEVICE)
    assert torch.equal(ops.embedding(ids, p), ops.embedding(ids, w))


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("variant", ["once", "tile"])
def test_mmvq_reads_padded_blocks_bit_exactly(m: int, variant: str) -> None:
    w = random_blocks(T.Q6_K, 20, 512, seed=3 + m)
    a = quantize_q8(activations(m, 512, torch.float32, seed=m))
    cfg = MmvqConfig(block_n=8, split_k=1, groups=2, variant=variant)
    want = mmvq(a, w, config=cfg)
    out = torch.full((m, 20), float("nan"), device=DEVICE)
    got = mmvq(a, padded(w), out=out, config=cfg)
    assert torch.equal(got, want)


def test_mmq_reads_padded_blocks_bit_exactly() -> None:
    w = random_blocks(T.Q6_K, 64, 512, seed=5)
    a = quantize_q8(activations(5, 512, torch.float32, seed=6))
    cfg = MmqConfig(block_m=16, block_n=64, split_k=1)
    want = mmq(a, w, config=cfg)
    out = torch.full((5, 64), float("nan"), device=DEVICE)
    assert torch.equal(mmq(a, padded(w), out=out, config=cfg), want)


def test_dequantizing_kernels_read_padded_blocks_bit_exactly() -> None:
    w = random_blocks(T.Q6_K, 24, 768, seed=7)  # K = 768: 3 groups, as the 30B's expert down
    out = torch.full((24, 768), float("nan"), device=DEVICE)
    assert torch.equal(dequantize_rows(padded(w), out), w.dequantize().to(DEVICE))
    x = activations(3, 768, torch.float32, seed=8)
    assert torch.equal(quant_gemv(x[:1], padded(w)), quant_gemv(x[:1], w))
    assert torch.equal(quant_gemm(x, padded(w)), quant_gemm(x, w))


@pytest.fixture(scope="module")
def experts() -> tuple[QTensor, QTensor, QTensor]:
    """gate Q4_K, up Q6_K, down Q6_K [S, ...]: Q6_K on both sides of the FFN."""
    return (
        stacked(T.Q4_K, (S, FF, H), seed=11),
        stacked(T.Q6_K, (S, FF, H), seed=12),
        stacked(T.Q6_K, (S, H, FF), seed=13),
    )


@pytest.mark.parametrize(
    "method, t, cfg",
    [
        ("mmvq", 2, MoeMmvqConfig()),  # the tile gate/up kernel, the "rows" down tile
        ("mmvq", 1, MoeMmvqConfig(down_rows=False)),  # the tile down
        ("grouped", 2, MoeGroupedConfig(block_m=2)),  # the "once" step (as the default gate/up)
        pytest.param(
            "grouped",
            2,
            MoeGroupedConfig(block_m=2, down_tiles=4),  # the down in row tiles
            marks=pytest.mark.skipif(DEVICE == "cpu", reason="45 s more in the interpreter"),
        ),
        ("mmq", 3, None),
        ("gemv", 2, None),
        ("gemm", 3, None),
    ],
)
def test_fused_moe_reads_padded_experts_bit_exactly(experts, method, t, cfg) -> None:
    gate, up, down = experts
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, H, generator=g).to(DEVICE)
    ids, weights = routing(t, 2, RESIDENT, seed=t + 1)
    slot = torch.tensor(SLOT, dtype=torch.int32, device=DEVICE)
    out = torch.full((t, H), float("nan"), device=DEVICE)
    if method == "grouped":  # a small tile: the default's takes minutes in the interpreter
        want = moe_grouped(x, ids, weights, gate, up, down, slot, torch.empty_like(out), cfg)
        got = moe_grouped(x, ids, weights, gate, padded(up), padded(down), slot, out, cfg)
    else:
        kw = {"mmvq_cfg": cfg} if cfg is not None else {}
        want = fused_moe(x, ids, weights, gate, up, down, slot, method=method, **kw)
        got = fused_moe(x, ids, weights, gate.aligned(), padded(up), padded(down), slot,
                        out=out, method=method, **kw)  # fmt: skip
    assert torch.equal(got, want)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize(
    "types",
    [(T.Q4_K, T.Q6_K, True), (T.Q4_K, T.Q6_K, False), (T.IQ4_XS, T.Q5_K, False)],
    ids=["q4k-q6k-padded", "q4k-q6k", "iq4xs-q5k"],
)
def test_mmvq_pair_gives_each_weights_rows_as_mmvq_does(m: int, types) -> None:
    """One launch over two weights of different types (Qwen3's q/k and v): each part's columns
    are, bit for bit, `mmvq` of that weight alone with the same launch shape."""
    from moestream.kernels.mmvq import mmvq_pair

    w = random_blocks(types[0], 24, 512, seed=20 + m)
    w2 = random_blocks(types[1], 10, 512, seed=21 + m)
    if types[2]:
        w2 = padded(w2)
    a = quantize_q8(activations(m, 512, torch.float32, seed=22))
    cfg = MmvqConfig(block_n=4, split_k=1, groups=2, num_warps=2, variant="once")
    y = mmvq_pair(a, w, w2, config=cfg)
    assert y.shape == (m, 34)
    assert torch.equal(y[:, :24], mmvq(a, w, config=cfg))
    assert torch.equal(y[:, 24:], mmvq(a, w2, config=cfg))
    with pytest.raises(ValueError, match="without a K split"):
        mmvq_pair(a, w, w2, config=MmvqConfig(4, 2, 1, 2, "once"))


def test_q_k_v_of_two_types_become_one_paired_projection(monkeypatch) -> None:
    """fuse_linears: Q4_K q and k merged, the Q6_K v paired with them; on the kernel path the
    pair is one `mmvq_pair` launch whose columns are the separate products' bits."""
    from moestream.kernels import mmvq as mmvq_module
    from moestream.layers import linear as linear_layer
    from moestream.layers.linear import Linear, PairedLinear, fuse_linears

    q, k = (Linear(random_blocks(T.Q4_K, n, 512, seed=s)) for n, s in ((16, 30), (8, 31)))
    v = Linear(padded(random_blocks(T.Q6_K, 8, 512, seed=32)))
    fused = fuse_linears([q, k, v])
    assert len(fused) == 1 and isinstance(fused[0][0], PairedLinear)
    assert fused[0][1] == [16, 8, 8]
    x = activations(1, 512, torch.bfloat16, seed=33)
    pair = fused[0][0]
    for got, want in zip(pair.outputs(x), (q(x), k(x), v(x)), strict=True):  # the CPU
        assert torch.equal(got, want)
    monkeypatch.setattr(linear_layer, "device_path", lambda x: True)
    monkeypatch.setattr(ops, "_use_kernels", lambda x, *ws: True)
    calls = []
    real = mmvq_module.mmvq_pair
    monkeypatch.setattr(
        mmvq_module, "mmvq_pair", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    yq, yk, yv = pair.outputs(x)
    assert calls == [1]
    yqk = ops.quant_matmul(x, pair.a.weight)
    assert torch.equal(yq, yqk[:, :16]) and torch.equal(yk, yqk[:, 16:])
    assert torch.equal(yv, ops.quant_matmul(x, v.weight))
    x3 = activations(3, 512, torch.bfloat16, seed=34)  # 3 rows: mmq for both, no pair launch
    assert not ops.pairs_in_one_launch(x3, *pair.weights)
    assert [t.shape[-1] for t in pair.outputs(x3)] == [16, 8, 8] and calls == [1]
    # a bias keeps them apart
    vb = Linear(v.weight, bias=QTensor.from_float(torch.ones(8)))
    assert not any(isinstance(p, PairedLinear) for p, _ in fuse_linears([q, k, vb]))

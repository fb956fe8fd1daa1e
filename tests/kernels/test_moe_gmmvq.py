"""The "gmmvq" MoE path (assignments grouped by expert, integer dots; `kernels.moe_gmmvq`)
against `moe_mmvq_ref`, with fresh random inputs, NaN-filled outputs and a slot table that is
not the identity. Without CUDA the Triton interpreter runs the kernels on the CPU (slow: few
cases, tiny shapes, routing onto few experts so that few blocks run)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType

from moestream.weights.qtensor import QTensor
from moestream.weights.quantize import quantize

pytest.importorskip("triton", reason="triton is not installed")

from moestream.kernels.mmvq import quantize_q8  # noqa: E402
from moestream.kernels.moe import fused_moe  # noqa: E402
from moestream.kernels.moe_gmmvq import (  # noqa: E402
    GmmvqConfig,
    fused_moe_gmmvq,
    gmmvq_counters,
)
from moestream.kernels.moe_mmvq import moe_mmvq_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T = GGMLQuantizationType
E, H, FF = 8, 512, 256  # experts, hidden (two groups of 256: room for a K split), expert FFN
SLOT = [5, 2, 7, 0, 3, 6, 1, 4]  # expert -> weight slot: a permutation, not the identity


def stacked(qtype: GGMLQuantizationType, shape: tuple[int, int, int], seed: int) -> QTensor:
    """Random expert weights [S, out, in] (std 0.05) quantized to `qtype`."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=g) * 0.05
    return QTensor(torch.from_numpy(quantize(values, qtype)).to(DEVICE), qtype, shape)


def experts(qtypes: tuple[GGMLQuantizationType, ...], seed: int) -> tuple[QTensor, ...]:
    """gate, up [E, F, H] and down [E, H, F] of the given types."""
    qg, qu, qd = qtypes
    return (
        stacked(qg, (E, FF, H), seed),
        stacked(qu, (E, FF, H), seed + 1),
        stacked(qd, (E, H, FF), seed + 2),
    )


def routing(t: int, k: int, pool: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] int64 (k distinct experts of `pool` per token) and softmax weights."""
    g = torch.Generator().manual_seed(seed)
    p = torch.tensor(pool)
    ids = torch.stack([p[torch.randperm(len(pool), generator=g)[:k]] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    return ids.to(DEVICE), weights.to(DEVICE)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "output has NaN/inf: some element was not written"
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def slots() -> torch.Tensor:
    return torch.tensor(SLOT, dtype=torch.int32, device=DEVICE)


def run(x, ids, weights, w, cfg: GmmvqConfig) -> torch.Tensor:
    """fused_moe(method="gmmvq") into a NaN-filled out."""
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=DEVICE)
    fused_moe(x, ids, weights, *w, slots(), out=out, method="gmmvq", gmmvq_cfg=cfg)
    return out


CASES = [
    (  # one token: one block per expert, K split with the last-arriving sum
        1, 2, [1, 6], (T.Q4_K, T.Q5_K, T.Q6_K), torch.float32,
        GmmvqConfig(m_block=2, up_groups=1, up_split=2, down_block_n=256),
    ),
    (  # three tokens on three experts, bfloat16, no split, one K step for all of H, plain sums
        3, 3, [0, 4, 7], (T.Q8_0, T.Q4_K, T.Q8_0), torch.bfloat16,
        GmmvqConfig(
            m_block=4, up_groups=2, up_split=1, up_tree=False, down_block_n=512, down_groups=1
        ),
    ),
]  # fmt: skip


@pytest.mark.parametrize("t, k, pool, qtypes, dtype, cfg", CASES)
def test_gmmvq_matches_reference(t, k, pool, qtypes, dtype, cfg):
    w = experts(qtypes, seed=10 * t + k)
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(t)).to(DEVICE, dtype)
    ids, weights = routing(t, k, pool, seed=t + k)
    out = run(x, ids, weights, w, cfg)
    ref = moe_mmvq_ref(x, ids, weights, *w, slots())
    assert rel_err(out, ref) < (2e-3 if dtype == torch.float32 else 2e-2)


def test_gmmvq_uneven_routing():
    """Nine tokens, k = 2: expert 5 in every token (9 assignments: three blocks of M_BLOCK 4,
    the last one partly filled) beside three others; Q6_K gate, Q8_0 up, Q5_K down."""
    w = experts((T.Q6_K, T.Q8_0, T.Q5_K), seed=40)
    t = 9
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(41)).to(DEVICE)
    other, weights = routing(t, 1, [0, 2, 7], seed=42)
    ids = torch.cat([torch.full_like(other, 5), other], dim=1)  # [T, 2]
    weights = torch.softmax(torch.randn(t, 2, generator=torch.Generator().manual_seed(43)), -1)
    cfg = GmmvqConfig(m_block=4, up_groups=2, up_split=1, down_block_n=512)
    out = run(x, ids, weights.to(DEVICE), w, cfg)
    assert rel_err(out, moe_mmvq_ref(x, ids, weights, *w, slots())) < 2e-3


def test_gmmvq_token_bits_do_not_depend_on_the_batch():
    """Token 0 alone (T = 1), in a batch of 5 and in a batch of 12 whose other tokens are routed
    to the same experts, at other M_BLOCK positions (copies of it at rows 5 and 11, sharing
    blocks with other tokens) and another M_BLOCK: the same output bits everywhere."""
    w = experts((T.Q4_K, T.Q4_K, T.Q6_K), seed=50)
    g = torch.Generator().manual_seed(51)
    x = torch.randn(12, H, generator=g).to(DEVICE)
    x[5] = x[11] = x[0]
    ids = torch.tensor([[3, 6], [6, 3]] * 6, device=DEVICE)  # [12, 2]: all on experts 3 and 6
    weights = torch.softmax(torch.randn(12, 2, generator=g), dim=-1).to(DEVICE)
    ids[5] = ids[11] = ids[0]
    weights[5] = weights[11] = weights[0]
    cfg = GmmvqConfig(m_block=4, up_groups=1, up_split=2, down_block_n=512, down_groups=1)
    one = run(x[:1], ids[:1], weights[:1], w, cfg)
    five = run(x[:5], ids[:5], weights[:5], w, replace(cfg, m_block=2))
    twelve = run(x, ids, weights, w, cfg)
    assert torch.equal(five[0], one[0])
    for row in (0, 5, 11):  # other positions in other blocks of each expert
        assert torch.equal(twelve[row], one[0]), row
    assert rel_err(twelve, moe_mmvq_ref(x, ids, weights, *w, slots())) < 2e-3


def test_fused_moe_gmmvq_direct_takes_quantized_x_and_leaves_counters_zero():
    """`fused_moe_gmmvq` called directly with the caller's q8 activations and arrival counters
    gives the bits of `fused_moe(method="gmmvq")` and leaves the counters zero."""
    w = experts((T.Q5_K, T.Q4_K, T.Q8_0), seed=60)
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(61)).to(DEVICE)
    ids, weights = routing(2, 2, [2, 4], seed=62)
    cfg = GmmvqConfig(m_block=2, up_groups=1, up_split=2, down_block_n=512)
    via_dispatch = run(x, ids, weights, w, cfg)
    counters = gmmvq_counters(4, FF, DEVICE)
    out = torch.full((2, H), float("nan"), device=DEVICE)
    fused_moe_gmmvq(x, quantize_q8(x), ids, weights, *w, slots(), out, cfg, counters)
    assert not counters.any()
    assert torch.equal(out, via_dispatch)
    with pytest.raises(ValueError, match="xa"):
        fused_moe_gmmvq(x, quantize_q8(x[:, :256]), ids, weights, *w, slots(), out, cfg)
    with pytest.raises(ValueError, match="counters"):
        fused_moe_gmmvq(x, None, ids, weights, *w, slots(), out, cfg, counters[:3])


def test_gmmvq_rejects_bad_arguments():
    with pytest.raises(ValueError, match="m_block"):
        GmmvqConfig(m_block=3)
    with pytest.raises(ValueError, match="m_block"):
        GmmvqConfig(m_block=32)
    with pytest.raises(ValueError, match="up_warps"):
        GmmvqConfig(up_warps=3)
    gate = stacked(T.Q3_K, (2, 256, 256), seed=70)
    up = stacked(T.Q4_K, (2, 256, 256), seed=71)
    down = stacked(T.Q4_K, (2, 256, 256), seed=72)
    x = torch.zeros(1, 256, device=DEVICE)
    ids = torch.tensor([[0]], device=DEVICE)
    weights = torch.ones(1, 1, device=DEVICE)
    slot = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="gate is Q3_K"):
        fused_moe(x, ids, weights, gate, up, down, slot, method="gmmvq")
    with pytest.raises(ValueError, match="expert_slot"):
        fused_moe_gmmvq(x, None, ids, weights, up, up, down, None, x, GmmvqConfig())

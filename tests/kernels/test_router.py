"""The fused MoE routing kernel (softmax + top-k + renormalisation) against
`layers.moe.topk_softmax_ref`. Without CUDA the Triton interpreter runs it on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

from moestream.layers.moe import topk_softmax_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # the modules above do not import triton; the kernel module below does
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

pytest.importorskip("triton", reason="triton is not installed")

from moestream.kernels.router import topk_softmax  # noqa: E402


@pytest.mark.parametrize("experts, k", [(128, 8), (60, 4), (8, 2)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_reference(experts, k, renormalize):
    g = torch.Generator().manual_seed(experts + k)
    logits = (torch.randn(9, experts, generator=g) * 3).to(DEVICE)
    weights, ids = topk_softmax(logits, k, renormalize)
    ref_w, ref_ids = topk_softmax_ref(logits, k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)  # same experts, most probable first
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


def test_ties_go_to_the_lower_expert():
    logits = torch.tensor([[0.0, 2.0, 5.0, 2.0, 5.0, -1.0]], device=DEVICE)
    _, ids = topk_softmax(logits, 4, True)
    assert ids.tolist() == [[2, 4, 1, 3]]


def test_rejects_bad_top_k():
    with pytest.raises(ValueError, match="top_k"):
        topk_softmax(torch.zeros(2, 4, device=DEVICE), 5, True)


# ---- fused router: logits + softmax + top-k in one launch ------------------------------------

from moestream.kernels.router import fused_route, route_counters  # noqa: E402


def router_case(t: int, experts: int, h: int, seed: int, wdtype: torch.dtype):
    """x [T, H] bf16 and a router weight [E, H]; the rows of token 0's two most likely experts
    are copied to a lower and a higher expert id, so exact ties sit inside its top-k."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).bfloat16()
    w = (torch.randn(experts, h, generator=g) * 0.2).to(wdtype)
    top = torch.topk(logits_f32(x, w)[0], 2).indices.tolist()
    others = [e for e in range(experts) if e not in top]
    for i, e in enumerate(top):
        w[others[i]] = w[others[-1 - i]] = w[e]
    return x.to(DEVICE), w.to(DEVICE)


def logits_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in float64 rounded to float32: duplicate rows give equal logits."""
    return (x.double() @ w.double().t()).float()


def top_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The k most probable experts, ties to the lower id (a stable sort: torch.topk's order
    among equal values is not specified on the CPU)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]


@pytest.mark.parametrize(
    "t, experts, k, h, wdtype",
    [(1, 128, 8, 256, torch.float32), (3, 128, 8, 256, torch.bfloat16),
     (1, 64, 4, 512, torch.float16), (3, 64, 4, 512, torch.float32),
     (2, 256, 8, 4096, torch.float32)],  # 2 experts a program, 4 K steps (one warp)
)  # fmt: skip
def test_fused_route_matches_reference(t, experts, k, h, wdtype):
    x, w = router_case(t, experts, h, seed=t + experts, wdtype=wdtype)
    counters = route_counters(DEVICE)
    weights, ids = fused_route(x, w, k, True, counters)
    logits = logits_f32(x.cpu(), w.cpu())
    ref_w, _ = topk_softmax_ref(logits, k, True)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), top_ids(logits, k))  # token 0's ties go to the lower id
    assert len(set(weights[0].tolist())) < k  # ... and there are ties in its top-k
    torch.testing.assert_close(weights.cpu(), ref_w, rtol=1e-5, atol=1e-6)
    assert not counters.any()  # the last program of each token reset its counter
    again = fused_route(x, w, k, True, counters)  # the counters serve the next launch
    assert torch.equal(again[0], weights) and torch.equal(again[1], ids)


def test_fused_route_launch_shapes_pick_the_same_experts():
    x, w = router_case(3, 128, 512, seed=5, wdtype=torch.float32)
    want = top_ids(logits_f32(x.cpu(), w.cpu()), 8)
    for ppt, warps in ((128, 1), (64, 4), (16, 8), (32, 2)):
        weights, ids = fused_route(x, w, 8, True, programs_per_token=ppt, num_warps=warps)
        assert torch.equal(ids.cpu(), want), (ppt, warps)
        assert torch.allclose(weights.sum(-1).cpu(), torch.ones(3))


def test_fused_route_ties_and_no_renormalisation():
    w = torch.zeros(6, 32)
    w[:, 0] = torch.tensor([0.0, 2.0, 5.0, 2.0, 5.0, -1.0])
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 0] = 1
    weights, ids = fused_route(x.to(DEVICE), w.to(DEVICE), 4, False)
    assert ids.tolist() == [[2, 4, 1, 3]]
    ref_w, _ = topk_softmax_ref(w[:, 0][None], 4, False)
    torch.testing.assert_close(weights.cpu(), ref_w)


def test_fused_route_rejects_bad_arguments():
    x = torch.zeros(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="F32, F16 or BF16"):
        fused_route(x, torch.zeros(4, 32, dtype=torch.float64, device=DEVICE), 2, True)
    with pytest.raises(ValueError, match="top_k"):
        fused_route(x, torch.zeros(4, 32, device=DEVICE), 5, True)
    with pytest.raises(ValueError, match="counters"):
        fused_route(x, torch.zeros(4, 32, device=DEVICE), 2, True, torch.zeros(1, device=DEVICE))

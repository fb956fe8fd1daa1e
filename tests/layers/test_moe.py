"""Sparse MoE layer against a per-token brute-force reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moestream.layers.moe import SparseMoE, StackedExperts, route
from moestream.weights.qtensor import QTensor

T, H, FF, E, K = 9, 16, 8, 6, 2


def weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(E, FF, H, generator=g), torch.randn(E, FF, H, generator=g)
    down = torch.randn(E, H, FF, generator=g)
    router = torch.randn(E, H, generator=g)
    return router, gate, up, down


@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_matches_brute_force(norm_topk: bool) -> None:
    router, gate, up, down = weights(0)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    moe = SparseMoE(
        QTensor.from_float(router),
        StackedExperts(*(QTensor.from_float(w) for w in (gate, up, down))),
        top_k=K,
        norm_topk_prob=norm_topk,
    )
    out = moe(x)
    ref = torch.zeros(T, H, dtype=torch.float64)
    probs = torch.softmax(x.double() @ router.double().T, dim=-1)  # [T, E]
    for t in range(T):
        top = torch.topk(probs[t], K)
        w = top.values / top.values.sum() if norm_topk else top.values
        for weight, e in zip(w.tolist(), top.indices.tolist(), strict=True):
            h = F.silu(x[t].double() @ gate[e].double().T) * (x[t].double() @ up[e].double().T)
            ref[t] += weight * (h @ down[e].double().T)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_route_shapes_and_normalisation() -> None:
    router, *_ = weights(2)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).bfloat16()
    w, ids = route(x, QTensor.from_float(router), K, norm_topk_prob=True)
    assert w.dtype == torch.float32 and ids.shape == (T, K)
    torch.testing.assert_close(w.sum(-1), torch.ones(T))
    assert (w[:, 0] >= w[:, 1]).all()


def test_stacked_experts_are_views() -> None:
    _, gate, up, down = weights(4)
    experts = StackedExperts(*(QTensor.from_float(w) for w in (gate, up, down)))
    g, u, d = experts.weights(3)
    assert g.shape == (FF, H) and d.shape == (H, FF) and experts.num_experts == E
    assert g.data.data_ptr() == gate[3].data_ptr()


def test_route_on_the_kernel_path(monkeypatch) -> None:
    """`route` as on a GPU (the Triton interpreter on the CPU): up to ROUTER_MAX_T tokens the
    fused router (logits in the kernel), above it the logits matmul + top-k kernel; in
    batch-invariant mode the fused router in chunks, each token's routing as when alone."""
    pytest.importorskip("triton", reason="triton is not installed")
    from moestream.kernels import ops, router
    from moestream.layers import moe as moe_layer

    monkeypatch.setattr(moe_layer, "on_kernel_path", lambda x: True)
    fused_calls: list[int] = []
    fused = router.fused_route

    def counted(x, *args):
        fused_calls.append(len(x))
        return fused(x, *args)

    monkeypatch.setattr(router, "fused_route", counted)
    g = torch.Generator().manual_seed(5)
    w = QTensor.from_float(torch.randn(8, 32, generator=g))  # 8 programs a token
    x = torch.randn(70, 32, generator=g).bfloat16()
    probs = torch.softmax(x.double() @ w.data.double().t(), dim=-1)
    ref_w, ref_ids = torch.topk(probs, 2)
    ref_w = (ref_w / ref_w.sum(-1, keepdim=True)).float()
    few = route(x[:3], w, 2, True)
    assert fused_calls == [3]
    many = route(x, w, 2, True)  # the fallback
    assert fused_calls == [3]
    with ops.batch_invariant():
        chunked = route(x, w, 2, True)
    assert fused_calls == [3, 64, 6]
    for weights, ids in (few, many, chunked):
        assert torch.equal(ids, ref_ids[: len(ids)])
        torch.testing.assert_close(weights, ref_w[: len(ids)], rtol=1e-5, atol=1e-6)
    alone = route(x[66:], w, 2, True)
    assert torch.equal(chunked[0][66:], alone[0]) and torch.equal(chunked[1][66:], alone[1])


@pytest.mark.usefixtures("kernel_weights")
def test_moe_takes_the_norms_q8(monkeypatch, device, quantized_weight, quantize_q8_calls) -> None:
    """A SparseMoE on the fused integer-dot path (fused router, fused MoE): fed the output of
    a norm that wrote its q8 rounding (the norm asked by `takes_q8`), it quantizes nothing and
    gives the bits of the plain norm output."""
    from moestream.layers import moe as moe_layer
    from moestream.layers import norm
    from moestream.layers.norm import RMSNorm

    monkeypatch.setattr(norm, "on_kernel_path", lambda x: True)
    monkeypatch.setattr(moe_layer, "on_kernel_path", lambda x: True)
    monkeypatch.setattr(moe_layer, "fused_moe_path", lambda x: True)
    h, f, e = 256, 256, 4
    shapes = [(e, f, h), (e, f, h), (e, h, f)]  # gate, up, down
    stacks = [quantized_weight(s, "Q4_K", seed=i) for i, s in enumerate(shapes)]
    g = torch.Generator().manual_seed(7)
    router = QTensor.from_float(torch.randn(e, h, generator=g).to(device))
    moe = SparseMoE(router, StackedExperts(*stacks), top_k=2, norm_topk_prob=True)
    ffn_norm = RMSNorm(QTensor.from_float(torch.rand(h, generator=g) + 0.5), 1e-6, device)
    x = torch.randn(1, h, generator=g).to(device, torch.bfloat16)
    assert moe.takes_q8(x)
    calls = quantize_q8_calls
    y = ffn_norm(x, q8=True)
    assert norm.q8_of(y) is not None and calls == []
    fused = moe(y)
    assert calls == []  # the MoE used the norm's rounding
    plain = moe(ffn_norm(x))
    assert calls == [1]
    assert torch.equal(fused, plain)

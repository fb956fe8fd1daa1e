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

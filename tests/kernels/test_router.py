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

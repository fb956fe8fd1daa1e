"""MoE routing in one launch: softmax over the router logits, top-k, optional renormalisation.

One program per token holds its E logits, takes the softmax in float32, then picks the k largest
probabilities by k rounds of argmax (ties go to the lower expert id, as the CPU reference's
`torch.topk` does), in descending order. Replaces softmax + topk + sum + div (four launches).

Letters: T tokens, E experts, k experts per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _topk_softmax_kernel(
    logits_ptr, weights_ptr, ids_ptr, E, stride_l,
    TOPK: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    ok = e < E
    x = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(ok, p, 0.0)
    probs = tl.where(ok, p / tl.sum(p, axis=0), -1.0)  # padding never wins
    kk = tl.arange(0, K_PAD)
    top_w = tl.zeros([K_PAD], tl.float32)
    top_i = tl.zeros([K_PAD], tl.int32)
    for j in tl.static_range(TOPK):
        best = tl.max(probs, axis=0)
        idx = tl.argmax(probs, axis=0, tie_break_left=True)
        top_w = tl.where(kk == j, best, top_w)
        top_i = tl.where(kk == j, idx, top_i)
        probs = tl.where(e == idx, -2.0, probs)
    if RENORM:
        top_w = top_w / tl.sum(tl.where(kk < TOPK, top_w, 0.0), axis=0)
    tl.store(weights_ptr + t * TOPK + kk, top_w, mask=kk < TOPK)
    tl.store(ids_ptr + t * TOPK + kk, top_i.to(ids_ptr.dtype.element_ty), mask=kk < TOPK)


def topk_softmax(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float -> (weights [T, k] float32, ids [T, k] int64); contract of
    `layers.moe.topk_softmax_ref`: softmax in float32, the k most probable experts in
    descending order, weights renormalised to sum to 1 when `renormalize`."""
    if logits.dim() != 2 or logits.stride(-1) != 1 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [T, E] with unit last stride, {logits.shape}")
    t, e = logits.shape
    if not 0 < top_k <= e:
        raise ValueError(f"top_k must be in 1..{e}, got {top_k}")
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    e_pad = triton.next_power_of_2(e)
    _topk_softmax_kernel[(t,)](
        logits, weights, ids, e, logits.stride(0),
        TOPK=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=e_pad, RENORM=renormalize,
        num_warps=min(4, max(1, e_pad // 128)),
    )  # fmt: skip
    return weights, ids

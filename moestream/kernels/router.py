"""MoE routing in one launch: router logits, softmax, top-k and optional renormalisation.

`topk_softmax`: from logits [T, E]. One program per token holds its E logits, takes the softmax
in float32, then picks the k largest probabilities by k rounds of argmax (ties go to the lower
expert id, as the CPU reference's `torch.topk` does), in descending order. Replaces softmax +
topk + sum + div (four launches).

`fused_route`: from the activations x [T, H] and the float router weight [E, H] (F32, F16 or
BF16), for decode-sized batches. Grid (T, E / BLOCK_E): each program computes BLOCK_E logits of
one token in float32 (a GEMV slice: the ~1 MB weight of Qwen3-30B-A3B is read by 128 programs at
once, where one program per token would read it through one SM) and writes them to a scratch
row; the last program of a token to arrive (a per-token int32 counter, bumped with an acq_rel
atomic after a CTA barrier) resets the counter to 0 (so the next launch, or CUDA-graph replay,
starts from 0) and runs the softmax / top-k epilogue above on the token's logits. Replaces the
cast of x to float32, cuBLAS's dot + reduce and the top-k launch (four launches, ~9 us on an
H200 per layer at T = 1). One warp a program: the epilogue's softmax and k rounds of argmax are
then reductions within a warp (shuffles), where 4 warps paid a shared-memory exchange and a
barrier for each (H200, `bench/kernels_gpu.py --sweep-router`, 2026-11-30: 4.5 us at T = 1
against 7.7 for 64 programs of 4 warps). Each logit is summed in an order fixed by (E, H) and
the launch shape alone: a token's routing does not depend on the batch.

Letters: T tokens, H hidden, E experts, k experts per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moestream.kernels.arrival import arrival_counters, check_counters, last_to_arrive
from moestream.kernels.pdl import pdl_args, pdl_start

# Tokens up to which `layers.moe.route` takes `fused_route` (the counter buffer's length); above,
# a GEMM for the logits and `topk_softmax` (each program would re-read the weight from L2).
ROUTER_MAX_T = 64
ROUTER_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PROGRAMS_PER_TOKEN = 128  # E / BLOCK_E, about: enough programs to read the weight in parallel
NUM_WARPS = 1
_TILE_PER_WARP = 2048  # BLOCK_E x BLOCK_K values per step and warp (64 float32 registers a thread)


@triton.jit
def _topk_softmax_row(x, ok, e, weights_ptr, ids_ptr, t, TOPK: tl.constexpr,
                      K_PAD: tl.constexpr, RENORM: tl.constexpr, E_PAD: tl.constexpr):  # fmt: skip
    """Softmax of one token's logits x [E_PAD] float32 (-inf where not `ok`, e = arange), its k
    most probable experts in descending order (ties to the lower id) into row t of weights and
    ids."""
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(ok, p, 0.0)
    probs = p / tl.sum(p, axis=0)  # [E_PAD], >= +0
    # One max per pick: probability bits (non-negative floats order as their bit patterns)
    # above the reversed id (ties to the lower id), padding -1 below every expert.
    key = (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (E_PAD - 1 - e)
    key = tl.where(ok, key, -1)
    kk = tl.arange(0, K_PAD)
    top_w = tl.zeros([K_PAD], tl.float32)
    top_i = tl.zeros([K_PAD], tl.int32)
    for j in tl.static_range(TOPK):
        best = tl.max(key, axis=0)
        idx = (E_PAD - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
        w = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        top_w = tl.where(kk == j, w, top_w)
        top_i = tl.where(kk == j, idx, top_i)
        key = tl.where(key == best, -2, key)
    if RENORM:
        top_w = top_w / tl.sum(tl.where(kk < TOPK, top_w, 0.0), axis=0)
    tl.store(weights_ptr + t * TOPK + kk, top_w, mask=kk < TOPK)
    tl.store(ids_ptr + t * TOPK + kk, top_i.to(ids_ptr.dtype.element_ty), mask=kk < TOPK)


@triton.jit
def _topk_softmax_kernel(
    logits_ptr, weights_ptr, ids_ptr, E, stride_l,
    TOPK: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    ok = e < E
    x = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    _topk_softmax_row(x, ok, e, weights_ptr, ids_ptr, t, TOPK, K_PAD, RENORM, E_PAD)


@triton.jit
def _fused_route_kernel(
    x_ptr, w_ptr, logits_ptr, count_ptr, weights_ptr, ids_ptr, E, stride_x, stride_w,
    H: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
    RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_E, BLOCK_K], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + kk
        k_ok = k < H
        xv = tl.load(x_ptr + t * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
        wv = tl.load(w_ptr + e[:, None] * stride_w + k[None, :],
                     mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        acc += wv * xv[None, :]
    tl.store(logits_ptr + t * E + e, tl.sum(acc, axis=1), mask=e_ok)  # [BLOCK_E]
    if last_to_arrive(count_ptr + t, tl.num_programs(1)):  # all the token's logits are out
        ee = tl.arange(0, E_PAD)
        ok = ee < E
        x = tl.load(logits_ptr + t * E + ee, mask=ok, other=float("-inf"), cache_modifier=".cg")
        _topk_softmax_row(x, ok, ee, weights_ptr, ids_ptr, t, TOPK, K_PAD, RENORM, E_PAD)


def _check_top_k(top_k: int, e: int) -> None:
    if not 0 < top_k <= e:
        raise ValueError(f"top_k must be in 1..{e}, got {top_k}")


def _outputs(t: int, top_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    weights = torch.empty((t, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=device)
    return weights, ids


def topk_softmax(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float -> (weights [T, k] float32, ids [T, k] int64); contract of
    `layers.moe.topk_softmax_ref`: softmax in float32, the k most probable experts in
    descending order, weights renormalised to sum to 1 when `renormalize`."""
    if logits.dim() != 2 or logits.stride(-1) != 1 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [T, E] with unit last stride, {logits.shape}")
    t, e = logits.shape
    _check_top_k(top_k, e)
    weights, ids = _outputs(t, top_k, logits.device)
    if t == 0:
        return weights, ids
    e_pad = triton.next_power_of_2(e)
    _topk_softmax_kernel[(t,)](
        logits, weights, ids, e, logits.stride(0),
        TOPK=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=e_pad, RENORM=renormalize,
        num_warps=min(4, max(1, e_pad // 128)), **pdl_args(logits.device),
    )  # fmt: skip
    return weights, ids


def route_counters(device: torch.device | str) -> torch.Tensor:
    """The per-token arrival counters `fused_route` needs: int32 [ROUTER_MAX_T], zero. Every
    launch leaves them at zero, so one buffer serves every launch in stream order (a layer
    keeps one; launches that may run concurrently need one each)."""
    return arrival_counters(ROUTER_MAX_T, device)


def router_tiles(
    e: int, h: int, programs_per_token: int = PROGRAMS_PER_TOKEN, num_warps: int = NUM_WARPS
) -> tuple[int, int]:
    """(BLOCK_E, BLOCK_K) of `fused_route` for E experts of width H: about
    `programs_per_token` programs per token, BLOCK_E x BLOCK_K <= _TILE_PER_WARP x warps. From
    (E, H) and the launch shape only."""
    block_e = max(1, triton.next_power_of_2(e) // programs_per_token)
    block_k = max(16, min(triton.next_power_of_2(h), _TILE_PER_WARP * num_warps // block_e))
    return block_e, block_k


def fused_route(
    x: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    counters: torch.Tensor | None = None,
    *,
    programs_per_token: int = PROGRAMS_PER_TOKEN,
    num_warps: int = NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] float (T <= ROUTER_MAX_T, unit last stride), router weight [E, H] float32,
    float16 or bfloat16 (contiguous) -> (weights [T, k] float32, ids [T, k] int64): the
    contract of `layers.moe.topk_softmax_ref` on logits x @ weight.T computed in float32.

    `counters`: int32 [>= T], all zero (`route_counters`), left zero on return; made here when
    None (one more launch). `programs_per_token` and `num_warps`: the launch shape (a token's
    bits depend on them, never on the batch)."""
    if x.dim() != 2 or x.stride(-1) != 1 or not x.is_floating_point():
        raise ValueError(f"x must be a float [T, H] with unit last stride, got {tuple(x.shape)}")
    t, h = x.shape
    if weight.dim() != 2 or weight.shape[1] != h or not weight.is_contiguous():
        raise ValueError(f"router weight must be a contiguous [E, {h}], got {tuple(weight.shape)}")
    if weight.dtype not in ROUTER_WEIGHT_DTYPES:
        raise ValueError(f"router weight must be F32, F16 or BF16, got {weight.dtype}")
    if t > ROUTER_MAX_T:
        raise ValueError(f"fused_route takes at most {ROUTER_MAX_T} tokens, got {t}")
    e = weight.shape[0]
    _check_top_k(top_k, e)
    if counters is None:
        counters = route_counters(x.device)
    check_counters(counters, t, x.device)
    weights, ids = _outputs(t, top_k, x.device)
    if t == 0:
        return weights, ids
    logits = torch.empty((t, e), dtype=torch.float32, device=x.device)  # scratch
    block_e, block_k = router_tiles(e, h, programs_per_token, num_warps)
    e_pad = triton.next_power_of_2(e)
    _fused_route_kernel[(t, triton.cdiv(e, block_e))](
        x, weight, logits, counters, weights, ids, e, x.stride(0), weight.stride(0),
        H=h, TOPK=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=e_pad, RENORM=renormalize,
        BLOCK_E=block_e, BLOCK_K=block_k, num_warps=num_warps, **pdl_args(x.device),
    )  # fmt: skip
    return weights, ids

"""Fused per-token kernels of a decoder layer: residual add + RMSNorm (optionally with its output
rounded to q8 blocks for the integer-dot matmuls that read it: `add_rms_norm_q8`), and per-head
q/k RMSNorm + RoPE + the KV-cache write. Each replaces a chain of ~8-20 small elementwise
launches with one; the math and its roundings follow the torch references in `layers.norm` and
`layers.attention` (float32 math, one rounding to the activation dtype where the reference
rounds), so results differ from them only in the last bits of the float32 reductions.

Letters: T tokens, H hidden, n/g query/KV heads, D head dim, R rotated dims (R/2 = HALF).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moestream.kernels.mmvq import QBLOCK, Q8Act, empty_q8, store_q8_blocks
from moestream.kernels.pdl import pdl_args, pdl_start


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, q_ptr, d_ptr, s_ptr, stride_x, stride_r, stride_o,
    stride_q, stride_d, H, eps,
    HAS_RES: tl.constexpr, Q8: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_H)
    ok = i < H
    x = tl.load(x_ptr + t * stride_x + i, mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + t * stride_r + i, mask=ok, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the residual, rounded
        tl.store(res_ptr + t * stride_r + i, h, mask=ok)
        h = h.to(tl.float32)
    else:
        h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / H
    w = tl.load(w_ptr + i, mask=ok, other=0.0)
    y = (w * (h * tl.math.rsqrt(var + eps))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_o + i, y, mask=ok)
    if Q8:  # the stored values (zero past H), rounded to q8 as `quantize_q8` would
        b = tl.arange(0, BLOCK_H // 32)
        x8 = tl.reshape(y.to(tl.float32), [BLOCK_H // 32, 8, 4])
        store_q8_blocks(x8, b, H // 32, q_ptr + t * stride_q, d_ptr + t * stride_d,
                        s_ptr + t * stride_d)  # fmt: skip


def _check_norm_args(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
) -> tuple[int, int]:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, H] with unit last stride, got {tuple(x.shape)}")
    t, h = x.shape
    if weight.shape != (h,) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous float32 [{h}], got {weight.dtype}")
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1
    ):
        raise ValueError(f"residual must be [{t}, {h}] {x.dtype} with unit last stride")
    return t, h


def _launch_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    xa: Q8Act | None,
) -> None:
    t, h = x.shape
    if t == 0:
        return
    res = residual if residual is not None else x
    q, d, s = xa if xa is not None else (out, out, out)  # unused pointers without Q8
    block = triton.next_power_of_2(h)
    _add_rms_norm_kernel[(t,)](
        x, res, weight, out, q, d, s, x.stride(0), res.stride(0), out.stride(0),
        q.stride(0), d.stride(0), h, eps,
        HAS_RES=residual is not None, Q8=xa is not None, BLOCK_H=block,
        num_warps=min(8, max(1, block // 256)), **pdl_args(x.device),
    )  # fmt: skip


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of (x + residual) -> [T, H] in x's dtype; contract of `layers.norm.add_rms_norm_ref`.

    x [T, H] (unit last stride); residual [T, H] of x's dtype or None; weight [H] float32. When
    `residual` is given it is updated in place to x + residual (rounded to x's dtype), the value
    the norm is taken of.
    """
    _check_norm_args(x, residual, weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch_norm(x, residual, weight, eps, out, None)
    return out


def add_rms_norm_q8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, Q8Act]:
    """`add_rms_norm`, and its output rounded to q8 blocks in the same launch: (out [T, H],
    Q8Act) with the Q8Act bit for bit `kernels.mmvq.quantize_q8(out)` (H a multiple of 32), for
    the integer-dot matmuls that read `out` next."""
    t, h = _check_norm_args(x, residual, weight)
    if h % QBLOCK:
        raise ValueError(f"q8 blocks need H to be a multiple of {QBLOCK}, got {h}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    xa = empty_q8(t, h, x.device)
    _launch_norm(x, residual, weight, eps, out, xa)
    return out, xa


@triton.jit
def _norm_parts(x1, x2, xr, w_ptr, o1, o2, j, m1, mr, eps, D: tl.constexpr):
    """RMSNorm over a head split in three float32 parts (the two rotated halves and the rest),
    each rounded to the activation dtype (`w_ptr`'s pointee is float32; the caller rounds)."""
    var = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0) + tl.sum(xr * xr, axis=0)) / D
    rstd = tl.math.rsqrt(var + eps)
    y1 = tl.load(w_ptr + o1, mask=m1, other=0.0) * (x1 * rstd)
    y2 = tl.load(w_ptr + o2, mask=m1, other=0.0) * (x2 * rstd)
    yr = tl.load(w_ptr + j, mask=mr, other=0.0) * (xr * rstd)
    return y1, y2, yr


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, slot_ptr, kc_ptr, vc_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    stride_kcs, stride_kch, stride_vcs, stride_vch, eps,
    N_HEADS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, HALF: tl.constexpr,
    HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr, NEOX: tl.constexpr, Q_NORM: tl.constexpr,
    K_NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(PDL)
    # Program (t, h): query head h < N_HEADS (rotated in place), else KV head h - N_HEADS
    # (rotated K and V to the cache slot; none for slot < 0). Branch-free: both kinds of head
    # run the same code under masks.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    is_q = h < N_HEADS
    hq = tl.minimum(h, N_HEADS - 1)
    kh = tl.maximum(h - N_HEADS, 0)
    slot = tl.load(slot_ptr + t)
    is_kv = (h >= N_HEADS) & (slot >= 0)
    dtype = q_ptr.dtype.element_ty
    i = tl.arange(0, HALF_PAD)
    m1 = i < HALF
    if NEOX:
        o1 = i
        o2 = i + HALF
    else:
        o1 = 2 * i
        o2 = 2 * i + 1
    j = 2 * HALF + tl.arange(0, REST_PAD)
    mr = j < D
    # The head-kind masks as bool tensors of each index shape: Triton 3.9's interpreter turns
    # `tensor & scalar` into int32, which it then refuses as a mask.
    is_q_i = (i * 0 + is_q.to(tl.int32)) > 0
    is_q_j = (j * 0 + is_q.to(tl.int32)) > 0
    is_kv_i = (i * 0 + is_kv.to(tl.int32)) > 0
    is_kv_j = (j * 0 + is_kv.to(tl.int32)) > 0
    q_row = q_ptr + t * stride_qt + hq * stride_qh
    k_row = k_ptr + t * stride_kt + kh * stride_kh
    x1 = tl.load(q_row + o1, mask=m1 & is_q_i, other=0.0) + tl.load(
        k_row + o1, mask=m1 & is_kv_i, other=0.0
    )
    x2 = tl.load(q_row + o2, mask=m1 & is_q_i, other=0.0) + tl.load(
        k_row + o2, mask=m1 & is_kv_i, other=0.0
    )
    xr = tl.load(q_row + j, mask=mr & is_q_j, other=0.0) + tl.load(
        k_row + j, mask=mr & is_kv_j, other=0.0
    )
    x1, x2, xr = x1.to(tl.float32), x2.to(tl.float32), xr.to(tl.float32)
    if Q_NORM:  # rounded to the activation dtype, as the reference's separate norm op
        n1, n2, nr = _norm_parts(x1, x2, xr, qw_ptr, o1, o2, j, m1 & is_q_i, mr & is_q_j, eps, D)
        x1 = tl.where(is_q, n1.to(dtype).to(tl.float32), x1)
        x2 = tl.where(is_q, n2.to(dtype).to(tl.float32), x2)
        xr = tl.where(is_q, nr.to(dtype).to(tl.float32), xr)
    if K_NORM:
        n1, n2, nr = _norm_parts(x1, x2, xr, kw_ptr, o1, o2, j, m1 & is_kv_i, mr & is_kv_j, eps, D)
        x1 = tl.where(is_q, x1, n1.to(dtype).to(tl.float32))
        x2 = tl.where(is_q, x2, n2.to(dtype).to(tl.float32))
        xr = tl.where(is_q, xr, nr.to(dtype).to(tl.float32))
    c = tl.load(cos_ptr + t * stride_cos + i, mask=m1, other=0.0)
    s = tl.load(sin_ptr + t * stride_sin + i, mask=m1, other=0.0)
    y1 = (x1 * c - x2 * s).to(dtype)
    y2 = (x2 * c + x1 * s).to(dtype)
    yr = xr.to(dtype)
    tl.store(q_row + o1, y1, mask=m1 & is_q_i)
    tl.store(q_row + o2, y2, mask=m1 & is_q_i)
    tl.store(q_row + j, yr, mask=mr & is_q_j)
    cty = kc_ptr.dtype.element_ty
    k_dst = kc_ptr + tl.maximum(slot, 0) * stride_kcs + kh * stride_kch
    tl.store(k_dst + o1, y1.to(cty), mask=m1 & is_kv_i)
    tl.store(k_dst + o2, y2.to(cty), mask=m1 & is_kv_i)
    tl.store(k_dst + j, yr.to(cty), mask=mr & is_kv_j)
    dd = tl.arange(0, D_PAD)
    v_ok = (dd < D) & ((dd * 0 + is_kv.to(tl.int32)) > 0)
    v = tl.load(v_ptr + t * stride_vt + kh * stride_vh + dd, mask=v_ok, other=0.0)
    v_dst = vc_ptr + tl.maximum(slot, 0) * stride_vcs + kh * stride_vch + dd
    tl.store(v_dst, v.to(vc_ptr.dtype.element_ty), mask=v_ok)


def qk_norm_rope_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    neox: bool,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Per-head RMSNorm (when a weight is given) and RoPE of q [T, n, D] in place, and of k
    [T, g, D] into the cache; v [T, g, D] into the cache. Contract of
    `layers.attention.qk_norm_rope_kv_ref`: cos, sin [T, R/2] float32; q_weight, k_weight [D]
    float32; slot_mapping [T] int64 (a negative slot writes nothing); caches
    [num_blocks, block_size, g, D]. Every tensor has unit stride along its last dimension.
    """
    t, n, d = q.shape
    g = k.shape[1]
    half = cos.shape[-1]
    if k.shape != (t, g, d) or v.shape != (t, g, d):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [{t}, g, {d}]")
    if cos.shape != (t, half) or sin.shape != (t, half) or 2 * half > d:
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not fit [T={t}, R/2] with R <= {d}")
    if k_cache.shape[2:] != (g, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not hold [g={g}, D={d}] heads")
    if slot_mapping.shape != (t,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{t}]")
    for name, x in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_cache", k_cache),
                    ("v_cache", v_cache)):  # fmt: skip
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along its last dimension")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.shape != (d,) or w.dtype != torch.float32):
            raise ValueError(f"{name} must be float32 [{d}]")
    if t == 0:
        return
    kc, vc = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [slots, g, D]
    _qk_norm_rope_kernel[(t, n + g)](
        q, k, v, cos, sin, q_weight if q_weight is not None else cos,
        k_weight if k_weight is not None else cos, slot_mapping, kc, vc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), eps,
        N_HEADS=n, D=d, D_PAD=triton.next_power_of_2(d), HALF=half,
        HALF_PAD=triton.next_power_of_2(max(half, 1)),
        REST_PAD=triton.next_power_of_2(max(d - 2 * half, 1)), NEOX=neox,
        Q_NORM=q_weight is not None, K_NORM=k_weight is not None, num_warps=1,
        **pdl_args(q.device),
    )  # fmt: skip

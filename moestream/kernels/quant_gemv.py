"""Decode-path quantized matmul (small M): y [M, N] = x [M, K] @ dequant(W [N, K]).T.

Each program owns BLOCK_N weight rows and walks their 256-value groups, reading every byte of a
group once (whole rows of GGUF blocks, contiguous runs, so the loads coalesce), dequantizing in
registers and accumulating products elementwise in float32, reduced once at the end (llama.cpp's
mmvq keeps one partial sum per thread likewise). Activations are loaded in the weights' layout
(each thread its own x values, from L1) rather than broadcast through shared memory. UNROLL
groups per loop step keep several loads in flight. When the row blocks alone cannot fill the
GPU, the groups are split over SPLIT_K programs that write float32 partials [SPLIT_K, M, N],
summed afterwards in a fixed order (deterministic, no atomics).

Letters: M activation rows (<= 8), N output features, K input features (a multiple of 256).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moestream.kernels._triton_dequant import (
    MAGIC,
    check_activation,
    dequant_superblock,
    kernel_qtype,
    num_sms,
    plane_k_offsets,
)
from moestream.kernels.mmvq import tree_sum
from moestream.weights.qtensor import QTensor

MAX_M = 8


@triton.jit
def gemv_rows(
    rows,
    x_row,
    g_lo,
    magic,
    GROUPS: tl.constexpr,
    UNROLL: tl.constexpr,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Dot products [BLOCK_N] of weight rows `rows` ([BLOCK_N] uint8 pointers) with one
    activation row (`x_row` points at its first element, unit stride) over groups
    g_lo .. g_lo + GROUPS - 1 (GROUPS a multiple of UNROLL). The products are summed by
    `mmvq.tree_sum` (a fixed order by index): a plain sum's order follows the register layout,
    which the loads' alignment changes (Q6_K's file and padded layouts gave different bits on
    the GPU)."""
    zero = tl.zeros([BLOCK_N, 1, 1], tl.int32)
    k0 = plane_k_offsets(0, QTYPE)[None, :, :] + zero  # [BLOCK_N, NG, G]: x in w's layout
    k1 = plane_k_offsets(1, QTYPE)[None, :, :] + zero
    acc = tl.zeros(k0.shape, tl.float32)
    for i in range(0, GROUPS, UNROLL):
        for u in tl.static_range(UNROLL):
            sb = g_lo + i + u
            w0, w1 = dequant_superblock(rows, sb, magic, QTYPE)  # [BLOCK_N, NG, G] each
            acc = acc + w0 * tl.load(x_row + sb * 256 + k0).to(tl.float32)
            acc = acc + w1 * tl.load(x_row + sb * 256 + k1).to(tl.float32)
    n: tl.constexpr = acc.shape[1] * acc.shape[2]
    return tl.reshape(tree_sum(tl.reshape(acc, [1, BLOCK_N, n]), 1, BLOCK_N, n), [BLOCK_N])


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_os,
    stride_om,
    magic,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    M_BLOCK: tl.constexpr,
    GROUPS_PER_SPLIT: tl.constexpr,
    UNROLL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64) * stride_wn  # [BLOCK_N]
    g_lo = pid_k * GROUPS_PER_SPLIT
    m = tl.arange(0, M_BLOCK)
    if M_BLOCK == 1:
        acc = gemv_rows(rows, x_ptr, g_lo, magic, GROUPS_PER_SPLIT, UNROLL, QTYPE, BLOCK_N)[
            None, :
        ]  # [1, BN]
    else:
        zero = tl.zeros([BLOCK_N, 1, 1], tl.int32)
        k0 = plane_k_offsets(0, QTYPE)[None, :, :] + zero  # [BLOCK_N, NG, G]
        k1 = plane_k_offsets(1, QTYPE)[None, :, :] + zero
        acc = tl.zeros([M_BLOCK, BLOCK_N], tl.float32)
        for i in range(GROUPS_PER_SPLIT):
            sb = g_lo + i
            w0, w1 = dequant_superblock(rows, sb, magic, QTYPE)  # [BLOCK_N, NG, G] each
            for mi in tl.static_range(M_BLOCK):
                xr = x_ptr + mi * stride_xm + sb * 256
                row_ok = (k0 * 0 + mi) < M  # a bool tensor (scalar & tensor is int32 in 3.9)
                x0 = tl.load(xr + k0, mask=row_ok, other=0.0).to(tl.float32)
                x1 = tl.load(xr + k1, mask=row_ok, other=0.0).to(tl.float32)
                part = tl.sum(tl.sum(w0 * x0 + w1 * x1, axis=2), axis=1)  # [BLOCK_N]
                acc += tl.where(m[:, None] == mi, part[None, :], 0.0)
    mask = (m[:, None] < M) & (n[None, :] < N)
    dst = out_ptr + pid_k * stride_os + m[:, None] * stride_om + n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape of `_gemv_kernel`: rows per program, K splits, groups unpacked per loop step
    (must divide the groups of a split) and warps per program."""

    block_n: int = 16
    split_k: int = 1
    unroll: int = 1
    num_warps: int = 4


def gemv_config(m: int, n: int, k: int, sms: int) -> GemvConfig:
    """The largest row block (16 down to 4) that gives two programs per SM, then a split of K
    (a power of two dividing K's groups, at least 2 groups per split) while programs are fewer
    than the SMs; two groups per loop step where the split's group count is even."""
    block_n = 16
    while block_n > 4 and triton.cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    programs = triton.cdiv(n, block_n)
    groups = k // 256
    split_k = 1
    while programs * split_k < sms and groups % (split_k * 2) == 0 and groups // split_k >= 4:
        split_k *= 2
    unroll = 2 if (groups // split_k) % 2 == 0 else 1
    return GemvConfig(block_n, split_k, unroll, 4)


def quant_gemv(
    x: torch.Tensor,
    w: QTensor,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(w [N, K]).T in x's dtype, for M <= 8.

    Same contract as `ops.quant_matmul_ref`. `x` is float32/bfloat16/float16 with unit stride
    along K; `w` a 2-D QTensor of a type in `_triton_dequant.GROUP_BYTES` with K a multiple of
    256. `out`, when given, is an [M, N] tensor of x's dtype with unit stride along N that
    receives the result. `config` overrides the `gemv_config` heuristic.
    """
    check_activation(x, w)
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_M:
        raise ValueError(f"quant_gemv takes at most {MAX_M} rows, got {m}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [{m}, {n}] {x.dtype} with unit last stride")
    cfg = config or gemv_config(m, n, k, num_sms(x.device))
    groups = k // 256
    if groups % cfg.split_k or (groups // cfg.split_k) % cfg.unroll:
        raise ValueError(f"{cfg} does not divide the {groups} groups of K={k}")
    if cfg.split_k == 1:
        dst, stride_os = out, 0
    else:
        dst = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
        stride_os = dst.stride(0)
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    _gemv_kernel[grid](
        x,
        w.data,
        dst,
        m,
        n,
        x.stride(0),
        w.data.stride(0),
        stride_os,
        dst.stride(-2),
        MAGIC,
        QTYPE=kernel_qtype(w),
        BLOCK_N=cfg.block_n,
        M_BLOCK=triton.next_power_of_2(m),
        GROUPS_PER_SPLIT=groups // cfg.split_k,
        UNROLL=cfg.unroll,
        num_warps=cfg.num_warps,
    )
    if cfg.split_k > 1:
        out.copy_(dst.sum(dim=0))  # [M, N], fixed order
    return out

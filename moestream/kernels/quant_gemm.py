"""Prefill-path quantized matmul (large M): y [M, N] = x [M, K] @ dequant(W [N, K]).T.

Each program computes a [BLOCK_M, BLOCK_N] tile. Per 256-value group it dequantizes the
[BLOCK_N, 256] weight tile in registers (two planes, see `_triton_dequant`), casts it to the
activation dtype (bfloat16 on the GPU path) and feeds it with the matching [BLOCK_M, 256]
activation tile (loaded in the plane's k order) to `tl.dot`, accumulating in float32. Programs
along axis 0 share a weight tile, so consecutive programs read it from L2. It serves the types
without the integer kernels (Q2_K, Q3_K, IQ4_XS and the 32-value types but Q8_0) from 2 to 31
rows, with 16-row tiles, a split of K over programs to fill the GPU, and float32 partials summed
afterwards in a fixed order (from 32 rows `dequant_mm` is faster: bench/RESULTS.md), and the
GPUs or dtypes without torch's grouped GEMM for the MoE.

Letters: M activation rows, N output features, K input features (a multiple of 256).
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
    reduce_split_k,
    split_k_target,
)
from moestream.weights.qtensor import QTensor


@triton.jit
def dot_superblock(
    acc,
    x_rows,
    w_rows,
    sb,
    magic,
    QTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """acc [BM, BN] += x[:, group sb] @ dequant(W rows, group sb).T, with `x_rows` [BM] pointers
    to activation rows (unit stride along K) and `w_rows` [BN] uint8 pointers to weight rows.

    The weight is rounded to x's dtype. DOT_F32 widens both operands to float32 before the dot
    (same products, exact in float32): the CPU interpreter cannot multiply bfloat16."""
    w0, w1 = dequant_superblock(w_rows, sb, magic, QTYPE)  # [BN, NG, G] float32
    k0 = plane_k_offsets(0, QTYPE)
    k1 = plane_k_offsets(1, QTYPE)
    x0 = tl.load(x_rows[:, None, None] + sb * 256 + k0[None, :, :])  # [BM, NG, G]
    x1 = tl.load(x_rows[:, None, None] + sb * 256 + k1[None, :, :])
    x0 = tl.reshape(x0, (BLOCK_M, 128))
    x1 = tl.reshape(x1, (BLOCK_M, 128))
    w0 = tl.reshape(w0, (BLOCK_N, 128)).to(x0.dtype)
    w1 = tl.reshape(w1, (BLOCK_N, 128)).to(x0.dtype)
    if DOT_F32:
        x0, x1, w0, w1 = x0.to(tl.float32), x1.to(tl.float32), w0.to(tl.float32), w1.to(tl.float32)
    acc = tl.dot(x0, tl.trans(w0), acc, input_precision=PRECISION)
    acc = tl.dot(x1, tl.trans(w1), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _gemm_kernel(
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
    GROUPS_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = x_ptr + tl.minimum(m, M - 1).to(tl.int64) * stride_xm  # [BLOCK_M]
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64) * stride_wn  # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in range(GROUPS_PER_SPLIT):
        sb = pid_k * GROUPS_PER_SPLIT + i
        acc = dot_superblock(
            acc, x_rows, w_rows, sb, magic, QTYPE, BLOCK_M, BLOCK_N, PRECISION, DOT_F32
        )
    dst = out_ptr + pid_k * stride_os + m[:, None].to(tl.int64) * stride_om + n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))


def dot_precision(dtype: torch.dtype) -> str:
    """float32 activations keep full precision ("ieee", not tf32); 16-bit ones ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class GemmConfig:
    """Launch shape of `_gemm_kernel`: tile, K splits (float32 partials summed afterwards),
    warps and software-pipeline stages."""

    block_m: int = 64
    block_n: int = 64
    split_k: int = 1
    num_warps: int = 8
    num_stages: int = 3


def gemm_config(m: int, n: int, k: int, dtype: torch.dtype, sms: int) -> GemmConfig:
    """Up to 64 x 64 tiles, 8 warps from 32 x 64 up (4 spill registers there: two dequantized
    planes live at once). Float32 activations take at most 32-row tiles and 2 stages (their
    full-precision dots stage float32 operands, which overflow shared memory at 64 x 64 x 3).
    Small M (batched decode) is bandwidth-bound: 16 x 32 tiles (16 x 16 ones cost 1.5-2x the
    instructions per weight) and a split of K (a power of two dividing K's groups, at least 2
    groups per split) until the SMs are busy."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if n >= 64 else 32 if n >= 32 else 16
    stages = 3
    if dtype == torch.float32:
        block_m, stages = min(block_m, 32), 2
    split_k = 1
    if block_m == 16:
        block_n = min(block_n, 32)
        programs = triton.cdiv(m, 16) * triton.cdiv(n, block_n)
        groups = k // 256
        while programs * split_k < sms and groups % (2 * split_k) == 0 and groups // split_k >= 4:
            split_k *= 2
    num_warps = 8 if block_m * block_n >= 32 * 64 else 4
    return GemmConfig(block_m, block_n, split_k, num_warps, stages)


def quant_gemm(
    x: torch.Tensor,
    w: QTensor,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(w [N, K]).T in x's dtype; any M.

    Same contract as `ops.quant_matmul_ref`; the weight is rounded to x's dtype before the
    products (float32 accumulation). `x` float32/bfloat16/float16 with unit stride along K;
    `w` a 2-D QTensor of a type in `_triton_dequant.GROUP_BYTES`, K a multiple of 256. `out`,
    when given, is [M, N] of x's dtype with unit stride along N. `config` (tiles: powers of
    two, at least 16) overrides `gemm_config`.
    """
    check_activation(x, w)
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [{m}, {n}] {x.dtype} with unit last stride")
    cfg = config or gemm_config(m, n, k, x.dtype, num_sms(x.device))
    groups = k // 256
    if groups % cfg.split_k:
        raise ValueError(f"{cfg} does not divide the {groups} groups of K={k}")
    dst, stride_os = split_k_target(out, cfg.split_k)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    _gemm_kernel[grid](
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
        GROUPS_PER_SPLIT=groups // cfg.split_k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        PRECISION=dot_precision(x.dtype),
        DOT_F32=x.device.type != "cuda",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    reduce_split_k(out, dst)
    return out

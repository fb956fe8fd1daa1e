"""Prefill-size matmuls as "dequantize, then a library GEMM": the weight tile goes to bf16 once,
then cuBLAS (dense) or torch's grouped GEMM (`torch._grouped_mm`, CUTLASS on sm_90; the MoE)
does the multiplication on the tensor cores.

Why: with M in the hundreds or thousands, the in-register dequantizing GEMM (`quant_gemm`, the
MoE "gemm" path) spends more instructions unpacking quants than the tensor cores spend on the
products (42 TFLOP/s on an H200 at M=4096, bench/RESULTS.md). Writing the weight out as bf16 and
reading it back costs about 4 bytes per weight over HBM, and the GEMM then runs at the library's
speed (710 TFLOP/s measured at M=4096). Measured on the H200, the dequantizing kernel writes
only ~1.1 TB/s: for a Qwen3-30B-A3B MoE layer (1.2 GB of bf16 experts) that is ~1 ms, half of
the layer at 4,096 tokens and most of it at 512. `cache_values` (`--weight-cache-gib`) keeps
the bf16 copies instead, trading memory for that time. llama.cpp's CUDA backend takes the
dequantize-then-cuBLAS route for large batches of types without its integer tensor-core
kernels.

Numerics: the weight is rounded to x's dtype, then multiplied with float32 accumulation: the
contract of `ops.quant_matmul_ref` and of the other kernel paths.

- `dequantize_rows`: a Triton kernel; one program per (block of rows, block of 256-value
  groups, expert), rows found through an expert -> slot table (the tiers' device table), experts
  without tokens skipped on the device (no host sync). Values are made in k order, 8 consecutive
  ones per thread, so each thread writes 16 bytes at once; the launch shape is fixed per type
  (`DEQUANT_SHAPES`, from bench/dequant_sweep.py), not tuned per process.
- `dequant_matmul`: dense y = x @ W.T, N chunked so the bf16 scratch stays under SCRATCH_BYTES.
- `moe_dequant_grouped`: the MoE FFN for many tokens: assignments grouped by expert
  (`moe.align_assignments`), one grouped GEMM for gate and up together (their weights stacked as
  [E, 2F, H]), SiLU and the product in one launch (`swiglu.silu_mul`), one grouped GEMM for
  down, then the routing-weighted sum over k in a fixed order straight from the grouped rows
  (`moe_combine`: one launch, where gathering the rows, widening them to float32, weighting
  and summing them in torch wrote and re-read ~200 MB a layer at 1,024 tokens). Deterministic
  (no atomics), no host sync: CUDA-graph-capturable.

Letters: M rows, N output features, K input features; T tokens, H hidden, F expert FFN,
E experts, S weight slots, k experts per token, A = T*k assignments.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from moestream.kernels._triton_dequant import (
    GROUP,
    GROUP_BYTES,
    MAGIC,
    check_activation,
    check_weight,
    dequant_superblock,
    kernel_qtype,
    plane_k_offsets,
)
from moestream.kernels._triton_dequant_groups import dequant_groups, group_k_offsets
from moestream.kernels.ops import DEQUANT_SCRATCH_BYTES as SCRATCH_BYTES
from moestream.kernels.swiglu import silu_mul
from moestream.weights.qtensor import QTensor

BLOCK_R = 32  # weight rows per dequantizing program on the CPU (the interpreter); and the
# multiple the dense path's chunks are rounded to
ALIGN_M = 16  # rows per expert group padded to this (TMA-friendly group starts)


@dataclass(frozen=True)
class DequantShape:
    """Launch shape of `_dequant_kernel`: a program writes `block_r` rows x `groups` 256-value
    groups (all their loads in flight at once) with `warps` warps; `stream` marks the stores
    evict-first (`.cs`: the output is read back once, by the GEMM); `planes` selects the older
    per-plane store order (kept as the baseline of bench/dequant_sweep.py)."""

    block_r: int
    groups: int
    warps: int
    stream: bool = False
    planes: bool = False


# Fixed launch shape per (type, K), else per (type, None): the rows of bench/dequant_sweep.py's
# table. A fixed shape replaces per-process autotuning, whose pick depended on the first call's
# timing. H200 (`python bench/dequant_sweep.py --quick`, 2026-11-30, bench/RESULTS.md): Q4_K
# MoE gate/up 147.7 us (3.5 TB/s read + written, 83% of copy; the old kernel 177.6), dense
# [4096, 2048] 9.5 us (36.5); Q6_K head 276.9 us (293.9); Q6_K MoE down (K = 768) fastest in
# the old per-plane order, 295 us (46% of copy). The other types were not swept: the guess
# (64 values per thread; in the sm_90 build, `bench/dequant_sweep.py`'s `build_sm90`, 32-63
# registers for Q5_K, Q8_0, Q2_K, Q3_K and 40-93 for IQ4_XS and the 32-value types, Q5_0/Q5_1
# the most; no spills, no shared memory).
# Groups need not divide a row's (K = 768 has 3): the last block is masked.
T = GGMLQuantizationType
DEQUANT_SHAPES: dict[tuple[GGMLQuantizationType, int | None], DequantShape] = {
    **{
        (qtype, None): DequantShape(block_r=16, groups=2, warps=4, stream=True)
        for qtype in GROUP_BYTES.keys() - {T.Q4_K, T.Q6_K}
    },
    (T.Q4_K, None): DequantShape(block_r=16, groups=2, warps=4),
    (T.Q6_K, None): DequantShape(block_r=16, groups=2, warps=4, stream=True),
    (T.Q6_K, 768): DequantShape(block_r=16, groups=1, warps=4, planes=True),
}
# Byte alignment of the scale words `dequant_groups` reads as int32 (int16: 2, the float16 fields'
# alignment, which every path needs; MXFP4 is read a byte at a time).
WORD_ALIGN = {T.Q4_K: 4, T.Q5_K: 4, T.Q2_K: 4, T.MXFP4: 1}


@triton.jit
def _dequant_kernel(
    w_ptr, slot_ptr, count_ptr, out_ptr, R, K, stride_we, stride_wr, stride_oe, stride_or, magic,
    QTYPE: tl.constexpr, BLOCK_R: tl.constexpr, GROUPS: tl.constexpr, HAS_SLOT: tl.constexpr,
    HAS_COUNT: tl.constexpr, STREAM: tl.constexpr, PLANES: tl.constexpr,
):  # fmt: skip
    # grid (row blocks x group blocks, experts), group blocks fastest: neighbouring programs
    # read neighbouring bytes of a row (the 32-byte sectors that two groups share come from L2)
    pid = tl.program_id(0)
    e = tl.program_id(1)
    src = e
    if HAS_SLOT:  # loaded before the count so that the two loads overlap
        src = tl.load(slot_ptr + e)
    if HAS_COUNT:  # noqa: SIM102 (a constexpr test, then a loaded one)
        if tl.load(count_ptr + e) == 0:  # an expert no token chose: its rows are never read
            return
    groups = K // 256
    blocks_k = tl.cdiv(groups, GROUPS)
    pid_r = pid // blocks_k
    pid_g = pid % blocks_k
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    rc = tl.minimum(r, R - 1).to(tl.int64)
    rows = w_ptr + src.to(tl.int64) * stride_we + rc * stride_wr  # [BR] uint8 pointers
    dst = out_ptr + e.to(tl.int64) * stride_oe + r.to(tl.int64) * stride_or  # [BR]
    ty = out_ptr.dtype.element_ty
    if PLANES:
        k0 = plane_k_offsets(0, QTYPE)[None, :, :]  # [1, NG, G]
        k1 = plane_k_offsets(1, QTYPE)[None, :, :]
        ok = (r < R)[:, None, None]
        for i in range(GROUPS):
            sb = pid_g * GROUPS + i
            if sb < groups:
                w0, w1 = dequant_superblock(rows, sb, magic, QTYPE)  # [BR, NG, G] float32 each
                d = dst[:, None, None] + sb * 256
                _store(d + k0, w0.to(ty), ok, STREAM)
                _store(d + k1, w1.to(ty), ok, STREAM)
    else:
        # the last block of groups may run past the row: its loads repeat the last group and
        # its stores are masked
        sb = pid_g * GROUPS + tl.arange(0, GROUPS)  # [GS]
        values = dequant_groups(rows, tl.minimum(sb, groups - 1), magic, QTYPE)  # [BR, GS, NS, SUB]
        k = sb[:, None, None] * 256 + group_k_offsets(QTYPE)[None, :, :]  # [GS, NS, SUB]
        ok = (r < R)[:, None, None, None] & (sb < groups)[None, :, None, None]
        _store(dst[:, None, None, None] + k[None], values.to(ty), ok, STREAM)


@triton.jit
def _store(ptr, value, mask, STREAM: tl.constexpr):
    if STREAM:
        tl.store(ptr, value, mask=mask, cache_modifier=".cs")
    else:
        tl.store(ptr, value, mask=mask)


def launch_shape(qtype: GGMLQuantizationType, k: int) -> DequantShape:
    """The fixed launch shape of `_dequant_kernel` for rows of k values of `qtype` on CUDA."""
    return DEQUANT_SHAPES.get((qtype, k)) or DEQUANT_SHAPES[(qtype, None)]


def dequantize_rows(
    w: QTensor,
    out: torch.Tensor,
    expert_slot: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    row_start: int = 0,
    shape: DequantShape | None = None,
) -> torch.Tensor:
    """Dequantize into `out` on w's device.

    2-D w [N, K]: out [R, K] receives rows row_start .. row_start + R - 1. 3-D w [S, N, K] (an
    expert stack): out [E, R, K] receives, for expert e, rows row_start .. of slot
    expert_slot[e] (slot e when the table is None); experts with counts[e] == 0 are skipped and
    their rows left as they were. `out` needs unit stride along K; it may be a strided view
    (e.g. half of a stacked [E, 2F, H] buffer). `shape` overrides the launch shape (the fixed
    `launch_shape` on CUDA, one for the interpreter on the CPU); every shape writes the same
    values.
    """
    check_weight(w, len(w.shape))
    k = w.shape[-1]
    data = w.data if len(w.shape) == 3 else w.data[None]  # [S, N, row_bytes]
    out3 = out if out.dim() == 3 else out[None]  # [E, R, K]
    e, r = out3.shape[0], out3.shape[1]
    if out3.shape[2] != k or out3.stride(2) != 1 or row_start + r > w.shape[-2]:
        raise ValueError(f"out {tuple(out.shape)} does not take rows of {w.shape} at {row_start}")
    if r == 0 or e == 0:
        return out
    if shape is None:
        shape = launch_shape(w.qtype, k) if out.is_cuda else _interpreter_shape(k)
    base = data[:, row_start:]
    align = WORD_ALIGN.get(w.qtype, 2)  # k order reads int32 / int16 words (`dequant_groups`)
    if any(v % align for v in (base.data_ptr(), data.stride(0), data.stride(1))):
        shape = replace(shape, planes=True)
    grid = (triton.cdiv(r, shape.block_r) * triton.cdiv(k // GROUP, shape.groups), e)
    _dequant_kernel[grid](
        base, expert_slot if expert_slot is not None else base,
        counts if counts is not None else base, out3,
        r, k, data.stride(0), data.stride(1), out3.stride(0), out3.stride(1), MAGIC,
        QTYPE=kernel_qtype(w), BLOCK_R=shape.block_r, GROUPS=shape.groups,
        HAS_SLOT=expert_slot is not None, HAS_COUNT=counts is not None, STREAM=shape.stream,
        PLANES=shape.planes, num_warps=shape.warps,
    )  # fmt: skip
    return out


def _interpreter_shape(k: int) -> DequantShape:
    """Few, large programs: the interpreter's cost is per program, not per value."""
    return DequantShape(BLOCK_R, 2, 4)


def cache_values(w: QTensor, dtype: torch.dtype) -> int:
    """Keep a copy of w's values in `dtype` on w's device (`QTensor.values`): the dense and MoE
    products of this module then skip dequantizing. Returns the bytes it takes."""
    check_weight(w, len(w.shape))
    values = torch.empty(w.shape, dtype=dtype, device=w.device)
    dequantize_rows(w, values)
    w.values = values
    return values.numel() * values.element_size()


def dequant_matmul(x: torch.Tensor, w: QTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(w [N, K]).T in x's dtype (contract of `quant_gemm`): the
    weight dequantized to x's dtype in chunks of rows under SCRATCH_BYTES (or its cached values,
    `cache_values`), each chunk multiplied by torch (cuBLAS on CUDA)."""
    check_activation(x, w)
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if (values := w.values_in(x.dtype)) is not None:
        return torch.mm(x, values.t(), out=out)
    rows = max(BLOCK_R, SCRATCH_BYTES // (k * x.element_size()) // BLOCK_R * BLOCK_R)
    scratch = torch.empty((min(rows, n), k), dtype=x.dtype, device=x.device)
    for n0 in range(0, n, rows):
        wd = dequantize_rows(w, scratch[: min(rows, n - n0)], row_start=n0)  # [R, K]
        if n0 == 0 and wd.shape[0] == n:
            torch.mm(x, wd.t(), out=out)
        else:
            out[:, n0 : n0 + wd.shape[0]] = x @ wd.t()
    return out


def grouped_mm_available(device: torch.device) -> bool:
    """torch's grouped GEMM with device-side group offsets: CPU, or CUDA sm_90 and up (where it
    runs CUTLASS; older GPUs fall back to a loop with a host sync)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (9, 0)
    return device.type == "cpu"


@triton.jit
def _moe_combine_kernel(y_ptr, row_ptr, w_ptr, out_ptr, H, stride_y, stride_o,
                        TOPK: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    """Program (token t, BLOCK_H columns): out[t] = sum_j w[t, j] * y[row[t k + j]] in float32,
    j = 0 .. k-1 in order (a token's bits depend on its own rows only)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOPK):
        r = tl.load(row_ptr + t * TOPK + j).to(tl.int64)
        w = tl.load(w_ptr + t * TOPK + j).to(tl.float32)
        acc += w * tl.load(y_ptr + r * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _moe_gather_kernel(x_ptr, ids_ptr, out_ptr, A, H, stride_x, stride_o,
                       TOPK: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    """Program (grouped row r, BLOCK_H columns): out[r] = x[ids[r] // k], zeros where
    ids[r] >= A (a padding row)."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    # The id broadcast to a vector: Triton 3.9's interpreter rejects a scalar term in a mask.
    a = tl.load(ids_ptr + r).to(tl.int64) + tl.zeros([BLOCK_H], tl.int64)
    row = tl.load(x_ptr + (a // TOPK) * stride_x + cols, mask=ok & (a < A), other=0.0)
    tl.store(out_ptr + r * stride_o + cols, row, mask=ok)


def moe_gather(x: torch.Tensor, sorted_ids: torch.Tensor, top_k: int) -> torch.Tensor:
    """[R, H]: row r the token of grouped assignment sorted_ids[r] (x's row sorted_ids[r] // k),
    zeros for padding entries (ids >= T * k), in one launch."""
    t, h = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((sorted_ids.shape[0], h), dtype=x.dtype, device=x.device)
    if out.shape[0] and h:
        block_h = min(1024, triton.next_power_of_2(h))
        _moe_gather_kernel[(out.shape[0], triton.cdiv(h, block_h))](
            x, sorted_ids, out, t * top_k, h, x.stride(0), out.stride(0),
            TOPK=top_k, BLOCK_H=block_h, num_warps=4,
        )  # fmt: skip
    return out


def moe_combine(
    y: torch.Tensor, rows: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """out [T, H] = sum_j topk_weights[t, j] * y[rows[t * k + j]] (y [R, H], unit last stride;
    rows [T * k] int; topk_weights [T, k]), float32 sums over j in order, one launch."""
    t, k = topk_weights.shape
    h = y.shape[1]
    if rows.shape != (t * k,) or out.shape != (t, h) or y.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(
            f"moe_combine: y {tuple(y.shape)}, rows {tuple(rows.shape)}, weights [{t}, {k}], "
            f"out {tuple(out.shape)}"
        )
    if t:
        block_h = min(1024, triton.next_power_of_2(h))
        _moe_combine_kernel[(t, triton.cdiv(h, block_h))](
            y, rows.contiguous(), topk_weights.contiguous(), out, h, y.stride(0), out.stride(0),
            TOPK=k, BLOCK_H=block_h, num_warps=4,
        )  # fmt: skip
    return out


def moe_dequant_grouped(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate: QTensor,
    up: QTensor,
    down: QTensor,
    expert_slot: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE FFN (contract of `ops.moe_forward_ref`) for many tokens: -> [T, H] in x's dtype.

    gate, up [S, F, H], down [S, H, F]; expert_slot [E] int32 on x's device; x bfloat16 on CUDA
    (any float dtype on the CPU). Peak scratch: E * 3 * F * H values of x's dtype (the routed
    experts' weights) plus a few [A, H] activations; none for the weights when all three stacks
    have cached values in x's dtype (`cache_values`), whose slots are then read directly.
    """
    from moestream.kernels.moe import align_assignments

    t, h = x.shape
    k = topk_ids.shape[1]
    f = gate.shape[1]
    e = expert_slot.shape[0]
    a = t * k
    if out is None:
        out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    values = [w.values_in(x.dtype) for w in (gate, up, down)]
    from_cache = all(v is not None for v in values)
    if from_cache:
        # Cached slot stacks: group the pairs by slot instead of expert (any slot table works).
        ids = expert_slot[topk_ids.long()]  # [T, k] slots
        groups = gate.shape[0]
    else:
        ids, groups = topk_ids, e
    flat = ids.reshape(-1).long()  # [A]
    counts = torch.zeros(groups, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # [groups], no sync
    sorted_ids, _ = align_assignments(ids, groups, ALIGN_M, counts)  # [R]
    xs = moe_gather(x, sorted_ids, k)  # [R, H], padding rows zero
    blocks = (counts + ALIGN_M - 1) // ALIGN_M
    offs = (torch.cumsum(blocks, 0) * ALIGN_M).to(torch.int32)  # [groups] end row of each
    if from_cache:
        g = torch._grouped_mm(xs, values[0].transpose(1, 2), offs=offs)  # [R, F]
        u = torch._grouped_mm(xs, values[1].transpose(1, 2), offs=offs)
        hidden = F.silu(g) * u  # [R, F] in x's dtype, as `layers.mlp.gated_mlp`
        w_d = values[2]  # [S, H, F]
    else:
        w_gu = torch.empty((e, 2 * f, h), dtype=x.dtype, device=x.device)  # gate, then up rows
        dequantize_rows(gate, w_gu[:, :f], expert_slot, counts)
        dequantize_rows(up, w_gu[:, f:], expert_slot, counts)
        w_d = torch.empty((e, h, f), dtype=x.dtype, device=x.device)
        dequantize_rows(down, w_d, expert_slot, counts)
        gu = torch._grouped_mm(xs, w_gu.transpose(1, 2), offs=offs)  # [R, 2F]
        hidden, _ = silu_mul(gu)  # [R, F] in x's dtype
    y = torch._grouped_mm(hidden, w_d.transpose(1, 2), offs=offs)  # [R, H]
    # row of each assignment in the grouped order, then the weighted sum over k in order
    row_of = torch.empty(a + 1, dtype=torch.long, device=x.device)
    row_of.scatter_(0, sorted_ids.long(), torch.arange(sorted_ids.numel(), device=x.device))
    return moe_combine(y, row_of[:a], topk_weights, out)

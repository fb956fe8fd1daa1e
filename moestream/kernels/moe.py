"""Fused MoE FFN over stacked quantized experts: one launch per stage for all experts of a layer.
This file holds the dispatcher `fused_moe` (and `default_method`, which picks its path), the
float "gemv" and "gemm" paths' kernels, `align_assignments` and `check_moe_args`; the other
paths live in `moe_mmvq`, `moe_grouped`, `moe_mmq` and `dequant_mm`.

out[t] = sum_j w[t, j] * down_s(silu(gate_s x[t]) * up_s x[t]),  s = expert_slot[topk_ids[t, j]]

Expert weights are found through the device-side `expert_slot` table, so no host round trip is
needed when the experts are in place. Six paths (`default_method` picks by A, types, device):
- decode, integer dots ("mmvq", below GROUPED_MIN_ASSIGNMENTS by default and at most
  MMVQ_MAX_ASSIGNMENTS, Q4_K/Q5_K/Q6_K/Q8_0; `kernels.moe_mmvq`): x rounded to q8 blocks, then
  gate/up per (assignment, 32 F rows, K split) with SiLU and h's q8 rounding fused, then down
  per (token, block of H rows) over the token's k experts: three launches, a token's bits
  independent of the batch. Launch variants in `moe_mmvq.MoeMmvqConfig`.
- batched decode, integer dots over tokens grouped by expert ("grouped", GROUPED_MIN_ASSIGNMENTS
  to GROUPED_MAX_ASSIGNMENTS, same types; `kernels.moe_grouped`): each expert's weights read
  once per block of 2-4 of its assignments, each weight word dotted with the block's rows.
- batched decode, int8 tensor cores ("mmq", up to MMQ_MAX_ASSIGNMENTS, same types;
  `kernels.moe_mmq`): assignments grouped by expert, weights unpacked to int8 and
  multiplied with q8 activations by `tl.dot` per sub-block of 32, block scales in float32.
- large batches and prefill with bf16 activations on sm_90 ("dequant", `kernels.dequant_mm`):
  the routed experts dequantized to bf16, torch's grouped GEMM for gate+up and for down.
- decode, float ("gemv", T*k <= GEMV_MAX_ASSIGNMENTS, other types): GEMV-style, two launches.
  Stage 1 runs one program per (assignment, block of F rows) for gate and up together, SiLU
  fused, h [T*k, F] float32;
  stage 2 one program per (token, block of H rows) that walks the token's k experts in selection
  order and writes the routing-weighted sum straight into out [T, H].
- other prefill cases ("gemm", two launches): tokens grouped by expert (`align_assignments`,
  device-side torch ops, no sync) into blocks of BLOCK_M assignments of one expert; stage 1 is
  a grouped GEMM with gate and up dequantized per tile and `tl.dot`, SiLU fused, h [T*k, F] in
  x's dtype; stage 2 a grouped GEMM whose rows are scaled by their routing weight into
  y [T*k, H] float32, summed
  over k in a fixed order afterwards (deterministic, no atomics).

Letters: T tokens, H hidden, F expert FFN, E experts, S weight slots, k experts per token,
A = T*k assignments.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from moestream.kernels import moe_mmvq
from moestream.kernels._triton_dequant import ACTIVATION_DTYPES, MAGIC, check_weight, kernel_qtype
from moestream.kernels.mmvq import MMVQ_DENSE_QTYPES, MMVQ_QTYPES, Q8Act
from moestream.kernels.moe_align import max_blocks
from moestream.kernels.moe_mmvq import MoeMmvqConfig, fused_moe_mmvq
from moestream.kernels.quant_gemm import dot_precision, dot_superblock
from moestream.kernels.quant_gemv import gemv_rows
from moestream.weights.qtensor import QTensor

GEMV_MAX_ASSIGNMENTS = 64  # the float GEMV path's limit
# The integer-dot path's limit. H200, Qwen3-30B-A3B layer (bench/kernels_gpu.py, bench/RESULTS.md):
# mmvq 34.6 us at T=1 and 179 us at T=8 (A=64); the grouped GEMM 787 us at T=16 and 1,012 us at
# T=32. mmvq was not timed above A=64; its time is expected to grow at most linearly in A
# (each assignment reads its expert once; distinct experts grow slower), which would keep it
# under 4 x 179 = 716 us up to A=256, below the GEMM. To confirm on a GPU.
MMVQ_MAX_ASSIGNMENTS = 256
# The default path by assignments A, for MMVQ_QTYPES. H200, Qwen3-30B-A3B layer, Q4_K/Q6_K
# (bench/mmq_gpu.py, bench/kernels_gpu.py): mmvq / mmq / dequantize + grouped GEMM at T=8
# 172 / 251 / - us, T=16 316 / 333 / -, T=32 597 / 459 / 990, T=64 1145 / 517 / 1088,
# T=512 - / - / 1213. mmq was not timed above T=64: its limit of A=1024 (T=128) is an estimate
# (it grew 459 -> 517 us from T=32 to 64, with every expert already read). Since the grouped
# path (below) took 64-512 pairs, MMVQ_DEFAULT_MAX_ASSIGNMENTS bounds mmvq only where that range
# is set empty; it is still where cached bf16 copies take over (`default_method`).
MMVQ_DEFAULT_MAX_ASSIGNMENTS = 128
MMQ_MAX_ASSIGNMENTS = 1024
# The "grouped" path's range of A (`moe_grouped`: each expert's weights read once per block of
# its assignments, integer dots). H200, Qwen3-30B-A3B layer, Q4_K/Q6_K (`python
# bench/kernels_gpu.py --sweep-moe-grouped` and `--sweep-moe-grouped-small`, 2026-11-30),
# grouped / mmvq us: T = 4 61.0 / 62.9, T = 8 101.3 / 111.7, T = 12 131.6 / 159.9, T = 16
# 154.7 / 202.8, T = 32 246.6 / 378.6 (mmq 377.8), T = 64 366.4 / 717.9 (mmq 422.2). mmvq keeps
# T <= 7 (even at T = 4; one program per pair, no grouping launch), mmq T > 64 (not timed there).
GROUPED_MIN_ASSIGNMENTS = 64
GROUPED_MAX_ASSIGNMENTS = 512
# The "dequant" path writes every routed expert of the layer as bf16 at once (1.2 GB for
# Qwen3-30B-A3B); a layer whose copies would exceed this takes the grouped Triton GEMM instead.
DEQUANT_MAX_SCRATCH_BYTES = 4 << 30


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr, ids_ptr, slot_ptr, g_ptr, u_ptr, h_ptr,
    F, stride_xt, stride_ge, stride_gn, stride_ue, stride_un, magic,
    QG: tl.constexpr, QU: tl.constexpr, H_GROUPS: tl.constexpr, TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    a = tl.program_id(0)  # assignment t * TOPK + j
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, F - 1).to(tl.int64)
    slot = tl.load(slot_ptr + tl.load(ids_ptr + a)).to(tl.int64)
    g_rows = g_ptr + slot * stride_ge + nc * stride_gn  # [BLOCK_N]
    u_rows = u_ptr + slot * stride_ue + nc * stride_un
    x_row = x_ptr + (a // TOPK).to(tl.int64) * stride_xt
    g = gemv_rows(g_rows, x_row, 0, magic, H_GROUPS, UNROLL, QG, BLOCK_N)  # [BLOCK_N]
    u = gemv_rows(u_rows, x_row, 0, magic, H_GROUPS, UNROLL, QU, BLOCK_N)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + a.to(tl.int64) * F + n, h.to(h_ptr.dtype.element_ty), mask=n < F)


@triton.jit
def _down_gemv_kernel(
    h_ptr, ids_ptr, weights_ptr, slot_ptr, d_ptr, out_ptr,
    H, stride_de, stride_dn, stride_ot, magic,
    QD: tl.constexpr, F_GROUPS: tl.constexpr, TOPK: tl.constexpr, BLOCK_N: tl.constexpr,
    UNROLL: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, H - 1).to(tl.int64)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for j in range(TOPK):
        a = t * TOPK + j
        slot = tl.load(slot_ptr + tl.load(ids_ptr + a)).to(tl.int64)
        weight = tl.load(weights_ptr + a).to(tl.float32)
        rows = d_ptr + slot * stride_de + nc * stride_dn
        h_row = h_ptr + a.to(tl.int64) * (F_GROUPS * 256)
        acc += weight * gemv_rows(rows, h_row, 0, magic, F_GROUPS, UNROLL, QD, BLOCK_N)
    dst = out_ptr + t.to(tl.int64) * stride_ot + n
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=n < H)


@triton.jit
def _gate_up_gemm_kernel(
    x_ptr, sorted_ptr, block_expert_ptr, slot_ptr, g_ptr, u_ptr, h_ptr,
    A, E, F, stride_xt, stride_ge, stride_gn, stride_ue, stride_un, magic,
    QG: tl.constexpr, QU: tl.constexpr, H_GROUPS: tl.constexpr, TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    pid_b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_b)
    if expert >= E:  # a spare block past the last expert's
        return
    slot = tl.load(slot_ptr + expert).to(tl.int64)
    assign = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    valid = assign < A
    token = tl.where(valid, assign // TOPK, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, F - 1).to(tl.int64)
    x_rows = x_ptr + token * stride_xt  # [BLOCK_M]
    g_rows = g_ptr + slot * stride_ge + nc * stride_gn  # [BLOCK_N]
    u_rows = u_ptr + slot * stride_ue + nc * stride_un
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for sb in range(H_GROUPS):
        acc_g = dot_superblock(
            acc_g, x_rows, g_rows, sb, magic, QG, BLOCK_M, BLOCK_N, PRECISION, DOT_F32
        )
        acc_u = dot_superblock(
            acc_u, x_rows, u_rows, sb, magic, QU, BLOCK_M, BLOCK_N, PRECISION, DOT_F32
        )
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    dst = h_ptr + assign[:, None].to(tl.int64) * F + n[None, :]
    tl.store(dst, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & (n[None, :] < F))


@triton.jit
def _down_gemm_kernel(
    h_ptr, sorted_ptr, block_expert_ptr, slot_ptr, d_ptr, weights_ptr, y_ptr,
    A, E, H, stride_de, stride_dn, magic,
    QD: tl.constexpr, F_GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    pid_b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_b)
    if expert >= E:
        return
    slot = tl.load(slot_ptr + expert).to(tl.int64)
    assign = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    valid = assign < A
    ac = tl.where(valid, assign, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, H - 1).to(tl.int64)
    h_rows = h_ptr + ac * (F_GROUPS * 256)  # [BLOCK_M]
    d_rows = d_ptr + slot * stride_de + nc * stride_dn  # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for sb in range(F_GROUPS):
        acc = dot_superblock(
            acc, h_rows, d_rows, sb, magic, QD, BLOCK_M, BLOCK_N, PRECISION, DOT_F32
        )
    weight = tl.load(weights_ptr + ac).to(tl.float32)  # [BLOCK_M]
    dst = y_ptr + ac[:, None] * H + n[None, :]
    tl.store(dst, acc * weight[:, None], mask=valid[:, None] & (n[None, :] < H))


def default_method(
    a: int,
    gate: QTensor,
    up: QTensor,
    down: QTensor,
    x: torch.Tensor | None = None,
    num_experts: int | None = None,
) -> str:
    """The path for A assignments: where all three types are MMVQ_QTYPES, integer-dot "grouped"
    from GROUPED_MIN_ASSIGNMENTS to GROUPED_MAX_ASSIGNMENTS, "mmvq" below it (up to
    MMVQ_DEFAULT_MAX_ASSIGNMENTS) and int8 tensor-core "mmq" up to MMQ_MAX_ASSIGNMENTS; where
    they are MMVQ_DENSE_QTYPES with a 4-bit code type among them, "grouped" up to
    GROUPED_MAX_ASSIGNMENTS; else the float "gemv" up to GEMV_MAX_ASSIGNMENTS; above, "dequant"
    (bf16 weights and torch's grouped GEMM) where `dequant_mm.grouped_mm_available` for x
    (bfloat16 on CUDA) and the layer's bf16 copies (`num_experts` experts, default the stacks'
    slots) fit DEQUANT_MAX_SCRATCH_BYTES, else the grouped Triton GEMM. With cached bf16 copies
    of all three stacks (`--weight-cache-gib`), "dequant" from MMVQ_DEFAULT_MAX_ASSIGNMENTS + 1
    on (no dequantizing left: the grouped GEMM reads the copies). Depends on (A, types, device,
    dtype, caches) only, never on the routing (row results stay independent of other tokens'
    experts).
    """
    if (
        a > MMVQ_DEFAULT_MAX_ASSIGNMENTS
        and x is not None
        and _dequant_ok(x)
        and all(w.values_in(x.dtype) is not None for w in (gate, up, down))
    ):
        return "dequant"
    if all(w.qtype in MMVQ_QTYPES for w in (gate, up, down)):
        if GROUPED_MIN_ASSIGNMENTS <= a <= GROUPED_MAX_ASSIGNMENTS:
            return "grouped"
        if a <= MMVQ_DEFAULT_MAX_ASSIGNMENTS:
            return "mmvq"
        if a <= MMQ_MAX_ASSIGNMENTS:
            return "mmq"
    elif a <= GROUPED_MAX_ASSIGNMENTS and all(
        w.qtype in MMVQ_DENSE_QTYPES for w in (gate, up, down)
    ):
        return "grouped"  # a 4-bit code type among them: no mmvq or mmq MoE kernel reads those
    if a <= GEMV_MAX_ASSIGNMENTS:
        return "gemv"
    if x is not None and _dequant_ok(x):
        experts = num_experts if num_experts is not None else gate.shape[0]
        if (
            experts * 3 * gate.shape[1] * gate.shape[2] * x.element_size()
            <= DEQUANT_MAX_SCRATCH_BYTES
        ):
            return "dequant"  # every routed expert's bf16 copy at once: small enough
    return "gemm"


def _dequant_ok(x: torch.Tensor) -> bool:
    from moestream.kernels.dequant_mm import grouped_mm_available

    return grouped_mm_available(x.device) and (x.dtype == torch.bfloat16 or not x.is_cuda)


def unroll_for(groups: int) -> int:
    """Groups per loop step of the GEMV kernels: the largest of 4, 3, 2, 1 that divides."""
    return next(u for u in (4, 3, 2, 1) if groups % u == 0)


def moe_gemm_config(
    assignments_per_expert: float, dtype: torch.dtype
) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, gate/up BLOCK_N, down BLOCK_N, num_warps, num_stages) of the grouped GEMMs.

    BLOCK_M follows the mean rows per expert (16, 32, 64); gate/up holds two accumulators and
    two dequantized tiles, so it takes 32-wide tiles from BLOCK_M 32 up (no register spills at
    8 warps); float32 activations take at most 32 rows and 2 stages (shared memory).
    """
    per = assignments_per_expert
    block_m = 16 if per <= 16 else 32 if per <= 32 else 64
    stages = 3
    if dtype == torch.float32:
        block_m, stages = min(block_m, 32), 2
    gu_block_n = 64 if block_m == 16 else 32
    return block_m, gu_block_n, 64, 8, stages


def align_assignments(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the A = T*k assignments by expert into blocks of `block_m` rows, on the device.

    Returns (sorted_ids [num_blocks * block_m] int32: assignment ids, expert by expert in
    ascending order, each expert's run padded to whole blocks with the sentinel A;
    block_expert [num_blocks] int32: the expert of each block, `num_experts` for spare blocks
    past the end). num_blocks = `moe_align.max_blocks(A, E, block_m)` bounds the blocks needed,
    so the shapes depend on (A, E, block_m) only and no count comes back to the host. `counts` [E],
    when the caller has them, are the assignments per expert (not counted again).
    """
    a = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [A]
    order = torch.argsort(flat, stable=True)  # [A] assignments grouped by expert
    if counts is None:
        counts = torch.zeros(num_experts, dtype=torch.long, device=device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E] (bincount would sync on CUDA)
    counts = counts.long()
    blocks = (counts + block_m - 1) // block_m  # [E]
    block_end = torch.cumsum(blocks, 0)  # [E]
    num_blocks = max_blocks(a, num_experts, block_m)
    block_expert = torch.searchsorted(
        block_end, torch.arange(num_blocks, device=device), right=True
    )  # [num_blocks], E past the end
    expert_of = flat[order]  # [A]
    first_assign = torch.cumsum(counts, 0) - counts  # [E] position of expert e's run in `order`
    first_row = (block_end - blocks) * block_m  # [E] padded row where expert e's run starts
    rank = torch.arange(a, device=device) - first_assign[expert_of]
    sorted_ids = torch.full((num_blocks * block_m,), a, dtype=torch.int32, device=device)
    sorted_ids[first_row[expert_of] + rank] = order.to(torch.int32)
    return sorted_ids, block_expert.to(torch.int32)


def check_moe_args(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate: QTensor,
    up: QTensor,
    down: QTensor,
    expert_slot: torch.Tensor | None,
) -> None:
    """Shapes, strides, dtypes and devices the fused kernels need (ValueError otherwise);
    `expert_slot` None (experts found by address) is not checked."""
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be [T, H] float with unit last stride, got {x.dtype} {x.shape}")
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        check_weight(w, 3, name)
        if w.device != x.device:
            raise ValueError(f"{name} on {w.device}, x on {x.device}")
    t, h = x.shape
    s, f = gate.shape[0], gate.shape[1]
    if gate.shape != (s, f, h) or up.shape != (s, f, h) or down.shape != (s, h, f):
        raise ValueError(f"expert shapes {gate.shape} {up.shape} {down.shape} do not fit H={h}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be a contiguous [T={t}, k], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_contiguous():
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} != topk_ids' shape")
    if not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    for name, t_ in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t_.device != x.device:
            raise ValueError(f"{name} on {t_.device}, x on {x.device}")
    if expert_slot is None:
        return
    if expert_slot.dim() != 1 or expert_slot.dtype != torch.int32 or expert_slot.stride(0) != 1:
        raise ValueError(f"expert_slot must be a contiguous int32 [E], got {expert_slot.dtype}")
    if expert_slot.device != x.device:
        raise ValueError(f"expert_slot on {expert_slot.device}, x on {x.device}")


def fused_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate: QTensor,
    up: QTensor,
    down: QTensor,
    expert_slot: torch.Tensor | None,
    out: torch.Tensor | None = None,
    method: str | None = None,
    block_n: int | None = None,
    mmvq_cfg: MoeMmvqConfig | None = None,
    expert_addr: torch.Tensor | None = None,
    xa: Q8Act | None = None,
    counters: torch.Tensor | None = None,
    host_rows: torch.Tensor | moe_mmvq.HostWork | None = None,
) -> torch.Tensor:
    """The Triton MoE FFN: same contract as `ops.moe_forward_ref`, -> [T, H] in x's dtype.

    gate, up: QTensor [S, F, H]; down [S, H, F] (H and F multiples of 256, kernel types);
    expert_slot [E] int32 maps every expert that `topk_ids` names to a slot in [0, S) (not
    checked on the device: a bad slot reads out of bounds). `out`, when given, is a [T, H]
    tensor of x's dtype with unit last stride. `method` ("mmvq", "mmq", "grouped", "gemv",
    "gemm" or "dequant") and `block_n`
    (a power of two; at least 16 for "gemm") override the heuristics (`default_method`).

    `expert_addr` [3, E] int64 (contiguous, on x's device), when given, replaces the stacks'
    slots: row e holds the byte addresses of expert e's gate, up and down weights (each laid
    out as one slot of `gate`/`up`/`down`, which then only give types, shapes and row strides),
    in device memory or in pinned host memory the GPU reads directly (mapped under unified
    addressing), each 16-byte aligned (not checked here: that would need a sync). It needs the
    "mmvq" path, and `expert_slot` may be None (it is not read).

    "mmvq" only: `mmvq_cfg` its launch shape (default `moe_mmvq.tuned_config`: DEFAULT_CONFIG
    unless `moestream tune` cached another); "mmvq" and "grouped": `xa` x's q8 blocks when the
    caller already has them (`mmvq.quantize_q8(x)`; x then gives only shapes, dtype and device);
    "mmvq": `counters` the zero arrival counters of a gate/up split (`moe_mmvq.mmvq_counters`,
    left zero; a fresh buffer per call when None), `host_rows` the experts the host computes
    (`moe_mmvq.fused_moe_mmvq`; their `expert_slot` entries negative).
    """
    check_moe_args(x, topk_ids, topk_weights, gate, up, down, expert_slot)
    if expert_slot is None and expert_addr is None:
        raise ValueError("fused_moe needs expert_slot or expert_addr")
    if expert_addr is not None and (
        expert_addr.dtype != torch.int64
        or expert_addr.dim() != 2
        or expert_addr.shape[0] != 3
        or not expert_addr.is_contiguous()
        or expert_addr.device != x.device
    ):
        raise ValueError("expert_addr must be a contiguous int64 [3, E] on x's device")
    t, h = x.shape
    k = topk_ids.shape[1]
    f = gate.shape[1]
    a = t * k
    if out is None:
        out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    elif out.shape != (t, h) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [{t}, {h}] {x.dtype} with unit last stride")
    if t == 0:
        return out
    if method is None:
        experts = expert_slot.shape[0] if expert_slot is not None else None
        method = default_method(a, gate, up, down, x, experts)
    if method == "mmvq":
        cfg = mmvq_cfg or moe_mmvq.tuned_config(x.device, gate, up, down, t, k)
        if block_n:
            cfg = replace(cfg, down_block_n=block_n)
        return fused_moe_mmvq(
            x, xa, topk_ids, topk_weights, gate, up, down, expert_slot, expert_addr, out, cfg,
            counters, host_rows,
        )  # fmt: skip
    if host_rows is not None:
        raise ValueError("host_rows need the mmvq path (at most 256 assignments)")
    if expert_addr is not None:
        raise ValueError("expert_addr needs the mmvq path (at most 256 assignments)")
    strides = (gate.data.stride(0), gate.data.stride(1), up.data.stride(0), up.data.stride(1))
    if method == "gemv":
        block_n = block_n or 16
        hidden = torch.empty((a, f), dtype=torch.float32, device=x.device)  # [A, F]
        _gate_up_gemv_kernel[(a, triton.cdiv(f, block_n))](
            x, topk_ids, expert_slot, gate.data, up.data, hidden,
            f, x.stride(0), *strides, MAGIC,
            QG=kernel_qtype(gate), QU=kernel_qtype(up), H_GROUPS=h // 256, TOPK=k, BLOCK_N=block_n,
            UNROLL=unroll_for(h // 256), num_warps=4,
        )  # fmt: skip
        _down_gemv_kernel[(t, triton.cdiv(h, block_n))](
            hidden, topk_ids, topk_weights, expert_slot, down.data, out,
            h, down.data.stride(0), down.data.stride(1), out.stride(0), MAGIC,
            QD=kernel_qtype(down), F_GROUPS=f // 256, TOPK=k, BLOCK_N=block_n,
            UNROLL=unroll_for(f // 256), num_warps=4,
        )  # fmt: skip
        return out
    if method == "mmq":
        from moestream.kernels.moe_mmq import moe_mmq

        return moe_mmq(x, topk_ids, topk_weights, gate, up, down, expert_slot, out=out)
    if method == "grouped":
        from moestream.kernels.moe_grouped import moe_grouped

        return moe_grouped(x, topk_ids, topk_weights, gate, up, down, expert_slot, out, xa=xa)
    if method == "dequant":
        from moestream.kernels.dequant_mm import moe_dequant_grouped

        if not _dequant_ok(x):
            raise ValueError(f"dequant: no grouped GEMM for {x.dtype} on {x.device}")
        return moe_dequant_grouped(x, topk_ids, topk_weights, gate, up, down, expert_slot, out)
    if method != "gemm":
        raise ValueError(
            f"method must be mmvq, mmq, grouped, gemv, gemm or dequant, got {method!r}"
        )
    num_experts = expert_slot.shape[0]
    block_m, gu_block_n, down_block_n, num_warps, num_stages = moe_gemm_config(
        a / num_experts, x.dtype
    )
    gu_block_n = block_n or gu_block_n
    down_block_n = block_n or down_block_n
    sorted_ids, block_expert = align_assignments(topk_ids, num_experts, block_m)
    num_blocks = block_expert.shape[0]
    precision = dot_precision(x.dtype)
    dot_f32 = x.device.type != "cuda"
    hidden = torch.empty((a, f), dtype=x.dtype, device=x.device)  # [A, F]
    _gate_up_gemm_kernel[(num_blocks, triton.cdiv(f, gu_block_n))](
        x, sorted_ids, block_expert, expert_slot, gate.data, up.data, hidden,
        a, num_experts, f, x.stride(0), *strides, MAGIC,
        QG=kernel_qtype(gate), QU=kernel_qtype(up), H_GROUPS=h // 256, TOPK=k,
        BLOCK_M=block_m, BLOCK_N=gu_block_n, PRECISION=precision, DOT_F32=dot_f32,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    y = torch.empty((a, h), dtype=torch.float32, device=x.device)  # [A, H]
    _down_gemm_kernel[(num_blocks, triton.cdiv(h, down_block_n))](
        hidden, sorted_ids, block_expert, expert_slot, down.data, topk_weights, y,
        a, num_experts, h, down.data.stride(0), down.data.stride(1), MAGIC,
        QD=kernel_qtype(down), F_GROUPS=f // 256, BLOCK_M=block_m, BLOCK_N=down_block_n,
        PRECISION=precision, DOT_F32=dot_f32, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    out.copy_(y.view(t, k, h).sum(dim=1))  # [T, H], j in order
    return out

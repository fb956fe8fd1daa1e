"""The fused MoE FFN on the int8 tensor cores (the "mmq" path of `moe.fused_moe`): token-expert
pairs grouped by expert (`moe_align.align_blocks`, on the device), blocks of BLOCK_M pairs of one
expert per program, so an expert's weights are read once per block instead of once per pair;
each block's gate/up and down are `mmq.mmq_tile`s (int8 `tl.dot` per block of 32 values, scales
in float32). Numerics are the "mmvq" path's (x and h rounded to q8 blocks): its reference
`moe_mmvq.moe_mmvq_ref` is this path's too.

Letters: T tokens, H hidden, F expert FFN, E experts, S slots, k experts per token,
A = T*k assignments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moestream.kernels._triton_dequant import kernel_qtype
from moestream.kernels.mmq import MMQ_QTYPES, MmqConfig, _check_config, mmq_tile, warps_for
from moestream.kernels.mmvq import quantize_q8, use_asm
from moestream.kernels.moe_align import align_blocks
from moestream.weights.qtensor import QTensor


@triton.jit
def _moe_gate_up_kernel(
    xq_ptr, xd_ptr, xs_ptr, sorted_ptr, block_expert_ptr, slot_ptr, g_ptr, u_ptr, h_ptr,
    A, E, stride_xm, stride_dm, stride_ge, stride_gn, stride_ue, stride_un,
    F: tl.constexpr, QG: tl.constexpr, QU: tl.constexpr, H_GROUPS: tl.constexpr,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Program (block of BLOCK_M assignments of one expert, BLOCK_N rows of F): gate and up
    against the assignments' tokens, h = silu(g) * u stored float32 into h [A, F]."""
    pid_b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_b)
    if expert >= E:  # a spare block past the last expert's
        return
    slot = tl.load(slot_ptr + expert).to(tl.int64)
    assign = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    valid = assign < A
    token = tl.where(valid, assign // TOPK, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, F - 1).to(tl.int64)
    xq, xd, xs = xq_ptr + token * stride_xm, xd_ptr + token * stride_dm, xs_ptr + token * stride_dm
    g_rows = g_ptr + slot * stride_ge + nc * stride_gn  # [BN]
    u_rows = u_ptr + slot * stride_ue + nc * stride_un
    g = mmq_tile(g_rows, xq, xd, xs, 0, H_GROUPS, QG, BLOCK_N, BLOCK_M, ASM)  # [BN, BM]
    u = mmq_tile(u_rows, xq, xd, xs, 0, H_GROUPS, QU, BLOCK_N, BLOCK_M, ASM)
    h = g * tl.sigmoid(g) * u
    dst = h_ptr + assign[None, :].to(tl.int64) * F + n[:, None]
    tl.store(dst, h, mask=valid[None, :] & (n[:, None] < F))


@triton.jit
def _moe_down_kernel(
    hq_ptr, hd_ptr, hs_ptr, sorted_ptr, block_expert_ptr, slot_ptr, d_ptr, weights_ptr, y_ptr,
    A, E, H, stride_de, stride_dn,
    F: tl.constexpr, QD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    """Program (block of BLOCK_M assignments of one expert, BLOCK_N rows of H): the down
    projection of the assignments' quantized h, times their routing weights, into y [A, H]."""
    pid_b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_b)
    if expert >= E:
        return
    slot = tl.load(slot_ptr + expert).to(tl.int64)
    assign = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    valid = assign < A
    ac = tl.where(valid, assign, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, H - 1).to(tl.int64)
    d_rows = d_ptr + slot * stride_de + nc * stride_dn  # [BN]
    hq, hd, hs = hq_ptr + ac * F, hd_ptr + ac * (F // 32), hs_ptr + ac * (F // 32)
    y = mmq_tile(d_rows, hq, hd, hs, 0, F // 256, QD, BLOCK_N, BLOCK_M, ASM)  # [BN, BM]
    weight = tl.load(weights_ptr + ac).to(tl.float32)  # [BM]
    dst = y_ptr + ac[None, :] * H + n[:, None]
    tl.store(dst, y * weight[None, :], mask=valid[None, :] & (n[:, None] < H))


def moe_mmq_config(a: int, num_experts: int) -> MmqConfig:
    """BLOCK_M from the mean assignments per expert (16, 32, 64), BLOCK_N 64; 2 warps at
    BLOCK_M 16, else `warps_for`. Depends on (A, E) only, never on the routing. H200, 30B layer
    (`python bench/kernels_gpu.py --sweep-moe-mmq`, 2026-11-30): 2 warps 272.9 / 367.8 / 432.4 us
    at T = 16 / 32 / 64 against 289.0 / 392.9 / 464.8 with 4, the fastest of 8 shapes."""
    per = a / num_experts
    block_m = 16 if per <= 16 else 32 if per <= 32 else 64
    return MmqConfig(block_m, 64, 1, 2 if block_m == 16 else warps_for(block_m), 3)


def moe_mmq(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate: QTensor,
    up: QTensor,
    down: QTensor,
    expert_slot: torch.Tensor,
    out: torch.Tensor | None = None,
    config: MmqConfig | None = None,
) -> torch.Tensor:
    """The MoE FFN on the int8 tensor cores: same contract as `moe.fused_moe` -> [T, H] in x's
    dtype (gate, up [S, F, H], down [S, H, F] of MMQ_QTYPES; expert_slot [E] int32 maps every
    routed expert to a slot, not checked on the device).

    Four launches after `quantize_q8(x)`: assignments grouped by expert on the device
    (`moe_align.align_blocks`, no sync); gate and up per (block of BLOCK_M assignments of one
    expert, BLOCK_N rows of F), SiLU fused, h [A, F] float32; `quantize_q8(h)`; down per
    (block, BLOCK_N rows of H), scaled by the routing weight into y [A, H] float32; the k rows
    of each token summed in selection order (deterministic, no atomics)."""
    from moestream.kernels.moe import check_moe_args

    if expert_slot is None:
        raise ValueError("moe_mmq needs expert_slot")
    check_moe_args(x, topk_ids, topk_weights, gate, up, down, expert_slot)
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        if w.qtype not in MMQ_QTYPES:
            raise ValueError(f"moe_mmq: {name} is {w.qtype.name}, no kernel")
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
    num_experts = expert_slot.shape[0]
    cfg = config or moe_mmq_config(a, num_experts)
    _check_config(cfg)
    asm = use_asm(x.device)
    sorted_ids, block_expert = align_blocks(topk_ids, num_experts, cfg.block_m)
    num_blocks = block_expert.shape[0]
    xa = quantize_q8(x)  # [T, H] -> q8 blocks
    hidden = torch.empty((a, f), dtype=torch.float32, device=x.device)  # [A, F]
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(f, cfg.block_n))](
        xa.q.view(torch.int8), xa.d, xa.s, sorted_ids, block_expert, expert_slot, gate.data,
        up.data, hidden, a, num_experts, 4 * xa.q.stride(0), xa.d.stride(0),
        gate.data.stride(0), gate.data.stride(1), up.data.stride(0), up.data.stride(1),
        F=f, QG=kernel_qtype(gate), QU=kernel_qtype(up), H_GROUPS=h // 256, TOPK=k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ASM=asm,
        **cfg.launch_options,
    )  # fmt: skip
    ha = quantize_q8(hidden)  # [A, F] -> q8 blocks
    y = torch.empty((a, h), dtype=torch.float32, device=x.device)  # [A, H]
    _moe_down_kernel[(num_blocks, triton.cdiv(h, cfg.block_n))](
        ha.q.view(torch.int8), ha.d, ha.s, sorted_ids, block_expert, expert_slot, down.data,
        topk_weights, y, a, num_experts, h, down.data.stride(0), down.data.stride(1),
        F=f, QD=kernel_qtype(down), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ASM=asm,
        **cfg.launch_options,
    )  # fmt: skip
    out.copy_(y.view(t, k, h).sum(dim=1))  # [T, H], j in order
    return out

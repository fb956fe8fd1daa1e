"""The "grouped" path of the fused MoE FFN (`moe.fused_moe`): batched decode (tens of tokens)
with integer dot products on q8 activations, for Q4_K/Q5_K/Q6_K/Q8_0 experts
(`mmvq.MMVQ_QTYPES`) and the 4-bit code types Q4_0/IQ4_NL/IQ4_XS/MXFP4 (`mmvq_codes`: for
them it is the integer-dot path at every batch size up to GROUPED_MAX_ASSIGNMENTS, since the
other MoE kernels do not read them), each expert's weights read once per block of its
assignments.

At 16-32 tokens a layer's 128-256 assignments touch most of its 128 experts, two or so each.
The "mmvq" path runs a program per assignment, so an expert's weights are read once per
assignment; the "mmq" path pads every expert's assignments to 16 tensor-core columns, so most
of its unpacking and scale arithmetic is spent on padding (Nsight Compute, H200, T = 32: 15-20%
of DRAM bandwidth, 177-252 registers a thread, 12% occupancy). Here the assignments are
grouped by expert on the device (`moe_align.align_blocks`, BLOCK_M of one expert per block,
no sync) and a program walks BLOCK_N weight rows of its block's expert over the whole of K
with the dense "once" GEMV's step (`mmvq_once._once_step`): each weight word is loaded and
unpacked once and dotted (dp4a) with the BLOCK_M activation rows of the block, which are
gathered by token.

Four launches after `quantize_q8(x)`: the alignment; gate and up per (block, BLOCK_N rows of
F), SiLU fused, h [A, F] float32; `quantize_q8(h)`; down per (block, BLOCK_N rows of H),
times the routing weight, into y [A, H] float32; then the k rows of each token summed in
selection order (deterministic, no atomics). Numerics are the "mmvq" path's (x and h rounded
to q8 blocks; `moe_mmvq.moe_mmvq_ref` is the reference); a row's sums are `mmvq.tree_sum`'s
fixed order, whatever else its block holds.

Letters: T tokens, H hidden, F expert FFN, E experts, S slots, k experts per token,
A = T*k assignments, MB = BLOCK_M.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from moestream.kernels._triton_dequant import Q4_K, Q5_K, Q6_K, Q6_KP, Q8_0, kernel_qtype
from moestream.kernels.exact import FP_EXACT, silu_rn
from moestream.kernels.mmvq import (
    MMVQ_DENSE_QTYPES,
    MMVQ_QTYPES,
    Q8Act,
    check_rows_aligned,
    quantize_q8,
    tree_sum,
    use_asm,
)
from moestream.kernels.mmvq_once import _once_step, capped_warps, runs_per_group
from moestream.kernels.moe_align import align_blocks
from moestream.kernels.moe_mmvq import check_xa
from moestream.kernels.pdl import pdl_args, pdl_start
from moestream.weights.qtensor import QTensor


@dataclass(frozen=True)
class MoeGroupedConfig:
    """Launch shape: `block_m` assignments of one expert per block (1-16, a power of two);
    gate/up: `up_block_n` F rows per program, `up_groups` groups of 256 per K step,
    `up_warps`; down: `down_block_n` H rows, `down_groups`, `down_warps`. Warps are capped so
    that each lane holds 4 words of a run (`mmvq_once.capped_warps`). `down_tiles` > 1: a down
    program takes that many tiles of `down_block_n` rows and walks F one group of 256 a step
    across all of them (`_block_rows`; K-quants and Q8_0), where a step of `down_groups` groups
    leaves lanes masked whenever F / 256 is not a power of two (the 30B's F = 768: three groups
    in a four-group tile). (Programs taking chains of
    consecutive blocks of one expert, so that later blocks find its rows in the SM's caches,
    were tried and removed: 17% / 30% slower at 16 / 32 requests on the H200, fewer programs
    in flight; bench/RESULTS.md, twenty-second session.)"""

    block_m: int = 4
    up_block_n: int = 8
    up_groups: int = 8
    up_warps: int = 2
    down_block_n: int = 8
    down_groups: int = 4
    down_warps: int = 1
    down_tiles: int = 1

    def __post_init__(self) -> None:
        for name in ("block_m", "up_block_n", "up_groups", "down_block_n", "down_groups"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1) or v > 32:
                raise ValueError(f"MoeGroupedConfig.{name} must be a power of two <= 32, got {v}")
        if self.block_m > 16:
            raise ValueError(f"MoeGroupedConfig.block_m must be at most 16, got {self.block_m}")
        for name in ("up_warps", "down_warps", "down_tiles"):
            if getattr(self, name) not in (1, 2, 4, 8):
                raise ValueError(f"MoeGroupedConfig.{name} must be 1, 2, 4 or 8")


# H200, Qwen3-30B-A3B layer, Q4_K/Q6_K (`python bench/kernels_gpu.py --sweep-moe-grouped`,
# 2026-11-30, bench/RESULTS.md), us at T = 16 / 32 / 64: 2 assignments a block 154.7 / 246.6 /
# 406.5, 4 a block 188.5 / 258.8 / 366.4 (8 and 16 spill registers: 320-2143); 8 weight rows a
# program against 4 or 16 (+6-45%). mmvq 202.8 / 378.6 / 717.9, mmq 296.8 / 377.8 / 422.2.
# One warp for the gate/up programs (2026-12-01, the 30B's batched decode, off/on/on/off): 16
# requests 1,533 -> 1,590 tok/s (+3.7%), 32 requests 2,262 -> 2,398 (+6.0%). At 4 assignments a
# block the sm_90 build of one warp spills (1,160 bytes, `python bench/sm90_builds.py
# --decode`), so that shape keeps two. The gate/up's warps and rows changed the output's bits
# on the H200 (the compiler contracted the K-quants' min term in some layouts only, now an
# explicit fma: `mmvq._acc_q4_k`; the GPU test passes since, 2026-12-01). One warp at 8
# requests: 1,077 -> 1,092 tok/s (+1.5%, twelfth session).
DEFAULT_CONFIG = MoeGroupedConfig(block_m=2, up_warps=1)


def grouped_config(assignments: int, num_experts: int) -> MoeGroupedConfig:
    """The launch shape for A assignments over E experts: DEFAULT_CONFIG, with 4 assignments a
    block (and two warps for the gate/up) where they average more than 2.5 an expert (T > 40
    tokens of 8 experts in 128). Depends on (A, E) only, never on the routing."""
    if assignments > 2.5 * num_experts:
        return replace(DEFAULT_CONFIG, block_m=4, up_warps=2)
    return DEFAULT_CONFIG


@triton.jit
def _block_rows(parts, rows0, rows_last, stride_n, QTYPE: tl.constexpr, G: tl.constexpr,
                GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, xq, xd, xs,
                ASM: tl.constexpr, TILES: tl.constexpr = 1):  # fmt: skip
    """parts [R, 2, MB, BN] (R = SUB * G * TILES) plus TILES tiles of BLOCK_N weight rows (row
    i of run r's tile at rows0 + min(i, rows_last) * stride_n; rows0 and rows_last scalars, or
    [R, 1, 1, 1] with TILES > 1) over GROUPS groups, G per step (unrolled, so that ptxas may
    issue a later step's loads early), against the activation rows xq/xd/xs ([1, 1, MB, 1]
    pointers: int32 words, float32 block scales). Run r is run r % SUB of group r % (SUB * G)
    // SUB of the step, in tile r // (SUB * G)."""
    if TILES > 1:
        tl.static_assert(
            (QTYPE == Q4_K) or (QTYPE == Q5_K) or (QTYPE == Q6_K) or (QTYPE == Q6_KP)  # noqa: SIM109
            or (QTYPE == Q8_0),
            "grouped rows in tiles: K-quants and Q8_0",
        )  # fmt: skip
    SUB: tl.constexpr = 8 if QTYPE == 8 else 4  # runs per group (Q8_0: 8 blocks)
    R: tl.constexpr = SUB * G * TILES
    r = tl.arange(0, R)[:, None, None, None]  # [R, 1, 1, 1]
    h = tl.arange(0, 2)[None, :, None, None]  # [1, 2, 1, 1]
    m = tl.arange(0, BLOCK_M)[None, None, :, None]  # [1, 1, MB, 1]
    j = tl.arange(0, 4)[None, None, None, :]  # [1, 1, 1, 4]
    for i in tl.static_range(0, GROUPS, G):
        sb = i + r % (SUB * G) // SUB
        parts = _once_step(parts, rows0, rows_last, stride_n, sb, r, h, m, j, sb < GROUPS,
                           xq, xd, xs, QTYPE, BLOCK_N, ASM)  # fmt: skip
    return parts


@triton.jit
def _block_assignments(pid_b, sorted_ptr, block_expert_ptr, slot_ptr, A, E,
                       BLOCK_M: tl.constexpr):  # fmt: skip
    """(slot of block pid_b's expert, its assignments [MB] (A for padding), valid [MB]); the
    slot is -1 for a spare block past the last expert's."""
    expert = tl.load(block_expert_ptr + pid_b)
    slot = tl.load(slot_ptr + tl.minimum(expert, E - 1)).to(tl.int64)
    slot = tl.where(expert < E, slot, -1)
    assign = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))  # [MB]
    return slot, assign, assign < A


@triton.jit
def _gate_up_grouped_kernel(
    xq_ptr, xd_ptr, xs_ptr, sorted_ptr, block_expert_ptr, slot_ptr, g_ptr, u_ptr, h_ptr,
    A, E, stride_xq, stride_xd, stride_ge, stride_gn, stride_ue, stride_un,
    F: tl.constexpr, QG: tl.constexpr, QU: tl.constexpr, H_GROUPS: tl.constexpr,
    TOPK: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ASM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (a block of BLOCK_M assignments of one expert, BLOCK_N rows of F): gate and up
    rows against the assignments' tokens' activations, h = silu(g) * u stored float32 into
    h [A, F]."""
    pdl_start(PDL)
    _gate_up_block(tl.program_id(0), xq_ptr, xd_ptr, xs_ptr, sorted_ptr, block_expert_ptr,
                   slot_ptr, g_ptr, u_ptr, h_ptr, A, E, stride_xq, stride_xd, stride_ge,
                   stride_gn, stride_ue, stride_un, F, QG, QU, H_GROUPS, TOPK, G, BLOCK_M,
                   BLOCK_N, ASM)  # fmt: skip


@triton.jit
def _gate_up_block(
    pid_b, xq_ptr, xd_ptr, xs_ptr, sorted_ptr, block_expert_ptr, slot_ptr, g_ptr, u_ptr, h_ptr,
    A, E, stride_xq, stride_xd, stride_ge, stride_gn, stride_ue, stride_un,
    F: tl.constexpr, QG: tl.constexpr, QU: tl.constexpr, H_GROUPS: tl.constexpr,
    TOPK: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    """Block pid_b of `_gate_up_grouped_kernel`, this program's BLOCK_N rows of F."""
    slot, assign, valid = _block_assignments(
        pid_b, sorted_ptr, block_expert_ptr, slot_ptr, A, E, BLOCK_M
    )
    if slot >= 0:
        token = tl.where(valid, assign // TOPK, 0).to(tl.int64)[None, None, :, None]
        xq = xq_ptr + token * stride_xq  # [1, 1, MB, 1]
        xd = xd_ptr + token * stride_xd
        xs = xs_ptr + token * stride_xd
        n0 = (tl.program_id(1) * BLOCK_N).to(tl.int64)  # F is a multiple of 256: no tail
        RG: tl.constexpr = (8 if QG == 8 else 4) * G
        RU: tl.constexpr = (8 if QU == 8 else 4) * G
        pg = _block_rows(tl.zeros([RG, 2, BLOCK_M, BLOCK_N], tl.float32),
                         g_ptr + slot * stride_ge + n0 * stride_gn, BLOCK_N - 1, stride_gn, QG,
                         G, H_GROUPS, BLOCK_N, BLOCK_M, xq, xd, xs, ASM)  # fmt: skip
        pu = _block_rows(tl.zeros([RU, 2, BLOCK_M, BLOCK_N], tl.float32),
                         u_ptr + slot * stride_ue + n0 * stride_un, BLOCK_N - 1, stride_un, QU,
                         G, H_GROUPS, BLOCK_N, BLOCK_M, xq, xd, xs, ASM)  # fmt: skip
        g = tree_sum(tl.permute(pg, (2, 3, 0, 1)), BLOCK_M, BLOCK_N, 2 * RG)  # [MB, BN]
        u = tree_sum(tl.permute(pu, (2, 3, 0, 1)), BLOCK_M, BLOCK_N, 2 * RU)
        h = silu_rn(g) * u
        cols = n0 + tl.arange(0, BLOCK_N)[None, :]
        tl.store(h_ptr + assign[:, None].to(tl.int64) * F + cols, h, mask=valid[:, None])


@triton.jit
def _down_grouped_kernel(
    hq_ptr, hd_ptr, hs_ptr, sorted_ptr, block_expert_ptr, slot_ptr, d_ptr, weights_ptr, y_ptr,
    A, E, H, stride_de, stride_dn,
    QD: tl.constexpr, F: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, TILES: tl.constexpr = 1,
):  # fmt: skip
    """Program (a block of BLOCK_M assignments of one expert, TILES tiles of BLOCK_N rows of
    H): the down projection of the assignments' quantized h, times their routing weights, into
    y [A, H]."""
    pdl_start(PDL)
    _down_block(tl.program_id(0), hq_ptr, hd_ptr, hs_ptr, sorted_ptr, block_expert_ptr,
                slot_ptr, d_ptr, weights_ptr, y_ptr, A, E, H, stride_de, stride_dn, QD, F, G,
                BLOCK_M, BLOCK_N, ASM, TILES)  # fmt: skip


@triton.jit
def _down_block(
    pid_b, hq_ptr, hd_ptr, hs_ptr, sorted_ptr, block_expert_ptr, slot_ptr, d_ptr, weights_ptr,
    y_ptr, A, E, H, stride_de, stride_dn,
    QD: tl.constexpr, F: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, ASM: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """Block pid_b of `_down_grouped_kernel`, this program's TILES * BLOCK_N rows of H."""
    slot, assign, valid = _block_assignments(
        pid_b, sorted_ptr, block_expert_ptr, slot_ptr, A, E, BLOCK_M
    )
    if slot >= 0:
        ac = tl.where(valid, assign, 0).to(tl.int64)  # [MB]
        a4 = ac[None, None, :, None]  # [1, 1, MB, 1]
        hq, hd, hs = hq_ptr + a4 * (F // 4), hd_ptr + a4 * (F // 32), hs_ptr + a4 * (F // 32)
        weight = tl.load(weights_ptr + ac).to(tl.float32)  # [MB]
        n0 = tl.program_id(1) * (TILES * BLOCK_N)
        expert = d_ptr + slot * stride_de
        SUB: tl.constexpr = 8 if QD == 8 else 4
        RG: tl.constexpr = SUB * G  # runs of a tile's step
        if TILES == 1:
            rows0 = expert + n0.to(tl.int64) * stride_dn
            rows_last = H - 1 - n0
        else:  # each run's tile's first row
            nt = n0 + tl.arange(0, RG * TILES)[:, None, None, None] // RG * BLOCK_N
            rows0 = expert + nt.to(tl.int64) * stride_dn
            rows_last = H - 1 - nt
        parts = _block_rows(tl.zeros([RG * TILES, 2, BLOCK_M, BLOCK_N], tl.float32), rows0,
                            rows_last, stride_dn, QD, G, F // 256, BLOCK_N, BLOCK_M, hq, hd, hs,
                            ASM, TILES)  # fmt: skip
        # [TILES, RG, 2, MB, BN] -> [TILES * MB, BN, RG * 2]: each tile's runs summed
        per = tl.permute(tl.reshape(parts, [TILES, RG, 2, BLOCK_M, BLOCK_N]), (0, 3, 4, 1, 2))
        y = tree_sum(tl.reshape(per, [TILES * BLOCK_M, BLOCK_N, 2 * RG]),
                     TILES * BLOCK_M, BLOCK_N, 2 * RG)  # fmt: skip
        y = tl.reshape(y, [TILES, BLOCK_M, BLOCK_N]) * weight[None, :, None]
        n = n0 + tl.arange(0, TILES)[:, None, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, None, :]
        tl.store(y_ptr + ac[None, :, None] * H + n, y, mask=valid[None, :, None] & (n < H))


def grouped_down(
    ha: Q8Act,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    expert_slot: torch.Tensor,
    down: QTensor,
    topk_weights: torch.Tensor,
    hidden: int,
    cfg: MoeGroupedConfig,
) -> torch.Tensor:
    """The grouped path's down projection: y [A, H] float32, row a = topk_weights' a-th weight
    times down(slot of its expert) @ h[a], h given as its q8 blocks `ha` [A, F]; the blocks as
    `align_blocks` gives them."""
    a, f = ha.rows, ha.k
    y = torch.empty((a, hidden), dtype=torch.float32, device=ha.q.device)  # [A, H]
    down_groups = min(cfg.down_groups, triton.next_power_of_2(f // 256))
    tiles = cfg.down_tiles if down.qtype in MMVQ_QTYPES else 1  # the types tiles take
    _down_grouped_kernel[(block_expert.shape[0], triton.cdiv(hidden, tiles * cfg.down_block_n))](
        ha.q, ha.d, ha.s, sorted_ids, block_expert, expert_slot, down.data, topk_weights, y,
        a, expert_slot.shape[0], hidden, down.data.stride(0), down.data.stride(1),
        QD=kernel_qtype(down), F=f, G=down_groups if tiles == 1 else 1, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.down_block_n, ASM=use_asm(y.device), TILES=tiles,
        num_warps=capped_warps(cfg.down_warps, runs_per_group(down.qtype),
                               down_groups if tiles == 1 else tiles),
        **pdl_args(y.device), **FP_EXACT,
    )  # fmt: skip
    return y


def moe_grouped(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate: QTensor,
    up: QTensor,
    down: QTensor,
    expert_slot: torch.Tensor,
    out: torch.Tensor,
    config: MoeGroupedConfig | None = None,
    xa: Q8Act | None = None,
) -> torch.Tensor:
    """The "grouped" path of `moe.fused_moe` (arguments checked there; expert_slot required)
    -> out [T, H] in x's dtype. `xa`: x's q8 blocks when the caller has them (else made
    here)."""
    if not all(w.qtype in MMVQ_DENSE_QTYPES for w in (gate, up, down)):
        raise ValueError("grouped: gate, up and down must be of MMVQ_DENSE_QTYPES")
    for w in (gate, up, down):
        check_rows_aligned(w, "grouped")
    if expert_slot is None:
        raise ValueError("grouped: needs expert_slot")
    t, h = x.shape
    k = topk_ids.shape[1]
    f = gate.shape[1]
    a = t * k
    num_experts = expert_slot.shape[0]
    cfg = config or grouped_config(a, num_experts)
    asm = use_asm(x.device)
    pdl = pdl_args(x.device)
    sorted_ids, block_expert = align_blocks(topk_ids, num_experts, cfg.block_m)
    num_blocks = block_expert.shape[0]
    if xa is None:
        xa = quantize_q8(x)  # [T, H] -> q8 blocks
    else:
        check_xa(xa, x)
    hidden = torch.empty((a, f), dtype=torch.float32, device=x.device)  # [A, F]
    up_groups = min(cfg.up_groups, triton.next_power_of_2(h // 256))
    _gate_up_grouped_kernel[(num_blocks, f // cfg.up_block_n)](
        xa.q, xa.d, xa.s, sorted_ids, block_expert, expert_slot, gate.data, up.data, hidden,
        a, num_experts, xa.q.stride(0), xa.d.stride(0), gate.data.stride(0),
        gate.data.stride(1), up.data.stride(0), up.data.stride(1),
        F=f, QG=kernel_qtype(gate), QU=kernel_qtype(up), H_GROUPS=h // 256, TOPK=k, G=up_groups,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.up_block_n, ASM=asm,
        num_warps=capped_warps(cfg.up_warps, runs_per_group(gate.qtype, up.qtype), up_groups),
        **pdl, **FP_EXACT,
    )  # fmt: skip
    ha = quantize_q8(hidden)  # [A, F] -> q8 blocks
    y = grouped_down(ha, sorted_ids, block_expert, expert_slot, down, topk_weights, h, cfg)
    out.copy_(y.view(t, k, h).sum(dim=1))  # [T, H], j in order
    return out

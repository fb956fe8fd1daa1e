"""Operator entry points used by `layers/`. Each picks the Triton kernel on a CUDA device when one
exists for the case, and the torch reference (same signature) otherwise.

Triton is imported lazily, only on the kernel path: this module imports and works (through the
references) on machines without triton or without CUDA.

Kernel path: a CUDA activation of float32/bfloat16/float16, triton installed, and weights of a
type in KERNEL_QTYPES (Q2_K..Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, MXFP4) whose
rows (K) are a multiple of 256 values. Float weights (F32, F16, BF16) and other block types take
the reference, which for float weights is a plain cuBLAS matmul.

Batch-invariant mode (`batch_invariant()`, the engine's `--deterministic` on a GPU): every row's
result is computed by the same kernels in the same shapes whatever else is in the batch, so
greedy text cannot change with concurrency, chunk size or prefix hits. Quantized matmuls of
MMVQ_DENSE_QTYPES run the integer-dot decode kernel on chunks of at most MMVQ_MAX_M rows (its row
results do not depend on the chunk: tested), other quantized types the float GEMV one row at a
time, float weights in fixed chunks of INVARIANT_ROWS rows (zero-padded, so cuBLAS always sees
one shape), and the fused MoE its integer-dot path on chunks of at most INVARIANT_MOE_TOKENS
tokens for MMVQ_QTYPES (one token at a time for other types). Prefill pays for it: the weights
are read once per chunk instead of once per step. On the CPU the reference paths are
batch-invariant already (`layers.linear`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from moestream.weights.qtensor import QTensor

if TYPE_CHECKING:
    from moestream.kernels.mmvq import Q8Act
    from moestream.kernels.moe_mmvq import HostWork

_Q = GGMLQuantizationType
KERNEL_QTYPES = frozenset(
    {_Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0, _Q.IQ4_NL, _Q.MXFP4}  # 32-value blocks
    | {_Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K, _Q.IQ4_XS}  # 256-value super-blocks
)
KERNEL_GROUP = 256  # the kernels walk rows in runs of 256 values
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HAS_TRITON = importlib.util.find_spec("triton") is not None
# Activation rows up to which the decode GEMV runs; more go to the tiled GEMM. The GEMV takes
# up to 8 rows, but from 2 rows its per-row FMAs cost ~3x the instructions of the GEMM's
# tensor-core path (SASS counts for sm_90); bench/kernels_gpu.py times both.
GEMV_MAX_M = 1
# Rows the integer-dot decode kernel (`kernels.mmvq`: activations rounded to 8 bits per block of
# 32, as llama.cpp's GPU decode path does) takes at most per call: batch-invariant mode runs it
# on chunks of this many rows; the default path uses it below MMQ_MIN_M rows.
MMVQ_MAX_M = 8
# Types of every integer-dot kernel: dense `mmvq` (both variants), the MoE's and `mmq`.
MMVQ_QTYPES = frozenset({_Q.Q4_K, _Q.Q5_K, _Q.Q6_K, _Q.Q8_0})
# Types of the dense decode kernel (`mmvq`, its "once" variant): MMVQ_QTYPES and the 4-bit code
# types (`kernels.mmvq_codes`). They have no `mmq`: `mmvq` up to MMVQ_MAX_M rows, then the float
# paths (`_mmvq_most_rows`); in the MoE, the grouped path (`kernels.moe.default_method`).
MMVQ_DENSE_QTYPES = MMVQ_QTYPES | {_Q.Q4_0, _Q.IQ4_NL, _Q.IQ4_XS, _Q.MXFP4}
# Rows from which a quantized matmul dequantizes the weight to the activation dtype and calls
# cuBLAS (`kernels.dequant_mm`) instead of the in-register dequantizing GEMM. H200, bf16
# (bench/kernels_gpu.py --only dequant): equal at 16 rows, 2-2.5x faster from 32 rows
# (N=12288 K=4096 Q4_K: 87.5 vs 172.2 us), 661 vs 42 TFLOP/s at 4096 rows.
DEQUANT_MIN_M = 32
# Rows from which weights of MMVQ_QTYPES take the int8 tensor-core kernel (`kernels.mmq`) below
# DEQUANT_MIN_M. H200, N=12288 K=4096 Q4_K (bench/mmq_gpu.py): M=8 34.8 us (mmvq 140.3),
# M=16 39.7 us (dequantize + cuBLAS 71.0); mmvq stays for 1-2 rows (23.4 / 33.0 us). MMQ was
# not timed below 8 rows: the switch at 3 is an estimate.
MMQ_MIN_M = 3
# Rows from which a weight with a cached bf16 copy (`--weight-cache-gib`) is multiplied by cuBLAS
# on the copy: it reads 16 bits per weight where MMQ reads ~4.5 plus its unpacking, so it pays
# once MMQ's per-row work dominates (MMQ: 40 us at 16 rows for N=12288 K=4096, where reading
# the 100 MB copy takes ~25 us). An estimate, not yet timed on a GPU.
CACHED_MIN_M = 16
# The bf16 weight chunk the dequantize + cuBLAS path writes per call (`kernels.dequant_mm`).
DEQUANT_SCRATCH_BYTES = 256 << 20
INVARIANT_ROWS = 8  # fixed row chunk of float-weight matmuls in batch-invariant mode
INVARIANT_MOE_TOKENS = 32  # token chunk of the fused MoE's integer-dot path in that mode
_BATCH_INVARIANT: ContextVar[bool] = ContextVar("moestream_batch_invariant", default=False)


@contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Within the block, kernel-path ops compute each row independently of the batch (module
    docstring). Scoped to the current thread / task; nests."""
    token = _BATCH_INVARIANT.set(enabled)
    try:
        yield
    finally:
        _BATCH_INVARIANT.reset(token)


def batch_invariant_enabled() -> bool:
    return _BATCH_INVARIANT.get()


def _in_row_chunks(
    x: torch.Tensor, rows: int, fn: Callable[[torch.Tensor], torch.Tensor], pad: bool = False
) -> torch.Tensor:
    """fn ([<= rows, K] -> [<= rows, N]) over consecutive chunks of at most `rows` rows of
    x [M, K], results concatenated; with `pad`, the last chunk is zero-padded to `rows` rows
    (fn always sees one shape)."""
    parts = []
    for i in range(0, x.shape[0], rows):
        chunk = x[i : i + rows]
        n = chunk.shape[0]
        if pad and n < rows:
            chunk = torch.cat([chunk, chunk.new_zeros(rows - n, *chunk.shape[1:])])
        parts.append(fn(chunk)[:n])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def quant_matmul_ref(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """Reference: x [M, K] @ dequant(w [N, K]).T -> [M, N] in x's dtype. Float weights (typed
    tensors) are used as they are, cast only when x's dtype differs."""
    if w.is_float:
        return x @ w.data.to(x.dtype).t()
    return x @ w.dequantize(x.dtype).t()


def kernel_weight(w: QTensor) -> bool:
    """Whether matmuls with `w` take the Triton kernels (given triton and a CUDA activation of
    KERNEL_DTYPES): a KERNEL_QTYPES weight on a CUDA device, rows a multiple of 256 values."""
    return (
        w.qtype in KERNEL_QTYPES
        and w.shape[-1] % KERNEL_GROUP == 0
        and w.data.stride(-1) == 1
        and w.data.is_cuda
    )


def _use_kernels(x: torch.Tensor, *weights: QTensor) -> bool:
    return (
        HAS_TRITON
        and x.is_cuda
        and x.dtype in KERNEL_DTYPES
        and all(kernel_weight(w) and w.device == x.device for w in weights)
    )


def _q8_rows(xa: Q8Act | None, lo: int, hi: int) -> Q8Act | None:
    """Rows lo .. hi - 1 of a Q8Act (views), or None."""
    if xa is None:
        return None
    return type(xa)(xa.q[lo:hi], xa.d[lo:hi], xa.s[lo:hi])


def _kernel_rows(x: torch.Tensor, xa: Q8Act | None) -> torch.Tensor:
    """x [..., K] as [M, K] with unit stride along K, checked against its q8 rounding `xa`."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if xa is not None:
        _check_q8(xa, *x2.shape)
    return x2


def _check_q8(xa: Q8Act, m: int, k: int) -> None:
    if xa.rows != m or xa.k != k:
        raise ValueError(f"xa holds [{xa.rows}, {xa.k}] quantized activations, x is [{m}, {k}]")


def _mmvq_most_rows(qtype: GGMLQuantizationType) -> int:
    """Most rows a dense matmul of `qtype` (in MMVQ_DENSE_QTYPES) sends to mmvq: below
    MMQ_MIN_M where the int8 tensor-core kernel takes over (MMVQ_QTYPES); MMVQ_MAX_M for the
    4-bit code types, which have no such kernel and whose next path, the tiled GEMM, was 2.2-7.2x
    slower at 2-8 rows (H200, N=12288 K=4096, 2026-11-30: mmvq 18.5-53.4 us against 102-145 us;
    bench/kernels_gpu.py --only gemv)."""
    return MMQ_MIN_M - 1 if qtype in MMVQ_QTYPES else MMVQ_MAX_M


def _matmul_path(x2: torch.Tensor, w: QTensor) -> str:
    """The kernel `quant_matmul` runs for x2 [M, K] on the kernel path outside batch-invariant
    mode: "mmvq", "dequant", "mmq", "gemv" or "gemm" (see `quant_matmul`)."""
    m = x2.shape[0]
    if w.qtype in MMVQ_DENSE_QTYPES and m <= _mmvq_most_rows(w.qtype):
        return "mmvq"
    if m >= DEQUANT_MIN_M or (m >= CACHED_MIN_M and w.values_in(x2.dtype) is not None):
        return "dequant"  # a bf16 copy (cached by `--weight-cache-gib`, or made now), cuBLAS
    if w.qtype in MMVQ_QTYPES:  # MMQ_MIN_M .. DEQUANT_MIN_M - 1 rows
        return "mmq"
    return "gemv" if m <= GEMV_MAX_M else "gemm"


def takes_q8(x: torch.Tensor, w: QTensor) -> bool:
    """Whether `quant_matmul(x, w)` rounds x to q8 blocks (`kernels.mmvq.quantize_q8`, one
    launch) before its integer-dot kernel: then a Q8Act of x made earlier (by the norm that
    produced x) can be passed as `xa` and that launch is saved."""
    if not (_use_kernels(x, w) and len(w.shape) == 2 and x.numel() > 0):
        return False
    if w.qtype not in MMVQ_DENSE_QTYPES:
        return False
    if batch_invariant_enabled():
        return True
    return _matmul_path(x.reshape(-1, x.shape[-1]), w) in ("mmvq", "mmq")


def quant_matmul(x: torch.Tensor, w: QTensor, xa: Q8Act | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T for a weight W [N, K] kept in its GGUF block format.

    On the kernel path, weights in MMVQ_DENSE_QTYPES take the integer-dot decode kernel below
    MMQ_MIN_M rows (the 4-bit code types up to MMVQ_MAX_M), those in MMVQ_QTYPES the int8
    tensor-core kernel from there to DEQUANT_MIN_M; up to GEMV_MAX_M rows of other types go to
    the float GEMV; from DEQUANT_MIN_M rows to a bf16 copy of the weight and cuBLAS, between
    them to the tiled GEMM; in batch-invariant mode `invariant_quant_matmul` (and fixed row
    chunks for other weights).

    `xa`: x's rows (flattened to [M, K]) already rounded by `kernels.mmvq.quantize_q8` (bit for
    bit its output); the integer-dot kernels then use it instead of quantizing x (`takes_q8`
    says when they run); ignored elsewhere.
    """
    invariant = batch_invariant_enabled() and x.is_cuda
    if not (_use_kernels(x, w) and len(w.shape) == 2 and x.numel() > 0):
        if invariant and x.numel() > 0:
            lead = x.shape[:-1]
            x2 = x.reshape(-1, x.shape[-1])  # [M, K]
            y = _in_row_chunks(x2, INVARIANT_ROWS, lambda c: quant_matmul_ref(c, w), pad=True)
            return y.reshape(*lead, w.shape[0])
        return quant_matmul_ref(x, w)
    lead = x.shape[:-1]
    x2 = _kernel_rows(x, xa)
    path = "invariant" if invariant else _matmul_path(x2, w)
    if path == "invariant":
        y = invariant_quant_matmul(x2, w, xa)
    elif path in ("mmvq", "mmq"):
        from moestream.kernels.mmvq import quantize_q8

        a = xa if xa is not None else quantize_q8(x2)
        if path == "mmvq":
            from moestream.kernels.mmvq import mmvq

            y = mmvq(a, w, out_dtype=x2.dtype)
        else:
            from moestream.kernels.mmq import mmq

            y = mmq(a, w, out_dtype=x2.dtype)
    elif path == "dequant":
        from moestream.kernels.dequant_mm import dequant_matmul

        y = dequant_matmul(x2, w)
    elif path == "gemv":
        from moestream.kernels.quant_gemv import quant_gemv

        y = quant_gemv(x2, w)
    else:
        from moestream.kernels.quant_gemm import quant_gemm

        y = quant_gemm(x2, w)
    return y.reshape(*lead, w.shape[0])  # [..., N]


def pairs_in_one_launch(x: torch.Tensor, w: QTensor, w2: QTensor) -> bool:
    """Whether `quant_matmul_pair(x, w, w2)` runs: on the kernel path outside batch-invariant
    mode, both weights take the integer-dot decode kernel (`mmvq`) for x's rows and step the
    same runs per group."""
    if not (
        _use_kernels(x, w, w2)
        and not batch_invariant_enabled()
        and len(w.shape) == len(w2.shape) == 2
        and x.numel() > 0
        and (w.qtype == _Q.Q8_0) == (w2.qtype == _Q.Q8_0)
    ):
        return False
    x2 = x.reshape(-1, x.shape[-1])
    return _matmul_path(x2, w) == "mmvq" and _matmul_path(x2, w2) == "mmvq"


def quant_matmul_pair(
    x: torch.Tensor, w: QTensor, w2: QTensor, xa: Q8Act | None = None
) -> torch.Tensor:
    """[..., N + N2] = x @ W.T then x @ W2.T, each as `quant_matmul` computes it, in one launch
    (`mmvq.mmvq_pair`); only where `pairs_in_one_launch(x, w, w2)`."""
    from moestream.kernels.mmvq import mmvq_pair, quantize_q8

    lead = x.shape[:-1]
    x2 = _kernel_rows(x, xa)
    a = xa if xa is not None else quantize_q8(x2)
    y = mmvq_pair(a, w, w2, out_dtype=x2.dtype)
    return y.reshape(*lead, y.shape[-1])


def invariant_quant_matmul(x: torch.Tensor, w: QTensor, xa: Q8Act | None = None) -> torch.Tensor:
    """x [M, K] @ W.T on the kernel path with every row's result independent of M: the
    integer-dot kernel on chunks of at most MMVQ_MAX_M rows for its types (their q8 rows from
    `xa` when given: `quant_matmul`), the float GEMV one row at a time for the others. Runs
    under the Triton interpreter on CPU tensors too."""
    if w.qtype in MMVQ_DENSE_QTYPES:
        from moestream.kernels.mmvq import mmvq, quantize_q8

        parts = []
        for i in range(0, x.shape[0], MMVQ_MAX_M):
            a = _q8_rows(xa, i, i + MMVQ_MAX_M) or quantize_q8(x[i : i + MMVQ_MAX_M])
            parts.append(mmvq(a, w, out_dtype=x.dtype))
        return torch.cat(parts) if len(parts) > 1 else parts[0]
    from moestream.kernels.quant_gemv import quant_gemv

    return _in_row_chunks(x, 1, lambda c: quant_gemv(c, w))


def moe_forward_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate: QTensor,
    up: QTensor,
    down: QTensor,
    expert_slot: torch.Tensor,
) -> torch.Tensor:
    """Reference MoE FFN: x [T, H], topk_ids [T, k] int, topk_weights [T, k] float, gate and up
    QTensor [S, F, H], down [S, H, F], expert_slot [E] int (expert id -> slot in [0, S)) ->
    [T, H] in x's dtype.

    out[t] = sum_j topk_weights[t, j] * down_s(silu(gate_s x[t]) * up_s x[t]) with
    s = expert_slot[topk_ids[t, j]]. Experts run in ascending id order on their grouped tokens
    (matmuls in x's dtype, as `layers.mlp.gated_mlp`), the weighted sum in float32. One host
    sync (the per-expert counts); raises ValueError when a selected expert has no valid slot.
    """
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()  # [T*k]
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert
    weight_of = topk_weights.reshape(-1)[order].float()  # [T*k]
    counts = torch.bincount(flat, minlength=expert_slot.shape[0]).tolist()
    slots = expert_slot.tolist()
    out = torch.zeros((t, x.shape[1]), dtype=torch.float32, device=x.device)  # [T, H]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        s = slots[e]
        if not 0 <= s < gate.shape[0]:
            raise ValueError(f"expert {e} is routed to but has slot {s} (of {gate.shape[0]})")
        tokens = order[start : start + n] // k  # [n]
        xs = x[tokens]  # [n, H]
        h = F.silu(quant_matmul_ref(xs, gate[s])) * quant_matmul_ref(xs, up[s])  # [n, F]
        y = quant_matmul_ref(h, down[s])  # [n, H]
        out.index_add_(0, tokens, y.float() * weight_of[start : start + n, None])
        start += n
    return out.to(x.dtype)


def moe_kernel_path(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor) -> bool:
    """Whether `moe_forward` takes the fused Triton kernel for these arguments (shape checks
    aside): a kernel activation and three kernel weights on its device."""
    return _use_kernels(x, gate, up, down)


def moe_takes_q8(
    x: torch.Tensor, top_k: int, gate: QTensor, up: QTensor, down: QTensor, num_experts: int
) -> bool:
    """Whether `moe_forward` of x [T, H] with k = top_k experts per token (E = num_experts)
    rounds x to q8 blocks (`kernels.mmvq.quantize_q8`) for the fused kernel's integer-dot path:
    then a Q8Act of x passed as `xa` saves that launch."""
    if not (moe_kernel_path(x, gate, up, down) and x.dim() == 2 and len(gate.shape) == 3):
        return False
    if x.shape[0] == 0 or not all(w.qtype in MMVQ_DENSE_QTYPES for w in (gate, up, down)):
        return False
    if batch_invariant_enabled():
        return all(w.qtype in MMVQ_QTYPES for w in (gate, up, down))  # `invariant_moe`'s mmvq
    from moestream.kernels.moe import default_method

    method = default_method(x.shape[0] * top_k, gate, up, down, x, num_experts)
    return method in ("mmvq", "grouped")


def moe_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate: QTensor,
    up: QTensor,
    down: QTensor,
    expert_slot: torch.Tensor,
    xa: Q8Act | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed-expert FFN of one MoE layer; contract of `moe_forward_ref`.

    On the kernel path (`kernels.moe.fused_moe`) no host sync happens and every selected
    expert's slot must be valid (not checked on the device). topk_ids [T, k] int32/int64 and
    topk_weights [T, k] float are made contiguous, expert_slot int32, if they are not already.
    `xa`: x already rounded by `kernels.mmvq.quantize_q8` (bit for bit), used by the fused
    kernel's integer-dot path instead of quantizing x (`moe_takes_q8`); ignored elsewhere.
    `counters`: the integer-dot path's arrival counters (`kernels.moe_mmvq.mmvq_counters`, kept by
    the caller so that a step allocates and zeroes none); made per call when None.
    """
    if not (moe_kernel_path(x, gate, up, down) and x.dim() == 2 and len(gate.shape) == 3):
        return moe_forward_ref(x, topk_ids, topk_weights, gate, up, down, expert_slot)
    from moestream.kernels.moe import fused_moe

    x = x if x.stride(-1) == 1 else x.contiguous()
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    slot = expert_slot.to(torch.int32).contiguous()
    if xa is not None:
        _check_q8(xa, *x.shape)
    if batch_invariant_enabled():
        return invariant_moe(x, ids, weights, gate, up, down, slot, xa)
    return fused_moe(x, ids, weights, gate, up, down, slot, xa=xa, counters=counters)


def _moe_in_token_chunks(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    rows: int,
    moe: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """moe(x, ids, weights) over consecutive chunks of at most `rows` tokens, concatenated."""
    parts = [
        moe(x[i : i + rows], topk_ids[i : i + rows], topk_weights[i : i + rows])
        for i in range(0, x.shape[0], rows)
    ]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def moe_forward_addr(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate: QTensor,
    up: QTensor,
    down: QTensor,
    expert_addr: torch.Tensor,
    host: HostWork | None = None,
    host_marks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused MoE with expert weights found by byte address (`experts.zero_copy`): gate, up
    [1, F, H] and down [1, H, F] give types and shapes, expert_addr [3, E] int64 the bytes of
    each expert. CUDA kernel path only ("mmvq", in chunks of at most MMVQ_MAX_ASSIGNMENTS
    assignments; a token's result does not depend on its chunk). `host` computes the experts
    whose `host_marks` [E] int32 entry is negative, chunk by chunk (`moe_mmvq.HostWork`).
    With `host_marks` the launch takes `HYBRID_CONFIG`, with or without `host` (a layer whose
    host work sits out this call keeps its bits)."""
    from moestream.kernels.moe import MMVQ_MAX_ASSIGNMENTS, fused_moe
    from moestream.kernels.moe_mmvq import HYBRID_CONFIG, ZERO_COPY_CONFIG

    if not (moe_kernel_path(x, gate, up, down) and all(
        w.qtype in MMVQ_QTYPES for w in (gate, up, down)
    )):  # fmt: skip
        raise ValueError("address-table experts need the CUDA integer-dot MoE kernel")
    x = x if x.stride(-1) == 1 else x.contiguous()
    return _moe_in_token_chunks(
        x, topk_ids.contiguous(), topk_weights.contiguous(),
        max(1, MMVQ_MAX_ASSIGNMENTS // topk_ids.shape[1]),
        lambda xc, ic, wc: fused_moe(
            xc, ic, wc, gate, up, down, host_marks, method="mmvq", expert_addr=expert_addr,
            mmvq_cfg=ZERO_COPY_CONFIG if host_marks is None else HYBRID_CONFIG, host_rows=host,
        ),
    )  # fmt: skip


def invariant_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate: QTensor,
    up: QTensor,
    down: QTensor,
    expert_slot: torch.Tensor,
    xa: Q8Act | None = None,
) -> torch.Tensor:
    """The fused MoE with every token's result independent of the batch: the integer-dot path
    on chunks of at most INVARIANT_MOE_TOKENS tokens (its rows are independent; their q8 rows
    from `xa` when given, as `moe_forward`), other types one token at a time. Arguments as
    `kernels.moe.fused_moe` (contiguous, int32 slots)."""
    from moestream.kernels.moe import fused_moe

    mmvq = all(w.qtype in MMVQ_QTYPES for w in (gate, up, down))
    if not mmvq:
        return _moe_in_token_chunks(
            x, topk_ids, topk_weights, 1,
            lambda xc, ic, wc: fused_moe(xc, ic, wc, gate, up, down, expert_slot, method="gemv"),
        )  # fmt: skip
    rows = INVARIANT_MOE_TOKENS
    parts = []
    for i in range(0, x.shape[0], rows):
        args = (x[i : i + rows], topk_ids[i : i + rows], topk_weights[i : i + rows])
        q8 = {} if xa is None else {"xa": _q8_rows(xa, i, i + rows)}
        parts.append(fused_moe(*args, gate, up, down, expert_slot, method="mmvq", **q8))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def embedding_ref(ids: torch.Tensor, w: QTensor) -> torch.Tensor:
    """Rows `ids` [T] of a (possibly quantized) [V, H] table -> [T, H] float32."""
    from moestream.weights.dequant import dequantize

    if w.is_float:
        return w.data[ids].float()
    rows = w.with_data(w.data[ids], (ids.numel(), w.shape[-1])).native()
    return dequantize(rows, w.qtype, (ids.numel(), w.shape[-1]))


def embedding(ids: torch.Tensor, w: QTensor) -> torch.Tensor:
    """Rows `ids` [T] of a [V, H] table -> [T, H] float32 (reference on every device)."""
    return embedding_ref(ids, w)

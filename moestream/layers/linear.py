"""A linear layer over a weight kept in its GGUF block format, and the batch-invariant matmul
every layer uses.

Batch invariance (DESIGN invariant 4): a row's result must not depend on the other rows of the
batch, or greedy text would change with concurrency and prefill chunk size. CPU BLAS (MKL) picks
a different kernel for each row count, and the rows of an [M, K] @ [K, N] product differ in the
last bits between M = 1, 2, 8, ... So on the CPU every row is multiplied on its own, as the
[1, K] @ [K, N] product a batch-1 decode computes: decode costs nothing extra, prefill pays a
GEMV per row instead of one GEMM (the weight is dequantized once per call either way). On a GPU
the call goes to `kernels.ops.quant_matmul` (its batch invariance is the kernels' business).

Large weights (the output head) are dequantized and multiplied in slices of output rows of
about a megabyte: the dequantization's temporaries then stay in cache, which makes it several
times faster, and each output column is computed exactly as it would be from the whole weight.
The slicing depends only on the weight's shape, never on the batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from gguf import GGMLQuantizationType

from moestream.kernels.ops import (
    HAS_TRITON,
    kernel_weight,
    pairs_in_one_launch,
    quant_matmul,
    quant_matmul_pair,
)
from moestream.layers.norm import q8_of, vector_weight
from moestream.weights.qtensor import QTensor

_ALIGN = 16  # floats: rows of K % 16 == 0 start on 64-byte boundaries, as fresh tensors do
SLICE_VALUES = 1 << 18  # weight values dequantized at a time (1 MiB of float32)
# Types whose torch dequantization builds its value table with `torch.tensor` (a host -> device
# copy): a CUDA graph cannot capture that, so a model using them on the reference path runs eager.
HOST_TABLE_QTYPES = frozenset(
    {
        GGMLQuantizationType.IQ4_NL,
        GGMLQuantizationType.IQ4_XS,
        GGMLQuantizationType.MXFP4,
        GGMLQuantizationType.NVFP4,
    }
)


def needs_host_table(w: QTensor) -> bool:
    """Whether a matmul with `w` dequantizes through a value table built on the host, which a
    CUDA graph cannot capture: a HOST_TABLE_QTYPES weight that the Triton kernels do not take
    (they unpack IQ4_NL, IQ4_XS and MXFP4 in registers: `ops.kernel_weight`)."""
    return w.qtype in HOST_TABLE_QTYPES and not (HAS_TRITON and kernel_weight(w))


def rowwise_matmul(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ wt [K, N] -> [M, N], each row computed as its own [1, K] product, so a row's
    result is the same bits whatever else is in `x`."""
    m, k = x.shape
    if m == 1:
        return x @ wt
    if m == 0:
        return x.new_empty(0, wt.shape[1])
    if k % _ALIGN:
        # A row at an odd offset could take an alignment-dependent path: copy each row out.
        return torch.cat([x[i : i + 1].clone() @ wt for i in range(m)])
    return torch.cat([x[i : i + 1] @ wt for i in range(m)])


def _row_slices(w: QTensor, rows: int) -> Iterator[QTensor]:
    """W [N, K] as consecutive slices of `rows` output rows (views of its blocks)."""
    n, k = w.shape
    for i in range(0, n, rows):
        yield w.with_data(w.data[i : i + rows], (min(rows, n - i), k))


def device_path(x: torch.Tensor) -> bool:
    """Whether `linear` hands x to `kernels.ops.quant_matmul`: everywhere but the CPU."""
    return x.device.type != "cpu"


def linear(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T for W [N, K] in GGUF block format; batch-invariant on CPU.

    CPU: the weight is dequantized to x's dtype (the reference dequantization, bit for bit as
    gguf-py) and multiplied row by row (module docstring). Other devices: `quant_matmul`, with
    the q8 rounding of x that the norm which produced x attached to it, if any (`norm.q8_of`).
    """
    if device_path(x):
        return quant_matmul(x, w, q8_of(x))
    n, k = w.shape
    x2 = x.reshape(-1, k)  # [M, K]
    rows = max(1, SLICE_VALUES // k)
    values = w.values_in(x.dtype)  # cached dequantized values: the same numbers, no work
    if values is not None:
        slices = (values[i : i + rows] for i in range(0, n, rows))
    else:
        slices = (s.dequantize(x.dtype) for s in _row_slices(w, rows))
    parts = [rowwise_matmul(x2, wd.t()) for wd in slices]  # [M, <= rows] each
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [M, N]
    return y.reshape(*x.shape[:-1], n)


class Linear:
    """y = x @ W.T (+ b) with W [N, K] a QTensor, through `linear`. The bias, when present, is a
    float32 vector."""

    def __init__(self, weight: QTensor, bias: QTensor | None = None):
        if len(weight.shape) != 2:
            raise ValueError(f"linear weight must be 2-D, got shape {weight.shape}")
        self.weight = weight
        self.bias = None if bias is None else vector_weight(bias, weight.device)  # [N]
        self._bias_cast: dict[torch.dtype, torch.Tensor] = {}

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def _bias_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The bias in `dtype`, cast once (a float32 bias is used as it is)."""
        assert self.bias is not None
        if dtype not in self._bias_cast:
            self._bias_cast[dtype] = self.bias.to(dtype)
        return self._bias_cast[dtype]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)  # [M, K] -> [M, N]
        if self.bias is not None:
            y = y + self._bias_as(y.dtype)
        return y


class PairedLinear:
    """Two bias-free linears over the same input whose weights do not share a type, each
    computing the parts of `sizes_a` / `sizes_b` (output columns, in order). `outputs` gives
    every part: from one launch where both take the integer-dot decode kernel
    (`ops.quant_matmul_pair`), else from the two products (no copy into one tensor)."""

    def __init__(self, a: Linear, b: Linear, sizes_a: list[int], sizes_b: list[int]):
        if a.bias is not None or b.bias is not None:
            raise ValueError("PairedLinear takes linears without biases")
        if sum(sizes_a) != a.out_features or sum(sizes_b) != b.out_features:
            raise ValueError("PairedLinear: the parts' sizes do not add up to the weights' rows")
        self.a, self.b = a, b
        self.sizes_a, self.sizes_b = list(sizes_a), list(sizes_b)

    @property
    def weights(self) -> tuple[QTensor, QTensor]:
        return self.a.weight, self.b.weight

    def outputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The parts' outputs [..., size] for x [..., K] (views)."""
        wa, wb = self.weights
        if device_path(x) and pairs_in_one_launch(x, wa, wb):
            y = quant_matmul_pair(x, wa, wb, q8_of(x))
            return list(y.split(self.sizes_a + self.sizes_b, dim=-1))
        return [*self.a(x).split(self.sizes_a, dim=-1), *self.b(x).split(self.sizes_b, dim=-1)]


# Whether `fuse_linears` pairs two linears of different types (`PairedLinear`); off only to
# time the layers without it (bench/scripts/gpu_figures.sh s9e).
PAIR_PROJECTIONS = True


def fuse_linears(parts: Sequence[Linear]) -> list[tuple[Linear | PairedLinear, list[int]]]:
    """Consecutive linears over the same input merged where their weights share a type: each
    entry is (a linear, the output sizes of the parts it computes, in order).

    Weights are concatenated along N (quantized rows are independent), biases likewise; parts
    merge only when all or none of them have a bias. One launch then computes, e.g., Q, K and V.
    Where that leaves two bias-free linears of different types (Qwen3's Q4_K q/k and Q6_K v in
    the Q4_K_M mix), they become one `PairedLinear`: one launch at decode as well.
    Used on CUDA only: on the CPU the per-part matmuls are kept for their exact bits.
    """
    groups: list[list[Linear]] = []
    for p in parts:
        last = groups[-1][-1] if groups else None
        if (
            last is not None
            and last.weight.qtype == p.weight.qtype
            and last.weight.shape[1] == p.weight.shape[1]
            and last.weight.padded == p.weight.padded
            and (last.bias is None) == (p.bias is None)
        ):
            groups[-1].append(p)
        else:
            groups.append([p])
    fused = []
    for group in groups:
        sizes = [p.out_features for p in group]
        if len(group) == 1:
            fused.append((group[0], sizes))
            continue
        w = group[0].weight
        data = torch.cat([p.weight.data for p in group], dim=0)
        merged = Linear(w.with_data(data, (sum(sizes), w.shape[1])))
        if group[0].bias is not None:
            merged.bias = torch.cat([p.bias for p in group])  # type: ignore[misc]
        fused.append((merged, sizes))
    if PAIR_PROJECTIONS and len(fused) == 2 and all(lin.bias is None for lin, _ in fused):
        (a, sa), (b, sb) = fused
        return [(PairedLinear(a, b, sa, sb), sa + sb)]  # type: ignore[arg-type]
    return fused

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

from collections.abc import Iterator

import torch

from moestream.kernels.ops import quant_matmul
from moestream.layers.norm import vector_weight
from moestream.weights.qtensor import QTensor

_ALIGN = 16  # floats: rows of K % 16 == 0 start on 64-byte boundaries, as fresh tensors do
SLICE_VALUES = 1 << 18  # weight values dequantized at a time (1 MiB of float32)


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
        yield QTensor(w.data[i : i + rows], w.qtype, (min(rows, n - i), k))


def linear(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T for W [N, K] in GGUF block format; batch-invariant on CPU.

    CPU: the weight is dequantized to x's dtype (the reference dequantization, bit for bit as
    gguf-py) and multiplied row by row (module docstring). Other devices: `quant_matmul`.
    """
    if x.device.type != "cpu":
        return quant_matmul(x, w)
    n, k = w.shape
    x2 = x.reshape(-1, k)  # [M, K]
    rows = max(1, SLICE_VALUES // k)
    if n <= rows:
        y = rowwise_matmul(x2, w.dequantize(x.dtype).t())  # [M, N]
    else:
        parts = [rowwise_matmul(x2, s.dequantize(x.dtype).t()) for s in _row_slices(w, rows)]
        y = torch.cat(parts, dim=1)  # [M, N]
    return y.reshape(*x.shape[:-1], n)


class Linear:
    """y = x @ W.T (+ b) with W [N, K] a QTensor, through `linear`. The bias, when present, is a
    float32 vector."""

    def __init__(self, weight: QTensor, bias: QTensor | None = None):
        if len(weight.shape) != 2:
            raise ValueError(f"linear weight must be 2-D, got shape {weight.shape}")
        self.weight = weight
        self.bias = None if bias is None else vector_weight(bias, weight.device)  # [N]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)  # [M, K] -> [M, N]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

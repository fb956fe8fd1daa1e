"""A linear layer over a weight kept in its GGUF block format, and the batch-invariant matmul
every layer uses.

Batch invariance (DESIGN invariant 4): a row's result must not depend on the other rows of the
batch, or greedy text would change with concurrency and prefill chunk size. CPU BLAS (MKL) picks
a different kernel for each row count, and the rows of an [M, K] @ [K, N] product differ in the
last bits between M = 1, 2, 8, ... So on the CPU every row is multiplied on its own, as the
[1, K] @ [K, N] product a batch-1 decode computes: decode costs nothing extra, prefill pays a
GEMV per row instead of one GEMM (the weight is dequantized once per call either way). On a GPU
the call goes to `kernels.ops.quant_matmul` (its batch invariance is the kernels' business).
"""

from __future__ import annotations

import torch

from moestream.kernels.ops import quant_matmul
from moestream.layers.norm import vector_weight
from moestream.weights.qtensor import QTensor

_ALIGN = 16  # floats: rows of K % 16 == 0 start on 64-byte boundaries, as fresh tensors do


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


def linear(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T for W [N, K] in GGUF block format; batch-invariant on CPU.

    CPU: the weight is dequantized to x's dtype (the reference dequantization, bit for bit as
    gguf-py) and multiplied row by row (module docstring). Other devices: `quant_matmul`.
    """
    if x.device.type != "cpu":
        return quant_matmul(x, w)
    wt = w.dequantize(x.dtype).t()  # [K, N]
    y = rowwise_matmul(x.reshape(-1, x.shape[-1]), wt)  # [M, N]
    return y.reshape(*x.shape[:-1], wt.shape[1])


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

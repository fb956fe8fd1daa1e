"""A linear layer over a weight kept in its GGUF block format."""

from __future__ import annotations

import torch

from moestream.kernels.ops import quant_matmul
from moestream.layers.norm import vector_weight
from moestream.weights.qtensor import QTensor


class Linear:
    """y = x @ W.T (+ b) with W [N, K] a QTensor; the matmul goes through `kernels.ops`, which
    dequantizes inside the kernel. The bias, when present, is a float32 vector."""

    def __init__(self, weight: QTensor, bias: QTensor | None = None):
        if len(weight.shape) != 2:
            raise ValueError(f"linear weight must be 2-D, got shape {weight.shape}")
        self.weight = weight
        self.bias = None if bias is None else vector_weight(bias, weight.device)  # [N]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = quant_matmul(x, self.weight)  # [M, K] -> [M, N]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

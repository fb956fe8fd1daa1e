"""Operator entry points used by `layers/`. Each picks the Triton kernel on a CUDA device when one
exists for the case, and the torch reference (same signature) otherwise."""

from __future__ import annotations

import torch

from moestream.weights.qtensor import QTensor


def quant_matmul_ref(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """Reference: x [M, K] @ dequant(w [N, K]).T -> [M, N] in x's dtype."""
    return x @ w.dequantize(x.dtype).t()


def quant_matmul(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T for a weight W [N, K] kept in its GGUF block format."""
    return quant_matmul_ref(x, w)


def embedding_ref(ids: torch.Tensor, w: QTensor) -> torch.Tensor:
    """Rows `ids` [T] of a (possibly quantized) [V, H] table -> [T, H] float32."""
    from moestream.weights.dequant import dequantize

    if w.is_float:
        return w.data[ids].float()
    rows = w.data[ids]  # [T, row_bytes]
    return dequantize(rows, w.qtype, (ids.numel(), w.shape[-1]))


def embedding(ids: torch.Tensor, w: QTensor) -> torch.Tensor:
    return embedding_ref(ids, w)

"""RMSNorm with float32 math, whatever the activation dtype."""

from __future__ import annotations

import torch

from moestream.weights.qtensor import QTensor


def vector_weight(w: QTensor, device: torch.device | str) -> torch.Tensor:
    """A 1-D weight (norm scale, bias) as a float32 tensor on `device`.

    Such vectors are tiny and stored as F32 in every GGUF llama.cpp writes; they are used
    directly by elementwise math, so they are turned into plain tensors once, at build.
    """
    if len(w.shape) != 1:
        raise ValueError(f"expected a 1-D weight, got shape {w.shape}")
    t = w.data.float() if w.is_float else w.dequantize(torch.float32)
    return t.to(device).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, computed in float32.

    x [..., D] any float dtype, weight [D] float32 -> [..., D] in x's dtype.
    """
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    # Same operation order as transformers' RMSNorm: (x * rsqrt(var + eps)) then * weight.
    return (weight * (x32 * torch.rsqrt(variance + eps))).to(x.dtype)


class RMSNorm:
    """RMSNorm over the last dimension with a learned scale (float32 math)."""

    def __init__(self, weight: QTensor, eps: float, device: torch.device | str):
        self.weight = vector_weight(weight, device)  # [D] float32
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

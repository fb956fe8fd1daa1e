"""RMSNorm with float32 math, whatever the activation dtype; and the residual add fused into it.

On a CUDA activation with triton installed (`on_kernel_path`) the norm is one Triton launch
(`kernels.norm_rope.add_rms_norm`) instead of a chain of ~8 elementwise ops; elsewhere the torch
reference runs, unchanged bit for bit.

Asked for it (`q8=True`: the caller knows the next matmuls round their input to q8 blocks,
`kernels.ops.takes_q8`), the kernel also writes that rounding of its output (`Q8Act`, bit for
bit `kernels.mmvq.quantize_q8`'s) and attaches it to the output tensor (`with_q8`); the linears
and the MoE read it back (`q8_of`) instead of quantizing again: one launch less per consumer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moestream.kernels.ops import HAS_TRITON, KERNEL_DTYPES
from moestream.weights.qtensor import QTensor

if TYPE_CHECKING:
    from moestream.kernels.mmvq import Q8Act

_Q8_ATTR = "q8_act"  # the attribute of a norm's output tensor that holds its Q8Act


def on_kernel_path(x: torch.Tensor) -> bool:
    """Whether the layers run their fused Triton kernels on `x`: a CUDA activation of a kernel
    dtype, with triton installed. (Everything else runs the torch references.)"""
    return x.is_cuda and HAS_TRITON and x.dtype in KERNEL_DTYPES


def with_q8(x: torch.Tensor, xa: Q8Act) -> torch.Tensor:
    """x [T, H], carrying xa = quantize_q8(x) for its consumers (`q8_of`). Only the kernel that
    just wrote x calls this (a norm, `kernels.swiglu.silu_mul`): the tensor is never written
    afterwards, so xa stays its value."""
    setattr(x, _Q8_ATTR, xa)
    return x


def q8_of(x: torch.Tensor) -> Q8Act | None:
    """The Q8Act a norm attached to this very tensor (`with_q8`), else None. Views, copies and
    results of ops carry none."""
    xa = getattr(x, _Q8_ATTR, None)
    if xa is None or x.dim() != 2 or xa.rows != x.shape[0] or xa.k != x.shape[1]:
        return None
    return xa


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


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Reference of `kernels.norm_rope.add_rms_norm`: rms_norm(residual + x) [T, H] in x's dtype;
    when `residual` [T, H] is given it is set (in place) to residual + x in x's dtype."""
    if residual is None:
        return rms_norm(x, weight, eps)
    residual.copy_(residual + x)
    return rms_norm(residual, weight, eps)


class RMSNorm:
    """RMSNorm over the last dimension with a learned scale (float32 math)."""

    def __init__(self, weight: QTensor, eps: float, device: torch.device | str):
        self.weight = vector_weight(weight, device)  # [D] float32
        self.eps = eps

    def __call__(self, x: torch.Tensor, q8: bool = False) -> torch.Tensor:
        """norm(x) [..., D] in x's dtype; with `q8` on the kernel path it carries its q8
        rounding (`q8_of`)."""
        if x.dim() == 2 and on_kernel_path(x):
            from moestream.kernels.norm_rope import add_rms_norm, add_rms_norm_q8

            if q8 and x.shape[1] % 32 == 0:
                return with_q8(*add_rms_norm_q8(x, None, self.weight, self.eps))
            return add_rms_norm(x, None, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, q8: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x) for x, residual [T, H] of one dtype.

        On the kernel path the sum is written into `residual` (one launch for both), and with
        `q8` the norm carries its q8 rounding (`q8_of`); elsewhere the sum is a new tensor and
        `residual` is left as it was."""
        if on_kernel_path(x):
            from moestream.kernels.norm_rope import add_rms_norm, add_rms_norm_q8

            if q8 and x.shape[1] % 32 == 0:
                return with_q8(*add_rms_norm_q8(x, residual, self.weight, self.eps)), residual
            return add_rms_norm(x, residual, self.weight, self.eps), residual
        h = residual + x
        return rms_norm(h, self.weight, self.eps), h

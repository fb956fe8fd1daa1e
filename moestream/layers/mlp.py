"""SiLU-gated feed-forward: down(silu(gate(x)) * up(x)).

On the kernel path (CUDA) the gate and up rows are stacked into one weight, so a step runs one
matmul for both, then `kernels.swiglu.silu_mul` (SiLU, the product and, for an integer-dot down
projection, the q8 rounding of h in one launch), then down: three launches where there were six.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moestream.kernels.ops import takes_q8
from moestream.layers.linear import linear, needs_host_table
from moestream.layers.norm import on_kernel_path, with_q8
from moestream.weights.qtensor import QTensor


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x); on the CPU written as x / (1 + exp(-x)) in float32.

    Not `F.silu` on the CPU: ATen's silu takes a scalar path for the tail of a tensor (and at
    the edges of each thread's chunk) whose results differ from its vector path in the last bit,
    so an element's value would depend on where it sits in the batch. Each op here is either
    exactly rounded or (exp) gives the same bits on both paths. Other devices use `F.silu`.
    """
    if x.device.type != "cpu":
        return F.silu(x)
    x32 = x.float()
    return (x32 / (1 + torch.exp(-x32))).to(x.dtype)


def gated_mlp(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor) -> torch.Tensor:
    """x [M, H]; gate, up [F, H]; down [H, F] -> [M, H] in x's dtype."""
    h = silu(linear(x, gate)) * linear(x, up)  # [M, F]
    return linear(h, down)


def stack_rows(a: QTensor, b: QTensor) -> tuple[QTensor, QTensor, QTensor]:
    """(a and b's rows stacked [Na + Nb, K], a view of its first Na rows, one of the rest): the
    views replace a and b, so the stack takes no memory beyond theirs."""
    if a.padded != b.padded:
        raise ValueError("stack_rows: one weight padded, the other not")
    data = torch.cat([a.data, b.data])  # quantized rows are independent: stack the bytes
    n = a.shape[0]
    both = a.with_data(data, (n + b.shape[0], a.shape[1]))
    return both, a.with_data(data[:n], a.shape), b.with_data(data[n:], b.shape)


class GatedMLP:
    """The dense FFN of llama, qwen2 and qwen3 blocks. `fuse` (default: the weights are on a
    CUDA device; gate and up must share type and shape): keep gate and up stacked for the kernel
    path (module docstring)."""

    def __init__(self, gate: QTensor, up: QTensor, down: QTensor, fuse: bool | None = None):
        if fuse is None:
            fuse = gate.device.type == "cuda"
        self.gate_up: QTensor | None = None
        if fuse and gate.qtype == up.qtype and gate.shape == up.shape and gate.shape[0] % 32 == 0:
            self.gate_up, gate, up = stack_rows(gate, up)
        self.gate, self.up, self.down = gate, up, down

    @property
    def capturable(self) -> bool:
        """No host copy in the forward (`needs_host_table`): a CUDA graph can capture it."""
        return not any(needs_host_table(w) for w in (self.gate, self.up, self.down))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None or not on_kernel_path(x) or x.dim() != 2:
            return gated_mlp(x, self.gate, self.up, self.down)
        from moestream.kernels.swiglu import silu_mul

        gu = linear(x, self.gate_up)  # [M, 2F]: gate, then up
        q8 = takes_q8(gu[:, : self.gate.shape[0]], self.down)
        h, ha = silu_mul(gu, q8=q8)  # [M, F], its q8 blocks for an integer-dot down
        return linear(with_q8(h, ha) if ha is not None else h, self.down)

"""SiLU-gated feed-forward: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moestream.layers.linear import HOST_TABLE_QTYPES, linear
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


class GatedMLP:
    """The dense FFN of llama, qwen2 and qwen3 blocks."""

    def __init__(self, gate: QTensor, up: QTensor, down: QTensor):
        self.gate, self.up, self.down = gate, up, down

    @property
    def capturable(self) -> bool:
        """No host copy in the forward (see HOST_TABLE_QTYPES): a CUDA graph can capture it."""
        return all(w.qtype not in HOST_TABLE_QTYPES for w in (self.gate, self.up, self.down))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(x, self.gate, self.up, self.down)

"""SiLU-gated feed-forward: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moestream.kernels.ops import quant_matmul
from moestream.weights.qtensor import QTensor


def gated_mlp(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor) -> torch.Tensor:
    """x [M, H]; gate, up [F, H]; down [H, F] -> [M, H] in x's dtype."""
    h = F.silu(quant_matmul(x, gate)) * quant_matmul(x, up)  # [M, F]
    return quant_matmul(h, down)


class GatedMLP:
    """The dense FFN of llama, qwen2 and qwen3 blocks."""

    def __init__(self, gate: QTensor, up: QTensor, down: QTensor):
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(x, self.gate, self.up, self.down)

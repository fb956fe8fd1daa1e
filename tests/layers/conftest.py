"""Shared by the layer tests of the norms' q8 rounding (test_q8_fusion.py, test_moe.py): the
device the kernels run on, quantized random weights, and a count of `quantize_q8` calls."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from moestream.weights.qtensor import QTensor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the Triton interpreter


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def quantized_weight() -> Callable[..., QTensor]:
    """(shape, qtype name, seed) -> a QTensor of N(0, 1) values quantized to qtype, on the
    kernels' device."""
    from gguf import GGMLQuantizationType

    from moestream.weights.quantize import quantize

    def make(shape: tuple[int, ...], qtype: str, seed: int) -> QTensor:
        q = GGMLQuantizationType[qtype]
        w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
        return QTensor(torch.from_numpy(quantize(w, q)).to(DEVICE), q, shape)

    return make


@pytest.fixture
def quantize_q8_calls(monkeypatch) -> list[int]:
    """Rows of every `kernels.mmvq.quantize_q8` call from here on (the matmuls' and the fused
    MoE's), in order."""
    pytest.importorskip("triton", reason="triton is not installed")
    from moestream.kernels import mmvq
    from moestream.kernels import moe_mmvq as moe_kernels

    calls: list[int] = []
    real = mmvq.quantize_q8

    def counted(x, *args):
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(mmvq, "quantize_q8", counted)
    monkeypatch.setattr(moe_kernels, "quantize_q8", counted)
    return calls


@pytest.fixture
def kernel_weights(monkeypatch) -> None:
    """Every weight of a kernel type takes the kernels, CPU tensors too (the interpreter)."""
    from moestream.kernels import ops

    def use(x: torch.Tensor, *weights: QTensor) -> bool:
        return all(
            w.qtype in ops.KERNEL_QTYPES and w.shape[-1] % ops.KERNEL_GROUP == 0 for w in weights
        )

    monkeypatch.setattr(ops, "_use_kernels", use)

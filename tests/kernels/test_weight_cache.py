"""`CausalLM.cache_kernel_values`: which weights get bf16 (here float32) copies, in what order,
within the budget. The kernel-path check is forced so that it runs on the CPU (the copies are
made by the dequantizing kernel under the Triton interpreter)."""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed")

from moestream.cli import DEMO_MODEL  # noqa: E402
from moestream.kernels import ops  # noqa: E402
from moestream.llm import LLM  # noqa: E402


def test_cache_weight_values_fills_dense_weights_then_experts_within_budget(monkeypatch):
    """Every layer's attention weights first, then the expert stacks layer by layer, while the
    budget lasts (float32 copies: the demo model's dtype on the CPU)."""
    model = LLM(DEMO_MODEL, device="cpu", weight_cache_gib=0).model
    assert model.cache_kernel_values(1 << 40) == 0  # CPU tensors: not on the kernel path
    kernel_weight = lambda w: w.qtype in ops.KERNEL_QTYPES and w.shape[-1] % ops.KERNEL_GROUP == 0  # noqa: E731
    monkeypatch.setattr(ops, "_use_kernels", lambda x, *ws: all(map(kernel_weight, ws)))
    size = lambda ws: sum(math.prod(w.shape) * 4 for w in ws if kernel_weight(w))  # noqa: E731
    dense = [w for layer in model.layers for w in layer.attn.weights()]
    first = model.layers[0].ffn.experts.stacked()
    assert all(kernel_weight(w) for w in first)
    budget = size(dense) + size(first)  # every attention weight and layer 0's experts
    used = model.cache_kernel_values(budget)
    assert used == budget
    for w in [w for w in dense if kernel_weight(w)] + list(first):
        assert w.values is not None and w.values.dtype == torch.float32
        torch.testing.assert_close(w.values, w.dequantize(torch.float32), rtol=0, atol=0)
    assert all(w.values is None for w in model.layers[1].ffn.experts.stacked())


def test_quant_matmul_uses_the_cached_copy_from_cached_min_m(monkeypatch):
    from moestream.kernels.dequant_mm import cache_values
    from moestream.weights.qtensor import QTensor
    from moestream.weights.quantize import quantize

    values = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    w = QTensor(torch.from_numpy(quantize(values, ops._Q.Q4_K)), ops._Q.Q4_K, (64, 256))
    monkeypatch.setattr(ops, "_use_kernels", lambda x, *ws: True)
    cache_values(w, torch.float32)
    w.values.mul_(2.0)  # marks the copy: a product from it is twice the true one
    x = torch.randn(ops.CACHED_MIN_M, 256, generator=torch.Generator().manual_seed(2))
    ref = ops.quant_matmul_ref(x, w)
    torch.testing.assert_close(ops.quant_matmul(x, w), 2 * ref, rtol=1e-5, atol=1e-5)
    few = x[: ops.CACHED_MIN_M - 1]  # fewer rows: the quantized kernels, not the copy
    got = ops.quant_matmul(few, w)
    assert ((got - ref[: len(few)]).abs().max() / ref.abs().max()).item() < 2e-2

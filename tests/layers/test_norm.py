"""RMSNorm: float32 math whatever the activation dtype."""

from __future__ import annotations

import torch

from moestream.layers.norm import RMSNorm, rms_norm
from moestream.weights.qtensor import QTensor


def test_rms_norm_matches_float64_formula() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 32, generator=g) * 3, torch.randn(32, generator=g)
    ref = w.double() * x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm(x, w, 1e-6).double(), ref, rtol=1e-6, atol=1e-6)


def test_bf16_input_keeps_dtype_and_uses_float32_math() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 64, generator=g).bfloat16(), torch.randn(64, generator=g)
    out = RMSNorm(QTensor.from_float(w.bfloat16()), 1e-5, "cpu")(x)
    assert out.dtype == torch.bfloat16
    ref = rms_norm(x.float(), w.bfloat16().float(), 1e-5).bfloat16()
    assert torch.equal(out, ref)

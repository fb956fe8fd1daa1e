"""`kernels.swiglu.silu_mul` (Triton interpreter on the CPU) and the dense FFN's stacked
gate/up path (`layers.mlp.GatedMLP`)."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
pytest.importorskip("triton", reason="triton is not installed")

from moestream.kernels.mmvq import quantize_q8_ref  # noqa: E402
from moestream.kernels.swiglu import silu_mul, silu_mul_ref  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,f", [(1, 96), (3, 288), (5, 64)])
def test_silu_mul_matches_reference_and_q8_is_quantize_of_h(dtype, m, f):
    g = torch.Generator().manual_seed(m * 1000 + f)
    gu = (torch.randn(m, 2 * f, generator=g) * 3).to(DEVICE, dtype)
    gu[0, :32] = 0  # an all-zero block: d = 0
    h, xa = silu_mul(gu, q8=True, blocks=2)  # f / 32 blocks not a multiple of 2 for f = 96
    ref = silu_mul_ref(gu)
    assert h.dtype == dtype and h.shape == (m, f)
    torch.testing.assert_close(h, ref, rtol=2e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)
    want = quantize_q8_ref(h.float())  # the q8 of the values it returned, bit for bit
    assert xa is not None
    for got, exp in zip(xa, want):
        assert torch.equal(got, exp)
    h2, none = silu_mul(gu)
    assert none is None and torch.equal(h2, h)


def test_silu_mul_rows_are_independent():
    g = torch.Generator().manual_seed(7)
    gu = torch.randn(6, 128, generator=g).to(DEVICE)
    alone, xa1 = silu_mul(gu[2:3].clone(), q8=True)
    batch, xa6 = silu_mul(gu, q8=True)
    assert torch.equal(alone[0], batch[2]) and torch.equal(xa1.q[0], xa6.q[2])


def test_silu_mul_rejects_bad_shapes():
    with pytest.raises(ValueError, match="2F"):
        silu_mul(torch.zeros(2, 48, device=DEVICE))
    with pytest.raises(ValueError, match="2F"):
        silu_mul(torch.zeros(2, 128, device=DEVICE)[:, ::2])


@pytest.mark.skipif(
    DEVICE == "cuda", reason="the CPU references of the matmuls with the interpreter's kernel"
)
def test_gated_mlp_stacked_path_matches_reference(monkeypatch):
    """GatedMLP with gate and up stacked (the CUDA layout), on the kernel path with the matmuls'
    references on the CPU: the same output as the three separate matmuls, to rounding; the views
    it keeps for gate and up hold the original rows."""
    from gguf import GGMLQuantizationType as T

    from moestream.layers import mlp
    from moestream.weights.qtensor import QTensor
    from moestream.weights.quantize import quantize

    g = torch.Generator().manual_seed(3)

    def q(shape, qtype):
        data = quantize((torch.randn(shape, generator=g) * 0.05).numpy(), qtype)
        return QTensor(torch.from_numpy(data), qtype, shape)

    h, f = 256, 256
    gate, up, down = q((f, h), T.Q4_K), q((f, h), T.Q4_K), q((h, f), T.Q6_K)
    plain = mlp.GatedMLP(gate, up, down, fuse=False)
    fused = mlp.GatedMLP(gate, up, down, fuse=True)
    assert plain.gate_up is None and fused.gate_up is not None
    assert fused.gate_up.shape == (2 * f, h)
    assert torch.equal(fused.gate.data, gate.data) and torch.equal(fused.up.data, up.data)
    assert fused.gate.data.data_ptr() == fused.gate_up.data.data_ptr()  # views, no copy
    monkeypatch.setattr(mlp, "on_kernel_path", lambda x: True)
    x = torch.randn(3, h, generator=g)
    want = mlp.gated_mlp(x, gate, up, down)
    got = fused(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert isinstance(fused.gate_up, QTensor)

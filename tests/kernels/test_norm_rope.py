"""The fused residual-add + RMSNorm and q/k-norm + RoPE + KV-write kernels against their torch
references (`layers.norm.add_rms_norm_ref`, `layers.attention.qk_norm_rope_kv_ref`), with fresh
random inputs. Without CUDA the Triton interpreter runs them on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

from moestream.layers.attention import qk_norm_rope_kv_ref
from moestream.layers.norm import add_rms_norm_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # the modules above do not import triton; the kernel module below does
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

pytest.importorskip("triton", reason="triton is not installed")

from moestream.kernels.mmvq import quantize_q8  # noqa: E402
from moestream.kernels.norm_rope import add_rms_norm, add_rms_norm_q8, qk_norm_rope_kv  # noqa: E402


def randn(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def tol(dtype: torch.dtype) -> dict:
    # float32: reduction order only. 16-bit: one rounding of the output (the interpreter's
    # bfloat16 stores truncate instead of rounding: up to 2 ulps).
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
            torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}[dtype]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm(dtype, with_residual):
    x, w = randn(5, 96, seed=0, dtype=dtype), randn(96, seed=1)
    res = randn(5, 96, seed=2, dtype=dtype) if with_residual else None
    res_ref = res.clone() if res is not None else None
    out = add_rms_norm(x, res, w, 1e-6)
    ref = add_rms_norm_ref(x, res_ref, w, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **tol(dtype))
    if with_residual:
        torch.testing.assert_close(res, res_ref, **tol(dtype))  # updated in place to x + res


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("h, with_residual", [(96, True), (256, False)])
def test_add_rms_norm_q8_is_quantize_q8_of_the_norm(dtype, h, with_residual):
    """The norm's own q8 rounding equals `quantize_q8` of its output bit for bit (an all-zero
    block included), and the norm and the residual update are those of `add_rms_norm`."""
    x, w = randn(3, h, seed=0, dtype=dtype), randn(h, seed=1)
    x[1, 32:64] = 0
    res = randn(3, h, seed=2, dtype=dtype) if with_residual else None
    res_plain = res.clone() if res is not None else None
    if res is not None:
        res[1, 32:64] = 0
        res_plain[1, 32:64] = 0
    out, xa = add_rms_norm_q8(x, res, w, 1e-6)
    plain = add_rms_norm(x, res_plain, w, 1e-6)
    assert torch.equal(out, plain)
    if with_residual:
        assert torch.equal(res, res_plain)
    ref = quantize_q8(plain)
    for got, want in zip(xa, ref, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert (xa.d[1, 1] == 0).item() and xa.q[1].any()


def test_add_rms_norm_q8_needs_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        add_rms_norm_q8(randn(2, 48, seed=0), None, randn(48, seed=1), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("half, norms", [(16, True), (12, True), (16, False)])
def test_qk_norm_rope_kv(dtype, neox, half, norms):
    """Full and partial rotary (R = 32 or 24 of D = 32), NeoX and adjacent-pair layouts, with
    and without q/k norms; a negative slot writes nothing; q comes as a strided view of a merged
    QKV output, as the merged projection gives it."""
    t, n, g, d = 4, 6, 2, 32
    qkv = randn(t, (n + 2 * g) * d, seed=3, dtype=dtype)
    q, k, v = (y.view(t, -1, d) for y in qkv.split([n * d, g * d, g * d], dim=-1))
    cos, sin = randn(t, half, seed=4), randn(t, half, seed=5)
    qw, kw = (randn(d, seed=6), randn(d, seed=7)) if norms else (None, None)
    slots = torch.tensor([3, -1, 17, 9], device=DEVICE)
    caches = [torch.zeros(5, 4, g, d, dtype=dtype, device=DEVICE) for _ in range(4)]
    q_ref = q.clone()
    qk_norm_rope_kv(q, k, v, cos, sin, qw, kw, 1e-6, neox, slots, caches[0], caches[1])
    qk_norm_rope_kv_ref(q_ref, k.clone(), v, cos, sin, qw, kw, 1e-6, neox, slots, *caches[2:])
    torch.testing.assert_close(q, q_ref, **tol(dtype))
    torch.testing.assert_close(caches[0], caches[2], **tol(dtype))
    assert torch.equal(caches[1], caches[3])  # V is copied
    written = caches[0].flatten(0, 1).abs().sum(dim=(1, 2)) > 0
    assert written.nonzero().flatten().tolist() == [3, 9, 17]


def test_qk_norm_rope_kv_rejects_bad_arguments():
    q, k = randn(2, 4, 32, seed=0), randn(2, 2, 32, seed=1)
    cos = randn(2, 16, seed=2)
    kc = torch.zeros(2, 4, 2, 32, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        qk_norm_rope_kv(q, k, k, cos, cos, None, None, 1e-6, True, slots.int(), kc, kc.clone())
    with pytest.raises(ValueError, match="cos/sin"):
        qk_norm_rope_kv(q, k, k, cos[:, :8].repeat(1, 3), cos, None, None, 1e-6, True, slots,
                        kc, kc.clone())  # fmt: skip

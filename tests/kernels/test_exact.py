"""Reproducible float arithmetic (`kernels.exact`): the correctly rounded fma that the
interpreter is given, the SiLU built from correctly rounded operations, and the decode MoE
launches that turn the compiler's contraction off."""

from __future__ import annotations

import os
from fractions import Fraction

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed")
tl = pytest.importorskip("triton.language")

from moestream.kernels.exact import (  # noqa: E402
    FP_EXACT,
    exact_interpreter,
    exp_rn_ref,
    fma_f32,
    silu_rn,
    silu_rn_ref,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def round_f32(v: Fraction) -> np.float32:
    """The float32 nearest to the rational v, ties to even (the oracle)."""
    c = np.float32(float(v))
    best = None
    for cand in (np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))):
        err = abs(Fraction(float(cand)) - v)
        even = (cand.view(np.int32) & 1) == 0
        if best is None or err < best[0] or (err == best[0] and even):
            best = (err, cand)
    return best[1]


def test_fma_f32_rounds_once_where_the_float64_sum_lands_on_a_tie() -> None:
    """x * y + z = 1 + 2^-23 + 2^-24 - 2^-70: float64 rounds the sum to the float32 midpoint
    1 + 2^-23 + 2^-24, whose tie-to-even would give 1 + 2^-22; the exact value is below the
    midpoint, so the fma's answer is 1 + 2^-23."""
    x = np.float32(2.0**-24 * (1 + 2.0**-23))
    y = np.float32(1 - 2.0**-23)
    z = np.float32(1 + 2.0**-23)
    naive = np.float32(np.float64(x) * np.float64(y) + np.float64(z))
    got = fma_f32(np.array([x]), np.array([y]), np.array([z]))[0]
    assert got == np.float32(1 + 2.0**-23) != naive


def test_fma_f32_matches_exact_rational_rounding() -> None:
    rng = np.random.default_rng(0)
    n = 3000

    # significands with few bits make products and sums meet at ties often
    def draw() -> np.ndarray:
        mant = rng.integers(1, 1 << rng.integers(1, 25, n), dtype=np.int64)
        sign = rng.choice([-1.0, 1.0], n)
        return (sign * np.ldexp(mant.astype(np.float64), rng.integers(-40, 20, n))).astype(
            np.float32
        )

    x, y, z = draw(), draw(), draw()
    got = fma_f32(x, y, z)
    for i in range(n):
        exact = Fraction(float(x[i])) * Fraction(float(y[i])) + Fraction(float(z[i]))
        assert got[i] == round_f32(exact), (x[i], y[i], z[i])


def test_exp_and_silu_rn_are_accurate_and_their_cpu_copies_equal() -> None:
    g = torch.cat([
        torch.linspace(-100, 100, 4001), torch.randn(4000) * 6,
        torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.0, -87.0, 88.0, 89.0, -89.0]),
    ])  # fmt: skip
    want = torch.nn.functional.silu(g.double())
    got = silu_rn_ref(g)
    # within 3 ulp of the float32 result; below g = -87 (exp(-g) clamped at e^88) |silu| and
    # its error are under 1e-35
    tol = 3 * 2.0**-24 * want.abs() + torch.where(g < -87, 1e-35, 1e-44).double()
    assert ((got.double() - want).abs() <= tol).all()
    x = torch.linspace(-87, 88, 5001)
    e = exp_rn_ref(x).double()
    assert ((e - x.double().exp()).abs() <= 2 * 2.0**-23 * e).all()


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's fma; on a GPU the hardware's")
def test_exact_interpreter_gives_tl_fma_one_rounding_and_silu_rn_its_cpu_bits() -> None:
    """Under `exact_interpreter`, tl.fma(x, x, -(x * x)) is the product's rounding error (one
    rounding, as on the GPU; Triton 3.6's interpreter alone gives 0, 3.9's rounds once itself),
    and the kernel's silu_rn equals the CPU copy bit for bit."""

    @triton.jit
    def kernel(x_ptr, err_ptr, silu_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        x = tl.load(x_ptr + i)
        tl.store(err_ptr + i, tl.fma(x, x, -(x * x)))
        tl.store(silu_ptr + i, silu_rn(x))

    x = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 8
    err, silu = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    with exact_interpreter():
        kernel[(1,)](x, err, silu, N=64, **FP_EXACT)
    want = torch.from_numpy(fma_f32(x.numpy(), x.numpy(), -(x * x).numpy()))
    assert torch.equal(err, want) and err.count_nonzero() > 48
    assert torch.equal(silu, silu_rn_ref(x))


def test_decode_moe_launches_turn_contraction_off(monkeypatch) -> None:
    """Every launch of the decode MoE kernels (both paths) and of the q8 rounding passes
    `enable_fp_fusion=False` (`kernels.exact.FP_EXACT`)."""
    from moestream.kernels import mmvq, moe_grouped, moe_mmvq

    seen: dict[str, list[object]] = {}
    kernels = [
        (moe_mmvq, "_gate_up_once_kernel"), (moe_mmvq, "_gate_up_mmvq_kernel"),
        (moe_mmvq, "_down_mmvq_kernel"), (moe_grouped, "_gate_up_grouped_kernel"),
        (moe_grouped, "_down_grouped_kernel"), (mmvq, "_quantize_q8_kernel"),
    ]  # fmt: skip

    class Spy:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.setdefault(self.name, []).append(kwargs.get("enable_fp_fusion"))

            return launch

    for module, name in kernels:
        monkeypatch.setattr(module, name, Spy(name))
    from tests.kernels.test_moe_kernel import two_experts

    x, ids, weights, gate, up, down, slot = two_experts([[1, 0]], [[0.75, 0.25]], seed=3)
    out = torch.empty(1, x.shape[1])
    for cfg in (moe_mmvq.DEFAULT_CONFIG, moe_mmvq.MoeMmvqConfig(up_once=False)):
        moe_mmvq.fused_moe_mmvq(x, None, ids, weights, gate, up, down, slot, None, out, cfg,
                                None)  # fmt: skip
    moe_grouped.moe_grouped(x, ids, weights, gate, up, down, slot, out)
    assert set(seen) == {name for _, name in kernels}, seen
    assert all(v is False for calls in seen.values() for v in calls), seen


# ---- the GPU's bits against the interpreter's ------------------------------------------------

CHILD = r"""
import sys
import torch
from moestream.kernels.exact import exact_interpreter
from tests.kernels.test_exact import run_moes
operands = torch.load(sys.argv[1], weights_only=True)
with exact_interpreter():
    torch.save(run_moes(operands, "cpu"), sys.argv[2])
"""


def moe_operands(t: int, seed: int) -> dict[str, torch.Tensor]:
    """Random operands of the decode MoE (CPU tensors): 4 experts of H = 512, F = 256, Q4_K
    gate/up and Q6_K down, T tokens of 2 experts each."""
    from gguf import GGMLQuantizationType as T

    from moestream.weights.quantize import quantize

    g = torch.Generator().manual_seed(seed)
    ops: dict[str, torch.Tensor] = {}
    for name, qtype, shape in (("gate", T.Q4_K, (4, 256, 512)), ("up", T.Q4_K, (4, 256, 512)),
                               ("down", T.Q6_K, (4, 512, 256))):  # fmt: skip
        ops[name] = torch.from_numpy(quantize(torch.randn(shape, generator=g) * 0.05, qtype))
    ops["x"] = torch.randn(t, 512, generator=g)
    ops["ids"] = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(t)])
    ops["weights"] = torch.softmax(torch.randn(t, 2, generator=g), dim=-1)
    return ops


# The paths whose bits the CPU reproduces (H200, bench/RESULTS.md: both equal, bit for bit):
# every reduction in them is written out in the kernel's source (`tree_sum`, running sums). The
# default "once" launch's down leaves its sum to `tl.sum`, whose order on a GPU (lanes, then
# warps) is not the interpreter's: its bits are the GPU's own (there 675 of 1,024 outputs
# differed, by at most 2.4e-7).
REPRODUCIBLE_PATHS = ("hybrid", "grouped")


def run_moes(ops: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """The decode MoE's paths on `ops` (`moe_operands`) on `device`: "once" (the default
    launch), "hybrid" (`HYBRID_CONFIG`, the launch beside host-computed experts), "grouped";
    float32 [T, H] each, back on the CPU."""
    from gguf import GGMLQuantizationType as T

    from moestream.kernels.moe_grouped import moe_grouped
    from moestream.kernels.moe_mmvq import DEFAULT_CONFIG, HYBRID_CONFIG, fused_moe_mmvq
    from moestream.weights.qtensor import QTensor

    dev = torch.device(device)
    gate = QTensor(ops["gate"].to(dev), T.Q4_K, (4, 256, 512))
    up = QTensor(ops["up"].to(dev), T.Q4_K, (4, 256, 512))
    down = QTensor(ops["down"].to(dev), T.Q6_K, (4, 512, 256))
    x, ids, w = ops["x"].to(dev), ops["ids"].to(dev), ops["weights"].to(dev)
    slot = torch.arange(4, dtype=torch.int32, device=dev)
    out = {}
    for path, cfg in (("once", DEFAULT_CONFIG), ("hybrid", HYBRID_CONFIG)):
        y = torch.full((x.shape[0], 512), float("nan"), device=dev)
        fused_moe_mmvq(x, None, ids, w, gate, up, down, slot, None, y, cfg, None)
        out[path] = y.cpu()
    grouped = torch.full((x.shape[0], 512), float("nan"), device=dev)
    moe_grouped(x, ids, w, gate, up, down, slot, grouped)
    out["grouped"] = grouped.cpu()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA device")
def test_gpu_moe_bits_equal_the_exact_interpreters(tmp_path) -> None:
    """The decode MoE's output on the GPU (both paths) equals, bit for bit, the interpreter's
    under `exact_interpreter` on the same operands: the CPU can reproduce the GPU's experts."""
    import subprocess
    import sys
    from pathlib import Path

    ops = moe_operands(t=2, seed=5)
    torch.save(ops, tmp_path / "ops.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "ops.pt"), str(tmp_path / "cpu.pt")],
        capture_output=True, text=True, env=env, cwd=root, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    cpu = torch.load(tmp_path / "cpu.pt", weights_only=True)
    gpu = run_moes(ops, "cuda")
    for path in REPRODUCIBLE_PATHS:
        assert torch.isfinite(gpu[path]).all()
        diff = (gpu[path] != cpu[path]).sum().item()
        assert diff == 0, f"{path}: {diff} of {gpu[path].numel()} elements differ"

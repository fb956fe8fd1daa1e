"""Float arithmetic that rounds as written, so that other hardware can reproduce a kernel's bits.

A Triton kernel's float results are not fixed by its source alone. By default the compiler may
contract a multiply and an add into one fma (LLVM's contraction in the PTX, and ptxas again on
every `mul.f32` / `add.f32` without a rounding mode), and `tl.exp` / `tl.sigmoid` / `/` lower
to approximate instructions (`ex2.approx.f32`, `div.full.f32`) whose last bits are the
hardware's own. That is fine for a kernel checked within a tolerance, not for one whose output
another engine (the CPU, computing some experts of a layer) must reproduce bit for bit.

Kernels whose bits must be reproducible therefore:

- launch with `**FP_EXACT` (`enable_fp_fusion=False`: every f32 multiply, add and subtract
  in the PTX carries `.rn`, which neither LLVM nor ptxas contracts; an fma is there only where
  the source writes `tl.fma`);
- use `exp_rn` / `silu_rn` (below) instead of `tl.exp` / `tl.sigmoid`, and `tl.math.div_rn`
  for a division: they are built from correctly rounded operations only.

`tests/kernels/test_sm90_builds.py` checks the sm_90 builds of the decode MoE kernels for it.

Under `TRITON_INTERPRET=1` the interpreter runs a kernel's operations in numpy, one IEEE
operation each; Triton 3.9's rounds `tl.fma` once too, older ones (3.6) multiply and add.
`exact_interpreter()` gives those a correctly rounded fma (`fma_f32`), after which the
interpreter computes what the GPU build computes, bit for bit, for kernels written as above.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
import triton
import triton.language as tl

# Launch option of every kernel whose bits must not depend on the compiler (module docstring).
FP_EXACT: dict[str, bool] = {"enable_fp_fusion": False}

# exp(x) = 2^k * exp(r), k = floor(x * log2(e) + 1/2), r = x - k * ln 2 (ln 2 split in two, the
# high part with 12 significant bits so that k * LN2_HI is exact for |k| < 2^12); exp(r) for
# |r| <= ln(2) / 2 by its Taylor polynomial to degree 7 (truncation < 6e-9 relative, under
# a tenth of an ulp). Constexprs: the kernel and its CPU copy read the same constants.
LOG2E = tl.constexpr(1.4426950408889634)
LN2_HI = tl.constexpr(0.693145751953125)
LN2_LO = tl.constexpr(1.4286067653302226e-06)
C7, C6, C5, C4 = (tl.constexpr(1 / 5040), tl.constexpr(1 / 720), tl.constexpr(1 / 120),
                  tl.constexpr(1 / 24))  # fmt: skip
C3, C2 = tl.constexpr(1 / 6), tl.constexpr(1 / 2)
EXP_LO, EXP_HI = tl.constexpr(-87.0), tl.constexpr(88.0)  # x clamped: 2^k stays normal


@triton.jit
def exp_rn(x):
    """exp(x) for float32 x from correctly rounded operations only (the module docstring):
    within 2 ulp of exp for x in [-87, 88]; x is clamped to that range first (so silu_rn(g)
    for g < -87 is g / (1 + e^88), under 1e-35 in magnitude as silu(g) is)."""
    x = tl.minimum(tl.maximum(x, EXP_LO), EXP_HI)
    k = tl.floor(x * LOG2E + 0.5)
    r = tl.fma(k, -LN2_HI, x)
    r = tl.fma(k, -LN2_LO, r)
    p = tl.fma(r, C7, C6)
    p = tl.fma(p, r, C5)
    p = tl.fma(p, r, C4)
    p = tl.fma(p, r, C3)
    p = tl.fma(p, r, C2)
    p = tl.fma(p, r, 1.0)
    p = tl.fma(p, r, 1.0)
    scale = ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)  # 2^k
    return p * scale


@triton.jit
def silu_rn(g):
    """silu(g) = g / (1 + exp(-g)), correctly rounded operations only (`exp_rn`, `div_rn`)."""
    return tl.math.div_rn(g, 1.0 + exp_rn(-g))


# ---- the same arithmetic on the CPU -----------------------------------------------------------


def fma_f32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """x * y + z rounded once to float32 (round to nearest, ties to even), elementwise.

    x * y is exact in float64 (24 + 24 significant bits); the sum is taken in float64 rounded
    to odd (TwoSum gives its error; an inexact sum with an even last bit moves one ulp toward
    the error), and rounding to odd at 53 >= 2 * 24 + 2 bits then to nearest at 24 is the
    correct rounding (Boldo and Melquiond). Infinities and NaNs follow float64's rules."""
    x64, y64, z64 = (np.asarray(v, dtype=np.float32).astype(np.float64) for v in (x, y, z))
    p = x64 * y64
    s = p + z64
    with np.errstate(invalid="ignore", over="ignore"):
        bb = s - p
        err = (p - (s - bb)) + (z64 - bb)
        bits = s.view(np.int64)
        odd = (bits & 1) == 1
        fix = np.isfinite(s) & np.isfinite(err) & (err != 0) & ~odd
        toward = np.where(err > 0, np.inf, -np.inf)
        s = np.where(fix, np.nextafter(s, toward), s)
        return s.astype(np.float32)


def exp_rn_ref(x: torch.Tensor) -> torch.Tensor:
    """`exp_rn` on the CPU, operation for operation (float32 in, float32 out)."""
    f = _fma_torch
    x = x.float().clamp(EXP_LO.value, EXP_HI.value)
    k = torch.floor(x * torch.tensor(LOG2E.value, dtype=torch.float32) + 0.5)
    r = f(k, -LN2_HI.value, x)
    r = f(k, -LN2_LO.value, r)
    p = f(r, C7.value, C6.value)
    for c in (C5, C4, C3, C2, 1.0, 1.0):
        p = f(p, r, getattr(c, "value", c))
    scale = ((k.to(torch.int32) + 127) << 23).view(torch.float32)
    return p * scale


def silu_rn_ref(g: torch.Tensor) -> torch.Tensor:
    """`silu_rn` on the CPU, operation for operation."""
    g = g.float()
    return g / (1.0 + exp_rn_ref(-g))


def _fma_torch(x: torch.Tensor | float, y: torch.Tensor | float, z: torch.Tensor | float):
    shape = torch.broadcast_shapes(*(torch.as_tensor(v).shape for v in (x, y, z)))
    arrs = [np.broadcast_to(np.asarray(torch.as_tensor(v, dtype=torch.float32)), shape)
            for v in (x, y, z)]  # fmt: skip
    return torch.from_numpy(np.ascontiguousarray(fma_f32(*arrs)))


@contextlib.contextmanager
def exact_interpreter() -> Iterator[None]:
    """Within the block, Triton's interpreter (`TRITON_INTERPRET=1`) computes `tl.fma` with one
    rounding (`fma_f32`) instead of a multiply and an add: a kernel written for reproducible
    bits (the module docstring) then gives the GPU build's bits on the CPU."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    before = builder.create_fma

    def create_fma(self, x, y, z):
        if z.data.dtype == np.float32:
            return interpreter.TensorHandle(fma_f32(x.data, y.data, z.data), z.dtype.scalar)
        return before(self, x, y, z)

    builder.create_fma = create_fma
    try:
        yield
    finally:
        builder.create_fma = before

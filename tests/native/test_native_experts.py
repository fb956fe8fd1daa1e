"""The native CPU expert arithmetic (`moestream/native/experts.c`) gives the GPU kernels' bits:
checked against the Triton kernel under the interpreter with a correctly rounded fma
(`kernels.exact.exact_interpreter`), which computes what the GPU build does (see
`tests/kernels/test_sm90_builds.py` and the GPU test in `tests/kernels/test_exact.py`)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from moestream import native
from moestream.weights.qtensor import QTensor
from moestream.weights.quantize import quantize

pytest.importorskip("triton", reason="triton is not installed")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "compares with the Triton interpreter (TRITON_INTERPRET=1)", allow_module_level=True
    )
try:
    native.library()
except native.NativeUnavailable as e:
    pytest.skip(f"native code unavailable: {e}", allow_module_level=True)

from moestream.kernels.exact import exact_interpreter  # noqa: E402
from moestream.kernels.mmvq import quantize_q8  # noqa: E402
from moestream.kernels.moe_mmvq import DEFAULT_CONFIG, gate_up_q8  # noqa: E402


def q4_k_stack(f: int, k: int, seed: int, scale: float = 0.05) -> QTensor:
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(1, f, k, generator=g) * scale
    return QTensor(torch.from_numpy(quantize(values, T.Q4_K)), T.Q4_K, (1, f, k))


def bits(a: np.ndarray | torch.Tensor) -> np.ndarray:
    return np.asarray(a).view(np.int32) if np.asarray(a).dtype == np.float32 else np.asarray(a)


@pytest.mark.parametrize(
    ("k", "up_groups", "x_scale"),
    [(512, 8, 1.0), (1024, 8, 3.0), (512, 1, 1.0), (768, 2, 0.2)],
    ids=["K512", "K1024", "K512-two-steps", "K768-two-steps-masked"],
)
def test_gate_up_q4_k_has_the_once_kernels_bits(k: int, up_groups: int, x_scale: float) -> None:
    """h = silu(gate x) * (up x) rounded to q8 blocks: the C code's hq, hd, hs equal the "once"
    gate/up kernel's bit for bit, one step of all groups or several (K / 256 = 3 with G = 2: a
    step's second group masked)."""
    f = 64
    gate, up = q4_k_stack(f, k, seed=k), q4_k_stack(f, k, seed=k + 1)
    scalar = up_groups == 1  # one case through the portable integer code
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(7)) * x_scale
    xa = quantize_q8(x)
    cfg = replace(DEFAULT_CONFIG, up_groups=up_groups)
    ids = torch.zeros(1, 1, dtype=torch.int64)
    slot = torch.zeros(1, dtype=torch.int32)
    hf = torch.full((1, f), float("nan"))
    with exact_interpreter():
        hq, hd, hs = gate_up_q8(xa, ids, gate, up, slot, None, cfg, None, hf=hf)
    g = min(up_groups, 1 << (k // 256 - 1).bit_length())
    h = np.full(f, np.nan, np.float32)
    with native.scalar_only() if scalar else contextlib.nullcontext():
        cq, cd, cs = native.gate_up_q4_k(
        native.as_numpy(gate.data[0]), native.as_numpy(up.data[0]),
        native.as_numpy(xa.q[0]).view(np.int8), native.as_numpy(xa.d[0]),
        native.as_numpy(xa.s[0]), g, h_out=h,
    )  # fmt: skip
    assert cfg.up_block_n < 32  # so the kernel stored h before rounding it into hf
    assert np.array_equal(bits(h), bits(native.as_numpy(hf[0])))
    assert np.array_equal(cq, native.as_numpy(hq[0]).view(np.int8))
    assert np.array_equal(bits(cd), bits(native.as_numpy(hd[0])))
    assert np.array_equal(bits(cs), bits(native.as_numpy(hs[0])))
    assert np.abs(cq).max() == 127  # h was not all zero


def test_silu_rn_has_the_kernels_bits() -> None:
    """The C silu equals `exact.silu_rn_ref` (itself the Triton `silu_rn`'s bits under the
    interpreter, tests/kernels/test_exact.py) over a wide range and at the clamps."""
    from moestream.kernels.exact import silu_rn_ref

    g = torch.cat([torch.linspace(-120, 120, 20001), torch.randn(20000) * 5,
                   torch.tensor([0.0, -0.0, 1e-38, -1e-38, 87.0, -87.0, 88.0, -88.0])])  # fmt: skip
    assert np.array_equal(bits(native.silu_rn(g.numpy())), bits(silu_rn_ref(g).numpy()))


def test_gate_up_q4_k_rows_and_bad_arguments() -> None:
    """A row range fills only its q8 blocks, with the bits of the whole call; arguments the
    code cannot take are a ValueError, not a wrong answer."""
    f, k = 96, 512
    gate, up = q4_k_stack(f, k, seed=1), q4_k_stack(f, k, seed=2)
    xa = quantize_q8(torch.randn(1, k, generator=torch.Generator().manual_seed(3)))
    args = (native.as_numpy(gate.data[0]), native.as_numpy(up.data[0]),
            native.as_numpy(xa.q[0]).view(np.int8), native.as_numpy(xa.d[0]),
            native.as_numpy(xa.s[0]))  # fmt: skip
    whole = native.gate_up_q4_k(*args, 2)
    out = (np.zeros(f, np.int8), np.zeros(f // 32, np.float32), np.zeros(f // 32, np.float32))
    native.gate_up_q4_k(*args, 2, rows=(32, 64), out=out)
    assert np.array_equal(out[0][32:64], whole[0][32:64]) and not out[0][:32].any()
    assert out[1][1] == whole[1][1] and out[1][0] == 0 and out[1][2] == 0
    with pytest.raises(ValueError, match="cannot take"):
        native.gate_up_q4_k(*args, 3)
    with pytest.raises(ValueError, match="cannot take"):
        native.gate_up_q4_k(*args, 2, rows=(0, 40))
    with pytest.raises(ValueError, match="contiguous"):
        native.gate_up_q4_k(args[0].astype(np.int8), *args[1:], 2)


# each down type and each chunk once (a minute of the interpreter a case)
@pytest.mark.parametrize(
    ("down_type", "chunk"), [(T.Q6_K, 1), (T.Q4_K, 8)], ids=["Q6_K-1", "Q4_K-8"]
)
def test_a_tokens_experts_on_the_cpu_give_the_reproducible_kernels_bits(down_type, chunk) -> None:
    """One token, three experts: gate/up, SiLU, the q8 rounding of h and the weighted down
    projection of each computed by the C code, summed in selection order from 0.0, equal the
    "mmvq" path launched with `REPRODUCIBLE_DOWN` bit for bit (the kernel reading Q6_K in the
    padded layout, the C code the file's), whether the kernel's chunk holds one expert or all
    three (`down_each`: each reduced on its own)."""
    from moestream.kernels.moe_mmvq import REPRODUCIBLE_DOWN, down_groups, fused_moe_mmvq

    e, f, h, k = 4, 256, 256, 3
    gate = QTensor(q4_k_stack(e * f, h, seed=11).data.view(e, f, -1), T.Q4_K, (e, f, h))
    up = QTensor(q4_k_stack(e * f, h, seed=12).data.view(e, f, -1), T.Q4_K, (e, f, h))
    g = torch.Generator().manual_seed(13)
    down_values = torch.randn(e, h, f, generator=g) * 0.05
    down = QTensor(torch.from_numpy(quantize(down_values, down_type)), down_type, (e, h, f))
    x = torch.randn(1, h, generator=g)
    ids = torch.tensor([[2, 0, 3]])
    weights = torch.softmax(torch.randn(1, k, generator=g), dim=-1)
    slot = torch.arange(e, dtype=torch.int32)
    cfg = replace(DEFAULT_CONFIG, **REPRODUCIBLE_DOWN, down_experts=chunk)
    out = torch.full((1, h), float("nan"))
    with exact_interpreter():
        # the kernel reads Q6_K padded, as a resident model does; the CPU the file's blocks
        fused_moe_mmvq(x, None, ids, weights, gate, up, down.aligned(), slot, None, out, cfg,
                       None)  # fmt: skip
        xa = quantize_q8(x)
    xq, xd, xs = (native.as_numpy(v[0]) for v in (xa.q, xa.d, xa.s))
    up_g = min(cfg.up_groups, 1 << (h // 256 - 1).bit_length())
    down_g = down_groups(cfg, f)
    for scalar in (False, True):  # the AVX2 integer code where present, then the portable one
        with native.scalar_only() if scalar else contextlib.nullcontext():
            y = cpu_token(xq, xd, xs, ids[0], weights[0], gate, up, down, up_g, down_g)
        assert np.array_equal(bits(y), bits(native.as_numpy(out[0]))), scalar
    assert np.abs(y).max() > 0


def cpu_token(xq, xd, xs, ids, weights, gate, up, down, up_g: int, down_g: int) -> np.ndarray:
    """One token's MoE output by the native code: its experts in selection order, summed from
    0.0 as the reproducible down kernel adds them."""
    y = np.zeros(down.shape[1], np.float32)
    for j in range(ids.shape[0]):
        ex = int(ids[j])
        hq, hd, hs = native.gate_up_q4_k(
            native.as_numpy(gate.data[ex]), native.as_numpy(up.data[ex]), xq.view(np.int8),
            xd, xs, up_g,
        )  # fmt: skip
        t = native.down_rows(native.as_numpy(down.data[ex]), down.qtype == T.Q6_K, hq, hd, hs,
                             float(weights[j]), down_g)  # fmt: skip
        y = y + t
    return y


def test_host_rows_give_the_bits_of_every_expert_on_the_device() -> None:
    """A token whose middle expert is computed by the native code (slot -1, its weighted sums
    passed as `host_rows`) gets the output the kernels give with all three experts in slots:
    expert placement does not change a bit. Without the reproducible down launch the kernels
    refuse host rows."""
    from moestream.kernels.moe_mmvq import REPRODUCIBLE_DOWN, down_groups, fused_moe_mmvq

    e, f, h = 4, 256, 256
    g = torch.Generator().manual_seed(31)
    gate = QTensor(q4_k_stack(e * f, h, seed=32).data.view(e, f, -1), T.Q4_K, (e, f, h))
    up = QTensor(q4_k_stack(e * f, h, seed=33).data.view(e, f, -1), T.Q4_K, (e, f, h))
    down_values = torch.randn(e, h, f, generator=g) * 0.05
    down = QTensor(torch.from_numpy(quantize(down_values, T.Q6_K)), T.Q6_K, (e, h, f))
    x = torch.randn(1, h, generator=g)
    ids = torch.tensor([[2, 0, 3]])
    weights = torch.softmax(torch.randn(1, 3, generator=g), dim=-1)
    cfg = replace(DEFAULT_CONFIG, **REPRODUCIBLE_DOWN)
    resident = torch.arange(e, dtype=torch.int32)
    hybrid = torch.tensor([-1, 1, 2, 3], dtype=torch.int32)  # expert 0 on the host
    with exact_interpreter():
        want = torch.full((1, h), float("nan"))
        fused_moe_mmvq(x, None, ids, weights, gate, up, down, resident, None, want, cfg, None)
        xa = quantize_q8(x)
        host = torch.full((3, h), float("nan"))
        for a in range(3):
            t, j = divmod(a, 3)
            if int(ids[t, j]) != 0:
                continue
            hq, hd, hs = native.gate_up_q4_k(
                native.as_numpy(gate.data[0]), native.as_numpy(up.data[0]),
                native.as_numpy(xa.q[t]).view(np.int8), native.as_numpy(xa.d[t]),
                native.as_numpy(xa.s[t]), 1,
            )  # fmt: skip
            row = native.down_rows(native.as_numpy(down.data[0]), True, hq, hd, hs,
                                   float(weights[t, j]), down_groups(cfg, f))  # fmt: skip
            host[a] = torch.from_numpy(row)
        got = torch.full((1, h), float("nan"))
        fused_moe_mmvq(x, xa, ids, weights, gate, up, down, hybrid, None, got, cfg, None,
                       host_rows=host)  # fmt: skip
    # (experts found by address with host rows, zero-copy placement's launch, keep these bits
    # too: tests/experts/test_host_compute.py, through `ZeroCopyExperts`)
    assert np.array_equal(bits(got.numpy()), bits(want.numpy()))
    with pytest.raises(ValueError, match="REPRODUCIBLE_DOWN"):
        fused_moe_mmvq(x, xa, ids, weights, gate, up, down, hybrid, None, got, DEFAULT_CONFIG,
                       None, host_rows=host)  # fmt: skip


@pytest.mark.parametrize("threads", [1, 2])
def test_moe_host_rows_equal_the_row_functions_at_any_thread_count(threads: int) -> None:
    """A layer's host assignments in one call, spread over threads: each row as gate_up_q4_k
    then down_rows give it (Q6_K and Q4_K downs, two tokens); bad shapes are a ValueError."""
    f, h = 256, 512
    rng = np.random.default_rng(5)
    experts = []
    for i in range(3):
        gate = native.as_numpy(q4_k_stack(f, h, seed=50 + i).data[0])
        up = native.as_numpy(q4_k_stack(f, h, seed=60 + i).data[0])
        q6 = i != 1
        values = torch.from_numpy(rng.standard_normal((h, f)).astype(np.float32) * 0.05)
        down = quantize(values, T.Q6_K if q6 else T.Q4_K)
        experts.append((gate, up, down, q6))
    xa = quantize_q8(torch.randn(2, h, generator=torch.Generator().manual_seed(6)))
    xq = native.as_numpy(xa.q).view(np.int8)
    xd, xs = native.as_numpy(xa.d), native.as_numpy(xa.s)
    tokens, weights = [0, 1, 1], [0.5, 0.25, 0.125]
    rows = native.moe_host_rows(experts, tokens, weights, xq, xd, xs, 2, 1, threads=threads)
    for i, (gate, up, down, q6) in enumerate(experts):
        t = tokens[i]
        hq, hd, hs = native.gate_up_q4_k(gate, up, xq[t], xd[t], xs[t], 2)
        want = native.down_rows(down, q6, hq, hd, hs, weights[i], 1)
        assert np.array_equal(bits(rows[i]), bits(want)), i
    with pytest.raises(ValueError, match="cannot take"):
        native.moe_host_rows(experts, tokens, weights, xq, xd, xs, 3, 1)
    with pytest.raises(ValueError, match="length"):
        native.moe_host_rows(experts, tokens[:2], weights, xq, xd, xs, 2, 1)


def test_moe_host_rows_give_the_same_rows_from_two_callers_at_any_size() -> None:
    """moe_host_rows from two Python threads at once (each its own team), calls of 1-8 threads
    and 1-4 assignments: each gives the rows of one thread, bit for bit."""
    from concurrent.futures import ThreadPoolExecutor

    f, h = 256, 256
    experts = [
        (native.as_numpy(q4_k_stack(f, h, seed=70 + i).data[0]),
         native.as_numpy(q4_k_stack(f, h, seed=80 + i).data[0]),
         native.as_numpy(q4_k_stack(h, f, seed=90 + i).data[0]), False)
        for i in range(4)
    ]  # fmt: skip
    xa = quantize_q8(torch.randn(2, h, generator=torch.Generator().manual_seed(7)))
    x = (native.as_numpy(xa.q).view(np.int8), native.as_numpy(xa.d), native.as_numpy(xa.s))
    calls = [(n, threads) for n in (1, 2, 3, 4) for threads in (1, 2, 3, 8)]

    def rows(n: int, threads: int) -> np.ndarray:
        tokens, weights = [i % 2 for i in range(n)], [0.5 / (i + 1) for i in range(n)]
        return native.moe_host_rows(experts[:n], tokens, weights, *x, 1, 1, threads=threads)

    want = {n: bits(rows(n, 1)) for n in (1, 2, 3, 4)}
    with ThreadPoolExecutor(2) as pool:
        for _ in range(3):
            got = list(pool.map(lambda c: (c[0], bits(rows(*c))), calls + calls[::-1]))
            for n, b in got:
                assert np.array_equal(b, want[n]), n

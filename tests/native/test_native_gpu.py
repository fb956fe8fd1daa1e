"""On a GPU: a token's experts computed by the native CPU code (`moestream.native`) give the
decode MoE kernels' bits at the Qwen3-30B-A3B shapes, with the GPU reading padded Q6_K blocks
(as a resident model does) and the CPU the file's (as a host tier holds them)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from moestream import native
from moestream.weights.qtensor import QTensor
from moestream.weights.quantize import quantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def need_native() -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    try:
        native.library()
    except native.NativeUnavailable as e:
        pytest.skip(f"native code unavailable: {e}")


def operands(seed: int, down_type: T, e: int = 16, t: int = 2) -> tuple:
    """Random CPU operands at the Qwen3-30B-A3B shapes (H 2048, F 768, top-8 of e experts, Q4_K
    gate/up): gate, up, down, x [t, H], ids [t, 8], weights [t, 8]."""
    g = torch.Generator().manual_seed(seed)

    def stack(qtype, shape):
        values = torch.randn(shape, generator=g) * 0.05
        return QTensor(torch.from_numpy(quantize(values, qtype)), qtype, shape)

    f, h, k = 768, 2048, 8
    gate, up, down = stack(T.Q4_K, (e, f, h)), stack(T.Q4_K, (e, f, h)), stack(down_type, (e, h, f))
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    return gate, up, down, x, ids, weights


def on_gpu(gate: QTensor, up: QTensor, down: QTensor) -> list[QTensor]:
    """The stacks on the GPU as a resident model holds them (Q6_K padded)."""
    dev = torch.device("cuda")
    return [QTensor(w.data.to(dev), w.qtype, w.shape).aligned() for w in (gate, up, down)]


@pytest.mark.parametrize("down_type", [T.Q6_K, T.Q4_K], ids=["Q6_K", "Q4_K"])
def test_cpu_experts_give_the_gpus_bits(down_type) -> None:
    need_native()
    from moestream.kernels.mmvq import quantize_q8
    from moestream.kernels.moe_mmvq import (
        DEFAULT_CONFIG,
        REPRODUCIBLE_DOWN,
        down_groups,
        fused_moe_mmvq,
    )

    gate, up, down, x, ids, weights = operands(21, down_type)
    (e, f, h), (t, k) = gate.shape, ids.shape
    dev = torch.device("cuda")
    gpu = on_gpu(gate, up, down)
    cfg = replace(DEFAULT_CONFIG, **REPRODUCIBLE_DOWN)
    out = torch.full((t, h), float("nan"), device=dev)
    slot = torch.arange(e, dtype=torch.int32, device=dev)
    xg = x.to(dev)
    xa = quantize_q8(xg)
    fused_moe_mmvq(xg, xa, ids.to(dev), weights.to(dev), *gpu, slot, None, out, cfg, None)
    want = out.cpu().numpy()
    up_g = min(cfg.up_groups, 1 << (h // 256 - 1).bit_length())
    down_g = down_groups(cfg, f)
    for i in range(t):
        xq = native.as_numpy(xa.q[i]).view(np.int8)
        xd, xs = native.as_numpy(xa.d[i]), native.as_numpy(xa.s[i])
        y = np.zeros(h, np.float32)
        for j in range(k):
            ex = int(ids[i, j])
            rows = [native.as_numpy(w.data[ex]) for w in (gate, up, down)]
            hq, hd, hs = native.gate_up_q4_k(rows[0], rows[1], xq, xd, xs, up_g)
            wt = float(weights[i, j])
            y = y + native.down_rows(rows[2], down_type == T.Q6_K, hq, hd, hs, wt, down_g)
        differ = int((y.view(np.int32) != want[i].view(np.int32)).sum())
        assert differ == 0, f"token {i}: {differ} of {h} outputs differ"


def test_host_rows_on_the_gpu_keep_the_bits() -> None:
    """At the 30B's shapes on the GPU: two tokens whose experts 0-3 are computed by the native
    code (slot -1, `host_rows`) get the output of all experts in slots, bit for bit."""
    need_native()
    from moestream.kernels.mmvq import quantize_q8
    from moestream.kernels.moe_mmvq import (
        DEFAULT_CONFIG,
        REPRODUCIBLE_DOWN,
        down_groups,
        fused_moe_mmvq,
    )

    gate, up, down, x, ids, weights = operands(41, T.Q6_K)
    (e, _, h), (t, k) = gate.shape, ids.shape
    dev = torch.device("cuda")
    gpu = on_gpu(gate, up, down)
    cfg = replace(DEFAULT_CONFIG, **REPRODUCIBLE_DOWN)
    xg, idg, wg = x.to(dev), ids.to(dev), weights.to(dev)
    xa = quantize_q8(xg)
    want = torch.full((t, h), float("nan"), device=dev)
    resident = torch.arange(e, dtype=torch.int32, device=dev)
    fused_moe_mmvq(xg, xa, idg, wg, *gpu, resident, None, want, cfg, None)
    host = torch.zeros(t * k, h)
    for a in range(t * k):
        i, j = divmod(a, k)
        ex = int(ids[i, j])
        if ex >= 4:
            continue
        xq = native.as_numpy(xa.q[i]).view(np.int8)
        rows = [native.as_numpy(w.data[ex]) for w in (gate, up, down)]
        hq, hd, hs = native.gate_up_q4_k(rows[0], rows[1], xq, native.as_numpy(xa.d[i]),
                                         native.as_numpy(xa.s[i]), 8)  # fmt: skip
        host[a] = torch.from_numpy(native.down_rows(rows[2], True, hq, hd, hs,
                                                    float(weights[i, j]),
                                                    down_groups(cfg, gate.shape[1])))  # fmt: skip
    hybrid = torch.where(torch.arange(e) < 4, -1, torch.arange(e)).to(dev, torch.int32)
    got = torch.full((t, h), float("nan"), device=dev)
    fused_moe_mmvq(xg, xa, idg, wg, *gpu, hybrid, None, got, cfg, None, host_rows=host.to(dev))
    assert (ids < 4).any()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))

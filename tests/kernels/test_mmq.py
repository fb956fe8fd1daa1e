"""MMQ (int8 tensor-core quantized matmul, dense and fused MoE) against its torch references, on
random GGUF blocks (every bit pattern of the quants and packed scales) and quantized weights.
Without CUDA the Triton interpreter runs the kernels on the CPU (byte-packed PTX emulated)."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

pytest.importorskip("triton", reason="triton is not installed")

from moestream.kernels.mmq import MmqConfig, mmq, mmq_config  # noqa: E402
from moestream.kernels.mmvq import mmvq_ref as mmq_ref  # noqa: E402  (the same product)
from moestream.kernels.mmvq import quantize_q8  # noqa: E402
from moestream.kernels.moe_mmq import moe_mmq, moe_mmq_config  # noqa: E402
from moestream.kernels.moe_mmvq import moe_mmvq_ref as moe_mmq_ref  # noqa: E402  (same numerics)
from tests.kernels.test_moe_kernel import rel_err, routing, stacked  # noqa: E402
from tests.kernels.test_quant_matmul import activations, quantized, random_blocks  # noqa: E402

T = GGMLQuantizationType
TYPES = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [1, 9, 17, 33])
def test_mmq_random_blocks(qtype: GGMLQuantizationType, m: int) -> None:
    n, k = (96, 512) if m < 17 else (64, 256)  # 96: a partial column block
    w = random_blocks(qtype, n, k, seed=int(qtype) + m)
    a = quantize_q8(activations(m, k, torch.float32, seed=m))
    out = torch.full((m, n), float("nan"), device=DEVICE)
    y = mmq(a, w, out=out, config=MmqConfig(block_m=16 if m < 17 else 32, block_n=64))
    assert rel_err(y, mmq_ref(a, w)) < 2e-5


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K])
def test_mmq_split_k_close_to_float_and_batch_invariant(qtype: GGMLQuantizationType) -> None:
    w = quantized(qtype, (64, 1024), seed=3)
    x = activations(17, 1024, torch.float32, seed=4)
    cfg = MmqConfig(block_m=32, block_n=64, split_k=2)
    y = mmq(quantize_q8(x), w, config=cfg)
    assert rel_err(y, mmq_ref(quantize_q8(x), w)) < 2e-5
    exact = x @ w.dequantize(torch.float32).t()
    assert rel_err(y, exact) < 2e-2  # 8-bit activations
    # a row gives the same bits alone (a 16-row tile) as in a 32-row tile of 17
    one = mmq(quantize_q8(x[5:6]), w, config=cfg._replace(block_m=16))
    assert torch.equal(one[0], y[5])


@pytest.mark.parametrize("split", [2, 4])
def test_mmq_fused_split_sum_matches_the_two_launch_sum(monkeypatch, split: int) -> None:
    """`FUSED_SPLIT_SUM`: the last program of each tile to arrive adds the K split's partials in
    split order and stores the output, a bfloat16 [M, N] as the layers ask; equal to the torch
    sum of the same partials to float32 rounding, a row's bits the same alone as among 17, and
    the counters left at zero (two tiles of rows, one of columns past N)."""
    import moestream.kernels.mmq as mmq_module

    w = quantized(T.Q4_K, (80, 1024), seed=5)
    x = activations(17, 1024, torch.float32, seed=6)
    cfg = MmqConfig(block_m=16, block_n=64, split_k=split)
    want = mmq(quantize_q8(x), w, config=cfg)  # float32 out: the two-launch sum
    monkeypatch.setattr(mmq_module, "FUSED_SPLIT_SUM", True)
    got = mmq(quantize_q8(x), w, config=cfg)
    assert rel_err(got, want) < 1e-6
    bf16 = mmq(quantize_q8(x), w, out_dtype=torch.bfloat16, config=cfg)
    # within a bfloat16 step (the interpreter's cast truncates; the GPU's rounds to nearest)
    torch.testing.assert_close(bf16.float(), got, rtol=2**-7, atol=0)
    one = mmq(quantize_q8(x[5:6]), w, config=cfg)
    assert torch.equal(one[0], got[5])
    counters = mmq_module.split_counters(got.device)
    assert counters is not None and not counters.any()


def test_mmq_config_and_bad_input() -> None:
    cfg = mmq_config(8, 4096, 2048, sms=132)
    assert cfg.block_m == 16 and cfg.split_k == 8  # 64 column blocks: 512 programs of a group
    assert mmq_config(64, 4096, 2048, sms=132).split_k == cfg.split_k  # independent of M
    assert mmq_config(64, 151936, 2048, sms=132) == MmqConfig(64, 64, 1, 8, 3)  # many blocks
    w = quantized(T.Q4_K, (64, 256), seed=0)
    with pytest.raises(ValueError, match="K="):
        mmq(quantize_q8(activations(1, 512, torch.float32, 0)), w)
    with pytest.raises(ValueError, match="no kernel"):
        mmq(quantize_q8(activations(1, 256, torch.float32, 0)), quantized(T.Q2_K, (8, 256), 0))
    with pytest.raises(ValueError, match="BLOCK_M"):
        mmq(quantize_q8(activations(1, 256, torch.float32, 0)), w, config=MmqConfig(8, 64))


H, FF = 256, 256  # hidden, expert FFN
E, S = 6, 5  # experts, weight slots: expert 5 has no slot and is never routed to
SLOT = [3, 0, 4, 1, 2, -1]  # a permutation of the slots


@pytest.mark.parametrize(
    "qtypes, t, k, experts, block_m",
    [
        ((T.Q4_K, T.Q5_K, T.Q6_K), 5, 2, [0, 1, 3, 4], 16),  # expert 2 gets no token
        ((T.Q8_0, T.Q8_0, T.Q4_K), 20, 2, [1, 3], 16),  # 20 rows per expert: two blocks each
        ((T.Q6_K, T.Q6_K, T.Q8_0), 9, 3, [0, 1, 2, 3, 4], 32),
    ],
)
def test_moe_mmq_matches_reference(qtypes, t, k, experts, block_m) -> None:
    gate = stacked(qtypes[0], (S, FF, H), seed=1)
    up = stacked(qtypes[1], (S, FF, H), seed=2)
    down = stacked(qtypes[2], (S, H, FF), seed=3)
    slot = torch.tensor(SLOT, dtype=torch.int32, device=DEVICE)
    ids, weights = routing(t, k, experts, seed=t)
    x = activations(t, H, torch.float32, seed=t + 1)
    out = torch.full((t, H), float("nan"), device=DEVICE)
    cfg = MmqConfig(block_m=block_m, block_n=64)
    moe_mmq(x, ids, weights, gate, up, down, slot, out=out, config=cfg)
    # h is rounded to 8 bits from float32 sums taken in another order than the reference's:
    # a value on a rounding boundary may land one step away
    assert rel_err(out, moe_mmq_ref(x, ids, weights, gate, up, down, slot)) < 2e-3


def test_moe_mmq_register_cap() -> None:
    """A config with a register cap (`maxnreg`, a launch option: ptxas caps the GPU build, the
    interpreter has no registers) launches and matches the reference; a cap that buys no
    more warps or that ptxas cannot take is refused before any launch."""
    gate = stacked(T.Q4_K, (S, FF, H), seed=1)
    up = stacked(T.Q4_K, (S, FF, H), seed=2)
    down = stacked(T.Q6_K, (S, H, FF), seed=3)
    slot = torch.tensor(SLOT, dtype=torch.int32, device=DEVICE)
    ids, weights = routing(5, 2, [0, 1, 3, 4], seed=5)
    x = activations(5, H, torch.float32, seed=6)
    cfg = MmqConfig(block_m=16, block_n=64, num_warps=4, num_stages=1, maxnreg=128)
    assert cfg.launch_options == {"num_warps": 4, "num_stages": 1, "maxnreg": 128}
    assert "maxnreg" not in MmqConfig().launch_options  # no cap: Triton's default launch
    out = moe_mmq(x, ids, weights, gate, up, down, slot, config=cfg)
    assert rel_err(out, moe_mmq_ref(x, ids, weights, gate, up, down, slot)) < 2e-3
    for bad in (100, 32, 256):
        with pytest.raises(ValueError, match="maxnreg"):
            moe_mmq(x, ids, weights, gate, up, down, slot, config=cfg._replace(maxnreg=bad))


def test_moe_mmq_config_and_bad_input() -> None:
    assert moe_mmq_config(8 * 8, 128).block_m == 16
    assert moe_mmq_config(1024 * 8, 128).block_m == 64
    gate = stacked(T.Q4_K, (S, FF, H), seed=1)
    down = stacked(T.Q2_K, (S, H, FF), seed=3)
    ids, weights = routing(2, 2, [0, 1], seed=0)
    x = activations(2, H, torch.float32, seed=0)
    slot = torch.tensor(SLOT, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="no kernel"):
        moe_mmq(x, ids, weights, gate, gate, down, slot)
    with pytest.raises(ValueError, match="expert_slot"):
        moe_mmq(x, ids, weights, gate, gate, gate, None)

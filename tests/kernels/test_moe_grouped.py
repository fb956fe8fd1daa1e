"""The "grouped" MoE path (each expert's weights read once per block of its assignments)
against the mmvq reference. Without CUDA the Triton interpreter runs it on the CPU, where each
weight row of a block costs ~0.1 s (the "once" step's integer dots are emulated): the CPU
cases are the smallest that cover the path (one expert block, padding, three weight types);
on a GPU more shapes run."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

pytest.importorskip("triton", reason="triton is not installed")

from moestream.kernels import moe as moe_module  # noqa: E402
from moestream.kernels import moe_grouped as grouped_module  # noqa: E402
from moestream.kernels.mmvq import MMVQ_QTYPES, quantize_q8  # noqa: E402
from moestream.kernels.moe import default_method, fused_moe  # noqa: E402
from moestream.kernels.moe_grouped import MoeGroupedConfig, grouped_config, moe_grouped  # noqa: E402
from moestream.kernels.moe_mmvq import moe_mmvq_ref  # noqa: E402
from moestream.weights.qtensor import QTensor  # noqa: E402
from tests.kernels.test_moe_kernel import rel_err, routing, stacked  # noqa: E402
from tests.kernels.test_quant_matmul import activations, random_blocks  # noqa: E402

T = GGMLQuantizationType
H, FF = 256, 256  # hidden, expert FFN: one group of 256 each
E, S = 6, 5  # experts, weight slots: expert 5 has no slot and is never routed to
SLOT = [3, 0, 4, 1, 2, -1]  # a permutation of the slots


def code_stack(qtype: GGMLQuantizationType, shape: tuple[int, int, int], seed: int) -> QTensor:
    """Random expert blocks [S, out, in] of a 4-bit code type (no quantizer for all of them
    here): `random_blocks` rows, stacked."""
    s, n, k = shape
    w = random_blocks(qtype, s * n, k, seed=seed)
    return QTensor(w.data.view(s, n, -1), qtype, shape)


@pytest.mark.parametrize(
    "qtypes", [(T.Q4_0, T.IQ4_XS, T.MXFP4), (T.IQ4_NL, T.Q4_0, T.IQ4_XS)], ids=["a", "b"]
)
def test_moe_grouped_reads_the_4_bit_code_types(qtypes) -> None:
    """Q4_0, IQ4_NL, IQ4_XS and MXFP4 experts (the dense "once" step's code types): against
    the mmvq reference, and the default path for them from one token on."""
    gate = code_stack(qtypes[0], (S, FF, H), seed=1)
    up = code_stack(qtypes[1], (S, FF, H), seed=2)
    down = code_stack(qtypes[2], (S, H, FF), seed=3)
    slot = torch.tensor(SLOT, dtype=torch.int32, device=DEVICE)
    ids = torch.tensor([[2], [2]], device=DEVICE)
    weights = torch.tensor([[0.75], [0.5]], device=DEVICE)
    x = activations(2, H, torch.float32, seed=4) * 0.02  # random blocks' scales reach 1
    out = torch.full((2, H), float("nan"), device=DEVICE)
    moe_grouped(x, ids, weights, gate, up, down, slot, out, MoeGroupedConfig(block_m=2))
    assert rel_err(out, moe_mmvq_ref(x, ids, weights, gate, up, down, slot)) < 2e-3
    assert [default_method(a, gate, up, down) for a in (1, 8, 512)] == ["grouped"] * 3
    assert default_method(513, gate, up, down) != "grouped"


def test_moe_grouped_matches_reference_and_a_rows_bits_do_not_depend_on_its_place() -> None:
    """Three tokens routed to one expert: one block of 4 (a padding row), gate Q4_K, up Q6_K,
    down Q8_0. Tokens 0 and 2 have the same activations and routing, at different places in
    the block: their outputs have the same bits (a row's sums are a fixed tree)."""
    gate = stacked(T.Q4_K, (S, FF, H), seed=1)
    up = stacked(T.Q6_K, (S, FF, H), seed=2)
    down = stacked(T.Q8_0, (S, H, FF), seed=3)
    slot = torch.tensor(SLOT, dtype=torch.int32, device=DEVICE)
    ids = torch.tensor([[3], [3], [3]], device=DEVICE)
    weights = torch.tensor([[0.75], [0.5], [0.75]], device=DEVICE)
    x = activations(3, H, torch.float32, seed=4)
    x[2] = x[0]
    out = torch.full((3, H), float("nan"), device=DEVICE)
    moe_grouped(x, ids, weights, gate, up, down, slot, out, MoeGroupedConfig(block_m=4))
    # h is rounded to 8 bits from float32 sums taken in another order than the reference's:
    # a value on a rounding boundary may land one step away
    assert rel_err(out, moe_mmvq_ref(x, ids, weights, gate, up, down, slot)) < 2e-3
    assert torch.equal(out[0], out[2])


@pytest.mark.skipif(DEVICE == "cpu", reason="minutes in the Triton interpreter; runs on a GPU")
@pytest.mark.parametrize(
    "qtypes, t, k, experts, cfg",
    [
        ((T.Q4_K, T.Q5_K, T.Q6_K), 5, 2, [0, 1, 3, 4], MoeGroupedConfig()),
        ((T.Q8_0, T.Q8_0, T.Q4_K), 20, 2, [1, 3], MoeGroupedConfig(block_m=8, up_block_n=16)),
        ((T.Q6_K, T.Q6_K, T.Q8_0), 9, 3, [0, 1, 2, 3, 4], MoeGroupedConfig(block_m=2)),
        ((T.Q4_K, T.Q4_K, T.Q6_K), 7, 2, [0, 1, 2, 3, 4], MoeGroupedConfig(block_m=1)),
        ((T.Q5_K, T.Q4_K, T.Q5_K), 12, 2, [0, 4], MoeGroupedConfig(block_m=16, up_groups=1)),
        ((T.IQ4_XS, T.IQ4_NL, T.Q4_0), 6, 2, [0, 1, 2, 3, 4], MoeGroupedConfig()),
        ((T.MXFP4, T.MXFP4, T.IQ4_XS), 1, 2, [0, 3], MoeGroupedConfig(block_m=2)),
    ],
)
def test_moe_grouped_shapes_match_reference(qtypes, t, k, experts, cfg) -> None:
    h = 2048  # 8 groups: K loops of several steps

    def weights_of(qtype, shape, seed):
        maker = stacked if qtype in MMVQ_QTYPES else code_stack
        return maker(qtype, shape, seed=seed)

    gate = weights_of(qtypes[0], (S, FF, h), seed=1)
    up = weights_of(qtypes[1], (S, FF, h), seed=2)
    down = weights_of(qtypes[2], (S, h, FF), seed=3)
    slot = torch.tensor(SLOT, dtype=torch.int32, device=DEVICE)
    ids, weights = routing(t, k, experts, seed=t)
    x = activations(t, h, torch.float32, seed=t + 1)
    out = torch.full((t, h), float("nan"), device=DEVICE)
    moe_grouped(x, ids, weights, gate, up, down, slot, out, cfg)
    assert rel_err(out, moe_mmvq_ref(x, ids, weights, gate, up, down, slot)) < 2e-3


def test_fused_moe_dispatches_the_grouped_path_and_rejects_bad_input(monkeypatch) -> None:
    gate = stacked(T.Q4_K, (S, FF, H), seed=1)
    q2 = stacked(T.Q2_K, (S, H, FF), seed=3)
    slot = torch.tensor(SLOT, dtype=torch.int32, device=DEVICE)
    ids, weights = routing(3, 2, [0, 1, 2], seed=0)
    x = activations(3, H, torch.float32, seed=1)
    calls = []
    monkeypatch.setattr(grouped_module, "moe_grouped", lambda *a, **kw: calls.append(kw) or a[7])
    out = fused_moe(x, ids, weights, gate, gate, gate, slot, method="grouped")
    assert calls == [{"xa": None}] and out.shape == x.shape
    # the default path takes it inside its range of assignments, for kernel types only
    monkeypatch.setattr(moe_module, "GROUPED_MIN_ASSIGNMENTS", 4)
    monkeypatch.setattr(moe_module, "GROUPED_MAX_ASSIGNMENTS", 8)
    assert [default_method(a, gate, gate, gate) for a in (3, 4, 8, 9)] == [
        "mmvq",
        "grouped",
        "grouped",
        "mmvq",
    ]
    assert default_method(6, gate, gate, q2) != "grouped"
    monkeypatch.undo()
    # two assignments a block up to 2.5 an expert on average, four above
    assert [grouped_config(a, 128).block_m for a in (128, 256, 320, 321, 512)] == [2, 2, 2, 4, 4]
    # one warp for the gate/up at two a block; two at four (one warp spills there on sm_90)
    assert [grouped_config(a, 128).up_warps for a in (256, 321)] == [1, 2]
    with pytest.raises(ValueError, match="MMVQ_DENSE_QTYPES"):
        moe_grouped(x, ids, weights, gate, gate, q2, slot, torch.empty_like(x))
    buf = torch.empty(gate.data.numel() + 2, dtype=torch.uint8, device=DEVICE)
    buf[2:] = gate.data.reshape(-1)
    odd = QTensor(buf[2:].view(gate.data.shape), T.Q4_K, gate.shape)  # 2 bytes off: not 4
    with pytest.raises(ValueError, match="aligned"):
        moe_grouped(x, ids, weights, gate, gate, odd, slot, torch.empty_like(x))
    with pytest.raises(ValueError, match="expert_slot"):
        moe_grouped(x, ids, weights, gate, gate, gate, None, torch.empty_like(x))
    with pytest.raises(ValueError, match="q8 blocks"):  # the caller's q8 of another x
        moe_grouped(x, ids, weights, gate, gate, gate, slot, torch.empty_like(x),
                    xa=quantize_q8(x[:2]))  # fmt: skip
    for bad in (dict(block_m=3), dict(block_m=32), dict(up_warps=3)):
        with pytest.raises(ValueError, match="MoeGroupedConfig"):
            MoeGroupedConfig(**bad)


@pytest.mark.skipif(DEVICE == "cpu", reason="the interpreter has no warps or register layouts")
@pytest.mark.parametrize("qtypes", [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q6_K, T.Q5_K, T.Q8_0)])
def test_moe_grouped_bits_do_not_depend_on_gate_up_warps_or_rows(qtypes) -> None:
    """The gate/up programs' warps and rows (what `grouped_config` picks by the number of
    assignments) leave every output's bits as they are. Each warp count compiles its own
    register layout; the K-quants' min term is an explicit fma since this failed on the H200
    (the compiler contracted `part - dmin * m` in some layouts only: `mmvq._acc_q4_k`)."""
    h = 2048
    gate = stacked(qtypes[0], (S, FF, h), seed=11)
    up = stacked(qtypes[1], (S, FF, h), seed=12)
    down = stacked(qtypes[2], (S, h, FF), seed=13)
    slot = torch.tensor(SLOT, dtype=torch.int32, device=DEVICE)
    ids, weights = routing(9, 2, [0, 1, 2, 3, 4], seed=9)
    x = activations(9, h, torch.float32, seed=10)
    outs = []
    for cfg in (
        MoeGroupedConfig(block_m=2, up_warps=2),
        MoeGroupedConfig(block_m=2, up_warps=1),
        MoeGroupedConfig(block_m=2, up_block_n=4, up_warps=1),
        MoeGroupedConfig(block_m=2, up_block_n=16, up_warps=4),
    ):
        out = torch.full((9, h), float("nan"), device=DEVICE)
        moe_grouped(x, ids, weights, gate, up, down, slot, out, cfg)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0])
def test_grouped_down_in_tiles_matches_reference(qtype) -> None:
    """The down kernel with a program taking 1, 2 or 4 tiles of rows and walking F one group a
    step across them (`down_tiles`), at F = 768 (three groups: the 30B's, where a step of four
    groups leaves a quarter of its lanes masked): every assignment's row against the q8
    reference, times its routing weight; tokens of one expert block and of two; a last tile
    past H (H = 40 rows, tiles of 8)."""
    from moestream.kernels.mmvq import mmvq_ref, quantize_q8_ref
    from moestream.kernels.moe_align import align_blocks
    from moestream.kernels.moe_grouped import grouped_down

    h_rows, f = 40, 768
    down = stacked(qtype, (S, h_rows, f), seed=31)
    slot = torch.tensor(SLOT, dtype=torch.int32, device=DEVICE)
    ids = torch.tensor([[3], [3], [0]], device=DEVICE)  # expert 3 twice (one block), 0 once
    weights = torch.tensor([0.75, 0.5, 0.25], device=DEVICE)
    hid = activations(3, f, torch.float32, seed=32)
    ha = quantize_q8(hid)
    want = torch.stack([
        float(weights[a]) * mmvq_ref(
            quantize_q8_ref(hid[a : a + 1].cpu()),
            QTensor(down.data[SLOT[int(ids[a, 0])]].cpu(), qtype, (h_rows, f)),
        )[0]
        for a in range(3)
    ])  # fmt: skip
    sorted_ids, block_expert = align_blocks(ids, E, 2)
    for tiles in (1, 2, 4):
        cfg = MoeGroupedConfig(block_m=2, down_tiles=tiles)
        y = grouped_down(ha, sorted_ids, block_expert, slot, down, weights, h_rows, cfg)
        assert rel_err(y.cpu(), want) < 1e-5, tiles
    with pytest.raises(ValueError, match="down_tiles"):
        MoeGroupedConfig(down_tiles=3)

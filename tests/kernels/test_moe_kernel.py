"""The fused MoE kernels (decode GEMV and prefill grouped-GEMM paths) against
`ops.moe_forward_ref`, with fresh random inputs. Without CUDA the Triton interpreter runs them on
the CPU; on a CUDA machine the same tests run the compiled kernels on the GPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from moestream.kernels import ops
from moestream.weights.qtensor import QTensor
from moestream.weights.quantize import quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # the modules above do not import triton; the kernel modules below do
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported


pytest.importorskip("triton", reason="triton is not installed")

from moestream.kernels.arrival import arrival_counters  # noqa: E402
from moestream.kernels.mmvq import MMVQ_DENSE_QTYPES, quantize_q8  # noqa: E402
from moestream.kernels.moe import align_assignments, default_method, fused_moe  # noqa: E402
from moestream.kernels.moe_mmvq import MoeMmvqConfig, mmvq_counters, moe_mmvq_ref  # noqa: E402

T = GGMLQuantizationType


def stacked(qtype: GGMLQuantizationType, shape: tuple[int, int, int], seed: int) -> QTensor:
    """Random expert weights [S, out, in] (std 0.05) quantized to `qtype`."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=g) * 0.05
    return QTensor(torch.from_numpy(quantize(values, qtype)).to(DEVICE), qtype, shape)


def routing(t: int, k: int, experts: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] int64 (k distinct experts from `experts` per token) and softmax weights."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(experts), generator=g)[:k]] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    return ids.to(DEVICE), weights.to(DEVICE)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "output has NaN/inf: some element was not written"
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


H, FF = 256, 256  # hidden, expert FFN
E, S = 6, 5  # experts, weight slots: expert 5 has no slot and is never routed to
SLOT = [3, 0, 4, 1, 2, -1]
RESIDENT = [0, 1, 2, 3, 4]


@pytest.fixture(scope="module")
def experts() -> tuple[QTensor, QTensor, QTensor]:
    """gate [S, F, H] Q4_K, up Q5_K, down [S, H, F] Q6_K (the Q4_K_M mix, plus Q5_K)."""
    return (
        stacked(T.Q4_K, (S, FF, H), seed=1),
        stacked(T.Q5_K, (S, FF, H), seed=2),
        stacked(T.Q6_K, (S, H, FF), seed=3),
    )


@pytest.mark.parametrize(
    "method, t, k, dtype",
    [
        ("gemv", 1, 2, torch.float32),
        ("gemv", 3, 2, torch.bfloat16),
        ("gemm", 3, 2, torch.float32),
        ("gemm", 7, 3, torch.bfloat16),
    ],
)
def test_fused_moe_matches_reference(experts, method, t, k, dtype):
    gate, up, down = experts
    g = torch.Generator().manual_seed(t * 10 + k)
    x = torch.randn(t, H, generator=g).to(DEVICE, dtype)
    ids, weights = routing(t, k, RESIDENT, seed=t)
    slot = torch.tensor(SLOT, dtype=torch.int32, device=DEVICE)
    out = torch.full((t, H), float("nan"), dtype=dtype, device=DEVICE)
    fused_moe(x, ids, weights, gate, up, down, slot, out=out, method=method, block_n=128)
    ref = ops.moe_forward_ref(x.float(), ids, weights, gate, up, down, slot)  # float32
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("t, k, dtype", [(1, 2, torch.float32), (2, 2, torch.bfloat16)])
def test_fused_moe_mmvq_matches_its_reference(experts, t, k, dtype):
    """The integer-dot decode path against its own reference (8-bit x and h, exact weights),
    and against the float reference within 8-bit activation rounding. The tile gate/up kernel:
    the default "once" one (`moe_mmvq.DEFAULT_CONFIG`) runs ~30x slower in the interpreter and
    has its own tests below (MMVQ_VARIANTS, at the default's rows per program)."""
    gate, up, down = experts
    tile = MoeMmvqConfig()
    g = torch.Generator().manual_seed(t * 10 + k + 1)
    x = torch.randn(t, H, generator=g).to(DEVICE, dtype)
    ids, weights = routing(t, k, RESIDENT, seed=t + 7)
    slot = torch.tensor(SLOT, dtype=torch.int32, device=DEVICE)
    out = torch.full((t, H), float("nan"), dtype=dtype, device=DEVICE)
    fused_moe(x, ids, weights, gate, up, down, slot, out=out, method="mmvq", block_n=256,
              mmvq_cfg=tile)  # fmt: skip
    ref = moe_mmvq_ref(x, ids, weights, gate, up, down, slot)
    assert rel_err(out, ref) < (2e-3 if dtype == torch.float32 else 2e-2)
    exact = ops.moe_forward_ref(x.float(), ids, weights, gate, up, down, slot)
    assert rel_err(out, exact) < 5e-2
    # each token's result does not depend on the other tokens in the batch
    one = torch.empty((1, H), dtype=dtype, device=DEVICE)
    fused_moe(x[-1:], ids[-1:], weights[-1:], gate, up, down, slot, out=one, method="mmvq",
              block_n=256, mmvq_cfg=tile)  # fmt: skip
    assert torch.equal(one[0], out[-1])
    assert default_method(t * k, gate, up, down) == "mmvq"
    assert default_method(63, gate, up, down) == "mmvq"
    assert default_method(64, gate, up, down) == "grouped"
    assert default_method(512, gate, up, down) == "grouped"
    assert default_method(513, gate, up, down) == "mmq"
    assert default_method(1024, gate, up, down) == "mmq"
    assert default_method(1025, gate, up, down) == "gemm"
    q3 = stacked(T.Q3_K, (1, 256, 256), seed=9)
    assert default_method(64, q3, up, down) == "gemv"
    assert default_method(65, q3, up, down) == "gemm"


@pytest.mark.parametrize("method", ["gemv", "gemm"])
@pytest.mark.parametrize(
    "qtypes",
    [(T.IQ4_XS, T.MXFP4, T.IQ4_XS), (T.Q4_0, T.Q5_0, T.IQ4_NL), (T.Q4_1, T.Q5_1, T.Q4_0)],
    ids=lambda q: "-".join(t.name for t in q),
)
def test_fused_moe_other_types_take_the_float_paths(qtypes, method):
    """Gate, up and down of types without integer-dot MoE kernels (random blocks: every code
    and scale) through the float paths, which `default_method` picks for them (but where all
    three are 4-bit code types: the grouped path, tests/kernels/test_moe_grouped.py)."""
    from tests.kernels.test_quant_matmul import random_blocks

    def stack(qtype, f, h, seed):
        w = random_blocks(qtype, 2 * f, h, seed)
        return QTensor(w.data.view(2, f, -1), qtype, (2, f, h))

    gate, up = stack(qtypes[0], FF, H, 1), stack(qtypes[1], FF, H, 2)
    down = stack(qtypes[2], H, FF, 3)
    grouped = all(t in MMVQ_DENSE_QTYPES for t in qtypes)
    assert default_method(4, gate, up, down) == ("grouped" if grouped else "gemv")
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(2, H, generator=g) * 1e-3).to(DEVICE)  # random blocks: values to ~5e4
    ids = torch.tensor([[0, 1], [1, 0]], device=DEVICE)
    weights = torch.softmax(torch.randn(2, 2, generator=g), -1).to(DEVICE)
    slot = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    out = torch.full((2, H), float("nan"), device=DEVICE)
    fused_moe(x, ids, weights, gate, up, down, slot, out=out, method=method, block_n=128)
    assert rel_err(out, ops.moe_forward_ref(x, ids, weights, gate, up, down, slot)) < 1e-5


def test_fused_moe_q8_0_and_int32_ids():
    """Other weight types, int32 ids, every token on the same expert (one full block)."""
    gate = stacked(T.Q8_0, (2, 256, 256), seed=4)
    up = stacked(T.Q8_0, (2, 256, 256), seed=5)
    down = stacked(T.Q4_K, (2, 256, 256), seed=6)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    ids = torch.tensor([[1], [1], [1], [1]], dtype=torch.int32, device=DEVICE)
    weights = torch.rand(4, 1, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    slot = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    ref = ops.moe_forward_ref(x, ids, weights, gate, up, down, slot)
    for method in ("gemv", "gemm"):
        out = torch.full((4, 256), float("nan"), device=DEVICE)
        fused_moe(x, ids, weights, gate, up, down, slot, out=out, method=method, block_n=128)
        assert rel_err(out, ref) < 1e-5, method
    out = torch.full((4, 256), float("nan"), device=DEVICE)
    cfg = MoeMmvqConfig(down_block_n=256)  # few programs for the interpreter
    fused_moe(x, ids, weights, gate, up, down, slot, out=out, method="mmvq", mmvq_cfg=cfg)
    assert rel_err(out, moe_mmvq_ref(x, ids, weights, gate, up, down, slot)) < 2e-3


def test_align_assignments_groups_by_expert():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3]], device=DEVICE)  # [T=4, k=2]
    a, num_experts, block_m = ids.numel(), 6, 2
    sorted_ids, block_expert = align_assignments(ids, num_experts, block_m)
    sorted_ids, block_expert, ids = sorted_ids.cpu(), block_expert.cpu(), ids.cpu()
    assert sorted_ids.dtype == block_expert.dtype == torch.int32
    assert len(sorted_ids) == len(block_expert) * block_m
    flat = ids.flatten()
    real = sorted_ids[sorted_ids < a].long()
    assert sorted(real.tolist()) == list(range(a))  # every assignment once
    rows = sorted_ids.view(-1, block_m)
    for b, e in enumerate(block_expert.tolist()):
        members = rows[b][rows[b] < a].long()
        if e == num_experts:
            assert len(members) == 0  # spare block
        else:
            assert len(members) > 0 and (flat[members] == e).all()
    used = block_expert[block_expert < num_experts].tolist()
    assert used == sorted(used)  # experts in ascending order
    assert used == [0, 1, 3, 3, 5]  # expert 3 has 4 assignments: two blocks


def test_moe_forward_ref_matches_per_token_loop(experts):
    gate, up, down = (w.to("cpu") for w in experts)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(9))
    ids, weights = (t.cpu() for t in routing(4, 3, RESIDENT, seed=9))
    slot = torch.tensor(SLOT, dtype=torch.int32)
    out = ops.moe_forward_ref(x, ids, weights, gate, up, down, slot)
    wg, wu, wd = gate.dequantize(), up.dequantize(), down.dequantize()
    for t in range(4):
        expect = torch.zeros(H)
        for j in range(3):
            s = SLOT[ids[t, j]]
            h = F.silu(wg[s] @ x[t]) * (wu[s] @ x[t])
            expect += weights[t, j] * (wd[s] @ h)
        torch.testing.assert_close(out[t], expect, rtol=1e-4, atol=1e-5)


def test_moe_forward_ref_rejects_unresident_expert(experts):
    gate, up, down = (w.to("cpu") for w in experts)
    ids = torch.tensor([[5, 0]])  # expert 5 has slot -1
    with pytest.raises(ValueError, match="expert 5"):
        ops.moe_forward_ref(
            torch.zeros(1, H), ids, torch.ones(1, 2), gate, up, down, torch.tensor(SLOT)
        )


def test_ops_moe_forward_uses_reference_on_cpu(experts):
    gate, up, down = (w.to("cpu") for w in experts)
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(10))
    ids, weights = (t.cpu() for t in routing(2, 2, RESIDENT, seed=10))
    slot = torch.tensor(SLOT, dtype=torch.int32)
    ref = ops.moe_forward_ref(x, ids, weights, gate, up, down, slot)
    assert torch.equal(ops.moe_forward(x, ids, weights, gate, up, down, slot), ref)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("t", [1, 40])
def test_ops_moe_forward_dispatches_to_kernels_on_cuda(experts, t):
    """int64 expert_slot is accepted (cast); decode and prefill sizes; no host sync needed."""
    gate, up, down = experts
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(t)).to(DEVICE, torch.bfloat16)
    ids, weights = routing(t, 2, RESIDENT, seed=t)
    slot = torch.tensor(SLOT, device=DEVICE)  # int64
    out = ops.moe_forward(x, ids, weights, gate, up, down, slot)
    assert out.shape == (t, H) and out.dtype == torch.bfloat16
    ref = ops.moe_forward_ref(x.float(), ids, weights, gate, up, down, slot)
    assert rel_err(out, ref) < 2e-2


def test_fused_moe_rejects_bad_arguments(experts):
    gate, up, down = experts
    x = torch.zeros(2, H, device=DEVICE)
    ids, weights = routing(2, 2, RESIDENT, seed=11)
    slot = torch.tensor(SLOT, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="expert shapes"):
        fused_moe(x, ids, weights, gate, up, QTensor(down.data[:4], T.Q6_K, (4, H, FF)), slot)
    with pytest.raises(ValueError, match="expert_slot"):
        fused_moe(x, ids, weights, gate, up, down, slot.long())
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(x, ids, weights[:, :1], gate, up, down, slot)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, ids.float(), weights, gate, up, down, slot)
    with pytest.raises(ValueError, match="method"):
        fused_moe(x, ids, weights, gate, up, down, slot, method="dense")


def test_fused_moe_mmvq_reads_experts_through_an_address_table(experts):
    """Expert weights found by byte address (copies outside the stacks, as pinned host memory
    would hold them) give the same bits as the stacked slots."""
    gate, up, down = experts
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(11)).to(DEVICE, torch.bfloat16)
    ids, weights = routing(1, 2, RESIDENT, seed=12)
    slot = torch.tensor(SLOT, dtype=torch.int32, device=DEVICE)
    cfg = MoeMmvqConfig(down_block_n=256, down_experts=1)  # few programs for the interpreter
    ref = fused_moe(x, ids, weights, gate, up, down, slot, method="mmvq", mmvq_cfg=cfg)
    copies = [
        [w.data[s].clone() if s >= 0 else w.data[0].clone() for s in SLOT] for w in (gate, up, down)
    ]  # per kind, per expert: its bytes in a buffer of its own
    addr = torch.tensor(
        [[c.data_ptr() for c in kind] for kind in copies], dtype=torch.int64, device=DEVICE
    )  # [3, E]
    kw = {"method": "mmvq", "mmvq_cfg": cfg, "expert_addr": addr}
    out = fused_moe(x, ids, weights, gate, up, down, slot, **kw)
    assert torch.equal(out, ref)
    no_slots = fused_moe(x, ids, weights, gate, up, down, None, **kw)
    assert torch.equal(no_slots, ref)  # the slot table is not read
    with pytest.raises(ValueError, match="expert_slot or expert_addr"):
        fused_moe(x, ids, weights, gate, up, down, None, method="mmvq")
    with pytest.raises(ValueError, match="mmvq path"):
        fused_moe(x, ids, weights, gate, up, down, slot, method="gemm", expert_addr=addr)
    with pytest.raises(ValueError, match="int64"):
        fused_moe(x, ids, weights, gate, up, down, slot, expert_addr=addr.int())


H2 = 512  # two groups of 256: room for a K split of gate/up
# Variants of the "mmvq" path (`MoeMmvqConfig`), each with its type mix and batch; large down
# blocks keep the interpreter's program count low.
MMVQ_VARIANTS = [
    (  # K split with the last-arriving epilogue, gate and up in one step, experts one at a
        # time over the [1, rows, runs, words] tile (the default's "rows" tile elsewhere)
        MoeMmvqConfig(up_groups=1, up_split=2, down_block_n=256, down_experts=1, down_rows=False),
        (T.Q4_K, T.Q5_K, T.Q6_K),
        3,
        1,
    ),
    (  # the earlier shape: gate's steps then up's, the token's k experts unrolled
        MoeMmvqConfig(up_groups=1, up_fused=False, down_block_n=512, down_groups=1),
        (T.Q8_0, T.Q4_K, T.Q8_0),
        1,
        3,
    ),
    (  # one step for all of H, experts in pairs, plain sums instead of trees
        MoeMmvqConfig(
            up_groups=2, down_block_n=512, down_experts=2, up_tree=False, down_tree=False
        ),
        (T.Q6_K, T.Q8_0, T.Q5_K),
        8,
        1,
    ),
    (  # gate/up "once" (the default's rows per program): the last of a q8 block's 4 programs
        # quantizes it
        MoeMmvqConfig(up_once=True, up_block_n=8, up_groups=2, down_block_n=512),
        (T.Q4_K, T.Q6_K, T.Q4_K),
        2,
        1,
    ),
    (  # gate/up "once": a whole q8 block a program, one group per K step, mixed types
        MoeMmvqConfig(up_once=True, up_block_n=32, up_groups=1, down_block_n=512),
        (T.Q8_0, T.Q5_K, T.Q6_K),
        1,
        2,
    ),
]


@pytest.mark.parametrize("cfg, qtypes, t, k", MMVQ_VARIANTS)
def test_fused_moe_mmvq_variants_match_reference(cfg, qtypes, t, k):
    """Every launch variant against `moe_mmvq_ref`; token 0 alone has the same bits as within
    the batch (batch invariance)."""
    gate = stacked(qtypes[0], (3, FF, H2), seed=20)
    up = stacked(qtypes[1], (3, FF, H2), seed=21)
    down = stacked(qtypes[2], (3, H2, FF), seed=22)
    slot = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE)
    x = torch.randn(t, H2, generator=torch.Generator().manual_seed(t)).to(DEVICE)
    ids, weights = routing(t, k, [0, 1, 2], seed=t + k)
    out = fused_moe(x, ids, weights, gate, up, down, slot, method="mmvq", mmvq_cfg=cfg)
    assert rel_err(out, moe_mmvq_ref(x, ids, weights, gate, up, down, slot)) < 2e-3
    if t > 1:
        one = fused_moe(x[:1], ids[:1], weights[:1], gate, up, down, slot, method="mmvq",
                        mmvq_cfg=cfg)  # fmt: skip
        assert torch.equal(one[0], out[0])


def two_experts(ids: list[list[int]], weights: list[list[float]], seed: int) -> tuple:
    """`fused_moe`'s first seven arguments for one token over two experts of H2 (Q4_K gate and
    up, Q6_K down, stored in swapped slots): x, ids, weights, gate, up, down, slot."""
    gate = stacked(T.Q4_K, (2, FF, H2), seed=seed)
    up = stacked(T.Q4_K, (2, FF, H2), seed=seed + 1)
    down = stacked(T.Q6_K, (2, H2, FF), seed=seed + 2)
    slot = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    x = torch.randn(1, H2, generator=torch.Generator().manual_seed(seed + 3)).to(DEVICE)
    ids_t = torch.tensor(ids, device=DEVICE)
    return x, ids_t, torch.tensor(weights, device=DEVICE), gate, up, down, slot


def test_fused_moe_mmvq_split_leaves_counters_zero_and_takes_quantized_x():
    """A K-split launch resets its arrival counters (so one buffer serves launch after launch,
    as CUDA-graph replays need); activations quantized by the caller (`xa`) and experts found
    by address give the same bits as x quantized inside and the stacks' slots."""
    args = two_experts([[1, 0]], [[0.75, 0.25]], seed=30)
    x, ids, weights, gate, up, down, slot = args
    cfg = MoeMmvqConfig(up_groups=1, up_split=2, down_block_n=512, down_experts=1)
    counters = mmvq_counters(2, FF, DEVICE)
    first = fused_moe(*args, method="mmvq", mmvq_cfg=cfg, counters=counters)
    assert not counters.any()
    again = fused_moe(*args, method="mmvq", mmvq_cfg=cfg, counters=counters, xa=quantize_q8(x))
    assert not counters.any()
    assert torch.equal(first, again)
    copies = [[w.data[s].clone() for s in (1, 0)] for w in (gate, up, down)]  # expert order
    addr = torch.tensor(
        [[c.data_ptr() for c in kind] for kind in copies], dtype=torch.int64, device=DEVICE
    )  # [3, E]
    by_addr = fused_moe(x, ids, weights, gate, up, down, None, method="mmvq", mmvq_cfg=cfg,
                        expert_addr=addr)  # fmt: skip
    assert torch.equal(by_addr, first)
    assert rel_err(first, moe_mmvq_ref(*args)) < 2e-3
    with pytest.raises(ValueError, match="xa"):
        fused_moe(*args, method="mmvq", xa=quantize_q8(x[:, :256]))
    with pytest.raises(ValueError, match="counters"):
        fused_moe(*args, method="mmvq", mmvq_cfg=cfg, counters=counters[:3])


def test_fused_moe_mmvq_once_leaves_counters_zero_and_reads_by_address():
    """The "once" gate/up's last-arriver epilogue resets its counters; experts found by
    address give the same bits as the stacks' slots."""
    args = two_experts([[1]], [[0.75]], seed=40)
    x, ids, weights, gate, up, down, slot = args
    cfg = MoeMmvqConfig(up_once=True, up_block_n=8, up_groups=2, down_block_n=512)
    counters = mmvq_counters(1, FF, DEVICE)
    first = fused_moe(*args, method="mmvq", mmvq_cfg=cfg, counters=counters)
    assert not counters.any()
    again = fused_moe(*args, method="mmvq", mmvq_cfg=cfg, counters=counters)
    assert not counters.any() and torch.equal(first, again)
    copies = [[w.data[s].clone() for s in (1, 0)] for w in (gate, up, down)]  # expert order
    addr = torch.tensor(
        [[c.data_ptr() for c in kind] for kind in copies], dtype=torch.int64, device=DEVICE
    )  # [3, E]
    by_addr = fused_moe(x, ids, weights, gate, up, down, None, method="mmvq", mmvq_cfg=cfg,
                        expert_addr=addr, counters=counters)  # fmt: skip
    assert torch.equal(by_addr, first) and not counters.any()
    assert rel_err(first, moe_mmvq_ref(*args)) < 2e-3


def test_fused_moe_mmvq_once_bits_do_not_depend_on_rows_or_warps():
    """The "once" gate/up with 8 rows a program and 2 warps (the old default) or 4 and 1 (the
    new) gives the same bits: on a GPU each warp count compiles its own layout."""
    args = two_experts([[1, 0]], [[0.75, 0.25]], seed=50)
    counters = mmvq_counters(2, FF, DEVICE)
    outs = [
        fused_moe(*args, method="mmvq", counters=counters, mmvq_cfg=MoeMmvqConfig(
            up_once=True, up_block_n=rows, up_groups=2, up_warps=warps, down_block_n=512))
        for rows, warps in ((8, 2), (4, 1))
    ]  # fmt: skip
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert not counters.any()


def test_fused_moe_mmvq_down_split_adds_the_same_partials():
    """The down kernel with the token's experts spread over 2 programs (the last to arrive adds
    their partials) gives the bits of one program that walks them 1 at a time (the same
    partials, added in the same order); its counters are left zero; a counter buffer too small
    for its 2 blocks of rows is refused. (Reading experts by address is the same load in either
    launch: test_fused_moe_mmvq_once_leaves_counters_zero_and_reads_by_address.)"""
    args = two_experts([[1, 0]], [[0.75, 0.25]], seed=60)
    base = dict(up_once=True, up_block_n=32, up_groups=2, down_block_n=256)  # no gate/up counters
    counters = mmvq_counters(2, FF, DEVICE, h=H2, top_k=2)
    one = fused_moe(*args, method="mmvq", counters=counters,
                    mmvq_cfg=MoeMmvqConfig(**base, down_experts=1))  # fmt: skip
    split = MoeMmvqConfig(**base, down_split=2)
    two = fused_moe(*args, method="mmvq", mmvq_cfg=split, counters=counters)
    assert torch.equal(two, one) and not counters.any()
    assert rel_err(two, moe_mmvq_ref(*args)) < 2e-3
    with pytest.raises(ValueError, match="counters"):
        fused_moe(*args, method="mmvq", mmvq_cfg=split, counters=arrival_counters(1, DEVICE))


def test_moe_mmvq_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="up_split"):
        MoeMmvqConfig(up_split=3)
    with pytest.raises(ValueError, match="down_warps"):
        MoeMmvqConfig(down_warps=3)
    with pytest.raises(ValueError, match="up_block_n"):
        MoeMmvqConfig(up_block_n=64)
    with pytest.raises(ValueError, match="down_split"):
        MoeMmvqConfig(down_split=3)

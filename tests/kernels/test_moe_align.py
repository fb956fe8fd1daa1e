"""`moe_align.align_blocks` (one Triton launch) against its torch reference
`moe.align_assignments`: equal outputs, element for element, on fresh random routings. Without
CUDA the Triton interpreter runs the kernel on the CPU (tests/conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

pytest.importorskip("triton", reason="triton is not installed")

from moestream.kernels import moe_align  # noqa: E402
from moestream.kernels.moe import align_assignments  # noqa: E402
from moestream.kernels.moe_align import align_blocks  # noqa: E402

POISON = -7777


@pytest.fixture
def poisoned(monkeypatch):
    """Every `torch.empty` during the test returns tensors filled with POISON, so an output
    element the kernel does not write shows up."""
    empty = torch.empty

    def poisoned_empty(*shape, dtype=None, device=None, **kwargs):
        out = empty(*shape, dtype=dtype, device=device, **kwargs)
        return out.fill_(POISON) if out.dtype in (torch.int32, torch.int64) else out

    monkeypatch.setattr(torch, "empty", poisoned_empty)


def routing(t: int, k: int, num_experts: int, seed: int, distinct: bool) -> torch.Tensor:
    """topk_ids [T, k] int64: k distinct experts per token (as a router picks), or any."""
    g = torch.Generator().manual_seed(seed)
    if distinct:
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(t)])
    else:
        ids = torch.randint(0, num_experts, (t, k), generator=g)
    return ids.reshape(t, k).to(DEVICE)


def assert_same(ids: torch.Tensor, num_experts: int, block_m: int, counts=None) -> None:
    want = align_assignments(ids, num_experts, block_m, counts)
    got = align_blocks(ids, num_experts, block_m, counts)
    for w, g in zip(want, got):
        assert g.dtype == torch.int32 and g.shape == w.shape
        assert torch.equal(g.cpu(), w.cpu())


@pytest.mark.parametrize("block_m", [1, 4, 16, 64])
@pytest.mark.parametrize(
    ("t", "k", "num_experts"),
    [(1, 1, 8), (1, 8, 128), (3, 2, 8), (5, 8, 128), (24, 8, 8), (64, 8, 128)],
)
def test_matches_torch_on_random_routings(poisoned, t, k, num_experts, block_m):
    # A from 1 to 512: A < E, A = E-ish and A > E.
    for seed, distinct in ((t * 31 + block_m, True), (t * 31 + block_m + 1, False)):
        if distinct and k > num_experts:
            continue
        assert_same(routing(t, k, num_experts, seed, distinct), num_experts, block_m)


@pytest.mark.parametrize("block_m", [1, 4, 16, 64])
@pytest.mark.parametrize("num_experts", [8, 128])
def test_matches_torch_when_skewed(poisoned, num_experts, block_m):
    a = 200
    for expert in (0, num_experts - 1):
        ids = torch.full((a, 1), expert, dtype=torch.int64, device=DEVICE)  # all on one expert
        assert_same(ids, num_experts, block_m)
    ids = torch.zeros(a, dtype=torch.int64)
    ids[::7] = num_experts // 2  # two experts, interleaved
    assert_same(ids.reshape(25, 8).to(DEVICE), num_experts, block_m)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_int32_ids_and_given_counts(poisoned, dtype):
    num_experts = 16
    ids = routing(40, 4, num_experts, seed=5, distinct=True).to(dtype)
    flat = ids.reshape(-1).long()
    for count_dtype in (torch.int32, torch.int64):
        counts = torch.zeros(num_experts, dtype=count_dtype, device=DEVICE)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=count_dtype))
        assert_same(ids, num_experts, 4, counts)


def test_experts_not_a_power_of_two(poisoned):
    for num_experts, block_m in ((5, 4), (60, 16), (300, 1)):
        assert_same(
            routing(33, 4, num_experts, seed=num_experts, distinct=True), num_experts, block_m
        )


def test_torch_fallback_outside_the_limits(monkeypatch):
    ids = routing(4, 2, 8, seed=1, distinct=False)
    monkeypatch.setattr(moe_align, "ALIGN_MAX_ASSIGNMENTS", 4)  # A = 8 is above: torch
    called = []
    monkeypatch.setattr(moe_align, "_align_kernel", called)  # indexing a list would fail
    assert_same(ids, 8, 4)
    assert called == []


@pytest.mark.parametrize("block_m", [1, 2, 4, 16])
def test_block_bound_is_reached_and_holds(poisoned, block_m):
    """`max_blocks` where it is tight: every expert holding one more assignment than a multiple
    of block_m (8 experts), and A < E distinct experts of one assignment each. Every block is
    a real one, and every assignment has its row."""
    g = torch.Generator().manual_seed(block_m)
    many = torch.arange(8).repeat_interleave(block_m + 1)
    few = torch.randperm(128, generator=g)[:5]
    for flat, num_experts, blocks in ((many, 8, 16), (few, 128, 5)):
        ids = flat[torch.randperm(flat.numel(), generator=g)].reshape(-1, 1).to(DEVICE)
        a = ids.numel()
        assert moe_align.max_blocks(a, num_experts, block_m) == blocks
        assert_same(ids, num_experts, block_m)
        sorted_ids, block_expert = align_blocks(ids, num_experts, block_m)
        assert bool((block_expert < num_experts).all())  # no spare block: the bound is tight
        assert sorted(v for v in sorted_ids.tolist() if v < a) == list(range(a))

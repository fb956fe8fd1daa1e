"""Step inputs (runner/inputs.py): a plan flattened with numpy matches the per-field reference
(`AttentionMetadata.build` and plain lists) on random mixes of prefill chunks, decodes and
drafts; the one-copy packing round-trips every dtype and shape."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from moestream.layers.attention import AttentionMetadata
from moestream.runner.inputs import build_step_inputs, pack, to_device, unpack
from moestream.types import ScheduledRequest, StepPlan

BS = 4


def random_plan(rng: random.Random, num_seqs: int) -> StepPlan:
    scheduled = []
    next_block = 0
    for i in range(num_seqs):
        kind = rng.choice(["decode", "chunk", "last_chunk", "drafts"])
        start = rng.randrange(0, 40)
        n = 1 if kind in ("decode", "drafts") else rng.randrange(1, 20)
        k = rng.randrange(1, 4) if kind == "drafts" else 0
        drafts = [rng.randrange(100) for _ in range(k)]
        covered = -(-(start + n + len(drafts)) // BS) + rng.randrange(0, 3)  # spare blocks too
        blocks = rng.sample(range(next_block, next_block + 3 * covered), covered)
        next_block += 3 * covered
        scheduled.append(
            ScheduledRequest(
                request_id=f"r{i}",
                token_ids=[rng.randrange(1000) for _ in range(n)],
                start_pos=start,
                block_ids=blocks,
                sample=kind != "chunk",
                draft_token_ids=drafts,
            )
        )
    return StepPlan(scheduled)


def reference(plan: StepPlan) -> tuple[list[int], list[int], AttentionMetadata, list[int]]:
    tokens, positions, seqs, rows = [], [], [], []
    for s in plan.scheduled:
        fed = s.token_ids + s.draft_token_ids
        tokens += fed
        positions += range(s.start_pos, s.start_pos + len(fed))
        seqs.append((s.start_pos, len(fed), s.block_ids))
        if s.sample:
            rows += range(len(tokens) - 1 - len(s.draft_token_ids), len(tokens))
    return tokens, positions, AttentionMetadata.build(seqs, BS, "cpu"), rows


@pytest.mark.parametrize("seed", range(6))
def test_matches_reference_on_random_plans(seed):
    rng = random.Random(seed)
    plan = random_plan(rng, rng.randrange(1, 9))
    got = build_step_inputs(plan, BS, torch.device("cpu"))
    tokens, positions, attn, rows = reference(plan)
    assert got.input_ids.tolist() == tokens and got.input_ids.dtype == torch.int64
    assert got.positions.tolist() == positions and got.positions.dtype == torch.int64
    assert got.sample_rows.tolist() == rows and got.sample_rows.dtype == torch.int64
    assert [s.request_id for s in got.sampled] == [s.request_id for s in plan.scheduled if s.sample]
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        a, b = getattr(got.attn, name), getattr(attn, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.attn.query_lens_cpu == attn.query_lens_cpu
    assert got.attn.seq_lens_cpu == attn.seq_lens_cpu
    assert got.attn.is_decode == attn.is_decode and got.attn.block_size == BS


def test_pure_decode_is_decode():
    plan = StepPlan([ScheduledRequest(f"r{i}", [7], 5 + i, [i, 9], True) for i in range(3)])
    got = build_step_inputs(plan, BS, torch.device("cpu"))
    assert got.attn.is_decode and got.positions.tolist() == [5, 6, 7]
    assert got.attn.slot_mapping.tolist() == [9 * BS + 1, 9 * BS + 2, 9 * BS + 3]


def test_bad_plans_are_refused():
    cpu = torch.device("cpu")
    chunk_with_drafts = ScheduledRequest("a", [1, 2], 0, [0], False, draft_token_ids=[3])
    with pytest.raises(ValueError, match="drafts in a prefill chunk"):
        build_step_inputs(StepPlan([chunk_with_drafts]), BS, cpu)
    short = ScheduledRequest("b", [1, 2, 3], 3, [0], True)  # positions 3..5 need 2 blocks
    with pytest.raises(ValueError, match="cannot hold 6 tokens"):
        build_step_inputs(StepPlan([short]), BS, cpu)
    with pytest.raises(ValueError, match="at least one"):
        build_step_inputs(StepPlan([]), BS, cpu)


def test_pack_round_trips_dtypes_and_shapes():
    arrays = [
        np.arange(3, dtype=np.int64),
        np.array([-1, 7, 2**40], dtype=np.int64),
        np.zeros(0, dtype=np.int64),
        np.arange(5, dtype=np.int32),  # 20 bytes: the next field must be realigned
        np.arange(12, dtype=np.int32).reshape(3, 4) - 6,
        np.array([2**62], dtype=np.int64),
    ]
    packed, offsets = pack(arrays)
    assert all(off % 8 == 0 for off in offsets)
    out = unpack(torch.from_numpy(packed.copy()), arrays, offsets)
    for a, t in zip(arrays, out, strict=True):
        assert t.dtype == torch.from_numpy(a).dtype and t.shape == a.shape
        assert t.tolist() == a.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_device_cuda_one_copy():
    rng = random.Random(3)
    plan = random_plan(rng, 6)
    got = build_step_inputs(plan, BS, torch.device("cuda"))
    ref = build_step_inputs(plan, BS, torch.device("cpu"))
    torch.cuda.synchronize()
    for name in ("input_ids", "positions", "sample_rows"):
        assert torch.equal(getattr(got, name).cpu(), getattr(ref, name)), name
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        assert torch.equal(getattr(got.attn, name).cpu(), getattr(ref.attn, name)), name
    arrays = [np.arange(4, dtype=np.int64), np.arange(6, dtype=np.int32).reshape(2, 3)]
    a, b = to_device(arrays, torch.device("cuda"))
    assert a.is_cuda and a.cpu().tolist() == [0, 1, 2, 3]
    assert b.dtype == torch.int32 and b.cpu().tolist() == [[0, 1, 2], [3, 4, 5]]

"""bench/greedy_gpu_vs_cpu.py's comparison on the CPU: the reference against itself agrees, and
against another model (the draft, same tokenizer) each divergence gets the reference's margin."""

from __future__ import annotations

import math

import pytest

from moestream.cli import DEMO_DRAFT, DEMO_MODEL
from moestream.llm import LLM
from tests.bench.scripts import load_bench_script


def load_script():
    return load_bench_script("greedy_gpu_vs_cpu")


@pytest.fixture(scope="module")
def models() -> tuple[LLM, LLM]:
    if not (DEMO_MODEL.is_file() and DEMO_DRAFT.is_file()):
        pytest.skip("demo models are not in this checkout")
    return LLM(DEMO_MODEL, device="cpu", num_threads=1), LLM(
        DEMO_DRAFT, device="cpu", num_threads=1
    )


def test_self_comparison_has_no_divergence(models) -> None:
    target, _ = models
    rows = load_script().compare(target, target, ["def add(a, b):"], 6, 0.1)
    assert rows[0]["diverged_at"] is None and rows[0]["tokens"] == 6


def test_divergence_gets_the_reference_margin(models) -> None:
    target, draft = models
    prompts = ["The history of the city", "import os\nimport sys\n"]
    rows = load_script().compare(target, draft, prompts, 16, 0.1)
    diverged = [r for r in rows if r["diverged_at"] is not None]
    assert diverged, "the draft model should not reproduce the target's text"
    for r in diverged:
        assert r["ref_token"] != r["other_token"]
        assert math.isfinite(r["margin_nats"]) and r["margin_nats"] >= 0.0  # target's argmax
        assert r["other_rank"] >= 1
        assert r["bound_nats"] == 0.1  # float32 models: two steps are far below 0.1 nats
        assert r["near_tie"] == (r["margin_nats"] <= 0.1)


def test_near_tie_bound_is_two_steps_of_the_dtype_or_the_tie() -> None:
    """bf16 logits of 8-16 are 0.0625 apart: two steps (0.125) exceed a 0.1 tie; of 1-2, the
    tie stays; float32 never widens it."""
    import torch

    bound = load_script().near_tie_bound
    assert bound(0.1, torch.bfloat16, 10.9) == 0.125
    assert bound(0.1, torch.bfloat16, -20.0) == 0.25
    assert bound(0.1, torch.bfloat16, 1.5) == 0.1
    assert bound(0.1, torch.float32, 30.0) == 0.1

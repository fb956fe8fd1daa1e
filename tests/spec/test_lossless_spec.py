"""Losslessness of speculative decoding on the trained tiny pair: 50 prompts (the bundled
exactness set: code, prose, copy-heavy; and 34 functions of the held-out Python sample, each
followed by a request to rewrite it renaming its variables), greedy, token-identical to plain
decode with the same logprob floats, at concurrency 8 and 1; and `moestream eval --lossless`
covers speculation. (Target and draft run with float32 weights, see conftest.py: the whole
file takes about 50 s on one core.)
"""

from __future__ import annotations

import pytest

from moestream.bench.spec_section import copy_prompts
from moestream.cli import DEMO_DRAFT, DEMO_MODEL
from moestream.config import CacheConfig, SchedConfig
from moestream.engine import Engine
from moestream.eval.lossless import EXECUTION_MODES, MODES, run_lossless, spec_modes
from moestream.eval.prompts import LOSSLESS_PROMPTS
from moestream.spec.base import SpecConfig
from moestream.spec.draft import DraftModelProposer
from moestream.spec.ngram import NgramProposer
from moestream.spec.speculator import Speculator
from moestream.types import SamplingParams

TOKENS = 24
PARAMS = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def prompt_ids(demo_pair) -> list[list[int]]:
    texts = list(LOSSLESS_PROMPTS) + copy_prompts(34)
    assert len(texts) == 50 and len(set(texts)) == 50
    return [demo_pair.tokenizer.encode(t) for t in texts]


def engine(pair, seqs: int, spec: SpecConfig | None = None) -> Engine:
    e = Engine(
        pair.target,
        pair.tokenizer,
        CacheConfig(block_size=16, enable_prefix_caching=False),
        SchedConfig(max_num_seqs=seqs, max_num_batched_tokens=512, max_model_len=1024),
    )
    if spec is not None:
        proposers = [NgramProposer(), DraftModelProposer(pair.draft, 256, 16)]
        e.speculator = Speculator(spec, proposers)
    return e


def generate(e: Engine, prompts: list[list[int]], together: bool) -> list[list[tuple]]:
    """(token, logprob) lists in prompt order; all queued at once, or one after another."""
    out: dict[str, list[tuple]] = {}
    groups = [prompts] if together else [[p] for p in prompts]
    n = 0
    for group in groups:
        for p in group:
            out[e.add_request(p, PARAMS, f"r{n}")] = []
            n += 1
        while e.has_unfinished():
            for o in e.step():
                out[o.request_id] += [(t, lp.logprob) for t, lp in zip(o.new_token_ids, o.logprobs)]
    return [out[f"r{i}"] for i in range(n)]


@pytest.fixture(scope="module")
def plain(demo_pair, prompt_ids) -> list[list[tuple]]:
    return generate(engine(demo_pair, 8), prompt_ids, together=True)


# n-gram lookup where it has a guess, the draft model otherwise: both proposers, every step.
MIXED = SpecConfig(mode="auto", draft_model=str(DEMO_DRAFT), always=True)


def test_fifty_prompts_at_concurrency_8(demo_pair, prompt_ids, plain):
    e = engine(demo_pair, 8, MIXED)
    got = generate(e, prompt_ids, together=True)
    diverged = [i for i, (a, b) in enumerate(zip(plain, got)) if a != b]
    assert not diverged, f"prompts {diverged} differ from plain decode"
    assert all(len(o) == TOKENS for o in got)
    by = e.spec_stats()["by_proposer"]
    assert by["ngram"]["accepted_tokens"] > 100 and by["draft"]["accepted_tokens"] > 100
    assert by["ngram"]["accepted_tokens"] < by["ngram"]["draft_tokens"]  # rejections too


def test_fifty_prompts_at_concurrency_1(demo_pair, prompt_ids, plain):
    e = engine(demo_pair, 1, MIXED)
    got = generate(e, prompt_ids, together=False)
    diverged = [i for i, (a, b) in enumerate(zip(plain, got)) if a != b]
    assert not diverged, f"prompts {diverged} differ from plain decode"
    assert e.spec_stats()["total"]["accepted_tokens"] > 200


def test_eval_lossless_covers_speculation():
    """`moestream eval --lossless` on the demo target runs the speculative modes, the
    draft-model ones with the embedded draft; each verifies drafts and passes."""
    names = [m.name for m in spec_modes(DEMO_DRAFT)]
    assert {"spec-ngram", "spec-ngram-c8", "spec-auto-c8", "spec-draft", "spec-draft-c8"} <= set(
        names
    )
    assert [m.name for m in MODES] == [m.name for m in EXECUTION_MODES + spec_modes(None)]
    prompts = [LOSSLESS_PROMPTS[i] for i in (0, 12, 14)]
    modes = [m for m in spec_modes(DEMO_DRAFT) if m.name != "spec-auto-c8"]
    report = run_lossless(DEMO_MODEL, {}, prompts, max_tokens=8, modes=modes)
    assert report["passed"], report
    for m in report["modes"]:
        assert m["identical"] == 3 and m["spec"]["verify_steps"] > 0, m

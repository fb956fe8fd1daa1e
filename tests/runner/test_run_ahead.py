"""Run-ahead of decode steps (runner/model_runner.py): the next step is queued, fed by the
previous step's tokens (argmax or sampled draw) on the device, before the host reads them.

On the CPU the decode graphs are driven by `RecomputeBackend` over the real demo model's forward
(what a CUDA graph replay computes), so the runner takes its graph path and its run-ahead. The
tokens must equal those of the same engine with run-ahead off, including when requests arrive,
finish or cross into new KV blocks between steps; and run-ahead must actually be used.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moestream import LLM
from moestream.cli import DEMO_MODEL
from moestream.runner.cuda_graph import DecodeGraphs, RecomputeBackend
from moestream.types import SamplingParams


def _llm(path: str, run_ahead: bool, speculative: str = "off") -> LLM:
    llm = LLM(
        path, device="cpu", kv_cache_gib=0.05, enable_prefix_caching=False,
        speculative=speculative,
    )  # fmt: skip
    engine = llm.engine
    model, kv, bs = engine.model, engine.kv, engine.cache_config.block_size

    def forward(ids, pos, attn):
        if bool((attn.slot_mapping < 0).any()):  # the capture's all-padding run (no K/V write)
            return torch.zeros(ids.shape[0], model.config.vocab_size)
        # The reference attention reads the lengths on the host (a graph's kernels do not).
        attn = dataclasses.replace(
            attn, query_lens_cpu=[1] * ids.shape[0], seq_lens_cpu=attn.seq_lens.tolist()
        )
        return model.compute_logits(model.forward(ids, pos, attn, kv))  # [B, V]

    engine.runner.graphs = DecodeGraphs(
        forward, bs, 64, "cpu", buckets=(1, 2, 3), backend=RecomputeBackend(),
        verify_buckets=(), verify_tokens=(),
    )  # fmt: skip
    engine.runner.run_ahead = run_ahead
    return llm  # a bucket per batch size used: the reference attention takes no padding rows


def _prompts(n: int) -> list[list[int]]:
    return [[(11 * i + 7 * j) % 500 + 3 for j in range(5 + 4 * i)] for i in range(n)]


@pytest.fixture(scope="module")
def pair():
    return _llm(str(DEMO_MODEL), True), _llm(str(DEMO_MODEL), False)


def test_run_ahead_tokens_equal_plain_steps(pair):
    ahead, plain = pair
    # Different lengths: requests finish at different steps; 20 tokens cross a 16-token block.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 7, 13)]
    prompts = _prompts(3)
    got = [o.token_ids for o in ahead.generate(prompts, params)]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert got == want
    assert ahead.engine.runner.run_ahead_hits > 10
    assert plain.engine.runner.run_ahead_hits == 0


def test_run_ahead_survives_arrivals_between_steps(pair):
    """A request added while others decode changes the planned step: the queued one is dropped
    and the planned step runs; the text is unchanged."""

    def run(llm: LLM) -> dict[str, list[int]]:
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        prompts = _prompts(3)
        ids = [engine.add_request(prompts[0], params)]
        out: dict[str, list[int]] = {ids[0]: []}
        steps = 0
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            steps += 1
            if steps in (4, 9):
                rid = engine.add_request(prompts[len(ids)], params)
                ids.append(rid)
        return {rid: out[rid] for rid in ids} | {"order": ids}  # type: ignore[dict-item]

    ahead, plain = pair
    dropped = ahead.engine.runner.run_ahead_dropped
    got, want = run(ahead), run(plain)
    assert [got[r] for r in got["order"]] == [want[r] for r in want["order"]]
    assert ahead.engine.runner.run_ahead_dropped > dropped  # counted (one per arrival here)
    assert plain.engine.runner.run_ahead_dropped == 0


def test_sampled_requests_run_ahead(pair):
    """Sampled rows run ahead too (the draw is on the device), each step sampled when it is
    executed: seeded requests with penalties (which read the output so far), truncation and a
    greedy row beside them give the tokens they give with run-ahead off."""
    ahead, plain = pair
    params = [
        SamplingParams(temperature=0.9, seed=3, max_tokens=18, ignore_eos=True,
                       presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.2, seed=7, max_tokens=15, ignore_eos=True, top_k=40,
                       top_p=0.9, repetition_penalty=1.3),
    ]  # fmt: skip
    before = ahead.engine.runner.run_ahead_hits
    got = [o.token_ids for o in ahead.generate(_prompts(3), params)]
    want = [o.token_ids for o in plain.generate(_prompts(3), params)]
    assert got == want
    assert ahead.engine.runner.run_ahead_hits - before > 10
    # not merely the greedy row's text: the seeded draws differ from the greedy tokens
    greedy = [dataclasses.replace(p, temperature=0.0) for p in params]
    assert got != [o.token_ids for o in plain.generate(_prompts(3), greedy)]


def test_no_run_ahead_with_logprobs(pair):
    """Logprobs are read back after the step, which would wait for a step queued behind."""
    ahead, plain = pair
    before = ahead.engine.runner.run_ahead_hits
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True, logprobs=2)
    got = ahead.generate(_prompts(1), params)[0]
    assert ahead.engine.runner.run_ahead_hits == before
    assert got.token_ids == plain.generate(_prompts(1), params)[0].token_ids


def test_run_ahead_while_speculating_is_lossless(pair):
    """With n-gram speculation the runner runs ahead only after a proposal round that drafted
    nothing; steps that verify drafts run as planned. Copy-heavy prompts (a repeated pattern)
    make the proposer draft, so both kinds of steps occur; the tokens equal plain decode."""
    _, plain = pair
    spec = _llm(str(DEMO_MODEL), True, speculative="ngram")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # One request at a time (run-ahead needs a step where no request drafts): a copy-heavy
    # prompt, then two without repeats (the proposer finds little to draft from).
    prompts = [[5, 6, 7, 8, 9] * 6, [(i * 37) % 500 + 3 for i in range(30)]]
    prompts.append([(i * 91) % 700 + 11 for i in range(25)])
    for p in prompts:
        got = spec.generate([p], params)[0].token_ids
        assert got == plain.generate([p], params)[0].token_ids
    stats = spec.engine.spec_stats()
    assert stats is not None and stats["total"]["verify_steps"] > 0  # drafts were verified
    assert spec.engine.runner.run_ahead_hits > 0  # and plain steps ran ahead


def test_a_queued_step_is_used_after_run_ahead_turns_off(pair):
    """`run_ahead` says whether a step queues the next one; a step already queued is used
    when the plan is that step, even once the flag is off (it is not dropped)."""
    ahead, plain = pair
    engine = ahead.engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine.add_request(_prompts(1)[0], params, "q")
    out: list[int] = []
    for o in engine.step() + engine.step():  # prefill, then a decode that queues the next
        out += o.new_token_ids
    assert engine.runner.has_queued_step
    engine.runner.run_ahead = False
    hits = engine.runner.run_ahead_hits
    for o in engine.step():
        out += o.new_token_ids
    assert engine.runner.run_ahead_hits == hits + 1 and not engine.runner.has_queued_step
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    engine.runner.run_ahead = True
    assert engine.runner.run_ahead_hits == hits + 1
    assert out == plain.generate(_prompts(1), params)[0].token_ids


def test_sampling_batch_reused_with_new_seeds(pair, monkeypatch):
    """A step whose rows have the parameters of the last one reuses its sampling batch with
    the new step seeds (`ModelRunner._sampling_batch`): the same draws as building every
    batch anew, with far fewer builds; a batch with penalties is always built anew."""
    from moestream.sampling.sampler import SamplingBatch

    ahead, _ = pair
    runner = ahead.engine.runner
    params = [
        SamplingParams(temperature=0.9, seed=11, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.1, seed=12, max_tokens=14, ignore_eos=True, top_p=0.8),
    ]
    builds = []
    build = SamplingBatch.from_params.__func__

    def counted(cls, *args, **kwargs):
        builds.append(1)
        return build(cls, *args, **kwargs)

    monkeypatch.setattr(SamplingBatch, "from_params", classmethod(counted))
    got = [o.token_ids for o in ahead.generate(_prompts(2), params)]
    reused = len(builds)

    def fresh(reqs):  # no reuse
        return SamplingBatch.from_params(
            [s.sampling_params for s in reqs], [s.output_token_ids for s in reqs],
            [s.prompt_token_ids for s in reqs], runner.device,
            [len(s.output_token_ids) for s in reqs],
        )  # fmt: skip

    monkeypatch.setattr(runner, "_sampling_batch", fresh)
    builds.clear()
    assert [o.token_ids for o in ahead.generate(_prompts(2), params)] == got
    assert reused < len(builds) // 4  # ~13 steps each built a batch, reuse built ~2
    monkeypatch.undo()
    runner._last_batch = None
    pen = [dataclasses.replace(p, presence_penalty=0.4) for p in params]
    builds_before = len(builds)
    monkeypatch.setattr(SamplingBatch, "from_params", classmethod(counted))
    ahead.generate(_prompts(2), pen)
    assert len(builds) - builds_before >= 13  # one per step

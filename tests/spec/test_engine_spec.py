"""Speculative decoding through the engine: drafts are verified in the same forward pass as
every other request's tokens, and greedy output is plain decode's, token for token, with the
same logprobs (the same floats: the CPU reference is batch-invariant, so verifying k + 1
tokens in one pass gives the logits of decoding them one by one). Sampled output keeps its
distribution. Rejected drafts leave K/V past `num_computed_tokens` that nothing reads.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from moestream.cli import DEMO_DRAFT, DEMO_MODEL, build_parser, llm_kwargs_from_args
from moestream.config import CacheConfig, SchedConfig
from moestream.engine import Engine
from moestream.errors import RequestError
from moestream.eval.prompts import LOSSLESS_PROMPTS
from moestream.llm import spec_config
from moestream.spec.base import Proposal, ProposalInput, Proposer, SpecConfig
from moestream.spec.draft import DraftModelProposer
from moestream.spec.ngram import NgramProposer
from moestream.spec.speculator import Speculator
from moestream.types import SamplingParams

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)


def make_engine(pair, *, chunk: int = 512, seqs: int = 16, num_blocks: int | None = None):
    c = pair.target.config
    gib = None
    if num_blocks is not None:
        gib = (num_blocks + 0.5) * 2 * c.n_layers * BS * c.n_kv_heads * c.head_dim * 4 / 2**30
    return Engine(
        pair.target,
        pair.tokenizer,
        CacheConfig(block_size=BS, kv_cache_gib=gib, enable_prefix_caching=True),
        SchedConfig(max_num_seqs=seqs, max_num_batched_tokens=chunk, max_model_len=1024),
    )


def real_speculator(pair, engine: Engine, config: SpecConfig) -> Speculator:
    """The config's proposers, the draft model on the dequantized demo draft."""
    proposers: list[Proposer] = []
    for name in config.proposer_names:
        if name == "ngram":
            proposers.append(NgramProposer(config.ngram_min, config.ngram_max))
        else:
            blocks = engine.scheduler.allocator.num_blocks
            proposers.append(DraftModelProposer(pair.draft, blocks, BS))
    return Speculator(config, proposers)


class ScriptedProposer(Proposer):
    """Drafts the plain run's continuation with planted errors: its n-th proposal for a request
    has draft `errors[n % len(errors)]` changed (None: all right), so verification sees drafts
    all accepted, rejected at the first and rejected in the middle."""

    name = "scripted"

    def __init__(self, truth: dict[str, list[int]], errors: Sequence[int | None], vocab: int):
        self.truth, self.errors, self.vocab = truth, list(errors), vocab
        self.calls: Counter[str] = Counter()

    def propose(self, inputs: Sequence[ProposalInput]) -> dict[str, Proposal]:
        out = {}
        for inp in inputs:
            truth = self.truth.get(inp.request_id)
            if truth is None:
                continue
            pos = len(inp.output_token_ids)
            drafts = list(truth[pos : pos + inp.num_drafts])
            if not drafts:
                continue
            err = self.errors[self.calls[inp.request_id] % len(self.errors)]
            self.calls[inp.request_id] += 1
            if err is not None and err < len(drafts):
                drafts[err] = (drafts[err] + 1) % self.vocab
            out[inp.request_id] = Proposal(drafts)
        return out

    def release(self, request_id: str) -> None:
        pass


Run = dict[str, list[tuple[int, float, list]]]


def run(engine: Engine, arrivals: dict[int, list], record=None) -> tuple[Run, dict[str, str]]:
    """Step `engine`, adding arrivals[step] before each step. Returns ({id: [(token, logprob,
    top)]}, {id: final text}); `record(plan)` sees every plan."""
    tokens: Run = {}
    texts: dict[str, str] = {}
    if record is not None:
        execute = engine.runner.execute

        def recording(plan):
            record(plan)
            return execute(plan)

        engine.runner.execute = recording
    for step in itertools.count():
        if not engine.has_unfinished() and step > max(arrivals):
            break
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(prompt, params, rid)
            tokens[rid] = []
        for out in engine.step() if engine.has_unfinished() else []:
            lps = [(lp.logprob, lp.top) for lp in out.logprobs] or [(math.nan, [])] * len(
                out.new_token_ids
            )
            tokens[out.request_id] += [(t, lp, top) for t, (lp, top) in zip(out.new_token_ids, lps)]
            if out.finished:
                texts[out.request_id] = out.text
    return tokens, texts


def assert_pool_clean(engine: Engine) -> None:
    alloc = engine.scheduler.allocator
    alloc.check_invariants()
    assert alloc.num_used == 0 and alloc.num_free == alloc.num_blocks


def prompts(pair, n: int) -> list[list[int]]:
    return [pair.tokenizer.encode(p) for p in LOSSLESS_PROMPTS[:n]]


def poison_beyond_computed(engine: Engine, plan) -> None:
    """NaN into every K/V slot a scheduled request holds at or past its num_computed_tokens
    (rejected drafts' K/V among them): were any read before being written, NaN would reach
    the logits and change tokens or logprobs."""
    for s in plan.scheduled:
        end = len(s.block_ids) * BS
        slots = [s.block_ids[p // BS] * BS + p % BS for p in range(s.start_pos, end)]
        idx = torch.tensor(slots, dtype=torch.long)
        for cache in (*engine.kv.k, *engine.kv.v):
            cache.flatten(0, 1)[idx] = math.nan


def kind(s) -> str:
    return "verify" if s.draft_token_ids else "decode" if s.is_decode else "prefill"


def test_verification_is_exact_next_to_plain_decodes_and_prefill(demo_pair):
    ps = prompts(demo_pair, 8)
    arrivals: dict[int, list] = {}
    for i, p in enumerate(ps):
        arrivals.setdefault(2 * i, []).append((f"g{i}", p, GREEDY))
    penalised = SamplingParams(
        temperature=0.0, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=1
    )  # penalties at draft j count drafts 0..j-1
    arrivals.setdefault(3, []).append(("g8", ps[7], penalised))
    for j in range(2):  # sampled neighbours: plain decode in the same steps
        params = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
        arrivals.setdefault(j, []).append((f"n{j}", ps[j], params))
    plain, plain_text = run(make_engine(demo_pair, chunk=40), arrivals)
    truth = {rid: [t for t, _, _ in toks] for rid, toks in plain.items() if rid[0] == "g"}

    engine = make_engine(demo_pair, chunk=40)
    vocab = demo_pair.target.config.vocab_size
    scripted = ScriptedProposer(truth, [None, 0, 2, 1, 3, None], vocab)
    engine.speculator = Speculator(SpecConfig(mode="ngram", always=True), [scripted])
    kinds: list[set[str]] = []

    def record(plan):
        kinds.append({kind(s) for s in plan.scheduled})
        poison_beyond_computed(engine, plan)

    spec, spec_text = run(engine, arrivals, record)
    for rid in truth:
        assert spec[rid] == plain[rid], rid  # tokens, logprobs (floats) and top-3 alternatives
        assert spec_text[rid] == plain_text[rid]
    assert all(len(spec[f"n{j}"]) == 12 for j in range(2))
    assert {"verify", "decode", "prefill"} in kinds  # one pass verified, decoded and prefilled
    stats = engine.spec_stats()["total"]
    assert stats["verify_steps"] > 10
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]
    assert 0 < stats["acceptance_by_position"][0] < 1
    assert len(kinds) < len(run(make_engine(demo_pair, chunk=40), arrivals)[0]["g0"]) + 30
    assert_pool_clean(engine)


def test_stops_and_max_tokens_inside_accepted_drafts(demo_pair):
    ps = prompts(demo_pair, 4)
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base, _ = run(make_engine(demo_pair), {0: [(f"g{i}", p, free) for i, p in enumerate(ps)]})
    truth = {rid: [t for t, _, _ in toks] for rid, toks in base.items()}
    text = demo_pair.tokenizer.decode(truth["g1"])
    stop_token = next(t for i, t in enumerate(truth["g0"]) if i >= 5 and t not in truth["g0"][:i])
    cases = [
        ("g0", SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_token])),
        ("g1", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[text[9:12]])),
        ("g2", SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)),
        ("g3", SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
    ]
    arrivals = {0: [(rid, ps[int(rid[1])], params) for rid, params in cases]}
    plain = run(make_engine(demo_pair), arrivals)
    engine = make_engine(demo_pair)
    scripted = ScriptedProposer(truth, [None], demo_pair.target.config.vocab_size)
    engine.speculator = Speculator(SpecConfig(mode="ngram", max_k=6, always=True), [scripted])
    spec = run(engine, arrivals)
    assert spec == plain
    assert len(plain[0]["g2"]) == 7 and len(plain[0]["g3"]) == 1
    assert len(plain[0]["g0"]) < 24 and plain[0]["g0"][-1][0] == stop_token
    assert engine.spec_stats()["total"]["accepted_tokens"] >= 8
    assert_pool_clean(engine)


def test_ngram_and_draft_model_under_preemption(demo_pair):
    """Both real proposers, a pool so small that requests are preempted and recomputed: the
    same text, every block back in both pools, every proposer's state released."""
    ps = prompts(demo_pair, 16)[8:]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    arrivals = {i % 3: [] for i in range(3)}
    for i, p in enumerate(ps):
        arrivals[i % 3].append((f"r{i}", p, params))
    plain, _ = run(make_engine(demo_pair), arrivals)
    engine = make_engine(demo_pair, num_blocks=20)
    config = SpecConfig(mode="auto", draft_model=str(DEMO_DRAFT), always=True)
    engine.speculator = spec = real_speculator(demo_pair, engine, config)
    got, _ = run(engine, arrivals)
    assert got == plain
    assert engine.scheduler.num_preemptions > 0
    by = engine.spec_stats()["by_proposer"]
    assert by["ngram"]["verify_steps"] > 0 and by["draft"]["verify_steps"] > 0
    assert by["draft"]["accepted_tokens"] > 0
    engine.step()  # an empty step hands the last finished ids to the speculator
    assert not spec.proposers["ngram"].request_ids() and not spec.proposers["draft"].request_ids()
    draft_alloc = spec.proposers["draft"].allocator
    assert draft_alloc.num_free == draft_alloc.num_blocks
    assert_pool_clean(engine)


def test_cost_picker_path_is_exact(demo_pair):
    """--speculative auto as the picker runs it (exploring eagerly, so that it speculates
    within a short test): output unchanged."""
    ps = prompts(demo_pair, 16)[12:]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
    arrivals = {0: [(f"r{i}", p, params) for i, p in enumerate(ps)]}
    plain, _ = run(make_engine(demo_pair), arrivals)
    engine = make_engine(demo_pair)
    config = SpecConfig(
        mode="auto", draft_model=str(DEMO_DRAFT), explore_interval=1, explore_budget=0.5
    )
    engine.speculator = real_speculator(demo_pair, engine, config)
    got, _ = run(engine, arrivals)
    assert got == plain
    stats = engine.spec_stats()
    assert stats["total"]["verify_steps"] > 0 and stats["total"]["accepted_tokens"] > 0
    assert engine.speculator.picker.target_cost.measured()  # step times reached the picker


def test_picker_is_fed_whole_steps(demo_pair):
    """Each step time the picker gets covers more than the forward (schedule, commit and the
    host work of drafting are in it: for a small model on a GPU they decide whether drafts
    pay); draft-model forwards are recorded apart, not twice."""
    engine = make_engine(demo_pair)
    # every round runs (idle_budget 0): steps of skipped rounds reach the picker as one mean
    config = SpecConfig(
        mode="auto", draft_model=str(DEMO_DRAFT), explore_interval=1, idle_budget=0.0
    )
    engine.speculator = spec = real_speculator(demo_pair, engine, config)
    forwards: list[float] = []
    commits: list[float] = []
    steps: list[float] = []
    execute, commit, record = engine.runner.execute, engine._commit, spec.record_step_time

    def timed(fn, into):
        def call(*args):
            start = time.perf_counter()
            out = fn(*args)
            into.append(time.perf_counter() - start)
            return out

        return call

    def recorded(num_tokens, seconds, ahead=False):
        steps.append(seconds)
        record(num_tokens, seconds, ahead)

    engine.runner.execute, engine._commit = timed(execute, forwards), timed(commit, commits)
    spec.record_step_time = recorded
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine.add_request(prompts(demo_pair, 1)[0], params)
    while engine.has_unfinished():
        engine.step()
    assert len(steps) == len(forwards) == len(commits) > 10
    assert all(s >= f + c for s, f, c in zip(steps, forwards, commits, strict=True))


@torch.inference_mode()
def exact_top3(model, tokens: list[int]) -> dict[int, float]:
    """p(next token) at temperature 1 with top-k 3, from one full forward."""
    from moestream.layers.attention import AttentionMetadata

    n = len(tokens)
    nb = -(-n // BS)
    kv = model.make_kv_cache(nb, BS)
    attn = AttentionMetadata.build([(0, n, list(range(nb)))], BS, "cpu")
    hidden = model.forward(torch.tensor(tokens), torch.arange(n), attn, kv)
    logits = model.compute_logits(hidden[-1:])[0]
    top = logits.topk(3)
    probs = torch.softmax(top.values, dim=-1)
    return dict(zip(top.indices.tolist(), probs.tolist()))


class FixedDraft(Proposer):
    """After the first output token t0, drafts `draft_of[t0]`."""

    name = "fixed"

    def __init__(self, draft_of: dict[int, int]):
        self.draft_of = draft_of

    def propose(self, inputs):
        return {
            i.request_id: Proposal([self.draft_of[i.output_token_ids[0]]])
            for i in inputs
            if len(i.output_token_ids) == 1
        }

    def release(self, request_id):
        pass


def test_sampled_tokens_keep_the_target_distribution(demo_pair):
    """Temperature 1, top-k 3: the joint law of the first two tokens, with the second verified
    against a draft the target finds unlikely, equals the target's (total variation)."""
    model = demo_pair.draft  # a small real model keeps 1,200 requests quick
    prompt = demo_pair.tokenizer.encode("def main(argv):\n    ")
    p0 = exact_top3(model, prompt)
    p1 = {t0: exact_top3(model, prompt + [t0]) for t0 in p0}
    draft_of = {t0: min(p, key=p.get) for t0, p in p1.items()}  # the least likely of the three
    exact = {(a, b): p0[a] * p1[a][b] for a in p0 for b in p1[a]}
    engine = Engine(
        model,
        demo_pair.tokenizer,
        CacheConfig(block_size=BS, enable_prefix_caching=True),
        SchedConfig(max_num_seqs=400, max_num_batched_tokens=4096, max_model_len=256),
    )
    engine.speculator = Speculator(SpecConfig(mode="ngram", always=True), [FixedDraft(draft_of)])
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    n = 1200
    for i in range(n):
        engine.add_request(prompt, params, f"s{i}")
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    pairs = Counter((o[0], o[1]) for o in outs.values())
    tv = 0.5 * sum(abs(pairs[c] / n - exact.get(c, 0.0)) for c in set(pairs) | set(exact))
    assert tv < 0.06, (tv, pairs, exact)
    stats = engine.spec_stats()["total"]
    expected_rate = sum(p0[a] * p1[a][draft_of[a]] for a in p0)
    assert stats["verify_steps"] == n
    assert abs(stats["acceptance_rate"] - expected_rate) < 0.05
    # Had every draft been taken, the second token would be the unlikely one far too often.
    assert sum(p0[a] * abs(1 - p1[a][draft_of[a]]) for a in p0) > 0.3


def test_constrained_requests_do_not_speculate(demo_pair):
    class Processor:
        def __init__(self, ids):
            self.ids = set(ids)

        def __contains__(self, rid):
            return rid in self.ids

        def apply(self, logits, request_ids, output_token_ids):
            return logits

    class Opaque(Processor):
        __contains__ = None  # cannot say which requests it changes

        def __len__(self):
            return len(self.ids)

    ps = prompts(demo_pair, 13)[12:] * 2  # copy-heavy: n-gram always has drafts
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for processor, drafted in ((Processor({"a"}), {"b"}), (Opaque({"a"}), set())):
        engine = make_engine(demo_pair)
        engine.speculator = Speculator(SpecConfig(mode="ngram", always=True), [NgramProposer()])
        engine.runner.logits_processor = processor
        seen: set[str] = set()

        def record(plan, seen=seen):
            seen.update(s.request_id for s in plan.scheduled if s.draft_token_ids)

        run(engine, {0: [("a", ps[0], params), ("b", ps[1], params)]}, record)
        assert seen == drafted


def test_speculator_swaps_only_between_requests(demo_pair):
    engine = make_engine(demo_pair)
    config = SpecConfig(mode="draft", draft_model=str(DEMO_DRAFT), always=True)
    spec = real_speculator(demo_pair, engine, config)
    engine.speculator = spec
    engine.add_request(prompts(demo_pair, 1)[0], SamplingParams(temperature=0, max_tokens=3))
    engine.step()
    with pytest.raises(RuntimeError):
        engine.speculator = None
    while engine.has_unfinished():
        engine.step()
    assert spec.proposers["draft"].request_ids()  # its end reaches the speculator next step
    engine.speculator = None  # releases everything the outgoing speculator held
    assert not spec.proposers["draft"].request_ids()
    alloc = spec.proposers["draft"].allocator
    assert alloc.num_free == alloc.num_blocks
    assert engine.spec_stats() is None


def test_command_line_and_default_draft(tmp_path):
    args = build_parser().parse_args(
        ["generate", "-p", "x", "--speculative", "auto", "--num-speculative-tokens", "6"]
    )
    kwargs = llm_kwargs_from_args(args)
    assert (kwargs["speculative"], kwargs["draft_model"], kwargs["num_speculative_tokens"]) == (
        "auto",
        None,
        6,
    )
    assert spec_config(DEMO_MODEL, "auto").draft_model == str(DEMO_DRAFT)
    assert spec_config(None, "draft", num_speculative_tokens=2).max_k == 2
    other = tmp_path / "other.gguf"
    assert spec_config(other, "auto").proposer_names == ("ngram",)
    assert spec_config(other, "ngram", draft_model=DEMO_DRAFT).draft_model is None
    assert not spec_config(other, "off").enabled
    with pytest.raises(RequestError, match="--draft-model"):
        spec_config(other, "draft")
    with pytest.raises(RequestError, match="--num-speculative-tokens"):
        spec_config(other, "ngram", num_speculative_tokens=0)


def test_llm_with_the_embedded_pair():
    """`LLM(speculative="auto")` on the shipped GGUFs: the engine loads the draft, sizes both
    KV pools alike and generates plain decode's text."""
    from moestream.llm import LLM

    llm = LLM(
        device="cpu", speculative=SpecConfig(mode="auto", draft_model=str(DEMO_DRAFT), always=True)
    )
    draft = llm.engine.speculator.draft_model
    assert draft.kv.num_blocks == llm.engine.scheduler.allocator.num_blocks
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = llm.generate(LOSSLESS_PROMPTS[14], params)[0].token_ids
    llm.engine.speculator = None
    assert got == llm.generate(LOSSLESS_PROMPTS[14], params)[0].token_ids


def test_bench_section_plain_vs_speculative(demo_pair):
    from types import SimpleNamespace

    from moestream.bench.runner import SECTIONS, BenchConfig
    from moestream.bench.spec_section import SpecSection

    engine = make_engine(demo_pair)
    config = BenchConfig(decode_tokens=8, repeats=2, warmup=0)
    ctx = SimpleNamespace(llm=SimpleNamespace(engine=engine, tokenizer=demo_pair.tokenizer))
    ctx.config = config
    section = SpecSection(num_prompts=1)
    assert section.run(ctx) is None  # plain engine: the section does not apply
    assert "speculative" in [s.name for s in SECTIONS]
    spec = Speculator(SpecConfig(mode="ngram", always=True), [NgramProposer()])
    engine.speculator = spec
    data = section.run(ctx)
    assert engine.speculator is spec
    copy, prose = data["rows"]
    assert (copy["kind"], prose["kind"]) == ("copy", "prose")
    assert copy["spec"]["verify_steps"] > 0 and copy["spec"]["tau"] > 1
    assert len(copy["samples"]) == 2 and copy["speedup"]["n"] == 2
    assert copy["outputs_differ"] == prose["outputs_differ"] == 0
    head, rows = section.table(data)
    assert len(rows) == 2 and len(rows[0]) == len(head)
    assert len(section.metrics(data)) == 6


def test_steps_that_capture_a_graph_are_not_timed(demo_pair, monkeypatch):
    """A step during which the runner captured a CUDA graph (its first use of a bucket) is not
    fed to the picker's step costs: its one-off capture would price that size out for good.
    Every other step is. (Counted within one run: how many steps a run takes depends on what
    the picker drafts, which depends on measured times.)"""
    from moestream.runner.model_runner import ModelRunner

    def timed_and_run(capturing: set[int]) -> tuple[int, int]:
        engine = make_engine(demo_pair)
        config = SpecConfig(mode="ngram", idle_budget=0.0)  # every step timed on its own
        engine.speculator = real_speculator(demo_pair, engine, config)
        calls = {"n": 0, "captured": 0}
        execute = engine.runner.execute

        def counting(plan):  # steps in `capturing` capture one graph each
            calls["n"] += 1
            calls["captured"] += calls["n"] in capturing
            return execute(plan)

        engine.runner.execute = counting
        monkeypatch.setattr(
            ModelRunner, "num_captured_graphs", property(lambda r: calls["captured"])
        )
        engine.add_request(prompts(demo_pair, 1)[0], SamplingParams(temperature=0, max_tokens=12))
        while engine.has_unfinished():
            engine.step()
        picker = engine.speculator.picker  # timed steps, run ahead or not
        timed = sum(picker.target_cost._count.values()) + sum(picker.plain_cost._count.values())
        return timed, calls["n"]

    timed, steps = timed_and_run(set())
    assert timed == steps
    timed, steps = timed_and_run({1, 4, 5})
    assert steps > 5 and timed == steps - 3

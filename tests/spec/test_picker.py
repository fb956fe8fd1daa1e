"""Picker, cost model and counters on synthetic acceptance and cost; the Speculator driving the
real scheduler against a simulated target."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from moestream.errors import RequestError
from moestream.sched.scheduler import Scheduler
from moestream.spec.base import ProposalInput, Proposer, SpecConfig
from moestream.spec.ngram import NgramProposer
from moestream.spec.picker import FIRST_TRIES, Candidate, Choice, Picker
from moestream.spec.speculator import IDLE_AFTER, IDLE_MAX_SKIP, IDLE_PRICED_OUT_SKIP, Speculator
from moestream.spec.stats import AcceptanceEMA, SpecStats, StepCostModel
from moestream.types import Request, RequestStatus, SamplingParams, ScheduledRequest, StepPlan


def dense(n: int) -> float:
    """A memory-bound dense target: verifying a few more tokens is nearly free."""
    return 1.0 + 0.03 * (n - 1)


def moe(n: int) -> float:
    """An MoE target (128 experts, 8 per token): n tokens read the union of their experts."""
    distinct = 128 * (1 - (1 - 8 / 128) ** n)
    return 0.1 + 0.9 * distinct / 8


def make_picker(acceptance: float, cost: Callable[[int], float], max_k: int = 4, **kw) -> Picker:
    """A picker with acceptance a[j] = acceptance^(j+1) and `cost` measured for 1..39 tokens;
    no exploration unless `explore_budget` is given."""
    kw.setdefault("explore_budget", 0.0)
    p = Picker(("ngram",), max_k, prior=[acceptance ** (j + 1) for j in range(max_k)], **kw)
    for n in range(1, 40):
        p.record_step_time(n, cost(n))
    return p


def choose_one(p: Picker, available: int = 4, rid: str = "a", max_k: int = 4) -> Choice:
    return p.choose([Candidate(rid, max_k, {"ngram": available})])[rid]


# ---- picker ------------------------------------------------------------------------------
def test_high_acceptance_and_cheap_verify_speculate_long():
    assert choose_one(make_picker(0.9, dense)) == Choice("ngram", 4)


def test_low_acceptance_is_plain_decode():
    assert choose_one(make_picker(0.02, dense)) == Choice()


def test_moe_verify_cost_turns_speculation_off():
    assert choose_one(make_picker(0.6, dense)).k >= 2
    assert choose_one(make_picker(0.6, moe)) == Choice()
    # near-certain drafts still pay on the MoE
    assert choose_one(make_picker(0.97, moe)).arm == "ngram"


def test_k_shrinks_as_verification_gets_dearer():
    def steep(n: int) -> float:
        return 1.0 + 0.25 * (n - 1)

    assert choose_one(make_picker(0.5, dense)).k == 4
    assert choose_one(make_picker(0.5, steep)).k == 1


def test_k_is_limited_by_the_proposal_and_the_request():
    p = make_picker(0.9, dense)
    assert choose_one(p, available=2) == Choice("ngram", 2)
    assert choose_one(p, available=4, rid="b", max_k=1) == Choice("ngram", 1)


def test_untried_sizes_are_priced_pessimistically():
    p = Picker(("ngram",), 4, prior=[0.99] * 4, explore_budget=0.0)  # pricing only: no tries
    p.record_step_time(1, 1.0)
    assert choose_one(p) == Choice()  # 5 tokens may cost 5x: unknown is not cheap
    p.record_step_time(5, 1.1)
    assert choose_one(p) == Choice("ngram", 4)


def test_switches_off_and_on_as_acceptance_changes():
    p = make_picker(0.5, dense)
    assert choose_one(p).arm == "ngram"
    for _ in range(20):
        p.record_verification("a", "ngram", 4, 0)
    assert choose_one(p) == Choice()
    for _ in range(20):
        p.record_verification("a", "ngram", 4, 4)
    assert choose_one(p) == Choice("ngram", 4)


def test_decides_per_request():
    p = make_picker(0.5, dense)
    for _ in range(20):
        p.record_verification("good", "ngram", 4, 4)
        p.record_verification("bad", "ngram", 4, 0)
    got = p.choose([Candidate(r, 4, {"ngram": 4}) for r in ("good", "bad")])
    assert got == {"good": Choice("ngram", 4), "bad": Choice()}


def test_exploration_schedule_backs_off_and_is_budgeted():
    p = make_picker(0.01, dense, explore_interval=4, explore_max_interval=16, explore_budget=0.5)
    explored = [step for step in range(64) if choose_one(p).explore]
    assert explored == [0, 8, 24, 40, 56]  # at once, then after 8, 16, 16, 16 steps
    assert all(choose_one(p, available=0).arm is None for _ in range(40))  # no match: no try
    # with no measured time there is no budget for exploring, beyond the first tries of a
    # free arm at its full length while that step size is untimed
    broke = Picker(("ngram",), 4, explore_interval=1)
    tries = [choose_one(broke) for _ in range(40)]
    assert [c for c in tries if c.explore] == [Choice("ngram", 4, explore=True)] * FIRST_TRIES
    broke.record_step_time(5, 1.0)
    assert not any(choose_one(broke).explore for _ in range(40))


def test_exploration_climbs_k_while_it_pays():
    # Only a one-token decode is measured, so longer drafts look expensive until tried.
    p = Picker(("ngram",), 4, explore_interval=2, explore_budget=0.5)
    choices = []
    for _ in range(40):
        c = choose_one(p)
        p.record_step_time(1 + c.k, dense(1 + c.k))
        if c.arm:
            p.record_verification("a", "ngram", c.k, c.k)  # everything is accepted
        choices.append(c)
    ks = [c.k for c in choices]
    # a first try at the full length (its step size untimed); plain decode while one token is
    # untimed (priced optimistically); then, all accepted, the longest
    assert choices[0] == Choice("ngram", 4, explore=True) and ks[1:] == [0] + [4] * 38
    assert choices[-1] == Choice("ngram", 4)  # the picker's own choice by now, not a try


def test_plain_decode_is_priced_at_its_fastest():
    """Plain steps that ran ahead (the runner queued them before the host read the previous
    step's tokens) are cheaper than the plain steps around drafting ones; verification must
    beat the cheaper ones."""
    p = Picker(("ngram",), 4, prior=[0.5] * 4, explore_budget=0.0)
    p.record_step_time(1, 1.3)  # plain, nothing queued ahead
    p.record_step_time(5, 2.0)  # 1 + 0.5 * 4 = 3 tokens: 1.5 per second
    assert choose_one(p) == Choice("ngram", 4)  # beats 1 / 1.3 per second
    p.record_step_time(1, 0.6, ahead=True)
    assert p.plain_time(1) == 0.6
    assert choose_one(p) == Choice()  # not 1 / 0.6


def test_choose_without_commit_changes_nothing_until_committed():
    def state(p: Picker):
        reqs = {
            r: (dict(s.interval), dict(s.since_tried), dict(s.chosen_k))
            for r, s in p._requests.items()
        }
        return reqs, p.explore_spent, list(p._unsettled), dict(p._tries), dict(p._first_tries)

    p = Picker(("ngram",), 4, explore_interval=2)
    p.record_step_time(1, 1.0)
    cands = [Candidate("a", 4, {"ngram": 4})]
    before = state(p)
    peeked = p.choose(cands, commit=False)
    assert peeked == {"a": Choice("ngram", 4, explore=True)}  # a first try
    assert state(p) == before
    assert p.choose(cands, commit=False) == peeked  # still not spent
    p.commit()
    assert state(p) != before and p._first_tries == {"ngram": 1} and p._tries == {"a": 1}
    q = Picker(("ngram",), 4, explore_interval=2)
    q.record_step_time(1, 1.0)
    assert q.choose(cands) == peeked and state(q) == state(p)


def test_draft_arm_is_weighed_with_its_forward_cost():
    def picker(draft_seconds: float) -> Picker:
        p = make_picker(0.3, dense)
        p.arms, p.model_arms = ("ngram", "draft"), ("draft",)
        p.global_acceptance["draft"] = AcceptanceEMA(4, 0.05, [0.9, 0.8, 0.7, 0.6])
        p.draft_cost["draft"] = StepCostModel()
        for b in (1, 2, 4):
            p.record_draft_time("draft", b, 4, 4 * draft_seconds)
        return p

    both = [Candidate("a", 4, {"ngram": 4, "draft": 4})]
    assert picker(0.01).choose(both)["a"] == Choice("draft", 4)
    # a draft forward as dear as a target step: the cheap n-gram drafts win
    assert picker(1.0).choose(both)["a"].arm == "ngram"


def test_a_draft_arm_is_timed_twice_before_its_price_holds():
    """A draft model's first timed forward may include compiling kernels (154 ms against
    ~0.2 ms on the H200 for the tiny pair's draft). The picker tries the arm again, outside
    the exploration budget, until a second timing replaces the first; then it drafts where
    that pays. (Priced at the first timing, a budgeted try would wait for hours.)"""
    p = Picker(("draft",), 4, model_arms=("draft",), prior=[0.9, 0.8, 0.7, 0.6],
               explore_interval=4, explore_budget=0.01)  # fmt: skip
    for n in range(1, 40):
        p.record_step_time(n, dense(n))
    compile_seconds = 300.0  # the first forward's; a forward costs 0.01 after it
    choices = []
    for _ in range(40):
        c = p.choose([Candidate("a", 4, {"draft": 4})])["a"]
        choices.append(c)
        if c.arm:
            p.record_draft_time("draft", 1, c.k, compile_seconds + 0.01 * c.k)
            compile_seconds = 0.0
            p.record_verification("a", "draft", c.k, c.k)
        p.record_step_time(1 + c.k, dense(1 + c.k))
    tries = [i for i, c in enumerate(choices) if c.explore]
    assert tries[:2] == [0, 1]  # at once, and again (all accepted), both unbudgeted
    assert choices[-1] == Choice("draft", 4)  # the picker's own choice, priced at 0.01
    assert p.draft_time("draft", 1) == pytest.approx(0.01)


def test_an_arm_is_priced_out_only_when_perfect_drafts_would_not_pay():
    """`priced_out`: every arm a model arm, timed twice at batch 1, and no draft length that
    would beat plain decode even if every draft were accepted."""

    def picker(forward: float | None, arms=("draft",)) -> Picker:
        p = Picker(arms, 4, model_arms=("draft",), explore_budget=0.01)
        for n in range(1, 40):
            p.record_step_time(n, dense(n))
        for _ in range(2 if forward is not None else 0):
            p.record_draft_time("draft", 1, 4, 4 * forward)
        return p

    assert picker(1.0).priced_out(1)  # a forward as dear as a target step
    assert not picker(0.5).priced_out(1)  # k = 1: 2 tokens in 1.53 steps would pay
    assert not picker(None).priced_out(1)  # not timed yet
    assert not picker(1.0, ("ngram", "draft")).priced_out(1)  # a free arm may always pay
    once = picker(None)
    once.record_draft_time("draft", 1, 4, 4.0)
    assert not once.priced_out(1)  # timed once: it may have been compiling


class ModelArm(Proposer):
    """A stand-in draft model that costs forwards and has nothing to draft."""

    name = "draft"
    costs_forward = True

    def propose(self, inputs):
        return {}

    def release(self, request_id):
        pass


def test_a_priced_out_model_arm_is_withheld_from_the_picker():
    """With a free arm beside it, a priced-out model arm (`Picker.arm_priced_out`) is not
    offered: a round whose n-gram finds nothing asks the picker nothing, but every
    IDLE_PRICED_OUT_SKIP-th round, which offers the arm so that it is re-priced."""
    spec = Speculator(SpecConfig(mode="auto"), [NgramProposer(), ModelArm()])
    for n in range(1, 40):
        spec.record_step_time(n, dense(n))
    inputs = [ProposalInput("a", [1, 2, 3, 4, 5, 6], [], num_drafts=4)]  # no n-gram recurs
    asked = []
    choose = spec.picker.choose

    def counted(cands, *args, **kwargs):
        asked.append([sorted(c.available) for c in cands])
        return choose(cands, *args, **kwargs)

    spec.picker.choose = counted
    assert spec.propose(inputs) == {}
    assert asked == [[["draft"]]]  # not timed yet: offered
    for _ in range(2):
        spec.picker.record_draft_time("draft", 1, 4, 4 * dense(1))  # as dear as a step
    assert spec.picker.arm_priced_out("draft", 1) and not spec.picker.priced_out(1)
    assert not spec.picker.arm_priced_out("ngram", 1)
    asked.clear()
    for _ in range(2 * IDLE_PRICED_OUT_SKIP):
        assert spec.propose(inputs) == {}
    assert asked == [[["draft"]], [["draft"]]]  # re-offered twice, at rounds N and 2N
    # forced drafting (`always`) offers it whatever its price
    forced = Speculator(SpecConfig(mode="auto", always=True), [NgramProposer(), ModelArm()])
    forced.picker = spec.picker
    assert forced._offered_model_arms(1) == ["draft"]


def test_after_a_priced_out_skip_the_model_arm_is_offered_again():
    """With model arms alone, all priced out, rounds are skipped IDLE_PRICED_OUT_SKIP at a
    time (`Picker.priced_out`); those skipped rounds count as withheld ones, so the round after
    each skip offers the arm to the picker again, which re-prices it."""
    spec = Speculator(SpecConfig(mode="draft", draft_model="draft.gguf"), [ModelArm()])
    for n in range(1, 40):
        spec.record_step_time(n, dense(n))
    for _ in range(2):
        spec.picker.record_draft_time("draft", 1, 4, 4 * dense(1))  # as dear as a step
    asked = []
    choose = spec.picker.choose
    spec.picker.choose = lambda cands, *a, **kw: asked.append(len(cands)) or choose(cands, *a, **kw)
    req = decoding("r", [1, 2, 3, 4, 5, 6])
    req.sampling_params = SamplingParams(temperature=0, max_tokens=4 * IDLE_PRICED_OUT_SKIP)
    for _ in range(2 * IDLE_PRICED_OUT_SKIP + 50):
        spec.draft([req])
        req.output_token_ids.append(7)
        req.num_computed_tokens = req.num_tokens - 1
    assert spec.picker.priced_out(1)
    assert len(asked) == 2  # once at the start (then skipped), once after each of the two skips


# ---- measurements --------------------------------------------------------------------------
def test_step_cost_bounds():
    c = StepCostModel(alpha=0.5)
    assert c.upper(7) == c.lower(7) == 7.0  # nothing measured: linear
    c.record(2, 2.0)
    c.record(8, 4.0)
    assert c.upper(2) == c.lower(2) == 2.0
    assert c.upper(4) == 4.0 and c.lower(4) == 2.0  # min(t8, t2*4/2), max(t2, t8*4/8)
    assert c.upper(1) == 2.0 and c.lower(1) == 1.0
    assert c.upper(16) == 8.0 and c.lower(16) == 4.0
    c.record(8, 6.0)  # the second measurement replaces the first (a warm-up's one-off costs)
    assert c.measured() == {2: 2.0, 8: 6.0}
    c.record(8, 4.0)  # then an EMA
    assert c.measured() == {2: 2.0, 8: 5.0}
    c.record(3, 1.0)  # noise: 3 tokens measured faster than 2
    assert c.uppers(2, 3) == [2.0, 2.0, 2.0]


def test_step_cost_forgets_a_warm_up_step():
    """A first step of 200 (graph capture) must not make that size look dear for long."""
    c = StepCostModel(alpha=0.2)
    c.record(1, 200.0)
    c.record(1, 1.0)
    c.record(1, 1.0)
    assert c.measured() == {1: 1.0}


def test_step_cost_follows_a_stall_only_partly():
    """A step the host was descheduled in (here 10x) moves the estimate as a 2x step would;
    a lasting change comes through, in tens of steps for a tenfold one."""
    c = StepCostModel(alpha=0.2)
    for _ in range(3):
        c.record(5, 1.0)
    c.record(5, 10.0)
    assert c.measured()[5] == pytest.approx(1.2)
    for _ in range(3):
        c.record(5, 1.0)
    for _ in range(20):
        c.record(5, 10.0)
    assert c.measured()[5] > 9.0


def test_acceptance_ema_updates_reached_positions_only():
    e = AcceptanceEMA(4, 0.5, [0.5, 0.5, 0.5, 0.5])
    e.update(2, 1)  # draft 0 accepted, draft 1 rejected, 2 and 3 not proposed
    assert e.values == [0.75, 0.25, 0.5, 0.5]
    assert e.curve() == [0.75, 0.25, 0.25, 0.25]  # non-increasing
    assert e.expected_accepted(2) == 1.0


def test_spec_stats_counters():
    s = SpecStats()
    s.record("ngram", 4, 2)
    s.record("ngram", 2, 2, explore=True)
    s.record("draft", 3, 0)
    s.record_plain(5)
    ng = s.arms["ngram"]
    assert ng.tau == 1 + 4 / 2  # accepted + 1 per verify step
    assert ng.acceptance_rate == 4 / 6
    assert ng.acceptance_by_position == [1.0, 1.0, 0.0, 0.0]
    tot = s.total
    assert (tot.num_verify_steps, tot.num_draft_tokens, tot.num_accepted_tokens) == (3, 9, 4)
    d = s.as_dict()
    assert d["plain_steps"] == 5 and d["total"]["explore_steps"] == 1
    assert set(d["by_proposer"]) == {"draft", "ngram"}
    with pytest.raises(ValueError):
        s.record("ngram", 2, 3)


def test_spec_config_validation():
    assert SpecConfig().proposer_names == ()
    assert SpecConfig(mode="auto").proposer_names == ("ngram",)
    assert SpecConfig(mode="auto", draft_model="d.gguf").proposer_names == ("ngram", "draft")
    with pytest.raises(RequestError, match="--speculative"):
        SpecConfig(mode="eagle")
    with pytest.raises(RequestError, match="--draft-model"):
        SpecConfig(mode="draft")
    with pytest.raises(RequestError):
        SpecConfig(mode="ngram", ngram_min=3, ngram_max=2)


# ---- the speculator against a simulated target ----------------------------------------------
def simulate(
    prompts: dict[str, list[int]],
    truth: dict[str, list[int]],
    cost: Callable[[int], float],
    spec: Speculator | None,
) -> tuple[dict[str, list[int]], float]:
    """Run the scheduler with a target whose greedy output is `truth`: verification accepts
    drafts while they match it (the StepPlan contract). Returns outputs and simulated time."""
    # One block per request: Scheduler._schedule_running asks the allocator for a negative
    # number of blocks when rejected drafts left a request holding more than it needs
    # (reported to the scheduler's owner); a single block never triggers that.
    sched = Scheduler(
        block_size=1024,
        num_blocks=8,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=1024,
        enable_prefix_caching=False,
    )
    reqs = []
    for rid, prompt in prompts.items():
        params = SamplingParams(temperature=0, max_tokens=len(truth[rid]), ignore_eos=True)
        reqs.append(Request(rid, list(prompt), params))
        sched.add_request(reqs[-1])
    total = 0.0
    while sched.has_unfinished():
        plan = sched.schedule()
        sampled = {}
        for s in plan.scheduled:
            if not s.sample:
                continue
            want = truth[s.request_id][len(s.output_token_ids) :]
            a = 0
            while a < len(s.draft_token_ids) and s.draft_token_ids[a] == want[a]:
                a += 1
            sampled[s.request_id] = want[: a + 1]
        seconds = cost(plan.num_tokens)
        total += seconds
        if spec:
            spec.observe(plan, sampled)
            spec.record_step_time(plan.num_tokens, seconds)
        sched.update(plan, sampled)
        if spec:
            spec.draft(sched.running)
    return {r.request_id: r.output_token_ids for r in reqs}, total


def workload(kind: str, n_req: int = 3, n_out: int = 150, seed: int = 0):
    rng = random.Random(seed)
    prompts, truth = {}, {}
    for i in range(n_req):
        pattern = rng.sample(range(5000), 40)
        if kind == "copy":  # the output keeps repeating the prompt's pattern
            prompts[f"r{i}"] = pattern * 2
            truth[f"r{i}"] = [pattern[j % 40] for j in range(n_out)]
        elif kind == "fresh":  # nothing to copy
            prompts[f"r{i}"] = pattern
            truth[f"r{i}"] = [rng.randrange(5000) for _ in range(n_out)]
        else:  # copies, but every `period`-th token departs from the pattern
            period = 3 if kind == "adversarial" else 4  # 3: every n-gram draft is rejected
            prompts[f"r{i}"] = pattern * 2
            truth[f"r{i}"] = [
                pattern[j % 40] if j % period else rng.randrange(5000) for j in range(n_out)
            ]
    return prompts, truth


def ngram_speculator() -> Speculator:
    config = SpecConfig(mode="ngram")
    return Speculator(config, [NgramProposer(config.ngram_min, config.ngram_max)])


@pytest.mark.parametrize("kind", ["copy", "fresh", "adversarial", "partial"])
@pytest.mark.parametrize("cost", [dense, moe], ids=["dense", "moe"])
def test_speculation_is_exact_and_never_slower(kind, cost):
    prompts, truth = workload(kind)
    plain_out, plain_time = simulate(prompts, truth, cost, None)
    spec = ngram_speculator()
    out, spec_time = simulate(prompts, truth, cost, spec)
    assert out == plain_out == truth
    assert spec_time <= 1.02 * plain_time, spec.stats.as_dict()
    if kind == "copy":
        # copying pays on both targets; with cheap verification it pays a lot
        assert spec.stats.total.tau > 1.8
        assert spec_time < (0.5 if cost is dense else 0.95) * plain_time
    if kind == "partial" and cost is dense:
        assert spec_time < 0.9 * plain_time


def test_speculator_releases_finished_requests():
    prompts, truth = workload("copy", n_req=2, n_out=30)
    spec = ngram_speculator()
    simulate(prompts, truth, dense, spec)
    # finished ids reach the speculator with the next plan; an empty step delivers them
    from moestream.types import StepPlan

    spec.observe(StepPlan(finished_ids=list(prompts)), {})
    assert spec.proposers["ngram"].num_requests == 0
    assert not spec.picker._requests


class CountingNgram(NgramProposer):
    """N-gram lookup that counts its rounds (calls of `propose`)."""

    def __init__(self) -> None:
        super().__init__()
        self.rounds = 0

    def propose(self, inputs):
        self.rounds += 1
        return super().propose(inputs)


def counting_speculator(**kw) -> tuple[Speculator, CountingNgram]:
    proposer = CountingNgram()
    return Speculator(SpecConfig(mode="ngram", **kw), [proposer]), proposer


def decoding(rid: str, prompt: list[int]) -> Request:
    req = Request(rid, list(prompt), SamplingParams(temperature=0, max_tokens=256))
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = req.num_tokens - 1  # one token left to feed: a decode
    return req


def decode_rounds(spec: Speculator, proposer: CountingNgram, req: Request, steps: int):
    """Draft for `req` at each of `steps` steps, appending a token that no n-gram predicts:
    (steps at which the proposer ran, `run_ahead` after each step's round)."""
    rounds, ahead = [], []
    for step in range(steps):
        before = proposer.rounds
        spec.draft([req])
        if proposer.rounds > before:
            rounds.append(step)
        ahead.append(spec.run_ahead)
        req.output_token_ids.append(10_000 + len(req.output_token_ids))
        req.num_computed_tokens = req.num_tokens - 1
    return rounds, ahead


def test_idle_rounds_are_skipped_more_and_more_and_new_requests_end_the_skip():
    spec, proposer = counting_speculator()
    spec.record_step_time(1, 1e-9)  # any host work is far over the budget of such a step
    a = decoding("a", [1, 2, 3, 4, 5, 6])  # no n-gram recurs: nothing to draft
    a.sampling_params = SamplingParams(temperature=0, max_tokens=1024)
    rounds, ahead = decode_rounds(spec, proposer, a, 400)
    assert a.draft_token_ids == []
    # a new request counts as idle after its first round: run-ahead from then on, and the
    # rounds skipped in between double (1, 3, 7, ...) up to IDLE_MAX_SKIP
    assert all(ahead)
    gaps = [b - a for a, b in zip(rounds, rounds[1:])]
    assert gaps == [1, 2, 4, 8, 16, 32, 64, 128, IDLE_MAX_SKIP + 1]
    assert spec.stats.as_dict()["plain_steps"] == 400
    b = decoding("b", [9, 8, 9, 8, 9])  # a request new since the last round ends the skip
    spec.draft([a, b])
    assert proposer.rounds == len(rounds) + 1
    # the skipped tokens were caught up: a's index knows all of its tokens
    assert len(proposer._index["a"]) == a.num_tokens


def test_rounds_after_drafting_are_held_without_run_ahead():
    """After a round that drafted, the next IDLE_AFTER rounds all run (a copy that pauses for
    a renamed variable resumes within them) and the runner does not queue steps ahead (a
    queued step could not carry the drafts); then the idle rounds are skipped as usual."""
    spec, proposer = counting_speculator()
    for n in range(1, 6):
        spec.record_step_time(n, 1e-9)  # verifying costs nothing: drafts pay
    a = decoding("a", [1, 2, 3, 1, 2, 3, 1, 2])
    spec.draft([a])
    assert a.draft_token_ids == [3, 1, 2, 3] and not spec.run_ahead
    a.output_token_ids.append(7)  # the target disagrees with the drafts
    a.num_computed_tokens = a.num_tokens - 1
    rounds, ahead = decode_rounds(spec, proposer, a, 12)
    assert rounds[:IDLE_AFTER] == list(range(IDLE_AFTER))
    assert ahead[: IDLE_AFTER - 1] == [False] * (IDLE_AFTER - 1) and all(ahead[IDLE_AFTER - 1 :])
    assert rounds[IDLE_AFTER : IDLE_AFTER + 2] == [IDLE_AFTER, IDLE_AFTER + 2]


def test_no_skipping_when_host_work_is_small_against_the_step_or_budget_is_zero():
    for step, kw in ((10.0, {}), (1e-9, {"idle_budget": 0.0})):
        spec, proposer = counting_speculator(**kw)
        spec.record_step_time(1, step)
        a = decoding("a", [1, 2, 3, 4, 5, 6])
        for i in range(5):
            spec.draft([a])
            assert proposer.rounds == i + 1
            a.output_token_ids.append(100 + i)
            a.num_computed_tokens = a.num_tokens - 1


@pytest.mark.parametrize("kind", ["copy", "fresh", "partial"])
def test_skipping_idle_rounds_on_a_fast_target_stays_exact(kind):
    """A target step of a microsecond: rounds that draft nothing cost more than the step, so
    most are skipped; the output stays the plain decode's and copying still drafts."""
    prompts, truth = workload(kind)
    spec, proposer = counting_speculator()
    out, _ = simulate(prompts, truth, lambda n: 1e-6 * dense(n), spec)
    assert out == truth
    stats = spec.stats
    if kind == "fresh":  # 150 decode steps of 3 requests, no drafts
        assert not stats.arms and proposer.rounds < 150 / 4, proposer.rounds
    if kind == "copy":
        assert stats.total.tau > 1.5, stats.as_dict()


def test_new_requests_restart_the_ramp_only_while_recent_requests_drafted():
    """On a fast target (0.2 ms steps), requests with nothing to copy, one after another:
    while recent ones drafted (at first) each new request restarts the ramp of skipped rounds;
    once the share of requests that drafted has fallen, a new request gets its own round and
    the skipping goes on. A request that copies is still found (its first round's proposal is
    tried, and tries that are all accepted are followed by rounds at once), and restarts come
    back."""
    spec, proposer = counting_speculator(idle_budget=1e-4)  # the ramp, not the budget, caps
    fast = lambda n: 2e-4 * dense(n)  # noqa: E731  (0.2 ms: the tiny pair on the H200)
    rounds = []

    def run(kind: str, seed: int, n_out: int) -> int:
        """Rounds for one request (its end then reaches the speculator, as with the next
        request's plan)."""
        (prompt,), (want,) = (d.values() for d in workload(kind, 1, n_out, seed))
        rid = f"{kind}{seed}"
        before = proposer.rounds
        out, _ = simulate({rid: prompt}, {rid: want}, fast, spec)
        assert out == {rid: want}
        spec.observe(StepPlan(finished_ids=[rid]), {})
        return proposer.rounds - before

    rounds = [run("fresh", seed, 100) for seed in range(8)]
    assert rounds[0] >= 7 and max(rounds[-3:]) <= 2, rounds
    assert spec.drafting_share < 0.25
    verified = spec.stats.total.num_verify_steps
    run("copy", 9, 150)
    assert spec.stats.total.num_verify_steps > verified + 20, spec.stats.as_dict()
    assert spec.drafting_share > 0.25  # the next request restarts the ramp again
    assert run("fresh", 10, 100) >= 7


def test_a_round_whose_step_is_queued_defers_its_drafts():
    """The runner queued the next step as plain decode: drafts for it would leave that work
    wasted, so the round hands out none and turns run-ahead off; the next round drafts."""
    spec, _ = counting_speculator()
    for n in range(1, 6):
        spec.record_step_time(n, 1e-9)  # verifying costs nothing: drafts pay
    a = decoding("a", [1, 2, 3, 1, 2, 3, 1, 2])
    spec.draft([a], queued=True)
    assert a.draft_token_ids == [] and spec.deferred and not spec.run_ahead
    assert not spec.picker._first_tries and not spec.picker._tries  # nothing spent
    a.output_token_ids.append(3)
    a.num_computed_tokens = a.num_tokens - 1
    spec.draft([a])
    assert a.draft_token_ids == [1, 2, 3, 1] and not spec.deferred


def test_steps_of_skipped_rounds_reach_the_picker_as_one_mean_step():
    spec, _ = counting_speculator()
    spec.record_step_time(1, 1e-9)
    a = decoding("a", [1, 2, 3, 4, 5, 6])
    for _ in range(2):  # the second round in a row that drafts nothing starts skipping
        spec.draft([a])
        a.output_token_ids.append(100 + len(a.output_token_ids))
        a.num_computed_tokens = a.num_tokens - 1
    plan = StepPlan([ScheduledRequest("a", [a.output_token_ids[-1]], a.num_tokens - 1, [], True)])
    assert spec.skips(plan)
    spec.skip(1.0)
    assert not spec.skips(plan)  # the one round skipped
    assert not spec.skips(StepPlan(plan.scheduled, finished_ids=["b"]))  # someone left
    measured = spec.picker.time_measured
    spec.end_idle()
    assert spec.picker.plain_cost.measured() == {1: pytest.approx(1.0, rel=0.01)}
    assert spec.picker.time_measured == pytest.approx(measured + 1.0, rel=0.01)
    spec._skip = 2  # a stretch in which a CUDA graph was captured is dropped
    spec.skip(5.0)
    spec.skip(5.0)
    spec.end_idle(timed=False)
    assert spec.picker.plain_cost.measured() == {1: pytest.approx(1.0, rel=0.01)}


@pytest.mark.parametrize("right", [True, False])
def test_unchosen_ngram_proposals_measure_acceptance_against_the_plain_tokens(right):
    """The picker declines (verification not yet measured), yet the n-gram proposal it did
    not choose is checked against the tokens the request then produced: acceptance rises when
    they match and falls when they do not, for a sampled request as for a greedy one (the
    matches are a draw of what verification would accept: tests/sampling/test_rejection.py)."""
    spec, proposer = counting_speculator()
    for n in range(1, 12):  # every size timed, linear: drafting never pays; no idle skipping
        spec.record_step_time(n, 2.0 * n)
    a = decoding("a", [5, 6, 7, 8, 9, 5, 6, 7])  # the n-gram proposes 8, 9, 5, 6
    hot = decoding("hot", [5, 6, 7, 8, 9, 5, 6, 7])
    hot.sampling_params = SamplingParams(temperature=0.8, max_tokens=64)
    prior = spec.picker.acceptance("a", "ngram")
    assert spec.picker.acceptance("hot", "ngram") == prior
    spec.draft([a, hot])
    assert a.draft_token_ids == [] and proposer.rounds == 1
    for t in [8, 9, 5, 6] if right else [4, 4, 4, 4]:
        a.output_token_ids.append(t)
        hot.output_token_ids.append(t)
    a.num_computed_tokens = a.num_tokens - 1
    hot.num_computed_tokens = hot.num_tokens - 1
    spec.draft([a, hot])
    for rid in ("a", "hot"):
        after = spec.picker.acceptance(rid, "ngram")
        if right:
            assert after[3] > prior[3] and after[0] > prior[0], rid
        else:
            assert after[0] < prior[0], rid


def test_skipped_steps_count_as_plain_steps_whenever_the_counters_are_read():
    """`skip` only counts steps; the plain request-steps they make are settled when the
    counters are read, at the next round or `end_idle`, each step counted once."""
    spec, _ = counting_speculator()
    spec.record_step_time(2, 1e-9)
    a, b = decoding("a", [1, 2, 3, 4, 5, 6]), decoding("b", [7, 8, 9, 10, 11])
    for _ in range(2):  # the second round in a row that drafts nothing starts skipping
        spec.draft([a, b])
    before = spec.stats.num_plain_steps
    spec._skip = 5
    for _ in range(3):
        spec.skip(1.0)
    assert spec.stats.num_plain_steps == before + 3 * 2
    spec.skip(1.0)
    spec.end_idle()
    assert spec.stats.num_plain_steps == before + 4 * 2
    spec.skip(1.0)
    spec.draft([a])  # the round size changes: the step before it counts at the old size
    assert spec.stats.num_plain_steps == before + 5 * 2 + 1

"""Scheduler tests against a fake model that reads its context back out of a fake KV pool.

The fake model's next token is a hash of every token before it, read through the block table,
so a wrong position, a wrong block, a prefix-cache block with other content or a lost token
changes the output. Exactness: each request's output equals running it alone.
"""

import random

import pytest

from moestream.errors import CapacityError, RequestError
from moestream.sched.scheduler import Scheduler
from moestream.types import Request, RequestStatus, SamplingParams, StepPlan

V = 1000  # fake vocabulary
EOS = 0


def next_token(context: list[int]) -> int:
    return hash(tuple(context)) % V  # ints and tuples of ints hash the same in every process


def reference(prompt: list[int], params: SamplingParams, eos=(EOS,)) -> list[int]:
    """The request run alone, token by token."""
    out: list[int] = []
    while True:
        t = next_token(prompt + out)
        out.append(t)
        if t in params.stop_token_ids or (t in eos and not params.ignore_eos):
            return out
        if len(out) >= params.max_tokens:
            return out


class FakeRunner:
    """Runs a StepPlan per its contract on a pool holding one token per slot."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.bs = sched.block_size
        self.kv: list[int | None] = [None] * (sched.allocator.num_blocks * self.bs)

    def slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.bs] * self.bs + pos % self.bs

    def run(self, plan: StepPlan) -> dict[str, list[int]]:
        alloc, written, sampled = self.sched.allocator, set(), {}
        for s in plan.scheduled:
            fed = s.token_ids + s.draft_token_ids
            assert len(s.block_ids) * self.bs >= s.start_pos + len(fed)
            for i, t in enumerate(fed):
                b = s.block_ids[(s.start_pos + i) // self.bs]
                assert alloc.ref_count(b) == 1 and not alloc.is_cached(b), "wrote a shared block"
                slot = self.slot(s.block_ids, s.start_pos + i)
                assert slot not in written
                written.add(slot)
                self.kv[slot] = t
            if not s.sample:
                continue
            base = s.start_pos + len(s.token_ids)
            out = []
            for j in range(len(s.draft_token_ids) + 1):
                ctx = [self.kv[self.slot(s.block_ids, p)] for p in range(base + j)]
                out.append(next_token(ctx))
                if j == len(s.draft_token_ids) or s.draft_token_ids[j] != out[-1]:
                    break
            sampled[s.request_id] = out
        return sampled


def make(**kw) -> Scheduler:
    args = dict(
        block_size=4,
        num_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=256,
        enable_prefix_caching=True,
        eos_token_ids=(EOS,),
    )
    args.update(kw)
    return Scheduler(**args)


def req(rid: str, prompt: list[int], **params) -> Request:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 8)
    return Request(rid, list(prompt), SamplingParams(**params))


def drive(sched: Scheduler, arrivals: dict[int, list[Request]], proposer=None, max_steps=5000):
    """Run to completion; check plan limits and allocator invariants every step."""
    runner, finished, plans = FakeRunner(sched), {}, []
    tables: dict[str, list[int]] = {}  # a copy of each block table seen in a plan
    arrivals = {k: list(v) for k, v in arrivals.items()}
    for step in range(max_steps):
        for r in arrivals.pop(step, []):
            sched.add_request(r)
        if not arrivals and not sched.has_unfinished():
            break
        if proposer is not None:
            for r in sched.running:
                if r.num_tokens - r.num_computed_tokens == 1:
                    r.draft_token_ids = proposer(r)
        plan = sched.schedule()
        if sched.has_unfinished():
            assert not plan.is_empty, "no progress"
        ids = [s.request_id for s in plan.scheduled]
        assert len(ids) == len(set(ids)) <= sched.max_num_seqs
        assert plan.num_tokens <= sched.max_num_batched_tokens
        for e in plan.scheduled:  # a held block table only grows at the end
            seen = tables.get(e.request_id, [])
            assert e.block_ids[: len(seen)] == seen
            tables[e.request_id] = list(e.block_ids)
        for rid in plan.preempted_ids:
            tables.pop(rid, None)
        assert not set(ids) & set(plan.preempted_ids), "resumed in the step that preempted it"
        for rid in plan.preempted_ids:
            r = sched.get(rid)
            assert r.status == RequestStatus.PREEMPTED and r in sched.waiting
            assert r.num_computed_tokens == 0 and r.block_ids == []
        for r in sched.update(plan, runner.run(plan)):
            finished[r.request_id] = r
        for e in plan.scheduled:
            r = sched.get(e.request_id)
            if e.sample and r is not None:  # K/V of every token but the newest is kept
                assert r.num_computed_tokens == r.num_tokens - 1
        sched.allocator.check_invariants()
        plans.append(plan)
    else:
        raise AssertionError("did not finish")
    assert sched.allocator.num_used == 0 and sched.allocator.num_free == sched.allocator.num_blocks
    return finished, plans


def test_chunked_prefill_spreads_a_prompt_over_steps_under_the_budget():
    s = make(max_num_batched_tokens=8)
    prompt = list(range(1, 21))
    s.add_request(req("a", prompt, max_tokens=3))
    runner = FakeRunner(s)
    chunks = []
    for _ in range(3):
        plan = s.schedule()
        (e,) = plan.scheduled
        chunks.append((e.start_pos, len(e.token_ids), e.sample))
        s.update(plan, runner.run(plan))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    r = s.get("a")
    assert r.num_computed_tokens == 20 and len(r.output_token_ids) == 1
    assert r.output_token_ids == reference(prompt, r.sampling_params)[:1]


def test_decodes_go_first_then_chunked_prefills_then_waiting_requests():
    s = make(max_num_batched_tokens=10)
    runner = FakeRunner(s)

    def step():
        plan = s.schedule()
        s.update(plan, runner.run(plan))
        return [(e.request_id, len(e.token_ids)) for e in plan.scheduled]

    s.add_request(req("a", [5, 6, 7], max_tokens=20, ignore_eos=True))
    assert step() == [("a", 3)]
    s.add_request(req("b", list(range(30)), max_tokens=20, ignore_eos=True))
    assert step() == [("a", 1), ("b", 9)]
    s.add_request(req("c", [9, 9]))
    assert step() == [("a", 1), ("b", 9)]
    assert step() == [("a", 1), ("b", 9)]
    assert step() == [("a", 1), ("b", 3), ("c", 2)]
    assert step() == [("a", 1), ("b", 1), ("c", 1)]


def test_waiting_requests_are_admitted_in_arrival_order():
    s = make(max_num_seqs=2)
    reqs = [req(f"r{i}", [i + 1] * (3 + 5 * (i % 3)), max_tokens=4 + i) for i in range(6)]
    finished, plans = drive(s, {0: reqs})
    first_seen = []
    for plan in plans:
        for e in plan.scheduled:
            if e.request_id not in first_seen:
                first_seen.append(e.request_id)
    assert first_seen == [r.request_id for r in reqs]
    for r in reqs:
        assert finished[r.request_id].output_token_ids == reference(
            r.prompt_token_ids, r.sampling_params
        )


def test_a_tiny_pool_preempts_the_latest_request_which_resumes_and_finishes():
    # 6 blocks of 4: each request alone needs 5 blocks (8 + 12 - 1 positions), both need 10.
    for caching in (True, False):
        s = make(num_blocks=6, enable_prefix_caching=caching)
        a = req("a", list(range(10, 18)), max_tokens=12, ignore_eos=True)
        b = req("b", list(range(20, 28)), max_tokens=12, ignore_eos=True)
        finished, plans = drive(s, {0: [a, b]})
        preempted = [rid for p in plans for rid in p.preempted_ids]
        assert preempted and set(preempted) == {"b"}
        assert finished["b"].num_preemptions == len(preempted)
        for r in (a, b):
            assert finished[r.request_id].output_token_ids == reference(
                r.prompt_token_ids, r.sampling_params
            )
            assert finished[r.request_id].finish_reason == "length"
        assert s.stats().num_preemptions == len(preempted)


def test_abort_mid_prefill_and_mid_decode_frees_blocks():
    s = make(max_num_batched_tokens=8)
    runner = FakeRunner(s)
    s.add_request(req("p", list(range(1, 30))))
    plan = s.schedule()
    s.update(plan, runner.run(plan))
    assert s.allocator.num_used == 2
    assert s.abort("p").status == RequestStatus.FINISHED_ABORTED
    assert s.allocator.num_used == 0 and not s.has_unfinished()
    assert s.abort("p") is None  # unknown now
    assert s.schedule().finished_ids == ["p"]

    s.add_request(req("d", [1, 2, 3], max_tokens=50))
    s.add_request(req("w", [4, 5, 6]))
    for _ in range(3):
        plan = s.schedule()
        s.update(plan, runner.run(plan))
    plan = s.schedule()
    sampled = runner.run(plan)
    assert s.abort("d").finish_reason == "abort"  # while the step ran: update skips it
    assert s.update(plan, sampled) == []
    assert s.get("d") is None and [r.request_id for r in s.running] == ["w"]
    s.abort("w")
    assert s.allocator.num_used == 0 and not s.has_unfinished()
    s.allocator.check_invariants()


def test_waiting_request_can_be_aborted_or_finished_by_the_engine():
    s = make(max_num_seqs=1)
    s.add_request(req("a", [1, 2]))
    s.add_request(req("b", [3, 4]))
    s.schedule()
    assert s.abort("b").status == RequestStatus.FINISHED_ABORTED
    r = s.finish("a", "stop", stop_reason="###")  # a stop string seen by the detokenizer
    assert (r.status, r.finish_reason, r.stop_reason) == (
        RequestStatus.FINISHED_STOPPED,
        "stop",
        "###",
    )
    assert not s.has_unfinished() and s.allocator.num_used == 0


def test_admission_errors_name_the_numbers():
    s = make(num_blocks=8, max_model_len=100)
    with pytest.raises(RequestError, match="prompt of 90 tokens plus max_tokens 20 exceeds .* 100"):
        s.add_request(req("long", [1] * 90, max_tokens=20))
    with pytest.raises(CapacityError, match="needs 10 KV blocks of 4 tokens, .* only 8"):
        s.add_request(req("big", [1] * 30, max_tokens=10))
    with pytest.raises(RequestError, match="empty prompt"):
        s.add_request(req("empty", []))
    s.add_request(req("ok", [1] * 24, max_tokens=9))  # 32 positions: exactly the pool
    with pytest.raises(RequestError, match="already in use"):
        s.add_request(req("ok", [1]))
    assert s.stats().num_waiting == 1


def test_stop_token_ids_eos_and_max_tokens_finish_requests():
    prompt = [1, 2, 3]
    free_run = reference(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    stop_tok = free_run[2]
    s = make(eos_token_ids=(free_run[3],))
    finished, _ = drive(
        s,
        {
            0: [
                req("stop", prompt, max_tokens=6, stop_token_ids=[stop_tok], ignore_eos=True),
                req("eos", prompt, max_tokens=6),
                req("len", prompt, max_tokens=6, ignore_eos=True),
            ]
        },
    )
    first = free_run.index(stop_tok)
    assert finished["stop"].output_token_ids == free_run[: first + 1]
    assert (finished["stop"].finish_reason, finished["stop"].stop_reason) == ("stop", stop_tok)
    eos_at = free_run.index(free_run[3])
    assert finished["eos"].output_token_ids == free_run[: eos_at + 1]
    assert (finished["eos"].finish_reason, finished["eos"].stop_reason) == ("stop", None)
    assert finished["len"].output_token_ids == free_run
    assert finished["len"].finish_reason == "length"
    # EOS ids given per request (the engine knows the tokenizer's) replace the scheduler's.
    s = make(eos_token_ids=())
    s.add_request(req("own-eos", prompt, max_tokens=6), eos_token_ids=[free_run[1]])
    finished, _ = drive(s, {})
    assert finished["own-eos"].output_token_ids == free_run[: free_run.index(free_run[1]) + 1]


def test_prefix_hit_is_reported_as_cached_tokens():
    s = make()
    shared = list(range(100, 123))  # 23 tokens: 5 full blocks
    drive(s, {0: [req("first", shared + [1, 2])]})
    second = req("second", shared + [7, 8, 9])
    s.add_request(second)
    plan = s.schedule()
    assert second.num_cached_tokens == 20 and plan.scheduled[0].start_pos == 20
    assert plan.scheduled[0].token_ids == shared[20:] + [7, 8, 9]
    st = s.stats()
    assert st.prefix_queries == 2 and st.prefix_hit_tokens == 20
    s.abort("second")


def _mixed_workload(seed: int, n: int = 14) -> dict[int, list[Request]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, V) for _ in range(21)]
    arrivals: dict[int, list[Request]] = {}
    for i in range(n):
        tail = [rng.randrange(1, V) for _ in range(rng.randint(1, 20))]
        prompt = system + tail if i % 3 else tail
        if i % 5 == 4:
            prompt = arrivals[min(arrivals)][0].prompt_token_ids  # an exact repeat
        r = req(f"r{i}", prompt, max_tokens=rng.randint(1, 20), ignore_eos=i % 2 == 0)
        arrivals.setdefault(rng.randint(0, 40), []).append(r)
    return arrivals


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("num_blocks,budget", [(64, 32), (20, 7), (16, 64)])
def test_batched_output_equals_running_each_request_alone(caching, num_blocks, budget):
    arrivals = _mixed_workload(seed=num_blocks + budget)
    s = make(
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        max_model_len=64,
    )
    finished, _ = drive(s, arrivals)
    reqs = [r for rs in arrivals.values() for r in rs]
    assert len(finished) == len(reqs)
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params), r.request_id
    if caching:
        assert s.stats().prefix_hit_tokens > 0
    if num_blocks < 64:
        assert s.stats().num_preemptions > 0


def test_draft_tokens_are_verified_without_changing_the_output():
    rng = random.Random(3)

    def proposer(r: Request) -> list[int]:
        truth = reference(
            r.all_token_ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        )
        k = rng.randint(0, 4)
        wrong_at = rng.randint(0, 4)
        return [t if i < wrong_at else (t + 1) % V for i, t in enumerate(truth[:k])]

    arrivals = _mixed_workload(seed=7, n=8)
    s = make(num_blocks=24, max_num_batched_tokens=16, max_model_len=64)
    finished, plans = drive(s, arrivals, proposer=proposer)
    for r in (r for rs in arrivals.values() for r in rs):
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params)
        assert len(r.output_token_ids) <= r.sampling_params.max_tokens
    assert any(e.draft_token_ids for p in plans for e in p.scheduled)


def test_update_rejects_a_runner_that_breaks_the_contract():
    s = make()
    s.add_request(req("a", [1, 2, 3]))
    plan = s.schedule()
    with pytest.raises(ValueError):
        s.update(plan, {})  # a sampling step must return a token
    with pytest.raises(ValueError):
        s.update(plan, {"a": [4, 5]})  # two tokens without drafts


def test_update_rejects_accepted_tokens_that_are_not_the_drafts():
    s = make()
    s.add_request(req("a", [1, 2, 3], max_tokens=10))
    plan = s.schedule()
    s.update(plan, FakeRunner(s).run(plan))
    s.get("a").draft_token_ids = [7, 8]
    plan = s.schedule()
    assert plan.scheduled[0].draft_token_ids == [7, 8] and plan.num_tokens == 3
    with pytest.raises(ValueError, match="not drafts"):
        s.update(plan, {"a": [9, 5]})
    with pytest.raises(ValueError):
        s.finish("a", "bored")


@pytest.mark.parametrize(
    "name,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", 1.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("seed", 1.5),
        ("max_tokens", 0),
        ("stop", [""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("ignore_eos", "yes"),
        ("logprobs", 21),
        ("logprobs", -1),
        ("n", 2),
    ],
)
def test_invalid_sampling_parameters_are_named(name, value):
    with pytest.raises(RequestError, match=f"invalid sampling parameter {name}"):
        SamplingParams(**{name: value})


def test_valid_sampling_parameters():
    p = SamplingParams(temperature=0, top_k=0, stop="###", stop_token_ids=(5,), seed=3, logprobs=0)
    assert p.greedy and p.stop == ["###"] and p.stop_token_ids == [5] and p.max_tokens == 256
    assert not SamplingParams(top_k=-1, top_p=1.0, min_p=0.0).greedy
    assert SamplingParams(top_k=1, temperature=0.7).greedy

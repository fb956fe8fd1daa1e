"""The speculator's host cost per decode step, without a model: the real scheduler and the
speculator's per-step calls, driven the way `Engine.step` drives them (`skips`/`skip` for a
skipped round; else `end_idle`, `observe`, `record_step_time`, `draft`), against a fake target
that answers from known continuations (verification accepts drafts while they match) and
takes a fixed simulated time per step. Only the speculator's calls are timed.

    python bench/spec_host_micro.py [--kinds prose,copy,late] [--modes off,ngram,auto]
                                    [--requests 32] [--batch 1] [--tokens 128]
                                    [--step-us 230] [--forward 0] [--repeats 5]
                                    [--profile MODE]

Workloads (`workload`): `prose`, little to copy (as the tiny pair's prose at temperature 1,
issue #8; sampled); `copy`, outputs that repeat the prompt with every seventh token new;
`late`, outputs that copy the prompt only after 64 tokens of prose (greedy both). `--batch`
requests decode at once (1: one after another, as `bench/spec_phases.py` runs them); a
warm-up of `WARM_UP` requests per seat comes first, and the speculator is kept throughout,
as a server keeps it. `auto` is the n-gram proposer beside a simulated draft model (a spin
of `--draft-us` per forward, counted as device time, not host time; each draft right with
probability 0.3), as on the tiny pair. `--forward N` runs N small CPU matmuls through torch
each step, as a forward's host work would: it evicts the caches the speculator's Python runs
from, which a tight loop keeps warm (on the H200 a round took ~100-130 us, here ~10-20 us).

Reported per kind and mode over `--repeats` runs (median, min-max): `host_us`, the
speculator's host microseconds per step less `off`'s (the timer's own cost); `round_us`, the
host time of a round that reached the proposers; `rounds` per request; `drafted`, the share of
steps that verified drafts; `tau`; `wait` (late), steps from the start of the copy to the
request's first drafts; `speedup`, simulated time of `off` over the mode's (steps at
`--step-us`, 3% dearer a token beyond one per decode, plus the host and draft time measured).
Outputs must equal the continuations.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from moestream.sched.scheduler import Scheduler
from moestream.spec.base import Proposal, ProposalInput, Proposer, SpecConfig
from moestream.spec.ngram import NgramProposer
from moestream.spec.speculator import Speculator
from moestream.types import Request, SamplingParams

VOCAB = 4096
PROMPT = 24  # prose prompts: the tiny pair's are 25-33 tokens
PATTERN = 40  # copy prompts: a pattern twice
LATE = 64  # `late`: tokens of prose before the copy starts
WARM_UP = 8  # requests per decoding seat before the measured ones


class FakeDraftModel(Proposer):
    """A draft model's cost and hit rate without a model: each forward spins `forward_s`;
    draft j is the continuation's token with probability `hit` (else a wrong one)."""

    name = "draft"
    costs_forward = True

    def __init__(self, truth: dict[str, list[int]], forward_s: float, hit: float = 0.3) -> None:
        self.truth = truth
        self.forward_s = forward_s
        self.hit = hit
        self.rng = random.Random(7)

    def propose(self, inputs: Sequence[ProposalInput]) -> dict[str, Proposal]:
        k = max(i.num_drafts for i in inputs)
        end = time.perf_counter() + k * self.forward_s
        while time.perf_counter() < end:
            pass
        out = {}
        for inp in inputs:
            want = self.truth[inp.request_id][len(inp.output_token_ids) :][: inp.num_drafts]
            drafts = [t if self.rng.random() < self.hit else VOCAB + 1 for t in want]
            if drafts:
                out[inp.request_id] = Proposal(drafts)
        return out

    def release(self, request_id: str) -> None:
        pass


def prose(rng: random.Random, n: int, cum_weights: list[float]) -> list[int]:
    """`n` tokens like the tiny pair's prose at temperature 1: words drawn from a Zipf law,
    and now and then (1 in 10) a phrase seen before resumed after its first word, copied on
    while a coin of 0.7 says so. N-gram lookup then proposes at ~12% of the steps, and ~55%
    of first drafts are right (the tiny pair's prose: 13% and 52%)."""
    out: list[int] = []
    seen: dict[int, list[int]] = {}  # token -> positions followed by a known token
    ptr = None  # the position whose successor is copied next
    while len(out) < n:
        if ptr is not None and rng.random() < 0.7:
            ptr += 1
        else:
            pos = seen.get(out[-1]) if out else None
            ptr = rng.choice(pos) if pos and rng.random() < 0.1 else None
        t = out[ptr + 1] if ptr is not None else rng.choices(range(VOCAB), cum_weights)[0]
        if out:
            seen.setdefault(out[-1], []).append(len(out) - 1)
        out.append(t)
    return out


def workload(kind: str, n: int, tokens: int, seed: int) -> tuple[dict, dict]:
    """Prompts and continuations of `n` requests (ids unique per seed)."""
    rng = random.Random(seed)
    cum_weights = list(itertools.accumulate(1.0 / (r + 1) for r in range(VOCAB)))
    prompts, truth = {}, {}
    for i in range(n):
        rid = f"{kind}{seed}-{i}"
        if kind == "prose":
            ids = prose(rng, PROMPT + tokens, cum_weights)
            prompts[rid], truth[rid] = ids[:PROMPT], ids[PROMPT:]
            continue
        pattern = rng.sample(range(VOCAB), PATTERN)
        prompts[rid] = pattern * 2
        if kind == "copy":
            truth[rid] = [
                pattern[j % PATTERN] if j % 7 else rng.randrange(VOCAB) for j in range(tokens)
            ]
        elif kind == "late":
            head = [t + VOCAB for t in prose(rng, LATE, cum_weights)]  # none from the pattern
            truth[rid] = head + [pattern[j % PATTERN] for j in range(tokens - LATE)]
        else:
            raise ValueError(f"unknown kind {kind!r}")
    return prompts, truth


def step_cost(num_tokens: int, decodes: int, step_s: float) -> float:
    """Simulated seconds of a step: a fixed cost, 3% more per token beyond one per decode."""
    return step_s * (1.0 + 0.03 * max(0, num_tokens - max(1, decodes)))


def torch_forward(layers: int) -> Callable[[], None] | None:
    """`layers` small matmuls through torch on the CPU: a forward's host work, roughly."""
    if layers < 1:
        return None
    import torch

    torch.set_num_threads(1)
    weights = [torch.randn(256, 256) for _ in range(layers)]
    x = torch.randn(1, 256)

    def forward() -> None:
        h = x
        for w in weights:
            h = torch.nn.functional.silu(h @ w)

    return forward


def run(
    spec: Speculator | None,
    prompts: dict[str, list[int]],
    truth: dict[str, list[int]],
    batch: int,
    step_s: float,
    temperature: float,
    forward: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Every request through the scheduler, `batch` at a time; what it cost the speculator."""
    sched = Scheduler(
        block_size=1024,
        num_blocks=batch + 1,
        max_num_seqs=batch,
        max_num_batched_tokens=4096,
        max_model_len=1024,
        enable_prefix_caching=False,
    )
    reqs = []
    for rid, prompt in prompts.items():
        params = SamplingParams(
            temperature=temperature, max_tokens=len(truth[rid]), ignore_eos=True, seed=0
        )
        reqs.append(Request(rid, list(prompt), params))
        sched.add_request(reqs[-1])

    def base_tokens() -> int:
        return max(1, sum(r.num_tokens - r.num_computed_tokens for r in sched.running))

    rounds = 0
    if spec is not None:
        propose = spec.propose

        def counted(*args, **kwargs):  # a round that reached the proposers
            nonlocal rounds
            rounds += 1
            return propose(*args, **kwargs)

        spec.propose = counted
    clock = time.perf_counter
    host = device = round_host = 0.0
    steps = verify = accepted = 0
    first_drafts: dict[str, int] = {}  # request -> its output length at its first drafts
    while sched.has_unfinished():
        plan = sched.schedule()
        t0 = clock()
        skipped = spec is not None and spec.skips(plan)
        if spec is not None and not skipped:
            spec.end_idle()
        host += clock() - t0
        if forward is not None:
            forward()
        sampled, decodes = {}, 0
        for s in plan.scheduled:
            if not s.sample:
                continue
            decodes += s.is_decode
            want = truth[s.request_id][len(s.output_token_ids) :]
            a = 0
            while a < len(s.draft_token_ids) and s.draft_token_ids[a] == want[a]:
                a += 1
            sampled[s.request_id] = want[: a + 1]
            if s.draft_token_ids:
                verify += 1
                accepted += a
                first_drafts.setdefault(s.request_id, len(s.output_token_ids))
        seconds = step_cost(plan.num_tokens, decodes, step_s)
        device += seconds
        steps += 1
        if spec is None or skipped:
            sched.update(plan, sampled)
            t0 = clock()
            if spec is not None:
                spec.skip(seconds)
            host += clock() - t0
            continue
        t0 = clock()
        spec.observe(plan, sampled)
        host += clock() - t0
        sched.update(plan, sampled)
        before = rounds
        t0 = clock()
        spec.record_step_time(plan.num_tokens, seconds)
        spec.draft(sched.running, base_tokens)
        spent = clock() - t0 - spec.draft_forward_seconds
        host += spent
        round_host += spent if rounds > before else 0.0
        device += spec.draft_forward_seconds
    if spec is not None:
        del spec.propose
    for r in reqs:
        if r.output_token_ids != truth[r.request_id]:
            raise AssertionError(f"{r.request_id}: the output differs from its continuation")
    waits = [first_drafts.get(r.request_id, len(truth[r.request_id])) - LATE for r in reqs]
    return {
        "host_us": host / steps * 1e6,
        "round_us": round_host / max(1, rounds) * 1e6,
        "rounds": rounds / len(reqs),
        "drafted": verify / max(1, sum(len(t) for t in truth.values())),
        "tau": 1 + accepted / verify if verify else 0.0,
        "wait": statistics.median(waits),
        "time": device + host,
    }


def make_speculator(mode: str, truth: dict[str, list[int]], draft_s: float) -> Speculator | None:
    if mode == "off":
        return None
    config = SpecConfig(mode="ngram")
    proposers: list[Proposer] = [NgramProposer(config.ngram_min, config.ngram_max)]
    if mode == "auto":
        proposers.append(FakeDraftModel(truth, draft_s))
    return Speculator(config, proposers)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", default="prose,copy,late")
    p.add_argument("--modes", default="off,ngram,auto")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--step-us", type=float, default=230.0)
    p.add_argument("--draft-us", type=float, default=200.0, help="a simulated draft forward")
    p.add_argument("--forward", type=int, default=0, help="torch matmuls a step (cold caches)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", default=None, help="cProfile this mode's first prose run")
    args = p.parse_args()
    if args.tokens <= LATE:
        p.error(f"--tokens must exceed {LATE}")
    step_s, draft_s = args.step_us * 1e-6, args.draft_us * 1e-6
    forward = torch_forward(args.forward)
    kinds, modes = args.kinds.split(","), args.modes.split(",")
    rows: dict[tuple[str, str], list[dict]] = {(k, m): [] for k in kinds for m in modes}
    for rep in range(args.repeats):
        for k in kinds:
            temperature = 1.0 if k == "prose" else 0.0
            warm = workload(k, WARM_UP * args.batch, args.tokens, seed=1000 + rep)
            work = workload(k, args.requests, args.tokens, seed=rep)
            truth = {**warm[1], **work[1]}
            for m in modes if rep % 2 == 0 else modes[::-1]:
                spec = make_speculator(m, truth, draft_s)
                run(spec, *warm, args.batch, step_s, temperature, forward)
                prof = cProfile.Profile() if (m, k, rep) == (args.profile, "prose", 0) else None
                if prof:
                    prof.enable()
                rows[k, m].append(run(spec, *work, args.batch, step_s, temperature, forward))
                if prof:
                    prof.disable()
                    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    print(
        f"{args.requests} requests x {args.tokens} tokens, {args.batch} at a time, step "
        f"{args.step_us:.0f} us, forward {args.forward}, {args.repeats} runs: median (min-max)"
    )
    cols = ["host_us", "round_us", "rounds", "drafted", "tau", "wait", "speedup"]
    print("| kind | mode | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 2) + "|")

    def spread(xs: list[float], digits: int) -> str:
        return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"

    for k in kinds:
        off = rows.get((k, "off"))
        for m in modes:
            rs = rows[k, m]
            base = off or [{"host_us": 0.0, "time": r["time"]} for r in rs]
            cells = [
                spread([r["host_us"] - o["host_us"] for r, o in zip(rs, base)], 2),
                f"{statistics.median(r['round_us'] for r in rs):.1f}",
                f"{statistics.median(r['rounds'] for r in rs):.1f}",
                f"{statistics.median(r['drafted'] for r in rs):.2f}",
                f"{statistics.median(r['tau'] for r in rs):.2f}",
                f"{statistics.median(r['wait'] for r in rs):.0f}" if k == "late" else "-",
                spread([o["time"] / r["time"] for r, o in zip(rs, base)], 3),
            ]
            print(f"| {k} | {m} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

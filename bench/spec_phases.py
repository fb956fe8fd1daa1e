"""Where a decode step's host time goes in each speculative mode on the trained tiny pair: the
engine's phases timed step by step (schedule, forward, commit, the speculator's bookkeeping,
proposing), the modes interleaved over rounds in one process, with garbage-collector pauses
and run-ahead hits.

    python bench/spec_phases.py [--device cuda] [--rounds 6] [--tokens 128] [--kind copy]
                                [--modes plain,plain#2,ngram,draft,auto] [--temperature 1.0]

A mode named twice with a suffix (`plain#2`) runs as a second arm of its own: how far two
identical arms differ is the noise floor of every other ratio. `plain!` is plain decode with
the runner's run-ahead off; `auto+restart` (or `ngram+restart`) restarts the ramp of skipped
proposal rounds at every new request, as before `Speculator.drafting_share`.

Each phase is timed by wrapping the engine's own methods on the instance (the same wrappers in
every mode, ~0.2 us each). "other" is the step's time outside the named phases (timing, the
engine's own checks). A mode is slower than plain decode by the sum of its rows' differences;
this names the row.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from moestream.bench.spec_section import decode_run, prompts_of
from moestream.cli import DEMO_DRAFT, DEMO_MODEL
from moestream.llm import LLM
from moestream.spec.base import SpecConfig

PHASES = ("schedule", "forward", "commit", "observe", "record", "propose")
# Parts of "forward" (the runner's execute), not in the phases' sum: the sampling batch's
# build and copy, the draw (batch included), queueing the next step ahead, the wait for the
# tokens' read-back.
RUNNER_PARTS = ("batch", "draw", "launch_next", "read_wait")
# ... and of "propose": the draft model's forwards (catch-up chunks and drafting).
SPEC_PARTS = ("draft_forward",)


class Clock:
    """Seconds per phase and steps, since the last `reset`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.rounds = 0
        self.gc_seconds = 0.0
        self.gc_count = 0
        self._gc_start = 0.0

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = 0
        self.rounds = 0
        self.gc_seconds = 0.0
        self.gc_count = 0

    def wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        seconds = self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - t

        return timed

    def gc_callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_seconds += time.perf_counter() - self._gc_start
            self.gc_count += 1


def instrument(engine: Any, clock: Clock) -> None:
    engine.scheduler.schedule = clock.wrap(engine.scheduler.schedule, "schedule")
    runner = engine.runner
    runner.execute = clock.wrap(runner.execute, "forward")
    runner._sampling_batch = clock.wrap(runner._sampling_batch, "batch")
    runner._draw = clock.wrap(runner._draw, "draw")
    runner._launch_next = clock.wrap(runner._launch_next, "launch_next")
    runner.reader.finish = clock.wrap(runner.reader.finish, "read_wait")
    engine._commit = clock.wrap(engine._commit, "commit")
    engine._propose_drafts = clock.wrap(engine._propose_drafts, "propose")
    step = clock.wrap(engine.step, "step")

    def counted() -> Any:
        clock.steps += 1
        return step()

    engine.step = counted


def instrument_speculator(spec: Any, clock: Clock) -> None:
    spec.observe = clock.wrap(spec.observe, "observe")
    spec.record_step_time = clock.wrap(spec.record_step_time, "record")
    propose = spec.propose

    def counted(*args: Any, **kwargs: Any) -> Any:
        clock.rounds += 1  # a proposal round that reached the proposers (not skipped)
        return propose(*args, **kwargs)

    spec.propose = counted
    for p in spec.proposers.values():
        if p.costs_forward:  # a draft model's forwards (inside "propose")
            p.propose = clock.wrap(p.propose, "draft_forward")


def arm_counts(spec: Any) -> dict[str, tuple[int, int]]:
    """(verify steps, exploration steps) per proposer so far."""
    if spec is None:
        return {}
    return {a: (s.num_verify_steps, s.num_explore_steps) for a, s in spec.stats.arms.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kind", default="copy", help="copy or prose prompts")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--modes", default="plain,ngram,draft,auto")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample at this temperature (seed = prompt index) instead of greedy: output with "
        "little to copy, where n-gram drafts are rarely there",
    )
    p.add_argument("--freeze", action="store_true", help="gc.freeze() after the warm-up round")
    args = p.parse_args()
    torch.set_num_threads(1)
    kv = {"kv_cache_gib": 2.0} if args.device != "cpu" else {}
    llm = LLM(DEMO_MODEL, device=args.device, enable_prefix_caching=False, **kv)
    engine = llm.engine
    clock = Clock()
    instrument(engine, clock)
    gc.callbacks.append(clock.gc_callback)
    modes = args.modes.split(",")
    specs: dict[str, Any] = {}
    for m in modes:
        specs[m] = None
        # "plain#2": a second arm of the same mode (the noise floor); "plain!": plain decode
        # with the runner's run-ahead off
        mode = m.split("#")[0].rstrip("!").removesuffix("+restart")
        if mode != "plain":
            specs[m] = engine.build_speculator(SpecConfig(mode=mode, draft_model=str(DEMO_DRAFT)))
            instrument_speculator(specs[m], clock)
            if m.endswith("+restart"):  # every new request restarts the idle ramp (old rule)
                specs[m].restart_share = 0.0
    prompts = [llm.tokenizer.encode(t) for t in prompts_of(args.kind, args.prompts)]
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(args.rounds + 1):  # round 0 warms up (compiles, captures, picker costs)
        if r == 1 and args.freeze:
            gc.collect()
            gc.freeze()
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        if r % 2:
            order.reverse()
        for m in order:
            engine.speculator = specs[m]
            if m.startswith("plain!"):
                engine.runner.run_ahead = False
            hits = engine.runner.run_ahead_hits
            dropped = engine.runner.run_ahead_dropped
            arms = arm_counts(specs[m])
            clock.reset()
            res = decode_run(engine, prompts, args.tokens + 2, args.temperature)
            engine.speculator = None  # (which turns run-ahead back on)
            steps = max(1, clock.steps)
            row = {f"{k}_us": v / steps * 1e6 for k, v in clock.seconds.items()}
            named = sum(clock.seconds[k] for k in PHASES)
            row["other_us"] = (clock.seconds["step"] - named) / steps * 1e6
            row["tok_s"] = res["tok_s"]
            row["steps"] = clock.steps
            row["gc"] = clock.gc_count
            row["gc_ms"] = clock.gc_seconds * 1e3
            row["ahead"] = (engine.runner.run_ahead_hits - hits) / steps
            row["dropped"] = engine.runner.run_ahead_dropped - dropped  # per run
            spec = res["spec"]
            row["verify_steps"] = spec.verified.num_verify_steps if spec is not None else 0
            row["rounds"] = clock.rounds  # per run
            # host time of a round (the engine's `_propose_drafts`, draft forwards included)
            row["round_us"] = clock.seconds["propose"] / clock.rounds * 1e6 if clock.rounds else 0
            tries = {
                a: (v - arms.get(a, (0, 0))[0], x - arms.get(a, (0, 0))[1])
                for a, (v, x) in arm_counts(specs[m]).items()
            }  # this run's (verify, exploration) steps per proposer
            print(f"round {r} {m}: {res['tok_s']:.0f} tok/s, verify/explore steps {tries}, "
                  f"draft forwards {clock.seconds['draft_forward'] * 1e3:.1f} ms",
                  file=sys.stderr)  # fmt: skip
            if r:
                rows[m].append(row)
    cols = ["tok_s", "step_us", *[f"{k}_us" for k in PHASES], "other_us",
            *[f"{k}_us" for k in RUNNER_PARTS + SPEC_PARTS], "ahead", "dropped", "gc", "gc_ms",
            "verify_steps", "rounds", "round_us"]  # fmt: skip
    sampled = f", temperature {args.temperature}" if args.temperature > 0 else ""
    frozen = " gc frozen" if args.freeze else ""
    print(f"{args.kind} prompts{sampled}, {args.prompts} x {args.tokens} tokens, "
          f"{args.rounds} rounds (medians; tok_s min-max){frozen}")  # fmt: skip
    print("| mode | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for m, rs in rows.items():
        cells = []
        for c in cols:
            vals = [x.get(c, 0.0) for x in rs]
            med = statistics.median(vals)
            cell = f"{med:,.1f}" if c != "ahead" else f"{med:.2f}"
            if c == "tok_s":
                cell += f" ({min(vals):,.0f}-{max(vals):,.0f})"
            cells.append(cell)
        print(f"| {m} | " + " | ".join(cells) + " |")
    plain = rows.get("plain")
    if plain:
        for m, rs in rows.items():
            ratios = [x["tok_s"] / q["tok_s"] for x, q in zip(rs, plain)]
            print(f"{m}: {statistics.median(ratios):.3f}x of plain "
                  f"({min(ratios):.3f}-{max(ratios):.3f}, per-round ratios)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Speculation on a simulated host-bound GPU target: the real engine (scheduler, speculator,
commit, text) over `SimulatedRunner` (moestream/bench/sim_runner.py), which answers from known
continuations and spends a small GPU model's device time in real time, run-ahead included.

    python bench/spec_sim.py [--kinds copy,rewrite,fresh,adversarial,partial] [--rounds 5]
                             [--tokens 128] [--requests 3] [--concurrent] [--modes ...]
                             [--temperature 1.0]
                             [--decode-us 190] [--verify-us 280] [--row-us 10] [--launch-us 5]
                             [--clock wall|cpu]

The defaults are a device-bound step (the device's 190 us hide the host's work when the
runner queues steps ahead); `--launch-us 150 --decode-us 60 --verify-us 120` makes launching
a step cost the host more than the device's work, so every microsecond of host work shows.

Each round runs every mode once per workload kind (order rotated and reversed from round to
round); round 0 is a warm-up whose figures are dropped, and each mode keeps one speculator
throughout (as a server does). Reported per kind and mode, medians over rounds: tok/s, the
median per-round ratio to plain decode, host time per step (the thread's CPU time less
what it spent waiting for the device: unlike wall time, not inflated when the process is
descheduled) and its median per-round excess over plain decode's,
the share of request-steps that carried drafts, tau, exploration tries and run-ahead steps
dropped per run. Outputs must equal the continuations.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from moestream.bench.sim_runner import (
    CpuClock,
    DeviceTimes,
    SimulatedRunner,
    WallClock,
    engine_clock,
    run_workload,
    workload,
)
from moestream.cli import DEMO_DRAFT, DEMO_MODEL
from moestream.llm import LLM
from moestream.spec.base import SpecConfig

MODES = {
    "plain": None,
    "ngram": SpecConfig(mode="ngram"),
    "auto": SpecConfig(mode="auto"),
    "ngram always": SpecConfig(mode="ngram", always=True),
    # the demo draft model, whose forwards run for real on the CPU (milliseconds each)
    "draft": SpecConfig(mode="draft", draft_model=str(DEMO_DRAFT)),
    "auto+draft": SpecConfig(mode="auto", draft_model=str(DEMO_DRAFT)),
}


def one_run(
    engine: Any, prompts: dict, truth: dict, tokens: int, concurrent: bool, temperature: float
) -> dict:
    runner, spec = engine.runner, engine.speculator
    steps, wait, dropped = runner.num_steps, runner.wait_cpu_seconds, runner.num_dropped
    before = spec.stats.total if spec else None
    plain_before = spec.stats.num_plain_steps if spec else 0
    cpu = time.thread_time()
    out, seconds = run_workload(engine, prompts, tokens, concurrent, temperature=temperature)
    cpu = time.thread_time() - cpu
    if out != truth:
        raise AssertionError("the output differs from the continuations")
    n = runner.num_steps - steps
    row = {
        "tok_s": sum(len(o) - 1 for o in out.values()) / seconds,
        "host_us": (cpu - (runner.wait_cpu_seconds - wait)) / n * 1e6,
        "steps": n,
        "dropped": runner.num_dropped - dropped,
        "drafted": 0.0,
        "tau": 0.0,
        "explore": 0,
    }
    if spec is not None:
        after = spec.stats.total
        verify = after.num_verify_steps - before.num_verify_steps
        plain = spec.stats.num_plain_steps - plain_before
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        row["drafted"] = verify / max(1, verify + plain)
        row["tau"] = 1 + accepted / verify if verify else 0.0
        row["explore"] = after.num_explore_steps - before.num_explore_steps
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", default="copy,rewrite,fresh,adversarial,partial")
    p.add_argument("--modes", default="plain,ngram,auto,ngram always")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--concurrent", action="store_true", help="requests at once, not one by one")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the requests' temperature: > 0 makes them sampled to the engine and the "
        "speculator (the simulated runner still answers with the continuations)",
    )
    d = DeviceTimes()
    p.add_argument("--decode-us", type=float, default=d.decode * 1e6, help="a decode step")
    p.add_argument("--verify-us", type=float, default=d.verify * 1e6, help="a 2-row verify")
    p.add_argument("--row-us", type=float, default=d.per_row * 1e6, help="each row beyond")
    p.add_argument("--launch-us", type=float, default=d.launch * 1e6, help="host time a launch")
    p.add_argument(
        "--clock", default="wall", choices=("wall", "cpu"),
        help="wall: real time, busy waits; cpu: the thread's CPU time plus the device's waits "
        "(what a loaded machine does not disturb)",
    )  # fmt: skip
    args = p.parse_args()
    with engine_clock(CpuClock() if args.clock == "cpu" else WallClock()) as clock:
        return run(args, clock)


def run(args: argparse.Namespace, clock: WallClock) -> int:
    times = DeviceTimes(
        decode=args.decode_us * 1e-6,
        verify=args.verify_us * 1e-6,
        per_row=args.row_us * 1e-6,
        launch=args.launch_us * 1e-6,
    )
    torch.set_num_threads(1)
    llm = LLM(DEMO_MODEL, device="cpu", enable_prefix_caching=False)
    engine = llm.engine
    kinds, modes = args.kinds.split(","), args.modes.split(",")
    work = {k: workload(k, args.requests, args.tokens, seed=i) for i, k in enumerate(kinds)}
    truth = {f"{k}/{rid}": t for k, (_, ts) in work.items() for rid, t in ts.items()}
    engine.runner = SimulatedRunner(truth, engine.cache_config.block_size, times, clock)
    specs = {m: engine.build_speculator(MODES[m]) if MODES[m] else None for m in modes}
    rows: dict[tuple[str, str], list[dict]] = {(k, m): [] for k in kinds for m in modes}
    for r in range(args.rounds + 1):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        if r % 2:
            order.reverse()
        for k in kinds:
            prompts = {f"{k}/{rid}": p for rid, p in work[k][0].items()}
            want = {rid: truth[rid] for rid in prompts}
            for m in order:
                engine.speculator = specs[m]
                row = one_run(engine, prompts, want, args.tokens, args.concurrent, args.temperature)
                engine.speculator = None
                if r:
                    rows[k, m].append(row)
    how = "at once" if args.concurrent else "one at a time"
    sampled = f", temperature {args.temperature}" if args.temperature > 0 else ""
    print(f"{args.requests} requests {how} x {args.tokens} tokens{sampled}, {args.rounds} rounds "
          f"(medians); {times}")  # fmt: skip
    cols = ["tok_s", "ratio", "host_us", "extra_us", "drafted", "tau", "explore", "dropped"]
    print("| kind | mode | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 2) + "|")
    for k in kinds:
        for m in modes:
            rs = rows[k, m]
            plain = rows.get((k, "plain"))
            med = {c: statistics.median(x[c] for x in rs) for c in cols if c in rs[0]}
            ratio = extra = float("nan")
            if plain:
                ratio = statistics.median(x["tok_s"] / q["tok_s"] for x, q in zip(rs, plain))
                extra = statistics.median(x["host_us"] - q["host_us"] for x, q in zip(rs, plain))
            cells = [
                f"{med['tok_s']:,.0f}",
                f"{ratio:.3f}",
                f"{med['host_us']:.1f}",
                f"{extra:+.1f}",
                f"{med['drafted']:.2f}",
                f"{med['tau']:.2f}",
                f"{med['explore']:.0f}",
                f"{med['dropped']:.0f}",
            ]
            print(f"| {k} | {m} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

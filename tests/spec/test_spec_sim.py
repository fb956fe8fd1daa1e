"""Speculation through the real engine (scheduler, speculator, commit, text) on a simulated
small GPU target (moestream/bench/sim_runner.py): a decode step is ~0.2 ms of device time, the
runner queues plain greedy steps ahead, and a queued step that the plan does not match still
costs the device its time. Time is the thread's CPU time plus the device's (`CpuClock`), so a
loaded machine does not change what the picker measures. Outputs must be the continuations;
what is asserted is counted (calls, steps, drafts) or a wide margin of simulated time."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from moestream.bench.sim_runner import (
    CpuClock,
    DeviceTimes,
    SimulatedRunner,
    engine_clock,
    run_workload,
    workload,
)
from moestream.cli import DEMO_MODEL
from moestream.engine import Engine
from moestream.llm import LLM
from moestream.spec.base import SpecConfig

N_OUT = 128


@pytest.fixture(scope="module")
def clock() -> Iterator[CpuClock]:
    with engine_clock(CpuClock()) as c:
        yield c  # type: ignore[misc]


@pytest.fixture(scope="module")
def engine(clock) -> Engine:
    return LLM(DEMO_MODEL, device="cpu", enable_prefix_caching=False).engine


def simulated(
    engine: Engine, clock: CpuClock, truth: dict, mode: str | None, times: DeviceTimes | None = None
) -> SimulatedRunner:
    """`engine` on a fresh simulated target, with a fresh speculator for `mode` (or none)."""
    engine.speculator = None
    runner = SimulatedRunner(truth, engine.cache_config.block_size, times or DeviceTimes(), clock)
    engine.runner = runner
    engine.speculator = engine.build_speculator(SpecConfig(mode=mode)) if mode else None
    return runner


def decode_time(engine: Engine, prompts: dict, truth: dict) -> float:
    out, seconds = run_workload(engine, prompts, N_OUT)
    assert out == {rid: truth[rid] for rid in prompts}  # what plain decode gives
    return seconds


class CountingClock:
    """Stands in for a module's `time` (here `clock`): counts perf_counter calls."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.calls = 0

    def perf_counter(self) -> float:
        self.calls += 1
        return self.clock.perf_counter()

    def __getattr__(self, name: str):
        return getattr(self.clock, name)


def test_steps_of_skipped_rounds_cost_the_speculator_nothing(engine, clock, monkeypatch):
    """Nothing to draft (fresh text): most steps skip the proposal round, and in such a step
    the engine asks the speculator nothing but whether to skip it (no observing, no step
    record, no proposer, no picker) and reads the clock twice, as for its own timing."""
    import moestream.engine
    import moestream.spec.speculator

    prompts, truth = workload("fresh", n_req=1, n_out=300)
    simulated(engine, clock, truth, "ngram")
    spec = engine.speculator
    calls: Counter[str] = Counter()
    counting = CountingClock(clock)
    monkeypatch.setattr(moestream.engine, "time", counting)
    monkeypatch.setattr(moestream.spec.speculator, "time", counting)
    for name in ("observe", "record_step_time", "draft", "propose"):
        method = getattr(spec, name)

        def counted(*args, _name=name, _method=method, **kw):
            calls[_name] += 1
            return _method(*args, **kw)

        setattr(spec, name, counted)
    for obj, name in ((spec.picker, "choose"), (spec.proposers["ngram"], "propose")):
        method = getattr(obj, name)

        def counted_other(*args, _name=f"{type(obj).__name__}.{name}", _method=method, **kw):
            calls[_name] += 1
            return _method(*args, **kw)

        setattr(obj, name, counted_other)
    step = engine.step
    idle_steps = decode_steps = 0

    def one_step():
        nonlocal idle_steps, decode_steps
        before, clocked = sum(calls.values()), counting.calls
        out = step()
        decode_steps += 1
        if sum(calls.values()) == before:  # nothing of the speculator ran
            idle_steps += 1
            assert counting.calls - clocked == 2
        return out

    engine.step = one_step
    try:
        out, _ = run_workload(engine, prompts, 300)
    finally:
        del engine.step
    assert out == truth
    assert idle_steps > 0.75 * decode_steps, (idle_steps, decode_steps, calls)
    assert calls["Picker.choose"] == 0  # nothing was proposed: nothing to choose
    assert calls["NgramProposer.propose"] == calls["propose"] < 0.25 * decode_steps


# The host's work of a plain step as a share of the simulated device's decode step, at most
# (`times_for_this_host`). The thresholds below were set where the host's share was small; on a
# host slow enough, drafting's own host work (a verify step's is ~3.4 plain steps') and the
# plain steps' host work that run-ahead no longer hides decide alone: on 2026-12-02 the 2-core
# development machine took 217 us a plain step (114% of a decode step), a verify step of 5
# tokens cost what 5 plain steps did, and this test failed there and in CI. With the device
# slowed to keep the share at 20% it passes there again (at 30%, "rewrite" reached 1.2x).
HOST_SHARE = 0.2


def times_for_this_host(engine: Engine, clock: CpuClock, prompts: dict, truth: dict) -> DeviceTimes:
    """`DeviceTimes` slowed as much as this host is slow (every device time times one factor),
    so that a plain step's host work (thread CPU time over a plain decode of `prompts`) is at
    most `HOST_SHARE` of a decode step: the picker then faces the costs the test was made for,
    in proportion, on any machine."""
    simulated(engine, clock, truth, None)
    steps, cpu = engine.num_steps, time.thread_time()
    decode_time(engine, prompts, truth)
    host = (time.thread_time() - cpu) / (engine.num_steps - steps)
    base = DeviceTimes()
    scale = max(1.0, host / (HOST_SHARE * base.decode))
    fields = {f.name: getattr(base, f.name) * scale for f in dataclasses.fields(base)}
    return DeviceTimes(**fields)


@pytest.mark.parametrize(("kind", "share", "speedup"), [("copy", 0.8, 1.8), ("rewrite", 0.35, 1.3)])
def test_copying_is_drafted_on_a_host_bound_target(engine, clock, kind, share, speedup):
    """Copy-heavy output (a pattern repeated; a function rewritten with some variables
    renamed, where n-gram drafts fail at each renamed one): the picker adopts n-gram drafting
    on most of the steps where it pays, for a clear speed-up (forced drafting: ~2.3x and
    ~1.6x), and never drops a step the runner had queued ahead."""
    prompts, truth = workload(kind, n_req=3, n_out=N_OUT)
    warm_up = {"r0": prompts.pop("r0")}  # the picker measures costs on a first request
    times = times_for_this_host(engine, clock, prompts, truth)
    simulated(engine, clock, truth, None, times)
    plain = decode_time(engine, prompts, truth)
    runner = simulated(engine, clock, truth, "ngram", times)
    decode_time(engine, warm_up, truth)
    stats = engine.speculator.stats
    verify, plain_steps = stats.total.num_verify_steps, stats.num_plain_steps
    spec = decode_time(engine, prompts, truth)
    verify = stats.total.num_verify_steps - verify
    plain_steps = stats.num_plain_steps - plain_steps
    assert verify / (verify + plain_steps) > share, stats.as_dict()
    assert plain / spec > speedup, (plain, spec, stats.as_dict())
    assert runner.num_dropped == 0


@pytest.mark.parametrize("kind", ["fresh", "adversarial", "partial"])
def test_nothing_to_copy_costs_nothing(engine, clock, kind):
    """Nothing to copy, or n-gram drafts that fail: within 3% of plain decode (interleaved
    runs, the best of three), no run-ahead step dropped, and few verify steps (first tries
    and exploration within its 1% budget: a handful in 0.15 s)."""
    prompts, truth = workload(kind, n_req=2, n_out=N_OUT)
    plain_runner = simulated(engine, clock, truth, None)
    plain_spec = (plain_runner, None)
    spec_runner = simulated(engine, clock, truth, "ngram")
    spec = (spec_runner, engine.speculator)
    ratios = []
    for _ in range(3):
        times = {}
        for name, (runner, speculator) in (("plain", plain_spec), ("spec", spec)):
            engine.speculator = None
            engine.runner = runner
            engine.speculator = speculator
            times[name] = decode_time(engine, prompts, truth)
        ratios.append(times["plain"] / times["spec"])
    assert max(ratios) > 0.97, ratios
    stats = spec[1].stats
    assert stats.total.num_verify_steps <= 12, stats.as_dict()
    assert spec_runner.num_dropped == 0


def test_a_priced_out_draft_model_is_not_asked_again_per_request(engine, clock):
    """Draft mode where the draft model's forwards (real, on this CPU: milliseconds) cost far
    more than the simulated target's 0.2 ms step, so drafting never pays even if every draft
    were accepted. Once its forward is timed twice the arm is priced out (`Picker.priced_out`)
    and rounds stop, new requests included, also after the speculator was swapped out and back
    in (`release_all` keeps the idle count). Rounds for the four requests after the first two:
    37 before the fifth session (the skips ramped up again at every request), 11 after it,
    ~8 when a swap restarted the ramp; now none."""
    from moestream.cli import DEMO_DRAFT

    prompts, truth = workload("fresh", n_req=6, n_out=N_OUT, seed=1)
    simulated(engine, clock, truth, None)
    engine.speculator = engine.build_speculator(
        SpecConfig(mode="draft", draft_model=str(DEMO_DRAFT))
    )
    spec = engine.speculator
    rounds = 0
    choose = spec.picker.choose

    def counted(*args, **kw):
        nonlocal rounds
        rounds += 1
        return choose(*args, **kw)

    spec.picker.choose = counted
    for rid in ("r0", "r1"):  # the draft arm is tried, timed twice and priced out
        decode_time(engine, {rid: prompts.pop(rid)}, truth)
    assert spec.picker.priced_out(1)
    engine.speculator = None  # swapped out and back in, as a benchmark interleaving modes does
    engine.speculator = spec
    rounds = 0
    for rid in list(prompts):
        decode_time(engine, {rid: prompts.pop(rid)}, truth)
    assert rounds <= 1, rounds
    assert spec.stats.total.num_verify_steps <= 3, spec.stats.as_dict()

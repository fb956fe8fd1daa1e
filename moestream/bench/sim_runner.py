"""A runner that plays a small, host-bound GPU target on the CPU, for the speculation picker's
benchmarks and tests: the real engine (scheduler, speculator, commit, detokenization) drives
it, and it answers from known greedy continuations while spending the device's time in real
time.

On a GPU a tiny model's step is a fraction of a millisecond, most of it the device's, and the
runner's run-ahead (`ModelRunner._decode_ahead`) queues the next plain greedy step before the
host reads this one's tokens. So the host's work between steps is hidden, a queued step that
the next plan does not match is dropped yet still occupies the device, and a verify step runs
without run-ahead. `SimulatedRunner` keeps one device timeline (when the device finishes what
was queued) and makes the host wait for it, so the engine's own host work costs what it costs
on this CPU and the picker's step times come from the same clock: `WallClock`, real time with
busy waits, or `CpuClock`, the thread's CPU time plus the waits, which a loaded machine does
not disturb (`engine_clock` makes the engine and the speculator read it).

Tokens: request id -> its greedy continuation (`truth`); a step samples the continuation at
the request's output length and accepts drafts while they equal it (`StepPlan`'s contract).
Only greedy requests are served.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moestream.runner.cuda_graph import BUCKETS, VERIFY_BUCKETS, VERIFY_TOKENS
from moestream.runner.model_runner import RunnerOutput
from moestream.types import ScheduledRequest, StepPlan


class WallClock:
    """Real time; the host waits for the device in a busy loop, as on a device event. Stands
    in for the `time` module."""

    def perf_counter(self) -> float:
        return time.perf_counter()

    def advance_to(self, deadline: float) -> None:
        while time.perf_counter() < deadline:
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class CpuClock(WallClock):
    """The thread's CPU time plus the time it waited for the simulated device. It stands still
    while the process is descheduled, so on a loaded machine the engine's step times, and what
    the picker decides from them, stay what they would be on an idle one (the engine's host
    work still costs what it costs; waiting costs no CPU)."""

    def __init__(self) -> None:
        self._waited = 0.0

    def perf_counter(self) -> float:
        return time.thread_time() + self._waited

    def advance_to(self, deadline: float) -> None:
        self._waited += max(0.0, deadline - self.perf_counter())


@contextlib.contextmanager
def engine_clock(clock: WallClock) -> Iterator[WallClock]:
    """Let the engine and the speculator time steps and rounds on `clock`."""
    import moestream.engine
    import moestream.spec.speculator

    modules = (moestream.engine, moestream.spec.speculator)
    saved = [m.time for m in modules]
    for m in modules:
        m.time = clock  # type: ignore[assignment]
    try:
        yield clock
    finally:
        for m, t in zip(modules, saved):
            m.time = t


def _bucket(n: int, sizes: Sequence[int]) -> int:
    return next((b for b in sizes if b >= n), n)


@dataclass(frozen=True)
class DeviceTimes:
    """Seconds a simulated device spends per step, by the graph it runs (rows: bucket x tokens
    per sequence; a verify step with k drafts runs K = the smallest `VERIFY_TOKENS` >= k + 1).

    `decode`: a one-row decode graph; `verify`: a two-row verify graph; `per_row`: each row
    beyond those; `prefill`, `prefill_per_token`: an eager prompt chunk. `launch`: host time
    to launch a step; `capture`: host time of a graph's first use (capture and compile), which
    raises `num_captured_graphs` as the real runner's does."""

    decode: float = 190e-6
    verify: float = 280e-6
    per_row: float = 10e-6
    prefill: float = 250e-6
    prefill_per_token: float = 1e-6
    launch: float = 5e-6
    capture: float = 2e-3

    def graph_seconds(self, bucket: int, k: int) -> float:
        if k == 1:
            return self.decode + self.per_row * (bucket - 1)
        return self.verify + self.per_row * (bucket * k - 2)


@dataclass
class _Queued:
    """A plain decode step launched ahead: what it feeds and when the device finishes it."""

    request_ids: list[str]
    positions: list[int]
    done: float


class SimulatedRunner:
    """Stands in for `ModelRunner` (the attributes and `execute` the engine uses) over a
    simulated device timeline; see the module docstring."""

    def __init__(
        self,
        truth: Mapping[str, Sequence[int]],
        block_size: int,
        times: DeviceTimes | None = None,
        clock: WallClock | None = None,
    ) -> None:
        self.truth = truth
        self.block_size = block_size
        self.times = times or DeviceTimes()
        self.clock = clock or WallClock()
        self.logits_processor: Any = None
        self.run_ahead = True
        self.run_ahead_hits = 0
        self.num_captured_graphs = 0
        self.last_step_graph: tuple[int, int] | None = None
        self.num_steps = 0
        self.num_dropped = 0  # steps launched ahead that the next plan did not match
        self.device_seconds = 0.0  # device time of every launched step, dropped ones included
        self.wait_seconds = 0.0  # host time spent waiting for the device...
        self.wait_cpu_seconds = 0.0  # ... and the thread's CPU time in it
        self._graphs: set[tuple[int, int]] = set()
        self._device_free = 0.0  # clock time when the device has run all it was given
        self._ahead: _Queued | None = None

    @property
    def has_queued_step(self) -> bool:
        return self._ahead is not None

    # ---- the device timeline -----------------------------------------------------------
    def _busy(self, seconds: float) -> None:
        """Host work of `seconds` (a launch, a capture): a busy loop either way."""
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def _launch(self, seconds: float) -> float:
        """Queue `seconds` of device work after the launch's host time: when it finishes."""
        self._busy(self.times.launch)
        start = max(self.clock.perf_counter(), self._device_free)
        self._device_free = start + seconds
        self.device_seconds += seconds
        return self._device_free

    def _wait(self, done: float) -> None:
        start, cpu = self.clock.perf_counter(), time.thread_time()
        self.clock.advance_to(done)
        self.wait_seconds += max(0.0, done - start)
        self.wait_cpu_seconds += time.thread_time() - cpu

    def _graph(self, reqs: list[ScheduledRequest]) -> tuple[int, int] | None:
        """(bucket, K) of the graph that would run `reqs`, capturing it on first use."""
        if not all(s.sample and len(s.token_ids) == 1 for s in reqs):
            return None
        most = max(len(s.draft_token_ids) for s in reqs)
        if most == 0:
            graph = (_bucket(len(reqs), BUCKETS), 1)
        else:
            graph = (_bucket(len(reqs), VERIFY_BUCKETS), _bucket(most + 1, VERIFY_TOKENS))
        if graph not in self._graphs:
            self._graphs.add(graph)
            self.num_captured_graphs += 1
            self._busy(self.times.capture)
        return graph

    # ---- steps -------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> RunnerOutput:
        self.last_step_graph = None
        ahead, self._ahead = self._ahead, None  # good for this step only
        if plan.is_empty:
            return RunnerOutput()
        self.num_steps += 1
        reqs = plan.scheduled
        sampled = {s.request_id: self._sample(s) for s in reqs if s.sample}
        graph = self._graph(reqs)
        self.last_step_graph = graph
        aheadable = self.logits_processor is None and all(  # as `ModelRunner._aheadable`
            s.sampling_params.logprobs is None for s in reqs
        )
        if graph is not None and graph[1] == 1 and (self.run_ahead or ahead) and aheadable:
            if (
                ahead is not None
                and ahead.request_ids == [s.request_id for s in reqs]
                and (ahead.positions == [s.start_pos for s in reqs])
            ):
                done = ahead.done
                self.run_ahead_hits += 1
            else:
                self.num_dropped += ahead is not None
                done = self._launch(self.times.graph_seconds(*graph))
            if self.run_ahead and self._may_launch_next(reqs):
                seconds = self.times.graph_seconds(*graph)
                positions = [s.start_pos + 1 for s in reqs]
                self._ahead = _Queued(
                    [s.request_id for s in reqs], positions, self._launch(seconds)
                )
            self._wait(done)
            return RunnerOutput(sampled=sampled)
        self.num_dropped += ahead is not None
        if graph is not None:
            seconds = self.times.graph_seconds(*graph)
        else:
            seconds = self.times.prefill + self.times.prefill_per_token * plan.num_tokens
        self._wait(self._launch(seconds))
        return RunnerOutput(sampled=sampled)

    def _sample(self, s: ScheduledRequest) -> list[int]:
        """Accepted drafts and one token: the continuation from the request's output length."""
        want = self.truth[s.request_id][len(s.output_token_ids) :]
        drafts = s.draft_token_ids
        a = 0
        while a < len(drafts) and a + 1 < len(want) and drafts[a] == want[a]:
            a += 1
        return list(want[: a + 1])

    def _may_launch_next(self, reqs: list[ScheduledRequest]) -> bool:
        """As `ModelRunner._launch_next`: the next step needs no new block and some request
        may still run after this step."""
        bs = self.block_size
        if any(s.start_pos + 1 >= len(s.block_ids) * bs for s in reqs):
            return False
        return not all(len(s.output_token_ids) + 1 >= s.sampling_params.max_tokens for s in reqs)


# ---- workloads ---------------------------------------------------------------------------
KINDS = ("copy", "rewrite", "fresh", "adversarial", "partial")


def workload(
    kind: str, n_req: int = 3, n_out: int = 150, seed: int = 0, vocab: int = 4096
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """(prompts, continuations) by request id. copy: the output keeps repeating the prompt's
    40-token pattern; rewrite: the prompt is a 100-token "function" whose identifiers (30
    tokens, a third of its tokens) recur, and the output is that function with a third of the
    identifiers renamed, again and again (as a model asked to rewrite it with its variables
    renamed: n-gram drafts hold until the next renamed identifier); fresh: nothing to copy;
    adversarial: the pattern with every third token replaced (every n-gram draft is
    rejected); partial: every fourth. Token ids from 3 up (clear of special tokens)."""
    if kind not in KINDS:
        raise ValueError(f"unknown workload {kind!r} (known: {', '.join(KINDS)})")
    rng = random.Random(seed)
    prompts, truth = {}, {}
    for i in range(n_req):
        rid = f"r{i}"
        pattern = rng.sample(range(3, vocab), 40)
        if kind == "copy":
            prompts[rid] = pattern * 2
            truth[rid] = [pattern[j % 40] for j in range(n_out)]
        elif kind == "rewrite":
            names = pattern[:30]
            body = [rng.choice(names) if rng.random() < 1 / 3 else rng.randrange(3, vocab)
                    for _ in range(100)]  # fmt: skip
            renamed = {t: rng.randrange(3, vocab) for t in names[::3]}
            prompts[rid] = body
            truth[rid] = [renamed.get(body[j % 100], body[j % 100]) for j in range(n_out)]
        elif kind == "fresh":
            prompts[rid] = pattern
            truth[rid] = [rng.randrange(3, vocab) for _ in range(n_out)]
        else:
            period = 3 if kind == "adversarial" else 4
            prompts[rid] = pattern * 2
            truth[rid] = [
                pattern[j % 40] if j % period else rng.randrange(3, vocab) for j in range(n_out)
            ]
    return prompts, truth


def run_workload(
    engine: Any,
    prompts: Mapping[str, Sequence[int]],
    n_out: int,
    concurrent: bool = False,
    on_step: Callable[[], None] | None = None,
    temperature: float = 0.0,
) -> tuple[dict[str, list[int]], float]:
    """`n_out` tokens per prompt through `engine` (its runner a `SimulatedRunner`): one
    request at a time, or all at once. (outputs by id, seconds from each request's first
    token to its last, summed, on the runner's clock). The runner answers with the
    continuations whatever the parameters; `temperature` > 0 makes the engine and the
    speculator treat the requests as sampled (no shadow drafts, verification by rejection)."""
    from moestream.types import SamplingParams

    clock = engine.runner.clock

    params = SamplingParams(temperature=temperature, max_tokens=n_out, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    batches = [list(prompts)] if concurrent else [[rid] for rid in prompts]
    seconds = 0.0
    for batch in batches:
        for rid in batch:
            engine.add_request(list(prompts[rid]), params, rid)
            outputs[rid] = []
        start = None
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.request_id] += out.new_token_ids
            if start is None and any(outputs[rid] for rid in batch):
                start = clock.perf_counter()
            if on_step is not None:
                on_step()
        seconds += clock.perf_counter() - (start or clock.perf_counter())
    return outputs, seconds

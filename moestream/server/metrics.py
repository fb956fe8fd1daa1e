"""Prometheus metrics of one server, in its own registry (no process-global state).

Counted as requests flow (event loop): HTTP requests by route and status, finished generations
by finish reason, prompt and generated tokens, time to first token, inter-token latency and
end-to-end latency. Read from the engine's latest snapshot at scrape time: running and waiting
requests (the server's admission queue included), KV blocks used and total, prefix-cache query
and hit tokens, preemptions and engine steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from moestream.engine import EngineOutput

if TYPE_CHECKING:
    from moestream.server.async_engine import AsyncEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip


class _EngineCollector:
    def __init__(
        self, engine: AsyncEngine, expert_store: Any = None, zero_copy: Any = (), paged: Any = ()
    ) -> None:
        self._engine = engine
        self._expert_store = expert_store
        self._zero_copy = list(zero_copy or ())
        self._paged = list(paged or ())

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats
        if stats is None:
            return
        s = stats.scheduler

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"moestream_{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"moestream_{name}", doc, value=value)

        yield gauge("num_requests_running", "Requests scheduled in the engine", s.num_running)
        yield gauge(
            "num_requests_waiting",
            "Requests queued: waiting in the engine or for a server slot",
            s.num_waiting + self._engine.num_queued,
        )
        yield gauge("kv_blocks_used", "KV cache blocks held by requests", s.num_used_blocks)
        yield gauge("kv_blocks_total", "KV cache blocks in the pool", stats.num_blocks)
        yield gauge(
            "kv_cache_usage_ratio",
            "Fraction of KV blocks held by requests",
            s.num_used_blocks / max(stats.num_blocks, 1),
        )
        yield gauge(
            "prefix_cache_blocks", "Full blocks kept in the prefix cache", s.num_cached_blocks
        )
        yield counter(
            "prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
            s.prefix_query_tokens,
        )  # fmt: skip
        yield counter(
            "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
            s.prefix_hit_tokens,
        )  # fmt: skip
        yield counter("num_preemptions", "Requests preempted by the scheduler", s.num_preemptions)
        yield counter("engine_steps", "Engine steps run", stats.steps)
        spec_stats = getattr(self._engine.engine, "spec_stats", None)
        spec = spec_stats() if spec_stats is not None else None
        if spec is not None:  # speculative decoding, per proposer
            yield from _spec_families(spec)
        if self._expert_store is not None:  # expert tiers: hits, misses, bytes, stalls
            from moestream.experts import metric_families

            for name, doc, kind, value in metric_families(self._expert_store.counters.snapshot()):
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                yield family(name, doc, value=value)
        if self._zero_copy:  # zero-copy placement: reads per tier, bytes over the host link
            from moestream.experts.zero_copy import zero_copy_metric_families, zero_copy_snapshot

            snap = zero_copy_snapshot(self._zero_copy)
            for name, doc, kind, value in zero_copy_metric_families(snap):
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                yield family(name, doc, value=value)
        if self._paged:  # paged placement: reads by where served, pages moved
            from moestream.experts.paged import paged_metric_families, paged_snapshot

            for name, doc, kind, value in paged_metric_families(paged_snapshot(self._paged)):
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                yield family(name, doc, value=value)


def _spec_families(spec: dict[str, Any]) -> Iterator[Metric]:
    """Speculation counters labelled by proposer, and tau (tokens per verify step)."""
    names = {
        "verify_steps": "Verify steps (a request's drafts checked in a target pass)",
        "draft_tokens": "Draft tokens proposed and verified",
        "accepted_tokens": "Draft tokens accepted",
    }
    for key, doc in names.items():
        family = CounterMetricFamily(f"moestream_spec_{key}", doc, labels=["proposer"])
        for proposer, arm in spec["by_proposer"].items():
            family.add_metric([proposer], arm[key])
        yield family
    tau = GaugeMetricFamily(
        "moestream_spec_tau", "Mean tokens emitted per verify step (accepted + 1)",
        labels=["proposer"],
    )  # fmt: skip
    for proposer, arm in spec["by_proposer"].items():
        if arm["tau"] is not None:
            tau.add_metric([proposer], arm["tau"])
    yield tau
    yield CounterMetricFamily(
        "moestream_spec_plain_steps", "Request-steps that ran plain decode instead",
        value=spec["plain_steps"],
    )  # fmt: skip


class ServerMetrics:
    """The server's metrics; also the AsyncEngine's request observer."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, cpu seconds, fds
        self.http_requests = Counter(
            "moestream_http_requests", "HTTP requests by route and status", ["route", "status"],
            registry=r,
        )  # fmt: skip
        self.finished = Counter(
            "moestream_request_success", "Finished generations by finish reason",
            ["finish_reason"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "moestream_prompt_tokens", "Prompt tokens of started generations", registry=r
        )
        self.generation_tokens = Counter(
            "moestream_generation_tokens", "Generated tokens", registry=r
        )
        self.ttft = Histogram(
            "moestream_time_to_first_token_seconds", "Time from arrival to the first token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "moestream_inter_token_latency_seconds", "Time between tokens of a request",
            buckets=_ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "moestream_e2e_request_latency_seconds", "Time from arrival to the last output",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip

    def watch(
        self, engine: AsyncEngine, expert_store: Any = None, zero_copy: Any = (), paged: Any = ()
    ) -> None:
        """Export the engine's snapshot gauges and counters (and the expert store's, or the
        zero-copy placement's per-layer providers)."""
        self.registry.register(_EngineCollector(engine, expert_store, zero_copy, paged))

    # ---- observer hooks (called by AsyncEngine on the event loop) ---------------------------
    def on_output(
        self, out: EngineOutput, arrival: float, prev_time: float | None, now: float
    ) -> None:
        n = len(out.new_token_ids)
        self.generation_tokens.inc(n)
        if prev_time is None:
            self.prompt_tokens.inc(out.num_prompt_tokens)
            self.ttft.observe(now - arrival)
            n -= 1
            prev_time = now
        for _ in range(n):
            self.itl.observe((now - prev_time) / n)

    def on_end(self, last: EngineOutput | None, arrival: float, now: float) -> None:
        reason = "abort" if last is None or not last.finished else last.finish_reason or "stop"
        self.finished.labels(finish_reason=reason).inc()
        if last is not None:
            self.e2e.observe(now - arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""Expert-tier counters, always on: hits and misses per tier, bytes moved per tier, prefetch
accuracy and the time the compute thread stalled waiting for experts.

Units: an *access* is one expert of one layer needed by one forward (a decode step of batch 1
makes `top_k` accesses per layer). Device hits and misses count accesses at the time the layer
asks for them; a device miss is then looked up in the host tier (host hit or miss; a host miss is
a disk read). Prefetch loads count in the host and disk figures as well, not in the device ones.
Pure Python, safe to bump from the I/O threads.

Phases: every count also goes to the phase of the forward that caused it, "prefill" (a forward
that feeds a prompt chunk) or "decode" (one token per request, drafts included), which the
model runner sets before each forward (`enter_step`). A load started by a forward and finished
on an I/O thread counts in the phase of the forward that started it (`in_phase`); a prefetch
counts as useful in the phase of the forward that used it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from moestream.types import StepPlan

R = TypeVar("R")
PHASES = ("prefill", "decode")

_FIELDS = {
    "tokens": "tokens whose routing the store saw (layer 0)",
    "device_hits": "expert accesses served from device slots",
    "device_misses": "expert accesses not in device slots when asked for",
    "host_hits": "expert loads served from the host tier",
    "host_misses": "expert loads the host tier did not hold (read from disk)",
    "disk_reads": "experts read from the GGUF file",
    "bytes_from_disk": "bytes read from the GGUF file",
    "bytes_to_host": "bytes written into the host tier",
    "bytes_to_device": "bytes copied into device slots",
    "queued_loads": "demand loads from the host tier queued on the compute stream (no wait)",
    "evictions_device": "experts evicted from device slots",
    "evictions_host": "experts evicted from the host tier",
    "prefetch_issued": "experts loaded into device slots ahead of use",
    "prefetch_useful": "prefetched experts used before eviction",
    "prefetch_late": "accesses that waited for a prefetch still in flight",
    "prefetch_held": "predictions not prefetched: too few of such loads were being used",
    "predicted": "predicted experts (next-layer router on the current hidden state)",
    "predicted_correct": "actually routed experts that had been predicted",
    "routed": "routed experts of layers whose routing had been predicted",
    "promotions": "experts promoted to resident device slots",
    "demotions": "experts demoted from resident to cached",
    "read_errors": "expert reads that failed",
    "stalls": "times the compute thread waited for an expert",
    "stall_s": "seconds the compute thread waited for experts",
}


class ExpertCounters:
    """Monotonic counters of one expert store, per phase (thread-safe)."""

    FIELDS = tuple(_FIELDS)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = {p: dict.fromkeys(_FIELDS, 0) for p in PHASES}
        self._local = threading.local()  # an I/O thread's job: the phase that started it
        self.phase = "decode"  # of the forward running now (`enter_step` sets it)

    def enter_step(self, plan: StepPlan) -> None:
        """A step's forward is about to run: count in its phase (`phase_of`)."""
        self.phase = phase_of(plan)

    def in_phase(self, fn: Callable[..., R]) -> Callable[..., R]:
        """`fn` to run on another thread, counting in the phase current now."""
        phase = self.phase

        def run(*args: Any, **kwargs: Any) -> R:
            self._local.phase = phase
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.phase = None

        return run

    def add(self, **deltas: float) -> None:
        phase = getattr(self._local, "phase", None) or self.phase
        with self._lock:
            values = self._values[phase]
            for name, delta in deltas.items():
                values[name] += delta  # KeyError on a typo: our bug

    def __getitem__(self, name: str) -> float:
        with self._lock:
            return sum(v[name] for v in self._values.values())

    def reset(self) -> None:
        with self._lock:
            self._values = {p: dict.fromkeys(_FIELDS, 0) for p in PHASES}

    def snapshot(self) -> dict[str, Any]:
        """Every counter over both phases, plus derived rates (None where undefined):
        device_hit_rate, host_hit_rate, prefetch_accuracy (useful / issued), prediction_recall
        (predicted_correct / routed), prediction_precision (predicted_correct / predicted),
        stall_ms_per_token; and under "phases" the same for each phase alone."""
        with self._lock:
            phases = {p: dict(v) for p, v in self._values.items()}
        total = {name: sum(v[name] for v in phases.values()) for name in _FIELDS}
        out = _derived(total)
        out["phases"] = {p: _derived(v) for p, v in phases.items()}
        return out


def phase_of(plan: StepPlan) -> str:
    """The phase of a step: "prefill" when it feeds some request a prompt chunk (or a
    recompute chunk after preemption), else "decode" (each request its last token, with or
    without drafts)."""
    prefill = any(
        len(s.token_ids) > 1 or s.start_pos < len(s.prompt_token_ids) for s in plan.scheduled
    )
    return "prefill" if prefill else "decode"


def _derived(values: dict[str, float]) -> dict[str, Any]:
    """The counters and their rates (`ExpertCounters.snapshot`)."""
    v: dict[str, Any] = dict(values)

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    v["device_hit_rate"] = ratio(v["device_hits"], v["device_hits"] + v["device_misses"])
    v["host_hit_rate"] = ratio(v["host_hits"], v["host_hits"] + v["host_misses"])
    v["prefetch_accuracy"] = ratio(v["prefetch_useful"], v["prefetch_issued"])
    v["prediction_recall"] = ratio(v["predicted_correct"], v["routed"])
    v["prediction_precision"] = ratio(v["predicted_correct"], v["predicted"])
    v["stall_ms_per_token"] = ratio(v["stall_s"] * 1e3, v["tokens"])
    return v


def metric_families(snapshot: dict[str, Any]) -> Iterator[tuple[str, str, str, float]]:
    """(name, help, type, value) for Prometheus: every counter as `moestream_expert_<name>`
    of type "counter" (exposed with the `_total` suffix prometheus_client adds), each defined
    rate as a "gauge". The server wraps them in prometheus_client metric families."""
    for name, doc in _FIELDS.items():
        yield f"moestream_expert_{name}", doc, "counter", float(snapshot[name])
    for name in (
        "device_hit_rate",
        "host_hit_rate",
        "prefetch_accuracy",
        "prediction_recall",
        "stall_ms_per_token",
    ):
        if snapshot.get(name) is not None:
            yield f"moestream_expert_{name}", name.replace("_", " "), "gauge", snapshot[name]

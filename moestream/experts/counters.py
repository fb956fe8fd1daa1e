"""Expert-tier counters, always on: hits and misses per tier, bytes moved per tier, prefetch
accuracy and the time the compute thread stalled waiting for experts.

Units: an *access* is one expert of one layer needed by one forward (a decode step of batch 1
makes `top_k` accesses per layer). Device hits and misses count accesses at the time the layer
asks for them; a device miss is then looked up in the host tier (host hit or miss; a host miss is
a disk read). Prefetch loads count in the host and disk figures as well, not in the device ones.
Pure Python, safe to bump from the I/O threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

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
    "evictions_device": "experts evicted from device slots",
    "evictions_host": "experts evicted from the host tier",
    "prefetch_issued": "experts loaded into device slots ahead of use",
    "prefetch_useful": "prefetched experts used before eviction",
    "prefetch_late": "accesses that waited for a prefetch still in flight",
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
    """Monotonic counters of one expert store (thread-safe)."""

    FIELDS = tuple(_FIELDS)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(_FIELDS, 0)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta  # KeyError on a typo: our bug

    def __getitem__(self, name: str) -> float:
        with self._lock:
            return self._values[name]

    def reset(self) -> None:
        with self._lock:
            self._values = dict.fromkeys(_FIELDS, 0)

    def snapshot(self) -> dict[str, Any]:
        """Every counter, plus derived rates (None where undefined): device_hit_rate,
        host_hit_rate, prefetch_accuracy (useful / issued), prediction_recall
        (predicted_correct / routed), prediction_precision (predicted_correct / predicted),
        stall_ms_per_token."""
        with self._lock:
            v = dict(self._values)

        def ratio(a: float, b: float) -> float | None:
            return a / b if b else None

        v["device_hit_rate"] = ratio(v["device_hits"], v["device_hits"] + v["device_misses"])
        v["host_hit_rate"] = ratio(v["host_hits"], v["host_hits"] + v["host_misses"])
        v["prefetch_accuracy"] = ratio(v["prefetch_useful"], v["prefetch_issued"])
        v["prediction_recall"] = ratio(v["predicted_correct"], v["routed"])
        v["prediction_precision"] = ratio(v["predicted_correct"], v["predicted"])
        ms = ratio(v["stall_s"] * 1e3, v["tokens"])
        v["stall_ms_per_token"] = ms
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

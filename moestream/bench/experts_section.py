"""The `experts` section of `moestream bench`: the expert store's counters over the whole run
(hits and misses per tier, bytes moved per tier, prefetch accuracy, stall time), present only
when experts are streamed (`--gpu-expert-cache-gib`); with `--expert-zero-copy`, the reads
per tier, the bytes that crossed the host link and the promotions (swaps); with
`--expert-paging`, the reads by where they were served, the experts paged in and the next-layer
prediction's precision and prefetches. It runs after the timed sections, so its figures
describe exactly the traffic those measurements paid for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # runner.py lists this section among its own
    from moestream.bench.runner import BenchContext, Metric

_RATES = (
    "device_hit_rate",
    "host_hit_rate",
    "prefetch_accuracy",
    "prediction_recall",
    "prediction_precision",
    "device_read_share",
    "slot_hit_rate",
)


class ExpertsSection:
    name = "experts"

    def run(self, ctx: BenchContext) -> dict[str, Any] | None:
        store = getattr(ctx.llm, "expert_store", None)
        zero_copy = getattr(ctx.llm, "zero_copy", None)
        paged = getattr(ctx.llm, "paged", None)
        if paged or zero_copy:  # reads by where they were served instead of a store's traffic
            from moestream.experts.paged import paged_snapshot
            from moestream.experts.zero_copy import zero_copy_snapshot

            providers = paged or zero_copy
            counters = paged_snapshot(paged) if paged else zero_copy_snapshot(zero_copy)
            budgets = {k: sum(p.nbytes[k] for p in providers) for k in ("device", "host")}
            return {"counters": counters, "budgets": budgets}
        if store is None:
            return None
        return {
            "counters": store.counters.snapshot(),
            "budgets": _budgets(ctx.llm),
            "direct_io": store.reader.direct_active,  # O_DIRECT reads (else the page cache's)
        }

    def metrics(self, data: dict[str, Any]) -> list[Metric]:
        from moestream.bench.runner import Metric

        c = data["counters"]
        out = [
            Metric(f"experts {r}", "ratio", True, [c[r]]) for r in _RATES if c.get(r) is not None
        ]
        if c.get("stall_ms_per_token") is not None:
            out.append(Metric("experts stall ms/token", "ms", False, [c["stall_ms_per_token"]]))
        return out

    def table(self, data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
        counters = data["counters"]
        phases = counters.get("phases", {})  # a store's, not zero-copy's
        rows = []
        for key, value in counters.items():
            if key == "phases":
                continue
            row = [key.replace("_", " "), _cell(value)]
            rows.append(row + [_cell(phases[p].get(key)) for p in phases])
        return ["expert store counter", "all", *phases], rows


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4f}" if value < 10 else f"{value:,.1f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _budgets(llm: Any) -> dict[str, Any]:
    """Bytes the store holds per tier (never above the budgets it was given)."""
    return {k: int(v) for k, v in llm.expert_store.allocated_bytes().items()}

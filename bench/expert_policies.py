"""Expert-cache policies compared on the trained tiny MoE's real routing.

1. Records every layer's top-k routing over held-out Python (teacher-forced, in windows of
   `--window-tokens`; `moestream/data/heldout-python.txt`), and the pre-gating prediction of each
   layer (the next layer's router applied to this layer's FFN input).
2. Replays each layer's routing, token by token as decode sees it, through each policy at each
   cache size with the store's own slot directory (`moestream.experts.policy.simulate`), and
   prints the device hit rate (mean over layers), with Belady's offline optimum as the ceiling;
   the device pager of paged placement also with its prefetch of the prediction.
3. With `--store-tokens N`, decodes N tokens through a real `ExpertStore` per policy (smallest
   cache, nothing in host RAM) and prints its counters: hit rate, prediction recall, prefetch
   accuracy, stall per token and bytes read from disk per token, over the whole run and over
   its decode steps alone (the prompt's prefill reads most experts of every layer at once).

    python bench/expert_policies.py [--slots 2,3,4,5,6] [--store-tokens 48] [--device cuda]
                                    [--json out.json]
"""

from __future__ import annotations

import argparse
import bisect
import json
import time
from pathlib import Path
from typing import Any

import torch

import moestream
from moestream.experts import ExpertBudgets, ExpertLayout, attach_expert_store, build_expert_store
from moestream.experts.policy import ExpertPolicy, simulate
from moestream.layers.moe import route
from moestream.llm import LLM
from moestream.types import SamplingParams

DATA = Path(moestream.__file__).parent / "data"


class Recorder:
    """Wraps a MoE layer: keeps its routing [T, k] and the next layer's predicted routing."""

    def __init__(self, moe: Any, next_router: Any):
        self.moe, self.next_router = moe, next_router
        self.ids: list[torch.Tensor] = []
        self.predicted: list[torch.Tensor] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        self.ids.append(route(x, moe.router, moe.top_k, moe.norm_topk_prob)[1])  # [T, k]
        if self.next_router is not None:
            nxt = route(x, self.next_router, moe.top_k, moe.norm_topk_prob)[1]  # [T, k]
            self.predicted.append(nxt)
        return moe(x)


def record_routing(llm: LLM, ids: list[int], window: int) -> tuple[list, list]:
    """(routing[layer][token] = experts, predicted[layer][token] = experts for layer >= 1)."""
    model = llm.model
    moes = model.moe_layers()
    recorders = [
        Recorder(m, moes[i + 1].router if i + 1 < len(moes) else None) for i, m in enumerate(moes)
    ]
    for layer, rec in zip(model.layers, recorders):
        layer.ffn = rec
    try:
        for start in range(0, len(ids), window):
            chunk = ids[start : start + window]
            if len(chunk) > 1:
                llm.logits(chunk)
    finally:
        for layer, moe in zip(model.layers, moes):
            layer.ffn = moe
    routing = [torch.cat(r.ids).tolist() for r in recorders]
    predicted = [None] + [torch.cat(r.predicted).tolist() for r in recorders[:-1]]
    return routing, predicted


class BeladyPolicy(ExpertPolicy):
    """Offline optimum: evicts the expert whose next use is farthest away (needs the trace)."""

    def __init__(self, num_experts: int, trace: list[list[int]]):
        super().__init__(num_experts)
        self.uses: list[list[int]] = [[] for _ in range(num_experts)]
        for t, experts in enumerate(trace):
            for e in set(experts):
                self.uses[e].append(t)

    def score(self, e: int) -> tuple[float, ...]:
        uses = self.uses[e]
        i = bisect.bisect_right(uses, self.clock)  # next use after the current token
        return (-(uses[i] if i < len(uses) else float("inf")),)


POLICIES: dict[str, dict[str, Any]] = {
    "lru": {"policy": "lru"},
    "lfu": {"policy": "lfu"},
    "window-64": {"policy": "window", "window": 64},
    "window-256": {"policy": "window", "window": 256},
    "lru+resident": {"policy": "lru", "resident_fraction": 0.5},
    "window-256+resident": {"policy": "window", "window": 256, "resident_fraction": 0.5},
}


def pager_hit_rate(
    trace: list[list[int]], n_experts: int, slots: int, predicted: list[list[int]] | None = None
) -> float:
    """The hit rate of paged placement's device pager (`experts.paged.page_ref`: the same
    decisions as the GPU's kernel) on one layer's trace, a token per forward, slots starting
    with experts 0..slots-1 as `PagedExperts` does; with `predicted` (the layer's experts as
    the layer before predicted them, a token per forward), each forward after its prediction's
    prefetch (`PagedExperts.predict`)."""
    from moestream.experts.paged import GATE_PRIOR, HEAT_HALF_LIFE, STATS, page_ref

    heat = torch.zeros(n_experts)
    slot_of = torch.full((n_experts,), -1, dtype=torch.int32)
    slot_of[:slots] = torch.arange(slots, dtype=torch.int32)
    owner = torch.arange(slots, dtype=torch.int32)
    stats = torch.zeros(len(STATS), dtype=torch.int64)
    mark, gate = torch.zeros(n_experts, dtype=torch.int8), torch.tensor(GATE_PRIOR)
    decay = 0.5 ** (1.0 / HEAT_HALF_LIFE)
    for t, experts in enumerate(trace):
        args = (heat, slot_of, owner, stats, decay, True, mark, gate)
        if predicted is not None:
            page_ref(torch.tensor([predicted[t]]), *args, predict=True)
        page_ref(torch.tensor([experts]), *args)
    return int(stats[0]) / int(stats[:3].sum())


def replay(
    routing: list[list[list[int]]], n_experts: int, slots: list[int], predicted: list
) -> dict[str, dict]:
    """{policy: {slots: mean hit rate over layers}}, the device pager (with and without the
    prediction, over layers 1.. which have one) and Belady included."""
    table: dict[str, dict[int, float]] = {}
    pager = ("device pager (paged)", "device pager, layers 1..", "device pager + prediction")
    for name, opts in [*POLICIES.items(), *((p, {}) for p in pager), ("belady (optimum)", {})]:
        row = {}
        for s in slots:
            rates = []
            for layer, trace in enumerate(routing):
                if name.startswith("device pager"):
                    if layer == 0 and name != pager[0]:
                        continue
                    pred = predicted[layer] if name == pager[2] else None
                    rates.append(pager_hit_rate(trace, n_experts, s, pred))
                    continue
                if name.startswith("belady"):
                    r = simulate(trace, n_experts, s, lambda n, tr=trace: BeladyPolicy(n, tr))
                else:
                    opts_ = dict(opts)
                    resident = int(opts_.pop("resident_fraction", 0) * s)
                    resident = min(resident, s - len(trace[0]))
                    r = simulate(trace, n_experts, s, n_resident=max(resident, 0), **opts_)
                rates.append(r["hits"] / (r["hits"] + r["misses"]))
            row[s] = sum(rates) / len(rates)
        table[name] = row
    return table


def prediction_recall(routing: list, predicted: list) -> list[float]:
    """Per layer >= 1: share of routed experts that the pre-gating prediction named."""
    out = []
    for actual, pred in zip(routing[1:], predicted[1:]):
        hit = sum(len(set(a) & set(p)) for a, p in zip(actual, pred))
        out.append(hit / sum(len(set(a)) for a in actual))
    return out


def store_runs(llm: LLM, prompt: list[int], tokens: int) -> list[dict[str, Any]]:
    """Decode through a real ExpertStore at the smallest cache, per policy, with and without
    prediction: the store's counters."""
    c = llm.config
    layout = ExpertLayout.from_gguf(llm.source.gguf, c.n_experts, c.n_experts_used)
    per_slot = sum(layout.expert_bytes(i) for i in range(layout.n_layers))
    rows = []
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for slots in (c.n_experts_used, c.n_experts_used + 2):
        budgets = ExpertBudgets(slots * per_slot / 2**30)
        for name in ("lru", "lfu", "window-256"):
            for predict in (True, False):
                opts = {k: v for k, v in POLICIES[name].items()}
                store = build_expert_store(llm.source, c, budgets, llm.device, **opts)
                attach_expert_store(llm.model, store, predict=predict)
                llm.engine.runner.before_forward[:] = [store.counters.enter_step]  # phases
                start = time.perf_counter()
                llm.generate([prompt], params)
                elapsed = time.perf_counter() - start
                s = store.counters.snapshot()
                d = s["phases"]["decode"]
                rows.append({
                    "slots": slots, "policy": name, "predict": predict,
                    "tokens": s["tokens"], "device_hit_rate": s["device_hit_rate"],
                    "prediction_recall": s["prediction_recall"],
                    "prefetch_accuracy": s["prefetch_accuracy"],
                    "stall_ms_per_token": s["stall_ms_per_token"],
                    "disk_kib_per_token": s["bytes_from_disk"] / s["tokens"] / 1024,
                    "tok_s": tokens / elapsed,
                    "decode_device_hit_rate": d["device_hit_rate"],
                    "decode_prefetch_accuracy": d["prefetch_accuracy"],
                    "decode_stall_ms_per_token": d["stall_ms_per_token"],
                    "decode_disk_kib_per_token": d["bytes_from_disk"] / max(d["tokens"], 1) / 1024,
                })  # fmt: skip
                store.close()
    return rows


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DATA / "tiny-qwen3-moe-Q4_K_M.gguf"))
    ap.add_argument("--text", default=str(DATA / "heldout-python.txt"))
    ap.add_argument("--window-tokens", type=int, default=1024)
    ap.add_argument("--slots", default="2,3,4,5,6,7", help="cache sizes (experts per layer)")
    ap.add_argument("--store-tokens", type=int, default=48, help="0 skips the store runs")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the store's device tier)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)

    llm = LLM(args.model, device=args.device, enable_prefix_caching=False)
    c = llm.config
    ids = llm.tokenizer.encode(Path(args.text).read_text(encoding="utf-8"))
    start = time.perf_counter()
    routing, predicted = record_routing(llm, ids, args.window_tokens)
    print(
        f"{c.name}: {c.n_layers} layers, {c.n_experts} experts, top-{c.n_experts_used}; "
        f"routing of {len(ids)} held-out tokens recorded in {time.perf_counter() - start:.1f} s\n"
    )
    slots = [int(s) for s in args.slots.split(",")]
    table = replay(routing, c.n_experts, slots, predicted)
    print("Device hit rate, mean over layers, by cache size (experts per layer of "
          f"{c.n_experts}; decode order, one token per forward):\n")  # fmt: skip
    print("| policy | " + " | ".join(f"{s} slots" for s in slots) + " |")
    print("|---|" + "---|" * len(slots))
    for name, row in table.items():
        print(f"| {name} | " + " | ".join(_pct(row[s]) for s in slots) + " |")
    recall = prediction_recall(routing, predicted)
    print(
        "\nPre-gating (layer i+1's router on layer i's FFN input) names "
        f"{_pct(sum(recall) / len(recall))} of the routed experts "
        f"(per layer 1..{c.n_layers - 1}: {', '.join(_pct(r) for r in recall)}; "
        f"chance: {_pct(c.n_experts_used / c.n_experts)})."
    )
    result: dict[str, Any] = {
        "model": args.model, "tokens": len(ids), "hit_rates": table,
        "prediction_recall": recall,
    }  # fmt: skip
    if args.store_tokens:
        prompt = ids[:64]
        rows = store_runs(llm, prompt, args.store_tokens)
        print(f"\nExpertStore, {len(prompt)}-token prompt + {args.store_tokens} decoded tokens, "
              f"host tier 0 (every miss read from the file), device {llm.device}:\n")  # fmt: skip
        print("| slots | policy | predict | hit rate | pred. recall | prefetch acc. | "
              "stall ms/tok | disk KiB/tok | tok/s | decode: hit rate | prefetch acc. | "
              "stall ms/tok | disk KiB/tok |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            stall = r["stall_ms_per_token"] or 0.0
            print(
                f"| {r['slots']} | {r['policy']} | {'yes' if r['predict'] else 'no'} | "
                f"{_pct(r['device_hit_rate'])} | {_pct(r['prediction_recall'])} | "
                f"{_pct(r['prefetch_accuracy'])} | {stall:.2f} | "
                f"{r['disk_kib_per_token']:.0f} | {r['tok_s']:.1f} | "
                f"{_pct(r['decode_device_hit_rate'])} | {_pct(r['decode_prefetch_accuracy'])} | "
                f"{r['decode_stall_ms_per_token'] or 0.0:.2f} | "
                f"{r['decode_disk_kib_per_token']:.0f} |"
            )
        result["store_runs"] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

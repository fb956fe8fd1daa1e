"""Expert store: placement from budgets, budgets as hard limits (also under concurrent
prefetch), counters, the slot table for fused kernels, and `info --budgets` data."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from moestream.cli import DEMO_MODEL
from moestream.config import CacheConfig, SchedConfig
from moestream.engine import Engine
from moestream.errors import CapacityError, RequestError
from moestream.experts import (
    ExpertBudgets,
    ExpertLayout,
    build_expert_store,
    describe_placement,
    format_placement,
    load_streamed_model,
    metric_families,
    plan_placement,
    traffic_per_token,
)
from moestream.models.registry import build_model
from moestream.types import SamplingParams

DEMO = DEMO_MODEL
GIB = 2**30


@pytest.fixture(scope="module")
def layout(source) -> ExpertLayout:
    c = source.config
    return ExpertLayout.from_gguf(source.gguf, c.n_experts, c.n_experts_used)


def per_slot(layout: ExpertLayout) -> int:
    """Bytes of one slot in every layer (layers 2 and 5 have bigger Q6_K down experts)."""
    return sum(layout.expert_bytes(i) for i in range(layout.n_layers))


def test_placement_splits_the_budget_in_whole_experts(layout: ExpertLayout) -> None:
    eb = [layout.expert_bytes(i) for i in range(layout.n_layers)]
    assert len(set(eb)) == 2  # uneven layers: the split must handle them
    for device in range(per_slot(layout) * 2, per_slot(layout) * 9, 97_531):
        for host in (0, 1_000_000, per_slot(layout) * 3 + 5):
            budgets = ExpertBudgets(device / GIB, host / GIB)
            p = plan_placement(layout, budgets, staging_experts=2)
            assert p.device_bytes <= budgets.device_bytes
            assert p.host_bytes <= budgets.host_bytes
            assert all(2 <= s <= 8 for s in p.device_slots)
            # no layer could take one more expert with what is left
            left = budgets.device_bytes - p.device_bytes
            assert all(s == 8 or b > left for s, b in zip(p.device_slots, eb))
            assert all(h == 0 for s, h in zip(p.device_slots, p.host_slots) if s == 8)
    p = plan_placement(layout, ExpertBudgets())  # no budget: everything resident
    assert p.fully_resident and p.device_bytes == layout.total_bytes


def test_budget_errors(layout: ExpertLayout) -> None:
    smallest = 2 * per_slot(layout)
    plan_placement(layout, ExpertBudgets(smallest / GIB))  # exactly top_k per layer: runs
    with pytest.raises(CapacityError, match=r"smallest that can run is 0\.0026 GiB"):
        plan_placement(layout, ExpertBudgets((smallest - 1) / GIB))
    with pytest.raises(RequestError, match="--gpu-expert-cache-gib"):
        ExpertBudgets(gpu_expert_cache_gib=0)
    with pytest.raises(RequestError, match="--host-expert-cache-gib"):
        ExpertBudgets(1.0, host_expert_cache_gib=-1)


def test_traffic_per_token_and_info_text(layout: ExpertLayout) -> None:
    budgets = ExpertBudgets(4 * per_slot(layout) / GIB, 2 * per_slot(layout) / GIB)
    summary = describe_placement(DEMO, budgets, device_hit_rate=0.75, host_hit_rate=0.5)
    t = summary["per_token"]
    assert t["expert_bytes_read"] == 2 * per_slot(layout)
    assert t["bytes_to_device"] == pytest.approx(0.25 * 2 * per_slot(layout))
    assert t["bytes_from_disk"] == pytest.approx(0.5 * t["bytes_to_device"])
    uniform = traffic_per_token(plan_placement(layout, budgets))
    assert uniform["bytes_to_device"] == pytest.approx(0.5 * 2 * per_slot(layout))  # 4 of 8
    text = format_placement(summary)
    assert "device slots     4 of 8 per layer" in text and "device hit rate 0.75" in text
    assert summary["graph_batch"] == 2  # 4 slots over top-2 routing: 2 requests a graph
    assert "chains of CUDA graphs at up to 2 requests a step" in text
    everything = describe_placement(DEMO, ExpertBudgets(8 * per_slot(layout) / GIB))
    assert everything["graph_batch"] is None
    assert "whole CUDA graphs" in format_placement(everything)


def test_allocated_buffers_stay_within_budgets(source, layout: ExpertLayout) -> None:
    budgets = ExpertBudgets(3.5 * per_slot(layout) / GIB, 2.2 * per_slot(layout) / GIB)
    with build_expert_store(source, source.config, budgets, warm=False) as store:
        alloc = store.allocated_bytes()
        assert alloc["device"] <= budgets.device_bytes and alloc["host"] <= budgets.host_bytes
        real = sum(b.numel() for t in store.device_tiers for b in t.buffers.buffers)
        assert real == alloc["device"] == store.placement.device_bytes


def generate(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[i] for i in ids]


def engine_for(model, tokenizer) -> Engine:
    return Engine(model, tokenizer, CacheConfig(enable_prefix_caching=False), SchedConfig())


def test_concurrent_prefetch_changes_nothing_and_keeps_budgets(source, layout) -> None:
    """Three threads prefetch random experts of random layers and check the store's invariants
    while the engine generates: same tokens as resident, no slot over budget at any time."""
    tok = source.tokenizer()
    prompts = [tok.encode(s) for s in ("def add(a, b):\n", "class Stack:\n", "x = [i * i for")]
    want = generate(engine_for(build_model(source), tok), prompts)
    budgets = ExpertBudgets(3 * per_slot(layout) / GIB, 2 * per_slot(layout) / GIB)
    model, store = load_streamed_model(DEMO, budgets, io_threads=2)
    before = store.allocated_bytes()
    stop = threading.Event()
    errors: list[BaseException] = []

    def hammer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                layer = rng.randrange(layout.n_layers)
                store.prefetch(layer, rng.sample(range(8), rng.randint(1, 4)))
                store.check()
                for tier in store.device_tiers:
                    assert len(tier.dir) <= tier.n_slots
                time.sleep(0.001)  # leave the engine thread some of the GIL
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    try:
        got = generate(engine_for(model, tok), prompts)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    assert got == want
    assert store.allocated_bytes() == before
    assert store.counters["prefetch_issued"] > 0
    store.check()
    store.close()


def test_counters_add_up(source, layout) -> None:
    budgets = ExpertBudgets(2 * per_slot(layout) / GIB)  # host tier 0: every miss from disk
    model, store = load_streamed_model(DEMO, budgets)
    tok = source.tokenizer()
    prompt = tok.encode("def main():\n    parser = argparse.ArgumentParser(")
    engine = engine_for(model, tok)
    engine.runner.before_forward.append(store.counters.enter_step)  # as `LLM` does
    generate(engine, [prompt])
    s = store.counters.snapshot()
    assert s["tokens"] == len(prompt) + 9  # the prefill, then one token per decode step
    prefill, decode = s["phases"]["prefill"], s["phases"]["decode"]
    assert prefill["tokens"] == len(prompt) and decode["tokens"] == 9
    for name in ("device_hits", "device_misses", "disk_reads", "prefetch_issued", "stall_s"):
        assert prefill[name] + decode[name] == pytest.approx(s[name])
    assert decode["device_hits"] + decode["device_misses"] == 9 * 6 * 2  # 6 layers, top-2
    assert s["disk_reads"] == s["host_misses"] and s["host_hits"] == 0
    assert s["bytes_from_disk"] == s["bytes_to_device"] > 0  # CPU: read straight into slots
    loads = s["device_misses"] + s["prefetch_issued"]
    assert s["disk_reads"] <= loads  # a late prefetch is one read, counted twice
    assert s["stalls"] > 0 and s["stall_ms_per_token"] > 0
    # real routing: the predictions' loads are used, never held back
    assert s["prefetch_held"] == 0 and decode["prefetch_issued"] > 0
    # pre-gating on the trained model predicts far better than chance (k / E = 0.25)
    assert s["prediction_recall"] > 0.6
    names = {name for name, *_ in metric_families(s)}
    assert {"moestream_expert_device_hits", "moestream_expert_stall_s"} <= names
    assert "moestream_expert_prefetch_accuracy" in names
    store.close()


def test_counts_go_to_the_phase_that_caused_them() -> None:
    """A step that feeds a prompt chunk counts as prefill, one of last tokens (with or
    without drafts) as decode; a job wrapped by `in_phase` on another thread counts in the
    phase current when it was wrapped, whatever the phase is when it runs."""
    from moestream.experts.counters import ExpertCounters, phase_of
    from moestream.types import ScheduledRequest, StepPlan

    def plan(*reqs: tuple[list[int], int, list[int]]) -> StepPlan:
        return StepPlan([ScheduledRequest(f"r{i}", fed, start, [0], True, drafts,
                                          prompt_token_ids=[1, 2, 3, 4])
                         for i, (fed, start, drafts) in enumerate(reqs)])  # fmt: skip

    assert phase_of(plan(([9], 5, []), ([9], 6, [7, 7]))) == "decode"
    assert phase_of(plan(([9], 5, []), ([3, 4], 2, []))) == "prefill"  # a chunk beside a decode
    assert phase_of(plan(([4], 3, []))) == "prefill"  # the prompt's last token (rest cached)
    assert phase_of(plan(([4, 9, 9], 3, []))) == "prefill"  # recomputed after preemption
    counters = ExpertCounters()
    counters.enter_step(plan(([1, 2], 0, [])))
    job = counters.in_phase(lambda: counters.add(prefetch_issued=1))
    counters.add(device_hits=2)
    counters.enter_step(plan(([9], 5, [])))
    worker = threading.Thread(target=job)
    worker.start()
    worker.join()
    counters.add(prefetch_useful=1, device_hits=1)
    s = counters.snapshot()
    prefill, decode = s["phases"]["prefill"], s["phases"]["decode"]
    assert (prefill["prefetch_issued"], prefill["device_hits"]) == (1, 2)
    assert (decode["prefetch_useful"], decode["device_hits"]) == (1, 1)
    assert decode["prefetch_issued"] == 0
    assert s["prefetch_accuracy"] == 1.0 and decode["prefetch_accuracy"] is None
    assert counters["device_hits"] == 3


def test_acquire_pins_experts_and_fills_the_slot_table(source, layout) -> None:
    budgets = ExpertBudgets(3 * per_slot(layout) / GIB)
    with build_expert_store(source, source.config, budgets) as store:
        experts = store.layers[4]
        table = experts.acquire([6, 1, 6])
        slots = table.tolist()
        assert slots[1] >= 0 and slots[6] >= 0 and slots[1] != slots[6]
        assert sum(s >= 0 for s in slots) <= 3
        gate, up, down = experts.stacked()
        assert gate.shape == (3, 256, 512) and down.shape == (3, 512, 256)
        for e in (1, 6):
            for stacked, name in zip(
                (gate, up, down), ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), strict=True
            ):
                want = source.tensors[f"blk.4.{name}.weight"].data[e]
                assert torch.equal(stacked.data[slots[e]], want)
        # pinned: prefetching two other experts cannot evict them (one slot is free to take)
        store.prefetch(4, [2, 3])
        store.drain()
        assert experts.tier.dir.is_mapped(1) and experts.tier.dir.is_mapped(6)
        experts.release()
        with pytest.raises(ValueError, match="do not fit"):
            experts.acquire([0, 1, 2, 3])
        store.check()


def holds(raw: tuple[torch.Tensor, ...], source, layer: int, e: int) -> bool:
    """Slot bytes `raw` (per kind) are expert `e` of `layer` in the file."""
    names = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    want = [source.tensors[f"blk.{layer}.{n}.weight"].data[e] for n in names]
    return all(torch.equal(r.view(-1), w.reshape(-1).view(torch.uint8)) for r, w in zip(raw, want))


class _NoPool:
    def submit(self, *args, **kwargs):
        raise AssertionError("a load went to the demand pool")


def test_host_tier_misses_are_queued_not_waited_for(source, layout) -> None:
    """Misses the host tier holds are copied on the caller's stream by the caller (no pool,
    no stall); `meanwhile` runs once, after they started; misses from the disk still go to the
    pool and are waited for."""
    budgets = ExpertBudgets(3 * per_slot(layout) / GIB, 8 * per_slot(layout) / GIB)
    with build_expert_store(source, source.config, budgets) as store:
        pool, store._demand_pool = store._demand_pool, _NoPool()
        calls: list[int] = []
        try:  # slots hold experts 0-2: 1 is a hit, 5 and 6 are misses
            store.load(3, [1, 5, 6], pin=True, meanwhile=lambda: calls.append(len(calls)))
        finally:
            store._demand_pool = pool
        assert calls == [0]
        tier = store.device_tiers[3]
        for e in (5, 6):
            slot = tier.dir.slot_of[e]
            assert tier.dir.pins[e] == 1 and tier.slot_mirror[e] == slot
            assert holds(tier.buffers.raw(slot), source, 3, e)
        s = store.counters.snapshot()
        assert (s["device_hits"], s["device_misses"], s["queued_loads"]) == (1, 2, 2)
        assert s["host_hits"] == 2 and s["stalls"] == 0 and s["disk_reads"] == 0
        assert s["bytes_to_device"] == 2 * layout.expert_bytes(3)
        for e in (1, 5, 6):
            tier.dir.unpin(e)
        store.check()
    disk_only = ExpertBudgets(budgets.gpu_expert_cache_gib)
    with build_expert_store(source, source.config, disk_only) as store:
        store.load(3, [5, 6], meanwhile=lambda: calls.append(len(calls)))
        assert calls == [0, 1]
        s = store.counters.snapshot()
        assert (s["device_misses"], s["queued_loads"], s["disk_reads"], s["stalls"]) == (2, 0, 2, 1)


def test_a_host_slot_is_not_overwritten_before_its_queued_copy_ran(source, layout) -> None:
    """A host slot that a queued copy reads (`copied_from`) is reused only after the copy's
    event: the read of another expert into it waits for the event first."""
    budgets = ExpertBudgets(2 * per_slot(layout) / GIB, 3 * per_slot(layout) / GIB)
    with build_expert_store(source, source.config, budgets) as store:
        host = store.host_tiers[2]
        assert host is not None and len(host.dir) == 3  # experts 0-2: the tier is full
        held = list(host.dir.expert_in)
        with host.cond:
            slot = host.claim_slot(7, store.counters)
        assert slot is not None and held[slot] in (0, 1, 2)
        waited: list[bool] = []

        class Event:  # a copy from the slot's old expert, queued before the eviction
            def synchronize(self) -> None:
                waited.append(holds(host.buffers.raw(slot), source, 2, held[slot]))

        host.copied_from(slot, Event())
        host.read(2, 7, slot, store.reader, store.counters, pin=False)
        assert waited == [True] and holds(host.buffers.raw(slot), source, 2, 7)
        store.check()


def test_predictions_are_not_prefetched_while_such_loads_go_unused(source, layout, monkeypatch):
    """A prediction's prefetch is held while few of the experts that predictions name outside
    the slots are then routed, still measured, and resumes once they are."""
    import moestream.experts.store as store_module

    monkeypatch.setattr(store_module, "PREFETCH_WINDOW", 16)
    budgets = ExpertBudgets(3 * per_slot(layout) / GIB, 8 * per_slot(layout) / GIB)
    pairs = [[0, 1], [2, 3], [4, 5], [6, 7]]
    with build_expert_store(source, source.config, budgets) as store:
        experts = store.layers[1]

        def forwards(n: int, right: bool) -> tuple[float, float]:
            """n forwards of layer 1 routed to pairs in turn, each predicted right or not."""
            before = store.counters["prefetch_issued"], store.counters["prefetch_held"]
            for i in range(n):
                routed = pairs[i % 4]
                store.predict(1, routed if right else pairs[(i + 1) % 4])
                store.drain()
                experts.begin([routed], load=routed, pin=True)
                experts.end()
            return (store.counters["prefetch_issued"] - before[0],
                    store.counters["prefetch_held"] - before[1])  # fmt: skip

        issued, held = forwards(16, right=False)
        assert issued > 0 and held >= 12  # open for the first quarter window, then held
        assert forwards(4, right=False) == (0, 4)
        issued, held = forwards(24, right=True)  # measured while held: it reopens
        assert held > 0 and issued > 0
        issued, held = forwards(8, right=True)
        assert held == 0 and issued >= 8
        store.check()

"""The streamed layer's device path, checked on the CPU: with `fused_moe_path` forced on and
`ops.moe_forward` replaced by a stand-in for the fused kernel, a streamed model at every budget
(one fused call over pinned slots, token-group passes, per-expert fallback) and a fully resident
store give the plain CPU model's tokens, logprobs and logits bit for bit; pins never leak;
a fully resident store leaves every layer capturable."""

from __future__ import annotations

import random

import pytest
import torch

from moestream.cli import DEMO_MODEL
from moestream.experts import (
    ExpertBudgets,
    ExpertFileReader,
    ExpertLayout,
    ExpertReadError,
    ExpertStore,
    LayerExperts,
    StreamedMoE,
    attach_expert_store,
    build_expert_store,
    plan_placement,
)
from moestream.experts.prefetch import split_tokens
from moestream.kernels import ops
from moestream.layers import moe as moe_layer
from moestream.layers.mlp import gated_mlp
from moestream.layers.moe import SparseMoE
from moestream.llm import LLM
from moestream.types import SamplingParams

GIB = 2**30
PROMPTS = ["def fibonacci(n):\n", "import json\n\nclass Config:\n", "for i in range(10):\n"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


def rowwise_moe_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate,
    up,
    down,
    expert_slot: torch.Tensor,
) -> torch.Tensor:
    """Stand-in for the fused kernel on the CPU: the contract of `ops.moe_forward_ref` (every
    routed expert must have a valid slot), each row independent of the others as the kernel's
    are for a fixed T, and the CPU per-expert path's arithmetic (`gated_mlp` works row by row
    there; experts summed in ascending id order), so it matches the plain CPU model bit for
    bit."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)
    weight_of = topk_weights.reshape(-1)[order].float()  # [T*k]
    counts = torch.bincount(flat, minlength=expert_slot.shape[0]).tolist()
    slots = expert_slot.tolist()
    out = torch.zeros((t, x.shape[1]), dtype=torch.float32)  # [T, H]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        s = slots[e]
        if not 0 <= s < gate.shape[0]:
            raise ValueError(f"expert {e} is routed to but has slot {s}")
        tokens = order[start : start + n] // k  # [n]
        y = gated_mlp(x[tokens], gate[s], up[s], down[s])  # [n, H]
        out.index_add_(0, tokens, y.float() * weight_of[start : start + n, None])
        start += n
    return out.to(x.dtype)


def test_stand_in_keeps_the_reference_contract() -> None:
    from moestream.weights.qtensor import QTensor

    g = torch.Generator().manual_seed(0)
    e, s, h, f, t, k = 6, 4, 32, 16, 5, 2
    gate, up = (QTensor.from_float(torch.randn(s, f, h, generator=g)) for _ in range(2))
    down = QTensor.from_float(torch.randn(s, h, f, generator=g))
    x = torch.randn(t, h, generator=g)
    ids = torch.tensor([[0, 3], [3, 5], [5, 0], [1, 3], [0, 1]])
    weights = torch.rand(t, k, generator=g)
    slot = torch.tensor([2, 0, -1, 3, -1, 1], dtype=torch.int32)
    want = ops.moe_forward_ref(x, ids, weights, gate, up, down, slot)
    got = rowwise_moe_forward(x, ids, weights, gate, up, down, slot)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # other rounding, same math
    # rows do not depend on each other
    one = rowwise_moe_forward(x[2:3], ids[2:3], weights[2:3], gate, up, down, slot)
    assert torch.equal(one[0], rowwise_moe_forward(x, ids, weights, gate, up, down, slot)[2])
    with pytest.raises(ValueError, match="expert 2"):
        rowwise_moe_forward(x, ids.clamp(max=2), weights, gate, up, down, slot)
    assert e == slot.shape[0]


def test_split_tokens_groups_fit_and_cover() -> None:
    rng = random.Random(0)
    for n_slots in (2, 3, 5, 8):
        tokens = [rng.sample(range(12), 2) for _ in range(40)]
        groups = split_tokens(tokens, n_slots)
        assert groups is not None
        seen = sorted(t for members, _ in groups for t in members)
        assert seen == list(range(40))
        for members, experts in groups:
            assert experts == sorted({e for t in members for e in tokens[t]})
            assert len(experts) <= n_slots
    assert split_tokens([[0, 1], [1, 0], [2, 3], [0, 2], [1, 0]], 2) == [
        ([0, 1, 4], [0, 1]),
        ([2], [2, 3]),
        ([3], [0, 2]),
    ]
    assert split_tokens([[0, 1], [2, 3], [0, 2]], 2, max_uses=5) is None
    with pytest.raises(ValueError, match="token 1 uses 3 experts"):
        split_tokens([[0, 1], [1, 2, 3]], 2)


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    llm = LLM(DEMO_MODEL, device="cpu", enable_prefix_caching=False)
    return run(llm)  # the plain CPU model: per-expert path over the file's stacks


def run(llm: LLM) -> tuple[list[list[int]], list[list[float]], torch.Tensor]:
    outs = llm.generate(PROMPTS, GREEDY)
    logprobs = [[lp.logprob for lp in o.logprobs] for o in outs]
    return [o.token_ids for o in outs], logprobs, llm.logits(PROMPTS[1])


@pytest.fixture
def device_path(monkeypatch):
    """Force the device path on the CPU; returns the stand-in's call log (operand pointers)."""
    calls: list[int] = []

    def kernel(x, ids, weights, gate, up, down, slot, xa=None, counters=None):
        calls.append(gate.data.data_ptr())
        return rowwise_moe_forward(x, ids, weights, gate, up, down, slot)

    monkeypatch.setattr(moe_layer, "fused_moe_path", lambda x: True)
    monkeypatch.setattr(moe_layer, "moe_rows_independent", lambda x, *w: True)
    monkeypatch.setattr(ops, "moe_forward", kernel)
    return calls


def budgets_for(llm: LLM, device_slots: int, host_slots: int) -> ExpertBudgets:
    c = llm.config
    layout = ExpertLayout.from_gguf(llm.source.gguf, c.n_experts, c.n_experts_used)
    per_slot = layout.slot_bytes
    return ExpertBudgets(device_slots * per_slot / GIB, host_slots * per_slot / GIB)


def paths(llm: LLM) -> dict[str, int]:
    total = {"fused": 0, "passes": 0, "per_expert": 0}
    for layer in llm.model.layers:
        if isinstance(layer.ffn, StreamedMoE):
            for k, v in layer.ffn.paths.items():
                total[k] += v
    return total


def test_resident_model_on_the_device_path(reference, device_path) -> None:
    llm = LLM(DEMO_MODEL, device="cpu", enable_prefix_caching=False)
    got = run(llm)
    assert got[0] == reference[0] and got[1] == reference[1] and torch.equal(got[2], reference[2])
    stacks = {layer.ffn.experts.gate_exps.data.data_ptr() for layer in llm.model.layers}
    assert device_path and set(device_path) == stacks  # one call per layer, the file's stacks


# (device slots, host slots, rows independent (the kernel runs), the path that must show up)
CASES = {
    "2-slots-passes": (2, 0, True, "passes"),
    "3-slots-host-2": (3, 2, True, "passes"),
    "5-slots-fused": (5, 0, True, "fused"),
    "2-slots-reference-kernel": (2, 0, False, "per_expert"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_device_path_matches_resident(reference, device_path, monkeypatch, case) -> None:
    device_slots, host_slots, independent, path = CASES[case]
    if not independent:
        monkeypatch.setattr(moe_layer, "moe_rows_independent", lambda x, *w: False)
    llm = LLM(DEMO_MODEL, device="cpu", enable_prefix_caching=False)
    budgets = budgets_for(llm, device_slots, host_slots)
    with build_expert_store(llm.source, llm.config, budgets, "cpu") as store:
        attach_expert_store(llm.model, store)
        got = run(llm)
        assert got[0] == reference[0]
        assert got[1] == reference[1]  # floats, bit for bit
        assert torch.equal(got[2], reference[2])
        taken = paths(llm)
        assert taken[path] > 0
        if independent:
            assert taken["per_expert"] == 0
            assert set(device_path) <= {t.buffers.buffers[0].data_ptr() for t in store.device_tiers}
        else:
            assert taken["passes"] == 0
        store.check()
        assert all(not t.dir.pins for t in store.device_tiers)  # every pin released
        alloc = store.allocated_bytes()
        assert alloc["device"] <= budgets.device_bytes and alloc["host"] <= budgets.host_bytes
        snap = store.counters.snapshot()
        assert snap["device_misses"] > 0 and snap["stall_s"] > 0
        assert snap["bytes_to_device"] > 0 and snap["device_hits"] > 0


def test_fully_resident_store_keeps_every_layer_capturable(reference, device_path, monkeypatch):
    llm = LLM(DEMO_MODEL, device="cpu", enable_prefix_caching=False)
    assert all(layer.ffn.capturable for layer in llm.model.layers)
    budgets = budgets_for(llm, 8, 0)  # every expert fits
    with build_expert_store(llm.source, llm.config, budgets, "cpu") as store:
        attach_expert_store(llm.model, store)
        for layer in llm.model.layers:
            assert isinstance(layer.ffn, SparseMoE)  # not wrapped: no routing read on the host
            assert isinstance(layer.ffn.experts, LayerExperts)
            assert layer.ffn.capturable
            assert not layer.ffn.experts.table_dirty  # the table is on the device already

        def no_per_expert(self, e):
            raise AssertionError("a resident layer on the device path reads experts one by one")

        monkeypatch.setattr(LayerExperts, "weights", no_per_expert)
        got = run(llm)
        assert got[0] == reference[0] and got[1] == reference[1]
        assert torch.equal(got[2], reference[2])
        assert set(device_path) == {t.buffers.buffers[0].data_ptr() for t in store.device_tiers}
    streamed = budgets_for(llm, 4, 0)
    with build_expert_store(llm.source, llm.config, streamed, "cpu") as store:
        attach_expert_store(llm.model, store)
        assert not any(layer.ffn.capturable for layer in llm.model.layers)


class FailingReader(ExpertFileReader):
    def read_expert(self, layer, e, out):
        if e == 5:
            raise ExpertReadError(f"expert {e} is unreadable (test)")
        return super().read_expert(layer, e, out)


def test_pinned_load_pins_all_or_none(source) -> None:
    c = source.config
    layout = ExpertLayout.from_gguf(source.gguf, c.n_experts, c.n_experts_used)
    per_slot = layout.slot_bytes
    placement = plan_placement(layout, ExpertBudgets(3 * per_slot / GIB))
    with ExpertStore(layout, placement, reader=FailingReader(layout)) as store:
        store.warm()
        tier, experts = store.device_tiers[1], store.layers[1]
        experts.acquire([0, 6])  # 0 was warmed (a hit), 6 is loaded into 1's or 2's slot
        assert tier.dir.pins == {0: 1, 6: 1}
        experts.release()
        experts.acquire([0])
        hit = 1 if tier.dir.is_ready(1) else 2
        with pytest.raises(ExpertReadError, match="expert 5"):
            store.load(1, [hit, 5], pin=True)  # pins the hit, then the read of 5 fails
        assert tier.dir.pins == {0: 1}  # the failed call left nothing pinned
        experts.release()
        assert not tier.dir.pins
        store.check()


class StepCutter:
    """A chain of graphs as the CPU can run one (runner/piecewise.py): the forward computes as it
    is 'captured', so each cut's `before` runs at once and its `after` at the next cut or at
    the step's end, the order a replay runs them in. On only in decode steps (the chains' only
    steps)."""

    def __init__(self) -> None:
        self.on = False
        self.cuts = 0
        self.after: list = []

    def cut(self, before, after) -> None:
        self.finish()
        before()
        self.after.append(after)
        self.cuts += 1

    def finish(self) -> None:
        while self.after:
            self.after.pop()()


def test_streamed_layers_cut_for_graphs_match_resident(reference, device_path, monkeypatch):
    """Decode steps through the captured path of every streamed layer (the routing read from
    the host buffer the piece copied it into, the experts loaded and pinned, the slot table
    refreshed, the fused call, the pins released after) give the plain model's bits."""
    from moestream.runner import piecewise

    llm = LLM(DEMO_MODEL, device="cpu", enable_prefix_caching=False)
    cutter = StepCutter()
    monkeypatch.setattr(piecewise, "active", lambda: cutter if cutter.on else None)

    def graph_tokens(self):
        return self.provider.n_slots // self.moe.top_k

    monkeypatch.setattr(StreamedMoE, "graph_tokens", property(graph_tokens))

    def decode_only(plan) -> None:
        cutter.finish()  # the previous step's last `after`
        reqs = plan.scheduled
        cutter.on = len(reqs) <= 3 and all(len(s.token_ids) == 1 for s in reqs)

    llm.engine.runner.before_forward.append(decode_only)
    budgets = budgets_for(llm, 7, 0)  # of 8 experts: 3 tokens' routing always fits
    with build_expert_store(llm.source, llm.config, budgets, "cpu") as store:
        attach_expert_store(llm.model, store)
        streamed = [layer.ffn for layer in llm.model.layers]
        assert all(isinstance(f, StreamedMoE) and f.graph_tokens == 3 for f in streamed)
        outs = llm.generate(PROMPTS, GREEDY)
        cutter.finish()
        cutter.on = False  # `logits` runs the model outside the runner: a prefill
        assert [o.token_ids for o in outs] == reference[0]
        assert [[lp.logprob for lp in o.logprobs] for o in outs] == reference[1]  # bit for bit
        assert torch.equal(llm.logits(PROMPTS[1]), reference[2])
        # the three prompts decode together: 5 steps after the prefill, a cut per layer each
        assert cutter.cuts == len(streamed) * (GREEDY.max_tokens - 1)
        store.check()
        assert all(not t.dir.pins for t in store.device_tiers)  # every pin released
        snap = store.counters.snapshot()
        assert snap["predicted"] > 0 and snap["predicted_correct"] > 0
        assert paths(llm)["fused"] > 0
        prompts = sum(len(llm.tokenizer.encode(p)) for p in [*PROMPTS, PROMPTS[1]])  # logits'
        assert snap["tokens"] == prompts + 3 * (GREEDY.max_tokens - 1)  # each counted once


def test_a_layer_past_its_graph_limit_is_refused(source, device_path, monkeypatch) -> None:
    """A captured forward whose tokens could route to more experts than the layer's slots is
    an error, never a silent wrong table."""
    from moestream.runner import piecewise

    llm = LLM(DEMO_MODEL, device="cpu", enable_prefix_caching=False)
    with build_expert_store(llm.source, llm.config, budgets_for(llm, 4, 0), "cpu") as store:
        attach_expert_store(llm.model, store)
        ffn = llm.model.layers[0].ffn
        assert ffn.graph_tokens == 0  # the CPU: no chains of graphs
        cutter = StepCutter()
        monkeypatch.setattr(piecewise, "active", lambda: cutter)
        monkeypatch.setattr(StreamedMoE, "graph_tokens", property(lambda self: 2))
        x = torch.randn(3, llm.config.hidden_size)
        with pytest.raises(RuntimeError, match="3 tokens exceed layer 0's graph limit"):
            ffn(x)
        assert cutter.cuts == 0


def test_a_failed_read_between_pieces_fails_the_layer_and_frees_it(device_path, monkeypatch):
    """An unreadable expert found by a cut layer's host hook raises ExpertReadError out of the
    replay (the step fails, as eagerly) and leaves nothing pinned or pending in the layer."""
    from moestream.runner import piecewise

    llm = LLM(DEMO_MODEL, device="cpu", enable_prefix_caching=False)
    c = llm.config
    layout = ExpertLayout.from_gguf(llm.source.gguf, c.n_experts, c.n_experts_used)
    per_slot = layout.slot_bytes
    placement = plan_placement(layout, ExpertBudgets(3 * per_slot / GIB))
    with ExpertStore(layout, placement, reader=FailingReader(layout)) as store:
        attach_expert_store(llm.model, store)
        ffn = llm.model.layers[0].ffn
        cutter = StepCutter()
        monkeypatch.setattr(piecewise, "active", lambda: cutter)
        monkeypatch.setattr(StreamedMoE, "graph_tokens", property(lambda self: 1))
        routing = (torch.tensor([[0.5, 0.5]]), torch.tensor([[5, 0]]))
        monkeypatch.setattr(moe_layer, "route", lambda *args: routing)
        with pytest.raises(ExpertReadError, match="expert 5"):
            ffn(torch.randn(1, c.hidden_size))
        provider, tier = ffn.provider, store.device_tiers[0]
        assert not tier.dir.pins and not provider.pending_snapshot()
        assert cutter.cuts == 0 and not cutter.after  # the piece after it never ran
        store.check()

"""Expert placement changes speed, never results: the trained tiny MoE (demo GGUF) gives the
same logits, bit for bit, and the same greedy tokens and logprobs at every budget, from the
smallest that can run (top_k experts per layer, nothing in host RAM: every miss read from disk)
to all experts resident, with and without prediction, under every policy."""

from __future__ import annotations

import pytest
import torch

from moestream.cli import DEMO_MODEL
from moestream.experts import (
    ExpertBudgets,
    ExpertLayout,
    attach_expert_store,
    build_expert_store,
)
from moestream.llm import LLM
from moestream.types import SamplingParams

DEMO = DEMO_MODEL
GIB = 2**30
PROMPTS = [
    "def fibonacci(n):\n",
    "import json\n\nclass Config:\n    def __init__(self, path):\n",
    "for i in range(10):\n    print(",
    "    return sorted(items, key=lambda x:",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)

# (device slots per layer, host slots per layer, store options)
CASES = {
    "smallest-disk-only": (2, 0, {}),
    "3-slots-host-3": (3, 3, {}),
    "5-slots-host-all-lru": (5, 8, {"policy": "lru"}),
    "4-slots-lfu-no-prediction": (4, 0, {"policy": "lfu", "predict": False}),
    "2-slots-direct-io": (2, 2, {"direct": True, "io_threads": 1}),
    "all-resident": (8, 0, {}),
}


def budgets_for(layout: ExpertLayout, device_slots: int, host_slots: int) -> ExpertBudgets:
    per_slot = sum(layout.expert_bytes(i) for i in range(layout.n_layers))
    return ExpertBudgets(device_slots * per_slot / GIB, host_slots * per_slot / GIB)


def run(llm: LLM) -> tuple[list[list[int]], list[list[float]], torch.Tensor]:
    outs = llm.generate(PROMPTS, GREEDY)
    tokens = [o.token_ids for o in outs]
    logprobs = [[lp.logprob for lp in o.logprobs] for o in outs]
    return tokens, logprobs, llm.logits(PROMPTS[1])


@pytest.fixture(scope="module")
def llm_and_reference():
    torch.set_num_threads(1)
    llm = LLM(DEMO, device="cpu", enable_prefix_caching=False)
    return llm, run(llm)  # every expert resident, as the model was built


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_is_the_same_at_every_budget(llm_and_reference, case: str) -> None:
    llm, (tokens, logprobs, logits) = llm_and_reference
    device_slots, host_slots, options = CASES[case]
    options = dict(options)
    predict = options.pop("predict", True)
    c = llm.config
    layout = ExpertLayout.from_gguf(llm.source.gguf, c.n_experts, c.n_experts_used)
    budgets = budgets_for(layout, device_slots, host_slots)
    store = build_expert_store(llm.source, c, budgets, "cpu", **options)
    try:
        assert store.placement.device_slots == (device_slots,) * c.n_layers
        attach_expert_store(llm.model, store, predict=predict)
        got_tokens, got_logprobs, got_logits = run(llm)
        assert got_tokens == tokens
        assert got_logprobs == logprobs  # floats, bit for bit
        assert torch.equal(got_logits, logits)
        alloc = store.allocated_bytes()
        assert alloc["device"] <= budgets.device_bytes and alloc["host"] <= budgets.host_bytes
        store.check()
        snap = store.counters.snapshot()
        if device_slots < c.n_experts:
            assert snap["device_misses"] > 0 and snap["bytes_to_device"] > 0
            assert snap["stall_s"] > 0
            if predict:
                assert snap["predicted"] > 0
            else:
                assert snap["predicted"] == 0 and snap["routed"] == 0
        else:
            assert snap["device_misses"] == 0 and snap["bytes_from_disk"] == 0
            assert snap["device_hit_rate"] == 1.0
    finally:
        store.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_streamed_experts_on_cuda_match_resident() -> None:
    """On a GPU: bf16 activations, the fused kernel everywhere. Streamed layers whose routed
    experts fit run one kernel over pinned slots; at 2 and 3 slots most do not, and run the
    token-group passes: both must give the resident model's logits bit for bit.
    Run: pytest tests/experts -m gpu -q"""
    from moestream.experts import StreamedMoE

    # Eager on both sides: this compares the expert paths, not graph replay against eager
    # launches (a streamed model's decode graphs, chains cut at its host reads, have their own
    # test: tests/runner/test_piecewise.py).
    llm = LLM(DEMO, device="cuda", enable_prefix_caching=False, enforce_eager=True)
    tokens, logprobs, logits = run(llm)
    c = llm.config
    layout = ExpertLayout.from_gguf(llm.source.gguf, c.n_experts, c.n_experts_used)
    del llm
    for device_slots, host_slots in ((2, 0), (3, 8), (6, 0)):
        budgets = budgets_for(layout, device_slots, host_slots)
        streamed = LLM(
            DEMO,
            device="cuda",
            enable_prefix_caching=False,
            gpu_expert_cache_gib=budgets.gpu_expert_cache_gib,
            host_expert_cache_gib=budgets.host_expert_cache_gib,
            enforce_eager=True,
            expert_paging=False,  # the store (paged would be the default where host RAM holds all)
        )
        store = streamed.expert_store
        assert store.placement.device_slots == (device_slots,) * c.n_layers
        got = run(streamed)
        assert got[0] == tokens, (device_slots, host_slots)
        assert got[1] == logprobs and torch.equal(got[2], logits), (device_slots, host_slots)
        paths = {"fused": 0, "passes": 0, "per_expert": 0}
        for layer in streamed.model.layers:
            assert isinstance(layer.ffn, StreamedMoE)
            for k, v in layer.ffn.paths.items():
                paths[k] += v
        assert paths["per_expert"] == 0 and paths["fused"] + paths["passes"] > 0, paths
        assert store.allocated_bytes()["device"] <= budgets.device_bytes
        assert all(not t.dir.pins for t in store.device_tiers)
        store.check()
        store.close()

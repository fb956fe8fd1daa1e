"""Zero-copy expert placement (`experts.zero_copy`) on the CPU: the same tokens and logprobs as
the resident model at any split between the tiers, counters that add up, budgets enforced."""

from __future__ import annotations

import pytest
import torch

from moestream.cli import DEMO_MODEL
from moestream.errors import CapacityError, RequestError
from moestream.llm import LLM
from moestream.types import SamplingParams

PROMPTS = ["def fibonacci(n):", "The history of the city"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def resident() -> LLM:
    if not DEMO_MODEL.is_file():
        pytest.skip("demo model is not in this checkout")
    torch.set_num_threads(1)
    return LLM(DEMO_MODEL, device="cpu", max_model_len=128)


def zero_copy(gpu_gib: float, host_gib: float = 1.0) -> LLM:
    return LLM(
        DEMO_MODEL, device="cpu", max_model_len=128, gpu_expert_cache_gib=gpu_gib,
        host_expert_cache_gib=host_gib, expert_zero_copy=True,
    )  # fmt: skip


def run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    return [
        (list(o.token_ids), [lp.logprob for lp in o.logprobs])
        for o in llm.generate(PROMPTS, GREEDY)
    ]


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_tokens_and_counters(resident: LLM, fraction: float) -> None:
    probe = zero_copy(1e-9)
    per_layer = probe.zero_copy[0].nbytes["host"]  # all experts of one layer, in bytes
    layers = len(probe.zero_copy)
    llm = zero_copy(fraction * per_layer * layers / 2**30 + 1e-9)
    n_device = {p.n_device for p in llm.zero_copy}
    experts = llm.zero_copy[0].num_experts
    assert n_device == {int(fraction * experts)}
    assert all(moe.capturable for moe in llm.model.moe_layers())  # no host work per forward
    assert run(llm) == run(resident)
    counts = [p.read_counts() for p in llm.zero_copy]
    total = {c["device"] + c["host"] for c in counts}
    assert len(total) == 1 and total.pop() > 0  # every layer saw every routed expert once
    if fraction == 0.0:
        assert all(c["device"] == 0 for c in counts)


def test_budgets_are_enforced() -> None:
    if not DEMO_MODEL.is_file():
        pytest.skip("demo model is not in this checkout")
    with pytest.raises(CapacityError, match="host-expert-cache-gib"):
        zero_copy(1e-9, host_gib=1e-6)
    with pytest.raises(RequestError, match="gpu_expert_cache_gib"):
        LLM(DEMO_MODEL, device="cpu", expert_zero_copy=True)


def test_bench_experts_section_reports_zero_copy_reads() -> None:
    if not DEMO_MODEL.is_file():
        pytest.skip("demo model is not in this checkout")
    from moestream.bench.experts_section import ExpertsSection

    llm = zero_copy(1e-9)
    llm.generate(PROMPTS[:1], GREEDY)

    class Ctx:  # the one field the section reads
        pass

    ctx = Ctx()
    ctx.llm = llm
    data = ExpertsSection().run(ctx)
    c = data["counters"]
    assert c["device_reads"] == 0 and c["host_reads"] > 0 and c["device_read_share"] == 0.0
    # layers' experts differ in size (the mix gives some down projections more bits)
    link = sum(p.read_counts()["host"] * p.expert_bytes for p in llm.zero_copy)
    assert c["host_link_bytes"] == link > 0
    assert data["budgets"]["device"] == 0 and data["budgets"]["host"] > 0
    head, rows = ExpertsSection().table(data)
    assert len(rows) == 4

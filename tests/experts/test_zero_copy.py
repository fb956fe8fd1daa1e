"""Zero-copy expert placement (`experts.zero_copy`) on the CPU: the same tokens and logprobs as
the resident model at any split between the tiers and after promotions, counters that add up,
budgets enforced; promotion moves the trained model's reads to the device."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from moestream.cli import DEMO_MODEL
from moestream.errors import CapacityError, RequestError
from moestream.experts.zero_copy import zero_copy_snapshot
from moestream.llm import LLM
from moestream.types import SamplingParams
from moestream.weights.qtensor import QTensor

PROMPTS = ["def fibonacci(n):", "The history of the city"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def resident() -> LLM:
    if not DEMO_MODEL.is_file():
        pytest.skip("demo model is not in this checkout")
    torch.set_num_threads(1)
    return LLM(DEMO_MODEL, device="cpu", max_model_len=256)


def zero_copy(gpu_gib: float, host_gib: float = 1.0, rebalance: int = 64) -> LLM:
    return LLM(
        DEMO_MODEL, device="cpu", max_model_len=256, gpu_expert_cache_gib=gpu_gib,
        host_expert_cache_gib=host_gib, expert_zero_copy=True, expert_rebalance_steps=rebalance,
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
    with pytest.raises(RequestError, match="expert_rebalance_steps"):
        zero_copy(1e-9, rebalance=-1)


def test_host_computed_experts_are_placed_and_checked(resident: LLM) -> None:
    """`expert_cpu_fraction`: that share of each layer's host-placed experts is marked for the
    host's cores (`experts.host_compute`; on the CPU device every expert takes the reference
    path, so the tokens are the resident model's), and bad values are a RequestError."""
    from moestream import native

    try:
        native.library()
    except native.NativeUnavailable as exc:
        pytest.skip(f"native experts unavailable: {exc}")
    llm = LLM(
        DEMO_MODEL, device="cpu", max_model_len=256, gpu_expert_cache_gib=1e-9,
        host_expert_cache_gib=1.0, expert_zero_copy=True, expert_cpu_fraction=0.5,
        expert_cpu_threads=1,
    )  # fmt: skip
    experts = llm.zero_copy[0].num_experts
    assert {int(p.host_marked.sum()) for p in llm.zero_copy} == {experts // 2}
    assert run(llm) == run(resident)
    # a wait for the host's rows that gave up (the poller's flags) fails the step that read
    # them, once; the next step runs
    compute = llm.zero_copy[0].host_work.compute
    assert compute.check in llm.engine.runner.checks
    assert llm.engine.runner.reader.blocking  # the step's wait leaves the cores to the host's
    compute.set_poll(True)
    compute._flags_np[3] = 1
    with pytest.raises(RuntimeError, match="1 waits for the host's rows timed out"):
        run(llm)
    compute.set_poll(False)
    assert run(llm) == run(resident)
    with pytest.raises(RequestError, match="expert_zero_copy"):
        LLM(DEMO_MODEL, device="cpu", expert_cpu_fraction=0.5)
    with pytest.raises(RequestError, match="expert_cpu_fraction"):
        zero_copy_llm = {"gpu_expert_cache_gib": 1e-9, "expert_zero_copy": True}
        LLM(DEMO_MODEL, device="cpu", expert_cpu_fraction=1.5, **zero_copy_llm)
    with pytest.raises(RequestError, match="expert_cpu_threads"):
        LLM(DEMO_MODEL, device="cpu", expert_cpu_threads=0, **zero_copy_llm)


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
    assert c["swaps"] == c["swap_bytes"] == 0  # no device slot to promote into
    assert c["cpu_reads"] == c["cpu_bytes"] == 0 and c["cpu_compute_seconds"] == 0.0
    assert c["stage_reads"] == c["stage_bytes"] == c["stage_copies"] == 0  # no stage
    assert c["cpu_poll_bad_posts"] == c["cpu_poll_timeouts"] == 0  # no host compute
    head, rows = ExpertsSection().table(data)
    assert len(rows) == 14


def quarter_on_device(rebalance: int) -> LLM:
    """Zero-copy with a quarter of each layer's experts on the device."""
    probe = zero_copy(1e-9)
    per_layer = probe.zero_copy[0].nbytes["host"]
    return zero_copy(0.25 * per_layer * len(probe.zero_copy) / 2**30 + 1e-9, rebalance=rebalance)


def check_placement(p) -> None:
    """Every expert in exactly one slot of one tier, the device tier full, and the address
    table and `weights(e)` pointing at that slot."""
    places = {(p._on_device[e], p._slot[e]) for e in range(p.num_experts)}
    assert len(places) == p.num_experts
    assert sum(p._on_device) == p.n_device
    for e in range(p.num_experts):
        for k in range(3):
            assert p.expert_addr[k, e].item() == p._slot_data(k, e).data_ptr()
            assert p.weights(e)[k].data.data_ptr() == p._slot_data(k, e).data_ptr()


def test_promotion_keeps_the_tokens_and_moves_reads_to_the_device(resident: LLM) -> None:
    """A swap round every 4 steps: the same tokens and logprobs as the resident model while
    experts move, and on the trained model's routing a clearly larger share of expert reads
    served from the device than the placement of load time gives (measured after a first
    batch of prompts: steady state)."""
    text = (DEMO_MODEL.parent / "heldout-python.txt").read_text()
    warm = [text[i : i + 300] for i in (0, 5000)]
    test = [text[i : i + 300] for i in (26000, 31000)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0)
    shares = {}
    for rebalance in (0, 4):
        llm = quarter_on_device(rebalance)
        llm.generate(warm, params)
        before = zero_copy_snapshot(llm.zero_copy)
        if rebalance:
            assert run(llm) == run(resident)  # after swaps
        out = llm.generate(test, params)
        after = zero_copy_snapshot(llm.zero_copy)
        device = after["device_reads"] - before["device_reads"]
        shares[rebalance] = device / (device + after["host_reads"] - before["host_reads"])
        for p in llm.zero_copy:
            check_placement(p)
        if rebalance:
            assert after["swaps"] > 0
            assert after["swap_bytes"] == sum(2 * p.swaps * p.expert_bytes for p in llm.zero_copy)
            assert [o.token_ids for o in out] == [
                o.token_ids for o in resident.generate(test, params)
            ]
    assert shares[4] > shares[0] + 0.15, shares


def test_rebalance_swaps_by_heat_with_hysteresis() -> None:
    """On made-up read counts: the hottest host-placed experts replace the coldest
    device-placed ones, but not for a small difference; an expert's bytes move with it, and
    reads count for the tier the expert was in when read."""
    from moestream.experts import zero_copy as zc
    from moestream.weights.quantize import quantize

    e, f, h = 6, 32, 256
    g = torch.Generator().manual_seed(0)
    stacks = [
        QTensor(
            torch.from_numpy(quantize(torch.randn(shape, generator=g), GGMLQuantizationType.Q8_0)),
            GGMLQuantizationType.Q8_0,
            shape,
        )
        for shape in ((e, f, h), (e, f, h), (e, h, f))
    ]
    p = zc.ZeroCopyExperts(stacks, 2, "cpu")  # experts 0, 1 on the device
    before = [tuple(w.data.clone() for w in p.weights(i)) for i in range(e)]
    p._reads += torch.tensor([10, 1, 0, 2, 40, 11])  # 4 and 5 are hot, 0 is warm
    assert p.read_counts() == {"device": 11, "host": 53, "cpu": 0, "stage": 0}
    assert p.rebalance() == 1  # 4 replaces 1; 5 (11) is not 1.25 x 10 + 1 hotter than 0
    assert sorted(i for i in range(e) if p._on_device[i]) == [0, 4]
    check_placement(p)
    for i in range(e):
        assert all(torch.equal(a, w.data) for a, w in zip(before[i], p.weights(i)))
    p._reads += torch.tensor([0, 0, 0, 0, 5, 0])
    assert p.read_counts() == {"device": 16, "host": 53, "cpu": 0, "stage": 0}  # 4 on the device
    assert p.rebalance() == 0 and p.swaps == 1
    # heat now 5, 0.5, 0, 1, 25, 5.5; 3 gains 14 reads: clearly hotter than 0 (heat 2.5) by the
    # factor, but 15 - 2.5 is within 3 standard deviations of count noise (sqrt(17.5) * 3)
    p._reads += torch.tensor([0, 0, 0, 14, 0, 0])
    assert p.rebalance() == 0


def test_prefill_stage_holds_the_host_tier_and_follows_promotions() -> None:
    """`ExpertStage`: a long forward copies the layer's host tier into the stage and reads it
    through `stage_addr` (device experts where they are, host experts in the stage); a swap
    rewrites both address tables; the stage's reads count apart from the link's."""
    from moestream.experts import zero_copy as zc

    e = 6
    g = torch.Generator().manual_seed(1)
    stacks = [
        QTensor(
            torch.randint(0, 255, (e, 8, 34), generator=g, dtype=torch.uint8),
            GGMLQuantizationType.Q8_0,
            (e, 8, 32),
        )  # fmt: skip
        for _ in range(3)
    ]
    p = zc.ZeroCopyExperts(stacks, 2, "cpu")  # experts 0, 1 on the device
    original = [w.data.clone() for w in stacks]  # (the device tier is a view of them here)
    stage = zc.ExpertStage([w.data.numel() for w in p._host], torch.device("cpu"))
    p.attach_stage(stage)
    short, staged = p.addresses(zc.STAGE_MIN_TOKENS - 1)
    assert short is p.expert_addr and not staged and stage.counts() == (0, 0)
    addr, staged = p.addresses(zc.STAGE_MIN_TOKENS)
    assert staged and stage.counts() == (1, p.nbytes["host"])

    def check_stage() -> None:
        for i in range(e):
            for k in range(3):
                where = int(addr[k, i])
                if p._on_device[i]:
                    assert where == int(p.expert_addr[k, i])
                else:
                    staged = stage.view(k, p._host[k].data)[p._slot[i]]
                    assert where == staged.data_ptr()
                    assert torch.equal(staged, original[k][i])

    check_stage()
    p._reads += torch.tensor([0, 0, 0, 0, 40, 0])
    assert p.rebalance() == 1  # 4 replaces 0 on the device
    addr, _ = p.addresses(zc.STAGE_MIN_TOKENS)  # the stage refilled: 0 now in a host slot
    check_stage()
    p.observe(torch.tensor([[4, 0]]), staged=True)
    assert p.read_counts() == {"device": 1, "host": 40, "cpu": 0, "stage": 1}
    snap = zc.zero_copy_snapshot([p])
    assert snap["stage_reads"] == 1 and snap["stage_copies"] == 2
    assert snap["host_link_bytes"] == 40 * p.expert_bytes + 2 * p.nbytes["host"]


def test_prefill_stage_comes_out_of_the_device_budget(resident: LLM) -> None:
    probe = zero_copy(1e-9)
    per_layer = probe.zero_copy[0].nbytes["host"]  # all experts of one layer, in bytes
    experts, layers = probe.zero_copy[0].num_experts, len(probe.zero_copy)
    budget = per_layer * layers // 2  # half the experts without a stage
    llm = LLM(
        DEMO_MODEL, device="cpu", max_model_len=256, gpu_expert_cache_gib=budget / 2**30,
        host_expert_cache_gib=1.0, expert_zero_copy=True, expert_prefill_stage=True,
    )  # fmt: skip
    # the most device experts a layer with which they and the stage (the largest layer's host
    # stack of each kind: the quant mix gives layers different sizes) fit the budget
    per_expert = probe.zero_copy[0].expert_bytes
    largest = sum(max(p._host[k].data[0].numel() for p in probe.zero_copy) for k in range(3))
    fits = [n for n in range(experts + 1)
            if n * layers * per_expert + (experts - n) * largest <= budget]  # fmt: skip
    assert {p.n_device for p in llm.zero_copy} == {max(fits)} and max(fits) < experts // 2
    assert all(p.stage is llm.zero_copy[0].stage is not None for p in llm.zero_copy)
    assert run(llm) == run(resident)  # the CPU takes the reference path: tokens unchanged
    with pytest.raises(CapacityError, match="prefill stage"):
        LLM(DEMO_MODEL, device="cpu", gpu_expert_cache_gib=per_layer / 2 / 2**30,
            host_expert_cache_gib=1.0, expert_zero_copy=True,
            expert_prefill_stage=True)  # fmt: skip
    with pytest.raises(RequestError, match="expert_prefill_stage"):
        LLM(DEMO_MODEL, device="cpu", expert_prefill_stage=True)


def test_uniform_routing_causes_almost_no_swaps() -> None:
    """Routing spread evenly (as random weights route): the hottest of many read counts beats
    the coldest by chance at every rebalance, and swapping on that would copy experts for
    nothing; the noise margin keeps it to a handful over many windows."""
    from moestream.experts import zero_copy as zc

    e, n_dev = 64, 32
    stacks = [
        QTensor(torch.zeros(e, 8, 34, dtype=torch.uint8), GGMLQuantizationType.Q8_0, (e, 8, 32))
        for _ in range(3)
    ]
    p = zc.ZeroCopyExperts(stacks, n_dev, "cpu")
    g = torch.Generator().manual_seed(0)
    for _ in range(50):  # windows of 64 steps of 8 distinct experts each
        for _ in range(64):
            p._reads[torch.randperm(e, generator=g)[:8]] += 1
        p.rebalance()
    assert p.swaps <= 5, p.swaps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_promotion_on_the_gpu_keeps_the_tokens() -> None:
    """On a GPU: swaps run on the stream between steps (CUDA graphs and run-ahead on) and the
    greedy tokens equal the resident model's, which runs the same kernels on slot stacks."""
    text = (DEMO_MODEL.parent / "heldout-python.txt").read_text()
    prompts = [text[i : i + 300] for i in (0, 5000, 26000)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    resident = LLM(DEMO_MODEL, device="cuda", max_model_len=256, kv_cache_gib=0.5)
    want = [o.token_ids for o in resident.generate(prompts, params)]
    del resident
    probe = LLM(
        DEMO_MODEL, device="cuda", max_model_len=256, kv_cache_gib=0.5,
        gpu_expert_cache_gib=1e-9, host_expert_cache_gib=1.0, expert_zero_copy=True,
    )  # fmt: skip
    per_layer = probe.zero_copy[0].nbytes["host"] * len(probe.zero_copy)
    del probe
    llm = LLM(
        DEMO_MODEL, device="cuda", max_model_len=256, kv_cache_gib=0.5,
        gpu_expert_cache_gib=0.25 * per_layer / 2**30 + 1e-9, host_expert_cache_gib=1.0,
        expert_zero_copy=True, expert_rebalance_steps=4,
    )  # fmt: skip
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert sum(p.swaps for p in llm.zero_copy) > 0
    for p in llm.zero_copy:
        check_placement(p)


def test_the_kernels_templates_are_on_the_device_with_no_expert_there() -> None:
    """The fused kernel takes types, shapes and row strides from `stacked()` and checks that they
    are on the activations' device: with every expert in host memory they must still be (the
    meta device stands in for CUDA here; before, they were a host slot and the CUDA forward
    raised)."""
    from moestream.experts.zero_copy import ZeroCopyExperts
    from moestream.weights.quantize import quantize

    stacks = [
        QTensor(torch.from_numpy(quantize(torch.randn(4, 256, 256) * 0.05, q)), q, (4, 256, 256))
        for q in (GGMLQuantizationType.Q4_K,) * 3
    ]
    for n_device in (0, 2):
        p = ZeroCopyExperts(stacks, n_device, "meta")
        assert all(t.data.device.type == "meta" for t in p.stacked())
        assert [tuple(t.data.shape) for t in p.stacked()] == [(1, 256, 144)] * 3

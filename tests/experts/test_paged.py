"""Paged expert placement (`experts.paged`): the pager kernel's decisions and copies against its
torch reference (the Triton interpreter without CUDA), and on the CPU the same tokens and
logprobs as the resident model at every slot count, tables that stay consistent, counters that
add up, budgets enforced, and the trained model's decode served mostly by the slots."""

from __future__ import annotations

import pytest
import torch

from moestream.cli import DEMO_MODEL
from moestream.errors import CapacityError, RequestError
from moestream.experts.paged import STATS, paged_metric_families, paged_snapshot
from moestream.llm import LLM
from moestream.types import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = ["def fibonacci(n):", "The history of the city"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)


def _state(e: int, s: int, seed: int) -> dict[str, torch.Tensor]:
    """A random consistent placement of e experts in s slots (some empty), random heat."""
    g = torch.Generator().manual_seed(seed)
    owner = torch.randperm(e, generator=g)[:s].to(torch.int32)
    owner[torch.rand(s, generator=g) < 0.2] = -1
    slot_of = torch.full((e,), -1, dtype=torch.int32)
    for i, x in enumerate(owner.tolist()):
        if x >= 0:
            slot_of[x] = i
    heat = torch.randint(0, 4, (e,), generator=g).float()  # ties on purpose
    return {
        "heat": heat, "slot_of": slot_of, "owner": owner, "stats": torch.zeros(8).long(),
        "mark": torch.zeros(e, dtype=torch.int8), "gate": torch.zeros(2),
    }  # fmt: skip


@pytest.mark.parametrize(
    "e, s, tokens, k", [(16, 6, 1, 4), (16, 5, 4, 4), (40, 24, 3, 8), (8, 1, 1, 2)]
)
def test_pager_kernel_matches_its_reference(e: int, s: int, tokens: int, k: int) -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    from moestream.experts.paged import page_ref
    from moestream.kernels.expert_pager import page

    words = (8, 4, 12)  # int32 words of the three weights of one expert
    host = [torch.randint(-(2**31), 2**31 - 1, (e, w), dtype=torch.int32) for w in words]
    slots = [torch.zeros(s, w, dtype=torch.int32, device=DEVICE) for w in words]
    if DEVICE == "cuda":
        host = [h.pin_memory() for h in host]
    host_addr = torch.tensor([[h[i].data_ptr() for i in range(e)] for h in host]).to(DEVICE)
    slot_addr = torch.tensor([[d[i].data_ptr() for i in range(s)] for d in slots]).to(DEVICE)
    ref = _state(e, s, seed=e + s)
    for k_, d in zip(range(3), slots, strict=True):  # slots hold their owners' bytes
        for i, x in enumerate(ref["owner"].tolist()):
            if x >= 0:
                d[i] = host[k_][x].to(DEVICE)
    dev = {name: t.clone().to(DEVICE) for name, t in ref.items()}
    addr = host_addr.clone()
    held = (ref["owner"] >= 0).nonzero().flatten()
    addr[:, ref["owner"][held].long()] = slot_addr[:, held.to(DEVICE)]
    copies = torch.zeros(1 + 2 * s, dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(7)
    schedule = []  # (ids, predict, admit): forwards, most after a prediction of their experts
    for f in range(6):
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
        if f < 5:  # a prediction half right, or (forwards 2 and 3) guessed
            other = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
            guess = other if f in (2, 3) else torch.cat([ids[:, : k // 2 + 1], other], 1)
            schedule.append((guess, True, True))
        schedule.append((ids, False, f != 1))  # forward 1 only counts, as a long one
    for step, (ids, predict, admit) in enumerate(schedule):
        gate_open = float(ref["gate"][1]) >= 0.5 * float(ref["gate"][0])
        moves = page_ref(
            ids, ref["heat"], ref["slot_of"], ref["owner"], ref["stats"], 0.9, admit,
            ref["mark"], ref["gate"], predict,
        )  # fmt: skip
        page(
            ids.to(DEVICE), dev["heat"], dev["slot_of"], dev["owner"], addr, host_addr,
            slot_addr, copies, dev["stats"], dev["mark"], dev["gate"], words, 0.9, admit,
            predict,
        )  # fmt: skip
        for name in ("slot_of", "owner", "stats", "mark"):
            assert torch.equal(dev[name].cpu(), ref[name]), (step, name)
        torch.testing.assert_close(dev["heat"].cpu(), ref["heat"])
        torch.testing.assert_close(dev["gate"].cpu(), ref["gate"])
        if admit:
            n = int(copies[0])
            listed = copies[1 : 1 + 2 * n].view(n, 2).tolist()
            assert [tuple(m) for m in listed] == moves  # hottest first, coldest slot first
        # every named expert found where the table says, with the right bytes
        for x in ids.unique().tolist():
            i = int(ref["slot_of"][x])
            want = slot_addr[:, i] if i >= 0 else host_addr[:, x]
            assert torch.equal(addr[:, x], want)
            if i >= 0:
                assert all(torch.equal(d[i].cpu(), h[x]) for d, h in zip(slots, host)), x
        outside = int((ref["slot_of"][ids.unique()] < 0).sum())
        if admit and ids.unique().numel() <= s and (gate_open or not predict):
            assert outside == 0  # room for all: every named expert got a slot
    stats = dict(zip(STATS, ref["stats"].tolist(), strict=True))
    assert stats["admissions"] > 0 and stats["slot_reads"] > 0  # admissions and hits happened
    assert stats["prefetched"] > 0 and stats["prefetched_used"] <= stats["prefetched"]
    if s >= 2 * k:  # room for a half-right prediction's experts: some were then routed
        assert stats["prefetched_used"] > 0
    assert stats["predicted_used"] <= stats["predicted"]


@pytest.mark.parametrize("tokens, k", [(1, 3), (5, 4)])
def test_gather_copies_the_routed_experts_into_the_stage_in_order(tokens: int, k: int) -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    from moestream.kernels.expert_pager import gather

    e, s, words = 12, 5, (8, 4, 12)
    g = torch.Generator().manual_seed(tokens)
    host = [
        torch.randint(-(2**31), 2**31 - 1, (e, w), dtype=torch.int32, generator=g) for w in words
    ]
    if DEVICE == "cuda":
        host = [h.pin_memory() for h in host]
    slots = [h[3 : 3 + s].clone().to(DEVICE) for h in host]  # experts 3..7 in slots 0..4
    stage = [torch.zeros(e, w, dtype=torch.int32, device=DEVICE) for w in words]
    addr = torch.tensor([[h[i].data_ptr() for i in range(e)] for h in host])
    for kind, d in enumerate(slots):
        addr[kind, 3 : 3 + s] = torch.tensor([d[i].data_ptr() for i in range(s)])
    stage_addr = torch.tensor([[t[i].data_ptr() for i in range(e)] for t in stage])
    stage_slot = torch.full((e,), -7, dtype=torch.int32, device=DEVICE)
    copies = torch.zeros(1 + 2 * e, dtype=torch.int32, device=DEVICE)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    gather(ids.to(DEVICE), addr.to(DEVICE), stage_addr.to(DEVICE), stage_slot, copies, words)
    routed = ids.unique().tolist()  # ascending
    assert int(copies[0]) == len(routed)
    for p, x in enumerate(routed):
        assert int(stage_slot[x]) == p
        assert all(torch.equal(t[p].cpu(), h[x]) for t, h in zip(stage, host, strict=True)), x
    assert all(int(stage_slot[x]) == -7 for x in range(e) if x not in routed)  # not written


def test_prepare_gives_a_stack_and_table_holding_every_routed_expert() -> None:
    """The fused path's contract (`PagedExperts.prepare`, with the interpreter's kernels on the
    CPU): after paging, the slots hold a forward's routed experts when tokens x k <= slots;
    beyond that (or beyond PAGE_MAX_TOKENS tokens, which do not page) the stage does, each at
    the slot its table names, with the expert's own bytes."""
    pytest.importorskip("triton", reason="triton is not installed")
    from gguf import GGMLQuantizationType as Q

    from moestream.experts.paged import PAGE_MAX_TOKENS, PagedExperts
    from moestream.experts.zero_copy import ExpertStage
    from moestream.weights.qtensor import QTensor

    e, f, h = 8, 256, 256  # Q4_K rows of 144 bytes: 36,864 bytes a weight of an expert
    g = torch.Generator().manual_seed(3)
    stacks = [
        QTensor(torch.randint(0, 256, (e, *rows), dtype=torch.uint8, generator=g), Q.Q4_K, shape)
        for rows, shape in (((f, 144), (e, f, h)), ((f, 144), (e, f, h)), ((h, 144), (e, h, f)))
    ]
    stage = ExpertStage([w.data.numel() for w in stacks], torch.device(DEVICE))
    p = PagedExperts(stacks, 3, DEVICE, stage)
    for tokens, via in ((1, "slots"), (1, "slots"), (2, "stage"), (PAGE_MAX_TOKENS + 1, "stage")):
        ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(tokens)]).to(DEVICE)
        *weights, table = p.prepare(ids)
        assert (weights[0].data.shape[0] == 3) == (via == "slots")
        for x in ids.unique().tolist():
            i = int(table[x])
            assert all(torch.equal(w.data[i].cpu(), s.data[x]) for w, s in zip(weights, stacks))
    assert int(p.stats[:, 3].sum()) > 0  # something was admitted


@pytest.fixture(scope="module")
def resident() -> LLM:
    if not DEMO_MODEL.is_file():
        pytest.skip("demo model is not in this checkout")
    torch.set_num_threads(1)
    return LLM(DEMO_MODEL, device="cpu", max_model_len=256)


def paged(gpu_gib: float, host_gib: float = 1.0) -> LLM:
    return LLM(
        DEMO_MODEL, device="cpu", max_model_len=256, gpu_expert_cache_gib=gpu_gib,
        host_expert_cache_gib=host_gib, expert_paging=True,
    )  # fmt: skip


def run(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[tuple[list[int], list[float]]]:
    return [
        (list(o.token_ids), [lp.logprob for lp in o.logprobs])
        for o in llm.generate(prompts, params)
    ]


def _gib_for(llm: LLM, slots: int) -> float:
    """The device budget that gives `slots` slots a layer: the stage (one layer's experts)
    and the slots, or every expert."""
    one = sum(p.expert_bytes for p in llm.paged)  # a slot in every layer
    e = llm.paged[0].num_experts
    stage = e * max(p.expert_bytes for p in llm.paged)
    return (e * one if slots == e else stage + slots * one) / 2**30 + 1e-9


@pytest.mark.parametrize("slots", [1, 5, 8])
def test_tokens_tables_and_counters(resident: LLM, slots: int) -> None:
    gib = _gib_for(paged(1.0), slots)
    llm = paged(gib)
    assert {p.n_slots for p in llm.paged} == {slots}
    assert sum(p.nbytes["device"] for p in llm.paged) <= gib * 2**30  # within the budget
    assert all(moe.capturable for moe in llm.model.moe_layers())  # no host work per forward
    assert run(llm) == run(resident)
    for p in llm.paged:  # slot table and owners are inverse maps; the bytes are the owners'
        for i, x in enumerate(p.held()):
            assert x >= 0 and int(p.slot_of[x]) == i
            assert torch.equal(p._dev[0].data[i], p._host[0].data[x])
        assert int((p.slot_of >= 0).sum()) == slots
    # every layer read each forwarded token's k experts once (the last token is not forwarded)
    top_k = llm.model.moe_layers()[0].top_k
    tokens = sum(len(llm._encode(p)) + GREEDY.max_tokens - 1 for p in PROMPTS)
    per_layer = {int(p.stats[:, :3].sum()) for p in llm.paged}
    assert per_layer == {tokens * top_k}
    c = paged_snapshot(llm.paged)
    assert c["admitted_bytes"] == sum(int(p.stats[:, 3].sum()) * p.expert_bytes for p in llm.paged)
    phases = c["phases"]  # prompts in prefill steps, each later token in a decode step
    decode_reads = sum(phases["decode"][k] for k in ("slot_reads", "admitted_reads", "link_reads"))
    assert decode_reads == len(llm.paged) * top_k * len(PROMPTS) * (GREEDY.max_tokens - 1)
    assert all(c[k] == sum(phases[p][k] for p in phases) for k in ("slot_reads", "admissions"))
    if slots == llm.paged[0].num_experts:  # all resident from the start
        assert c["admissions"] == c["link_reads"] == 0 and c["slot_hit_rate"] == 1.0
    else:
        assert c["admissions"] > 0 and c["slot_reads"] > 0
    if slots < top_k:  # a token's experts never all fit: some read across the link
        assert c["link_reads"] > 0
    metrics = {name: value for name, _, _, value in paged_metric_families(c)}
    assert metrics["moestream_expert_paged_admissions"] == c["admissions"]
    assert metrics["moestream_expert_paged_slot_hit_rate"] == c["slot_hit_rate"]


def test_the_prediction_prefetches_only_while_it_pays() -> None:
    """`page_ref`'s gate (the kernel's decision, tested against it above): predictions that
    name the wrong experts stop being prefetched, are still scored while they are not, and are
    prefetched again once they name what the forwards route."""
    from moestream.experts.paged import page_ref

    e, s = 16, 4
    state = _state(e, s, seed=1)
    st = state["stats"]
    g = torch.Generator().manual_seed(2)

    def forward(right: bool) -> None:
        ids = torch.randperm(e // 2, generator=g)[:2][None]  # experts 0-7 routed
        guess = ids if right else ids + e // 2  # or experts 8-15 named
        args = (state["heat"], state["slot_of"], state["owner"], st, 0.9)
        page_ref(guess, *args, True, state["mark"], state["gate"], predict=True)
        page_ref(ids, *args, True, state["mark"], state["gate"])

    for _ in range(20):
        forward(right=False)
    wrong = dict(zip(STATS, st.tolist(), strict=True))
    assert wrong["predicted_used"] == 0 and 0 < wrong["prefetched"] < wrong["predicted"]
    for _ in range(10):
        forward(right=False)
    assert int(st[6]) == wrong["prefetched"]  # closed: named, scored, not copied
    assert int(st[4]) > wrong["predicted"]
    for _ in range(60):
        forward(right=True)
    assert int(st[6]) > wrong["prefetched"] and int(st[7]) > 0  # open again, and used


def test_the_prediction_raises_the_hit_rate_on_real_routing() -> None:
    """On the trained MoE (2 of 8 experts a token), decode at 4 slots a layer: the next
    layer's router applied to this layer's FFN input names most of its experts, and paging
    them ahead turns admissions into hits; the tokens do not change."""
    if not DEMO_MODEL.is_file():
        pytest.skip("demo model is not in this checkout")
    text = (DEMO_MODEL.parent / "heldout-python.txt").read_text()
    prompts = [text[i : i + 300] for i in (0, 5000)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    gib = _gib_for(paged(1.0), 4)
    snaps, tokens = {}, {}
    for predict in (True, False):
        llm = LLM(
            DEMO_MODEL, device="cpu", max_model_len=256, gpu_expert_cache_gib=gib,
            host_expert_cache_gib=1.0, expert_paging=True, expert_prediction=predict,
        )  # fmt: skip
        tokens[predict] = [o.token_ids for o in llm.generate(prompts, params)]
        snaps[predict] = paged_snapshot(llm.paged)["phases"]["decode"]
    assert tokens[True] == tokens[False]
    on, off = snaps[True], snaps[False]
    assert off["predicted"] == off["prefetched"] == 0
    assert on["prefetch_accuracy"] > 0.6 and on["prediction_precision"] > 0.6, on
    assert on["slot_hit_rate"] > off["slot_hit_rate"] + 0.08, (on, off)
    assert on["admissions"] < off["admissions"]
    metrics = {name: value for name, _, _, value in paged_metric_families(on)}
    assert metrics["moestream_expert_paged_prefetch_accuracy"] == on["prefetch_accuracy"]


def test_budgets_are_enforced() -> None:
    if not DEMO_MODEL.is_file():
        pytest.skip("demo model is not in this checkout")
    one_slot = _gib_for(paged(1.0), 1)
    with pytest.raises(CapacityError, match="a device slot a layer"):
        paged(one_slot * 0.9)
    with pytest.raises(CapacityError, match="host-expert-cache-gib"):
        paged(one_slot, host_gib=one_slot)
    with pytest.raises(RequestError, match="expert_paging"):
        LLM(DEMO_MODEL, device="cpu", expert_paging=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("slots, seqs", [(1, 1), (4, 1), (1, 3), (4, 3)])
def test_paging_on_the_gpu_keeps_the_tokens(slots: int, seqs: int) -> None:
    """On a GPU, decode steps captured as CUDA graphs with the pager, gather and copy kernels
    inside (run-ahead on): the greedy tokens equal the resident model's, one request at a time
    (decode over the slots: 2 experts a token) and three together (beyond one slot or four:
    through the stage, as the prompts are)."""
    text = (DEMO_MODEL.parent / "heldout-python.txt").read_text()
    prompts = [text[i : i + 300] for i in (0, 5000, 26000)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    kw = {"device": "cuda", "max_model_len": 256, "kv_cache_gib": 0.5, "max_num_seqs": seqs}
    resident = LLM(DEMO_MODEL, **kw)
    want = [o.token_ids for o in resident.generate(prompts, params)]
    del resident
    probe = LLM(
        DEMO_MODEL, **kw, gpu_expert_cache_gib=1.0, host_expert_cache_gib=1.0, expert_paging=True
    )
    gib = _gib_for(probe, slots)
    del probe
    llm = LLM(DEMO_MODEL, **kw, gpu_expert_cache_gib=gib, host_expert_cache_gib=1.0)
    assert {p.n_slots for p in llm.paged} == {slots}  # paged: the default on CUDA
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.captured
    c = paged_snapshot(llm.paged)
    assert c["phases"]["decode"]["slot_reads"] > 0 and c["link_reads"] > 0, c
    if seqs == 1:  # (three requests can keep one slot's expert routed at every step)
        assert c["admissions"] > 0, c
        # every decode token's reads and no others (the captures' warm-ups are left out)
        d = c["phases"]["decode"]
        top_k = llm.model.moe_layers()[0].top_k
        reads = len(prompts) * (params.max_tokens - 1) * top_k * len(llm.paged)
        assert d["slot_reads"] + d["admitted_reads"] + d["link_reads"] == reads, d
    if seqs == 1 and slots == 4:  # the trained model's next-layer prediction is prefetched
        assert c["prefetched"] > 0 and c["prefetch_accuracy"] > 0.5, c
    for p in llm.paged:
        for i, x in enumerate(p.held()):
            assert x >= 0 and int(p.slot_of[x]) == i
            assert torch.equal(p._dev[2].data[i].cpu(), p._host[2].data[x])


def test_plan_paging_counts_the_stage_and_refuses_what_cannot_page() -> None:
    from gguf import GGMLQuantizationType as Q

    from moestream.errors import UnsupportedError
    from moestream.experts.paged import plan_paging

    mib = 2**20
    kinds = [[(Q.Q4_K, mib), (Q.Q4_K, mib), (Q.Q6_K, 2 * mib)]] * 4  # 4 MiB an expert a layer
    gib = 2**30
    # stage: 8 experts x 4 MiB = 32 MiB; a slot in each of the 4 layers: 16 MiB
    assert plan_paging(kinds, 8, (32 + 3 * 16) * mib / gib, None) == 3
    assert plan_paging(kinds, 8, 8 * 16 * mib / gib, None) == 8  # all fit: no stage
    with pytest.raises(CapacityError, match="a device slot a layer"):
        plan_paging(kinds, 8, (32 + 15) * mib / gib, None)
    with pytest.raises(CapacityError, match="pinned host memory"):
        plan_paging(kinds, 8, 1.0 * (32 + 16) * mib / gib, 0.1)
    with pytest.raises(UnsupportedError, match="integer-dot"):
        plan_paging([[(Q.IQ4_XS, mib)] * 3] * 4, 8, 1.0, None)
    assert plan_paging([[(Q.IQ4_XS, mib)] * 3] * 4, 8, 1.0, None, cuda=False) == 8
    with pytest.raises(UnsupportedError, match="multiples of 16"):
        plan_paging([[(Q.Q4_K, 1000)] * 3] * 4, 8, 1.0, None)


def test_info_says_which_placement_cuda_gets() -> None:
    if not DEMO_MODEL.is_file():
        pytest.skip("demo model is not in this checkout")
    from moestream.experts import ExpertBudgets, describe_placement, format_placement

    paged_ = describe_placement(DEMO_MODEL, ExpertBudgets(0.005, 1.0))
    assert paged_["paged_slots"] >= 1 and "paged (the default there)" in format_placement(paged_)
    at_half = describe_placement(DEMO_MODEL, ExpertBudgets(0.005, 1.0), device_hit_rate=0.5)
    per_token = paged_["top_k"] * sum(paged_["expert_bytes"])  # every routed expert's bytes
    assert at_half["paged_bytes_per_token"] == pytest.approx(0.5 * per_token)
    streamed = describe_placement(DEMO_MODEL, ExpertBudgets(0.005, 0.0))
    assert streamed["paged_slots"] is None and "not paged" in format_placement(streamed)


def test_expert_prediction_off_turns_off_the_streamed_stores_too() -> None:
    """`expert_prediction=False` means load on demand for either placement: with the streamed
    store (the CPU's placement by default) no prediction is made or prefetched, and the tokens
    are those it gives with predictions."""
    if not DEMO_MODEL.is_file():
        pytest.skip("demo model is not in this checkout")
    out, stats = {}, {}
    for predict in (True, False):
        llm = LLM(
            DEMO_MODEL, device="cpu", max_model_len=256, gpu_expert_cache_gib=0.004,
            host_expert_cache_gib=1.0, expert_prediction=predict,
        )  # fmt: skip
        assert llm.expert_store is not None and not llm.paged
        out[predict] = run(llm)
        stats[predict] = llm.expert_store.counters.snapshot()
        llm.expert_store.close()
    assert out[True] == out[False]
    assert stats[True]["predicted"] > 0 and stats[True]["prefetch_issued"] > 0
    assert stats[False]["predicted"] == stats[False]["prefetch_issued"] == 0

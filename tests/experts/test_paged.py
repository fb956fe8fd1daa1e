"""Paged expert placement (`experts.paged`): the pager kernel's decisions and copies against its
torch reference (the Triton interpreter without CUDA), and on the CPU the same tokens and
logprobs as the resident model at every slot count, tables that stay consistent, counters that
add up, budgets enforced, and the trained model's decode served mostly by the slots."""

from __future__ import annotations

import pytest
import torch

from moestream.cli import DEMO_MODEL
from moestream.errors import CapacityError, RequestError
from moestream.experts.paged import paged_snapshot
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
    return {"heat": heat, "slot_of": slot_of, "owner": owner, "stats": torch.zeros(5).long()}


@pytest.mark.parametrize(
    "e, s, tokens, k", [(16, 6, 1, 4), (16, 5, 4, 4), (40, 24, 3, 8), (8, 1, 1, 2)]
)
def test_pager_kernel_matches_its_reference(e: int, s: int, tokens: int, k: int) -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    from moestream.kernels.expert_pager import page, page_ref

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
    for step in range(6):
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
        admit = step != 3  # one forward that only counts, as a long one
        moves = page_ref(ids, ref["heat"], ref["slot_of"], ref["owner"], ref["stats"], 0.9, admit)
        page(
            ids.to(DEVICE), dev["heat"], dev["slot_of"], dev["owner"], addr, host_addr,
            slot_addr, copies, dev["stats"], words, 0.9, admit,
        )  # fmt: skip
        for name in ("slot_of", "owner", "stats"):
            assert torch.equal(dev[name].cpu(), ref[name]), (step, name)
        torch.testing.assert_close(dev["heat"].cpu(), ref["heat"])
        if admit:
            n = int(copies[0])
            listed = copies[1 : 1 + 2 * n].view(n, 2).tolist()
            assert [tuple(m) for m in listed] == moves  # hottest first, coldest slot first
        # every routed expert found where the table says, with the right bytes
        for x in ids.unique().tolist():
            i = int(ref["slot_of"][x])
            want = slot_addr[:, i] if i >= 0 else host_addr[:, x]
            assert torch.equal(addr[:, x], want)
            if i >= 0:
                assert all(torch.equal(d[i].cpu(), h[x]) for d, h in zip(slots, host)), x
        outside = int((ref["slot_of"][ids.unique()] < 0).sum())
        if admit and ids.unique().numel() <= s:  # room for all: every routed expert got a slot
            assert outside == 0
    assert ref["stats"][3] > 0 and ref["stats"][0] > 0  # admissions and hits both happened


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


def _layer_gib(llm: LLM) -> float:
    return sum(p.expert_bytes for p in llm.paged) / 2**30  # one slot in every layer


@pytest.mark.parametrize("slots", [1, 5, 8])
def test_tokens_tables_and_counters(resident: LLM, slots: int) -> None:
    one = _layer_gib(paged(1.0))
    llm = paged(slots * one + 1e-9)
    assert {p.n_slots for p in llm.paged} == {slots}
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
    per_layer = {int(p.stats[:, [0, 1, 2, 4]].sum()) for p in llm.paged}
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


def test_budgets_are_enforced() -> None:
    if not DEMO_MODEL.is_file():
        pytest.skip("demo model is not in this checkout")
    one = _layer_gib(paged(1.0))
    with pytest.raises(CapacityError, match="at least one device slot"):
        paged(one / 2)
    with pytest.raises(CapacityError, match="host-expert-cache-gib"):
        paged(one, host_gib=one)
    with pytest.raises(RequestError, match="expert_paging"):
        LLM(DEMO_MODEL, device="cpu", expert_paging=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_paging_on_the_gpu_keeps_the_tokens() -> None:
    """On a GPU, decode steps captured as CUDA graphs with the pager and copy kernels inside
    (run-ahead on): the greedy tokens equal the resident model's at one slot a layer (most
    experts read across the link) and at half of them (most paged). One request at a time:
    three decoding together can keep a single slot's expert routed at every step."""
    text = (DEMO_MODEL.parent / "heldout-python.txt").read_text()
    prompts = [text[i : i + 300] for i in (0, 5000, 26000)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    resident = LLM(DEMO_MODEL, device="cuda", max_model_len=256, kv_cache_gib=0.5, max_num_seqs=1)
    want = [o.token_ids for o in resident.generate(prompts, params)]
    del resident
    one = None
    for slots in (1, 4):
        if one is None:
            probe = LLM(
                DEMO_MODEL, device="cuda", max_model_len=256, kv_cache_gib=0.5,
                gpu_expert_cache_gib=1.0, host_expert_cache_gib=1.0, expert_paging=True,
            )  # fmt: skip
            one = _layer_gib(probe)
            del probe
        llm = LLM(
            DEMO_MODEL, device="cuda", max_model_len=256, kv_cache_gib=0.5,
            gpu_expert_cache_gib=slots * one + 1e-9, host_expert_cache_gib=1.0,
            expert_paging=True, max_num_seqs=1,
        )  # fmt: skip
        assert [o.token_ids for o in llm.generate(prompts, params)] == want, slots
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.captured
        c = paged_snapshot(llm.paged)
        assert c["admissions"] > 0, c
        for p in llm.paged:
            for i, x in enumerate(p.held()):
                assert x >= 0 and int(p.slot_of[x]) == i
                assert torch.equal(p._dev[2].data[i].cpu(), p._host[2].data[x])
        del llm

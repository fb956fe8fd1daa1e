"""Draft-model proposer on the real tiny Qwen3 draft: greedy drafts, rollback, batching."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from moestream.errors import ModelFormatError
from moestream.layers.attention import AttentionMetadata
from moestream.models.registry import build_model
from moestream.spec.base import ProposalInput, SpecConfig
from moestream.spec.draft import DraftModelProposer
from moestream.spec.speculator import Speculator
from moestream.weights.loader import open_model
from moestream.weights.qtensor import QTensor

DATA = Path(__file__).resolve().parents[2] / "moestream" / "data"
DRAFT = DATA / "tiny-qwen3-draft-Q8_0.gguf"
BS = 16


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: one thread is faster than two and avoids oversubscribed CI machines."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def source():
    return open_model(DRAFT)


@pytest.fixture(scope="module")
def model(source):
    """The draft model with its Q8_0 weights dequantized once (bit-exact), so that the CPU
    reference path does not dequantize every weight in every forward."""
    tensors = {
        name: QTensor.from_float(source.tensors[name].dequantize(torch.float32))
        for name in source.tensors
    }
    return build_model(dataclasses.replace(source, tensors=tensors))


@pytest.fixture(scope="module")
def prompts(source):
    tok = source.tokenizer()
    text = (DATA / "heldout-python.txt").read_text()
    ids = tok.encode(text[:3000])
    return [ids[:23], ids[100:140], ids[300:309]]


@torch.inference_mode()
def greedy_reference(model, tokens: list[int], k: int) -> list[int]:
    """k greedy tokens, each from a full forward over all tokens in a fresh cache."""
    toks, out = list(tokens), []
    for _ in range(k):
        n = len(toks)
        nb = -(-n // BS)
        kv = model.make_kv_cache(nb, BS)
        dev = model.device
        attn = AttentionMetadata.build([(0, n, list(range(nb)))], BS, dev)
        ids = torch.tensor(toks, device=dev)
        hidden = model.forward(ids, torch.arange(n, device=dev), attn, kv)
        t = int(model.compute_logits(hidden[-1:]).argmax())
        out.append(t)
        toks.append(t)
    return out


@torch.inference_mode()
def assert_draft_kv_matches(model, prop, rid, tokens):
    """The proposer's cached K/V of `tokens` (all layers) equal a fresh full forward's."""
    n = len(tokens)
    nb = -(-n // BS)
    kv = model.make_kv_cache(nb, BS)
    attn = AttentionMetadata.build([(0, n, list(range(nb)))], BS, "cpu")
    model.forward(torch.tensor(tokens), torch.arange(n), attn, kv)
    blocks = prop._states[rid].block_ids
    for layer in range(model.config.n_layers):
        for mine, ref in ((prop.kv.k[layer], kv.k[layer]), (prop.kv.v[layer], kv.v[layer])):
            got = mine[blocks].flatten(0, 1)[:n]  # [n, g, D]
            torch.testing.assert_close(got, ref.flatten(0, 1)[:n], rtol=1e-4, atol=1e-4)


def propose_one(prop, rid, prompt, output, k):
    got = prop.propose([ProposalInput(rid, prompt, output, num_drafts=k)])
    return got[rid].token_ids


def test_proposals_are_the_draft_models_greedy_continuation(model, prompts):
    prop = DraftModelProposer(model, num_blocks=16, block_size=BS)
    got = prop.propose([ProposalInput("a", prompts[0], [], num_drafts=4)])
    assert got["a"].probs is None  # greedy drafts: verified as one-hot q
    assert got["a"].token_ids == greedy_reference(model, prompts[0], 4)
    assert prop.num_computed("a") == len(prompts[0])


@pytest.mark.parametrize("accepted", [0, 1, 3, 4])
def test_rollback_after_partial_acceptance(model, prompts, accepted):
    prompt, k = prompts[0], 4
    prop = DraftModelProposer(model, num_blocks=16, block_size=BS)
    drafts = propose_one(prop, "a", prompt, [], k)
    # The target accepts `accepted` drafts, then emits its own token: a different one from
    # the next draft (a rejection), or any token after all k were accepted.
    bonus = (drafts[accepted] + 1) % model.config.vocab_size if accepted < k else 7
    output = drafts[:accepted] + [bonus]
    nxt = propose_one(prop, "a", prompt, output, 3)
    # the drafted K/V that matched the accepted tokens were kept, the rest is recomputed
    assert prop.num_computed("a") == len(prompt) + len(output)
    assert nxt == greedy_reference(model, prompt + output, 3)
    assert_draft_kv_matches(model, prop, "a", prompt + output)


def test_rollback_when_the_request_moved_on_without_verifying(model, prompts):
    """Drafts that were never verified (the step ran plain decode, several times): the tokens
    that follow match the drafts only in part, and only that part of the draft K/V is kept."""
    prompt = prompts[1]
    prop = DraftModelProposer(model, num_blocks=16, block_size=BS)
    drafts = propose_one(prop, "a", prompt, [], 4)
    vocab = model.config.vocab_size
    output = [drafts[0], (drafts[1] + 1) % vocab, drafts[2], 3, 4]  # diverges at the 2nd
    assert propose_one(prop, "a", prompt, output, 2) == greedy_reference(model, prompt + output, 2)
    assert_draft_kv_matches(model, prop, "a", prompt + output)


def test_batched_requests_equal_alone(model, prompts):
    ks = [4, 2, 3]
    batched = DraftModelProposer(model, num_blocks=32, block_size=BS)
    inputs = [
        ProposalInput(f"r{i}", p, [], num_drafts=k) for i, (p, k) in enumerate(zip(prompts, ks))
    ]
    got = batched.propose(inputs)
    for i, (p, k) in enumerate(zip(prompts, ks)):
        alone = DraftModelProposer(model, num_blocks=16, block_size=BS)
        assert got[f"r{i}"].token_ids == propose_one(alone, "x", p, [], k)
        assert len(got[f"r{i}"].token_ids) == k
    # a second batched step after different acceptances stays right for every request
    outs = [got["r0"].token_ids[:2] + [5], [11], got["r2"].token_ids[:3] + [9]]
    inputs = [
        ProposalInput(f"r{i}", p, o, num_drafts=2) for i, (p, o) in enumerate(zip(prompts, outs))
    ]
    got = batched.propose(inputs)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert got[f"r{i}"].token_ids == greedy_reference(model, p + o, 2)


def test_chunked_catch_up_gives_the_same_drafts(model, prompts):
    chunked = DraftModelProposer(model, num_blocks=16, block_size=BS, max_prefill_tokens=8)
    plain = DraftModelProposer(model, num_blocks=16, block_size=BS)
    assert propose_one(chunked, "a", prompts[1], [], 3) == propose_one(
        plain, "a", prompts[1], [], 3
    )


def test_capacity_skips_and_release_frees_blocks(model, prompts):
    prop = DraftModelProposer(model, num_blocks=3, block_size=BS)
    assert set(prop.propose([ProposalInput("a", prompts[1], [], num_drafts=4)])) == {"a"}
    held = prop.allocator.num_used
    assert held == 3  # 40 + 3 positions
    # no blocks left for a second request: no proposal, no error
    assert prop.propose([ProposalInput("b", prompts[0], [], num_drafts=4)]) == {}
    prop.release("a")
    prop.release("b")
    assert prop.allocator.num_used == 0 and prop.num_requests == 0
    prop.allocator.check_invariants()


def test_warm_up_runs_the_draft_once_per_pool_and_leaves_nothing(model, prompts, monkeypatch):
    """`warm_up` (the engine calls it on a GPU, so kernels compile before a request pays):
    catch-up forwards and single-token forwards at batch 1 and 2, over lengths that are
    multiples of 16 and not, then no request, no block held, and requests after it get the
    same drafts as on a fresh pool. Once per pool: again only after `resize_kv`."""
    prop = DraftModelProposer(model, num_blocks=16, block_size=BS)
    shapes = []  # (tokens, sequences) of each forward
    forward = model.forward

    def counted(ids, positions, attn, kv):
        shapes.append((ids.shape[0], attn.seq_lens.shape[0]))
        return forward(ids, positions, attn, kv)

    monkeypatch.setattr(model, "forward", counted)
    prop.warm_up(4)
    # one request of 16 tokens: its catch-up giving the first draft, then 3 single tokens;
    # then two of 17 and 41 together: a 58-token catch-up, then 3 forwards of 2 tokens
    assert shapes == [(16, 1), (1, 1), (1, 1), (1, 1), (58, 2), (2, 2), (2, 2), (2, 2)]
    assert prop.num_requests == 0 and prop.allocator.num_used == 0 and prop.last_forwards == 0
    prop.warm_up(4)
    assert len(shapes) == 8
    assert propose_one(prop, "a", prompts[0], [], 4) == greedy_reference(model, prompts[0], 4)
    prop.release("a")
    prop.resize_kv(8)
    before = len(shapes)
    prop.warm_up(2)
    assert len(shapes) == before + 4
    prop.allocator.check_invariants()


def test_last_forwards_counts_catch_up_chunks_and_drafted_positions(model, prompts):
    """`last_forwards`, what the picker divides a draft call's time by: the catch-up chunks
    of a long request plus one forward per drafted position."""
    prop = DraftModelProposer(model, num_blocks=16, block_size=BS, max_prefill_tokens=16)
    propose_one(prop, "a", prompts[1], [], 3)  # 40 tokens: 2 chunks of 16, then 8 + 2 drafts
    assert prop.last_forwards == 2 + 3
    propose_one(prop, "a", prompts[1], [7], 2)  # caught up: the drafts' forwards alone
    assert prop.last_forwards == 2
    assert prop.propose([]) == {} and prop.last_forwards == 0


def test_vocabulary_mismatch_is_rejected(model, source):
    tokens = source.metadata["tokenizer.ggml.tokens"]
    DraftModelProposer.check_compatible(model.config, 4096, "d.gguf", tokens, list(tokens))
    with pytest.raises(ModelFormatError, match="vocabulary"):
        DraftModelProposer.check_compatible(model.config, 151936, "x.gguf")
    other = list(tokens)
    other[5] = "something else"
    with pytest.raises(ModelFormatError, match="token 5"):
        DraftModelProposer.check_compatible(model.config, 4096, "x.gguf", tokens, other)


def test_speculator_with_draft_keeps_greedy_output(model, prompts):
    """The draft model verifying itself: every draft is accepted, output equals plain greedy."""
    from moestream.sched.scheduler import Scheduler
    from moestream.types import Request, SamplingParams

    config = SpecConfig(
        mode="draft", draft_model=str(DRAFT), max_k=3, explore_interval=1, explore_budget=0.5
    )
    spec = Speculator(config, [DraftModelProposer(model, num_blocks=8, block_size=BS)])
    prompt, n_out = prompts[2], 10
    truth = greedy_reference(model, prompt, n_out)
    sched = Scheduler(
        block_size=BS,
        num_blocks=8,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        max_model_len=256,
        enable_prefix_caching=False,
    )
    req = Request("a", list(prompt), SamplingParams(temperature=0, max_tokens=n_out))
    sched.add_request(req)
    steps = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        sampled = {}
        for s in plan.scheduled:
            pos = len(s.output_token_ids)
            out = []
            for j, d in enumerate(s.draft_token_ids):
                if d != truth[pos + j]:
                    break
                out.append(d)
            sampled[s.request_id] = out + [truth[pos + len(out)]]
        spec.observe(plan, sampled)
        spec.record_step_time(plan.num_tokens, 1.0)  # a target step costs far more than drafting
        sched.update(plan, sampled)
        spec.draft(sched.running)
        steps += 1
    assert req.output_token_ids == truth
    total = spec.stats.total
    assert total.num_verify_steps >= 1 and total.acceptance_rate == 1.0
    assert steps < n_out  # speculation saved target steps


def test_from_config_loads_the_draft_and_checks_its_vocabulary():
    auto = SpecConfig(mode="auto", draft_model=str(DRAFT))
    spec = Speculator.from_config(auto, vocab_size=4096, draft_num_blocks=4)
    assert list(spec.proposers) == ["ngram", "draft"]
    assert spec.proposers["draft"].kv.num_blocks == 4
    assert Speculator.from_config(SpecConfig(mode="off"), vocab_size=4096) is None
    with pytest.raises(ModelFormatError, match="does not match the target's 151936"):
        Speculator.from_config(auto, vocab_size=151936)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_draft_proposer_on_cuda(source, prompts):
    """The Q8_0 draft on the GPU kernels: drafts equal the same model's full-forward greedy
    continuation; prints the time of one batched propose call."""
    import time

    model = build_model(source, device="cuda")
    prop = DraftModelProposer(model, num_blocks=64, block_size=BS)
    inputs = [ProposalInput(f"r{i}", p, [], num_drafts=4) for i, p in enumerate(prompts)]
    got = prop.propose(inputs)
    for i, p in enumerate(prompts):
        assert got[f"r{i}"].token_ids == greedy_reference(model, p, 4)
    for batch in (1, 3):
        steps = [
            [ProposalInput(f"t{i}", prompts[i], [7] * s, num_drafts=4) for i in range(batch)]
            for s in range(10)
        ]  # a new token per call, as in decode
        torch.cuda.synchronize()
        start = time.perf_counter()
        for step in steps:
            prop.propose(step)
        per_call = (time.perf_counter() - start) / len(steps)
        print(f"draft propose, {batch} request(s), k=4: {per_call * 1e3:.2f} ms per call")


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="runs the attention and norm kernels through the Triton interpreter on CPU tensors",
)
def test_decode_graphs_give_the_eager_drafts(source, prompts, monkeypatch):
    """The proposer's single-token forwards through decode graphs (replayed by recomputation
    on the CPU, the layers on their kernel path under the interpreter; two layers) draft the
    same tokens as the same proposer run eagerly, over calls where requests advance, accept
    part of their drafts and join, at batch 1 and 2."""
    pytest.importorskip("triton", reason="triton is not installed")
    from moestream.layers import attention, norm
    from moestream.runner.cuda_graph import DecodeGraphs, RecomputeBackend

    for module in (norm, attention):
        monkeypatch.setattr(module, "on_kernel_path", lambda x: True)
    tensors = {
        name: QTensor.from_float(source.tensors[name].dequantize(torch.float32))
        for name in source.tensors
    }
    model = build_model(dataclasses.replace(source, tensors=tensors))  # a copy to cut
    model.layers = model.layers[:2]
    eager = DraftModelProposer(model, num_blocks=16, block_size=BS)
    eager.use_graphs = False
    graphed = DraftModelProposer(model, num_blocks=16, block_size=BS)
    graphed.use_graphs = True

    def forward(ids, pos, attn):
        return model.compute_logits(model.forward(ids, pos, attn, graphed.kv))

    graphed._graphs = DecodeGraphs(
        forward, BS, 16, "cpu", buckets=(1, 2), backend=RecomputeBackend(), verify_buckets=(),
        verify_tokens=(),
    )  # fmt: skip
    graphed._graphs_made = True
    outputs: dict[str, list[int]] = {"a": [], "b": []}
    for step in range(4):
        rids = ["a"] if step < 2 else ["a", "b"]
        inputs = [
            ProposalInput(r, prompts[i], outputs[r], num_drafts=3) for i, r in enumerate(rids)
        ]
        want, got = eager.propose(inputs), graphed.propose(inputs)
        assert {r: p.token_ids for r, p in got.items()} == {
            r: p.token_ids for r, p in want.items()
        }, step
        for r in rids:  # accept the first draft, then the "target" picks token 7
            outputs[r] = outputs[r] + want[r].token_ids[:1] + [7]
    assert graphed.graphs is not None and graphed.graphs.captured == (1, 2)

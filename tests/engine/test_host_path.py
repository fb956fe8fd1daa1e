"""The engine's fast host paths give exactly the tokens of the paths they replace.

1. Greedy rows that ask for nothing else take one argmax and one read-back instead of the full
   sampler: the same tokens as requests that go through the sampler (logprobs asked).
2. Graph decode steps, on the CPU: exactly the eager engine's tokens.
3. Graph verify steps (speculation: K tokens per request), on the CPU: exactly the eager
   speculating engine's tokens and logprobs, and greedy ones those of plain decode.

A CUDA graph cannot run here, so the runner gets `DecodeGraphs` over the tiny model's reference
forward with a backend that "replays" by recomputing into the captured output: every pure
decode step then goes through the host path a GPU step takes (the plan to host lists,
`run_decode`'s staging with incremental block-table rows and one copy, padding rows, the
argmax read-back or the full sampler) while prefill steps stay eager. Requests of different
lengths arrive and finish at different steps (sequences change rows; tables grow in place),
greedy ones next to seeded random ones and ones asking for logprobs: every request's tokens
and logprobs equal those of the eager engine.
"""

from __future__ import annotations

import random

import torch

from moestream.config import CacheConfig, SchedConfig
from moestream.engine import Engine
from moestream.layers.attention import AttentionMetadata
from moestream.runner.cuda_graph import DecodeGraphs, RecomputeBackend
from moestream.spec.base import Proposal, ProposalInput, Proposer, SpecConfig
from moestream.spec.speculator import Speculator
from moestream.types import SamplingParams

BS = 16


def reference_forward(engine: Engine, calls: list[tuple[int, int]]):
    """A graph forward over static buffers on the CPU reference path: the real rows (slot >= 0;
    each sequence's first rows) of the real sequences (seq_len > 0) get host copies of their
    lengths, the pad rows and padding sequences are left out. Decode graphs (K = 1) and verify
    graphs (K tokens per sequence, the new tokens the last K of seq_lens) alike."""
    model, kv = engine.model, engine.kv

    def forward(ids: torch.Tensor, pos: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        k = attn.max_query_len or 1
        lens, slots = attn.seq_lens.tolist(), attn.slot_mapping.tolist()
        seqs, rows, query_lens = [], [], []
        for b, n in enumerate(lens):
            real = [b * k + j for j in range(k) if slots[b * k + j] >= 0]
            assert real == list(range(b * k, b * k + len(real))), "pad rows before real ones"
            if n:
                seqs.append(b)
                rows += real
                query_lens.append(len(real))
            else:
                assert not real, "a padding sequence writes K/V"
        out = torch.zeros(len(slots), model.config.vocab_size)
        if seqs:
            calls.append((len(seqs), k))
            rows_t, seqs_t = torch.tensor(rows), torch.tensor(seqs)
            seq_lens = [lens[b] - k + q for b, q in zip(seqs, query_lens)]
            starts = [0]
            for q in query_lens:
                starts.append(starts[-1] + q)
            meta = AttentionMetadata(
                query_start_loc=torch.tensor(starts, dtype=torch.int32),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                block_tables=attn.block_tables[seqs_t],
                slot_mapping=attn.slot_mapping[rows_t],
                query_lens_cpu=query_lens,
                seq_lens_cpu=seq_lens,
                block_size=attn.block_size,
                is_decode=k == 1,
            )
            hidden = model.forward(ids[rows_t], pos[rows_t], meta, kv)
            out[rows_t] = model.compute_logits(hidden)
        return out

    return forward


def make_engine(tiny_moe, proposer: Proposer | None = None) -> Engine:
    model, tokenizer = tiny_moe
    engine = Engine(
        model,
        tokenizer,
        CacheConfig(block_size=BS),
        SchedConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
    )
    if proposer is not None:
        engine.speculator = Speculator(SpecConfig(mode="ngram", max_k=20, always=True), [proposer])
    return engine


def with_graphs(engine: Engine, calls: list[tuple[int, int]]) -> Engine:
    """`engine` with its runner's graphs over the reference forward (RecomputeBackend)."""
    max_blocks = engine.scheduler.allocator.num_blocks
    engine.runner.graphs = DecodeGraphs(
        reference_forward(engine, calls), BS, max_blocks, "cpu", backend=RecomputeBackend()
    )
    return engine


def run(engine: Engine, arrivals: list[tuple[int, list[int], SamplingParams]]) -> dict:
    """Add each request at its step; step until all finish: tokens and logprobs by request."""
    got: dict[str, tuple[list[int], list[float]]] = {}
    step = 0
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            rid = engine.add_request(prompt, params, f"r{len(got)}")
            got[rid] = ([], [])
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(lp.logprob for lp in out.logprobs)
        step += 1
    return got


def test_graph_decode_host_path_matches_eager(tiny_moe):
    rng = random.Random(1)
    arrivals = []
    for i in range(9):
        prompt = [rng.randrange(3, 4096) for _ in range(rng.randrange(3, 40))]
        kind = i % 3
        params = SamplingParams(
            temperature=0.0 if kind != 1 else 0.9,
            seed=100 + i if kind == 1 else None,
            logprobs=0 if kind == 2 else None,
            max_tokens=rng.randrange(6, 30),  # tables grow past a block boundary
            ignore_eos=True,
        )
        arrivals.append((rng.randrange(0, 12), prompt, params))
    eager = run(make_engine(tiny_moe), arrivals)
    engine = make_engine(tiny_moe)
    calls: list[tuple[int, int]] = []
    graphed = run(with_graphs(engine, calls), arrivals)
    assert graphed == eager
    assert len(calls) > 20 and len(set(calls)) > 3  # decode steps of many batch sizes ran
    assert sum(len(lps) for _, lps in graphed.values()) > 0


def test_argmax_path_matches_sampler_path(tiny_moe):
    """Plain greedy requests (argmax path) against the same requests asking for logprobs
    (full sampler), batched together with random neighbours: the same tokens."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 4096) for _ in range(rng.randrange(3, 30))] for _ in range(4)]

    def tokens(logprobs: int | None) -> list[list[int]]:
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=logprobs)
        noisy = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
        arrivals = [(0, p, greedy) for p in prompts] + [(2, prompts[0], noisy)]
        got = run(make_engine(tiny_moe), arrivals)
        return [got[f"r{i}"][0] for i in range(len(prompts))]

    plain = tokens(None)
    assert plain == tokens(0)
    assert all(len(t) == 12 for t in plain)


class OracleProposer(Proposer):
    """Drafts from known continuations (a plain run's output by request id): a random number
    of them, one corrupted half the time, none for a fifth of the requests. Deterministic per
    (request, tokens so far), so two engines get the same drafts."""

    name = "oracle"

    def __init__(self, continuations: dict[str, list[int]]):
        self.continuations = continuations

    def propose(self, inputs: list[ProposalInput]) -> dict[str, Proposal]:
        out = {}
        for inp in inputs:
            done = len(inp.output_token_ids)
            rng = random.Random(f"{inp.request_id}/{done}")
            if rng.random() < 0.2:
                continue
            n = rng.randint(1, inp.num_drafts)
            drafts = self.continuations[inp.request_id][done : done + n]
            drafts += [rng.randrange(3, 4096) for _ in range(n - len(drafts))]
            if rng.random() < 0.5:
                drafts[rng.randrange(n)] = rng.randrange(3, 4096)
            out[inp.request_id] = Proposal(drafts)
        return out

    def release(self, request_id: str) -> None:
        pass


def test_graph_verify_steps_match_eager(tiny_moe):
    """Speculating engines, eager and with decode + verify graphs: requests arrive at
    different steps with greedy, seeded random and logprob-asking sampling; drafts of 1..20
    tokens (up to 15 fit the verify graphs, more run eagerly) are partly accepted, so
    positions jump and tables grow by several tokens a step."""
    rng = random.Random(4)
    arrivals = []
    for i in range(8):
        prompt = [rng.randrange(3, 4096) for _ in range(rng.randrange(3, 40))]
        params = SamplingParams(
            temperature=0.9 if i % 3 == 1 else 0.0,
            seed=200 + i,
            logprobs=0 if i % 3 == 2 else None,
            max_tokens=rng.randrange(20, 60),
            ignore_eos=True,
        )
        arrivals.append((rng.randrange(0, 10), prompt, params))
    plain = run(make_engine(tiny_moe), arrivals)
    continuations = {rid: tokens for rid, (tokens, _) in plain.items()}
    eager = run(make_engine(tiny_moe, OracleProposer(continuations)), arrivals)
    calls: list[tuple[int, int]] = []
    engine = with_graphs(make_engine(tiny_moe, OracleProposer(continuations)), calls)
    steps: list[tuple[int, tuple[int, int] | None]] = []  # (most drafts, graph) per step
    execute = engine.runner.execute

    def recorded(plan):
        out = execute(plan)
        most = max((len(s.draft_token_ids) for s in plan.scheduled), default=-1)
        steps.append((most, engine.runner.last_step_graph))
        return out

    engine.runner.execute = recorded
    graphed = run(engine, arrivals)
    assert graphed == eager
    for i, (_, _, params) in enumerate(sorted(arrivals, key=lambda a: a[0])):  # as `run` adds
        if params.temperature == 0:
            assert graphed[f"r{i}"] == plain[f"r{i}"], f"r{i} differs from plain decode"
    ks = {g[1] for _, g in steps if g is not None}
    assert 1 in ks and len(ks - {1}) >= 3, ks  # decode graphs and verify graphs of several K
    assert any(most > 15 and g is None for most, g in steps)  # too many drafts: eager
    assert all(g is None or g[1] >= most + 1 for most, g in steps)
    accepted = engine.spec_stats()["total"]["accepted_tokens"]
    assert accepted > 50, engine.spec_stats()

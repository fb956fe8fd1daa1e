"""The engine's fast host paths give exactly the tokens of the paths they replace.

1. Greedy rows that ask for nothing else take one argmax and one read-back instead of the full
   sampler: the same tokens as requests that go through the sampler (logprobs asked).
2. Graph decode steps, on the CPU: exactly the eager engine's tokens.

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
from collections.abc import Callable

import torch

from moestream.config import CacheConfig, SchedConfig
from moestream.engine import Engine
from moestream.layers.attention import AttentionMetadata
from moestream.runner.cuda_graph import DecodeGraphs
from moestream.types import SamplingParams

BS = 16


class RecomputeBackend:
    """Capture = run once and keep the output buffer; replay = recompute into it."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        out = fn()
        return (lambda: out.copy_(fn())), out


def reference_decode(engine: Engine, calls: list[int]):
    """A decode forward over static buffers on the CPU reference path: padding rows (length
    0) are left out, the real rows get host copies of their lengths."""
    model, kv = engine.model, engine.kv

    def forward(ids: torch.Tensor, pos: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        lens = attn.seq_lens.tolist()
        real = [i for i, n in enumerate(lens) if n > 0]
        out = torch.zeros(len(lens), model.config.vocab_size)
        if real:
            calls.append(len(real))
            rows = torch.tensor(real)
            meta = AttentionMetadata(
                query_start_loc=torch.arange(len(real) + 1, dtype=torch.int32),
                seq_lens=attn.seq_lens[rows],
                block_tables=attn.block_tables[rows],
                slot_mapping=attn.slot_mapping[rows],
                query_lens_cpu=[1] * len(real),
                seq_lens_cpu=[lens[i] for i in real],
                block_size=attn.block_size,
                is_decode=True,
            )
            hidden = model.forward(ids[rows], pos[rows], meta, kv)
            out[rows] = model.compute_logits(hidden)
        return out

    return forward


def make_engine(tiny_moe) -> Engine:
    model, tokenizer = tiny_moe
    return Engine(
        model,
        tokenizer,
        CacheConfig(block_size=BS),
        SchedConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
    )


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
    calls: list[int] = []
    max_blocks = engine.scheduler.allocator.num_blocks
    engine.runner.graphs = DecodeGraphs(
        reference_decode(engine, calls), BS, max_blocks, "cpu", backend=RecomputeBackend()
    )
    graphed = run(engine, arrivals)
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

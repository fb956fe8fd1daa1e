"""Exactness: a request's greedy tokens do not depend on how the engine runs it.

Stronger than the text: each token's logprob (computed from the raw logits) must be the same
float, so any last-bit difference in any layer shows up here, even where it would not (yet)
flip an argmax.

The same 12 prompts (some sharing prefixes) are run alone, all together among random-sampling
neighbours, arriving at different steps, with small prefill chunks, with prefix-cache hits and
with a KV pool so small that requests are preempted; every run must give the reference tokens,
bit for bit, and leave every KV block back in the pool.
"""

from __future__ import annotations

import random

import pytest

from moestream.config import CacheConfig, SchedConfig
from moestream.engine import Engine
from moestream.types import SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def make_prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 4096) for _ in range(40)]  # a 40-token common prefix
    prompts = []
    for i in range(12):
        n = rng.randrange(3, 60)
        own = [rng.randrange(3, 4096) for _ in range(n)]
        prompts.append(shared[: 8 * (i % 6)] + own if i % 2 else own)
    return prompts


PROMPTS = make_prompts()


def make_engine(tiny_moe, *, chunk: int = 256, num_blocks: int | None = None, prefix=True):
    model, tokenizer = tiny_moe
    c = model.config
    gib = None
    if num_blocks is not None:
        gib = (num_blocks + 0.5) * 2 * c.n_layers * 16 * c.n_kv_heads * c.head_dim * 4 / 2**30
    return Engine(
        model,
        tokenizer,
        CacheConfig(block_size=16, kv_cache_gib=gib, enable_prefix_caching=prefix),
        SchedConfig(max_num_seqs=64, max_num_batched_tokens=chunk, max_model_len=512),
    )


Run = dict[str, list[tuple[int, float]]]


def run(engine: Engine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]]) -> Run:
    """Step `engine`, adding arrivals[step] before each step; {request id: [(token, logprob)]}
    (logprob NaN where not asked for)."""
    tokens: Run = {}
    step = 0
    while engine.has_unfinished() or any(s >= step for s in arrivals):
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(prompt, params, rid)
            tokens[rid] = []
        for out in engine.step() if engine.has_unfinished() else []:
            lps = [lp.logprob for lp in out.logprobs] or [float("nan")] * len(out.new_token_ids)
            tokens[out.request_id] += zip(out.new_token_ids, lps, strict=True)
        step += 1
    return tokens


def assert_pool_clean(engine: Engine) -> None:
    alloc = engine.scheduler.allocator
    alloc.check_invariants()
    assert alloc.num_used == 0
    assert alloc.num_free == alloc.num_blocks  # free + cached-but-unreferenced


@pytest.fixture(scope="module")
def reference(tiny_moe) -> list[list[tuple[int, float]]]:
    """Each prompt alone in an engine without prefix caching."""
    engine = make_engine(tiny_moe, prefix=False)
    refs = []
    for i, p in enumerate(PROMPTS):
        refs.append(run(engine, {0: [(f"r{i}", p, GREEDY)]})[f"r{i}"])
    assert_pool_clean(engine)
    assert all(len(r) == MAX_TOKENS for r in refs)
    assert len({tuple(t for t, _ in r) for r in refs}) > 6  # the prompts lead to different texts
    return refs


def greedy_arrivals(step_of=lambda i: 0):
    arrivals: dict[int, list] = {}
    for i, p in enumerate(PROMPTS):
        arrivals.setdefault(step_of(i), []).append((f"g{i}", p, GREEDY))
    return arrivals


def check(tokens: Run, reference: list[list[tuple[int, float]]]) -> None:
    for i, ref in enumerate(reference):
        assert tokens[f"g{i}"] == ref, f"prompt {i} diverged"


def test_all_together_among_random_neighbours(tiny_moe, reference) -> None:
    arrivals = greedy_arrivals()
    rng = random.Random(1)
    for j in range(20):  # 32 requests in all; the others sample at temperature 1
        prompt = [rng.randrange(3, 4096) for _ in range(rng.randrange(2, 50))]
        params = SamplingParams(temperature=1.0, max_tokens=rng.randrange(1, 15), seed=j)
        arrivals[0].append((f"n{j}", prompt, params))
    engine = make_engine(tiny_moe)
    check(run(engine, arrivals), reference)
    assert_pool_clean(engine)


def test_arriving_at_different_steps(tiny_moe, reference) -> None:
    engine = make_engine(tiny_moe, chunk=64)
    check(run(engine, greedy_arrivals(lambda i: 3 * i % 17)), reference)
    assert_pool_clean(engine)


@pytest.mark.parametrize("chunk", [16, 64])
def test_small_prefill_chunks(tiny_moe, reference, chunk: int) -> None:
    engine = make_engine(tiny_moe, chunk=chunk)
    check(run(engine, greedy_arrivals()), reference)
    assert_pool_clean(engine)


def test_prefix_cache_hits(tiny_moe, reference) -> None:
    engine = make_engine(tiny_moe)
    check(run(engine, greedy_arrivals()), reference)
    cached: dict[str, int] = {}
    engine2_tokens: Run = {}
    for i, p in enumerate(PROMPTS):  # the same prompts again, one by one, in the same engine
        rid = f"g{i}"
        engine.add_request(p, GREEDY, rid)
        engine2_tokens[rid] = []
        while engine.has_unfinished():
            for out in engine.step():
                engine2_tokens[rid] += [(lp.token_id, lp.logprob) for lp in out.logprobs]
                cached[rid] = out.num_cached_tokens
    check(engine2_tokens, reference)
    long_prompts = [f"g{i}" for i, p in enumerate(PROMPTS) if len(p) > 16]
    assert all(cached[rid] > 0 for rid in long_prompts)
    assert engine.scheduler.stats().num_cached_blocks > 0
    assert_pool_clean(engine)


def test_tiny_kv_pool_preempts_and_stays_exact(tiny_moe, reference) -> None:
    longest = max(len(p) for p in PROMPTS) + MAX_TOKENS
    engine = make_engine(tiny_moe, chunk=32, num_blocks=-(-longest // 16) + 2)
    check(run(engine, greedy_arrivals()), reference)
    assert engine.scheduler.num_preemptions > 0
    assert_pool_clean(engine)


def test_layer_primitives_are_batch_invariant() -> None:
    """What the engine-level runs rest on, on shapes where CPU kernels do take other paths:
    a row's linear output and an element's SiLU are the same bits at any batch position."""
    import torch

    from moestream.layers.linear import linear
    from moestream.layers.mlp import silu
    from moestream.weights.qtensor import QTensor

    g = torch.Generator().manual_seed(0)
    w = QTensor.from_float(torch.randn(96, 64, generator=g))
    x = torch.randn(37, 64, generator=g)
    full = linear(x, w)
    for lo, hi in ((0, 1), (3, 5), (8, 16), (5, 37)):
        assert torch.equal(linear(x[lo:hi], w), full[lo:hi])
    h = torch.randn(7 * 600, generator=g) * 4
    pieces = torch.cat([silu(h[i : i + 7]) for i in range(0, h.numel(), 7)])  # tails
    assert torch.equal(silu(h), pieces)

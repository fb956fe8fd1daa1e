"""The engine end to end on a tiny random Qwen3-MoE: stop strings and stop tokens, max_tokens,
seeds, logprobs, aborts, admission errors, and the commit path's use of the scheduler's tokens."""

from __future__ import annotations

import random

import pytest
import torch

from moestream.config import CacheConfig, SchedConfig
from moestream.engine import Engine
from moestream.errors import CapacityError, RequestError
from moestream.layers.attention import AttentionMetadata
from moestream.runner.model_runner import RunnerOutput
from moestream.tokenizer import StreamDecoder
from moestream.types import SamplingParams

rng = random.Random(0)
PROMPT = [rng.randrange(3, 4096) for _ in range(37)]
LONG_PROMPT = [rng.randrange(3, 4096) for _ in range(70)]


def make_engine(tiny_moe, chunk: int = 256, num_blocks: int | None = None) -> Engine:
    model, tokenizer = tiny_moe
    c = model.config
    gib = None
    if num_blocks is not None:
        gib = (num_blocks + 0.5) * 2 * c.n_layers * 16 * c.n_kv_heads * c.head_dim * 4 / 2**30
    return Engine(
        model,
        tokenizer,
        CacheConfig(block_size=16, kv_cache_gib=gib),
        SchedConfig(max_num_batched_tokens=chunk, max_model_len=512),
    )


def run_all(engine: Engine) -> dict[str, list]:
    """Step until done; every output of every request, in order."""
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def generate(engine: Engine, prompt: list[int], params: SamplingParams, rid: str = "a") -> list:
    engine.add_request(prompt, params, rid)
    return run_all(engine)[rid]


def tokens_of(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def assert_pool_clean(engine: Engine) -> None:
    alloc = engine.scheduler.allocator
    alloc.check_invariants()
    assert alloc.num_used == 0 and alloc.num_free == alloc.num_blocks


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    dec = StreamDecoder(tokenizer)
    return [dec.feed(t) for t in ids]


@pytest.fixture(scope="module")
def greedy_ref(tiny_moe):
    """(token ids, text) of PROMPT, greedy, 24 tokens, no stop."""
    engine = make_engine(tiny_moe)
    outs = generate(engine, PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert outs[-1].finish_reason == "length"
    ids = tokens_of(outs)
    assert len(ids) == 24 and outs[-1].text == "".join(token_texts(tiny_moe[1], ids))
    return ids, outs[-1].text


# ---- stop strings, stop tokens, max_tokens ---------------------------------------------------
def test_stop_string_across_tokens_is_cut_and_never_streamed(tiny_moe, greedy_ref) -> None:
    ids, text = greedy_ref
    pieces = token_texts(tiny_moe[1], ids)
    # a boundary after which two tokens each add at least 2 characters: stop spans them
    j = next(j for j in range(3, 20) if len(pieces[j - 1]) >= 2 and len(pieces[j]) >= 2)
    boundary = sum(len(p) for p in pieces[:j])
    stop = text[boundary - 2 : boundary + 2]
    cut = text.find(stop)
    engine = make_engine(tiny_moe)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop, "\x00@@"])
    outs = generate(engine, PROMPT, params)
    last = outs[-1]
    assert last.finished and last.finish_reason == "stop" and last.stop_reason == stop
    assert last.text == text[:cut]
    assert "".join(o.delta_text for o in outs) == last.text  # nothing streamed then taken back
    got = tokens_of(outs)
    assert got == ids[: len(got)]  # the token completing the stop string is the last kept
    end = cut + len(stop)  # the stop string ends inside the last kept token's text
    assert len("".join(pieces[: len(got) - 1])) < end <= len("".join(pieces[: len(got)]))
    assert_pool_clean(engine)


def test_partial_stop_string_is_released_at_the_end(tiny_moe, greedy_ref) -> None:
    ids, text = greedy_ref
    stop = text[-2:] + "\x00never"  # the final text ends with a proper prefix of it
    engine = make_engine(tiny_moe)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    outs = generate(engine, PROMPT, params)
    assert outs[-1].finish_reason == "length" and outs[-1].text == text
    assert "".join(o.delta_text for o in outs) == text


def test_stop_token_id_ends_the_request_without_its_text(tiny_moe, greedy_ref) -> None:
    ids, _ = greedy_ref
    stop_id = ids[5]
    n = ids.index(stop_id) + 1
    engine = make_engine(tiny_moe)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id])
    outs = generate(engine, PROMPT, params)
    assert tokens_of(outs) == ids[:n]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop_id
    assert outs[-1].text == "".join(token_texts(tiny_moe[1], ids[: n - 1]))
    assert "".join(o.delta_text for o in outs) == outs[-1].text
    assert_pool_clean(engine)


def test_max_tokens(tiny_moe, greedy_ref) -> None:
    engine = make_engine(tiny_moe)
    outs = generate(engine, PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert tokens_of(outs) == greedy_ref[0][:3] and outs[-1].finish_reason == "length"
    assert outs[-1].num_output_tokens == 3


def test_commit_takes_tokens_the_scheduler_kept(tiny_moe) -> None:
    """With drafts the scheduler stops at a stop token inside the sampled list; the engine must
    report what the request kept, not the raw samples."""
    engine = make_engine(tiny_moe)
    stop_id = 4000
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id])
    engine.add_request(PROMPT, params, "a")
    (first,) = engine.step()
    assert first.new_token_ids != [stop_id]
    engine.scheduler.get("a").draft_token_ids = [5, stop_id, 7]
    plan = engine.scheduler.schedule()
    assert plan.scheduled[0].draft_token_ids == [5, stop_id, 7]
    (out,) = engine._commit(plan, RunnerOutput(sampled={"a": [5, stop_id, 7, 9]}))
    assert out.new_token_ids == [5, stop_id] and out.finished and out.stop_reason == stop_id
    assert out.num_output_tokens == 3
    assert out.text == "".join(token_texts(tiny_moe[1], first.new_token_ids + [5]))
    assert_pool_clean(engine)


# ---- sampling: seeds and logprobs ------------------------------------------------------------
def test_seeded_sampling_same_alone_and_in_a_batch(tiny_moe) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=1234, ignore_eos=True)
    alone = tokens_of(generate(make_engine(tiny_moe), PROMPT, params))
    engine = make_engine(tiny_moe, chunk=32)
    engine.add_request(LONG_PROMPT, SamplingParams(temperature=1.0, max_tokens=9), "x")
    engine.step()
    engine.add_request(PROMPT, params, "a")
    engine.add_request(PROMPT, SamplingParams(temperature=0.9, max_tokens=12, seed=99), "b")
    outs = run_all(engine)
    assert tokens_of(outs["a"]) == alone
    assert tokens_of(outs["b"]) != alone  # another seed, another text
    assert_pool_clean(engine)


def test_logprobs_and_top_logprobs(tiny_moe, greedy_ref) -> None:
    model, _ = tiny_moe
    engine = make_engine(tiny_moe)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    engine.add_request(PROMPT, params, "a")
    engine.add_request(PROMPT[:20], SamplingParams(temperature=0, max_tokens=4, logprobs=0), "b")
    engine.add_request(PROMPT[:25], SamplingParams(temperature=0, max_tokens=4), "c")
    outs = run_all(engine)
    lps = [lp for o in outs["a"] for lp in o.logprobs]
    ids = tokens_of(outs["a"])
    assert [lp.token_id for lp in lps] == ids == greedy_ref[0][:4]
    # the logprob of each token equals log_softmax of a one-shot forward, bit for bit
    seq = PROMPT + ids
    kv = model.make_kv_cache(8, 16)
    attn = AttentionMetadata.build([(0, len(seq), list(range(8)))], 16, "cpu")
    with torch.inference_mode():
        hidden = model.forward(torch.tensor(seq), torch.arange(len(seq)), attn, kv)
        ref = torch.log_softmax(model.compute_logits(hidden), dim=-1)  # [T, V]
    for i, lp in enumerate(lps):
        row = ref[len(PROMPT) - 1 + i]
        assert lp.logprob == row[lp.token_id].item()
        assert len(lp.top) == 3 and lp.top[0] == (lp.token_id, lp.logprob)  # greedy: the best
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    b = [lp for o in outs["b"] for lp in o.logprobs]
    assert len(b) == len(tokens_of(outs["b"])) and all(lp.top == [] for lp in b)
    assert all(o.logprobs == [] for o in outs["c"])


# ---- aborts and memory -----------------------------------------------------------------------
def test_abort_mid_prefill_and_mid_decode_frees_blocks(tiny_moe) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = tokens_of(generate(make_engine(tiny_moe), PROMPT, greedy, "ref"))
    engine = make_engine(tiny_moe, chunk=16)
    engine.add_request(LONG_PROMPT, greedy, "prefilling")
    engine.add_request(PROMPT, greedy, "kept")
    engine.add_request(LONG_PROMPT[:50], greedy, "decoding")
    engine.add_request(PROMPT[:9], greedy, "waiting")
    engine.abort("waiting")
    outs: dict[str, list] = {}
    for _ in range(2):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    long_req = engine.scheduler.get("prefilling")
    assert 0 < long_req.num_computed_tokens < len(LONG_PROMPT) and long_req.block_ids
    engine.abort("prefilling")
    while "decoding" not in outs or len(tokens_of(outs["decoding"])) < 2:
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert not outs["decoding"][-1].finished
    engine.abort("decoding")
    engine.abort("no-such-request")
    used = engine.scheduler.allocator.num_used
    assert used == len(engine.scheduler.get("kept").block_ids) > 0
    for rid, more in run_all(engine).items():
        outs.setdefault(rid, []).extend(more)
    assert set(outs) <= {"kept", "decoding"}
    assert tokens_of(outs["kept"]) == ref
    assert_pool_clean(engine)


def test_admission_errors_name_the_numbers(tiny_moe) -> None:
    engine = make_engine(tiny_moe)
    with pytest.raises(RequestError, match=r"600 tokens.*512"):
        engine.add_request([5] * 600, SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(RequestError, match="4096"):
        engine.add_request([1, 4096], SamplingParams())
    small = make_engine(tiny_moe, num_blocks=4)
    with pytest.raises(CapacityError, match=r"100 tokens.*needs 7 KV blocks.*only 4"):
        small.add_request([5] * 100, SamplingParams(max_tokens=10))
    assert not small.has_unfinished() and not engine.has_unfinished()
    model, tokenizer = tiny_moe
    with pytest.raises(CapacityError, match="holds no block"):
        Engine(model, tokenizer, CacheConfig(kv_cache_gib=1e-9))


def test_full_pool_makes_requests_wait(tiny_moe) -> None:
    """Two requests that cannot both hold their blocks: the second waits, both complete."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    refs = [tokens_of(generate(make_engine(tiny_moe), p, greedy)) for p in (PROMPT, LONG_PROMPT)]
    engine = make_engine(tiny_moe, num_blocks=6)  # 96 slots; the two need 3 + 5 blocks
    engine.add_request(LONG_PROMPT, greedy, "long")
    engine.add_request(PROMPT, greedy, "short")
    waited = False
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        waited |= engine.scheduler.stats().num_waiting > 0
    assert waited
    assert [tokens_of(outs["short"]), tokens_of(outs["long"])] == refs
    assert_pool_clean(engine)

"""`LLM` (generate / stream / logits) on the embedded demo GGUF (tiny Qwen3-MoE, Q4_K_M): the
quantized path, real text, and the engine underneath."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from moestream.cli import DEMO_MODEL
from moestream.errors import RequestError
from moestream.llm import LLM
from moestream.types import SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):",
    "# sort a list of numbers\ndef sort(xs):",
]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm() -> LLM:
    if not DEMO_MODEL.is_file():
        pytest.skip(f"demo model {DEMO_MODEL} is not in this checkout")
    return LLM(DEMO_MODEL, device="cpu", max_model_len=256, max_num_batched_tokens=64)


def lp_pairs(out) -> list[tuple[int, float]]:
    return [(lp.token_id, lp.logprob) for lp in out.logprobs]


def assert_pool_clean(llm: LLM) -> None:
    alloc = llm.engine.scheduler.allocator
    alloc.check_invariants()
    assert alloc.num_used == 0 and not llm.engine.has_unfinished()


def test_generate_runs_prompts_together_with_alone_results(llm: LLM) -> None:
    alone = [llm.generate(p, GREEDY)[0] for p in PROMPTS]
    sizes: list[int] = []
    execute = llm.engine.runner.execute

    def spy(plan):
        sizes.append(len(plan.scheduled))
        return execute(plan)

    llm.engine.runner.execute = spy
    try:
        together = llm.generate(PROMPTS, GREEDY)
    finally:
        del llm.engine.runner.execute
    assert max(sizes) == len(PROMPTS)  # one step ran every prompt
    assert len(sizes) < sum(len(o.token_ids) for o in together)
    for a, b, p in zip(alone, together, PROMPTS, strict=True):
        assert b.prompt == p and b.prompt_token_ids == llm.tokenizer.encode(p)
        assert b.text == a.text and b.token_ids == a.token_ids and len(b.token_ids) == 8
        assert lp_pairs(b) == lp_pairs(a)  # bit for bit, on the quantized path
        assert b.finish_reason == "length"
    assert_pool_clean(llm)


def test_logits_equal_the_rows_generate_sampled_from(llm: LLM) -> None:
    seen: list[torch.Tensor] = []
    compute = llm.model.compute_logits

    def spy(hidden):
        out = compute(hidden)
        seen.append(out.clone())
        return out

    llm.model.compute_logits = spy
    try:
        (out,) = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6))
    finally:
        del llm.model.compute_logits
    ids = out.prompt_token_ids + out.token_ids
    full = llm.logits(ids[:-1])  # [T, V]
    n = len(out.prompt_token_ids)
    assert full.shape == (len(ids) - 1, llm.config.vocab_size)
    assert len(seen) == len(out.token_ids)
    for i, row in enumerate(seen):
        assert torch.equal(full[n - 1 + i], row[0])
        assert int(row[0].argmax()) == out.token_ids[i]


def test_stream_deltas_stop_string_and_early_close(llm: LLM) -> None:
    (ref,) = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16))
    stop = ref.text[6:9]
    params = SamplingParams(temperature=0, max_tokens=16, stop=[stop])
    chunks = list(llm.stream(PROMPTS[0], params))
    final = chunks[-1]
    assert final.finished and final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == ref.text[: ref.text.find(stop)]
    assert "".join(c.delta_text for c in chunks) == final.text
    assert all(c.new_token_ids for c in chunks)
    assert_pool_clean(llm)
    stream = llm.stream(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16))
    next(stream)
    assert llm.engine.scheduler.allocator.num_used > 0
    stream.close()  # the request is aborted and its blocks come back
    assert_pool_clean(llm)


def test_prefix_cache_hit_and_seeded_sampling(llm: LLM) -> None:
    prompt = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    params = SamplingParams(temperature=0.8, max_tokens=8, seed=3)
    first = llm.generate(prompt, params)[0]
    second = llm.generate([prompt, PROMPTS[2]], params)[0]
    assert second.num_cached_tokens > 0 and second.text == first.text
    assert_pool_clean(llm)


def test_bad_arguments(llm: LLM) -> None:
    with pytest.raises(RequestError, match="one SamplingParams per prompt"):
        llm.generate(PROMPTS, [GREEDY])
    with pytest.raises(RequestError, match="256"):
        llm.generate(["x " * 300], GREEDY)
    with pytest.raises(RequestError, match="empty"):
        llm.logits([])
    with pytest.raises(RequestError, match="num_threads"):
        LLM(DEMO_MODEL, num_threads=0)
    assert_pool_clean(llm)


def test_deterministic_reaches_the_model_and_changes_nothing_on_cpu(llm: LLM) -> None:
    """`deterministic` switches the model to batch-invariant kernels (GPU); the CPU reference
    is invariant already, so its output is the same bits."""
    det = LLM(
        DEMO_MODEL, device="cpu", max_model_len=256, max_num_batched_tokens=64, deterministic=True
    )
    assert det.model.batch_invariant and not llm.model.batch_invariant
    for a, b in zip(det.generate(PROMPTS[:2], GREEDY), llm.generate(PROMPTS[:2], GREEDY)):
        assert a.token_ids == b.token_ids and lp_pairs(a) == lp_pairs(b)


def test_cli_deterministic_flag() -> None:
    from moestream.cli import build_parser, llm_kwargs_from_args

    args = build_parser().parse_args(["generate", "--deterministic", "-p", "hi"])
    assert llm_kwargs_from_args(args)["deterministic"] is True
    args = build_parser().parse_args(["generate", "-p", "hi"])
    assert llm_kwargs_from_args(args)["deterministic"] is False

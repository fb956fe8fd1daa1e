"""Experts computed by the host's cores on a CUDA device (`experts.host_compute`): the host
functions run inside the decode steps' CUDA graphs, and the text and logprobs do not depend on
the placement (device share, host-computed share, promotions every 4 steps)."""

from __future__ import annotations

import pytest
import torch

from moestream.cli import DEMO_MODEL
from moestream.llm import LLM
from moestream.types import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["def fibonacci(n):", "The history of the city", "import numpy as np\n"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)


def hybrid(gpu_share: float, cpu_fraction: float, layer_bytes: int, layers: int) -> LLM:
    return LLM(
        DEMO_MODEL, device="cuda", max_model_len=256, kv_cache_gib=0.25,
        gpu_expert_cache_gib=gpu_share * layer_bytes * layers / 2**30 + 1e-9,
        host_expert_cache_gib=1.0, expert_zero_copy=True, expert_cpu_fraction=cpu_fraction,
        expert_rebalance_steps=4,
    )  # fmt: skip


def demo_sizes() -> tuple[int, int]:
    """(bytes of one layer's experts, MoE layers) of the demo model; skips the test where the
    native experts cannot be built."""
    from moestream import native

    try:
        native.library()
    except native.NativeUnavailable as exc:
        pytest.skip(f"native experts unavailable: {exc}")
    probe = hybrid(0.0, 0.0, 0, 1)
    return probe.zero_copy[0].nbytes["host"], len(probe.zero_copy)


def test_host_computed_experts_give_the_same_text_at_every_placement() -> None:
    layer_bytes, layers = demo_sizes()
    outs = []
    placements = ((0.5, 0.5), (0.25, 1.0), (0.0, 0.5))
    for gpu_share, cpu_fraction in placements:
        llm = hybrid(gpu_share, cpu_fraction, layer_bytes, layers)
        assert llm.engine.runner.graphs is not None and llm.model.supports_cuda_graphs
        got = [
            (list(o.token_ids), [lp.logprob for lp in o.logprobs])
            for o in llm.generate(PROMPTS, GREEDY)
        ]
        compute = llm.zero_copy[0].host_work.compute
        assert compute.counters["assignments"] > 0
        outs.append(got)
    for placement, got in zip(placements[1:], outs[1:]):
        assert got == outs[0], first_difference(placement, got, outs[0])


def first_difference(placement, got, want) -> str:
    """Where `got` (a placement's tokens and logprobs per prompt) first leaves `want`."""
    for p, ((tokens, lps), (want_tokens, want_lps)) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(zip(tokens, lps), zip(want_tokens, want_lps))):
            if a != b:
                return f"placement {placement}, prompt {p}, token {i}: {a} against {b}"
    return f"placement {placement}: lengths differ"


def test_prefill_stage_keeps_the_text() -> None:
    """A prompt long enough for the prefill stage (`experts.zero_copy.ExpertStage`): its
    forward reads the host tier from device memory with the same launch shape, so tokens and
    logprobs equal those of the same placement without the stage (host work and link alike)."""
    from moestream.experts.zero_copy import STAGE_MIN_TOKENS, zero_copy_snapshot

    layer_bytes, layers = demo_sizes()
    prompt = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 6
    for cpu_fraction in (0.5, 0.0):
        outs = []
        for stage in (False, True):
            llm = LLM(
                DEMO_MODEL, device="cuda", max_model_len=512, kv_cache_gib=0.25,
                gpu_expert_cache_gib=0.5 * layer_bytes * layers / 2**30,
                host_expert_cache_gib=1.0, expert_zero_copy=True,
                expert_cpu_fraction=cpu_fraction, expert_prefill_stage=stage,
            )  # fmt: skip
            assert len(llm.tokenizer.encode(prompt)) >= STAGE_MIN_TOKENS
            (out,) = llm.generate([prompt], GREEDY)
            outs.append((list(out.token_ids), [lp.logprob for lp in out.logprobs]))
            assert (zero_copy_snapshot(llm.zero_copy)["stage_copies"] > 0) == stage
        assert outs[1] == outs[0], first_difference((cpu_fraction, "stage"), outs[1:], outs[:1])


def test_poll_mode_keeps_the_text(monkeypatch) -> None:
    """Host experts answered by the native poller thread (`MOESTREAM_HOST_POLL=1`: the kernels
    post and wait in mapped memory, no CUDA host function) give the tokens and logprobs of the
    host-function path at the same placement."""
    layer_bytes, layers = demo_sizes()
    outs = []
    for poll in ("0", "1"):
        monkeypatch.setenv("MOESTREAM_HOST_POLL", poll)
        llm = hybrid(0.25, 1.0, layer_bytes, layers)
        assert llm.zero_copy[0].host_work.compute.poll == (poll == "1")
        outs.append([
            (list(o.token_ids), [lp.logprob for lp in o.logprobs])
            for o in llm.generate(PROMPTS, GREEDY)
        ])  # fmt: skip
        assert llm.zero_copy[0].host_work.compute.counters["assignments"] > 0
        del llm
    assert outs[1] == outs[0], first_difference("poll", outs[1], outs[0])

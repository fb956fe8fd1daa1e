"""A short Cline-style agent session (bench/agent_session.py, 5 turns, tiny prompts) replayed with
the `openai` client: each turn reuses every whole block it shares with an earlier prompt (also
when the client rewrote its last message), and every text equals a cold run of the same prompt on
a second server without a prefix cache."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

MODEL = "tiny"  # conftest's served name
MAX_TOKENS = 8


def _bench_module():
    path = Path(__file__).resolve().parents[2] / "bench" / "agent_session.py"
    spec = importlib.util.spec_from_file_location("moestream_bench_agent_session", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cold_app(model_path):
    """An app over a second engine of the same model with prefix caching off."""
    from moestream.llm import LLM
    from moestream.server.app import build_app
    from moestream.server.serving import ServerConfig

    llm = LLM(model_path, device="cpu", max_model_len=256, enable_prefix_caching=False)
    return lambda: build_app(llm, ServerConfig(model_names=[MODEL]))


def test_reusable_tokens():
    bench = _bench_module()
    a = list(range(40))
    assert bench.reusable_tokens(a, [], 16) == 0
    assert bench.reusable_tokens(a, [a[:35] + [99]], 16) == 32
    assert bench.reusable_tokens(a, [a, a[:20]], 16) == 32  # never the last token
    assert bench.reusable_tokens(a[:33], [a], 16) == 32


def test_agent_session_reuse_and_exactness(live, live_server, cold_app, llm, engine_idle):
    bench = _bench_module()
    session = bench.build_session(small=True)
    actions = [t["action"] for t in session]
    assert len(session) == 5 and sum(a.startswith("rewrite last") for a in actions) == 2
    with live_server(cold_app()) as cold:
        results = bench.replay(live.url, cold.url, session, max_tokens=MAX_TOKENS)
    print("\n" + bench.table(results))
    assert bench.problems(results) == []
    for r, turn in zip(results, session):
        assert r.identical and r.text, r
        assert r.cached_tokens == r.reusable_tokens, r  # every shared whole block, no more
        assert r.cold_cached_tokens == 0
        if turn["action"].startswith("rewrite last"):
            # Everything before the rewritten message is reused: count its tokens.
            before = llm.tokenizer.apply_chat_template(turn["messages"][:-1])
            n_before = len(llm.tokenizer.encode(before, add_special_tokens=False))
            assert r.cached_tokens >= n_before // bench.BLOCK_SIZE * bench.BLOCK_SIZE > 0
    assert results[0].cached_tokens == 0 and all(r.cached_tokens > 0 for r in results[1:])
    assert engine_idle(llm)

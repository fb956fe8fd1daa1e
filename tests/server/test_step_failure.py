"""A MoestreamError raised inside a forward (an ExpertReadError: the model file failed under us)
fails the requests in that step with a 500 (a streamed one with an error event) and nothing
else: the engine thread lives on, a queued request and later ones run and give the same text as
a cold engine, the failed step leaves no KV block held and registers none in the prefix cache."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from moestream.experts.disk import ExpertReadError
from moestream.types import SamplingParams

MODEL = "tiny"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cold_llm(model_path):
    """A second engine over the same model with no prefix cache: the reference texts."""
    from moestream.llm import LLM

    return LLM(model_path, device="cpu", max_model_len=256, enable_prefix_caching=False)


def _complete(url: str, prompt: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def _read_error() -> ExpertReadError:
    return ExpertReadError("model.gguf: layer 1 expert 3 ffn_down_exps: short read (injected)")


@pytest.mark.parametrize("when", ["before", "after"])
def test_failed_step_fails_its_requests_only(
    when, llm, cold_llm, app_factory, live_server, engine_idle, monkeypatch
):
    # A prompt no other test sends: its blocks can only be in the cache if this test put them
    # there. Several full blocks (block size 16).
    prompt = f"# probe {when}: a failing step\n" + "def add(a, b):\n    return a + b\n" * 6
    (expected,) = cold_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))

    runner = llm.engine.runner
    real_execute = runner.execute
    entered, release = threading.Event(), threading.Event()
    calls = []

    def execute(plan):
        calls.append(plan)
        if len(calls) > 1:
            return real_execute(plan)
        entered.set()
        assert release.wait(30)
        if when == "after":  # the forward ran and wrote K/V, then the step failed
            real_execute(plan)
        raise _read_error()

    monkeypatch.setattr(runner, "execute", execute)
    app = app_factory(max_concurrency=1)
    aengine = app.state.moestream.aengine
    with live_server(app) as live:
        responses: dict[str, httpx.Response] = {}

        def send(name: str) -> None:
            responses[name] = _complete(live.url, prompt)

        in_flight = threading.Thread(target=send, args=("in_flight",))
        in_flight.start()
        assert entered.wait(30), "the first step never ran"
        queued = threading.Thread(target=send, args=("queued",))
        queued.start()
        deadline = time.monotonic() + 30
        while aengine.num_queued < 1:  # the second request waits for the only slot
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.01)
        release.set()
        in_flight.join(60)
        queued.join(60)

        failed = responses["in_flight"]
        assert failed.status_code == 500, failed.text
        error = failed.json()["error"]
        assert error["type"] == "server_error"
        assert "ExpertReadError" in error["message"] and "ffn_down_exps" in error["message"]

        ok = responses["queued"]
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["text"] == expected.text
        # The failed step committed nothing: no block of it was registered for reuse.
        assert ok.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        later = _complete(live.url, prompt)
        assert later.status_code == 200, later.text
        assert later.json()["choices"][0]["text"] == expected.text
        assert later.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert aengine.is_running and aengine.error is None
        assert httpx.get(f"{live.url}/health").status_code == 200
        assert engine_idle(llm), "the failed step left requests or blocks behind"
    assert len(calls) > 2


def test_prompt_logprobs_read_error_is_500_then_recovers(client, monkeypatch):
    """The echo + logprobs forward runs in the engine thread through AsyncEngine.call."""
    import moestream.server.completions as completions

    real = completions.prompt_logprobs
    calls = []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise _read_error()
        return real(*args, **kwargs)

    monkeypatch.setattr(completions, "prompt_logprobs", failing_once)
    body = {"model": MODEL, "prompt": "import os\n", "max_tokens": 0, "echo": True, "logprobs": 1}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "ExpertReadError"
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert client.get("/health").status_code == 200


def test_streamed_request_gets_an_error_event(client, llm, engine_idle, monkeypatch):
    runner = llm.engine.runner
    real_execute = runner.execute
    calls = []

    def execute(plan):
        calls.append(plan)
        if len(calls) == 2:  # after the first token went out
            raise _read_error()
        return real_execute(plan)

    monkeypatch.setattr(runner, "execute", execute)
    body = {"model": MODEL, "prompt": "import sys\n", "max_tokens": MAX_TOKENS, "temperature": 0}
    with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert "choices" in events[0]  # the first token was streamed before the failure
    assert events[-1]["error"]["type"] == "server_error"
    assert "ExpertReadError" in events[-1]["error"]["message"]
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    assert engine_idle(llm)

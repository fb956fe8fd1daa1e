"""The server on a real loopback socket (uvicorn, random free port) driven by the official
`openai` client and raw httpx: chat, streaming, completions, logprobs, JSON schema, tool calls,
error classes, 429 when full, abort on disconnect, 32 concurrent streams, graceful shutdown,
and a small soak (bench/soak.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}


def sdk(live, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=kw.pop("api_key", "none"), **kw)


def user(text: str = "Hello there") -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_stream_completions_logprobs(live):
    client = sdk(live)
    assert [m.id for m in client.models.list()] == [MODEL]
    r = client.chat.completions.create(
        model=MODEL, messages=user(), max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == len(r.choices[0].logprobs.content)
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=user(), max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    c = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=5, logprobs=1)
    assert len(c.choices[0].logprobs.tokens) == c.usage.completion_tokens
    assert all(len(t) >= 1 for t in c.choices[0].logprobs.top_logprobs)


def test_json_schema_answer_validates(live):
    client = sdk(live)
    r = client.chat.completions.create(
        model=MODEL, messages=user("Weather plan as JSON"), max_tokens=60, temperature=1.0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "plan", "schema": SCHEMA, "strict": True}},
    )  # fmt: skip
    plan = json.loads(r.choices[0].message.content)
    assert plan["city"] in ("Paris", "Rome", "Oslo") and 1 <= plan["days"] <= 7
    assert set(plan) == {"city", "days"}


def test_tool_calls_with_the_sdk(live):
    client = sdk(live)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=MODEL, messages=user("Weather in Oslo?"), tools=[WEATHER], tool_choice=choice,
        max_tokens=60,
    )  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city", "days"}
    # the call goes back to the model as history, with its result
    follow = user("Weather in Oslo?") + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    again = client.chat.completions.create(model=MODEL, messages=follow, max_tokens=3)
    assert again.choices[0].message.role == "assistant"
    args, name = "", None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=user(),
        tools=[WEATHER],
        tool_choice=choice,
        max_tokens=60,
        stream=True,
    ):
        for piece in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            name = piece.function.name or name
            args += piece.function.arguments or ""
    assert name == "get_weather" and set(json.loads(args)) == {"city", "days"}


def test_error_classes_through_the_sdk(live):
    client = sdk(live, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=user(), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=MODEL, messages=user("x " * 600), max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=user(), temperature=-3)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)


def held_stream(live, body: dict):
    """Open a streamed request and read its first event; returns (client, response, lines).
    Keep `lines` alive: closing that iterator closes the connection."""
    http = httpx.Client(base_url=live.url, timeout=30)
    r = http.send(http.build_request("POST", "/v1/chat/completions", json=body), stream=True)
    lines = r.iter_lines()
    assert next(lines).startswith("data: ")
    return http, r, lines


LONG = {"model": MODEL, "messages": user(), "max_tokens": 200, "ignore_eos": True, "stream": True}


def test_disconnect_aborts_and_frees_blocks(live, llm, engine_idle):
    http, r, _lines = held_stream(live, LONG)
    assert llm.engine.scheduler.stats().num_used_blocks > 0
    r.close()
    http.close()  # the client goes away mid-stream
    assert engine_idle(llm, timeout=10), "the request was not aborted"
    # a non-streamed request whose client times out is aborted too
    with (
        httpx.Client(base_url=live.url, timeout=0.3) as quick,
        pytest.raises(httpx.TimeoutException),
    ):
        quick.post("/v1/chat/completions", json=LONG | {"stream": False})
    assert engine_idle(llm, timeout=10)
    metrics = httpx.get(f"{live.url}/metrics").text
    assert 'moestream_request_success_total{finish_reason="abort"} 2.0' in metrics


def test_32_concurrent_streams(live, llm, engine_idle):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=user(f"request {i}"), max_tokens=8, temperature=0.8, seed=i,
            stream=True,
        )  # fmt: skip
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="x") as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(run())
    assert len(results) == 32 and all(finish in ("stop", "length") for _, finish in results)
    assert sum(bool(text) for text, _ in results) >= 28
    assert engine_idle(llm)


def test_queue_full_429(app_factory, live_server):
    with live_server(app_factory(max_concurrency=1, max_queue=0)) as live:
        http, held, _lines = held_stream(live, LONG)
        r = httpx.post(f"{live.url}/v1/chat/completions", json=LONG | {"stream": False})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        held.close()
        http.close()


def test_key_and_size_limits_on_the_socket(app_factory, live_server):
    with live_server(app_factory(api_key="sekret", max_request_bytes=4096)) as live:
        with pytest.raises(openai.AuthenticationError):
            sdk(live, max_retries=0).models.list()
        client = sdk(live, api_key="sekret", max_retries=0)
        assert client.models.list().data[0].id == MODEL
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model=MODEL, messages=user("y" * 8000), max_tokens=2)
        assert e.value.status_code == 413


def stream_during_shutdown(live, body: dict) -> list[str]:
    """Stream `body`, stop the server once the first event is in, return all events read."""
    events: list[str] = []

    def consume() -> None:
        try:
            with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body) as r:
                events.extend(line for line in r.iter_lines() if line)
        except httpx.HTTPError as e:  # the server cut the stream
            events.append(f"cut: {type(e).__name__}")

    reader = threading.Thread(target=consume)
    reader.start()
    deadline = time.monotonic() + 30
    while not events and time.monotonic() < deadline:
        time.sleep(0.005)
    live.stop()
    reader.join(timeout=30)
    assert not live.thread.is_alive() and not reader.is_alive()
    return events


def test_graceful_shutdown(app_factory, live_server, llm, engine_idle):
    # in-flight requests finish within the grace period ...
    body = {"model": MODEL, "messages": user(), "max_tokens": 30, "ignore_eos": True}
    with live_server(app_factory(), graceful_s=20) as live:
        events = stream_during_shutdown(live, body | {"stream": True})
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in events[-2]  # all 30 tokens came
    # ... past it they are aborted, and the engine is left clean
    with live_server(app_factory(), graceful_s=0.3) as live:
        events = stream_during_shutdown(live, LONG | {"max_tokens": 250})
    assert events[-1] != "data: [DONE]"
    assert engine_idle(llm)


def test_small_soak(live, llm, engine_idle):
    path = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
    spec = importlib.util.spec_from_file_location("moestream_bench_soak", path)
    soak = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = soak  # its dataclasses look their module up
    spec.loader.exec_module(soak)
    result = asyncio.run(
        soak.run_soak(live.url, MODEL, requests=50, concurrency=16, abort_fraction=0.1,
                      max_tokens=8, max_words=16, seed=1)
    )  # fmt: skip
    summary = result.summary()
    assert result.server_errors == 0 and not result.failures, summary
    assert result.completed + result.aborted == 50 and result.aborted >= 1
    assert summary["ttft_s"]["n"] > 0 and summary["e2e_s"]["p50"] > 0
    assert engine_idle(llm)
    after = soak.wait_idle(live.url)
    assert after["moestream_kv_blocks_used"] == 0 and after["process_resident_memory_bytes"] > 0

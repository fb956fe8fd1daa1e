"""The HTTP server in-process (FastAPI TestClient): schema, streaming, completions with echo and
prompt logprobs, every error class with its status, limits, metrics, tokenizer endpoints."""

from __future__ import annotations

import json
import math

import pytest
import torch
from fastapi.testclient import TestClient

MODEL_NAME = "tiny"  # conftest's served name
MAX_MODEL_LEN = 256  # conftest's context limit

MESSAGES = [{"role": "user", "content": "Write a Python function that adds two numbers."}]


def chat(client, **kw):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    return client.post("/v1/chat/completions", json=body | kw)


def sse_events(client, path: str, body: dict) -> list:
    """The JSON events of a streamed response; asserts it ends with [DONE]."""
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def test_models_and_health(client):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == MODEL_NAME
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_chat_completion_schema_and_usage(client, llm):
    r = chat(client, logprobs=True, top_logprobs=3)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    prompt = llm.tokenizer.apply_chat_template(MESSAGES)
    n_prompt = len(llm.tokenizer.encode(prompt, add_special_tokens=False))
    usage = body["usage"]
    assert usage["prompt_tokens"] == n_prompt
    assert usage["total_tokens"] == n_prompt + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0
    lps = choice["logprobs"]["content"]
    assert len(lps) == usage["completion_tokens"]
    for entry in lps:
        assert len(entry["top_logprobs"]) == 3
        # greedy: the chosen token is the most likely one
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-5)
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
    if choice["finish_reason"] == "length":
        assert "".join(e["token"] for e in lps) == choice["message"]["content"]


def test_streaming_matches_non_streaming(client):
    full = chat(client, max_tokens=10).json()
    events = sse_events(
        client,
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 10, "temperature": 0,
         "stream": True, "stream_options": {"include_usage": True}},
    )  # fmt: skip
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == full["choices"][0]["message"]["content"]
    finishes = [e["choices"][0].get("finish_reason") for e in events if e["choices"]]
    assert finishes[-1] == full["choices"][0]["finish_reason"]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == full["usage"] | {
        "prompt_tokens_details": events[-1]["usage"]["prompt_tokens_details"]
    }


def test_prefix_cache_hits_show_in_usage(client):
    long = [{"role": "user", "content": "def add(a, b):\n    return a + b\n" * 6}]
    chat(client, messages=long, max_tokens=2)
    second = chat(client, messages=long, max_tokens=2).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16


def test_stop_string_and_stop_token(client, llm):
    full = chat(client, max_tokens=12).json()["choices"][0]["message"]["content"]
    assert len(full) > 4
    stop = full[2:4]
    cut = chat(client, max_tokens=12, stop=[stop]).json()["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["message"]["content"] == full[: full.index(stop)]
    first = chat(client, max_tokens=3, logprobs=True).json()["choices"][0]
    first_token = llm.tokenizer.token_to_id(first["logprobs"]["content"][0]["token"])
    if first_token is not None:  # a whole-token string: stop on that id; its text is left out
        r = chat(client, max_tokens=3, stop_token_ids=[first_token]).json()["choices"][0]
        assert r["finish_reason"] == "stop" and r["message"]["content"] == ""


def test_seed_and_n(client):
    a = chat(client, temperature=1.0, seed=7, max_tokens=8).json()["choices"][0]["message"]
    b = chat(client, temperature=1.0, seed=7, max_tokens=8).json()["choices"][0]["message"]
    assert a == b
    r = chat(client, temperature=1.0, seed=7, max_tokens=8, n=3).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["choices"][0]["message"] == a  # choice i uses seed + i
    assert 3 <= r["usage"]["completion_tokens"] <= 24


def test_completions_echo_with_prompt_logprobs(client, llm):
    prompt = "def add(a, b):\n    return"
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "logprobs": 2, "echo": True}  # fmt: skip
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    ids = llm.tokenizer.encode(prompt)
    lp = choice["logprobs"]
    assert choice["text"].startswith(prompt)
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"][: len(ids)] == [
        sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))
    ]
    # reference: log-softmax of the model's own logits over the prompt
    ref = torch.log_softmax(llm.logits(ids), dim=-1)
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        top = lp["top_logprobs"][i]
        assert max(top.values()) == pytest.approx(ref[i - 1].max().item(), abs=1e-4)
        assert lp["tokens"][i] in top
    # what lm-eval's local-completions reads: greedy continuation is the top-1
    last = lp["top_logprobs"][-1]
    assert lp["token_logprobs"][-1] == pytest.approx(max(last.values()), abs=1e-5)


def test_completions_batch_token_prompts_and_max_tokens_zero(client, llm):
    prompts = [llm.tokenizer.encode("import os"), llm.tokenizer.encode("class A:")]
    body = {"model": MODEL_NAME, "prompt": prompts, "max_tokens": 3, "n": 2, "seed": 1}
    r = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["usage"]["prompt_tokens"] == len(prompts[0]) + len(prompts[1])
    assert r["usage"]["completion_tokens"] <= 12
    echo = {"model": MODEL_NAME, "prompt": "x = 1", "max_tokens": 0, "echo": True, "logprobs": 0}
    r = client.post("/v1/completions", json=echo).json()
    assert r["choices"][0]["text"] == "x = 1" and r["usage"]["completion_tokens"] == 0
    events = sse_events(client, "/v1/completions", body | {"stream": True, "n": 1})
    assert {c["index"] for e in events for c in e["choices"]} == {0, 1}


def error_of(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_error_statuses(client):
    post = client.post
    r = post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    error_of(r, 400)
    assert error_of(chat(client, temperature=-1), 400)["param"] == "temperature"
    assert error_of(chat(client, top_p=0), 400)["param"] == "top_p"
    assert error_of(chat(client, n=0), 400)["param"] == "n"
    error_of(chat(client, top_logprobs=2), 400)
    error_of(post("/v1/chat/completions", json={"model": MODEL_NAME}), 400)
    error_of(post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": "hi"}), 400)
    err = error_of(chat(client, model="gpt-4"), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    long = [{"role": "user", "content": "word " * (MAX_MODEL_LEN * 2)}]
    err = error_of(chat(client, messages=long), 400)
    assert err["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in err["message"]
    err = error_of(chat(client, max_tokens=MAX_MODEL_LEN), 400)
    assert err["param"] == "max_tokens" and str(MAX_MODEL_LEN) in err["message"]
    bad_ids = {"model": MODEL_NAME, "prompt": [1, 10**9], "max_tokens": 1}
    error_of(post("/v1/completions", json=bad_ids), 400)
    error_of(client.get("/v1/nothing"), 404)
    error_of(client.post("/v1/models"), 405)
    assert client.get("/health").status_code == 200  # nothing above hurt the server


def test_body_limit_413(app_factory):
    with TestClient(app_factory(max_request_bytes=2000)) as c:
        big = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x" * 5000}]}
        error_of(c.post("/v1/chat/completions", json=big), 413)

        def chunked():  # no Content-Length: counted while it is read
            yield json.dumps(big).encode()

        r = c.post(
            "/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"}
        )
        error_of(r, 413)
        assert chat(c).status_code == 200


def test_api_key_401(app_factory):
    with TestClient(app_factory(api_key="sekret")) as c:
        error_of(chat(c), 401)
        error_of(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        ok = c.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200  # open, for load balancers


def test_tokenizer_endpoints(client, llm):
    r = client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert r["tokens"] == llm.tokenizer.encode("hello world")
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN
    assert "".join(r["token_strs"]) == "hello world"
    r2 = client.post("/tokenize", json={"messages": MESSAGES}).json()
    prompt = llm.tokenizer.apply_chat_template(MESSAGES)
    assert r2["tokens"] == llm.tokenizer.encode(prompt, add_special_tokens=False)
    back = client.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "hello world"}
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and "im_start" in info["chat_template"]
    error_of(client.post("/tokenize", json={}), 400)
    error_of(client.post("/detokenize", json={"tokens": [-1]}), 400)


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics(client):
    chat(client, max_tokens=4)
    chat(client, model="nope")
    m = parse_metrics(client.get("/metrics").text)
    assert m["moestream_generation_tokens_total"] >= 4
    assert m["moestream_prompt_tokens_total"] > 0
    assert m['moestream_http_requests_total{route="/v1/chat/completions",status="200"}'] >= 1
    assert m['moestream_http_requests_total{route="/v1/chat/completions",status="404"}'] >= 1
    assert m["moestream_time_to_first_token_seconds_count"] >= 1
    assert m["moestream_inter_token_latency_seconds_count"] >= 3
    assert m["moestream_kv_blocks_total"] > 0 and m["moestream_kv_blocks_used"] == 0
    for name in ("num_requests_running", "num_requests_waiting", "prefix_cache_hit_tokens_total"):
        assert f"moestream_{name}" in m
    assert not math.isnan(m["moestream_kv_cache_usage_ratio"])


def test_serve_flags_read_env(monkeypatch):
    from moestream.cli import build_parser

    monkeypatch.setenv("MOESTREAM_MAX_QUEUE", "7")
    monkeypatch.setenv("MOESTREAM_API_KEY", "k")
    args = build_parser().parse_args(["serve", "m.gguf", "--max-queue", "9"])
    assert args.max_queue == 9 and args.api_key == "k"  # the flag wins over the env
    assert args.host == "127.0.0.1"
    args = build_parser().parse_args(["serve", "m.gguf"])
    assert args.max_queue == 7 and args.timeout_graceful_shutdown == 30.0


def test_engine_failure_is_500_and_others_carry_on(client, llm, monkeypatch, engine_idle):
    real_step = llm.engine.step
    failures = []

    def step_failing_once():
        if not failures:
            failures.append(1)
            raise RuntimeError("kaboom")
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step_failing_once)
    err = error_of(chat(client), 500)
    assert "kaboom" in err["message"] and err["type"] == "server_error"
    assert engine_idle(llm)  # the failed request's blocks went back
    assert chat(client).status_code == 200
    assert client.get("/health").status_code == 200

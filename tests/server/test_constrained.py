"""Constrained decoding: the bitmask op, the logits processor on random logits, and grammars
enforced end to end through the server (the random model cannot produce valid JSON itself)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from moestream.errors import RequestError
from moestream.server.constrained import (
    ConstrainedLogits,
    GrammarCompiler,
    RequestConstraint,
    apply_token_bitmask,
    grammar_from_spec,
    json_schema_grammar,
)
from moestream.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "admin"],
    "additionalProperties": False,
}


def check_schema(obj: object) -> None:
    """SCHEMA, checked by hand (no jsonschema package here)."""
    assert isinstance(obj, dict) and set(obj) == {"name", "age", "tags", "admin"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 120
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3
    assert all(t in ("a", "b", "c") for t in obj["tags"])
    assert isinstance(obj["admin"], bool)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from pathlib import Path

    return Tokenizer.from_hf_dir(Path(__file__).parent.parent / "fixtures")


def test_apply_token_bitmask():
    logits = torch.zeros(2, 70)
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = 0b101  # tokens 0 and 2
    bitmask[1, 2] = 1 << 5  # token 69
    bitmask[1, 1] = -(2**31)  # bit 31 of word 1: token 63
    apply_token_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [63, 69]


def test_processor_samples_only_valid_json(tokenizer):
    """Random logits + the mask, sampled to the end, give JSON that validates."""
    vocab = tokenizer.vocab_size + 7  # a padded logits width, as models have
    compiler = GrammarCompiler(tokenizer, vocab)
    proc = ConstrainedLogits(compiler.mask_words, sorted(tokenizer.eos_token_ids))
    grammar = json_schema_grammar(SCHEMA)
    ids = [f"r{i}" for i in range(3)]
    for rid in ids:
        proc.add(rid, RequestConstraint(compiler.matcher(grammar, "schema"), bias={5: 3.0}))
    proc.add("free", RequestConstraint(bias={7: 100.0}))
    outputs: dict[str, list[int]] = {rid: [] for rid in ids + ["free"]}
    g = torch.Generator().manual_seed(0)
    eos = tokenizer.eos_token_ids
    for _ in range(200):
        live = [r for r, out in outputs.items() if not (out and out[-1] in eos) and len(out) < 200]
        if live == ["free"] or not live:
            break
        logits = torch.randn(len(live), vocab, generator=g) * 3
        logits = proc.apply(logits, live, [outputs[r] for r in live])
        assert torch.isfinite(logits).any(dim=1).all()
        guided = [i for i, r in enumerate(live) if r != "free"]
        assert torch.isinf(logits[guided, tokenizer.vocab_size :]).all()  # padded ids: never
        picks = torch.multinomial(logits.softmax(-1), 1, generator=g).flatten().tolist()
        for r, t in zip(live, picks):
            outputs[r].append(t)
    assert all(t == 7 for t in outputs["free"])  # bias +100 wins every draw
    for rid in ids:
        assert outputs[rid][-1] in eos, "the grammar must end with EOS"
        check_schema(json.loads(tokenizer.decode(outputs[rid][:-1])))


def test_matcher_rolls_back(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    c = RequestConstraint(compiler.matcher(grammar_from_spec("regex", "ab+c"), "regex"))
    a, b = tokenizer.encode("a", False), tokenizer.encode("b", False)
    c.sync(a + b + b)
    c.sync(a + b)  # shorter history, e.g. a rejected draft: roll back one token
    assert len(c.consumed) == len(a + b) and not c.matcher.is_error()
    c.sync(a + b + tokenizer.encode("c", False))
    assert c.matcher.is_accepting()


def test_bad_grammars_raise(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    with pytest.raises(RequestError, match="regex"):
        compiler.matcher(grammar_from_spec("regex", "[a-"), "regex")
    with pytest.raises(RequestError):
        compiler.matcher(json_schema_grammar({"type": "bogus"}), "schema")
    with pytest.raises(RequestError):
        grammar_from_spec("json_schema", "{not json")


# ---- end to end ---------------------------------------------------------------------------
def chat(client, **kw):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Describe a user as JSON."}],
        "max_tokens": 120,
        "temperature": 1.0,
    }
    return client.post("/v1/chat/completions", json=body | kw)


def test_json_schema_response_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}}
    r = chat(client, response_format=fmt, n=2, seed=11)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        check_schema(json.loads(choice["message"]["content"]))


def test_json_object_and_streaming(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA}}
    text = ""
    body = {
        "model": "tiny", "messages": [{"role": "user", "content": "JSON"}], "max_tokens": 120,
        "response_format": fmt, "stream": True, "seed": 5,
    }  # fmt: skip
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    text += ch["delta"].get("content") or ""
    check_schema(json.loads(text))
    r = chat(client, response_format={"type": "json_object"}, max_tokens=12, seed=1)
    content = r.json()["choices"][0]["message"]["content"]
    assert content.startswith("{")  # may be cut by max_tokens, but it is an object


@pytest.mark.parametrize(
    "grammar,pattern",
    [
        ({"type": "regex", "value": r"[0-9]{3}-[a-z]{2}"}, r"[0-9]{3}-[a-z]{2}"),
        ('start: "yes" | "no"', r"yes|no"),
        ({"type": "gbnf", "value": 'root ::= "x" [0-9] [0-9]'}, r"x[0-9]{2}"),
    ],
)
def test_grammar_field_on_completions(client, grammar, pattern):
    body = {"model": "tiny", "prompt": "Answer:", "max_tokens": 20, "grammar": grammar, "seed": 2}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert re.fullmatch(pattern, r.json()["choices"][0]["text"])


def test_invalid_constraints_are_400(client):
    r = chat(client, grammar={"type": "regex", "value": "[a-"})
    assert r.status_code == 400 and "regex" in r.json()["error"]["message"]
    r = chat(
        client, response_format={"type": "json_schema", "json_schema": {"schema": {"type": 3}}}
    )
    assert r.status_code == 400
    r = chat(client, response_format={"type": "json_schema"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    r = chat(client, logit_bias={"abc": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_logit_bias_forces_a_token(client):
    r = chat(client, logit_bias={"42": 100}, max_tokens=5, logprobs=True)
    lps = r.json()["choices"][0]["logprobs"]["content"]
    assert len(lps) == 5
    assert all(math.isfinite(t["logprob"]) for t in lps)
    text = r.json()["choices"][0]["message"]["content"]
    assert text == (r.json()["choices"][0]["logprobs"]["content"][0]["token"]) * 5

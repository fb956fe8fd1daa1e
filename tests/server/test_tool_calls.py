"""Tool-call parsing (Qwen/Hermes <tool_call> format) on crafted text, whole and streamed, and
tool_choice "required" end to end (a forced call is valid whatever the model; the named-function
case, streamed and not, is in test_openai_client.py)."""

from __future__ import annotations

import json

import pytest

from moestream.server.tool_calls import ToolCallParser, parse_tool_calls

TWO_CALLS = (
    "Let me check both.\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"a": "}"}]}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_time", "arguments": {}}\n'
    "</tool_call>"
)


def stream(text: str, step: int) -> tuple[str, dict[int, dict]]:
    """Feed `text` in pieces of `step` characters; merge the deltas like a client does."""
    parser = ToolCallParser()
    content = ""
    calls: dict[int, dict] = {}
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += delta.content
        for piece in delta.tool_calls:
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.name is not None:
                assert call["name"] is None, "name sent twice"
                call["id"], call["name"] = piece.id, piece.name
            else:
                assert call["name"] is not None, "arguments before the name"
            call["arguments"] += piece.arguments
    return content, calls


def test_parse_two_calls_with_content():
    content, calls = parse_tool_calls(TWO_CALLS)
    assert content == "Let me check both."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": [1, {"a": "}"}]}
    assert json.loads(calls[1].arguments) == {}
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


@pytest.mark.parametrize("step", [1, 2, 3, 5, 11, 1000])
def test_streaming_matches_whole_text(step):
    _, whole = parse_tool_calls(TWO_CALLS)
    content, calls = stream(TWO_CALLS, step)
    assert content.strip() == "Let me check both."
    assert "<" not in content  # no partial tag leaked into content
    assert [calls[i]["name"] for i in sorted(calls)] == [c.name for c in whole]
    assert [calls[i]["arguments"] for i in sorted(calls)] == [c.arguments for c in whole]


def test_name_streams_before_arguments_finish():
    parser = ToolCallParser()
    first = parser.feed('<tool_call>\n{"name": "f", "arguments": {"x": 1')
    assert [(p.name, p.arguments) for p in first.tool_calls] == [("f", '{"x": 1')]
    more = parser.feed(', "y": 2}')  # the "}" may close the call's object: held back
    assert [p.arguments for p in more.tool_calls] == [', "y": 2']
    rest = parser.feed("}\n</tool_call>")
    assert [p.arguments for p in rest.tool_calls] == ["}"]
    text = '{"x": 1' + "".join(p.arguments for d in (more, rest) for p in d.tool_calls)
    assert json.loads(text) == {"x": 1, "y": 2}


def test_plain_text_and_partial_tag():
    assert parse_tool_calls("no tools here") == ("no tools here", [])
    parser = ToolCallParser()
    assert parser.feed("a <tool").content == "a "  # might still become a tag
    assert parser.finish().content == "<tool"  # it did not


def test_invalid_call_falls_back_to_content():
    text = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(text) == (text, [])
    missing_name = '<tool_call>{"arguments": {}}</tool_call>'
    assert parse_tool_calls(missing_name) == (missing_name, [])


def test_arguments_first_and_unterminated_call():
    content, calls = parse_tool_calls('<tool_call>{"arguments": {"a": 1}, "name": "x"}</tool_call>')
    assert content is None and calls[0].name == "x" and json.loads(calls[0].arguments) == {"a": 1}
    content, calls = parse_tool_calls('<tool_call>\n{"name": "x", "arguments": {"a": 1}}')
    assert [c.name for c in calls] == ["x"] and json.loads(calls[0].arguments) == {"a": 1}


def test_text_after_calls_is_content_but_layout_is_not():
    content, calls = parse_tool_calls(TWO_CALLS + "\n\n")
    assert content == "Let me check both." and len(calls) == 2
    content, _ = parse_tool_calls(TWO_CALLS + "\nDone.")
    assert content.endswith("Done.")


# ---- end to end ---------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}  # fmt: skip


def check_weather_args(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "days"}
    assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7


def chat_body(**kw) -> dict:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER, CLOCK],
        "max_tokens": 80,
        "temperature": 1.0,
        "seed": 3,
    }
    return body | kw


def test_required_tool_choice_and_errors(client):
    body = chat_body(tool_choice="required", parallel_tool_calls=False)
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    if call["function"]["name"] == "get_weather":
        check_weather_args(call["function"]["arguments"])
    else:
        assert call["function"]["name"] == "get_time"
        assert json.loads(call["function"]["arguments"])["tz"] in ("UTC", "CET")
    bad = {"type": "function", "function": {"name": "nope"}}
    r = client.post("/v1/chat/completions", json=chat_body(tool_choice=bad))
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json=chat_body(tools=None, tool_choice="required"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"

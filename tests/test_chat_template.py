"""Chat templates rendered like `transformers`' apply_chat_template(..., tokenize=False)."""

from __future__ import annotations

import copy
import json
import shutil
from datetime import datetime
from pathlib import Path

import pytest

from moestream.chat_template import ChatTemplate
from moestream.errors import ModelFormatError, RequestError
from moestream.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"

# A compact Qwen3-style template: tools in the system turn, <think> blocks, <tool_call> JSON,
# tool responses folded into a user turn; uses namespace, tojson, loop controls, raise_exception.
QWEN3_STYLE_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions.\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nReturn calls as <tool_call>"
        + "{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if loop.first and message.role == "system" %}
        {%- continue %}
    {%- endif %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or message.role == "system" %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = message.reasoning_content
            if message.reasoning_content is string else '' %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n')
                + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if not loop.first or content %}{{- '\n' }}{%- endif %}
            {%- set call = tool_call.function if tool_call.function else tool_call %}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {{- call.arguments if call.arguments is string else call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo actuelle d'une ville (天気)",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Two cities, two calls.",
        "tool_calls": [
            {"type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": "{\"city\": \"東京\"}"}},
        ],
    },
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "tool", "content": "{\"temp\": 25}"},
    {"role": "assistant", "content": "Paris 21°C, Tokyo 25°C. 🌤"},
    {"role": "user", "content": "And tomorrow?"},
]  # fmt: skip


@pytest.fixture(scope="module")
def auto_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained


@pytest.fixture(scope="module")
def qwen3_style_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen3tmpl")
    shutil.copy(FIXTURES / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((FIXTURES / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3_STYLE_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_chatml_fixture_matches_transformers(auto_tokenizer):
    ours, hf = Tokenizer.from_hf_dir(FIXTURES), auto_tokenizer(FIXTURES)
    chat = [m for m in CHAT if isinstance(m["content"], str) and m["role"] != "tool"]
    for add_generation_prompt in (True, False):
        expected = hf.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.apply_chat_template(chat, add_generation_prompt) == expected
    assert expected.endswith("<|im_start|>user\nAnd tomorrow?<|im_end|>\n")


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
@pytest.mark.parametrize("with_tools", [True, False])
@pytest.mark.parametrize("n_messages", [len(CHAT), 5])  # 5: ends in tool results, mid-turn
def test_qwen3_style_template_with_tools_matches_transformers(
    qwen3_style_dir, auto_tokenizer, with_tools, kwargs, n_messages
):
    ours, hf = Tokenizer.from_hf_dir(qwen3_style_dir), auto_tokenizer(qwen3_style_dir)
    tools = TOOLS if with_tools else None
    chat = copy.deepcopy(CHAT[:n_messages])
    expected = hf.apply_chat_template(
        chat, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
    )
    got = ours.apply_chat_template(chat, add_generation_prompt=True, tools=tools, **kwargs)
    assert got == expected
    assert chat == CHAT[:n_messages]  # the caller's messages are untouched
    # reasoning is shown only for assistant turns after the last user query
    assert ("<think>\nTwo cities, two calls.\n</think>" in got) == (n_messages == 5)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in got
    assert ("Météo" in got) == with_tools  # tojson keeps non-ASCII text
    assert ours.eos_token_ids == {0, 2}  # <|im_end|> follows the assistant's text


def test_reasoning_alias_and_none_values():
    template = ChatTemplate(
        "{% for m in messages %}[{{ m.reasoning_content }}|{{ m.thinking }}|"
        "{{ 'content' in m }}]{% endfor %}"
    )
    out = template.render([{"role": "assistant", "content": None, "reasoning": "hmm"}])
    assert out == "[hmm|hmm|False]"


def test_tojson_options_match_transformers(auto_tokenizer):
    source = (
        "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|"
        "{{ messages[0] | tojson(separators=(',', ':'), sort_keys=true) }}|"
        "{{ messages[0] | tojson(ensure_ascii=true) }}"
    )
    chat = [{"role": "user", "content": "é <b>&</b> 🚀", "z": [1, 2]}]
    expected = auto_tokenizer(FIXTURES).apply_chat_template(
        chat, chat_template=source, tokenize=False
    )
    assert ChatTemplate(source).render(chat) == expected
    assert '"é <b>&</b> 🚀"' in expected and "\\u00e9" in expected


def test_globals_and_loop_controls():
    template = ChatTemplate(
        "{{ strftime_now('%Y') }}|{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}"
        "{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}|{{ dict(a=1) }}|"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% endfor %}{{ ns.n }}|{{ bos_token }}"
    )
    out = template.render([{"role": "user", "content": "x"}] * 3, bos_token="<s>")
    assert out == f"{datetime.now().year}|02|{{'a': 1}}|3|<s>"


def test_trim_and_lstrip_blocks():
    template = ChatTemplate("  {% if true %}\nA\n  {% endif %}\nB")
    assert template.render([]) == "A\nB"


def test_template_errors_are_request_errors():
    tok = Tokenizer.from_hf_dir(FIXTURES)
    with pytest.raises(RequestError, match="Unknown role: robot"):
        ChatTemplate(QWEN3_STYLE_TEMPLATE).render([{"role": "robot", "content": "beep"}])
    with pytest.raises(RequestError, match="content"):
        tok.apply_chat_template([{"role": "user"}])  # the template reads a missing key
    with pytest.raises(RequestError, match="messages"):
        tok.apply_chat_template("hello")
    with pytest.raises(RequestError):  # the sandbox refuses attribute tricks
        ChatTemplate("{{ ''.__class__.__mro__ }}").render([])
    with pytest.raises(RequestError, match="_secret"):
        ChatTemplate("{% set ns = namespace(_secret=1) %}").render([])
    with pytest.raises(ModelFormatError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", name="model.gguf: chat template")


def test_no_chat_template():
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
    }
    tok = Tokenizer.from_gguf_metadata(meta, "bare.gguf")
    assert tok.encode("abba") == [2, 1, 0]
    with pytest.raises(RequestError, match="bare.gguf: the model has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])

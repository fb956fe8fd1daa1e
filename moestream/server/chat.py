"""POST /v1/chat/completions: messages -> the model's chat template -> the engine -> a chat
completion (or its SSE chunks), with tool calls parsed out of the text in the model's format.

`tool_choice`: "none" leaves the text alone; "auto" (the default with tools) parses calls the
model chose to make; "required" or a named function also forces the call format through
constrained decoding, so the answer is a valid call whatever the model's inclination.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from moestream.server.constrained import tool_call_grammar
from moestream.server.errors import bad_request
from moestream.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChoiceLogprobs,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from moestream.server.serving import (
    ChoiceState,
    ServerState,
    build_constraints,
    chat_logprobs,
    check_n,
    engine_error,
    new_id,
    open_streams,
    request_grammar,
    resolve_max_tokens,
    sampling_params,
    unless_disconnected,
    usage,
)
from moestream.server.streaming import DONE, SSEResponse, merge, sse
from moestream.server.tool_calls import ParsedDelta, ToolCallParser, parse_tool_calls

_RESERVED_TEMPLATE_KEYS = {"messages", "tools", "add_generation_prompt", "documents"}


def _template_message(i: int, message: ChatMessage) -> dict[str, Any]:
    m = message.model_dump(exclude_none=True)
    m.setdefault("content", "")  # null beside tool_calls; templates concatenate it
    content = m["content"]
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"messages[{i}].content: only text parts are supported, got "
                    f"{part.get('type')!r}",
                    param=f"messages.{i}.content",
                )
            texts.append(part["text"])
        m["content"] = "".join(texts)
    for call in m.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            # templates write arguments with `| tojson`: give them the object
            with contextlib.suppress(json.JSONDecodeError):
                fn["arguments"] = json.loads(fn["arguments"])
    return m


def render_chat_prompt(
    state: ServerState,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: dict[str, Any] | None,
) -> str:
    """The prompt text the model's chat template makes of the conversation."""
    if add_generation_prompt and continue_final_message:
        raise bad_request(
            "continue_final_message needs add_generation_prompt false", "continue_final_message"
        )
    kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KEYS}
    msgs = [_template_message(i, m) for i, m in enumerate(messages)]
    prompt = state.tokenizer.apply_chat_template(
        msgs, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
    )
    if continue_final_message:
        final = msgs[-1].get("content") or ""
        end = prompt.rfind(final) if final else -1
        if end < 0:
            raise bad_request("the final message is not in the rendered prompt", "messages")
        prompt = prompt[: end + len(final)]
    return prompt


def _tool_setup(req: ChatCompletionRequest) -> tuple[list[dict] | None, bool, str | None]:
    """(tools for the template, parse calls?, forced-call grammar or None)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if choice in ("none", "auto"):
        return tools, choice == "auto", None
    only = None if choice == "required" else choice.function.name
    return tools, True, tool_call_grammar(tools, only, req.parallel_tool_calls and only is None)


async def create_chat_completion(
    state: ServerState, req: ChatCompletionRequest, raw: Request
) -> Response:
    state.check_model(req.model)
    check_n(req, state)
    tools, parse_tools, tool_grammar = _tool_setup(req)
    prompt = render_chat_prompt(
        state, req.messages, tools, req.add_generation_prompt, req.continue_final_message,
        req.chat_template_kwargs,
    )  # fmt: skip
    ids = state.tokenizer.encode(prompt, add_special_tokens=False)
    requested = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    max_tokens = resolve_max_tokens(state, len(ids), requested, "messages")
    if max_tokens < 1:
        raise bad_request("max_tokens must be >= 1", "max_tokens")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs true", "top_logprobs")
    top = req.top_logprobs or 0
    grammar = request_grammar(req)
    if tool_grammar is not None:
        if grammar is not None:
            raise bad_request("a forced tool_choice cannot be combined with response_format")
        grammar = (tool_grammar, "tool_choice")
    constraints = await build_constraints(state, req, grammar, req.n)
    params = [
        sampling_params(req, max_tokens, top if req.logprobs else None, i) for i in range(req.n)
    ]
    rid = new_id("chatcmpl")
    streams = await open_streams(state, raw, rid, [(ids, p) for p in params], constraints)
    if streams is None:
        return Response(status_code=499)
    if req.stream:
        return SSEResponse(_events(state, req, rid, streams, parse_tools, top))
    try:
        choices = await unless_disconnected(raw, _collect(state, streams))
    except Exception as e:
        raise engine_error(e) from e
    if choices is None:
        return Response(status_code=499)
    return JSONResponse(_response(state, req, rid, choices, parse_tools, top))


async def _collect(state: ServerState, streams: list) -> list[ChoiceState]:
    choices = [ChoiceState() for _ in streams]
    async for i, out in merge(streams):
        choices[i].update(out)
    return choices


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


def _response(
    state: ServerState,
    req: ChatCompletionRequest,
    rid: str,
    choices: list[ChoiceState],
    parse_tools: bool,
    top: int,
) -> dict[str, Any]:
    out = []
    for i, c in enumerate(choices):
        content, calls = parse_tool_calls(c.text) if parse_tools else (c.text, [])
        if not req.parallel_tool_calls:
            calls = calls[:1]
        tool_calls = [
            ToolCall(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments))
            for t in calls
        ]
        out.append(
            ChatChoice(
                index=i,
                message=AssistantMessage(content=content, tool_calls=tool_calls or None),
                logprobs=ChoiceLogprobs(content=chat_logprobs(state, c.logprobs, top))
                if req.logprobs
                else None,
                finish_reason=_finish_reason(c.finish_reason, bool(calls)),
            )
        )
    body = ChatCompletionResponse(
        id=rid,
        model=req.model,
        choices=out,
        usage=usage(
            choices[0].num_prompt, sum(c.num_output for c in choices), choices[0].num_cached
        ),
    ).model_dump(exclude_none=True)
    for choice in body["choices"]:
        choice["message"].setdefault("content", None)
        choice.setdefault("logprobs", None)
    return body


def _delta_tool_calls(parsed: ParsedDelta, parallel: bool) -> list[DeltaToolCall] | None:
    calls = []
    for piece in parsed.tool_calls:
        if not parallel and piece.index > 0:
            continue
        if piece.name is not None:
            fn = DeltaFunctionCall(name=piece.name, arguments=piece.arguments)
            calls.append(
                DeltaToolCall(index=piece.index, id=piece.id, type="function", function=fn)
            )
        else:
            fn = DeltaFunctionCall(arguments=piece.arguments)
            calls.append(DeltaToolCall(index=piece.index, function=fn))
    return calls or None


async def _events(
    state: ServerState,
    req: ChatCompletionRequest,
    rid: str,
    streams: list,
    parse_tools: bool,
    top: int,
) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], **kw: Any) -> str:
        return sse(ChatCompletionChunk(id=rid, model=req.model, choices=choices, **kw))

    n = len(streams)
    choices = [ChoiceState() for _ in range(n)]
    parsers = [ToolCallParser() if parse_tools else None for _ in range(n)]
    try:
        for i in range(n):
            yield chunk(
                [ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]
            )
        async for i, out in merge(streams):
            delta = choices[i].update(out)
            parsed = ParsedDelta(content=delta)
            parser = parsers[i]
            if parser is not None:
                parsed = parser.feed(delta)
                if out.finished:
                    rest = parser.finish()
                    parsed.content += rest.content
                    parsed.tool_calls += rest.tool_calls
            has_calls = parser is not None and parser.has_tool_calls
            finish = _finish_reason(choices[i].finish_reason, has_calls) if out.finished else None
            logprobs = None
            if req.logprobs and out.new_token_ids:
                lps = out.logprobs[-len(out.new_token_ids) :]
                logprobs = ChoiceLogprobs(content=chat_logprobs(state, lps, top))
            delta_msg = DeltaMessage(
                content=parsed.content or None,
                tool_calls=_delta_tool_calls(parsed, req.parallel_tool_calls),
            )
            if parsed or logprobs is not None or finish is not None:
                yield chunk(
                    [
                        ChatChunkChoice(
                            index=i, delta=delta_msg, logprobs=logprobs, finish_reason=finish
                        )
                    ]
                )
        if req.stream_options is not None and req.stream_options.include_usage:
            total = sum(c.num_output for c in choices)
            yield chunk([], usage=usage(choices[0].num_prompt, total, choices[0].num_cached))
        yield DONE
    except Exception as e:  # the engine failed mid-stream: say so in the stream, then end it
        yield sse(engine_error(e).body())
        yield DONE
    finally:
        for s in streams:
            s.close()

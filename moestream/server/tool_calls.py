"""Tool calls in the Qwen / Hermes format, parsed out of generated text, also while streaming.

The model writes each call as a JSON object between tags, after optional plain content:

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`ToolCallParser.feed(delta)` turns text deltas into content deltas and tool-call deltas in the
OpenAI streaming shape: the first delta of a call carries its index, id and name (as soon as
the name is complete), the following ones carry fragments of `arguments`, the JSON text of the
arguments object exactly as the model wrote it. Text that may still become a tag is held back.
`parse_tool_calls(text)` runs the same parser over a whole text and merges the deltas; if a call
is not valid JSON with a string `name`, the whole text is returned as content instead.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGS_KEY = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')  # the value has begun
_CLOSE = re.compile(r"\s*(?:\}\s*)?$")  # what may still be the close of the call's object


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ToolCallDelta:
    """One streamed piece of a tool call; `name` and `id` only on its first piece."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass
class _Call:
    index: int
    id: str
    name_sent: bool = False
    args_start: int | None = None  # offset of the arguments value in the call body
    args_sent: int = 0  # characters of the arguments text already streamed
    valid: bool = True


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # JSON text


class ToolCallParser:
    """Incremental parser: `feed` each text delta, then `finish` once at the end."""

    def __init__(self) -> None:
        self._buf = ""
        self._call: _Call | None = None  # the call being read, None in content
        self._calls: list[_Call] = []
        self._pending_space = ""  # whitespace after a call, emitted only if content follows

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._calls)

    @property
    def all_valid(self) -> bool:
        return all(c.valid for c in self._calls)

    def feed(self, delta: str) -> ParsedDelta:
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> ParsedDelta:
        """Flush held-back text; an unterminated last call is closed as it stands."""
        return self._advance(final=True)

    # ---- the state machine ---------------------------------------------------------------
    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if self._call is None:
                i = self._buf.find(TOOL_CALL_START)
                if i >= 0:
                    self._content(out, self._buf[:i], closing=True)
                    self._buf = self._buf[i + len(TOOL_CALL_START) :]
                    self._call = _Call(index=len(self._calls), id=new_tool_call_id())
                    self._calls.append(self._call)
                    continue
                hold = 0 if final else _partial_tag(self._buf, TOOL_CALL_START)
                self._content(out, self._buf[: len(self._buf) - hold], closing=final)
                self._buf = self._buf[len(self._buf) - hold :]
                return out
            j = self._buf.find(TOOL_CALL_END)
            if j >= 0 or final:
                body = self._buf if j < 0 else self._buf[:j]
                self._close_call(out, self._call, body)
                self._buf = "" if j < 0 else self._buf[j + len(TOOL_CALL_END) :]
                self._call = None
                if j < 0:
                    return out
                continue
            hold = _partial_tag(self._buf, TOOL_CALL_END)
            self._stream_call(out, self._call, self._buf[: len(self._buf) - hold])
            return out

    def _content(self, out: ParsedDelta, text: str, closing: bool) -> None:
        if not self._calls:
            out.content += text
            return
        # After a call, whitespace alone is layout between calls, not content.
        text = self._pending_space + text
        if text.strip():
            out.content += text
            self._pending_space = ""
        else:
            self._pending_space = "" if closing else text

    def _piece(self, out: ParsedDelta, call: _Call) -> ToolCallDelta:
        if out.tool_calls and out.tool_calls[-1].index == call.index:
            return out.tool_calls[-1]
        piece = ToolCallDelta(index=call.index)
        out.tool_calls.append(piece)
        return piece

    def _send_name(self, out: ParsedDelta, call: _Call, name: str) -> None:
        piece = self._piece(out, call)
        piece.id, piece.name = call.id, name
        call.name_sent = True

    def _stream_call(self, out: ParsedDelta, call: _Call, body: str) -> None:
        name = _NAME.match(body)
        if name is None:
            return  # the name is not complete yet, or the object does not start with it
        if not call.name_sent:
            self._send_name(out, call, json.loads(name.group(1)))
        if call.args_start is None:
            key = _ARGS_KEY.match(body, name.end())
            if key is None:
                return
            call.args_start = key.end()
        avail = body[call.args_start :]
        safe = len(avail) - len(_CLOSE.search(avail).group(0))
        if safe > call.args_sent:
            self._piece(out, call).arguments += avail[call.args_sent : safe]
            call.args_sent = safe

    def _close_call(self, out: ParsedDelta, call: _Call, body: str) -> None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            call.valid = False
            return
        if not call.name_sent:
            self._send_name(out, call, obj["name"])
        args = obj.get("arguments", obj.get("parameters", {}))
        if call.args_start is None:
            text = json.dumps(args, ensure_ascii=False)
        else:
            raw = body[call.args_start :].rstrip()
            text = raw[:-1].rstrip() if raw.endswith("}") else raw
            try:
                if json.loads(text) != args:
                    raise ValueError
            except ValueError:
                call.valid = call.args_sent == 0
                text = json.dumps(args, ensure_ascii=False)
        if len(text) > call.args_sent:
            self._piece(out, call).arguments += text[call.args_sent :]
            call.args_sent = len(text)


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, tool calls) of a whole generated text. Content is None when empty."""
    parser = ToolCallParser()
    deltas = [parser.feed(text), parser.finish()]
    if not parser.has_tool_calls or not parser.all_valid:
        return (text or None), []
    content = "".join(d.content for d in deltas).strip() or None
    calls: dict[int, ParsedToolCall] = {}
    for d in deltas:
        for piece in d.tool_calls:
            call = calls.setdefault(piece.index, ParsedToolCall(piece.id or "", "", ""))
            if piece.name is not None:
                call.id, call.name = piece.id or call.id, piece.name
            call.arguments += piece.arguments
    return content, [calls[i] for i in sorted(calls)]

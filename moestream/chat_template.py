"""Render Hugging Face chat templates (jinja2) with the conventions of `transformers`.

The environment matches `transformers.utils.chat_template_utils`: an immutable sandbox with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that keeps
non-ASCII text and takes `indent`/`separators`/`sort_keys`, and the globals `raise_exception`,
`strftime_now`, `dict` and a `namespace` that refuses underscore names. Templates are untrusted
code from model files, hence the sandbox.

Before rendering, messages are normalised as `transformers` does: keys whose value is None are
dropped (OpenAI clients send `content: null` beside `tool_calls`), and a reasoning text given as
`reasoning_content`, `thinking` or `reasoning` is visible under `reasoning_content` and `thinking`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moestream.errors import ModelFormatError, RequestError

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` inside templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing attributes that start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja2's signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def make_environment() -> ImmutableSandboxedEnvironment:
    """A fresh sandboxed jinja2 environment configured like `transformers`'."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the template sees them (None values dropped, reasoning fields aliased)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise RequestError(f"messages must be a list of objects, got {type(messages).__name__}")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise RequestError(f"messages[{i}] must be an object, got {type(message).__name__}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


class ChatTemplate:
    """One compiled chat template. `name` says where it came from, for error messages."""

    def __init__(self, source: str, name: str = "chat template") -> None:
        self.source = source
        self.name = name
        try:
            self._template = make_environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelFormatError(
                f"{name}: does not compile: {e.message} (line {e.lineno})"
            ) from e

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """Render a conversation to the prompt text.

        `variables` are extra template variables (bos_token, eos_token, enable_thinking, ...).
        Any error the template raises (its own `raise_exception`, a missing key, a type error
        on unexpected message shapes) becomes a RequestError carrying the message.
        """
        if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
            raise RequestError("tools must be a list of JSON schema objects")
        try:
            return self._template.render(
                messages=normalize_messages(messages),
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except (
            jinja2.TemplateError,
            TypeError,
            ValueError,
            LookupError,
            AttributeError,
            ArithmeticError,
        ) as e:
            raise RequestError(f"{self.name}: {type(e).__name__}: {e}") from e

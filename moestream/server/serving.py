"""What the chat and completions endpoints share: the server state, request fields turned into
`SamplingParams` and constraints, the context-length check, logprob formatting, and waiting
for a result while watching for the client to go away."""

from __future__ import annotations

import asyncio
import math
import re
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from moestream.engine import EngineOutput
from moestream.errors import MoestreamError, RequestError
from moestream.runner.model_runner import TokenLogprobs
from moestream.server.async_engine import (
    AsyncEngine,
    EngineStoppedError,
    QueueFullError,
    RequestStream,
)
from moestream.server.constrained import (
    ConstrainedLogits,
    GrammarCompiler,
    RequestConstraint,
    grammar_from_spec,
    json_schema_grammar,
)
from moestream.server.errors import APIError, bad_request, from_moestream_error, internal_error
from moestream.server.metrics import ServerMetrics
from moestream.server.protocol import (
    PromptTokensDetails,
    SamplingRequest,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from moestream.types import SamplingParams

T = TypeVar("T")
LOGPROB_FLOOR = -9999.0  # JSON has no -inf


@dataclass
class ServerConfig:
    """Limits and identity of one server (the CLI's serve flags)."""

    model_names: list[str]
    api_key: str | None = None
    max_queue: int = 1024
    max_concurrency: int = 256
    max_request_bytes: int = 16 * 2**20
    max_n: int = 16

    def __post_init__(self) -> None:
        if not self.model_names:
            raise ValueError("a server needs at least one model name")


class ServerState:
    """Everything the endpoints need, built once per app from an `LLM`."""

    def __init__(self, llm: Any, config: ServerConfig) -> None:
        self.llm = llm
        self.config = config
        self.tokenizer = llm.tokenizer
        self.engine = llm.engine
        self.max_model_len: int = llm.engine.max_model_len
        self.vocab_size: int = llm.config.vocab_size
        self.metrics = ServerMetrics()
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        eos = sorted(self.tokenizer.eos_token_ids)
        self.aengine = AsyncEngine(
            llm.engine,
            max_concurrency=config.max_concurrency,
            max_queue=config.max_queue,
            logits_processor=ConstrainedLogits(self.grammars.mask_words, eos),
            observer=self.metrics,
        )
        self.metrics.watch(
            self.aengine, getattr(llm, "expert_store", None), getattr(llm, "zero_copy", ()),
            getattr(llm, "paged", ()),
        )  # fmt: skip
        self._token_text = [b.decode("utf-8", errors="replace") for b in self.tokenizer.token_bytes]

    @property
    def model_name(self) -> str:
        return self.config.model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.config.model_names:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def token_text(self, token_id: int) -> str:
        return self._token_text[token_id] if 0 <= token_id < len(self._token_text) else ""

    def token_bytes(self, token_id: int) -> list[int]:
        table = self.tokenizer.token_bytes
        return list(table[token_id]) if 0 <= token_id < len(table) else []

    @property
    def pool_tokens(self) -> int:
        sched = self.engine.scheduler
        return sched.allocator.num_blocks * sched.block_size


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- request fields -> engine inputs ------------------------------------------------------------
def resolve_max_tokens(
    state: ServerState, num_prompt: int, requested: int | None, prompt_param: str
) -> int:
    """max_tokens for a prompt of `num_prompt` tokens (the rest of the context when not given);
    400 with the numbers when prompt and completion do not fit."""
    limit = state.max_model_len
    if num_prompt >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens, but the prompt has "
            f"{num_prompt} tokens. Please shorten the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return max(1, min(limit - num_prompt, state.pool_tokens - num_prompt + 1))
    if requested < 0:
        raise bad_request(f"max_tokens must be >= 0, got {requested}", param="max_tokens")
    if num_prompt + requested > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt + requested} tokens ({num_prompt} in the prompt, {requested} for the "
            "completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


_PARAM = re.compile(r"invalid sampling parameter (\w+)")


def sampling_params(
    req: SamplingRequest, max_tokens: int, logprobs: int | None, choice: int = 0
) -> SamplingParams:
    """SamplingParams of choice `choice` of a request (seed + choice, so n choices differ)."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=None if req.seed is None else req.seed + choice,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )
    except RequestError as e:
        m = _PARAM.search(str(e))
        raise bad_request(str(e), param=m.group(1) if m else None) from e


def check_n(req: SamplingRequest, state: ServerState) -> None:
    if not 1 <= req.n <= state.config.max_n:
        raise bad_request(f"n must be in [1, {state.config.max_n}], got {req.n}", param="n")


def _logit_bias(state: ServerState, bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= token < state.vocab_size or not -100 <= value <= 100:
            raise bad_request(
                f"logit_bias {token}: {value}: ids must be in [0, {state.vocab_size}) and "
                "biases in [-100, 100]",
                "logit_bias",
            )
        out[token] = float(value)
    return out


def request_grammar(req: SamplingRequest) -> tuple[str, str] | None:
    """(llguidance grammar, the request field it comes from) from `grammar` or
    `response_format`, or None."""
    fmt = req.response_format
    if req.grammar is not None and fmt is not None and fmt.type != "text":
        raise bad_request("give either grammar or response_format, not both", "grammar")
    if isinstance(req.grammar, str):
        return grammar_from_spec("lark", req.grammar), "grammar"
    if req.grammar is not None:
        return grammar_from_spec(req.grammar.type, req.grammar.value), "grammar"
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_schema_grammar({"type": "object"}), "response_format"
    if fmt.json_schema is None:
        raise bad_request("response_format json_schema needs a json_schema", "response_format")
    schema = fmt.json_schema.json_schema
    return json_schema_grammar({} if schema is None else schema), "response_format"


async def build_constraints(
    state: ServerState, req: SamplingRequest, grammar: tuple[str, str] | None, count: int
) -> list[RequestConstraint | None]:
    """One constraint per choice (None where nothing constrains the request)."""
    bias = _logit_bias(state, req.logit_bias)
    if grammar is None:
        return [RequestConstraint(bias=bias) if bias else None for _ in range(count)]
    try:
        first = await asyncio.to_thread(state.grammars.matcher, *grammar)
    except RequestError as e:
        raise bad_request(str(e), param=grammar[1]) from e
    matchers = [first] + [first.deep_copy() for _ in range(count - 1)]
    return [RequestConstraint(matcher=m, bias=dict(bias)) for m in matchers]


# ---- outputs -> response parts ------------------------------------------------------------------
def usage(num_prompt: int, num_output: int, num_cached: int) -> Usage:
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_output,
        total_tokens=num_prompt + num_output,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
    )


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def chat_logprobs(state: ServerState, lps: Sequence[TokenLogprobs], top: int) -> list[TokenLogprob]:
    return [
        TokenLogprob(
            token=state.token_text(lp.token_id),
            logprob=finite(lp.logprob),
            bytes=state.token_bytes(lp.token_id),
            top_logprobs=[
                TopLogprob(token=state.token_text(t), logprob=finite(v), bytes=state.token_bytes(t))
                for t, v in lp.top[:top]
            ],
        )
        for lp in lps
    ]


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text: str = ""
    num_prompt: int = 0
    num_output: int = 0
    num_cached: int = 0
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    def update(self, out: EngineOutput) -> str:
        """Record `out`; returns its text delta."""
        delta = out.delta_text
        self.text += delta
        self.num_prompt = out.num_prompt_tokens
        self.num_output = out.num_output_tokens
        self.num_cached = out.num_cached_tokens
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.logprobs[-len(out.new_token_ids) :] if out.logprobs else [])
        if out.finished:
            self.finish_reason = out.finish_reason
        return delta


def engine_error(e: BaseException) -> APIError:
    """The HTTP error for an exception from the engine side (AsyncEngine.open, a stream,
    AsyncEngine.call)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(
            429, f"the server is busy ({e}); retry later", code="queue_full",
            headers={"Retry-After": "1"},
        )  # fmt: skip
    if isinstance(e, EngineStoppedError):
        return APIError(503, str(e), headers={"Retry-After": "5"})
    if isinstance(e, MoestreamError):
        return from_moestream_error(e)
    return internal_error(e)  # EngineFailure and our own bugs


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone (call after the body has been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Result of `work`, or None (with `work` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task.result() if not task.cancelled() else None


async def open_streams(
    state: ServerState,
    request: Request,
    request_id: str,
    inputs: Sequence[tuple[Sequence[int], SamplingParams]],
    constraints: Sequence[RequestConstraint | None],
) -> list[RequestStream] | None:
    """Admit one engine request per (prompt ids, params), ids `{request_id}-{i}`. None if the
    client left while they waited; an APIError (429, 503, 400) if one was refused. Either way
    nothing stays open unless the streams are returned."""
    streams: list[RequestStream] = []

    async def admit() -> list[RequestStream]:
        for i, ((ids, params), constraint) in enumerate(zip(inputs, constraints)):
            rid = f"{request_id}-{i}"
            streams.append(await state.aengine.open(ids, params, rid, constraint))
        return streams

    try:
        opened = await unless_disconnected(request, admit())
    except BaseException as e:
        for s in streams:
            s.close()
        if isinstance(e, Exception):
            raise engine_error(e) from e
        raise
    if opened is None:
        for s in streams:
            s.close()
    return opened

"""POST /v1/completions: raw prompts (text, token ids, or batches of either) -> text.

`echo` puts the prompt in front of the text; with `logprobs` it also returns the prompt's own
logprobs (the first token has none), which is what lm-evaluation-harness `local-completions`
reads for loglikelihood tasks (echo, max_tokens 1 or 0, logprobs 1). Prompt logprobs come from
one separate forward pass over the prompt, run in the engine thread.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from moestream.layers.attention import AttentionMetadata
from moestream.runner.model_runner import TokenLogprobs
from moestream.server.errors import bad_request
from moestream.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from moestream.server.serving import (
    ChoiceState,
    ServerState,
    build_constraints,
    check_n,
    engine_error,
    finite,
    new_id,
    open_streams,
    request_grammar,
    resolve_max_tokens,
    sampling_params,
    unless_disconnected,
    usage,
)
from moestream.server.streaming import DONE, SSEResponse, merge, sse

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_LOGITS_CHUNK = 256  # rows of [T, V] logits materialised at once


@dataclass
class _Prompt:
    ids: list[int]
    text: str
    logprobs: list[TokenLogprobs | None] | None = None  # echo + logprobs only


def _prompts(state: ServerState, prompt: Any) -> list[_Prompt]:
    if isinstance(prompt, str) or prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.append(_Prompt(state.tokenizer.encode(p), p))
            continue
        bad = [t for t in p if not 0 <= t < state.vocab_size]
        if bad:
            raise bad_request(
                f"prompt[{i}] has token id {bad[0]} outside the vocabulary "
                f"(0..{state.vocab_size - 1})",
                "prompt",
            )
        out.append(_Prompt(list(p), state.tokenizer.decode(p)))
    for p in out:
        if not p.ids:
            raise bad_request("prompt must not be empty", "prompt")
    return out


@torch.inference_mode()
def prompt_logprobs(llm: Any, ids: Sequence[int], top: int) -> list[TokenLogprobs | None]:
    """Logprob of each prompt token given the ones before it (None for the first), with the
    `top` most likely alternatives. One forward pass in a private KV cache; engine thread."""
    model, device, block_size = llm.model, llm.device, 16
    n_blocks = -(-len(ids) // block_size)
    kv = model.make_kv_cache(n_blocks, block_size)
    attn = AttentionMetadata.build([(0, len(ids), list(range(n_blocks)))], block_size, device)
    input_ids = torch.tensor(ids, dtype=torch.long, device=device)  # [T]
    hidden = model.forward(input_ids, torch.arange(len(ids), device=device), attn, kv)  # [T, H]
    out: list[TokenLogprobs | None] = [None]
    for start in range(0, len(ids) - 1, _LOGITS_CHUNK):
        end = min(start + _LOGITS_CHUNK, len(ids) - 1)
        logp = torch.log_softmax(model.compute_logits(hidden[start:end]).float(), dim=-1)  # [C, V]
        nxt = input_ids[start + 1 : end + 1]
        chosen = logp.gather(1, nxt.unsqueeze(1)).squeeze(1).tolist()
        if top:
            values, tokens = logp.topk(min(top, logp.shape[1]), dim=-1)  # [C, K]
            alts = [list(zip(t, v)) for t, v in zip(tokens.tolist(), values.tolist())]
        else:
            alts = [[] for _ in chosen]
        out += [TokenLogprobs(t, lp, a) for t, lp, a in zip(nxt.tolist(), chosen, alts)]
    return out


def _logprobs(
    state: ServerState,
    token_ids: Sequence[int],
    lps: Sequence[TokenLogprobs | None],
    start_offset: int,
) -> CompletionLogprobs:
    """OpenAI completion logprobs of `token_ids`; text offsets start at `start_offset`."""
    result = CompletionLogprobs()
    offset = start_offset
    for t, lp in zip(token_ids, lps):
        text = state.token_text(t)
        result.tokens.append(text)
        result.text_offset.append(offset)
        offset += len(text)
        if lp is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(finite(lp.logprob))
        top = {state.token_text(a): finite(v) for a, v in lp.top}
        top.setdefault(text, finite(lp.logprob))
        result.top_logprobs.append(top)
    return result


async def _add_prompt_logprobs(state: ServerState, prompts: list[_Prompt], top: int) -> None:
    for p in prompts:
        try:
            p.logprobs = await state.aengine.call(
                lambda ids=p.ids: prompt_logprobs(state.llm, ids, top)
            )
        except Exception as e:
            raise engine_error(e) from e


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Response:
    state.check_model(req.model)
    check_n(req, state)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (no server-side ranking)", "best_of")
    prompts = _prompts(state, req.prompt)
    requested = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    max_tokens = [resolve_max_tokens(state, len(p.ids), requested, "prompt") for p in prompts]
    if requested == 0 and not req.echo:
        raise bad_request("max_tokens 0 needs echo", "max_tokens")
    if req.echo and req.logprobs is not None:
        await _add_prompt_logprobs(state, prompts, req.logprobs)
    rid = new_id("cmpl")
    n = req.n
    if requested == 0:  # echo only
        choices = [ChoiceState(num_prompt=len(p.ids), finish_reason="length") for p in prompts]
        if req.stream:
            return SSEResponse(_echo_events(state, req, rid, prompts))
        return JSONResponse(
            _response(state, req, rid, prompts, [c for c in choices for _ in range(n)])
        )
    grammar = request_grammar(req)
    constraints = await build_constraints(state, req, grammar, len(prompts) * n)
    inputs = [
        (p.ids, sampling_params(req, m, req.logprobs, j))
        for p, m in zip(prompts, max_tokens)
        for j in range(n)
    ]
    streams = await open_streams(state, raw, rid, inputs, constraints)
    if streams is None:
        return Response(status_code=499)
    if req.stream:
        return SSEResponse(_events(state, req, rid, prompts, streams))
    try:
        states = await unless_disconnected(raw, _collect(state, streams))
    except Exception as e:
        raise engine_error(e) from e
    if states is None:
        return Response(status_code=499)
    return JSONResponse(_response(state, req, rid, prompts, states))


async def _collect(state: ServerState, streams: list) -> list[ChoiceState]:
    choices = [ChoiceState() for _ in streams]
    async for i, out in merge(streams):
        choices[i].update(out)
    return choices


def _choice_logprobs(
    state: ServerState, req: CompletionRequest, prompt: _Prompt, c: ChoiceState
) -> CompletionLogprobs | None:
    if req.logprobs is None:
        return None
    ids: list[int] = []
    lps: list[TokenLogprobs | None] = []
    if req.echo:
        ids, lps = list(prompt.ids), list(prompt.logprobs or [None] * len(prompt.ids))
    return _logprobs(state, ids + c.token_ids, lps + list(c.logprobs), 0)


def _usage(prompts: list[_Prompt], choices: list[ChoiceState], n: int) -> Any:
    firsts = choices[::n]
    return usage(
        sum(len(p.ids) for p in prompts),
        sum(c.num_output for c in choices),
        sum(c.num_cached for c in firsts),
    )


def _response(
    state: ServerState,
    req: CompletionRequest,
    rid: str,
    prompts: list[_Prompt],
    choices: list[ChoiceState],
) -> dict[str, Any]:
    out = []
    for k, c in enumerate(choices):
        prompt = prompts[k // req.n]
        out.append(
            CompletionChoice(
                index=k,
                text=(prompt.text if req.echo else "") + c.text,
                logprobs=_choice_logprobs(state, req, prompt, c),
                finish_reason=c.finish_reason,
            )
        )
    body = CompletionResponse(
        id=rid, model=req.model, choices=out, usage=_usage(prompts, choices, req.n)
    ).model_dump()
    return body


async def _echo_events(
    state: ServerState, req: CompletionRequest, rid: str, prompts: list[_Prompt]
) -> AsyncIterator[str]:
    choices = []
    for k in range(len(prompts) * req.n):
        p = prompts[k // req.n]
        lps = None
        if req.logprobs is not None:
            lps = _logprobs(state, p.ids, p.logprobs or [None] * len(p.ids), 0)
        choices.append(CompletionChoice(index=k, text=p.text, logprobs=lps, finish_reason="length"))
    yield sse(CompletionResponse(id=rid, model=req.model, choices=choices))
    if req.stream_options is not None and req.stream_options.include_usage:
        states = [ChoiceState() for _ in choices]
        yield sse(
            CompletionResponse(
                id=rid, model=req.model, choices=[], usage=_usage(prompts, states, req.n)
            )
        )
    yield DONE


async def _events(
    state: ServerState,
    req: CompletionRequest,
    rid: str,
    prompts: list[_Prompt],
    streams: list,
) -> AsyncIterator[str]:
    def chunk(choices: list[CompletionChoice], **kw: Any) -> str:
        return sse(CompletionResponse(id=rid, model=req.model, choices=choices, **kw))

    n = req.n
    choices = [ChoiceState() for _ in streams]
    offsets = [0] * len(streams)  # characters of text sent per choice
    try:
        if req.echo:
            for k in range(len(streams)):
                p = prompts[k // n]
                lps = None
                if req.logprobs is not None:
                    lps = _logprobs(state, p.ids, p.logprobs or [None] * len(p.ids), 0)
                yield chunk([CompletionChoice(index=k, text=p.text, logprobs=lps)])
                offsets[k] = len(p.text)
        async for k, out in merge(streams):
            delta = choices[k].update(out)
            lps = None
            if req.logprobs is not None and out.new_token_ids:
                new = out.logprobs[-len(out.new_token_ids) :]
                lps = _logprobs(state, out.new_token_ids, new, offsets[k])
            offsets[k] += len(delta)
            finish = choices[k].finish_reason if out.finished else None
            if delta or lps is not None or finish is not None:
                yield chunk(
                    [CompletionChoice(index=k, text=delta, logprobs=lps, finish_reason=finish)]
                )
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage=_usage(prompts, choices, n))
        yield DONE
    except Exception as e:
        yield sse(engine_error(e).body())
        yield DONE
    finally:
        for s in streams:
            s.close()

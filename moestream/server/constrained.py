"""Constrained decoding: grammars (JSON schema, regex, Lark/GBNF) compiled by llguidance into a
per-request token mask, applied to the logits before sampling; plus `logit_bias`.

The hook the runner calls is `LogitsProcessor.apply` (see its contract). The runner calls it
between `compute_logits` and `Sampler.sample`, in the engine thread, with the rows it is about
to sample. `ConstrainedLogits` implements it: it holds one `RequestConstraint` per constrained
request, brings each request's llguidance matcher up to date with the request's output tokens
(rolling back if they shrank), fills a bitmask of allowed tokens and sets the others to -inf.

JSON is constrained to single-line layout (", " and ": " separators, no free whitespace): with
free whitespace a weak or confused model can emit whitespace until max_tokens.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import llguidance
import torch

from moestream.errors import RequestError
from moestream.tokenizer import Tokenizer

log = logging.getLogger("moestream.server")

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LogitsProcessor(Protocol):
    """Changes sampling logits per request. Called by the runner in the engine thread.

    `apply(logits, request_ids, output_token_ids)`: `logits` [B, V] float32 are the rows about
    to be sampled, row i belonging to `request_ids[i]` whose generated tokens so far are
    `output_token_ids[i]` (for a speculative verify row: the output plus the drafts before that
    position). Returns the logits to sample from (may be `logits` changed in place). Rows of
    requests it does not know are left unchanged; it must never leave a row with no finite
    entry. It keeps no reference to the token lists after returning.
    """

    def apply(
        self,
        logits: torch.Tensor,
        request_ids: Sequence[str],
        output_token_ids: Sequence[Sequence[int]],
    ) -> torch.Tensor: ...


class _TokenizerAdapter:
    """What llguidance.TokenizerWrapper reads from a tokenizer object."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = tokenizer.token_bytes
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


class GrammarCompiler:
    """Builds llguidance matchers for one model's tokenizer and logits width `vocab_size`."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(tokenizer.eos_token_ids)
        wrapper = llguidance.TokenizerWrapper(_TokenizerAdapter(tokenizer))
        self.ll_tokenizer = llguidance.LLTokenizer(wrapper, eos_token=self.eos_token_ids or None)
        # Masks cover the tokenizer's ids; ids past them (padded vocabularies) stay disallowed.
        self.mask_words = (self.ll_tokenizer.vocab_size + 31) // 32

    def matcher(self, grammar: str, what: str) -> llguidance.LLMatcher:
        """A fresh matcher for an llguidance grammar; RequestError naming `what` if invalid."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"invalid {what}: {matcher.get_error()}")
        return matcher


# ---- grammars from request fields ---------------------------------------------------------------
def _with_json_options(schema: dict[str, Any] | bool) -> dict[str, Any]:
    if schema is True or schema == {}:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise RequestError("a JSON schema must be an object")
    return {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(_with_json_options(schema))
    except ValueError as e:
        raise RequestError(f"invalid JSON schema: {e}") from e


def grammar_from_spec(kind: str, value: str | dict[str, Any]) -> str:
    """An llguidance grammar from moestream's `grammar` field (kind lark, gbnf, regex or
    json_schema; a plain string is "lark", which also accepts GBNF)."""
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise RequestError(f"grammar: the JSON schema is not valid JSON ({e})") from e
        return json_schema_grammar(value)
    if not isinstance(value, str):
        raise RequestError(f"grammar: a {kind} grammar must be a string")
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    try:
        return llguidance.grammar_from("grammar", value)
    except ValueError as e:
        raise RequestError(f"grammar: {e}") from e


def tool_call_grammar(tools: Sequence[dict[str, Any]], only: str | None, parallel: bool) -> str:
    """Lark grammar forcing the Qwen/Hermes tool-call format: one call (of `only` if given),
    or with `parallel` one or more calls, each `<tool_call>\\n{json}\\n</tool_call>`."""
    options = []
    for tool in tools:
        fn = tool["function"]
        if only is not None and fn["name"] != only:
            continue
        params = fn.get("parameters") or {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    if not options:
        raise RequestError(f"tool_choice names function {only!r}, which is not in tools")
    schema = {"anyOf": options, "x-guidance": JSON_OPTIONS}
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    lark = (
        f'{start}\ncall: "<tool_call>\\n" obj "\\n</tool_call>"\nobj: %json {json.dumps(schema)}\n'
    )
    return llguidance.LLMatcher.grammar_from_lark(lark)


# ---- the processor ----------------------------------------------------------------------------
@dataclass
class RequestConstraint:
    """One request's constraint: a grammar matcher and/or additive logit biases."""

    matcher: llguidance.LLMatcher | None = None
    bias: dict[int, float] = field(default_factory=dict)
    consumed: list[int] = field(default_factory=list)

    def sync(self, history: Sequence[int]) -> None:
        """Bring the matcher to the state after `history` (the request's output tokens)."""
        if self.matcher is None:
            return
        n = len(self.consumed)
        if len(history) < n or (n and history[n - 1] != self.consumed[-1]):
            keep = 0
            while keep < min(n, len(history)) and history[keep] == self.consumed[keep]:
                keep += 1
            self.matcher.rollback(n - keep)
            del self.consumed[keep:]
        for t in history[len(self.consumed) :]:
            if not self.matcher.consume_token(int(t)):
                log.warning("grammar matcher refused token %d: %s", t, self.matcher.get_error())
            self.consumed.append(int(t))


def fill_bitmask(
    matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int, words: int
) -> None:
    """Write the matcher's allowed-token bits into the first `words` words of row `row` of
    `bitmask` [R, W] int32 (CPU, contiguous). (llguidance.torch does the same, but importing it
    imports torch._dynamo, which costs seconds.)"""
    target = bitmask[row, :words]
    matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set to -inf the entries of `logits` [R, V] whose bit in `bitmask` [R, ceil(V/32)] int32
    is 0 (bit j of word w is token 32 * w + j). In place; returns `logits`."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()  # [R, V]
    return logits.masked_fill_(~allowed, -math.inf)


class ConstrainedLogits:
    """`LogitsProcessor` over the constrained requests. Used only from the engine thread."""

    def __init__(self, mask_words: int, eos_token_ids: Sequence[int] = ()) -> None:
        self._requests: dict[str, RequestConstraint] = {}
        self._mask_words = mask_words
        self._eos = [int(t) for t in eos_token_ids]

    def add(self, request_id: str, constraint: RequestConstraint) -> None:
        self._requests[request_id] = constraint

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        """Whether a request is constrained (the engine does not speculate for those)."""
        return request_id in self._requests

    def apply(
        self,
        logits: torch.Tensor,
        request_ids: Sequence[str],
        output_token_ids: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        if not self._requests:
            return logits
        rows = [(i, self._requests[r]) for i, r in enumerate(request_ids) if r in self._requests]
        if not rows:
            return logits
        vocab = logits.shape[1]
        guided = [(i, c) for i, c in rows if c.matcher is not None]
        if guided:
            words = max((vocab + 31) // 32, self._mask_words)
            bitmask = torch.zeros(len(guided), words, dtype=torch.int32)  # [G, W]
            for k, (i, c) in enumerate(guided):
                c.sync(output_token_ids[i])
                fill_bitmask(c.matcher, bitmask, k, self._mask_words)
            self._never_empty(bitmask)
            index = torch.tensor([i for i, _ in guided], device=logits.device)
            masked = apply_token_bitmask(logits.index_select(0, index), bitmask.to(logits.device))
            logits.index_copy_(0, index, masked)
        for i, c in rows:
            for token, bias in c.bias.items():
                if token < vocab:
                    logits[i, token] += bias
        return logits

    def _never_empty(self, bitmask: torch.Tensor) -> None:
        """A matcher in an error state may allow nothing: let such rows end with EOS."""
        empty = (bitmask == 0).all(dim=1).nonzero().flatten().tolist()
        for row in empty:
            for t in self._eos:
                word, bit = divmod(t, 32)
                value = 1 << bit
                bitmask[row, word] |= value - (1 << 32) if value >= 1 << 31 else value

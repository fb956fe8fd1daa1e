"""The proposer interface of speculative decoding, its inputs and outputs, and the registry.

A proposer guesses the next tokens of a request; the target model verifies the guesses in one
pass (`sampling.rejection.rejection_sample`) and keeps the longest accepted prefix plus one token
of its own. Proposals are guesses only: whatever a proposer returns, the output is the target's
(greedy: token for token; sampled: the same distribution). A bad proposer costs time, never
correctness. This module imports no torch: the n-gram proposer and the picker are pure Python.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from moestream.errors import RequestError

SPECULATIVE_MODES = ("off", "ngram", "draft", "auto")

# Proposer name -> "module:Class", imported on first use so that picking "ngram" never imports
# torch. MTP heads and block drafters are added here.
PROPOSERS: dict[str, str] = {
    "ngram": "moestream.spec.ngram:NgramProposer",
    "draft": "moestream.spec.draft:DraftModelProposer",
}


def proposer_class(name: str) -> type[Proposer]:
    """The Proposer subclass registered under `name` (ValueError if none is)."""
    if name not in PROPOSERS:
        raise ValueError(f"unknown proposer {name!r} (known: {', '.join(sorted(PROPOSERS))})")
    module, cls = PROPOSERS[name].split(":")
    return getattr(importlib.import_module(module), cls)


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (`--speculative`, `--draft-model`, `--num-speculative-tokens`).

    `mode`: off | ngram | draft | auto (auto: every proposer that is available; the picker
    chooses per request and step, and plain decode whenever speculation does not pay).
    `max_k`: most drafts per request and step. `ngram_min`/`ngram_max`: n-gram sizes looked up,
    longest first. `explore_interval`: steps a request goes without trying a proposer beyond
    the picker's own choice before it is tried once with a longer k (the interval doubles
    after each try, up to `explore_max_interval`, and resets when the picker itself goes
    further); the estimated extra time of all tries stays within `explore_budget` of the
    measured time. `min_gain`: relative speed-up the picker needs before it prefers
    speculation to plain decode. `ema_alpha`: weight of a new acceptance observation.
    `idle_budget`: share of the step time that proposal rounds drafting nothing may cost in
    host work (proposers, picker): while rounds draft nothing, whole rounds are skipped, more
    and more, up to what stays within it (`Speculator.draft`; 0: never skip). A lower budget
    costs a request that starts copying late more steps before its first drafts.
    `always`: skip the picker and draft as many tokens as the first proposer with a proposal
    gives (up to max_k) at every decode step (no round is skipped, no step queued ahead): for
    tests and acceptance measurements (tau and acceptance by position at a fixed k), not for
    speed.
    """

    mode: str = "off"
    draft_model: str | None = None
    max_k: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    explore_interval: int = 16
    explore_max_interval: int = 512
    explore_budget: float = 0.01
    min_gain: float = 0.03
    ema_alpha: float = 0.2
    idle_budget: float = 0.0025
    always: bool = False

    def __post_init__(self) -> None:
        if self.mode not in SPECULATIVE_MODES:
            raise RequestError(
                f"--speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {self.mode!r}"
            )
        if self.mode == "draft" and not self.draft_model:
            raise RequestError("--speculative draft needs --draft-model PATH")
        if not 1 <= self.max_k <= 64:
            raise RequestError(f"--num-speculative-tokens must be in 1..64, got {self.max_k}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise RequestError(
                f"n-gram sizes must satisfy 1 <= min <= max, got {self.ngram_min}..{self.ngram_max}"
            )
        if not 1 <= self.explore_interval <= self.explore_max_interval:
            raise RequestError(
                f"explore interval must satisfy 1 <= interval <= max, got "
                f"{self.explore_interval}..{self.explore_max_interval}"
            )
        if not 0 <= self.explore_budget < 1:
            raise RequestError(f"explore_budget must be in [0, 1), got {self.explore_budget}")
        if not 0 <= self.min_gain < 1:
            raise RequestError(f"min_gain must be in [0, 1), got {self.min_gain}")
        if not 0 <= self.idle_budget < 1:
            raise RequestError(f"idle_budget must be in [0, 1), got {self.idle_budget}")
        if not 0 < self.ema_alpha <= 1:
            raise RequestError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def proposer_names(self) -> tuple[str, ...]:
        """Proposers this mode uses (auto uses the draft model only when one is given)."""
        if self.mode == "auto":
            return ("ngram", "draft") if self.draft_model else ("ngram",)
        return () if self.mode == "off" else (self.mode,)


@dataclass
class ProposalInput:
    """One request that wants drafts for its next step.

    `prompt_token_ids` and `output_token_ids` are the request's own lists (read-only): the
    request's tokens so far, the last of which is fed next step, followed by the drafts.
    Proposers read only what they have not seen, so a step costs O(new tokens + k), not
    O(length). `num_drafts` is how many drafts to propose at most (k >= 1).
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    num_drafts: int
    temperature: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return list(self.prompt_token_ids[start:end])
        if start >= p:
            return list(self.output_token_ids[start - p : end - p])
        return list(self.prompt_token_ids[start:]) + list(self.output_token_ids[: end - p])


@dataclass
class Proposal:
    """Drafted tokens for one request, in order; 1 <= len(token_ids) <= num_drafts.

    `probs` is None for deterministic drafts (n-gram lookup, greedy draft model), which
    `rejection_sample(draft_probs=None)` verifies exactly (q is one-hot); a proposer that
    samples its drafts gives their distributions here ([k, V] float32 tensor).
    """

    token_ids: list[int]
    probs: Any = None
    meta: dict[str, Any] = field(default_factory=dict)  # e.g. the n-gram match length


class Proposer(ABC):
    """Guesses continuations of requests. Contract:

    - `propose` returns, for some of `inputs`, a Proposal of 1..num_drafts tokens; a request
      with nothing to propose is left out. Proposals never change the output, only its speed.
    - Per-request state (an n-gram index, a draft KV cache) is kept between calls and brought
      up to date from the tokens the request has when called: tokens only ever append, and
      drafts proposed earlier may have been rejected, so a proposer checks what it assumed.
    - `release(request_id)` drops that state (request finished, aborted or preempted); it is a
      no-op for unknown ids. A released id may come back later as a new request.
    - `costs_forward` is True when proposing runs a model forward per drafted position (the
      picker then weighs its measured time), False when proposing is nearly free.
    """

    name: ClassVar[str]
    costs_forward: ClassVar[bool] = False
    # Model forwards the last `propose` ran (a `costs_forward` proposer): the picker prices a
    # drafted position at the call's time over these. 0: one per drafted position.
    last_forwards: int = 0

    @abstractmethod
    def propose(self, inputs: Sequence[ProposalInput]) -> dict[str, Proposal]:
        """Drafts for `inputs`, keyed by request id (see the class contract)."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Forget the state kept for `request_id`."""

    def request_ids(self) -> list[str]:
        """Ids of the requests this proposer keeps state for."""
        return []

"""Plain data that flows between server, engine, scheduler and runner. No torch here.

`Request` is the scheduler's view of one generation; `StepPlan` is what the scheduler hands the
runner for one forward pass; `StepOutput` is what the engine streams back. See `StepPlan` for the
runner's contract.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from moestream.errors import RequestError

MAX_LOGPROBS = 20


def _bad(name: str, rule: str, value: object) -> RequestError:
    return RequestError(f"invalid sampling parameter {name}: must be {rule}, got {value!r}")


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction (RequestError).

    `top_k` of -1 or 0 means no top-k. `stop` strings are matched by the engine's detokenizer
    (which calls `Scheduler.finish`); `stop_token_ids` and EOS are checked by the scheduler, and
    the stopping token is kept in the request's output token ids.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_number(t) or not (0 <= t < math.inf):
            raise _bad("temperature", "a finite number >= 0", t)
        if not _is_number(self.top_p) or not (0 < self.top_p <= 1):
            raise _bad("top_p", "in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", "-1 or 0 (off) or an integer >= 1", self.top_k)
        if not _is_number(self.min_p) or not (0 <= self.min_p <= 1):
            raise _bad("min_p", "in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not (-2 <= v <= 2):
                raise _bad(name, "in [-2, 2]", v)
        rp = self.repetition_penalty
        if not _is_number(rp) or not (0 < rp < math.inf):
            raise _bad("repetition_penalty", "a finite number > 0", rp)
        if self.seed is not None and not _is_int(self.seed):
            raise _bad("seed", "an integer or null", self.seed)
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _bad("max_tokens", "an integer >= 1", self.max_tokens)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise _bad("stop", "a list of non-empty strings", self.stop)
        object.__setattr__(self, "stop", list(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise _bad("stop_token_ids", "a list of token ids >= 0", ids)
        object.__setattr__(self, "stop_token_ids", list(ids))
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", "a boolean", self.ignore_eos)
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not (0 <= lp <= MAX_LOGPROBS)):
            raise _bad("logprobs", f"null or an integer in [0, {MAX_LOGPROBS}]", lp)
        if self.n != 1:
            raise _bad("n", "1 (one completion per request)", self.n)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0 or self.top_k == 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waits at the front of the queue to recompute
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"  # client went away or cancelled
    FINISHED_ERROR = "error"  # the engine failed on this request

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason ("stop", "length", "abort", "error"), None if unfinished."""
        return self.value if self.is_finished else None


@dataclass(eq=False)
class Request:
    """One generation as the scheduler tracks it (mutable; owned by the scheduler once added).

    `num_computed_tokens` counts the tokens of `all_token_ids` whose KV is in the cache; the
    tokens after it are what the next steps feed. `block_ids` is the block table: block i holds
    positions [i * block_size, (i + 1) * block_size).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    # Prefix-cache namespace (LoRA id, multimodal hash, cache salt): equal tokens under different
    # keys never share blocks.
    cache_key: bytes | str | None = None
    eos_token_ids: tuple[int, ...] | None = None  # None: the scheduler's EOS ids
    arrival_time: float = 0.0  # engine clock, for metrics; the scheduler orders by arrival_order
    arrival_order: int = -1  # set by Scheduler.add_request
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # one per full block of all tokens
    draft_token_ids: list[int] = field(default_factory=list)  # proposals for the next step
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason


@dataclass
class ScheduledRequest:
    """One request's share of a step. See `StepPlan` for what the runner must do with it.

    Fed tokens are `token_ids + draft_token_ids`, token i at position `start_pos + i`.
    `block_ids` is the request's whole block table and covers every fed position. It is the
    request's own list, not a copy: read-only; an entry never changes while the request holds
    its blocks (the table only grows at the end; preemption and finishing start a new list), so
    a runner may keep device copies and send only the new tail.
    `prompt_token_ids`, `output_token_ids` and `sampling_params` are the request's own objects,
    shared for the sampler (penalties, seeds): read-only, current as of this step.
    """

    request_id: str
    token_ids: list[int]  # a prompt chunk, a recompute chunk, or the last sampled token
    start_pos: int  # == the request's num_computed_tokens when the plan was made
    block_ids: list[int]
    sample: bool  # True when the fed tokens reach the end of the request: sample from them
    draft_token_ids: list[int] = field(default_factory=list)  # speculative tokens to verify
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens fed this step, drafts included (what counts against the token budget)."""
        return len(self.token_ids) + len(self.draft_token_ids)

    @property
    def num_lookahead_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def is_decode(self) -> bool:
        """One fed token (plus drafts) that is sampled from: a decode or verify step."""
        return len(self.token_ids) == 1 and self.sample


@dataclass
class StepPlan:
    """What one forward pass computes. Produced by `Scheduler.schedule`, consumed by the runner.

    Runner contract, for each `s` in `scheduled` (in this order; a request appears at most once):
    - Feed `s.token_ids + s.draft_token_ids`; token i sits at position `p = s.start_pos + i`.
      Its K/V go to slot `s.block_ids[p // block_size] * block_size + p % block_size`.
    - Token at position p attends to positions 0..p of the same request: the K/V of positions
      below `s.start_pos` are already in the pool at the slots the block table gives (computed by
      earlier steps or shared from the prefix cache). Shared blocks are full and never written.
    - If `s.sample` is False (a prompt chunk that does not reach the end), no token is sampled;
      leave the request out of `sampled` or give it an empty list.
    - If `s.sample` is True and there are no drafts, sample one token from the logits of the
      last fed token: `sampled[s.request_id] = [t]`.
    - With drafts d_0..d_{k-1}: verify them from the logits at the last of `s.token_ids` and at
      each draft; return the accepted drafts followed by one more sampled token:
      `[d_0, ..., d_{a-1}, t]` with 0 <= a <= k.
    Then call `Scheduler.update(plan, sampled)`. `preempted_ids` and `finished_ids` name requests
    whose blocks were freed since the previous plan: drop any per-request state kept for them
    (a preempted request comes back later with `start_pos` set to its prefix-cache hit or 0).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Total tokens fed this step (prefill chunks, decodes and drafts)."""
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RequestOutput:
    """What one step produced for one request. Text fields are filled by the engine."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    text: str = ""  # all text so far
    delta_text: str = ""  # text added by this step
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


@dataclass
class StepOutput:
    """Everything one engine step produced."""

    outputs: list[RequestOutput] = field(default_factory=list)
    num_tokens: int = 0  # tokens fed to the model this step

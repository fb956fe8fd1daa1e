"""Continuous-batching scheduler with chunked prefill, prefix caching and preemption.

Every request is a token sequence of which `num_computed_tokens` have K/V in the pool; a step
feeds some of the rest. One code path serves prefill, chunked prefill, decode, recompute after
preemption and (later) draft verification.

Each `schedule()` spends a token budget of `max_num_batched_tokens`, in this order:
1. running requests with one token left (decodes), oldest first;
2. running requests still prefilling, oldest first, each chunked to the budget left;
3. waiting requests in arrival order (FIFO; the head blocks the rest), each starting from its
   prefix-cache hit and chunked to the budget left. Skipped in a step that preempted.
A running request that cannot get a block for even one token preempts the most recently
arrived running request (possibly itself) by recompute: its blocks are freed and it returns to
the front of the queue with `num_computed_tokens = 0`, keeping its output tokens, so that it
later feeds prompt + outputs again. The oldest request can always make progress (admission
checks it fits the whole pool), so no request starves. A chunk shrinks to the blocks that can
be had before anything is preempted.

Invariant: every running request arrived before every waiting one, and both lists stay sorted
by arrival.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from moestream.cache.block_allocator import BlockAllocator
from moestream.cache.prefix_cache import PrefixCache, extend_block_hashes
from moestream.errors import CapacityError, RequestError
from moestream.types import Request, RequestStatus, ScheduledRequest, StepPlan

_STATUS_OF_REASON = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
    "error": RequestStatus.FINISHED_ERROR,
}


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_free_blocks: int  # free + cached-but-unreferenced
    num_cached_blocks: int
    num_preemptions: int
    prefix_queries: int
    prefix_query_tokens: int
    prefix_hit_tokens: int


@dataclass
class _Step:
    budget: int
    entries: dict[str, ScheduledRequest] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)


class Scheduler:
    """Plans steps over a shared paged KV pool of `num_blocks` blocks of `block_size` tokens."""

    def __init__(
        self,
        *,
        block_size: int,
        num_blocks: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        for name, v in (
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.prefix_cache = PrefixCache(self.allocator) if enable_prefix_caching else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._next_arrival = 0
        self._finished_ids: list[str] = []
        self.num_preemptions = 0

    # ---- requests in and out ---------------------------------------------------------------
    def add_request(self, request: Request, eos_token_ids: Sequence[int] | None = None) -> None:
        """Queue a request. `eos_token_ids`, if given, replaces the scheduler's EOS ids for
        this request (still skipped under `ignore_eos`). Raises RequestError if the request is
        malformed or can never fit in max_model_len, CapacityError if it can never fit in the
        whole KV pool."""
        rid, n = request.request_id, request.num_prompt_tokens
        max_tokens = request.sampling_params.max_tokens
        if rid in self._requests:
            raise RequestError(f"request id {rid!r} is already in use")
        if n == 0:
            raise RequestError(f"request {rid!r} has an empty prompt")
        if n + max_tokens > self.max_model_len:
            raise RequestError(
                f"request {rid!r}: prompt of {n} tokens plus max_tokens {max_tokens} exceeds "
                f"the maximum context length of {self.max_model_len} tokens"
            )
        # The last sampled token is never fed, so n + max_tokens - 1 positions hold K/V.
        need = self.allocator.blocks_needed(n + max_tokens - 1)
        if need > self.allocator.num_blocks:
            raise CapacityError(
                f"request {rid!r}: prompt of {n} tokens plus max_tokens {max_tokens} needs {need} "
                f"KV blocks of {self.block_size} tokens, but the pool has only "
                f"{self.allocator.num_blocks}"
            )
        if eos_token_ids is not None:
            request.eos_token_ids = tuple(eos_token_ids)
        request.arrival_order = self._next_arrival
        self._next_arrival += 1
        request.status = RequestStatus.WAITING
        self._requests[rid] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request as aborted at any time, freeing its blocks. None if unknown."""
        return self.finish(request_id, "abort")

    def finish(
        self, request_id: str, reason: str = "stop", stop_reason: int | str | None = None
    ) -> Request | None:
        """Finish a request for `reason` ("stop" for a stop string, "abort", "error",
        "length"), freeing its blocks. None if the request is unknown or already finished."""
        if reason not in _STATUS_OF_REASON:
            raise ValueError(f"unknown finish reason {reason!r}")
        req = self._requests.get(request_id)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, _STATUS_OF_REASON[reason], stop_reason)
        return req

    def get(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        cache = self.prefix_cache
        s = cache.stats if cache else None
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_used_blocks=self.allocator.num_used,
            num_free_blocks=self.allocator.num_free,
            num_cached_blocks=cache.num_cached_blocks if cache else 0,
            num_preemptions=self.num_preemptions,
            prefix_queries=s.queries if s else 0,
            prefix_query_tokens=s.query_tokens if s else 0,
            prefix_hit_tokens=s.hit_tokens if s else 0,
        )

    # ---- planning --------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Plan the next step (see the module docstring for the policy)."""
        step = _Step(budget=self.max_num_batched_tokens)
        running = self.running  # preemption removes from it while we walk it
        prefilling = False
        i = 0
        while i < len(running) and step.budget > 0:
            req = running[i]
            i += 1
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining == 1:
                self._schedule_running(req, step, remaining)
            else:
                prefilling = True
        i = 0
        while prefilling and i < len(running) and step.budget > 0:
            req = running[i]
            i += 1
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining != 1 and req.request_id not in step.entries:
                self._schedule_running(req, step, remaining)
        if not step.preempted:
            self._admit_waiting(step)
        plan = StepPlan(list(step.entries.values()), step.preempted, self._finished_ids)
        self._finished_ids = []
        return plan

    def _schedule_running(self, req: Request, step: _Step, remaining: int) -> None:
        """Schedule `remaining` (its tokens not yet computed) or as many as fit of a running
        request, preempting the most recently arrived ones while no block can be had."""
        num_new = min(remaining, step.budget)
        drafts: list[int] = []
        if remaining == 1 and req.draft_token_ids:
            # k drafts can yield k + 1 tokens; never let that pass max_tokens.
            room = req.sampling_params.max_tokens - req.num_output_tokens - 1
            drafts = req.draft_token_ids[: max(0, min(room, step.budget - 1))]
        if len(req.block_ids) * self.block_size >= req.num_computed_tokens + num_new + len(drafts):
            self._add_entry(req, num_new, drafts, step)  # its blocks hold it: nothing to get
            return
        while True:
            held = len(req.block_ids) + self.allocator.num_free
            fit = held * self.block_size - req.num_computed_tokens  # positions we could cover
            if fit >= 1:
                num_new = min(num_new, fit)
                drafts = drafts[: fit - num_new]
                break
            victim = self.running[-1]  # the most recently arrived
            self._preempt(victim, step)
            if victim is req:
                return
        need = self.allocator.blocks_needed(req.num_computed_tokens + num_new + len(drafts))
        if need > len(req.block_ids):  # rejected drafts may have left spare blocks: keep them
            req.block_ids += self.allocator.allocate(need - len(req.block_ids))
        self._add_entry(req, num_new, drafts, step)

    def _admit_waiting(self, step: _Step) -> None:
        while self.waiting and step.budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit = self._lookup_prefix(req)
            num_hit = len(hit) * self.block_size
            revived = sum(1 for b in hit if self.allocator.ref_count(b) == 0)
            free = self.allocator.num_free - revived
            fit = (len(hit) + free) * self.block_size - num_hit
            num_new = min(req.num_tokens - num_hit, step.budget, fit)
            if num_new < 1:
                break  # FIFO: nothing behind the head goes first
            self.allocator.incref(hit)
            need = self.allocator.blocks_needed(num_hit + num_new) - len(hit)
            req.block_ids = hit + self.allocator.allocate(need)
            req.num_computed_tokens = num_hit
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_hit
                if self.prefix_cache is not None:
                    self.prefix_cache.stats.record(req.num_tokens, num_hit)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_entry(req, num_new, [], step)

    def _lookup_prefix(self, req: Request) -> list[int]:
        if self.prefix_cache is None:
            return []
        self._hash_blocks(req, req.num_tokens // self.block_size)
        return self.prefix_cache.lookup(req.block_hashes, req.num_tokens)

    def _hash_blocks(self, req: Request, num_blocks: int) -> None:
        """Make sure the first `num_blocks` full blocks of `req` are hashed."""
        known = len(req.block_hashes)
        if known < num_blocks:
            bs = self.block_size
            new_tokens = req.token_slice(known * bs, num_blocks * bs)
            extend_block_hashes(req.block_hashes, new_tokens, bs, req.cache_key)

    def _add_entry(self, req: Request, num_new: int, drafts: list[int], step: _Step) -> None:
        start = req.num_computed_tokens
        step.entries[req.request_id] = ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.token_slice(start, start + num_new),
            start_pos=start,
            block_ids=req.block_ids,
            sample=start + num_new == req.num_tokens,
            draft_token_ids=drafts,  # a new list: a slice of the request's, or []
            sampling_params=req.sampling_params,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
        )
        step.budget -= num_new + len(drafts)

    def _preempt(self, req: Request, step: _Step) -> None:
        self.running.remove(req)
        self._free_blocks(req)
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        entry = step.entries.pop(req.request_id, None)
        if entry is not None:
            step.budget += entry.num_tokens
        step.preempted.append(req.request_id)

    # ---- committing ------------------------------------------------------------------------
    def update(self, plan: StepPlan, sampled: dict[str, list[int]]) -> list[Request]:
        """Commit a step the runner has run: advance `num_computed_tokens`, append sampled
        tokens (accepted drafts then one more, see StepPlan), register newly full blocks in the
        prefix cache and finish requests that hit EOS, a stop token id, max_tokens or
        max_model_len. Returns the requests finished by this step. Requests finished or
        aborted since `plan` was made are skipped."""
        finished = []
        for s in plan.scheduled:
            req = self._requests.get(s.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            tokens = sampled.get(s.request_id) or []
            if s.sample != bool(tokens) or len(tokens) > 1 + len(s.draft_token_ids):
                raise ValueError(
                    f"runner returned {tokens} for {s.request_id!r} "
                    f"(sample={s.sample}, {len(s.draft_token_ids)} drafts)"
                )
            if len(tokens) > 1 and tokens[:-1] != s.draft_token_ids[: len(tokens) - 1]:
                raise ValueError(
                    f"runner accepted tokens {tokens[:-1]} that are not drafts "
                    f"{s.draft_token_ids} of {s.request_id!r}"
                )
            req.num_computed_tokens = s.start_pos + len(s.token_ids)
            if req.draft_token_ids:
                req.draft_token_ids = []
            status = None
            for j, t in enumerate(tokens):
                if j:
                    req.num_computed_tokens += 1  # the previous token was a verified draft
                req.output_token_ids.append(t)
                status = self._stop_status(req, t)
                if status is not None:
                    break
            self._cache_computed_blocks(req, s.start_pos)
            if status is not None:
                self.running.remove(req)
                self._finish(req, status, req.stop_reason)
                finished.append(req)
        return finished

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if token in params.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        eos = self.eos_token_ids if req.eos_token_ids is None else req.eos_token_ids
        if not params.ignore_eos and token in eos:
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _cache_computed_blocks(self, req: Request, old_computed: int) -> None:
        if self.prefix_cache is None:
            return
        first, end = old_computed // self.block_size, req.num_computed_tokens // self.block_size
        if end > first:
            self._hash_blocks(req, end)
            self.prefix_cache.insert(req.block_hashes[first:end], req.block_ids[first:end])

    def _finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None) -> None:
        self._free_blocks(req)
        req.status = status
        req.stop_reason = stop_reason
        req.draft_token_ids = []
        del self._requests[req.request_id]
        self._finished_ids.append(req.request_id)

    def _free_blocks(self, req: Request) -> None:
        self.allocator.free(reversed(req.block_ids))
        req.block_ids = []

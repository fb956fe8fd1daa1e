"""`Speculator`: the proposers and the `Picker` behind one object the engine drives: each step
it asks the picker which requests draft (and how many tokens), collects the drafts, and after
the verify pass feeds the measured step time and the accepted lengths back."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from moestream.spec.base import Proposal, ProposalInput, Proposer, SpecConfig
from moestream.spec.ngram import NgramProposer
from moestream.spec.picker import Candidate, Choice, Picker
from moestream.spec.stats import SpecStats
from moestream.types import Request, StepPlan

# Most proposal rounds skipped in a row while rounds draft nothing (`Speculator.draft`): bounds
# how long a request that starts to repeat itself waits for its first n-gram drafts (128 steps:
# ~30 ms on a 0.23 ms step; a larger model's longer steps reach `SpecConfig.idle_budget` with
# fewer skips). At 64 the cap, not the budget, bounded a tiny model's rounds on the H200: a
# round of ~130 us within 0.5% of a 0.23 ms step asked for ~110 skips. (The budget is 0.25% now
# that a round no longer indexes the skipped tokens: ~8-10 us on the CPU instead of ~18.)
IDLE_MAX_SKIP = 128
# Rounds skipped in a row while every proposer is a priced-out model arm (`Picker.priced_out`:
# no draft could pay even if all were accepted), new requests included: only the costs can
# change that, and a round re-measures them.
IDLE_PRICED_OUT_SKIP = 1024
# Rounds in a row that draft nothing before the speculator counts as idle: from the next one
# on, rounds are skipped (`Speculator.draft`) and the runner may queue plain steps ahead
# (`Speculator.run_ahead`). A copy that pauses for a renamed variable resumes within them.
IDLE_AFTER = 3
# A request new to decoding restarts the ramp of skipped rounds (with a free proposer: its text
# may be worth copying within a few tokens) while at least this share of the requests that
# finished lately drafted (`Speculator.drafting_share`, an EMA over finished requests with
# weight DRAFTING_ALPHA, starting at 1). Below it, a new request gets its own round and the
# skipping goes on where it was: on sampled prose the restarts were ~5 extra rounds per
# 128-token request, ~2.5% of the tiny pair's time on the H200.
RESTART_SHARE = 0.25
DRAFTING_ALPHA = 0.25


class Speculator:
    """Proposers, picker and counters together: all the engine calls for speculation.

    Each step (the integration recipe is in `moestream/spec/__init__.py`):
    0. once the step is planned: if `skips(plan)`, the round after it is skipped (nothing was
       drafted for it and nothing will be): run and commit the step, then `skip(seconds)`
       with its cost; that is all (a few attribute reads and writes);
    1. otherwise, after the runner ran `plan` (verifying drafts): `end_idle()` hands the
       picker the skipped steps' time, `observe(plan, sampled)` records the acceptance of
       every verified request and drops state of preempted and finished requests;
    2. after the scheduler committed the step: `record_step_time(n, seconds, ahead)` with the
       step's whole cost (schedule, forward, commit; the host work of the round that drafted
       for it is added here: for small models on a GPU that host work is what decides whether
       drafts pay), then `draft(scheduler.running, queued=...)` sets
       `Request.draft_token_ids` of the requests that decode next (`draft_forward_seconds`
       then holds its draft-model forwards); the scheduler feeds them.
    `run_ahead` (after `draft`) says whether the runner may queue a plain step before the
    host has read the previous step's tokens (`ModelRunner.run_ahead`). A queued step that
    the next plan does not match (it carries drafts) would still cost the device its time,
    so a round whose next step is already queued (`queued`) drafts nothing: when it would
    have drafted, it turns run-ahead off instead, and the next round drafts (`propose`).
    Drafts are guesses: the output never depends on them, only the speed does.
    """

    def __init__(self, config: SpecConfig, proposers: Sequence[Proposer]) -> None:
        self.config = config
        self.proposers = {p.name: p for p in proposers}
        self._free = any(not p.costs_forward for p in proposers)  # a proposer without forwards
        self.picker = Picker(
            [p.name for p in proposers],
            config.max_k,
            model_arms=[p.name for p in proposers if p.costs_forward],
            explore_interval=config.explore_interval,
            explore_max_interval=config.explore_max_interval,
            explore_budget=config.explore_budget,
            min_gain=config.min_gain,
            ema_alpha=config.ema_alpha,
        )
        self._stats = SpecStats()  # (`stats`: with the skipped steps not yet counted)
        self._pending: dict[str, Choice] = {}  # drafts handed out, awaiting verification
        self._probs: dict[str, Any] = {}
        self.draft_forward_seconds = 0.0  # draft-model forwards of the last `propose`
        self._skip = 0  # proposal rounds left to skip (`draft`)
        self._idle_rounds = IDLE_AFTER - 1  # rounds in a row that drafted nothing
        self._round_size = 0  # requests that decoded at the last round
        self._round_host = 0.0  # host seconds of rounds not yet charged to a timed step
        self._idle_steps = 0  # steps of skipped rounds not yet handed to the picker...
        self._idle_seconds = 0.0  # ... and their seconds
        self._idle_counted = 0  # ... of which counted as plain request-steps (`_count_idle`)
        # Shadow drafts (`_shadow_check`): request id -> [(arm, its output list, output length
        # at the proposal, proposed tokens)]
        self._shadows: dict[str, list[tuple[str, Sequence[int], int, list[int]]]] = {}
        self._round_ids: set[str] = set()  # requests of the last round that proposed
        self.deferred = False  # the last round would have drafted, but its step was queued
        self._priced_out = False  # the last round found every arm priced out (`_round`)
        self._withheld: dict[str, int] = {}  # rounds in a row a priced-out arm was withheld
        self._drafted: set[str] = set()  # requests a round drafted for (tries aside)
        self.drafting_share = 1.0  # EMA over finished requests: 1 if one drafted, else 0
        self.restart_share = RESTART_SHARE  # (0: new requests always restart the ramp)

    @classmethod
    def from_config(
        cls,
        config: SpecConfig,
        *,
        vocab_size: int,
        target_tokens: Sequence[str] | None = None,
        device: Any = "cpu",
        dtype: Any = None,
        block_size: int = 16,
        draft_num_blocks: int | None = None,
    ) -> Speculator | None:
        """The speculator for `config` (None when off). Loads `config.draft_model` when the
        mode uses it; ModelFormatError when its vocabulary differs from the target's
        (`vocab_size`, and `target_tokens`, the target GGUF's `tokenizer.ggml.tokens`, if
        given)."""
        if not config.enabled:
            return None
        proposers: list[Proposer] = []
        for name in config.proposer_names:
            if name == "ngram":
                proposers.append(NgramProposer(config.ngram_min, config.ngram_max))
            elif name == "draft":
                from moestream.spec.draft import DraftModelProposer  # imports torch

                proposers.append(
                    DraftModelProposer.from_file(
                        str(config.draft_model),
                        vocab_size,
                        target_tokens=target_tokens,
                        device=device,
                        dtype=dtype,
                        block_size=block_size,
                        num_blocks=draft_num_blocks,
                    )
                )
        return cls(config, proposers)

    @property
    def stats(self) -> SpecStats:
        """The counters (verify steps per proposer, plain request-steps), up to date."""
        self._count_idle()
        return self._stats

    def _count_idle(self) -> None:
        """Count the skipped steps since the last count as plain decode of the last round's
        requests (`skip` leaves it until the counters are read or that round size changes)."""
        steps = self._idle_steps - self._idle_counted
        if steps > 0:
            self._stats.num_plain_steps += steps * self._round_size
        self._idle_counted = self._idle_steps

    # ---- proposing -------------------------------------------------------------------------
    @property
    def run_ahead(self) -> bool:
        """Whether the next plain step may be queued ahead: after `IDLE_AFTER` rounds in
        a row that drafted nothing, unless the last round held drafts back because its step
        was queued. Right after drafting, the next round is likely to draft again (a copy
        resumes after a renamed variable), and one that may not draft because its step is
        queued costs a step's delay."""
        if self.config.always:  # a draft at every step that has a proposal
            return False
        return self._idle_rounds >= IDLE_AFTER and not self.deferred

    def skips(self, plan: StepPlan) -> bool:
        """Whether the round after `plan` is skipped, as `draft` would decide, in O(1): rounds
        are being skipped and `plan` schedules as many requests as the last round decoded,
        none finished or preempted since. Then it decodes exactly those: the scheduler plans
        decodes first, and any other request (a new one, a prompt chunk) adds to the count.
        The engine then runs the step without the speculator and calls `skip`."""
        return (
            self._skip > 0
            and len(plan.scheduled) == self._round_size
            and not plan.finished_ids
            and not plan.preempted_ids
        )

    def skip(self, seconds: float) -> None:
        """A step whose round was skipped (`skips`) took `seconds`. Its time is summed with
        the other skipped rounds' steps: they reach the picker as one mean step at the next
        round (`end_idle`). Three counters, nothing else: the rest (the host time of the
        round before them, the plain steps' count) is settled once per stretch."""
        self._skip -= 1
        self._idle_steps += 1
        self._idle_seconds += seconds

    def end_idle(self, timed: bool = True) -> None:
        """Hand the picker the mean of the steps since the last round (`skip`) as one plain
        decode step that ran ahead, the host work of the round before them included (as
        `record_step_time` includes it). `timed` False: some of them captured a CUDA graph;
        they are dropped. Call before the next round's `record_step_time` and `draft`."""
        if not self._idle_steps:
            return
        self._count_idle()
        if timed:
            seconds = self._idle_seconds + self._round_host
            mean = seconds / self._idle_steps
            self.picker.record_step_time(self._round_size, mean, ahead=True)
            self.picker.time_measured += seconds - mean  # all of them ran
        self._round_host = 0.0
        self._idle_steps = self._idle_counted = 0
        self._idle_seconds = 0.0

    def draft(
        self,
        requests: Iterable[Request],
        base_tokens: int | Callable[[], int] | None = None,
        queued: bool = False,
    ) -> None:
        """Set `draft_token_ids` of each running request whose next step is a decode (one
        token left to feed) to this step's proposal, or [] for plain decode. `base_tokens`:
        as in `propose`, or a function giving it (called only by rounds that propose).
        `queued`: the runner has queued the next step ahead, as plain decode; drafts would
        make it wasted work, so the round drafts nothing (`propose`).

        A round costs host work (proposers, picker) whatever it decides. Where a step takes a
        fraction of a millisecond (small models on a GPU) that work alone can make a workload
        slower than plain decode. So while rounds draft nothing, rounds are skipped, more and
        more: after the n-th round in a row that drafted nothing, n > `IDLE_AFTER`, the next
        min(2^(n - IDLE_AFTER) - 1, IDLE_MAX_SKIP) rounds propose nothing, but no more than
        keeps a round's host work h within `SpecConfig.idle_budget` of the plain step time t:
        ceil(h / (idle_budget * t)) - 1. (h includes the proposers catching up on the tokens
        since the last round: the n-gram index scans rather than indexes them while its
        lookups are rare, `NgramIndex`.) A request that stops copying for a token or two (a
        renamed variable) loses no round; one that never copies costs little. A request that
        decodes for the first time since the last round gets a round (and, with a free
        proposer, while at least `RESTART_SHARE` of the requests that finished lately drafted,
        the skips ramp up from the start again); a round that drafts (or would
        have) ends the skipping; a round that drafts nothing but exploration tries does not
        count as drafting. Proposers catch up on skipped tokens at the next round. With model
        arms alone, all priced out (`Picker.priced_out`: no draft could pay even if every one
        were accepted), the next `IDLE_PRICED_OUT_SKIP` rounds are skipped, new requests'
        included: a round (~50-100 us of the picker's planning in Python) every 40-60 steps
        cost a 0.2 ms step 1.5-3.5% on the H200."""
        start = time.perf_counter()
        self.draft_forward_seconds = 0.0
        requests = requests if isinstance(requests, list) else list(requests)
        if self._idle_steps:  # (steps skipped, `end_idle` not called: the count stays right)
            self._count_idle()
        self._round(requests, base_tokens, queued, start)
        host = time.perf_counter() - start - self.draft_forward_seconds
        self._round_host += max(0.0, host)

    def _round(
        self,
        requests: list[Request],
        base_tokens: int | Callable[[], int] | None,
        queued: bool,
        start: float,
    ) -> None:
        if self._skip > 0 and len(requests) == len(self._round_ids):
            # the common skipped round, cheaply: the same requests as at the last round, whose
            # drafts that round (which drafted nothing) already cleared
            ids = self._round_ids
            if all(req.request_id in ids and not req.draft_token_ids for req in requests):
                self._skip -= 1
                self._stats.num_plain_steps += len(requests)
                return
        inputs = []
        new_request = False
        for req in requests:
            if req.draft_token_ids:
                req.draft_token_ids = []
            room = req.sampling_params.max_tokens - req.num_output_tokens - 1
            if req.is_finished or req.num_tokens - req.num_computed_tokens != 1 or room < 1:
                continue
            new_request = new_request or req.request_id not in self._round_ids
            inputs.append((req, room))
        if self._skip > 0 and (not new_request or self._priced_out):
            if self._priced_out and (new_request or len(inputs) != self._round_size):
                # requests came or went: `skips` keeps answering in O(1) for the new set
                self._round_ids = {req.request_id for req, _ in inputs}
                self._round_size = len(inputs)
            self._skip -= 1
            self._stats.num_plain_steps += len(inputs)
            return
        if new_request or len(inputs) != self._round_size:
            self._round_ids = {req.request_id for req, _ in inputs}
            self._round_size = len(inputs)
        self._skip = 0
        self.deferred = False
        if new_request and self._free and self.drafting_share >= self.restart_share:
            # Its first round comes now, and the skips ramp up again from the start: a free
            # proposer (n-gram) may find the new request's text worth copying within a few
            # tokens, as it did for many of the requests lately. A model arm's price does not
            # depend on the request (its acceptance starts from the estimate over all
            # requests), so with model arms alone, or when few requests lately drafted, the
            # new request has this round and the skipping goes on where it was. (Its first
            # round's proposal may still be tried, and a try whose drafts are all accepted is
            # followed by rounds at once: a request that copies is found that way.)
            self._idle_rounds = min(self._idle_rounds, IDLE_AFTER - 1)
        if not inputs:
            return
        proposals = self.propose(
            [
                ProposalInput(
                    req.request_id,
                    req.prompt_token_ids,
                    req.output_token_ids,
                    num_drafts=min(self.config.max_k, room),
                    temperature=req.sampling_params.temperature,
                )
                for req, room in inputs
            ],
            base_tokens,
            defer=queued,
        )
        if proposals:
            by_id = {req.request_id: req for req, _ in inputs}
            for rid, p in proposals.items():
                by_id[rid].draft_token_ids = list(p.token_ids)
            chosen = [rid for rid in proposals if not self._pending[rid].explore]
            if chosen:  # tries alone do not say that drafting resumes
                self._idle_rounds = 0
                self._drafted.update(chosen)
            self._priced_out = False
            return
        if self.deferred:  # the next round, its step not queued, drafts or counts as idle
            return
        self._idle_rounds += 1
        self._priced_out = False
        if self.config.always or self.config.idle_budget <= 0 or self._idle_rounds <= IDLE_AFTER:
            return
        if self.picker.priced_out(len(inputs)):  # never with a free arm
            self._priced_out = True
            self._skip = IDLE_PRICED_OUT_SKIP
            for name in self.picker.model_arms:  # skipped rounds count as withheld ones: the
                self._withheld[name] = self._withheld.get(name, 0) + self._skip  # next re-prices
            return
        step = self.picker.plain_time(len(inputs))  # of the decodes the skipped rounds skip
        host = time.perf_counter() - start - self.draft_forward_seconds
        need = math.ceil(host / (self.config.idle_budget * step)) - 1
        ramp = 2 ** min(self._idle_rounds - IDLE_AFTER, 8) - 1
        self._skip = max(0, min(IDLE_MAX_SKIP, ramp, need))

    def propose(
        self,
        inputs: Sequence[ProposalInput],
        base_tokens: int | Callable[[], int] | None = None,
        defer: bool = False,
    ) -> dict[str, Proposal]:
        """Proposals for the requests the picker lets speculate this step. `base_tokens`: as
        in `Picker.choose`, or a function giving it. `defer`: none; the picker is asked what
        it would choose without committing to it (no try is spent), and `deferred` says
        whether that was anything (the free proposers' proposals still count as shadow
        drafts)."""
        self.draft_forward_seconds = 0.0
        inputs = [i for i in inputs if i.num_drafts >= 1]
        if self._pending:
            for inp in inputs:
                self._pending.pop(inp.request_id, None)
                self._probs.pop(inp.request_id, None)
        if not inputs:
            return {}
        self._shadow_check()
        free = {
            name: p.propose(inputs) for name, p in self.proposers.items() if not p.costs_forward
        }
        offered = self._offered_model_arms(len(inputs))
        if not offered and not any(free.values()):
            self._stats.num_plain_steps += len(inputs)  # nothing to choose from, nothing to try
            return {}
        cands = []
        for inp in inputs:
            avail = {
                name: len(props[inp.request_id].token_ids)
                for name, props in free.items()
                if inp.request_id in props
            }
            for name in offered:
                avail[name] = inp.num_drafts
            cands.append(Candidate(inp.request_id, inp.num_drafts, avail))
        if self.config.always:
            choices = self._always(cands)
        else:
            n0 = base_tokens() if callable(base_tokens) else base_tokens
            choices = self.picker.choose(cands, n0, commit=not defer)
        if defer:
            self.deferred = any(c.arm is not None for c in choices.values())
            if self.deferred:
                choices = {c.request_id: Choice() for c in cands}
            else:
                self.picker.commit()
        out: dict[str, Proposal] = {}
        for name, p in self.proposers.items():
            chosen = [i for i in inputs if choices[i.request_id].arm == name]
            if not chosen:
                continue
            if p.costs_forward:
                ks = [choices[i.request_id].k for i in chosen]
                t0 = time.perf_counter()
                props = p.propose([replace(i, num_drafts=k) for i, k in zip(chosen, ks)])
                seconds = time.perf_counter() - t0
                self.draft_forward_seconds += seconds
                forwards = p.last_forwards or max(ks)
                self.picker.record_draft_time(name, len(chosen), forwards, seconds)
            else:
                props = free[name]
            for inp in chosen:
                prop = props.get(inp.request_id)
                choice = choices[inp.request_id]
                if prop is None or not prop.token_ids:
                    continue
                k = min(choice.k, len(prop.token_ids))
                probs = prop.probs[:k] if prop.probs is not None else None
                out[inp.request_id] = Proposal(prop.token_ids[:k], probs, prop.meta)
                self._pending[inp.request_id] = choice
                self._probs[inp.request_id] = probs
        self._stats.num_plain_steps += len(inputs) - len(out)
        self._shadow_keep(inputs, free, choices)
        return out

    def _offered_model_arms(self, num_requests: int) -> list[str]:
        """The model arms offered to the picker this round: not those priced out for
        `num_requests` requests (`Picker.arm_priced_out`: no draft of theirs could pay even if
        accepted), but for every `IDLE_PRICED_OUT_SKIP`-th round that would withhold one, so
        that the picker re-prices it (rounds skipped because every arm was priced out count
        among them, so the round after such a skip offers them). A round whose free proposers
        have nothing then asks
        the picker nothing (~50-100 us of planning in Python, which loops over each model
        arm's draft lengths: 4.6% of a 0.23 ms step of the tiny pair on the H200 with
        `auto`). With `SpecConfig.always` every model arm is offered (drafting is forced)."""
        out = []
        for name, p in self.proposers.items():
            if not p.costs_forward:
                continue
            if not self.config.always and self.picker.arm_priced_out(name, num_requests):
                withheld = self._withheld.get(name, 0) + 1
                if withheld < IDLE_PRICED_OUT_SKIP:
                    self._withheld[name] = withheld
                    continue
            self._withheld[name] = 0
            out.append(name)
        return out

    # ---- shadow drafts ---------------------------------------------------------------------
    # A free proposer (n-gram) proposes for every request at no cost, chosen or not. For a
    # greedy request the tokens plain decode then produces are exactly what verification
    # would have compared the drafts with, so a proposal the picker did not choose still
    # measures its acceptance: it is kept, and once the request has produced the tokens that
    # settle it (as many as drafted, or one that differs) the picker records it
    # (`Picker.record_shadow`). The picker then knows a proposer's acceptance without trying
    # it; tries are left to measure what verifying costs.
    # For a sampled request the same count is a sample of the same law: a deterministic
    # draft d_j (no probabilities: one-hot q) is accepted with probability p_j(d_j), and plain
    # decode draws d_j at that position with probability p_j(d_j) too, from the same
    # distribution after the same accepted prefix. So the number of leading drafts that plain
    # sampling reproduces is distributed as the number that verification would accept, and
    # a sampled request's shadows are kept as well (a proposal with probabilities is not).

    def _shadow_keep(
        self,
        inputs: Sequence[ProposalInput],
        free: Mapping[str, Mapping[str, Proposal]],
        choices: Mapping[str, Choice],
    ) -> None:
        for inp in inputs:
            chosen = choices[inp.request_id].arm
            for name, props in free.items():
                prop = props.get(inp.request_id)
                if name != chosen and prop is not None and prop.token_ids and prop.probs is None:
                    out = inp.output_token_ids
                    entry = (name, out, len(out), list(prop.token_ids))
                    self._shadows.setdefault(inp.request_id, []).append(entry)

    def _shadow_check(self) -> None:
        """Record every shadow proposal that the requests' new tokens now settle."""
        for rid in list(self._shadows):
            waiting = []
            for entry in self._shadows[rid]:
                arm, out, pos, drafts = entry
                seen = out[pos : pos + len(drafts)]
                a = 0
                while a < len(seen) and seen[a] == drafts[a]:
                    a += 1
                if a < len(seen) or len(seen) == len(drafts):  # a mismatch, or all seen
                    self.picker.record_shadow(rid, arm, len(drafts), a)
                else:
                    waiting.append(entry)
            if waiting:
                self._shadows[rid] = waiting
            else:
                del self._shadows[rid]

    def _always(self, cands: Sequence[Candidate]) -> dict[str, Choice]:
        """`SpecConfig.always`: the first proposer (in order) that can draft for a request
        drafts as much as it can; the picker is not asked."""
        choices = {}
        for c in cands:
            choices[c.request_id] = Choice()
            for name in self.proposers:
                k = min(c.available.get(name, 0), c.max_k)
                if k >= 1:
                    choices[c.request_id] = Choice(name, k)
                    break
        return choices

    @property
    def draft_model(self) -> Any:
        """The draft-model proposer, or None when this speculator runs none."""
        return self.proposers.get("draft")

    def draft_probs(self, request_id: str) -> Any:
        """[k, V] distributions the pending drafts of `request_id` were sampled from, or None
        (deterministic drafts: verify with `rejection_sample(draft_probs=None)`)."""
        return self._probs.get(request_id)

    # ---- feedback --------------------------------------------------------------------------
    def observe(self, plan: StepPlan, sampled: Mapping[str, list[int]]) -> None:
        """Record a step the runner ran: the acceptance of every request that carried drafts
        (`sampled[id]` = accepted drafts + one token), and release state of the plan's
        preempted and finished requests. Its cost goes to `record_step_time`."""
        if not (self._pending or plan.finished_ids or plan.preempted_ids):
            return  # nothing was drafted for this step, nobody left
        for s in plan.scheduled:
            out = sampled.get(s.request_id)
            if s.draft_token_ids and out:
                self.record_verification(s.request_id, len(s.draft_token_ids), len(out) - 1)
        for rid in plan.finished_ids:
            self._count_finished(rid)
        for rid in (*plan.preempted_ids, *plan.finished_ids):
            self.release(rid)

    def _count_finished(self, request_id: str) -> None:
        """`drafting_share` takes in a finished request (before its state is released)."""
        drafted = request_id in self._drafted
        self.drafting_share += DRAFTING_ALPHA * (drafted - self.drafting_share)

    def record_verification(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """The target verified `num_drafts` of the drafts proposed for `request_id` (the
        scheduler may have cut some) and accepted the first `num_accepted`."""
        choice = self._pending.pop(request_id, None)
        self._probs.pop(request_id, None)
        if choice is None or choice.arm is None or num_drafts < 1:
            return
        self.picker.record_verification(request_id, choice.arm, num_drafts, num_accepted)
        self._stats.record(choice.arm, num_drafts, num_accepted, choice.explore)

    def record_step_time(self, num_tokens: int, seconds: float, ahead: bool = False) -> None:
        """A step over `num_tokens` tokens took `seconds` (`ahead`: a plain step whose forward
        the runner had queued ahead); the host work of the rounds since the last timed step
        (the one that drafted for this step among them) is added to it."""
        self.picker.record_step_time(num_tokens, seconds + self._round_host, ahead)
        self._round_host = 0.0

    def release_all(self) -> None:
        """Drop the state of every request (the engine has none unfinished); measurements
        (costs, acceptance over all requests, counters) stay, and so do the count of idle
        rounds and `drafting_share` (which takes in these requests' ends): the next requests
        get a round each, and then, with model arms alone (whose price does not depend on the
        request) or few requests lately drafting, the skipping goes on where it was, as it
        does for requests that arrive while others run (`draft`)."""
        ids = {*self._pending, *self.picker._requests, *self._shadows, *self._drafted}
        for p in self.proposers.values():
            ids.update(p.request_ids())
        for rid in sorted(ids):  # all finished: their ends count as `observe` would count them
            self._count_finished(rid)
            self.release(rid)
        self._count_idle()
        self._skip = self._round_size = self._idle_steps = self._idle_counted = 0
        self._idle_seconds = self._round_host = 0.0
        self.deferred = False

    def release(self, request_id: str) -> None:
        """Drop every proposer's and the picker's state of `request_id`."""
        self._round_ids.discard(request_id)
        self._drafted.discard(request_id)
        self._shadows.pop(request_id, None)
        self._pending.pop(request_id, None)
        self._probs.pop(request_id, None)
        self.picker.release(request_id)
        for p in self.proposers.values():
            p.release(request_id)

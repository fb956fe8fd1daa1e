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
# how long a request that starts to repeat itself waits for its first n-gram drafts.
IDLE_MAX_SKIP = 64


class Speculator:
    """Proposers, picker and counters together: all the engine calls for speculation.

    Each step (the integration recipe is in `moestream/spec/__init__.py`):
    1. after the runner ran `plan` (verifying drafts): `observe(plan, sampled)` records the
       acceptance of every verified request and drops state of preempted and finished requests;
    2. after the scheduler committed the step: `record_step_time(n, seconds)` with the step's
       whole cost (schedule, forward, commit, and the host work of drafting for it: for small
       models on a GPU that host work is what decides whether drafts pay), then
       `draft(scheduler.running)` sets `Request.draft_token_ids` of the requests that decode
       next (`draft_forward_seconds` then holds its draft-model forwards); the scheduler feeds
       them.
    Drafts are guesses: the output never depends on them, only the speed does.
    """

    def __init__(self, config: SpecConfig, proposers: Sequence[Proposer]) -> None:
        self.config = config
        self.proposers = {p.name: p for p in proposers}
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
        self.stats = SpecStats()
        self._pending: dict[str, Choice] = {}  # drafts handed out, awaiting verification
        self._probs: dict[str, Any] = {}
        self.draft_forward_seconds = 0.0  # draft-model forwards of the last `propose`
        self._skip = 0  # proposal rounds left to skip (`draft`)
        # Shadow drafts (`_shadow_check`): request id -> [(arm, its output list, output length
        # at the proposal, proposed tokens)]
        self._shadows: dict[str, list[tuple[str, Sequence[int], int, list[int]]]] = {}
        self._round_ids: set[str] = set()  # requests of the last round that proposed

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

    # ---- proposing -------------------------------------------------------------------------
    def draft(
        self,
        requests: Iterable[Request],
        base_tokens: int | Callable[[], int] | None = None,
    ) -> None:
        """Set `draft_token_ids` of each running request whose next step is a decode (one
        token left to feed) to this step's proposal, or [] for plain decode. `base_tokens`:
        as in `propose`, or a function giving it (called only by rounds that propose).

        A round costs host work (proposers, picker) whatever it decides. Where a step takes a
        fraction of a millisecond (small models on a GPU) that work alone can make a workload
        slower than plain decode, so while rounds draft nothing, whole rounds are skipped:
        after an empty round that took h seconds of host work at a measured plain step time t,
        the next ceil(h / (idle_budget * t)) - 1 rounds (at most `IDLE_MAX_SKIP`) propose
        nothing, keeping idle rounds within `SpecConfig.idle_budget` of the step time. A
        request that decodes for the first time since the last round, or a round that drafts,
        ends the skipping. Proposers catch up on the skipped tokens at the next round."""
        start = time.perf_counter()
        self.draft_forward_seconds = 0.0
        requests = requests if isinstance(requests, list) else list(requests)
        if self._skip > 0 and len(requests) == len(self._round_ids):
            # the common skipped round, cheaply: the same requests as at the last round, whose
            # drafts that round (which drafted nothing) already cleared
            ids = self._round_ids
            if all(req.request_id in ids and not req.draft_token_ids for req in requests):
                self._skip -= 1
                self.stats.record_plain(len(requests))
                return
        inputs = []
        new_request = False
        for req in requests:
            req.draft_token_ids = []
            room = req.sampling_params.max_tokens - req.num_output_tokens - 1
            if req.is_finished or req.num_tokens - req.num_computed_tokens != 1 or room < 1:
                continue
            new_request = new_request or req.request_id not in self._round_ids
            inputs.append((req, room))
        if self._skip > 0 and not new_request:
            self._skip -= 1
            self.stats.record_plain(len(inputs))
            return
        self._round_ids = {req.request_id for req, _ in inputs}
        if callable(base_tokens):
            base_tokens = base_tokens()
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
        )
        by_id = {req.request_id: req for req, _ in inputs} if proposals else {}
        for rid, p in proposals.items():
            by_id[rid].draft_token_ids = list(p.token_ids)
        self._skip = 0
        if not proposals and inputs and not self.config.always and self.config.idle_budget > 0:
            host = time.perf_counter() - start - self.draft_forward_seconds
            step = self.picker.target_cost.upper(base_tokens or len(inputs))
            rounds = math.ceil(host / (self.config.idle_budget * step))
            self._skip = max(0, min(IDLE_MAX_SKIP, rounds) - 1)

    def propose(
        self, inputs: Sequence[ProposalInput], base_tokens: int | None = None
    ) -> dict[str, Proposal]:
        """Proposals for the requests the picker lets speculate this step."""
        self.draft_forward_seconds = 0.0
        inputs = [i for i in inputs if i.num_drafts >= 1]
        for inp in inputs:
            self._pending.pop(inp.request_id, None)
            self._probs.pop(inp.request_id, None)
        if not inputs:
            return {}
        self._shadow_check()
        free = {
            name: p.propose(inputs) for name, p in self.proposers.items() if not p.costs_forward
        }
        cands = []
        for inp in inputs:
            avail = {
                name: len(props[inp.request_id].token_ids)
                for name, props in free.items()
                if inp.request_id in props
            }
            for name, p in self.proposers.items():
                if p.costs_forward:
                    avail[name] = inp.num_drafts
            cands.append(Candidate(inp.request_id, inp.num_drafts, avail))
        if self.config.always:
            choices = self._always(cands)
        else:
            choices = self.picker.choose(cands, base_tokens)
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
                self.picker.record_draft_time(name, len(chosen), max(ks), seconds)
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
        self.stats.record_plain(len(inputs) - len(out))
        self._shadow_keep(inputs, free, choices)
        return out

    # ---- shadow drafts ---------------------------------------------------------------------
    # A free proposer (n-gram) proposes for every request at no cost, chosen or not. For a
    # greedy request the tokens plain decode then produces are exactly what verification
    # would have compared the drafts with, so a proposal the picker did not choose still
    # measures its acceptance: it is kept, and once the request has produced the tokens that
    # settle it (as many as drafted, or one that differs) the picker records it
    # (`Picker.record_shadow`). The picker then knows a proposer's acceptance without trying
    # it; tries are left to measure what verifying costs.

    def _shadow_keep(
        self,
        inputs: Sequence[ProposalInput],
        free: Mapping[str, Mapping[str, Proposal]],
        choices: Mapping[str, Choice],
    ) -> None:
        for inp in inputs:
            if inp.temperature > 0:
                continue
            chosen = choices[inp.request_id].arm
            for name, props in free.items():
                prop = props.get(inp.request_id)
                if name != chosen and prop is not None and prop.token_ids:
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
        for s in plan.scheduled:
            out = sampled.get(s.request_id)
            if s.draft_token_ids and out:
                self.record_verification(s.request_id, len(s.draft_token_ids), len(out) - 1)
        for rid in (*plan.preempted_ids, *plan.finished_ids):
            self.release(rid)

    def record_verification(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """The target verified `num_drafts` of the drafts proposed for `request_id` (the
        scheduler may have cut some) and accepted the first `num_accepted`."""
        choice = self._pending.pop(request_id, None)
        self._probs.pop(request_id, None)
        if choice is None or choice.arm is None or num_drafts < 1:
            return
        self.picker.record_verification(request_id, choice.arm, num_drafts, num_accepted)
        self.stats.record(choice.arm, num_drafts, num_accepted, choice.explore)

    def record_step_time(self, num_tokens: int, seconds: float) -> None:
        self.picker.record_step_time(num_tokens, seconds)

    def release_all(self) -> None:
        """Drop the state of every request (the engine has none unfinished); measurements
        (costs, acceptance over all requests, counters) stay."""
        ids = {*self._pending, *self.picker._requests, *self._shadows}
        for p in self.proposers.values():
            ids.update(p.request_ids())
        for rid in ids:
            self.release(rid)

    def release(self, request_id: str) -> None:
        """Drop every proposer's and the picker's state of `request_id`."""
        self._round_ids.discard(request_id)
        self._shadows.pop(request_id, None)
        self._pending.pop(request_id, None)
        self._probs.pop(request_id, None)
        self.picker.release(request_id)
        for p in self.proposers.values():
            p.release(request_id)

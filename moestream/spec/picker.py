"""The picker: per request and step, plain decode or a proposer and its draft length k, chosen
to maximise expected tokens per second from measured acceptance and measured step cost.

For a step of B decoding requests, request i drafting k_i tokens with arm (proposer) p_i emits
B + sum_i E_{p_i}[accepted | k_i] tokens, where E_p[accepted | k] = a_p[0] + ... + a_p[k-1] and
a_p[j] is the estimated probability that drafts 0..j are all accepted (`AcceptanceEMA`, per
request, started from the estimate over all requests). The step costs the target pass over
n0 + sum_i k_i tokens (measured `StepCostModel`; on an MoE, k extra tokens read the union of
their experts, which the measurement includes) plus, for an arm that runs a model, max_i k_i
draft forwards over its requests. Draft slots are added greedily by expected gain (each
request's a[j] is non-increasing, so the best m slots are the m largest gains); every prefix
and every cap on the model arms' k is priced, and the best rate wins if it beats plain decode
B / t(n0) by `min_gain`. Untried sizes are priced pessimistically for speculation and
optimistically for plain decode (`StepCostModel.upper/lower`), so the picker speculates only
on measured gains.

Exploration keeps the estimates alive and measures untried sizes. An arm available to a
request whose drafts have not been tried beyond the picker's own choice for `explore_interval`
of its steps is tried once with a longer k (the longest whose estimated extra cost fits). Each
try doubles the request's interval for that arm (up to `explore_max_interval`); an arm is
first tried as soon as it is available, and after a try whose drafts were all accepted, or
when the picker itself goes further, the next try comes at once. What the tries lose against
plain decode (their extra step time, estimated and then re-priced once measured, less the
plain-decode time of the tokens they got accepted) stays within `explore_budget` of the
measured time, so exploring cannot make a workload slower than plain decode by more than
that. Deterministic: no random draws.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from moestream.spec.base import Proposal, ProposalInput, Proposer, SpecConfig
from moestream.spec.ngram import NgramProposer
from moestream.spec.stats import AcceptanceEMA, SpecStats, StepCostModel
from moestream.types import Request, StepPlan


@dataclass(frozen=True)
class Choice:
    """What one request does this step: `arm` None is plain decode (k = 0)."""

    arm: str | None = None
    k: int = 0
    explore: bool = False


@dataclass
class Candidate:
    """A request that may speculate this step. `max_k`: most drafts it can take (config,
    max_tokens room). `available`: arm -> most drafts that arm can give it now (an n-gram
    proposer's match length, a draft model's max_k); arms missing cannot propose."""

    request_id: str
    max_k: int
    available: Mapping[str, int]


@dataclass
class _RequestState:
    acceptance: dict[str, AcceptanceEMA] = field(default_factory=dict)
    since_tried: dict[str, int] = field(default_factory=dict)  # steps since k beyond choice
    interval: dict[str, int] = field(default_factory=dict)
    chosen_k: dict[str, int] = field(default_factory=dict)  # the picker's last own k per arm


def default_prior(max_k: int) -> list[float]:
    """Acceptance assumed before any measurement: a[j] = 0.5^(j+1)."""
    return [0.5 ** (j + 1) for j in range(max_k)]


class Picker:
    """Chooses `Choice`s per request and step (see the module docstring).

    `arms`: proposer names in order of preference on ties; `model_arms`: those that run a model
    forward per drafted position, whose per-forward time `record_draft_time` feeds. Step times
    must be fed (`record_step_time`) for the picker to ever speculate.
    """

    def __init__(
        self,
        arms: Sequence[str],
        max_k: int,
        *,
        model_arms: Sequence[str] = (),
        explore_interval: int = 16,
        explore_max_interval: int = 512,
        explore_budget: float = 0.01,
        min_gain: float = 0.03,
        ema_alpha: float = 0.2,
        global_alpha: float = 0.05,
        prior: Sequence[float] | None = None,
    ) -> None:
        self.arms = tuple(arms)
        self.max_k = max_k
        self.model_arms = tuple(a for a in self.arms if a in model_arms)
        self.explore_interval = explore_interval
        self.explore_max_interval = explore_max_interval
        self.explore_budget = explore_budget
        self.min_gain = min_gain
        self.ema_alpha = ema_alpha
        prior = list(prior) if prior is not None else default_prior(max_k)
        self.global_acceptance = {a: AcceptanceEMA(max_k, global_alpha, prior) for a in arms}
        self.target_cost = StepCostModel()
        self.draft_cost = {a: StepCostModel() for a in self.model_arms}  # per forward, by batch
        self.time_measured = 0.0  # seconds of all recorded target and draft work
        self.explore_spent = 0.0  # estimated extra seconds of exploration so far
        self._unsettled: list[tuple[str, int, int, float]] = []  # last step's (arm, k, n0, cost)
        self._tries: dict[str, int] = {}  # request id -> n0 of its try awaiting verification
        self._requests: dict[str, _RequestState] = {}

    # ---- measurements --------------------------------------------------------------------
    def record_step_time(self, num_tokens: int, seconds: float) -> None:
        """A target forward (any step: prefill, decode, verify) over `num_tokens` tokens."""
        self.target_cost.record(num_tokens, seconds)
        self.time_measured += seconds

    def record_draft_time(
        self, arm: str, num_requests: int, num_forwards: int, seconds: float
    ) -> None:
        """`arm` drafted for `num_requests` requests in `num_forwards` forwards."""
        if num_requests > 0 and num_forwards > 0:
            self.draft_cost[arm].record(num_requests, seconds / num_forwards)
            self.time_measured += seconds

    def record_verification(
        self, request_id: str, arm: str, num_drafts: int, num_accepted: int
    ) -> None:
        """Of `num_drafts` drafts by `arm`, the target accepted the first `num_accepted`.
        A try (`Choice.explore`) is credited with the plain-decode time its accepted tokens
        saved: the budget bounds what exploring loses. A try whose drafts were all accepted
        is followed by another at the next step (so a proposer that keeps being right is used
        until the estimates catch up); any other leaves the doubled interval."""
        n0 = self._tries.pop(request_id, None)
        st = self._requests.setdefault(request_id, _RequestState())
        if n0 is not None:
            saved = num_accepted * self.target_cost.lower(n0) / n0
            self.explore_spent = max(0.0, self.explore_spent - saved)  # no credit is banked
            if num_accepted == num_drafts:  # all taken: a longer k may pay too, try at once
                st.interval[arm] = self.explore_interval
                st.since_tried[arm] = self.explore_interval - 1
        ema = st.acceptance.get(arm)
        if ema is None:
            ema = st.acceptance[arm] = self.global_acceptance[arm].copy(self.ema_alpha)
        ema.update(num_drafts, num_accepted)
        self.global_acceptance[arm].update(num_drafts, num_accepted)

    def acceptance(self, request_id: str, arm: str) -> list[float]:
        """The a[j] curve the picker uses for this request and arm."""
        st = self._requests.get(request_id)
        ema = st.acceptance.get(arm) if st else None
        return (ema or self.global_acceptance[arm]).curve()

    def draft_time(self, arm: str, num_requests: int) -> float:
        """Estimated seconds of one forward of `arm` over `num_requests` requests; before it
        is measured, as much as a target forward over as many tokens."""
        cost = self.draft_cost[arm]
        return cost.upper(num_requests) if len(cost) else self.target_cost.upper(num_requests)

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._tries.pop(request_id, None)

    # ---- choosing ------------------------------------------------------------------------
    def choose(
        self, candidates: Sequence[Candidate], base_tokens: int | None = None
    ) -> dict[str, Choice]:
        """A Choice for every candidate. `base_tokens`: tokens the target step feeds without
        drafts (default: one per candidate)."""
        n0 = base_tokens or len(candidates)
        self._settle()
        choices = self._best_plan(candidates, n0)
        self._explore(candidates, choices, n0)
        return choices

    def _best_plan(self, cands: Sequence[Candidate], n0: int) -> dict[str, Choice]:
        b = len(cands)
        plan: dict[str, Choice] = {c.request_id: Choice() for c in cands}
        if not cands:
            return plan
        gains = [self._gains(c) for c in cands]  # [i] arm -> a[0..limit-1]
        best_rate = b / self.target_cost.lower(n0) * (1.0 + self.min_gain)
        best: tuple[list[tuple[float, int, int, str]], int] | None = None
        model_arms = [a for a in self.model_arms if any(a in c.available for c in cands)]
        times = self.target_cost.uppers(n0, b * self.max_k + 1)  # [m] target step of n0 + m
        forward = {a: [0.0] + [self.draft_time(a, u) for u in range(1, b + 1)] for a in model_arms}
        tried = set()
        for caps in itertools.product(range(self.max_k + 1), repeat=len(model_arms)):
            picks = self._pick_arms(gains, dict(zip(model_arms, caps)))
            if picks in tried:  # the cap changed nothing
                continue
            tried.add(picks)
            slots = sorted(
                (-g, i, j, arm)
                for i, (arm, limit) in enumerate(picks)
                if arm is not None
                for j, g in enumerate(gains[i][arm][:limit])
            )
            ks = [0] * b
            users = dict.fromkeys(model_arms, 0)
            longest = dict.fromkeys(model_arms, 0)
            gained = draft = 0.0
            for m, (neg_gain, i, _, arm) in enumerate(slots, start=1):
                gained -= neg_gain
                ks[i] += 1
                if arm in users:  # max_i k_i forwards over the arm's requests
                    users[arm] += ks[i] == 1
                    longest[arm] = max(longest[arm], ks[i])
                    draft = sum(longest[a] * forward[a][users[a]] for a in model_arms)
                rate = (b + gained) / (times[m] + draft)
                if rate > best_rate:
                    best_rate, best = rate, (slots, m)
        if best is not None:
            slots, m = best
            ks = [0] * b
            arms: list[str | None] = [None] * b
            for _, i, _, arm in slots[:m]:
                ks[i] += 1
                arms[i] = arm
            for i, c in enumerate(cands):
                if ks[i]:
                    plan[c.request_id] = Choice(arms[i], ks[i])
        return plan

    def _gains(self, c: Candidate) -> dict[str, list[float]]:
        """arm -> the positive a[j] of the drafts it can give `c` (non-increasing)."""
        out = {}
        for arm, avail in c.available.items():
            curve = self.acceptance(c.request_id, arm)[: min(avail, c.max_k, self.max_k)]
            out[arm] = [g for g in curve if g > 0]
        return out

    def _pick_arms(
        self, gains: list[dict[str, list[float]]], cap: Mapping[str, int]
    ) -> tuple[tuple[str | None, int], ...]:
        """Per request, (arm, most drafts) of the arm with the largest expected accepted
        length under `cap` (ties: the earlier arm), or (None, 0)."""
        picks = []
        for g in gains:
            best: tuple[str | None, int] = (None, 0)
            best_sum = 0.0
            for arm in self.arms:
                if arm in g:
                    limit = min(len(g[arm]), cap.get(arm, self.max_k))
                    total = sum(g[arm][:limit])
                    if total > best_sum:
                        best, best_sum = (arm, limit), total
            picks.append(best)
        return tuple(picks)

    def _explore_cost(self, arm: str, k: int, n0: int) -> float:
        """Pessimistic extra seconds of verifying k more drafts of `arm` in a step of n0."""
        extra = self.target_cost.upper(n0 + k) - self.target_cost.lower(n0)
        if arm in self.draft_cost:
            extra += k * self.draft_time(arm, 1)
        return max(0.0, extra)

    def _settle(self) -> None:
        """Re-price the previous step's tries now that their step time is measured."""
        for arm, k, n0, charged in self._unsettled:
            self.explore_spent += self._explore_cost(arm, k, n0) - charged
        self._unsettled.clear()

    def _explore(self, cands: Sequence[Candidate], choices: dict[str, Choice], n0: int) -> None:
        for c in cands:
            st = self._requests.setdefault(c.request_id, _RequestState())
            chosen = choices[c.request_id]
            stale = []
            for rank, arm in enumerate(self.arms):
                most = min(c.available.get(arm, 0), c.max_k, self.max_k)
                if most < 1:
                    continue
                own_k = chosen.k if chosen.arm == arm else 0
                interval = st.interval.setdefault(arm, self.explore_interval)
                since = st.since_tried.get(arm, interval - 1)  # first try: when available
                if own_k > st.chosen_k.get(arm, 0):  # the picker itself went further: climb on
                    interval = st.interval[arm] = self.explore_interval
                    since = interval - 1
                st.chosen_k[arm] = own_k
                if own_k >= most:  # nothing longer to try
                    st.since_tried[arm] = 0
                    continue
                since = st.since_tried[arm] = since + 1
                if since >= interval:
                    stale.append((interval - since, rank, arm, own_k, most))
            for _, _, arm, own_k, most in sorted(stale):  # the most overdue first
                budget = self.explore_budget * self.time_measured - self.explore_spent
                k = most
                while k > own_k and self._explore_cost(arm, k, n0) > budget:
                    k -= 1
                if k > own_k:
                    choices[c.request_id] = Choice(arm, k, explore=True)
                    cost = self._explore_cost(arm, k, n0)
                    self.explore_spent += cost
                    self._unsettled.append((arm, k, n0, cost))
                    self._tries[c.request_id] = n0
                    st.since_tried[arm] = 0
                    st.interval[arm] = min(2 * st.interval[arm], self.explore_max_interval)
                    break


class Speculator:
    """Proposers, picker and counters together: all the engine calls for speculation.

    Each step (the integration recipe is in `moestream/spec/__init__.py`):
    1. after the runner ran `plan` (verifying drafts) in `seconds`:
       `observe(plan, sampled, seconds)` records the step time, the acceptance of every
       verified request, and drops state of preempted and finished requests;
    2. after the scheduler committed the step: `draft(scheduler.running)` sets
       `Request.draft_token_ids` of the requests that decode next; the scheduler feeds them.
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
    def draft(self, requests: Iterable[Request], base_tokens: int | None = None) -> None:
        """Set `draft_token_ids` of each running request whose next step is a decode (one
        token left to feed) to this step's proposal, or [] for plain decode."""
        requests = list(requests)
        inputs = []
        for req in requests:
            req.draft_token_ids = []
            room = req.sampling_params.max_tokens - req.num_output_tokens - 1
            if req.is_finished or req.num_tokens - req.num_computed_tokens != 1 or room < 1:
                continue
            inputs.append(
                ProposalInput(
                    req.request_id,
                    req.prompt_token_ids,
                    req.output_token_ids,
                    num_drafts=min(self.config.max_k, room),
                    temperature=req.sampling_params.temperature,
                )
            )
        proposals = self.propose(inputs, base_tokens)
        by_id = {req.request_id: req for req in requests} if proposals else {}
        for rid, p in proposals.items():
            by_id[rid].draft_token_ids = list(p.token_ids)

    def propose(
        self, inputs: Sequence[ProposalInput], base_tokens: int | None = None
    ) -> dict[str, Proposal]:
        """Proposals for the requests the picker lets speculate this step."""
        inputs = [i for i in inputs if i.num_drafts >= 1]
        for inp in inputs:
            self._pending.pop(inp.request_id, None)
            self._probs.pop(inp.request_id, None)
        if not inputs:
            return {}
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
                self.picker.record_draft_time(name, len(chosen), max(ks), time.perf_counter() - t0)
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
        return out

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
    def observe(
        self, plan: StepPlan, sampled: Mapping[str, list[int]], seconds: float | None = None
    ) -> None:
        """Record a step the runner ran: its time (when given), the acceptance of every request
        that carried drafts (`sampled[id]` = accepted drafts + one token), and release state
        of the plan's preempted and finished requests."""
        if seconds is not None and plan.num_tokens > 0:
            self.picker.record_step_time(plan.num_tokens, seconds)
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
        ids = {*self._pending, *self.picker._requests}
        for p in self.proposers.values():
            ids.update(p.request_ids())
        for rid in ids:
            self.release(rid)

    def release(self, request_id: str) -> None:
        """Drop every proposer's and the picker's state of `request_id`."""
        self._pending.pop(request_id, None)
        self._probs.pop(request_id, None)
        self.picker.release(request_id)
        for p in self.proposers.values():
            p.release(request_id)

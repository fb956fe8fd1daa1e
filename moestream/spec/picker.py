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

Plain decode is priced at the cheapest way it runs. On a GPU the runner queues a plain greedy
step before the host has read the previous one's tokens (run-ahead), hiding the host's work;
a step with drafts cannot be queued that way, and the plain steps around drafting ones are not
(`Speculator` keeps run-ahead for stretches of rounds it skips). Plain steps whose forward ran
ahead are measured apart (`plain_cost`), and t(n0) is the lower of the two measurements, so
verification is weighed against the plain decode it would displace at its fastest.

Acceptance also comes without tries: a free proposer (n-gram) proposes for every request
whether chosen or not, and the speculator checks an unchosen proposal against the tokens plain
decode then produced, which are what greedy verification would have compared it with, and for
a sampled request a draw of what rejection sampling would accept (`Speculator._shadow_keep`
says why; `record_shadow`). Tries are then needed mostly to measure what verifying costs.

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

A round may ask what the picker would choose without committing to it (`choose(commit=False)`,
then `commit()` or nothing): the speculator does so when the next step is already queued as
plain decode, and holds drafts back for a step if the answer is to draft. Nothing of the
exploration (intervals, budget, first tries) is spent on an answer that is not committed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from moestream.spec.stats import AcceptanceEMA, StepCostModel

# Tries of an arm at its full draft length taken outside the exploration budget while what
# prices it is unmeasured (`Picker._first_try`): a free proposer's verify step size (one may
# capture a CUDA graph, not timed), a draft model's forward (its first timing may compile).
FIRST_TRIES = 3


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
        self.target_cost = StepCostModel()  # every timed step but the run-ahead ones
        self.plain_cost = StepCostModel()  # plain decode steps whose forward ran ahead
        self.draft_cost = {a: StepCostModel() for a in self.model_arms}  # per forward, by batch
        self.time_measured = 0.0  # seconds of all recorded target and draft work
        self.explore_spent = 0.0  # estimated extra seconds of exploration so far
        self._unsettled: list[tuple[str, int, int, float]] = []  # last step's (arm, k, n0, cost)
        self._tries: dict[str, int] = {}  # request id -> n0 of its try awaiting verification
        self._first_tries: dict[str, int] = {}  # arm -> tries taken outside the budget
        self._staged: Callable[[], None] | None = None  # what `commit` records
        self._requests: dict[str, _RequestState] = {}

    # ---- measurements --------------------------------------------------------------------
    def record_step_time(self, num_tokens: int, seconds: float, ahead: bool = False) -> None:
        """A target forward (any step: prefill, decode, verify) over `num_tokens` tokens.
        `ahead`: a plain decode step whose forward was queued before the previous step's
        tokens were read (run-ahead), or the mean of a stretch of such steps."""
        (self.plain_cost if ahead else self.target_cost).record(num_tokens, seconds)
        self.time_measured += seconds

    def plain_time(self, num_tokens: int) -> float:
        """The least a plain step over `num_tokens` tokens can take, by every measurement."""
        t = self.target_cost.lower(num_tokens)
        return min(t, self.plain_cost.lower(num_tokens)) if len(self.plain_cost) else t

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
            saved = num_accepted * self.plain_time(n0) / n0
            self.explore_spent = max(0.0, self.explore_spent - saved)  # no credit is banked
            if num_accepted == num_drafts:  # all taken: a longer k may pay too, try at once
                st.interval[arm] = self.explore_interval
                st.since_tried[arm] = self.explore_interval - 1
        self._update_acceptance(st, arm, num_drafts, num_accepted)

    def record_shadow(self, request_id: str, arm: str, num_drafts: int, num_accepted: int) -> None:
        """Of `num_drafts` drafts `arm` proposed for a request that decoded without them, the
        first `num_accepted` equal the tokens it then produced: what verification would have
        accepted (greedy), or a draw of it (sampled, deterministic drafts). Free evidence of
        acceptance (no try, no budget)."""
        st = self._requests.setdefault(request_id, _RequestState())
        self._update_acceptance(st, arm, num_drafts, num_accepted)

    def _update_acceptance(
        self, st: _RequestState, arm: str, num_drafts: int, num_accepted: int
    ) -> None:
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

    def priced_out(self, num_requests: int) -> bool:
        """Whether there is no free arm and every model arm is priced out for `num_requests`
        requests (`arm_priced_out`). Then what a proposal round can find does not depend on
        the request: only the costs, which change slowly."""
        if not self.model_arms or len(self.model_arms) != len(self.arms):
            return False
        return all(self.arm_priced_out(arm, num_requests) for arm in self.model_arms)

    def arm_priced_out(self, arm: str, num_requests: int) -> bool:
        """Whether model arm `arm` is timed (twice at batch 1: `_first_try`) and, for
        `num_requests` requests each drafting k <= max_k tokens with it, could not beat plain
        decode by `min_gain` even if every draft were accepted. (Under costs linear in the
        tokens, fewer of the requests drafting pays still less: u of b requests pay only if
        u * a > b * F(u), a the target step's fixed cost and F the draft forward's.) A free
        arm is never priced out: it costs no forward."""
        b = num_requests
        if arm not in self.draft_cost or b < 1 or self.draft_cost[arm].count(1) < 2:
            return False
        best_rate = b / self.plain_time(b) * (1.0 + self.min_gain)
        forward = self.draft_time(arm, b)
        for k in range(1, self.max_k + 1):
            if b * (1 + k) / (self.target_cost.upper(b * (1 + k)) + k * forward) > best_rate:
                return False
        return True

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._tries.pop(request_id, None)

    # ---- choosing ------------------------------------------------------------------------
    def choose(
        self, candidates: Sequence[Candidate], base_tokens: int | None = None, commit: bool = True
    ) -> dict[str, Choice]:
        """A Choice for every candidate. `base_tokens`: tokens the target step feeds without
        drafts (default: one per candidate). `commit` False: what would be chosen, changing
        nothing yet (exploration state, budget, first tries); `commit()` then records it as
        if chosen with `commit`, and another `choose` drops it."""
        n0 = base_tokens or len(candidates)
        self._settle()
        choices = self._best_plan(candidates, n0)
        self._staged = self._explore(candidates, choices, n0)
        if commit:
            self.commit()
        return choices

    def commit(self) -> None:
        """Record the last `choose(commit=False)` (no-op if none is pending)."""
        staged, self._staged = self._staged, None
        if staged is not None:
            staged()

    def _best_plan(self, cands: Sequence[Candidate], n0: int) -> dict[str, Choice]:
        b = len(cands)
        plan: dict[str, Choice] = {c.request_id: Choice() for c in cands}
        if not cands:
            return plan
        gains = [self._gains(c) for c in cands]  # [i] arm -> a[0..limit-1]
        best_rate = b / self.plain_time(n0) * (1.0 + self.min_gain)
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
        extra = self.target_cost.upper(n0 + k) - self.plain_time(n0)
        if arm in self.draft_cost:
            extra += k * self.draft_time(arm, 1)
        return max(0.0, extra)

    def _first_try(self, arm: str, n: int, taken: int) -> bool:
        """Whether a try of `arm` that verifies n tokens goes ahead outside the budget, `taken`
        such tries of `arm` having gone before (up to `FIRST_TRIES` per arm; none with a zero
        budget: no exploration at all).

        A free arm (no model forwards): while a step of n tokens has never been timed. One
        verify step prices every draft length up to it; before it is timed, the linear bound
        prices drafting out and the budget would allow only short tries for a long while. (A
        first step that captures a CUDA graph is not timed, hence more than one.)

        A model arm (a draft model): while its forward at batch 1 has been timed fewer than
        twice. Its first timing often includes compiling kernels for a shape the warm-up did
        not cover (154 ms on the H200 for the tiny pair's draft, ~700 forwards' worth); it
        stands until a second replaces it (`StepCostModel.record`), and priced at it every
        budgeted try would wait for hours."""
        if not self.explore_budget or taken >= FIRST_TRIES:
            return False
        if arm in self.draft_cost:
            return self.draft_cost[arm].count(1) < 2
        return n not in self.target_cost

    def _settle(self) -> None:
        """Re-price the previous step's tries now that their step time is measured."""
        for arm, k, n0, charged in self._unsettled:
            self.explore_spent += self._explore_cost(arm, k, n0) - charged
        self._unsettled.clear()

    def _explore(
        self, cands: Sequence[Candidate], choices: dict[str, Choice], n0: int
    ) -> Callable[[], None]:
        """Turn overdue arms into tries in `choices`; returns the function that records what
        this decided (each request's exploration state, the tries and their estimated cost)."""
        states = []  # (request id, its state, [(arm, interval, own k, steps since a try)])
        tries = []  # (its state, request id, arm, k, estimated cost, interval)
        spent = self.explore_spent
        first = dict(self._first_tries)
        for c in cands:
            st = self._requests.get(c.request_id) or _RequestState()
            arms = []
            states.append((c.request_id, st, arms))
            chosen = choices[c.request_id]
            stale = []
            for rank, arm in enumerate(self.arms):
                most = min(c.available.get(arm, 0), c.max_k, self.max_k)
                if most < 1:
                    continue
                own_k = chosen.k if chosen.arm == arm else 0
                interval = st.interval.get(arm, self.explore_interval)
                since = st.since_tried.get(arm, interval - 1)  # first try: when available
                if own_k > st.chosen_k.get(arm, 0):  # the picker itself went further: climb on
                    interval = self.explore_interval
                    since = interval - 1
                since = 0 if own_k >= most else since + 1  # k = most: nothing longer to try
                arms.append((arm, interval, own_k, since))
                if own_k < most and since >= interval:
                    stale.append((interval - since, rank, arm, own_k, most, interval))
            for _, _, arm, own_k, most, interval in sorted(stale):  # the most overdue first
                budget = self.explore_budget * self.time_measured - spent
                k = most
                if self._first_try(arm, n0 + most, first.get(arm, 0)):
                    first[arm] = first.get(arm, 0) + 1
                else:
                    while k > own_k and self._explore_cost(arm, k, n0) > budget:
                        k -= 1
                if k > own_k:
                    choices[c.request_id] = Choice(arm, k, explore=True)
                    cost = self._explore_cost(arm, k, n0)
                    spent += cost
                    tries.append((st, c.request_id, arm, k, cost, interval))
                    break

        def record() -> None:
            for rid, st, arms in states:
                self._requests.setdefault(rid, st)
                for arm, interval, own_k, since in arms:
                    st.interval[arm], st.chosen_k[arm], st.since_tried[arm] = interval, own_k, since
            for st, rid, arm, k, cost, interval in tries:
                self._unsettled.append((arm, k, n0, cost))
                self._tries[rid] = n0
                st.since_tried[arm] = 0
                st.interval[arm] = min(2 * interval, self.explore_max_interval)
            self.explore_spent = spent
            self._first_tries = first

        return record

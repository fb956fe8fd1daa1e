"""Measurements of speculative decoding: counters for bench and /metrics (`SpecStats`), the
acceptance estimates the picker decides from (`AcceptanceEMA`) and the measured cost of a
forward pass by its token count (`StepCostModel`). Pure Python.

Conventions: a verify step is one request's step that carried k >= 1 drafts; it emits
accepted + 1 tokens (the accepted drafts, then the target's own token). tau is the mean number
of tokens a verify step emits, so tau = 1 + mean accepted (plain decode has tau = 1).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ArmStats:
    """Counters of one proposer (or of all of them, see `SpecStats.total`)."""

    num_verify_steps: int = 0
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0
    num_explore_steps: int = 0  # verify steps the picker forced to refresh its estimates
    proposed_by_position: list[int] = field(default_factory=list)  # [j]: steps with a draft j
    accepted_by_position: list[int] = field(default_factory=list)  # [j]: ... where j accepted

    def record(self, num_drafts: int, num_accepted: int, explore: bool = False) -> None:
        if not 0 <= num_accepted <= num_drafts or num_drafts < 1:
            raise ValueError(f"accepted {num_accepted} of {num_drafts} drafts")
        self.num_verify_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_explore_steps += explore
        for counts in (self.proposed_by_position, self.accepted_by_position):
            counts.extend([0] * (num_drafts - len(counts)))
        for j in range(num_drafts):
            self.proposed_by_position[j] += 1
            self.accepted_by_position[j] += j < num_accepted

    def merge(self, other: ArmStats) -> None:
        self.num_verify_steps += other.num_verify_steps
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_explore_steps += other.num_explore_steps
        for mine, theirs in (
            (self.proposed_by_position, other.proposed_by_position),
            (self.accepted_by_position, other.accepted_by_position),
        ):
            mine.extend([0] * (len(theirs) - len(mine)))
            for j, c in enumerate(theirs):
                mine[j] += c

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verify step (accepted + 1); 0.0 before any."""
        if not self.num_verify_steps:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_verify_steps

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """[j]: fraction of steps with a draft j in which draft j was accepted (so were all
        before it)."""
        return [a / p for a, p in zip(self.accepted_by_position, self.proposed_by_position)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "verify_steps": self.num_verify_steps,
            "explore_steps": self.num_explore_steps,
            "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "tau": self.tau,
            "acceptance_by_position": self.acceptance_by_position,
        }


@dataclass
class SpecStats:
    """Counters per proposer plus the request-steps decoded without drafts."""

    arms: dict[str, ArmStats] = field(default_factory=dict)
    num_plain_steps: int = 0  # request-steps that asked for drafts and ran plain decode

    def record(self, arm: str, num_drafts: int, num_accepted: int, explore: bool = False) -> None:
        self.arms.setdefault(arm, ArmStats()).record(num_drafts, num_accepted, explore)

    def record_plain(self, n: int = 1) -> None:
        self.num_plain_steps += n

    @property
    def total(self) -> ArmStats:
        out = ArmStats()
        for a in self.arms.values():
            out.merge(a)
        return out

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the benchmark JSON and /metrics (tau: accepted + 1 per verify step)."""
        return {
            "plain_steps": self.num_plain_steps,
            "total": self.total.as_dict(),
            "by_proposer": {name: a.as_dict() for name, a in sorted(self.arms.items())},
        }


class AcceptanceEMA:
    """Moving averages of a[j] = P(drafts 0..j all accepted | draft j proposed), j < max_k.

    A verify step with k drafts and `accepted` accepted updates a[0..k-1] with the indicators
    [accepted > j]; positions it did not reach keep their value. The prior counts as
    `prior_weight` observations: the n-th update of a position has weight
    max(alpha, 1 / (n + prior_weight)), so early evidence moves the estimate quickly and later
    it tracks changes with weight `alpha`. `curve()` is made non-increasing (a later position
    cannot be likelier)."""

    def __init__(
        self, max_k: int, alpha: float, prior: Sequence[float], prior_weight: float = 2.0
    ) -> None:
        if len(prior) < max_k:
            raise ValueError(f"prior has {len(prior)} positions, need {max_k}")
        self.alpha = alpha
        self.prior_weight = prior_weight
        self.values = [float(p) for p in prior[:max_k]]
        self.counts = [0] * max_k

    def copy(self, alpha: float | None = None) -> AcceptanceEMA:
        """These values as the prior of a new average (with its own `alpha`)."""
        return AcceptanceEMA(
            len(self.values),
            self.alpha if alpha is None else alpha,
            self.values,
            self.prior_weight,
        )

    def update(self, num_drafts: int, num_accepted: int) -> None:
        for j in range(min(num_drafts, len(self.values))):
            self.counts[j] += 1
            w = max(self.alpha, 1.0 / (self.counts[j] + self.prior_weight))
            self.values[j] += w * (float(num_accepted > j) - self.values[j])

    def curve(self) -> list[float]:
        out, low = [], 1.0
        for v in self.values:
            low = min(low, v)
            out.append(low)
        return out

    def expected_accepted(self, k: int) -> float:
        """E[accepted | k drafts] = sum of a[j] for j < k."""
        return sum(self.curve()[:k])


# Most a step time may differ from its size's estimate (either way) for the estimate to follow
# it in full (`StepCostModel.record`).
STALL = 2.0


class StepCostModel:
    """Measured seconds of a forward over n tokens (or n requests), an EMA per n.

    Sizes never measured are bounded from what is known, assuming a step time that does not
    decrease with n and grows at most in proportion to n (t(n) / n does not increase):
    `upper(n)` is the most it can be, `lower(n)` the least. The picker prices speculation at
    `upper` and plain decode at `lower`, so it speculates only on measured gains. With no
    measurement both are n (linear: k drafts never look cheaper than k + 1 plain steps).
    """

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self._sizes: list[int] = []  # sorted
        self._seconds: dict[int, float] = {}
        self._count: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._sizes)

    def record(self, n: int, seconds: float) -> None:
        """A step of n took `seconds`. The first step of each size often pays one-off costs
        (kernel compilation, CUDA graph capture: 100x a step); it stands only until the second
        measurement replaces it, after which an EMA follows, fed each measurement within
        `STALL` times the estimate either way: a step the host was descheduled in, or a
        garbage-collector pause, must not price a size out of reach (it would not be tried
        again for long), while a lasting change still comes through in a few steps."""
        if n < 1 or seconds < 0:
            raise ValueError(f"step of {n} tokens took {seconds} s")
        count = self._count.get(n, 0)
        self._count[n] = count + 1
        if count == 0:
            bisect.insort(self._sizes, n)
            self._seconds[n] = seconds
        elif count == 1:
            self._seconds[n] = seconds
        else:
            old = self._seconds[n]
            seconds = min(max(seconds, old / STALL), old * STALL)
            self._seconds[n] = old + self.alpha * (seconds - old)

    def __contains__(self, n: object) -> bool:
        """Whether steps of n have been measured."""
        return n in self._seconds

    def count(self, n: int) -> int:
        """How many steps of n have been measured."""
        return self._count.get(n, 0)

    def measured(self) -> dict[int, float]:
        return {n: self._seconds[n] for n in self._sizes}

    def _neighbours(self, n: int) -> tuple[int | None, int | None, float | None]:
        """(largest measured size below n, smallest above n, t(n) if measured)."""
        sizes = self._sizes
        i = bisect.bisect_left(sizes, n)
        if i < len(sizes) and sizes[i] == n:
            return None, None, self._seconds[n]
        below = sizes[i - 1] if i > 0 else None
        above = sizes[i] if i < len(sizes) else None
        return below, above, None

    def upper(self, n: int) -> float:
        """The most a step of n can take: min(t(b), t(a) * n / a) for measured a < n < b
        (t(b) below every measurement, t(a) * n / a above)."""
        if not self._sizes:
            return float(n)
        a, b, exact = self._neighbours(n)
        if exact is not None:
            return exact
        t = self._seconds
        if a is None:
            return t[b]
        return t[a] * n / a if b is None else min(t[b], t[a] * n / a)

    def lower(self, n: int) -> float:
        """The least a step of n can take: max(t(a), t(b) * n / b) for measured a < n < b
        (t(b) * n / b below every measurement, t(a) above)."""
        if not self._sizes:
            return float(n)
        a, b, exact = self._neighbours(n)
        if exact is not None:
            return exact
        t = self._seconds
        if b is None:
            return t[a]
        return t[b] * n / b if a is None else max(t[a], t[b] * n / b)

    def uppers(self, start: int, count: int) -> list[float]:
        """[upper(start + m) for m < count], made non-decreasing (noise in the measurements
        must not make more tokens look cheaper)."""
        out, high = [], 0.0
        for m in range(count):
            high = max(high, self.upper(start + m))
            out.append(high)
        return out

"""Which experts a tier keeps: eviction policies over one layer's routing history, and the
`SlotDirectory` that maps experts to a tier's slots with them. Pure Python (no torch), so the
bench replays recorded routing through exactly the decisions the store makes.

Time is counted in tokens: `record` is given each token's experts in order. Routing reuse is
cyclic over a few hundred tokens, so plain LRU thrashes once the working set of that cycle is
larger than the cache; a frequency count over a window of recent tokens keeps the experts the
cycle comes back to.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any


class ExpertPolicy(ABC):
    """Scores the experts of one layer from the routing it has seen.

    Contract: `record` gets each token's routed experts, in token order; `score(e)` is larger for
    experts more worth keeping; ties break towards keeping the more recently used one, then the
    lower id (deterministic). Loading an expert is not an access: only routing is recorded.
    """

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.clock = 0  # tokens recorded so far
        self.last_use = [-1] * num_experts

    def record(self, token_experts: Iterable[Iterable[int]]) -> None:
        for experts in token_experts:
            ids = set(experts)
            for e in ids:
                self.last_use[e] = self.clock
            self._count(ids)
            self.clock += 1

    def _count(self, experts: set[int]) -> None:  # noqa: B027 (optional hook)
        """Per-token hook for frequency-based policies."""

    @abstractmethod
    def score(self, e: int) -> tuple[float, ...]: ...

    def victim(self, candidates: Iterable[int]) -> int:
        """The candidate to evict: the lowest score."""
        return min(candidates, key=lambda e: (*self.score(e), -e))

    def hot(self, n: int) -> list[int]:
        """The `n` experts most worth keeping, among those ever used."""
        used = [e for e in range(self.num_experts) if self.last_use[e] >= 0]
        return sorted(used, key=lambda e: (*self.score(e), -e), reverse=True)[:n]


class LRUPolicy(ExpertPolicy):
    """Least recently used goes first."""

    def score(self, e: int) -> tuple[float, ...]:
        return (self.last_use[e],)


class LFUPolicy(ExpertPolicy):
    """Least frequently used over all tokens seen goes first (recency breaks ties)."""

    def __init__(self, num_experts: int):
        super().__init__(num_experts)
        self.counts = [0] * num_experts

    def _count(self, experts: set[int]) -> None:
        for e in experts:
            self.counts[e] += 1

    def score(self, e: int) -> tuple[float, ...]:
        return (self.counts[e], self.last_use[e])


class WindowLFUPolicy(ExpertPolicy):
    """Least frequently used over the last `window` tokens goes first (recency breaks ties)."""

    def __init__(self, num_experts: int, window: int = 256):
        super().__init__(num_experts)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.counts = [0] * num_experts
        self._history: deque[tuple[int, ...]] = deque()

    def _count(self, experts: set[int]) -> None:
        self._history.append(tuple(experts))
        for e in experts:
            self.counts[e] += 1
        if len(self._history) > self.window:
            for e in self._history.popleft():
                self.counts[e] -= 1

    def score(self, e: int) -> tuple[float, ...]:
        return (self.counts[e], self.last_use[e])


POLICIES: dict[str, Callable[..., ExpertPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "window": WindowLFUPolicy,
}


def make_policy(name: str, num_experts: int, **options: Any) -> ExpertPolicy:
    """A policy by registry name: lru | lfu | window (window=N tokens, default 256)."""
    if name not in POLICIES:
        raise ValueError(f"unknown expert policy {name!r} (known: {', '.join(POLICIES)})")
    if name == "window":
        return WindowLFUPolicy(num_experts, **options)
    return POLICIES[name](num_experts)


class SlotDirectory:
    """Which expert occupies each of one tier's `n_slots` slots for one layer.

    An expert is *mapped* from the moment a slot is claimed for it; it is *ready* once its load
    finished. Eviction never takes a pinned or loading expert; among the rest it prefers, in
    order, experts outside `keep` (needed by the current forward), non-resident, not fresh (a
    prefetched expert stays fresh until the layer's next forward), then the policy's victim.
    `n_resident` experts, the most frequent over `promote_window` tokens, are promoted to
    resident every `rebalance_every` tokens (0 turns promotion off). Not thread-safe: the owner
    holds a lock.
    """

    def __init__(
        self,
        n_slots: int,
        policy: ExpertPolicy,
        n_resident: int = 0,
        rebalance_every: int = 32,
        promote_window: int = 256,
    ):
        if not 0 <= n_resident <= n_slots:
            raise ValueError(f"{n_resident} resident experts do not fit {n_slots} slots")
        self.n_slots = n_slots
        self.policy = policy
        self.n_resident = n_resident
        self.rebalance_every = rebalance_every
        self.promoter: ExpertPolicy | None = None
        if n_resident:  # the eviction policy itself when it counts the same window
            same = isinstance(policy, WindowLFUPolicy) and policy.window == promote_window
            self.promoter = policy if same else WindowLFUPolicy(policy.num_experts, promote_window)
        self.slot_of: dict[int, int] = {}
        self.expert_in: list[int | None] = [None] * n_slots
        self._free = list(range(n_slots - 1, -1, -1))  # pop() gives the lowest slot
        self.loading: set[int] = set()
        self.pins: dict[int, int] = {}
        self.resident: set[int] = set()
        self.fresh: set[int] = set()
        self._since_rebalance = 0

    # ---- lookups -----------------------------------------------------------------------------
    def is_mapped(self, e: int) -> bool:
        return e in self.slot_of

    def is_ready(self, e: int) -> bool:
        return e in self.slot_of and e not in self.loading

    def __len__(self) -> int:
        return len(self.slot_of)

    # ---- state changes -----------------------------------------------------------------------
    def claim(self, e: int, keep: Collection[int] = ()) -> tuple[int, int | None] | None:
        """A slot for unmapped expert `e`, marked loading: (slot, evicted expert or None), or
        None when every slot is pinned or loading."""
        assert e not in self.slot_of, f"expert {e} is already mapped"
        if self._free:
            slot, evicted = self._free.pop(), None
        else:
            candidates = [x for x in self.slot_of if x not in self.loading and not self.pins.get(x)]
            if not candidates:
                return None
            keep = set(keep)

            def key(x: int) -> tuple[Any, ...]:
                score = self.policy.score(x)
                return (x in keep, x in self.resident, x in self.fresh, *score, -x)

            evicted = min(candidates, key=key)
            slot = self.slot_of.pop(evicted)
            self.fresh.discard(evicted)
        self.slot_of[e] = slot
        self.expert_in[slot] = e
        self.loading.add(e)
        return slot, evicted

    def finish(self, e: int, fresh: bool = False) -> None:
        """The load of `e` completed; `fresh` marks a prefetch not yet used."""
        self.loading.discard(e)
        if fresh:
            self.fresh.add(e)

    def abort(self, e: int) -> None:
        """The load of `e` failed: its slot is free again."""
        self.loading.discard(e)
        slot = self.slot_of.pop(e)
        self.expert_in[slot] = None
        self._free.append(slot)

    def use(self, e: int) -> bool:
        """`e` is being used by a forward; True when it was an unused prefetch."""
        if e in self.fresh:
            self.fresh.discard(e)
            return True
        return False

    def pin(self, e: int) -> None:
        self.pins[e] = self.pins.get(e, 0) + 1

    def use_all_ready(self, experts: Sequence[int], pin: bool) -> int | None:
        """When every one of `experts` is ready (a forward's hits, the common case of a warm
        cache): marks each used (and pins it when `pin`) and returns how many were unused
        prefetches; else None, and nothing changed."""
        slot_of, loading = self.slot_of, self.loading
        for e in experts:
            if e not in slot_of or e in loading:
                return None
        if pin:
            pins = self.pins
            for e in experts:
                pins[e] = pins.get(e, 0) + 1
        fresh = self.fresh
        if not fresh:
            return 0
        used = fresh.intersection(experts)
        fresh.difference_update(used)
        return len(used)

    def unpin(self, e: int) -> None:
        n = self.pins[e] - 1
        if n:
            self.pins[e] = n
        else:
            del self.pins[e]

    def unpin_all(self, experts: Iterable[int]) -> None:
        pins = self.pins
        for e in experts:
            n = pins[e] - 1
            if n:
                pins[e] = n
            else:
                del pins[e]

    def new_forward(self) -> None:
        """A forward of this layer begins: earlier prefetches lose their protection."""
        self.fresh.clear()

    def record(self, token_experts: Sequence[Sequence[int]]) -> list[int]:
        """Record routing; on a rebalance, returns the newly resident experts that are not
        mapped (the owner may load them)."""
        self.policy.record(token_experts)
        if self.promoter is None:
            return []
        if self.promoter is not self.policy:
            self.promoter.record(token_experts)
        self._since_rebalance += len(token_experts)
        if self._since_rebalance < self.rebalance_every:
            return []
        self._since_rebalance = 0
        return self.rebalance()[0]

    def rebalance(self) -> tuple[list[int], list[int]]:
        """Promote the hottest experts to resident: (promoted and unmapped, demoted)."""
        assert self.promoter is not None
        hot = set(self.promoter.hot(self.n_resident))
        demoted = sorted(self.resident - hot)
        promoted = sorted(hot - self.resident)
        self.resident = hot
        return [e for e in promoted if e not in self.slot_of], demoted

    def check(self) -> None:
        """Invariants (tests): slots hold distinct experts, mapped + free == n_slots."""
        assert len(self.slot_of) + len(self._free) == self.n_slots
        assert len(set(self.slot_of.values())) == len(self.slot_of)
        for e, s in self.slot_of.items():
            assert self.expert_in[s] == e
        assert self.loading <= set(self.slot_of)


def simulate(
    trace: Sequence[Sequence[int]],
    num_experts: int,
    n_slots: int,
    policy: str | Callable[[int], ExpertPolicy] = "window",
    n_resident: int = 0,
    **options: Any,
) -> dict[str, int]:
    """Replay one layer's decode routing (one token per forward) through a `SlotDirectory`:
    {"hits", "misses", "promotion_loads"}. `policy` is a registry name or a factory taking
    num_experts; `options` go to the named policy."""
    made = make_policy(policy, num_experts, **options) if isinstance(policy, str) else None
    directory = SlotDirectory(n_slots, made or policy(num_experts), n_resident)  # type: ignore[operator]
    hits = misses = promotion_loads = 0
    for experts in trace:
        directory.new_forward()
        needed = list(dict.fromkeys(experts))
        for e in needed:
            if directory.is_mapped(e):
                hits += 1
                continue
            misses += 1
            claimed = directory.claim(e, keep=needed)
            assert claimed is not None, "fewer slots than experts per token"
            directory.finish(e)
        for e in directory.record([needed]):
            if directory.claim(e, keep=needed) is not None:
                directory.finish(e)
                promotion_loads += 1
    return {"hits": hits, "misses": misses, "promotion_loads": promotion_loads}

"""Eviction policies and the slot directory on synthetic routing traces (pure Python)."""

from __future__ import annotations

import random

import pytest

from moestream.experts.policy import (
    LFUPolicy,
    LRUPolicy,
    SlotDirectory,
    WindowLFUPolicy,
    make_policy,
    simulate,
)


def cyclic_trace(n_tokens: int) -> list[list[int]]:
    """k = 2: one of 6 hot experts (each back every 6 tokens) and one of 40 cold experts swept
    in a cycle (each back every 40 tokens). Between two uses of a hot expert 11 other experts
    appear, so an 8-slot LRU cache never keeps one; a frequency count keeps all six."""
    hot, cold = list(range(6)), list(range(6, 46))
    return [[hot[t % 6], cold[t % 40]] for t in range(n_tokens)]


def hit_rate(result: dict[str, int]) -> float:
    return result["hits"] / (result["hits"] + result["misses"])


def test_window_lfu_beats_lru_on_a_cyclic_trace_larger_than_the_cache() -> None:
    trace = cyclic_trace(2000)
    lru = hit_rate(simulate(trace, 46, 8, "lru"))
    window = hit_rate(simulate(trace, 46, 8, "window", window=256))
    lfu = hit_rate(simulate(trace, 46, 8, "lfu"))
    assert lru == 0.0  # the cycle is longer than the cache: LRU thrashes
    assert window > 0.45 and lfu > 0.45  # every hot access hits once the counts are in
    assert window <= 0.5  # cold experts (each seen every 40 tokens) can never hit


def test_window_adapts_to_a_shift_that_all_time_lfu_does_not() -> None:
    rng = random.Random(0)
    phase_a = [[rng.choice(range(0, 4)), rng.choice(range(16, 32))] for _ in range(3000)]
    phase_b = [[rng.choice(range(4, 8)), rng.choice(range(16, 32))] for _ in range(3000)]
    trace = phase_a + phase_b
    lfu = simulate(trace, 32, 5, "lfu")
    window = simulate(trace, 32, 5, "window", window=128)
    tail = len(phase_b)
    # Replay phase b alone after a: hits in phase b are what differ.
    lfu_b = lfu["hits"] - simulate(phase_a, 32, 5, "lfu")["hits"]
    window_b = window["hits"] - simulate(phase_a, 32, 5, "window", window=128)["hits"]
    assert window_b > lfu_b + tail // 4  # all-time counts keep phase a's experts


def test_policy_scores_and_registry() -> None:
    lru, lfu, win = LRUPolicy(4), LFUPolicy(4), WindowLFUPolicy(4, window=2)
    for p in (lru, lfu, win):
        p.record([[0, 1], [0, 2], [3, 3]])  # a repeated id in a token counts once
    assert lru.victim([0, 1, 2, 3]) == 1  # used longest ago
    assert lfu.victim([0, 1, 2, 3]) == 1 and lfu.counts == [2, 1, 1, 1]
    assert win.counts == [1, 0, 1, 1]  # token [0, 1] fell out of the 2-token window
    assert win.hot(2) == [3, 0]  # 0 and 2 tie (count 1, last used together): lower id kept
    with pytest.raises(ValueError, match="unknown expert policy"):
        make_policy("fifo", 4)
    assert isinstance(make_policy("window", 4, window=8), WindowLFUPolicy)


def test_directory_never_evicts_pinned_loading_or_needed_experts() -> None:
    d = SlotDirectory(3, LRUPolicy(8))
    for e in (0, 1, 2):
        slot, evicted = d.claim(e)
        assert evicted is None
        d.finish(e)
    d.policy.record([[0], [1], [2]])
    d.pin(0)
    slot, evicted = d.claim(5, keep={1})
    assert evicted == 2 and d.expert_in[slot] == 5  # 0 pinned, 1 needed: 2 goes though newest
    assert d.is_mapped(5) and not d.is_ready(5)
    slot, evicted = d.claim(6)
    assert evicted == 1  # 0 pinned, 5 loading
    assert d.claim(7) is None  # 0 pinned, 5 and 6 loading: nothing can be evicted
    d.abort(6)
    assert not d.is_mapped(6)
    assert d.claim(7) == (slot, None)  # the failed load's slot is free again
    d.check()
    d.unpin(0)
    assert d.claim(8)[1] == 0  # unpinned: the only expert not loading
    d.check()


def test_fresh_prefetch_is_kept_until_the_next_forward() -> None:
    d = SlotDirectory(2, LRUPolicy(8))
    for e in (0, 1):
        d.claim(e)
        d.finish(e, fresh=(e == 1))
    d.policy.record([[0]])
    _, evicted = d.claim(2)
    assert evicted == 0  # 1 is a prefetch not yet used, though 0 is more recent
    d.finish(2)
    d.new_forward()
    d.policy.record([[2]])
    _, evicted = d.claim(3)
    assert evicted == 1  # its forward came and went unused


def test_promotion_protects_hot_experts_from_a_burst() -> None:
    """An LRU cache with 2 resident slots keeps the frequent experts through a burst of new
    ones; the same cache without promotion loses them."""
    base = [[t % 2, 10 + t % 3] for t in range(200)]  # 0, 1 hot; 10-12 warm
    burst = [[20 + t, 40 + t] for t in range(6)]  # 12 one-off experts
    trace = base + burst + base[:20]
    plain = simulate(trace, 64, 5, "lru")
    promoted = simulate(trace, 64, 5, "lru", n_resident=2)
    assert promoted["hits"] > plain["hits"]
    d = SlotDirectory(4, LRUPolicy(8), n_resident=2, rebalance_every=4)
    for e in range(4):
        d.claim(e)
        d.finish(e)
    missing = d.record([[6, 7]] * 3 + [[6, 1]])
    assert d.resident == {6, 7} and missing == [6, 7]  # hot but not mapped: to be loaded

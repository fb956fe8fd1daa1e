import random

import pytest

from moestream.cache.block_allocator import BlockAllocator
from moestream.errors import CapacityError, MoestreamError


def test_allocate_and_free_returns_every_block():
    a = BlockAllocator(num_blocks=8, block_size=4)
    got = a.allocate(5) + a.allocate(3)
    assert sorted(got) == list(range(8))
    assert a.num_free == 0 and a.num_used == 8
    a.check_invariants()
    a.free(reversed(got))
    assert a.num_free == 8 and a.num_used == 0
    a.check_invariants()
    assert sorted(a.allocate(8)) == list(range(8))


def test_refcounts_share_a_block_until_the_last_free():
    a = BlockAllocator(4, 2)
    (b,) = a.allocate(1)
    a.incref([b])
    a.incref([b])
    assert a.ref_count(b) == 3
    a.free([b])
    a.free([b])
    assert a.ref_count(b) == 1 and a.num_free == 3
    a.free([b])
    assert a.ref_count(b) == 0 and a.num_free == 4
    a.check_invariants()


def test_capacity_errors_take_nothing():
    a = BlockAllocator(4, 16)
    a.allocate(3)
    with pytest.raises(CapacityError, match="cannot allocate 2 KV blocks: 1 of 4"):
        a.allocate(2)
    assert a.num_free == 1
    with pytest.raises(CapacityError):
        BlockAllocator(4, 16).allocate(5)
    assert issubclass(CapacityError, MoestreamError)


def test_misuse_is_a_bug_not_a_capacity_error():
    a = BlockAllocator(4, 4)
    (b,) = a.allocate(1)
    a.free([b])
    with pytest.raises(ValueError):
        a.free([b])
    with pytest.raises(ValueError):
        a.incref([b])
    with pytest.raises(ValueError):
        a.mark_cached(b)
    with pytest.raises(ValueError):
        a.allocate(-1)


def test_cached_blocks_stay_evictable_and_are_evicted_lru_after_free_ones():
    a = BlockAllocator(4, 4)
    evicted = []
    a.set_evict_callback(evicted.append)
    blocks = a.allocate(3)
    for b in blocks:
        a.mark_cached(b)
    a.free(reversed(blocks))  # tail first: blocks[2] is the least recently released
    assert a.num_free == 4 and a.num_evictable == 3 and a.num_used == 0
    a.check_invariants()
    first = a.allocate(1)  # the never-cached block goes first
    assert first not in blocks and evicted == []
    a.allocate(2)
    assert evicted == [blocks[2], blocks[1]]
    assert not a.is_cached(blocks[2]) and a.is_cached(blocks[0])
    a.check_invariants()


def test_incref_revives_an_evictable_block_and_uncache_frees_it():
    a = BlockAllocator(3, 4)
    (b,) = a.allocate(1)
    a.mark_cached(b)
    a.free([b])
    a.incref([b])  # a prefix-cache hit
    assert a.ref_count(b) == 1 and a.num_evictable == 0 and a.num_free == 2
    a.free([b])
    a.uncache(b)
    assert a.num_evictable == 0 and a.num_free == 3 and not a.is_cached(b)
    a.check_invariants()


def test_random_operations_keep_the_partition():
    rng = random.Random(0)
    a = BlockAllocator(16, 4)
    held: list[int] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and a.num_free:
            held += a.allocate(rng.randint(1, a.num_free))
        elif op < 0.55 and held:
            b = rng.choice(held)
            a.incref([b])
            held.append(b)
        elif op < 0.65 and held:
            a.mark_cached(rng.choice(held))
        elif held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            a.free(held[:k])
            held = held[k:]
        assert a.num_used == len(set(held))
        a.check_invariants()
    a.free(held)
    assert a.num_used == 0 and a.num_free == 16
    a.check_invariants()

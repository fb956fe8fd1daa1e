import os
import subprocess
import sys

import pytest

from moestream.cache.block_allocator import BlockAllocator
from moestream.cache.prefix_cache import PrefixCache, block_hashes, extend_block_hashes, hash_block
from moestream.errors import CapacityError

BS = 4


def _cache(num_blocks: int = 16) -> tuple[BlockAllocator, PrefixCache]:
    a = BlockAllocator(num_blocks, BS)
    return a, PrefixCache(a)


def _store(a: BlockAllocator, c: PrefixCache, tokens: list[int], extra=None) -> list[int]:
    """Allocate blocks for `tokens` as a request would, cache its full blocks, keep refs."""
    blocks = a.allocate(a.blocks_needed(len(tokens)))
    hashes = block_hashes(tokens, BS, extra)
    c.insert(hashes, blocks[: len(hashes)])
    return blocks


def test_hash_is_stable_across_processes():
    code = (
        "from moestream.cache.prefix_cache import hash_block;"
        "print(hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8], 'lora-a').hex())"
    )
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.check_output([sys.executable, "-c", code], env=env, text=True))
    assert len(outs) == 1
    assert (
        outs.pop().strip()
        == hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8], "lora-a").hex()
    )


def test_hash_chains_the_whole_prefix_and_the_extra_key():
    h = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    assert len(h) == 2  # the partial third block has no hash
    assert h[1] != block_hashes([0, 2, 3, 4, 5, 6, 7, 8], BS)[1]  # same block, other parent
    assert h != block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS, extra="lora-b")
    assert h[0] == hash_block(None, [1, 2, 3, 4])
    inc: list[bytes] = []
    extend_block_hashes(inc, [1, 2, 3, 4, 5, 6], BS)
    extend_block_hashes(inc, [5, 6, 7, 8, 9], BS)  # continues at the block boundary
    assert inc == h


def test_match_returns_the_cached_full_block_prefix_but_never_the_last_token():
    a, c = _cache()
    tokens = list(range(100, 112))  # exactly 3 full blocks
    blocks = _store(a, c, tokens)
    assert c.match(tokens) == blocks[:2]  # the last token must be computed for its logits
    assert c.match(tokens + [7]) == blocks[:3]
    assert c.match(tokens[:5]) == blocks[:1]
    assert c.match([100, 101, 102]) == []
    assert c.match(tokens + [7], extra="other-adapter") == []
    s = c.stats
    assert (s.queries, s.query_tokens, s.hit_tokens) == (5, 12 + 13 + 5 + 3 + 13, 8 + 12 + 4)


def test_rewriting_the_last_message_reuses_every_full_block_before_it():
    system = list(range(1000, 1037))  # 37 tokens
    turns = [list(range(2000, 2023)), list(range(3000, 3017))]
    last = list(range(4000, 4030))
    first_prompt = system + turns[0] + turns[1] + last
    a, c = _cache(num_blocks=64)
    blocks = _store(a, c, first_prompt)
    a.free(reversed(blocks))  # the first request finished; its blocks stay cached
    rewritten = system + turns[0] + turns[1] + [4000, 4001] + list(range(5000, 5040))
    divergence = len(system) + len(turns[0]) + len(turns[1]) + 2
    hit = c.match(rewritten)
    assert len(hit) == divergence // BS
    assert hit == blocks[: divergence // BS]
    assert c.stats.hit_tokens == divergence // BS * BS


def test_unreferenced_cached_blocks_are_evicted_lru_and_forgotten():
    a, c = _cache(num_blocks=6)
    seq_a, seq_b = list(range(8)), list(range(50, 58))
    blocks_a, blocks_b = _store(a, c, seq_a), _store(a, c, seq_b)
    assert c.num_cached_blocks == 4
    a.free(reversed(blocks_a))  # released first: evicted first
    a.free(reversed(blocks_b))
    a.allocate(2)  # the two never-cached blocks
    assert c.stats.evictions == 0
    a.allocate(1)  # evicts A's tail block
    assert c.stats.evictions == 1
    assert c.match(seq_a + [0]) == blocks_a[:1]
    assert c.match(seq_b + [0]) == blocks_b
    a.allocate(1)
    assert c.match(seq_a + [0]) == []
    assert c.num_cached_blocks == 2
    a.check_invariants()


def test_referenced_cached_blocks_are_never_evicted():
    a, c = _cache(num_blocks=4)
    blocks = _store(a, c, list(range(8)))  # 2 cached blocks, still referenced
    a.allocate(2)
    with pytest.raises(CapacityError):
        a.allocate(1)
    assert c.match(list(range(9))) == blocks


def test_a_hit_revived_with_incref_survives_allocation_pressure():
    a, c = _cache(num_blocks=3)
    tokens = list(range(8))
    blocks = _store(a, c, tokens)
    a.free(reversed(blocks))
    hit = c.match(tokens + [9])
    a.incref(hit)
    assert a.num_free == 1
    a.allocate(1)
    assert c.match(tokens + [9]) == blocks[:2] and c.stats.evictions == 0


def test_duplicate_content_keeps_the_first_block_and_clear_forgets_everything():
    a, c = _cache()
    tokens = list(range(8))
    first = _store(a, c, tokens)
    second = a.allocate(2)
    assert c.insert(block_hashes(tokens, BS), second) == 0
    a.free(second)
    assert a.num_evictable == 0  # the duplicate was not cached
    assert c.match(tokens + [1]) == first
    a.free(first)
    assert a.num_evictable == 2
    c.clear()
    assert c.num_cached_blocks == 0 and a.num_evictable == 0 and a.num_free == 16
    assert c.match(tokens + [1]) == []
    a.check_invariants()

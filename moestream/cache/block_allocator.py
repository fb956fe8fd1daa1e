"""Reference-counted allocator of KV-cache blocks (integer ids into the paged KV pool).

A block is in exactly one of three states:
- free: refcount 0, no cached content; on the free list (FIFO).
- evictable: refcount 0 but its content is registered in the prefix cache; kept in LRU order
  (least recently released first) so a later request can reuse it. `allocate` takes free blocks
  first and evicts from here only when the free list is empty, telling the prefix cache through
  the evict callback so it forgets the block.
- in use: refcount >= 1 (one per request whose block table holds it).

`num_free` counts free + evictable blocks: all that `allocate` can hand out now.
Misuse (freeing a free block, taking a reference on a free block) is our bug and raises
ValueError; asking for more blocks than can be had is a capacity problem (CapacityError).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from moestream.errors import CapacityError


class BlockAllocator:
    """Hands out block ids 0..num_blocks-1 with reference counts. Pure Python."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._cached = [False] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._on_evict: Callable[[int], None] | None = None

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out now (never used, released, or cached but unreferenced)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - self.num_free

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._cached[block_id]

    def blocks_needed(self, num_slots: int) -> int:
        """Blocks that hold `num_slots` token positions."""
        return -(-num_slots // self.block_size)

    # ---- allocation ------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks, each with refcount 1. Evicts LRU cached blocks once the free list
        is empty. Raises CapacityError (taking nothing) if fewer than `n` can be had."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise CapacityError(
                f"cannot allocate {n} KV blocks: {self.num_free} of {self.num_blocks} are free"
            )
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._cached[b] = False
                if self._on_evict is not None:
                    self._on_evict(b)
            self._ref_counts[b] = 1
            out.append(b)
        return out

    def incref(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (sharing a prefix). A cached block with no
        references comes back from the evictable list; a plain free block is a bug."""
        for b in block_ids:
            if self._ref_counts[b] == 0:
                if not self._cached[b]:
                    raise ValueError(f"incref of free block {b}")
                del self._evictable[b]
            self._ref_counts[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the order given. A block whose count reaches 0
        goes to the back of the evictable LRU if cached, else back to the free list. Pass a
        request's blocks last-first so its tail is evicted before its (more shared) head."""
        for b in block_ids:
            if self._ref_counts[b] <= 0:
                raise ValueError(f"free of block {b} with no references")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                if self._cached[b]:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # ---- prefix-cache hooks ----------------------------------------------------------------
    def set_evict_callback(self, on_evict: Callable[[int], None] | None) -> None:
        """`on_evict(block_id)` is called when `allocate` reuses a cached block."""
        self._on_evict = on_evict

    def mark_cached(self, block_id: int) -> None:
        """Its content is now in the prefix cache: keep it evictable rather than free at 0."""
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cannot cache block {block_id}: it has no references")
        self._cached[block_id] = True

    def uncache(self, block_id: int) -> None:
        """Its content left the prefix cache (without eviction): it frees normally again."""
        if not self._cached[block_id]:
            return
        self._cached[block_id] = False
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
            self._free.append(block_id)

    # ---- checks ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the three states do not partition the blocks."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & evictable, "a block is both free and evictable"
        for b in range(self.num_blocks):
            rc = self._ref_counts[b]
            assert rc >= 0, f"block {b} has refcount {rc}"
            if rc > 0:
                assert b not in free and b not in evictable, f"block {b} in use and free"
            elif self._cached[b]:
                assert b in evictable, f"cached block {b} with refcount 0 is not evictable"
            else:
                assert b in free, f"block {b} with refcount 0 is lost"

"""N-gram lookup proposer: right continuations, longest and latest match, O(1) updates."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest

from moestream.spec.base import ProposalInput, proposer_class
from moestream.spec.ngram import DENSE_LOOKUPS, NgramIndex, NgramProposer


def ref_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """Brute force: latest earlier occurrence of the longest suffix, continuation wrapping
    with the occurrence's period."""
    last = len(tokens) - 1
    for n in range(min(max_n, last + 1), min_n - 1, -1):
        suffix = tokens[last - n + 1 :]
        for end in range(last - 1, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                out: list[int] = []
                for j in range(k):
                    pos = end + 1 + j
                    out.append(tokens[pos] if pos <= last else out[j - (last - end)])
                return out, n
    return [], 0


def lookup(tokens: list[int], k: int, min_n: int = 1, max_n: int = 4) -> tuple[list[int], int]:
    idx = NgramIndex(min_n, max_n)
    idx.extend(tokens)
    return idx.lookup(k)


def test_copy_continuation():
    tokens = [1, 2, 3, 4, 5, 6, 7, 9, 9, 1, 2, 3]
    assert lookup(tokens, 4) == ([4, 5, 6, 7], 3)
    assert lookup(tokens, 2) == ([4, 5], 3)


def test_prefers_longest_match():
    # [1, 2] last occurred at 6..7 (then 3), but [5, 1, 2] occurred at 0..2 (then 7).
    tokens = [5, 1, 2, 7, 8, 9, 1, 2, 3, 6, 5, 1, 2]
    assert lookup(tokens, 2) == ([7, 8], 3)
    assert lookup(tokens, 2, max_n=2) == ([3, 6], 2)


def test_prefers_latest_occurrence_and_wraps_period():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]
    assert lookup(tokens, 4, max_n=2) == ([4, 1, 2, 4], 2)
    assert lookup([7, 1, 2, 1, 2], 5) == ([1, 2, 1, 2, 1], 2)
    assert lookup([3, 3, 3], 4) == ([3, 3, 3, 3], 2)


def test_no_match_no_proposal():
    assert lookup([1, 2, 3, 4, 5], 3) == ([], 0)
    # a repeated single token is only a unigram match: ignored when min_n = 2
    assert lookup([1, 2, 3, 1], 3, min_n=1) == ([2, 3, 1], 1)
    assert lookup([1, 2, 3, 1], 3, min_n=2) == ([], 0)
    prop = NgramProposer(min_n=2, max_n=3)
    assert prop.propose([ProposalInput("a", [1, 2, 3, 4], [5], num_drafts=3)]) == {}


@pytest.mark.parametrize("min_n,max_n", [(1, 3), (2, 4)])
def test_incremental_matches_brute_force(min_n, max_n):
    rng = random.Random(0)
    prompt = [rng.randrange(4) for _ in range(40)]
    output: list[int] = []
    prop = NgramProposer(min_n, max_n)
    for step in range(150):
        k = 1 + step % 5
        got = prop.propose([ProposalInput("r", prompt, output, num_drafts=k)])
        want, n = ref_lookup(prompt + output, k, min_n, max_n)
        if want:
            assert got["r"].token_ids == want
            assert got["r"].meta["match_len"] == n
        else:
            assert got == {}
        output.extend(rng.randrange(4) for _ in range(1 + step % 3))  # 1-3 new tokens a step


class CountingList(list):
    """A list that counts the elements read through slicing or indexing."""

    reads = 0

    def __getitem__(self, item):
        got = super().__getitem__(item)
        CountingList.reads += len(got) if isinstance(item, slice) else 1
        return got


def test_updates_are_constant_time():
    rng = random.Random(1)
    prompt = CountingList(rng.randrange(1000) for _ in range(100_000))
    output = CountingList()
    prop = NgramProposer(2, 4)
    prop.propose([ProposalInput("r", prompt, output, num_drafts=4)])
    assert CountingList.reads == 100_000  # the prompt is read once
    CountingList.reads = 0
    start = time.perf_counter()
    steps = 20_000
    for _ in range(steps):
        output.append(rng.randrange(1000))
        prop.propose([ProposalInput("r", prompt, output, num_drafts=4)])
    elapsed = time.perf_counter() - start
    assert CountingList.reads == steps  # one new token read per step: no rescans
    # A rescan per step would touch 2e9 tokens; constant work is ~10 us a step.
    assert elapsed < 10.0, elapsed
    idx = prop._index["r"]
    assert len(idx) == 100_000 + steps
    assert all(len(d) <= len(idx) for d in idx._last_end)


def test_release_frees_state_and_id_can_be_reused():
    prop = NgramProposer(2, 3)
    inp = ProposalInput("r", [1, 2, 3, 1, 2], [], num_drafts=2)
    assert prop.propose([inp])["r"].token_ids == [3, 1]
    assert prop.num_requests == 1
    prop.release("r")
    prop.release("unknown")  # no-op
    assert prop.num_requests == 0
    # the same id now names another request: no stale index
    other = ProposalInput("r", [7, 8, 9, 7, 8], [], num_drafts=2)
    assert prop.propose([other])["r"].token_ids == [9, 7]


def test_batch_of_requests_is_independent():
    prop = NgramProposer(2, 3)
    a = ProposalInput("a", [1, 2, 3, 1, 2], [], num_drafts=3)
    b = ProposalInput("b", [4, 5, 6], [4, 5], num_drafts=1)
    c = ProposalInput("c", [9, 8, 7], [], num_drafts=2)
    out = prop.propose([a, b, c])
    assert out["a"].token_ids == [3, 1, 2]
    assert out["b"].token_ids == [6]
    assert "c" not in out


def test_registry_and_pure_python_import():
    assert proposer_class("ngram") is NgramProposer
    with pytest.raises(ValueError, match="unknown proposer"):
        proposer_class("eagle")
    # the n-gram proposer, the picker and the counters never import torch
    code = "import sys, moestream.spec; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 4), (2, 4), (3, 5)])
def test_index_built_in_chunks_equals_index_built_at_once(min_n, max_n):
    """The dict index caught up after every chunk of 0..20 tokens (bulk from the max_n-th
    token on) holds what one built over all the tokens at the end holds."""
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(50):
        chunked, once = NgramIndex(min_n, max_n), NgramIndex(min_n, max_n)
        for _ in range(rng.randint(1, 6)):
            chunk = [rng.randrange(5) for _ in range(rng.randint(0, 20))]
            for t in chunk:
                chunked.append(t)
            chunked.build_index()
            once.extend(chunk)
        once.build_index()
        assert chunked.tokens == once.tokens and chunked._last_end == once._last_end
        assert chunked.lookup(4) == once.lookup(4)


# token ids whose 4-byte words share bytes: a byte match that straddles two words must not count
STRADDLING = [0, 1, 256, 65536, 16777216, 257]


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 4), (2, 4), (3, 5)])
@pytest.mark.parametrize("vocab", [[0, 1, 2], list(range(7)), STRADDLING, list(range(70_000))])
def test_scanned_and_indexed_lookups_equal_brute_force(min_n, max_n, vocab):
    """A lookup that scans (rare lookups) and one that reads the dict index (frequent
    lookups) both give the brute force's proposal, on random streams."""
    rng = random.Random(len(vocab) * 100 + min_n * 10 + max_n)
    for _ in range(30):
        scanned = NgramIndex(min_n, max_n, index_after=float("inf"))
        indexed = NgramIndex(min_n, max_n, index_after=0)
        tokens: list[int] = []
        for _ in range(rng.randint(1, 10)):
            chunk = rng.choices(vocab, k=rng.randint(0, 12))
            tokens += chunk
            scanned.extend(chunk)
            indexed.extend(chunk)
            k = rng.randint(1, 6)
            want = ref_lookup(tokens, k, min_n, max_n)
            assert scanned.lookup(k) == want, tokens
            assert indexed.lookup(k) == want, tokens
        assert not scanned.indexed and not any(scanned._last_end)
        assert indexed.indexed or len(tokens) == 0


def test_the_index_is_built_once_lookups_are_dense():
    """Rare lookups (a request whose rounds are skipped) scan and never build the index, nor
    do lookups at every token of a short sequence (a scan of it costs less than indexing a
    token); `DENSE_LOOKUPS` in a row at every token of a long one build it (a long request
    drafting every step). The proposals are the brute force's throughout."""
    rng = random.Random(3)
    prompt = [rng.randrange(50) for _ in range(2000)]

    def lookups(idx: NgramIndex, tokens: list[int], steps: int, every: int) -> int | None:
        """Lookups after every `every` new tokens; the first at which the index was built."""
        idx.extend(tokens)
        built = None
        for step in range(steps):
            new = [rng.randrange(50) for _ in range(every)]
            idx.extend(new)
            tokens = tokens + new
            assert idx.lookup(3) == ref_lookup(tokens, 3, 2, 4)
            if built is None and idx.indexed:
                built = step
        return built

    rare = NgramIndex(2, 4)
    assert lookups(rare, prompt, 20, every=100) is None and not any(rare._last_end)
    assert lookups(NgramIndex(2, 4), prompt[:200], 2 * DENSE_LOOKUPS, every=1) is None
    # (the first lookup is not dense: none came before it)
    assert lookups(NgramIndex(2, 4), prompt, 2 * DENSE_LOOKUPS, every=1) == DENSE_LOOKUPS

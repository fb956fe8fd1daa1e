"""N-gram lookup proposer (prompt lookup decoding): copy what followed the current suffix the
last time it occurred in the prompt or the output. Pure Python.

A lookup tries the longest suffix first (n = max_n..min_n); the proposal is the tokens that
followed its latest earlier occurrence. When that occurrence ends within k tokens of the end
(a repeating pattern of period P < k), the continuation wraps around with period P, as the
sequence would if it kept repeating.

Per request an `NgramIndex` finds that occurrence in one of two ways, with the same answer:
- a scan: the tokens are also kept as 4-byte words in a `bytearray`, and `rfind` of the
  suffix's bytes runs backwards over them in C (~0.5 ns a token). Appending costs nothing
  more; a lookup costs O(length). While lookups are rare (a request whose rounds are skipped
  because nothing is drafted: one every ~100 steps) this is all there is;
- a dict per n from each n-gram to the end of its latest occurrence with a known successor:
  O(1) a lookup, but indexing a token costs ~250-400 ns of Python. It pays where lookups are
  dense: fewer than 1 / `SCAN_RATIO` of the sequence's length apart (a scan of the sequence
  then costs more than indexing the tokens added since the last lookup). It is built after
  `DENSE_LOOKUPS` dense lookups in a row, and from then on catches up on new tokens at each
  lookup.
So a long request that drafts every step soon has its index, and one whose rounds are skipped
never pays for one (indexing a 30k-token prompt took 13 ms; a scan of it takes ~16 us).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from moestream.spec.base import Proposal, ProposalInput, Proposer

_TOKEN_BITS = 32  # token ids are packed into one int key per n-gram...
_WORD = array("I").itemsize  # ... and are 4-byte words in the scanned buffer
# A lookup is dense when the tokens added since the previous one, times SCAN_RATIO, are fewer
# than the sequence's: a scan reads a token in ~0.5 ns (up to three scans a lookup), the index
# takes ~250-400 ns to add one. DENSE_LOOKUPS in a row build the index: a new request's first
# rounds (a few steps apart) do not build one for a long prompt, a drafting request soon has it.
SCAN_RATIO = 256
DENSE_LOOKUPS = 16


class NgramIndex:
    """The tokens of one sequence, and the latest earlier occurrence of its suffixes (see the
    module docstring: scanned, or indexed once lookups are frequent)."""

    def __init__(self, min_n: int = 2, max_n: int = 4, index_after: float = DENSE_LOOKUPS) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if _WORD != 4:
            raise RuntimeError(f"array('I') has {_WORD}-byte items here, need 4")
        self.min_n, self.max_n = min_n, max_n
        self.index_after = index_after  # dense lookups (0: index at once; inf: scan always)
        self.tokens: list[int] = []
        self._words = bytearray()  # the tokens as 4-byte words, for `rfind`
        self._looked_up = 0  # the sequence's length at the last lookup...
        self._dense = 0  # ... and dense lookups in a row until then
        self._indexed = -1  # tokens the dict index covers (-1: none built)
        self._last_end: list[dict[int, int]] = [{} for _ in range(max_n + 1)]  # [n] key -> end

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def indexed(self) -> bool:
        """Whether lookups use the dict index (built after `index_after` dense lookups in a
        row)."""
        return self._indexed >= 0

    def append(self, token: int) -> None:
        self.extend((token,))

    def extend(self, tokens: Sequence[int]) -> None:
        """Add `tokens` at the end (O(len(tokens)) in C; the dict index, if built, catches up
        at the next lookup)."""
        self.tokens.extend(tokens)
        self._words += array("I", tokens).tobytes()

    def build_index(self) -> None:
        """Index every n-gram whose successor is known, or catch up on the tokens added since
        (the ends from `_indexed - 1` on): per n, the keys in one comprehension and one dict
        update, a later occurrence overwriting an earlier one."""
        toks = self.tokens
        first = max(0, self._indexed - 1)  # the n-grams ending here get their successor now
        stop = len(toks) - 1
        self._indexed = len(toks)
        head = min(stop, max(first, self.max_n - 1))  # ends before it lack some n-grams
        for end in range(first, head):
            key = shift = 0
            for n in range(1, min(self.max_n, end + 1) + 1):
                key |= toks[end - n + 1] << shift
                shift += _TOKEN_BITS
                if n >= self.min_n:
                    self._last_end[n][key] = end
        if head >= stop:
            return
        ends = range(head, stop)
        keys = toks[head:stop]  # n = 1
        for n in range(1, self.max_n + 1):
            if n > 1:
                shift = _TOKEN_BITS * (n - 1)
                older = toks[head - n + 1 : stop - n + 1]
                keys = [k | t << shift for k, t in zip(keys, older)]
            if n >= self.min_n:
                self._last_end[n].update(zip(keys, ends))

    def lookup(self, k: int) -> tuple[list[int], int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching
        suffix, and that suffix's length n; ([], 0) when no suffix of min_n.. tokens recurs."""
        length = len(self.tokens)
        last = length - 1
        if k < 1 or last < 0:
            return [], 0
        if self._indexed < 0:
            dense = (length - self._looked_up) * SCAN_RATIO < length
            self._dense = self._dense + 1 if dense else 0
            self._looked_up = length
            if self._dense >= self.index_after:
                self._indexed = 0
        if self._indexed >= 0:
            if self._indexed < length:
                self.build_index()
            end, n = self._indexed_match(last)
        else:
            end, n = self._scanned_match(last)
        if n == 0:
            return [], 0
        period = last - end  # >= 1: `end` always has a successor
        out: list[int] = []
        for j in range(k):
            pos = end + 1 + j
            out.append(self.tokens[pos] if pos <= last else out[j - period])
        return out, n

    def _indexed_match(self, last: int) -> tuple[int, int]:
        """(end of the latest earlier occurrence of the longest matching suffix, its n), or
        (-1, 0), from the dict index."""
        toks, key = self.tokens, 0
        keys = []
        for n in range(1, min(self.max_n, last + 1) + 1):
            key |= toks[last - n + 1] << (_TOKEN_BITS * (n - 1))
            keys.append(key)
        for n in range(len(keys), self.min_n - 1, -1):
            end = self._last_end[n].get(keys[n - 1])
            if end is not None:
                return end, n
        return -1, 0

    def _scanned_match(self, last: int) -> tuple[int, int]:
        """`_indexed_match` by scanning: the shortest suffix first (none recurring, no longer
        one does), then the longest down."""
        end = self._rfind(self.min_n, last)
        if end < 0:
            return -1, 0
        for n in range(min(self.max_n, last), self.min_n, -1):
            longer = self._rfind(n, last)
            if longer >= 0:
                return longer, n
        return end, self.min_n

    def _rfind(self, n: int, last: int) -> int:
        """End of the latest occurrence of the last n tokens that ends before `last`, or -1."""
        if n > last:  # no room for an earlier occurrence
            return -1
        words = self._words
        width = n * _WORD
        suffix = words[-width:]
        stop = last * _WORD  # occurrences end at a token before `last`
        while True:
            i = words.rfind(suffix, 0, stop)
            if i < 0 or i % _WORD == 0:
                return i // _WORD + n - 1 if i >= 0 else -1
            stop = i + width - 1  # a match across word boundaries: look before it


class NgramProposer(Proposer):
    """Prompt-lookup drafts from a per-request `NgramIndex`, updated with each call's new
    tokens. `Proposal.meta["match_len"]` is the length of the suffix that matched."""

    name = "ngram"
    costs_forward = False

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[str, NgramIndex] = {}

    @property
    def num_requests(self) -> int:
        """Requests with an index (for tests and memory accounting)."""
        return len(self._index)

    def index(self, inp: ProposalInput) -> NgramIndex:
        """The request's index, brought up to date with its tokens (reads only new ones)."""
        idx = self._index.get(inp.request_id)
        n = inp.num_tokens
        if idx is None or len(idx) > n:  # new request, or an id reused for another one
            idx = self._index[inp.request_id] = NgramIndex(self.min_n, self.max_n)
        if len(idx) < n:
            idx.extend(inp.token_slice(len(idx), n))
        return idx

    def propose(self, inputs: Sequence[ProposalInput]) -> dict[str, Proposal]:
        out = {}
        for inp in inputs:
            tokens, n = self.index(inp).lookup(inp.num_drafts)
            if tokens:
                out[inp.request_id] = Proposal(tokens, meta={"match_len": n})
        return out

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)

    def request_ids(self) -> list[str]:
        return list(self._index)

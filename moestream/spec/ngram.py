"""N-gram lookup proposer (prompt lookup decoding): copy what followed the current suffix the
last time it occurred in the prompt or the output. Pure Python.

Per request an `NgramIndex` maps each n-gram (n = min_n..max_n) to the end position of its most
recent occurrence whose next token is known. Appending a token inserts max_n - min_n + 1 keys
and a lookup probes at most as many: O(1) per token whatever the length, no rescans. A lookup
tries the longest suffix first; the proposal is the tokens that followed its last earlier
occurrence. When that occurrence ends within k tokens of the end (a repeating pattern of period
P < k), the continuation wraps around with period P, as the sequence would if it kept repeating.
"""

from __future__ import annotations

from collections.abc import Sequence

from moestream.spec.base import Proposal, ProposalInput, Proposer

_TOKEN_BITS = 32  # token ids are packed into one int key per n-gram


class NgramIndex:
    """The tokens of one sequence and, per n-gram, the end position of its latest occurrence
    that is followed by a known token (so never the sequence's current suffix itself)."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._last_end: list[dict[int, int]] = [{} for _ in range(max_n + 1)]  # [n] key -> end

    def __len__(self) -> int:
        return len(self.tokens)

    def _keys(self, end: int) -> list[int]:
        """Keys of the n-grams ending at `end`, for n = 1..min(max_n, end + 1)."""
        toks, keys, key = self.tokens, [], 0
        for n in range(1, min(self.max_n, end + 1) + 1):
            key |= toks[end - n + 1] << (_TOKEN_BITS * (n - 1))
            keys.append(key)
        return keys

    def append(self, token: int) -> None:
        """Add one token: the n-grams ending just before it now have a known successor."""
        toks = self.tokens
        end = len(toks) - 1
        key = shift = 0
        for n in range(1, min(self.max_n, end + 1) + 1):
            key |= toks[end - n + 1] << shift
            shift += _TOKEN_BITS
            if n >= self.min_n:
                self._last_end[n][key] = end
        toks.append(token)

    def extend(self, tokens: Sequence[int]) -> None:
        """`append` each of `tokens`, in bulk: per n, the keys of every new n-gram in one
        comprehension and one dict update (a later occurrence overwrites an earlier one)."""
        toks = self.tokens
        few = len(tokens) < 8  # where one by one is as fast
        head = len(tokens) if few else min(len(tokens), max(0, self.max_n - len(toks)))
        for t in tokens[:head]:  # a few tokens, or until a max_n-gram fits: one by one
            self.append(t)
        if head == len(tokens):
            return
        first = len(toks) - 1  # the n-grams ending here get their successor now
        toks.extend(tokens[head:])
        stop = len(toks) - 1
        ends = range(first, stop)
        keys = toks[first:stop]  # n = 1
        for n in range(1, self.max_n + 1):
            if n > 1:
                shift = _TOKEN_BITS * (n - 1)
                older = toks[first - n + 1 : stop - n + 1]
                keys = [k | t << shift for k, t in zip(keys, older)]
            if n >= self.min_n:
                self._last_end[n].update(zip(keys, ends))

    def lookup(self, k: int) -> tuple[list[int], int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching
        suffix, and that suffix's length n; ([], 0) when no suffix of min_n.. tokens recurs."""
        last = len(self.tokens) - 1
        if k < 1 or last < 0:
            return [], 0
        keys = self._keys(last)
        for n in range(len(keys), self.min_n - 1, -1):
            end = self._last_end[n].get(keys[n - 1])
            if end is None:
                continue
            period = last - end  # >= 1: `end` always has a successor
            out: list[int] = []
            for j in range(k):
                pos = end + 1 + j
                out.append(self.tokens[pos] if pos <= last else out[j - period])
            return out, n
        return [], 0


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

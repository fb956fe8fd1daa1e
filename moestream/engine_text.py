"""The text of one request as the engine streams it: incremental detokenization, stop strings,
and deltas that never split a stop string.

Rules (tested in tests/engine/test_engine.py):
- `text` is the decoded output; when a stop string appears, it and everything after it are cut
  and the request ends. The token that completed the stop string stays in the token ids.
- The text of the EOS / stop token that ended a request is not added (`drop_last`).
- A delta never ends inside a multi-byte character (the decoder holds bytes back) nor with a
  proper prefix of a stop string (held back until it either completes, and is cut, or cannot).
  So the concatenated deltas equal the final text, and no delta ever shows a partial stop string.
"""

from __future__ import annotations

from moestream.tokenizer import StreamDecoder, Tokenizer


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string: those
    characters may still become a stop string and must not be streamed yet."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold


class RequestText:
    """Text state of one request (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.decoder = StreamDecoder(tokenizer)
        self.stop = list(stop)
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string cut the text: nothing more is added
        self.finished = False

    def add_tokens(self, token_ids: list[int], drop_last: bool = False) -> tuple[int, str | None]:
        """Decode `token_ids` in order (all but the last if `drop_last`), checking stop strings
        after each. Returns (how many of the ids to keep, the stop string found or None): on a
        stop the ids after the one that completed it are to be dropped."""
        n = len(token_ids)
        for i, t in enumerate(token_ids):
            if self.stopped or (drop_last and i == n - 1):
                break
            old = len(self.text)
            self.text += self.decoder.feed(t)
            stop = self._find_stop(old)
            if stop is not None:
                return i + 1, stop
        return n, None

    def finish(self) -> None:
        """The request ended: flush bytes the decoder held back (unless a stop string cut the
        text) and release everything held for stop strings."""
        if not self.stopped:
            old = len(self.text)
            self.text += self.decoder.finish()
            self._find_stop(old)
        self.finished = True

    def take_delta(self) -> str:
        """Text that is final and not yet handed out; marks it handed out."""
        visible = len(self.text)
        if self.stop and not self.finished:
            visible -= held_back(self.text, self.stop)
        delta = self.text[self.emitted : visible] if visible > self.emitted else ""
        self.emitted = max(self.emitted, visible)
        return delta

    @property
    def emitted_text(self) -> str:
        return self.text[: self.emitted]

    def _find_stop(self, old_len: int) -> str | None:
        """Earliest stop string that ends in text added after `old_len`; cuts the text there."""
        if not self.stop or len(self.text) == old_len:
            return None
        start = max(0, old_len - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        self.stopped = True
        return best[1]

"""`moestream eval --reference`: our logits against a reference implementation's on real text.

The text is tokenized with our tokenizer and cut into non-overlapping windows of `ctx` tokens;
each window is scored from an empty context by `LLM.logits` and by the reference (the same token
ids). Over every position of every window:
- top-1 agreement: argmax(ours) == argmax(ref);
- KL(ref || ours) = sum_v p_ref(v) (log p_ref(v) - log p_ours(v)), mean over positions (nats);
- perplexity of each side: exp(mean next-token NLL) over the positions whose next token lies in
  the same window.
Gates: top-1 >= `min_top1` and mean KL <= `max_kl` (defaults 0.9 and 0.1, as in the seeds).

The default text, moestream/data/heldout-python.txt, is the first ~40 KB of the held-out set of
the tiny demo models (files of the Python 3.11 standard library's `test/` package joined by
<|endoftext|>; the models never trained on it), copied from /work/shared/data/heldout-python.txt.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "data" / "heldout-python.txt"
DEFAULT_MIN_TOP1 = 0.9
DEFAULT_MAX_KL = 0.1
_ROWS = 64  # rows per float64 chunk in the KL

LogitsFn = Callable[[Sequence[int]], torch.Tensor]  # ids [T] -> float32 logits [T, V]


@dataclass
class LogitsEvalResult:
    n_windows: int
    n_positions: int  # positions scored for top-1 and KL
    n_predictions: int  # positions scored for perplexity
    top1: float
    kl_mean: float
    kl_max: float
    ppl_ours: float
    ppl_ref: float
    min_top1: float
    max_kl: float

    @property
    def top1_ok(self) -> bool:
        return self.top1 >= self.min_top1

    @property
    def kl_ok(self) -> bool:
        return self.kl_mean <= self.max_kl

    @property
    def passed(self) -> bool:
        return self.top1_ok and self.kl_ok

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "top1_ok": self.top1_ok, "kl_ok": self.kl_ok, "passed": self.passed}


def windows(n_tokens: int, ctx: int) -> list[tuple[int, int]]:
    """[start, end) of consecutive non-overlapping windows of at most `ctx` tokens; a last
    window shorter than 2 tokens (nothing to predict) is dropped."""
    if ctx < 2:
        raise ValueError(f"ctx must be >= 2, got {ctx}")
    out = [(s, min(s + ctx, n_tokens)) for s in range(0, n_tokens, ctx)]
    return [(s, e) for s, e in out if e - s >= 2]


@dataclass
class _Totals:
    positions: int = 0
    agree: int = 0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    predictions: int = 0
    nll_ours: float = 0.0
    nll_ref: float = 0.0

    def add(self, ours: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> None:
        """ours, ref: logits [T, V]; targets: [T - 1] next tokens of rows 0..T-2.

        Float64 in chunks of rows: exact enough for KL near 0, bounded memory at V ~ 150K."""
        self.positions += ours.shape[0]
        self.agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
        self.predictions += targets.numel()
        for s in range(0, ours.shape[0], _ROWS):
            logp_ours = torch.log_softmax(ours[s : s + _ROWS].double(), dim=-1)  # [R, V]
            logp_ref = torch.log_softmax(ref[s : s + _ROWS].double(), dim=-1)  # [R, V]
            kl = (logp_ref.exp() * (logp_ref - logp_ours)).sum(-1)  # [R]
            self.kl_sum += float(kl.sum())
            self.kl_max = max(self.kl_max, float(kl.max()))
            tgt = targets[s : s + _ROWS]  # [<= R]: the last row of a window has no target
            rows = torch.arange(tgt.numel())
            self.nll_ours -= float(logp_ours[rows, tgt].sum())
            self.nll_ref -= float(logp_ref[rows, tgt].sum())


def evaluate_logits(
    ours: LogitsFn,
    ref: LogitsFn,
    token_ids: Sequence[int],
    ctx: int = 512,
    min_top1: float = DEFAULT_MIN_TOP1,
    max_kl: float = DEFAULT_MAX_KL,
    progress: Callable[[int, int], None] | None = None,
) -> LogitsEvalResult:
    """Score `token_ids` window by window through both logit functions (see module doc)."""
    spans = windows(len(token_ids), ctx)
    if not spans:
        raise ValueError("the text has fewer than 2 tokens")
    t = _Totals()
    for i, (s, e) in enumerate(spans):
        ids = [int(x) for x in token_ids[s:e]]
        a, b = ours(ids), ref(ids)  # [T, V] each
        if a.shape != b.shape:
            raise ValueError(
                f"logits shapes differ: ours {tuple(a.shape)}, "
                f"reference {tuple(b.shape)} (vocabulary sizes must match)"
            )
        t.add(a, b, torch.tensor(ids[1:], dtype=torch.long))
        if progress:
            progress(i + 1, len(spans))
    return LogitsEvalResult(
        n_windows=len(spans),
        n_positions=t.positions,
        n_predictions=t.predictions,
        top1=t.agree / t.positions,
        kl_mean=t.kl_sum / t.positions,
        kl_max=t.kl_max,
        ppl_ours=math.exp(t.nll_ours / t.predictions),
        ppl_ref=math.exp(t.nll_ref / t.predictions),
        min_top1=min_top1,
        max_kl=max_kl,
    )


def format_logits_result(r: LogitsEvalResult, ours: str, ref: str) -> str:
    def mark(ok: bool) -> str:
        return "pass" if ok else "FAIL"

    return "\n".join(
        [
            f"ours: {ours}",
            f"reference: {ref}",
            f"scored: {r.n_windows} windows, {r.n_positions} positions "
            f"({r.n_predictions} next-token predictions)",
            f"top-1 agreement  {r.top1:.4f}  (>= {r.min_top1})  {mark(r.top1_ok)}",
            f"KL(ref || ours)  {r.kl_mean:.3e} nats mean, {r.kl_max:.3e} max  "
            f"(<= {r.max_kl})  {mark(r.kl_ok)}",
            f"perplexity       ours {r.ppl_ours:.4f}, reference {r.ppl_ref:.4f}",
            f"logits gate: {'PASS' if r.passed else 'FAIL'}",
        ]
    )

"""Verification of one step's drafts on the target's logits (the runner's side of speculation).

A request that fed its last token and k drafts has k + 1 logits rows: position j predicts the
token after draft j - 1. `verify_drafts` takes those rows for every verifying request, laid end
to end ([R, V], R = sum of k_b + 1), pads them to [B, K + 1, V] (K the largest k) and runs
`rejection_sample` with each row's own k: greedy rows accept drafts while they equal the target's
argmax, random rows keep the target distribution exactly. Logprobs of the emitted tokens come
from the same rows as plain decode's would (the sampler's `logprobs_mode`; penalties at
position j count drafts 0..j-1), so on a batch-invariant backend they are the same floats.

Letters: R logits rows, B verifying requests, K most drafts, V vocabulary. No host
synchronisation here: the caller reads the results once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moestream.sampling.logprobs import TokenLogprobs, gather_logprobs
from moestream.sampling.penalties import apply_penalties, draft_token_counts
from moestream.sampling.rejection import rejection_sample
from moestream.sampling.sampler import SamplingBatch, process_logits


@dataclass(frozen=True, eq=False)
class Verified:
    """Row b emits `token_ids[b, :num_accepted[b] + 1]` (accepted drafts, then one token)."""

    token_ids: torch.Tensor  # [B, K+1] int64, -1 past what row b emits
    num_accepted: torch.Tensor  # [B] int64
    logprobs: TokenLogprobs | None  # [B*(K+1)] rows: of token_ids (row b*(K+1)+j is j of b)


def pad_rows(logits: torch.Tensor, num_drafts: Sequence[int]) -> torch.Tensor:
    """[R, V] rows laid end to end (k_b + 1 per request) -> [B, K+1, V]; a row's padding
    repeats its last real position (finite, never read)."""
    most = max(num_drafts)
    index, start = [], 0
    for k in num_drafts:
        index.extend(start + min(j, k) for j in range(most + 1))
        start += k + 1
    if start != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows for drafts {list(num_drafts)}")
    idx = torch.tensor(index, dtype=torch.int64).to(logits.device)
    return logits.index_select(0, idx).view(len(num_drafts), most + 1, logits.shape[1])


def verify_drafts(
    logits: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    batch: SamplingBatch,
    *,
    generator: torch.Generator | None = None,
    logprobs_mode: str = "raw",
) -> Verified:
    """Verify every request's drafts from its rows of `logits` [R, V] (see the module
    docstring). `batch` has one row per request (its output so far, without the drafts);
    logprobs are gathered when any request asks for them (`batch.num_logprobs`)."""
    num_drafts = [len(d) for d in draft_token_ids]
    if not num_drafts or min(num_drafts) < 1:
        raise ValueError(f"every verifying request needs drafts, got {num_drafts}")
    most = max(num_drafts)
    target = pad_rows(logits, num_drafts)  # [B, K+1, V]
    drafts = torch.tensor(
        [list(d) + [0] * (most - len(d)) for d in draft_token_ids], dtype=torch.int64
    ).to(logits.device)  # [B, K]
    out, accepted = rejection_sample(drafts, None, target, batch, generator, num_drafts)
    logprobs = None
    if any(n is not None for n in batch.num_logprobs):
        source = _logprobs_source(target, drafts, batch, logprobs_mode)  # [B*(K+1), V]
        logprobs = gather_logprobs(source, out.clamp_min(0).reshape(-1), batch.max_num_logprobs)
    return Verified(out, accepted, logprobs)


def _logprobs_source(
    target: torch.Tensor, drafts: torch.Tensor, batch: SamplingBatch, mode: str
) -> torch.Tensor:
    """The logits plain decode would take logprobs from, at every verify position."""
    b, positions, vocab = target.shape
    raw = target.reshape(b * positions, vocab).to(torch.float32)
    if mode == "raw":
        return raw
    rows = batch.repeat_rows(positions)
    penalised = raw
    if batch.any_penalties:
        drafted = draft_token_counts(drafts, vocab).reshape(b * positions, vocab)
        penalised = apply_penalties(raw, rows, drafted)
    # Greedy rows carry temperature 1 and no truncation: processing leaves them penalised.
    return penalised if mode == "penalized" else process_logits(penalised, rows)

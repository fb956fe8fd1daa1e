"""Repetition, presence and frequency penalties over a batch of logits.

Conventions (as in vLLM and the OpenAI API):
- repetition penalty r (Hugging Face / CTRL style): every token seen in the prompt or the output
  has its logit divided by r when positive and multiplied by r when not. r = 1 is off.
- frequency penalty f and presence penalty a (OpenAI style), on output tokens only:
  `logit -= f * count + a * (count > 0)`. 0 is off.
All three are applied to the raw logits before temperature, to every row (greedy rows too).
A row whose penalties are off is left bit for bit unchanged: x / 1, x * 1 and x - 0 are exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moestream.sampling.sampler import SamplingBatch


def output_token_counts(batch: SamplingBatch, vocab_size: int) -> torch.Tensor:
    """How often each token occurs in each row's output so far: float32 [B, V].

    Only rows with a penalty carry their output tokens in the batch; other rows count zero.
    """
    counts = torch.zeros(batch.num_rows, vocab_size, dtype=torch.float32, device=batch.device)
    ones = torch.ones_like(batch.output_token_ids, dtype=torch.float32)
    # Integer-valued float sums are exact whatever order the atomics run in.
    return counts.index_put_((batch.output_token_rows, batch.output_token_ids), ones, True)


def prompt_token_mask(batch: SamplingBatch, vocab_size: int) -> torch.Tensor:
    """True where a token occurs in the row's prompt: bool [B, V] (rows with repetition penalty)."""
    mask = torch.zeros(batch.num_rows, vocab_size, dtype=torch.bool, device=batch.device)
    seen = torch.ones_like(batch.prompt_token_ids, dtype=torch.bool)
    return mask.index_put_((batch.prompt_token_rows, batch.prompt_token_ids), seen)


def draft_token_counts(draft_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counts of the drafts that precede each verify position: float32 [B, k+1, V].

    Position j of a verify pass sees the output extended by drafts 0..j-1, so the penalties at
    position j must count them (speculation must not change what penalties see).
    """
    b, k = draft_token_ids.shape  # [B, k]
    counts = torch.zeros(b, k + 1, vocab_size, dtype=torch.float32, device=draft_token_ids.device)
    if k:
        counts[:, 1:].scatter_(2, draft_token_ids.unsqueeze(-1), 1.0)
    return counts.cumsum_(dim=1)


def apply_penalties(
    logits: torch.Tensor, batch: SamplingBatch, extra_output_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """Penalised copy of `logits` [B, V] float32.

    `extra_output_counts` [B, V] adds tokens to the output counts (drafts being verified).
    """
    vocab_size = logits.shape[-1]
    counts = output_token_counts(batch, vocab_size)  # [B, V]
    if extra_output_counts is not None:
        counts = counts + extra_output_counts
    occurred = counts > 0  # [B, V]
    out = logits
    if batch.any_repetition_penalty:
        seen = occurred | prompt_token_mask(batch, vocab_size)
        r = batch.repetition_penalty.unsqueeze(1)  # [B, 1]
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    f = batch.frequency_penalty.unsqueeze(1)  # [B, 1]
    a = batch.presence_penalty.unsqueeze(1)
    return out - f * counts - a * occurred.to(torch.float32)

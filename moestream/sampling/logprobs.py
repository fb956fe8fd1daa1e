"""Log-probabilities returned with sampled tokens.

Which distribution they describe is the sampler's `logprobs_mode`:
- "raw" (default, as vLLM's `raw_logprobs`): log-softmax of the model's logits, before
  penalties, temperature and truncation. What evaluation (perplexity, KL) wants.
- "penalized": log-softmax after the penalties, before temperature and truncation.
- "processed": log-softmax of the distribution the token was drawn from (after penalties,
  temperature, min-p, top-k, top-p); tokens filtered out have -inf. Greedy rows: "penalized".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LogprobsMode = Literal["raw", "penalized", "processed"]
LOGPROBS_MODES: tuple[str, ...] = ("raw", "penalized", "processed")


@dataclass(frozen=True, eq=False)
class TokenLogprobs:
    """Logprobs of the sampled tokens and, when asked, of each row's top tokens."""

    logprobs: torch.Tensor  # [B] float32: logprob of the sampled token
    ranks: torch.Tensor  # [B] int64: 1 + number of tokens with a strictly higher logprob
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None  # (values [B, K] f32, ids [B, K] i64)


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> TokenLogprobs:
    """Logprobs of `token_ids` [B] under log_softmax(`logits` [B, V]) and the `num_top` best.

    `num_top` is the largest count any row asked for (0 or less: no top list). Rows that asked
    for fewer read the first entries; their order is by descending logprob.
    """
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [B, V]
    sampled = logprobs.gather(1, token_ids.unsqueeze(1))  # [B, 1]
    ranks = (logprobs > sampled).sum(dim=-1) + 1  # [B]
    top = None
    if num_top > 0:
        values, ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)  # [B, K]
        top = (values, ids)
    return TokenLogprobs(sampled.squeeze(1), ranks, top)

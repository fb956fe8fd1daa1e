"""Rejection sampling for speculative decoding: verify drafted tokens against the target.

For each row with drafts x_0..x_{k-1} (drawn from q_j) and target logits at k+1 positions:
- greedy rows accept while x_j == argmax(target_j) and then emit the target argmax, so their
  output is exactly the target's greedy continuation;
- random rows accept x_j with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection
  they emit a token drawn from norm(max(0, p_j - q_j)); if all k are accepted they emit a bonus
  token drawn from p_k. Each emitted token is then distributed exactly as p (Leviathan et al.,
  Chen et al. 2023).
p_j is the target distribution after the sampler's own processing (penalties counting the
drafts before position j, temperature, min-p, top-k, top-p). `draft_probs=None` means a
deterministic draft (n-gram lookup, greedy draft model): q_j is one-hot at x_j.

Rows may carry different numbers of drafts (`num_drafts`): the tensors are padded to the
largest k; a row with k_b drafts reads positions 0..k_b only, and what lies beyond is ignored.

Randomness follows the sampler: a seeded row draws its k_b uniforms and then its (k_b+1) x V
exponential noise from its own generator (seed, step), so it is batch-invariant (its draws do
not depend on the other rows' k). No host synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moestream.sampling.penalties import apply_penalties, draft_token_counts
from moestream.sampling.sampler import (
    SamplingBatch,
    check_logits,
    exponential_race,
    fill_per_row,
    process_logits,
    row_generators,
)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    batch: SamplingBatch,
    generator: torch.Generator | None = None,
    num_drafts: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify drafts; returns (output_token_ids [B, k+1] int64, -1 padded; num_accepted [B]).

    draft_token_ids [B, k] int64; draft_probs [B, k, V] float32 (rows sum to 1) or None;
    target_logits [B, k+1, V]. `num_drafts[b]` (host ints in 0..k, default k for every row) is
    how many of row b's drafts are real; its positions beyond are padding (any valid token id
    and finite logits). Row b emits output[b, :num_accepted[b] + 1]: its accepted drafts
    followed by one target token. `generator` serves unseeded rows (None: torch's default).
    """
    b, k = draft_token_ids.shape
    vocab = target_logits.shape[-1]
    if tuple(target_logits.shape) != (b, k + 1, vocab):
        raise ValueError(f"target_logits {tuple(target_logits.shape)} != {(b, k + 1, vocab)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (b, k, vocab):
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)} != {(b, k, vocab)}")
    if num_drafts is not None:
        num_drafts = [int(n) for n in num_drafts]
        if len(num_drafts) != b or not all(0 <= n <= k for n in num_drafts):
            raise ValueError(f"num_drafts {num_drafts} must be {b} values in 0..{k}")
    ragged = num_drafts is not None and any(n != k for n in num_drafts)
    device = target_logits.device
    positions = torch.arange(k + 1, device=device).unsqueeze(0)  # [1, k+1]
    if ragged:
        nd = torch.tensor(num_drafts, dtype=torch.int64).to(device)  # [B]
        real = positions[:, :k] < nd.unsqueeze(1)  # [B, k]: draft j is real
    rows = batch.repeat_rows(k + 1)  # verify position j of row i is row i*(k+1)+j
    logits = check_logits(target_logits.reshape(b * (k + 1), vocab), rows)  # [B*(k+1), V]
    if batch.any_penalties:
        drafted = draft_token_counts(draft_token_ids, vocab).reshape(b * (k + 1), vocab)
        logits = apply_penalties(logits, rows, drafted)
    output = greedy_output = greedy_accepted = None

    if batch.any_greedy:
        target_argmax = logits.argmax(dim=-1).view(b, k + 1)  # [B, k+1]
        matches = draft_token_ids == target_argmax[:, :k]  # [B, k]
        if ragged:
            matches &= real
        greedy_accepted = matches.long().cumprod(dim=1).sum(dim=1)  # [B]
        greedy_output = target_argmax.masked_fill(positions > greedy_accepted.unsqueeze(1), -1)
        if batch.all_greedy:
            return greedy_output, greedy_accepted

    probs = process_logits(logits, rows).softmax(dim=-1).view(b, k + 1, vocab)  # p
    target_probs = probs[:, :k]  # [B, k, V]
    drafts = draft_token_ids.unsqueeze(2)  # [B, k, 1]
    p_draft = target_probs.gather(2, drafts).squeeze(2)  # [B, k]: p_j(x_j)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        residual = target_probs.scatter(2, drafts, 0.0)  # max(0, p - onehot(x))
    else:
        q_draft = draft_probs.to(torch.float32).gather(2, drafts).squeeze(2)  # q_j(x_j)
        residual = (target_probs - draft_probs).clamp_min(0.0)
    # An all-zero residual means p <= q everywhere, i.e. p == q: rejection cannot happen there
    # except by rounding; fall back to p rather than emit token 0.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, target_probs)

    gens = row_generators(batch, device)
    if ragged:
        uniform, noise = _ragged_draws(b, k, vocab, num_drafts, gens, generator, device)
    else:
        uniform = fill_per_row(torch.empty(b, k, device=device), gens, generator, "uniform_")
        noise = torch.empty(b, k + 1, vocab, device=device)
        fill_per_row(noise, gens, generator, "exponential_")

    accept = (q_draft > 0) & (p_draft >= uniform * q_draft)  # u <= p/q, u in [0, 1)
    if ragged:
        accept &= real
    accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]
    recovered = exponential_race(residual, noise[:, :k])  # [B, k]
    if ragged:
        # Row b's bonus position is k_b: a draw from p there, a recovery draw before it.
        bonus = exponential_race(probs, noise)  # [B, k+1]
        recovered = torch.cat([recovered, bonus[:, k:]], dim=1)  # [B, k+1]
        emitted = torch.where(positions == nd.unsqueeze(1), bonus, recovered)
    else:
        bonus = exponential_race(probs[:, k], noise[:, k])  # [B]
        emitted = torch.cat([recovered, bonus.unsqueeze(1)], dim=1)  # [B, k+1]
    padded_drafts = torch.cat([draft_token_ids, emitted[:, k:]], dim=1)  # [B, k+1]
    n = accepted.unsqueeze(1)
    output = torch.where(positions < n, padded_drafts, emitted).masked_fill(positions > n, -1)

    if greedy_output is not None:
        is_greedy = batch.greedy.unsqueeze(1)
        output = torch.where(is_greedy, greedy_output, output)
        accepted = torch.where(batch.greedy, greedy_accepted, accepted)
    return output, accepted


def _ragged_draws(
    b: int,
    k: int,
    vocab: int,
    num_drafts: list[int],
    gens: list[torch.Generator | None],
    generator: torch.Generator | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(uniform [B, k], exponential noise [B, k+1, V]) where seeded row b draws exactly its
    k_b uniforms, then its (k_b+1) x V noise, from its own generator; the padding positions
    of seeded rows hold harmless constants (never read)."""
    uniform = torch.zeros(b, k, device=device)
    noise = torch.ones(b, k + 1, vocab, device=device)
    if any(g is None for g in gens):
        uniform.uniform_(generator=generator)
        noise.exponential_(generator=generator)
    for i, g in enumerate(gens):
        if g is not None:
            uniform[i, : num_drafts[i]].uniform_(generator=g)
            noise[i, : num_drafts[i] + 1].exponential_(generator=g)
    return uniform, noise

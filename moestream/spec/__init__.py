"""Speculative decoding: proposers (n-gram lookup, draft model; MTP heads and block drafters
later) behind one interface (`base.Proposer`), a picker that decides per request and step
whether and how far to speculate, and the statistics both rest on.

Integration (engine and runner), a few lines:

    spec = Speculator.from_config(spec_config, vocab_size=model.config.vocab_size,
                                  device=device, dtype=model.dtype, block_size=block_size,
                                  draft_num_blocks=...)           # None when --speculative off
    # Engine.step:
    plan = self.scheduler.schedule()                # feeds Request.draft_token_ids as drafts
    t0 = time.perf_counter()
    result = self.runner.execute(plan)              # verifies drafts: rejection_sample(...)
    if spec: spec.observe(plan, result.sampled, time.perf_counter() - t0)
    outputs = self._commit(plan, result.sampled, result.logprobs)
    if spec: spec.draft(self.scheduler.running)     # sets draft_token_ids for the next step

The runner verifies `s.draft_token_ids` with `rejection_sample(drafts [B, k], draft_probs,
target_logits [B, k+1, V], batch)`, where draft_probs is None when every
`spec.draft_probs(id)` is None (all current proposers draft deterministically), and returns
`output[:num_accepted + 1]` per request as StepPlan requires.
"""

from moestream.spec.base import (
    PROPOSERS,
    SPECULATIVE_MODES,
    Proposal,
    ProposalInput,
    Proposer,
    SpecConfig,
    proposer_class,
)
from moestream.spec.ngram import NgramIndex, NgramProposer
from moestream.spec.picker import Candidate, Choice, Picker, Speculator
from moestream.spec.stats import AcceptanceEMA, ArmStats, SpecStats, StepCostModel

__all__ = [
    "PROPOSERS",
    "SPECULATIVE_MODES",
    "AcceptanceEMA",
    "ArmStats",
    "Candidate",
    "Choice",
    "NgramIndex",
    "NgramProposer",
    "Picker",
    "Proposal",
    "ProposalInput",
    "Proposer",
    "SpecConfig",
    "SpecStats",
    "Speculator",
    "StepCostModel",
    "proposer_class",
]

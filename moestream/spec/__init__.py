"""Speculative decoding: proposers (n-gram lookup, draft model; MTP heads and block drafters
later) behind one interface (`base.Proposer`), a picker that decides per request and step
whether and how far to speculate, and the statistics both rest on.

Integration (engine and runner), a few lines:

    spec = Speculator.from_config(spec_config, vocab_size=model.config.vocab_size,
                                  target_tokens=source.metadata.get("tokenizer.ggml.tokens"),
                                  device=device, dtype=model.dtype, block_size=block_size,
                                  draft_num_blocks=...)      # None when --speculative off
    # Engine.step:
    plan = self.scheduler.schedule()           # feeds Request.draft_token_ids as drafts
    t0 = time.perf_counter()
    result = self.runner.execute(plan)         # verifies drafts (below); ends in a host sync
    if spec: spec.observe(plan, result.sampled, time.perf_counter() - t0)
    outputs = self._commit(plan, result.sampled, result.logprobs)
    if spec: spec.draft(self.scheduler.running)  # sets draft_token_ids for the next step

`observe` learns the step's cost (by its token count) and every verified request's accepted
length, and drops the state of the plan's preempted and finished requests; `draft` asks the
picker, per decoding request, for plain decode or a proposer and k, and runs the proposers.
The runner verifies a request with k drafts from the logits of its last k + 1 fed rows:
`rejection_sample(drafts [B, k], draft_probs, target_logits [B, k + 1, V], batch)` with
draft_probs None (every current proposer drafts deterministically; `spec.draft_probs(id)`
says so per request), rows grouped by k (rejection_sample takes one k per call), and
`sampled[id] = output[b, :num_accepted[b] + 1]` as StepPlan requires.
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

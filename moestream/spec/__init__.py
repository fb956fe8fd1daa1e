"""Speculative decoding: proposers (n-gram lookup, draft model; MTP heads and block drafters
later) behind one interface (`base.Proposer`), a picker that decides per request and step
whether and how far to speculate, the statistics both rest on, and the verification of a
step's drafts on the target's logits (`verify`).

How the engine uses it (moestream/engine.py):

    engine = Engine(model, tokenizer, cache, sched, spec=SpecConfig(mode="auto", ...))
    # Engine.step:
    plan = scheduler.schedule()            # feeds Request.draft_token_ids as drafts
    if speculator.skips(plan):             # an idle round: O(1), nothing else to do
        commit(plan, runner.execute(plan)); speculator.skip(seconds); return
    speculator.end_idle()                  # the skipped rounds' steps, as one mean step
    result = runner.execute(plan)          # one forward pass: prefill chunks, plain decodes
                                           # and every request's drafts; ends in a host sync
    speculator.observe(plan, result.sampled)   # acceptance, releases
    outputs = commit(plan, result)         # scheduler.update takes [d_0..d_{a-1}, t]
    speculator.record_step_time(plan.num_tokens, seconds, ahead)   # schedule..commit
    speculator.draft(running requests that decode next, base_tokens, queued)  # next drafts
    runner.run_ahead = speculator.run_ahead    # may the next plain step be queued ahead

The runner gives a request with k drafts k + 1 logits rows (its last fed token, then each
draft) and verifies all such requests together (`verify.verify_drafts`, which pads them to
the largest k and calls `sampling.rejection_sample` with each request's own k; when every row
needs only an argmax, the runner reads all rows' argmax back at once and accepts on the host,
the same choices); plain decodes of the same step are sampled as without speculation. Every
current proposer drafts deterministically (`Proposal.probs` None), which rejection sampling
verifies exactly at any temperature. K/V of rejected drafts are never read: they lie past the
request's `num_computed_tokens`, and the next step overwrites them.
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
from moestream.spec.picker import Candidate, Choice, Picker
from moestream.spec.speculator import Speculator
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

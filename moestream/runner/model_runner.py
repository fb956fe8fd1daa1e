"""StepPlan -> tensors -> logits -> sampled tokens.

The runner is the only place where a plan becomes tensors. It follows `StepPlan`'s contract
(moestream/types.py): every scheduled request's tokens are flattened into one batch, their K/V go
to the slots their block tables give, and the rows that end a request's known tokens are sampled.

Speculative decoding rides the same forward pass: a request with k drafts feeds its last token
and the drafts, and gets k + 1 logits rows instead of one; `sample_with_drafts` verifies them
(`spec.verify`) next to the plain decodes of the same step. K/V of rejected drafts stay in the
pool past the request's `num_computed_tokens`; nothing reads them (a query at position p reads
positions 0..p, all written by this or earlier steps) and the next step overwrites them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from moestream.cache.kv_cache import PagedKVCache
from moestream.layers.attention import AttentionMetadata
from moestream.models.base import CausalLM
from moestream.runner.cuda_graph import decode_graphs_for
from moestream.sampling.sampler import Sampler, SamplingBatch
from moestream.spec.verify import verify_drafts
from moestream.types import ScheduledRequest, StepPlan


@dataclass
class TokenLogprobs:
    """Log-probability of the chosen token and, when asked, the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class RunnerOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class LogitsProcessor(Protocol):
    """Changes sampling logits per request (constrained output, logit bias); see
    `server.constrained.LogitsProcessor` for the full contract. A processor should also answer
    `request_id in processor` (True when it changes that request's logits): the engine does
    not speculate for those requests (a grammar matcher cannot take drafts it may refuse), and
    without the answer it speculates for none while the processor holds any request."""

    def apply(
        self,
        logits: torch.Tensor,
        request_ids: Sequence[str],
        output_token_ids: Sequence[Sequence[int]],
    ) -> torch.Tensor: ...


@dataclass
class _Batch:
    """A plan flattened: the model inputs and which rows are sampled."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    # Rows of the flattened batch whose logits are needed: per entry of `sampled`, its last fed
    # token's row preceded by one row per draft (k + 1 rows in all; 1 without drafts).
    sample_rows: list[int]
    sampled: list[ScheduledRequest]

    @property
    def has_drafts(self) -> bool:
        return any(s.draft_token_ids for s in self.sampled)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv: PagedKVCache,
        block_size: int,
        device: torch.device,
        enforce_eager: bool = False,
    ):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.logits_processor: LogitsProcessor | None = None
        # Pure decode steps as CUDA graphs (runner/cuda_graph.py); None: always eager.
        self.graphs = None if enforce_eager else decode_graphs_for(model, kv, block_size)

    def prepare(self, plan: StepPlan) -> _Batch:
        """Flatten the plan's requests into one batch (StepPlan's runner contract)."""
        tokens: list[int] = []
        positions: list[int] = []
        seqs: list[tuple[int, int, list[int]]] = []
        sample_rows: list[int] = []
        sampled: list[ScheduledRequest] = []
        for s in plan.scheduled:
            if s.draft_token_ids and not s.sample:
                raise ValueError(f"request {s.request_id!r} carries drafts in a prefill chunk")
            fed = s.token_ids + s.draft_token_ids
            tokens.extend(fed)
            positions.extend(range(s.start_pos, s.start_pos + len(fed)))
            seqs.append((s.start_pos, len(fed), s.block_ids))
            if s.sample:
                sample_rows.extend(range(len(tokens) - 1 - len(s.draft_token_ids), len(tokens)))
                sampled.append(s)
        return _Batch(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            attn=AttentionMetadata.build(seqs, self.block_size, self.device),
            sample_rows=sample_rows,
            sampled=sampled,
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> RunnerOutput:
        """Run one step: forward over every fed token, then one sampled token per request whose
        fed tokens reach its end (after its accepted drafts, for a request with drafts)."""
        if plan.is_empty:
            return RunnerOutput()
        batch = self.prepare(plan)
        if self.graphs is not None and self.graphs.can_run(batch.attn, len(batch.sampled)):
            a = batch.attn
            logits = self.graphs.run(
                batch.input_ids, batch.positions, a.block_tables, a.seq_lens, a.slot_mapping
            )  # [B, V] float32
            return self.sample(logits, batch.sampled)
        hidden = self.model.forward(batch.input_ids, batch.positions, batch.attn, self.kv)  # [T, H]
        if not batch.sampled:
            return RunnerOutput()
        rows = torch.tensor(batch.sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # [R, V] float32
        if batch.has_drafts:
            return self.sample_with_drafts(logits, batch.sampled)
        return self.sample(logits, batch.sampled)

    def sample(self, logits: torch.Tensor, reqs: list[ScheduledRequest]) -> RunnerOutput:
        """One token per row of `logits` [B, V] for `reqs` (in order), with logprobs if asked."""
        if self.logits_processor is not None:
            logits = self.logits_processor.apply(
                logits, [s.request_id for s in reqs], [s.output_token_ids for s in reqs]
            )
        batch = SamplingBatch.from_params(
            [s.sampling_params for s in reqs],
            [s.output_token_ids for s in reqs],
            [s.prompt_token_ids for s in reqs],
            self.device,
            [len(s.output_token_ids) for s in reqs],
        )
        result = self.sampler.sample(logits, batch)
        token_ids = result.token_ids.tolist()  # the step's one host synchronisation
        out = RunnerOutput()
        want = [s.sampling_params.logprobs is not None for s in reqs]
        lp = result.logprobs.tolist() if any(want) else []
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        if any(want) and result.top_logprobs is not None:
            top_values, top_ids = (t.tolist() for t in result.top_logprobs)
        for i, s in enumerate(reqs):
            out.sampled[s.request_id] = [token_ids[i]]
            if want[i]:
                k = s.sampling_params.logprobs or 0
                alts = list(zip(top_ids[i][:k], top_values[i][:k])) if k and top_ids else []
                out.logprobs[s.request_id] = [TokenLogprobs(token_ids[i], lp[i], alts)]
        return out

    # ---- speculative decoding ------------------------------------------------------------
    def sample_with_drafts(
        self, logits: torch.Tensor, reqs: list[ScheduledRequest]
    ) -> RunnerOutput:
        """Tokens for `reqs` from `logits` [R, V] (k + 1 rows per request, in order): plain
        decodes are sampled as by `sample`, requests with drafts are verified together."""
        plain_rows: list[int] = []
        draft_rows: list[int] = []
        plain, verifying = [], []
        row = 0
        for s in reqs:
            k = len(s.draft_token_ids)
            (draft_rows if k else plain_rows).extend(range(row, row + k + 1))
            (verifying if k else plain).append(s)
            row += k + 1
        out = RunnerOutput()
        if plain:
            out = self.sample(logits[plain_rows], plain)
        verified = self.verify(logits[draft_rows], verifying)
        out.sampled.update(verified.sampled)
        out.logprobs.update(verified.logprobs)
        return out

    def verify(self, logits: torch.Tensor, reqs: list[ScheduledRequest]) -> RunnerOutput:
        """Accepted drafts plus one token per request of `reqs`, from `logits` [R, V] (its last
        fed token's row, then one per draft). A logits processor sees each row with the output
        extended by the drafts before that position."""
        if self.logits_processor is not None:
            ids, history = [], []
            for s in reqs:
                for j in range(len(s.draft_token_ids) + 1):
                    ids.append(s.request_id)
                    history.append(list(s.output_token_ids) + s.draft_token_ids[:j])
            logits = self.logits_processor.apply(logits, ids, history)
        batch = SamplingBatch.from_params(
            [s.sampling_params for s in reqs],
            [s.output_token_ids for s in reqs],
            [s.prompt_token_ids for s in reqs],
            self.device,
            [len(s.output_token_ids) for s in reqs],
        )
        result = verify_drafts(
            logits,
            [s.draft_token_ids for s in reqs],
            batch,
            generator=self.sampler.generator(self.device),
            logprobs_mode=self.sampler.logprobs_mode,
        )
        token_ids = result.token_ids.tolist()  # the verification's one host synchronisation
        accepted = result.num_accepted.tolist()
        width = len(token_ids[0])
        lp: list[float] = []
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        if result.logprobs is not None:
            lp = result.logprobs.logprobs.tolist()
            if result.logprobs.top_logprobs is not None:
                top_values, top_ids = (t.tolist() for t in result.logprobs.top_logprobs)
        out = RunnerOutput()
        for b, s in enumerate(reqs):
            emitted = token_ids[b][: accepted[b] + 1]
            out.sampled[s.request_id] = emitted
            n_top = s.sampling_params.logprobs
            if n_top is None:
                continue
            lps = []
            for j, t in enumerate(emitted):
                r = b * width + j
                alts = list(zip(top_ids[r][:n_top], top_values[r][:n_top])) if n_top else []
                lps.append(TokenLogprobs(t, lp[r], alts))
            out.logprobs[s.request_id] = lps
        return out

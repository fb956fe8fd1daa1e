"""StepPlan -> tensors -> logits -> sampled tokens.

The runner is the only place where a plan becomes tensors. It follows `StepPlan`'s contract
(moestream/types.py): every scheduled request's tokens are flattened into one batch, their K/V go
to the slots their block tables give, and the rows that end a request's known tokens are sampled.

Draft verification (speculative decoding) is not wired in yet: a plan with drafts is refused.
It will take the logits of the last fed token and of every draft (k + 1 rows per request
instead of one) and hand them to `sampling.rejection_sample`; `sample_rows` is the seam.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from moestream.cache.kv_cache import PagedKVCache
from moestream.layers.attention import AttentionMetadata
from moestream.models.base import CausalLM
from moestream.sampling.sampler import Sampler, SamplingBatch
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
    `server.constrained.LogitsProcessor` for the full contract."""

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
    sample_rows: list[int]  # row of the flattened batch to sample, per entry of `sampled`
    sampled: list[ScheduledRequest]


class ModelRunner:
    def __init__(self, model: CausalLM, kv: PagedKVCache, block_size: int, device: torch.device):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.logits_processor: LogitsProcessor | None = None

    def prepare(self, plan: StepPlan) -> _Batch:
        """Flatten the plan's requests into one batch (StepPlan's runner contract)."""
        tokens: list[int] = []
        positions: list[int] = []
        seqs: list[tuple[int, int, list[int]]] = []
        sample_rows: list[int] = []
        sampled: list[ScheduledRequest] = []
        for s in plan.scheduled:
            if s.draft_token_ids:
                raise NotImplementedError(
                    f"request {s.request_id!r} carries draft tokens: draft verification is not "
                    "wired into the runner yet"
                )
            tokens.extend(s.token_ids)
            positions.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
            seqs.append((s.start_pos, len(s.token_ids), s.block_ids))
            if s.sample:
                sample_rows.append(len(tokens) - 1)
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
        fed tokens reach its end."""
        if plan.is_empty:
            return RunnerOutput()
        batch = self.prepare(plan)
        hidden = self.model.forward(batch.input_ids, batch.positions, batch.attn, self.kv)  # [T, H]
        if not batch.sampled:
            return RunnerOutput()
        rows = torch.tensor(batch.sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # [B, V] float32
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

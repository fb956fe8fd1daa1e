"""StepPlan -> tensors -> logits -> sampled tokens.

The runner is the only place where a plan becomes tensors. It follows `StepPlan`'s contract
(moestream/types.py): every scheduled request's tokens are flattened into one batch, their K/V go
to the slots their block tables give, and the rows that end a request's known tokens are sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moestream.cache.kv_cache import PagedKVCache
from moestream.layers.attention import AttentionMetadata
from moestream.models.base import CausalLM
from moestream.sampling.sampler import Sampler, SamplingBatch
from moestream.types import StepPlan


@dataclass
class TokenLogprobs:
    """Log-probability of the chosen token and, when asked, the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RunnerOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: CausalLM, kv: PagedKVCache, block_size: int, device: torch.device):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> RunnerOutput:
        if plan.is_empty:
            return RunnerOutput()
        tokens: list[int] = []
        positions: list[int] = []
        seqs: list[tuple[int, int, list[int]]] = []
        sample_rows: list[int] = []  # index into the flattened batch of each sampled row
        sampled_reqs = []
        for s in plan.scheduled:
            fed = s.token_ids + s.draft_token_ids
            if s.draft_token_ids:
                raise NotImplementedError("draft verification is not wired into the runner yet")
            tokens.extend(fed)
            positions.extend(range(s.start_pos, s.start_pos + len(fed)))
            seqs.append((s.start_pos, len(fed), s.block_ids))
            if s.sample:
                sample_rows.append(len(tokens) - 1)
                sampled_reqs.append(s)
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)  # [T]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
        attn = AttentionMetadata.build(seqs, self.block_size, self.device)
        hidden = self.model.forward(input_ids, pos, attn, self.kv)  # [T, H]
        out = RunnerOutput()
        if not sampled_reqs:
            return out
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # [B, V] float32
        batch = SamplingBatch.from_params(
            [s.sampling_params for s in sampled_reqs],
            [s.output_token_ids for s in sampled_reqs],
            [s.prompt_token_ids for s in sampled_reqs],
            self.device,
            [len(s.output_token_ids) for s in sampled_reqs],
        )
        result = self.sampler.sample(logits, batch)
        token_ids = result.token_ids.tolist()  # the step's one host synchronisation
        want_lp = [s.sampling_params.logprobs is not None for s in sampled_reqs]
        lp = result.logprobs.tolist() if any(want_lp) else None
        top = None
        if any(want_lp) and result.top_logprobs is not None:
            top = (result.top_logprobs[0].tolist(), result.top_logprobs[1].tolist())
        for i, s in enumerate(sampled_reqs):
            out.sampled[s.request_id] = [token_ids[i]]
            if want_lp[i] and lp is not None:
                k = s.sampling_params.logprobs or 0
                alts = list(zip(top[1][i][:k], top[0][i][:k])) if top and k else []
                out.logprobs[s.request_id] = [TokenLogprobs(token_ids[i], lp[i], alts)]
        return out

"""The engine: add requests, then `step()` = plan, run, commit.

`Engine` is synchronous and single-threaded; the server drives it from one thread through
`AsyncEngine` (moestream/server). Text is produced here: each request has an incremental
detokenizer, and stop strings are matched on the text so that they are never split across the
chunks a client receives.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from moestream.config import CacheConfig, SchedConfig
from moestream.errors import CapacityError, RequestError
from moestream.models.base import CausalLM
from moestream.runner.model_runner import ModelRunner, TokenLogprobs
from moestream.sched.scheduler import Scheduler
from moestream.tokenizer import StreamDecoder, Tokenizer
from moestream.types import Request, RequestOutput, SamplingParams, StepPlan


@dataclass
class _TextState:
    decoder: StreamDecoder
    stop: list[str]
    text: str = ""  # decoded text, stop string and what follows it removed
    emitted: int = 0  # characters of `text` already handed out
    logprobs: list[TokenLogprobs] = field(default_factory=list)


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string: those
    characters may still become a stop string and must not be streamed yet."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold


@dataclass
class EngineOutput(RequestOutput):
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # of this step's new tokens


class Engine:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        cache: CacheConfig | None = None,
        sched: SchedConfig | None = None,
        device: torch.device | str = "cpu",
        kv_dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        cache = cache or CacheConfig()
        sched = sched or SchedConfig()
        self.cache_config, self.sched_config = cache, sched
        self.max_model_len = min(
            sched.max_model_len or model.config.context_length, model.config.context_length
        )
        kv_dtype = kv_dtype or (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        num_blocks = self._num_blocks(cache, kv_dtype)
        self.kv = model.make_kv_cache(num_blocks, cache.block_size, kv_dtype)
        self.scheduler = Scheduler(
            block_size=cache.block_size,
            num_blocks=num_blocks,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=cache.enable_prefix_caching,
        )
        self.runner = ModelRunner(model, self.kv, cache.block_size, self.device)
        self._text: dict[str, _TextState] = {}
        self._ids = itertools.count()

    def _num_blocks(self, cache: CacheConfig, kv_dtype: torch.dtype) -> int:
        c = self.model.config
        bytes_per_block = (
            2 * c.n_layers * cache.block_size * c.n_kv_heads * c.head_dim * kv_dtype.itemsize
        )
        if cache.kv_cache_gib is not None:
            budget = cache.kv_cache_gib * 2**30
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = 0.9 * free
        else:
            # CPU: enough for a few full-length sequences, at most 1 GiB.
            budget = min(2**30, 4 * self.max_model_len / cache.block_size * bytes_per_block)
        num_blocks = int(budget // bytes_per_block)
        need = -(-self.max_model_len // cache.block_size)
        if num_blocks < 1:
            raise CapacityError(
                f"KV cache budget of {budget / 2**30:.3f} GiB holds no block "
                f"({bytes_per_block} bytes per block of {cache.block_size} tokens)"
            )
        if cache.kv_cache_gib is None:
            num_blocks = max(num_blocks, need)
        return num_blocks

    # ---- requests ----------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        params = params or SamplingParams()
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        request_id = request_id or f"req-{next(self._ids)}"
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids += [t for t in sorted(self.tokenizer.eos_token_ids) if t not in stop_ids]
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            arrival_time=time.monotonic(),
        )
        self.scheduler.add_request(req, eos_token_ids=stop_ids)
        self._text[request_id] = _TextState(StreamDecoder(self.tokenizer), list(params.stop))
        return request_id

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._text.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        plan = self.scheduler.schedule()
        result = self.runner.execute(plan)
        return self._commit(plan, result.sampled, result.logprobs)

    def _commit(
        self,
        plan: StepPlan,
        sampled: dict[str, list[int]],
        logprobs: dict[str, list[TokenLogprobs]],
    ) -> list[EngineOutput]:
        finished = {r.request_id: r for r in self.scheduler.update(plan, sampled)}
        outputs = []
        for s in plan.scheduled:
            new = sampled.get(s.request_id)
            if not new:
                continue
            req = self.scheduler.get(s.request_id) or finished.get(s.request_id)
            state = self._text[s.request_id]
            for t in new:
                state.text += state.decoder.feed(t)
            if s.request_id in logprobs:
                state.logprobs = logprobs[s.request_id]
            stop_hit = self._match_stop(state)
            if stop_hit is not None and not req.is_finished:
                self.scheduler.finish(s.request_id, "stop", stop_reason=stop_hit)
            outputs.append(self._output(req, state, new))
        for rid in list(self._text):
            req = self.scheduler.get(rid)
            if req is None or req.is_finished:
                self._text.pop(rid, None)
        return outputs

    @staticmethod
    def _match_stop(state: _TextState) -> str | None:
        if not state.stop:
            return None
        window = max(len(s) for s in state.stop) + 16
        start = max(0, state.emitted - window)
        best = None
        for s in state.stop:
            i = state.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        state.text = state.text[: best[0]]
        return best[1]

    def _output(self, req: Request, state: _TextState, new: list[int]) -> EngineOutput:
        if req.is_finished:
            visible = len(state.text)
        else:
            visible = len(state.text) - _held_back(state.text, state.stop)
        delta = state.text[state.emitted : visible] if visible > state.emitted else ""
        state.emitted = max(state.emitted, visible)
        return EngineOutput(
            request_id=req.request_id,
            new_token_ids=list(new),
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            text=state.text[: state.emitted],
            delta_text=delta,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=req.num_output_tokens,
            logprobs=list(state.logprobs),
        )

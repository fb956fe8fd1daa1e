"""The engine: add requests, then `step()` = plan, run, commit.

`Engine` is synchronous and single-threaded; the server drives it from one thread through
`AsyncEngine` (moestream/server). Text is produced here (`engine_text.RequestText`): each
request has an incremental detokenizer, stop strings are matched on the text and are never
split across the chunks a client receives, and the text of the EOS or stop token that ended a
request is left out (as OpenAI servers do).

Speculative decoding (`spec`, see moestream/spec): after each step the speculator proposes
drafts for the requests that decode next (`Request.draft_token_ids`); the scheduler feeds them,
the runner verifies them in the same forward pass as every other request's tokens, and the
scheduler commits the accepted ones. Greedy output is token for token that of plain decode.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moestream.config import CacheConfig, SchedConfig
from moestream.engine_text import RequestText
from moestream.errors import CapacityError, RequestError
from moestream.models.base import CausalLM
from moestream.runner.model_runner import ModelRunner, RunnerOutput, TokenLogprobs
from moestream.sched.scheduler import Scheduler
from moestream.spec.base import SpecConfig
from moestream.spec.speculator import Speculator
from moestream.tokenizer import Tokenizer
from moestream.types import Request, RequestOutput, RequestStatus, SamplingParams, StepPlan


@dataclass
class EngineOutput(RequestOutput):
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # of this step's new tokens


def draft_blocks_that_fit(room: int, bytes_per_block: int, need: int, cap: int) -> int:
    """Blocks of a draft model's KV pool in `room` bytes: at most `cap` (the target pool's),
    at least `need` (one full-length sequence), else CapacityError."""
    blocks = max(0, room) // bytes_per_block
    if blocks < need:
        raise CapacityError(
            f"no room for the draft model's KV cache: {blocks} blocks of {bytes_per_block} "
            f"bytes fit, one full-length sequence needs {need} (lower --kv-cache-gib)"
        )
    return min(blocks, cap)


class Engine:
    """Continuous batching over one model and one paged KV pool.

    `add_request` queues a prompt (RequestError / CapacityError at once if it can never run);
    each `step` runs one forward pass over what the scheduler planned and returns an
    `EngineOutput` for every request that got new tokens; `abort` ends a request at any time.
    Every KV block a request holds returns to the pool when it finishes or is aborted.

    `spec` turns on speculative decoding (None or mode "off": plain decode). A draft model is
    loaded before the KV pool is sized, and its own KV pool gets as many blocks as the
    target's, out of the same budget. `vocab_tokens` (the target GGUF's
    `tokenizer.ggml.tokens`) lets the draft's vocabulary be checked token by token.
    """

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        cache: CacheConfig | None = None,
        sched: SchedConfig | None = None,
        device: torch.device | str = "cpu",
        kv_dtype: torch.dtype | None = None,
        spec: SpecConfig | None = None,
        vocab_tokens: Sequence[str] | None = None,
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
        self._vocab_tokens = vocab_tokens
        # Draft weights first: on a GPU the pool is sized from the memory left after them.
        speculator = self.build_speculator(spec, draft_num_blocks=1) if spec else None
        draft = speculator.draft_model if speculator else None
        draft_bytes = draft.kv_bytes_per_block if draft else 0
        num_blocks = self._num_blocks(cache, kv_dtype, draft_bytes)
        if draft is not None:
            draft.resize_kv(num_blocks)
            self._warm_up(speculator)
        self.kv = model.make_kv_cache(num_blocks, cache.block_size, kv_dtype)
        self.scheduler = Scheduler(
            block_size=cache.block_size,
            num_blocks=num_blocks,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=cache.enable_prefix_caching,
        )
        self.runner = ModelRunner(
            model,
            self.kv,
            cache.block_size,
            self.device,
            prefill_graph_tokens=sched.max_num_batched_tokens,
        )
        self.runner.run_ahead = speculator is None  # a speculator turns it on when idle
        self._speculator = speculator
        self._captured = 0  # the runner's graph captures as of the last speculating step
        self._text: dict[str, RequestText] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self._periodic: list[tuple[int, Callable[[], object]]] = []  # (steps, fn) of `every`

    def _num_blocks(self, cache: CacheConfig, kv_dtype: torch.dtype, draft_bytes: int = 0) -> int:
        """Blocks of the pool: `draft_bytes` per block go to the draft model's own pool."""
        c = self.model.config
        bytes_per_block = draft_bytes + (
            2 * c.n_layers * cache.block_size * c.n_kv_heads * c.head_dim * kv_dtype.itemsize
        )
        if cache.kv_cache_gib is not None:
            budget = cache.kv_cache_gib * 2**30
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            reserve = self._activation_reserve()
            budget = max(0.0, min(0.9 * free, free - reserve))
            if budget < bytes_per_block:
                raise CapacityError(
                    f"{free / 2**30:.2f} GiB of free GPU memory, less {reserve / 2**30:.2f} GiB "
                    "kept for a step's activations, holds no KV block: free memory, or give "
                    "--kv-cache-gib (and a smaller --max-num-batched-tokens)"
                )
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

    def _activation_reserve(self) -> int:
        """Device bytes a step needs besides weights and the KV pool, an upper estimate: the
        MoE's bf16 expert copies (`kernels.dequant_mm`, every expert of a layer), the dense
        path's bf16 weight chunk, per-token activations at the step's token budget (the MoE's
        per-pair rows in float32 dominate), twice where prefill chunks run as CUDA graphs (their
        private pool keeps the temporaries of the largest), sampled logits, and 512 MiB for the
        decode graphs and the allocator's rounding. Kept out of the default KV budget so that a
        long prefill cannot run out of memory on a small GPU."""
        from moestream.kernels.ops import DEQUANT_SCRATCH_BYTES

        c = self.model.config
        tokens = self.sched_config.max_num_batched_tokens
        h, k = c.hidden_size, max(c.n_experts_used, 1)
        experts = c.n_experts * 3 * c.expert_ffn_size * h * 2  # bf16
        per_token = 64 * h + k * (8 * h + 6 * max(c.expert_ffn_size, c.ffn_size))
        logits = 2 * self.sched_config.max_num_seqs * c.vocab_size * 4
        step = experts + tokens * per_token
        if self.model.supports_cuda_graphs:  # the prefill graphs' pool holds a step's as well
            step *= 2
        return step + DEQUANT_SCRATCH_BYTES + logits + (512 << 20)

    # ---- requests ----------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises RequestError for an empty prompt, a token id
        outside the vocabulary or a prompt + max_tokens over the context length, CapacityError
        when it could never fit in the whole KV pool."""
        params = params or SamplingParams()
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"
            )
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
        self._text[request_id] = RequestText(self.tokenizer, params.stop)
        return request_id

    def abort(self, request_id: str) -> None:
        """End a request now (waiting, running or unknown), freeing its KV blocks."""
        self.scheduler.abort(request_id)
        self._text.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- speculative decoding ------------------------------------------------------------
    @property
    def speculator(self) -> Speculator | None:
        return self._speculator

    @speculator.setter
    def speculator(self, speculator: Speculator | None) -> None:
        """Swap speculation (benchmarks compare plain and speculative decode on one engine);
        only between requests."""
        if self.has_unfinished():
            raise RuntimeError("the speculator can only change while no request is unfinished")
        if self._speculator is not None and self._speculator is not speculator:
            self._speculator.release_all()  # its requests' end would reach the next one only
        self._speculator = speculator
        self._captured = self.runner.num_captured_graphs
        self.runner.run_ahead = speculator is None  # a speculator turns it on when idle

    def build_speculator(
        self, spec: SpecConfig | None, draft_num_blocks: int | None = None
    ) -> Speculator | None:
        """A speculator for this engine's model (None when `spec` is off). Its draft KV pool
        has `draft_num_blocks` blocks (default: as many as the target's pool, allocated on top
        of it; on a GPU at most what the free memory holds, less the activation reserve, and
        at least one full-length sequence, else CapacityError)."""
        if spec is None or not spec.enabled:
            return None
        fit = draft_num_blocks is None and self.device.type == "cuda"
        if draft_num_blocks is None:
            draft_num_blocks = 1 if fit else self.scheduler.allocator.num_blocks
        speculator = Speculator.from_config(
            spec,
            vocab_size=self.model.config.vocab_size,
            target_tokens=self._vocab_tokens,
            device=self.device,
            dtype=self.model.dtype,
            block_size=self.cache_config.block_size,
            draft_num_blocks=draft_num_blocks,
        )
        draft = speculator.draft_model if speculator else None
        if fit and draft is not None:  # the target's pool is already allocated: what is left
            free, _ = torch.cuda.mem_get_info(self.device)
            blocks = draft_blocks_that_fit(
                free - self._activation_reserve(),
                draft.kv_bytes_per_block,
                -(-self.max_model_len // self.cache_config.block_size),
                self.scheduler.allocator.num_blocks,
            )
            draft.resize_kv(blocks)
            self._warm_up(speculator)
        return speculator

    def _warm_up(self, speculator: Speculator) -> None:
        """On a GPU, run the draft model once before any request (`DraftModelProposer.warm_up`:
        its kernels compile then, not in a request's first round, where the picker would
        measure the compilation as the draft's cost)."""
        draft = speculator.draft_model
        if draft is not None and self.device.type == "cuda":
            draft.warm_up(speculator.config.max_k)

    def spec_stats(self) -> dict[str, Any] | None:
        """Speculation counters (tau, acceptance by position, per proposer); None when off."""
        return self._speculator.stats.as_dict() if self._speculator else None

    def _may_speculate(self, request_id: str) -> bool:
        """False for a request whose logits a logits processor changes (a grammar matcher
        cannot take drafts it may refuse). A processor that cannot say (`in`) rules out all
        while it holds any request."""
        processor = self.runner.logits_processor
        if processor is None:
            return True
        try:
            return request_id not in processor  # type: ignore[operator]
        except TypeError:
            try:
                return len(processor) == 0  # type: ignore[arg-type]
            except TypeError:
                return False

    def _base_tokens(self) -> int:
        """Tokens the next step feeds without drafts, as far as the queue tells: what running
        requests have left to feed, then the prompts that may be admitted, within the budget."""
        sched = self.scheduler
        n = sum(r.num_tokens - r.num_computed_tokens for r in sched.running)
        seats = self.sched_config.max_num_seqs - len(sched.running)
        for req in itertools.islice(sched.waiting, max(0, seats)):
            n += req.num_tokens - req.num_computed_tokens
        return max(1, min(n, self.sched_config.max_num_batched_tokens))

    def _propose_drafts(self, speculator: Speculator) -> None:
        requests = self.scheduler.running
        if self.runner.logits_processor is not None:
            requests = [r for r in requests if self._may_speculate(r.request_id)]
        speculator.draft(requests, self._base_tokens, queued=self.runner.has_queued_step)

    # ---- the step ----------------------------------------------------------------------
    def every(self, steps: int, fn: Callable[[], object]) -> None:
        """Call `fn` after every `steps`-th step, between steps (upkeep such as
        `ZeroCopyExperts.rebalance`)."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self._periodic.append((steps, fn))

    def step(self) -> list[EngineOutput]:
        """Plan, run, commit (then propose the next step's drafts): one forward pass. Outputs
        for requests that got tokens."""
        outputs = self._step()
        self.num_steps += 1
        for steps, fn in self._periodic:
            if self.num_steps % steps == 0:
                fn()
        return outputs

    def _step(self) -> list[EngineOutput]:
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty and not plan.preempted_ids and self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler planned an empty step with requests unfinished")
        spec = self._speculator
        if spec is not None and not spec.skips(plan):
            return self._speculative_step(spec, plan, start)
        outputs = self._commit(plan, self.runner.execute(plan))
        if spec is not None:  # a skipped round: nothing drafted, nothing to propose
            spec.skip(time.perf_counter() - start)
        return outputs

    def _speculative_step(
        self, spec: Speculator, plan: StepPlan, start: float
    ) -> list[EngineOutput]:
        """`step` with the speculator's round: observe the drafts' verification, time the
        step, propose the next step's drafts."""
        runner = self.runner
        captured, hits = runner.num_captured_graphs, runner.run_ahead_hits
        # Steps of skipped rounds since the last round, as one plain step (unless a CUDA graph
        # was captured among them: see below).
        spec.end_idle(timed=captured == self._captured)
        result = runner.execute(plan)
        spec.observe(plan, result.sampled)  # acceptance and releases
        outputs = self._commit(plan, result)
        # The picker is fed what a step costs end to end, the same way for plain and
        # speculative steps: schedule, forward (a step that sampled ended in a host sync),
        # commit, plus the host work of the round that drafted for it (the speculator adds
        # it; a draft model's forwards are priced on their own). Where a step takes a fraction
        # of a millisecond (small models on a GPU) the host work decides whether drafts pay.
        # A step that captured a CUDA graph (and compiled its kernels) took 10-100x its cost:
        # measured, it would price that size out of the picker's reach for good.
        self._captured = runner.num_captured_graphs
        if result.sampled and plan.num_tokens > 0 and self._captured == captured:
            seconds = time.perf_counter() - start
            spec.record_step_time(plan.num_tokens, seconds, ahead=runner.run_ahead_hits != hits)
        self._propose_drafts(spec)
        # Run-ahead: the runner queues the next plain step before this one's tokens are read.
        # The speculator allows it while it is not drafting (and drafts nothing for a step
        # that was queued: the device would run it all the same).
        runner.run_ahead = spec.run_ahead
        return outputs

    def _commit(self, plan: StepPlan, result: RunnerOutput) -> list[EngineOutput]:
        """Hand the sampled tokens to the scheduler, then turn what it kept into text.

        New tokens are read from each request's `output_token_ids` after `update`, not from the
        raw samples: the scheduler may cut them at a stop token or max_tokens (drafts)."""
        texts = self._text
        for rid in plan.finished_ids:
            texts.pop(rid, None)
        get = self.scheduler.get
        sampled: list[tuple[Request, int]] = []
        for s in plan.scheduled:
            if s.sample and (req := get(s.request_id)) is not None:
                sampled.append((req, len(req.output_token_ids)))
        self.scheduler.update(plan, result.sampled)
        outputs = []
        for req, num_before in sampled:
            new = req.output_token_ids[num_before:]
            state = texts.get(req.request_id)
            if not new or state is None:
                continue
            # The EOS / stop token that ended the request is kept in the ids, not in the text.
            stopped_by_token = req.status is RequestStatus.FINISHED_STOPPED
            kept, stop = state.add_tokens(new, drop_last=stopped_by_token)
            if stop is not None:
                del req.output_token_ids[num_before + kept :]
                new = new[:kept]
                self._finish_for_stop_string(req, stop)
            finished = req.status is not RequestStatus.RUNNING  # after update: or finished
            if finished:
                state.finish()
                del texts[req.request_id]
            lps = result.logprobs.get(req.request_id, [])[: len(new)] if result.logprobs else []
            outputs.append(self._output(req, state, new, lps, finished))
        return outputs

    def _finish_for_stop_string(self, req: Request, stop: str) -> None:
        if not req.is_finished:
            self.scheduler.finish(req.request_id, "stop", stop_reason=stop)
        else:
            # Finished by length or a token in this very step, after the stop string: the
            # scheduler has let go of the request; report the stop string as the reason.
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = stop

    @staticmethod
    def _output(
        req: Request, state: RequestText, new: list[int], lps: list[TokenLogprobs], finished: bool
    ) -> EngineOutput:
        """The step's output of `req`; `new` and `lps` are lists of its own (not copied)."""
        delta = state.take_delta()
        return EngineOutput(
            request_id=req.request_id,
            new_token_ids=new,
            finished=finished,
            finish_reason=req.status.value if finished else None,
            stop_reason=req.stop_reason,
            text=state.emitted_text,
            delta_text=delta,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=len(req.output_token_ids),
            logprobs=lps,
        )

"""`LLM`: the offline Python API, as users of vLLM know it.

    from moestream import LLM, SamplingParams
    llm = LLM("model.gguf")
    outs = llm.generate(["def f(x):", "import os"], SamplingParams(temperature=0, max_tokens=64))
    print(outs[0].text)

All prompts of one `generate` call run through the engine together (continuous batching).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moestream.config import CacheConfig, SchedConfig
from moestream.engine import Engine, EngineOutput
from moestream.errors import RequestError
from moestream.experts import (
    ExpertBudgets,
    attach_expert_store,
    build_expert_store,
    defer_expert_tensors,
    paging_allowed,
)
from moestream.experts.paged import PagedExperts, attach_paged
from moestream.experts.zero_copy import ZeroCopyExperts, attach_zero_copy, rebalance_all
from moestream.layers.attention import AttentionMetadata
from moestream.models.registry import build_model
from moestream.runner.model_runner import TokenLogprobs
from moestream.spec.base import SpecConfig
from moestream.types import SamplingParams
from moestream.weights.loader import open_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Dequantized weight copies kept on the CPU by default (`LLM(weight_cache_gib=None)`): every CPU
# matmul otherwise dequantizes its weight, ~70% of a demo-model decode step.
CPU_WEIGHT_CACHE_GIB = 4.0


def default_model_path() -> Path:
    from moestream.cli import DEMO_MODEL

    return DEMO_MODEL


def default_draft_model(model: str | Path | None) -> Path | None:
    """The embedded draft model when `model` is the embedded demo target (None means the
    demo), else None: a draft must share the target's tokenizer, so only the demo pair has one
    by default."""
    from moestream.cli import DEMO_DRAFT, DEMO_MODEL

    if model is None or Path(model).resolve() == DEMO_MODEL.resolve():
        return DEMO_DRAFT
    return None


def spec_config(
    model: str | Path | None,
    speculative: str | SpecConfig = "off",
    draft_model: str | Path | None = None,
    num_speculative_tokens: int | None = None,
) -> SpecConfig:
    """The SpecConfig of LLM's speculation arguments: a SpecConfig is taken as is; a mode
    name (off, ngram, draft, auto) gets `draft_model`, or the embedded draft for the demo
    target, and `num_speculative_tokens` (default 4). RequestError when draft mode has no
    draft model."""
    if isinstance(speculative, SpecConfig):
        return speculative
    uses_draft = speculative in ("draft", "auto")
    if draft_model is None and uses_draft:
        draft_model = default_draft_model(model)
    return SpecConfig(
        mode=speculative,
        draft_model=str(draft_model) if draft_model is not None and uses_draft else None,
        max_k=4 if num_speculative_tokens is None else num_speculative_tokens,
    )


@dataclass
class CompletionOutput:
    """One finished generation."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)


def default_cpu_threads(source) -> int:
    """One CPU thread per 256 MiB of weights, at most one per core. Small models run fastest on
    one thread: their matrices are too small to split, and every parallel region waits for its
    slowest thread (on a busy 2-core machine the demo model ran at 26 tok/s on one thread and
    at 1 tok/s on two)."""
    nbytes = sum(source.tensors[name].nbytes for name in source.tensors)
    return max(1, min(os.cpu_count() or 1, nbytes // (256 * 2**20)))


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RequestError("--device cuda was asked for but no CUDA device is available")
    return dev


class LLM:
    """A model, its tokenizer and an `Engine` over them (see the module docstring).

    `num_threads` sets torch's intra-op CPU threads for the whole process
    (`torch.set_num_threads`); None picks `default_cpu_threads` on the CPU.
    `enforce_eager` runs every step eagerly; by default a CUDA model whose forward can be
    captured runs pure decode steps and verification steps (drafted tokens) as CUDA graphs (one
    per batch-size bucket and tokens per request, captured on first use). `deterministic` makes
    the GPU kernels batch-invariant (`kernels.ops`: a request's greedy text cannot depend on
    what runs beside it), at a cost in prefill speed. `expert_zero_copy` (with
    `gpu_expert_cache_gib`) places experts once instead of streaming them: those that fit the
    device budget on the device, the rest in pinned host memory the GPU reads in place
    (`experts.zero_copy`), and every `expert_rebalance_steps` engine steps promotes the experts
    the routing uses most to the device (`ZeroCopyExperts.rebalance`; 0: placement fixed at
    load); `expert_cpu_fraction` of each layer's host-placed experts are then computed by the
    host's cores (`expert_cpu_threads`; `experts.host_compute`) instead of read across the
    host link, and `expert_prefill_stage` keeps one layer's host tier of device memory (out of
    `gpu_expert_cache_gib`) into which forwards of 64 tokens or more copy each layer's host
    experts before reading them (`experts.zero_copy.ExpertStage`). `expert_paging` (with
    `gpu_expert_cache_gib`) keeps every expert in pinned host memory and as many as the budget
    holds in device slots, into which the GPU itself pages each decode forward's routed experts
    (`experts.paged`: no host work, CUDA graphs stay on). None (the default) pages on CUDA
    wherever the budgets allow (the host budget holds every expert, the device budget a layer's
    experts and a slot a layer, kernel-path types) and streams otherwise; False always streams.
    Paged and streamed layers predict the next layer's experts (its router applied to their
    FFN input) and prefetch them while such predictions are mostly right
    (`PagedExperts.predict`, `StreamedMoE`); `expert_prediction=False` turns that off.
    `expert_direct_io` reads streamed experts from the file with O_DIRECT (past the page
    cache). `weight_cache_gib` keeps bf16 copies of that many GiB of quantized weights on a GPU
    (`CausalLM.cache_weight_values`) so that matmuls of many rows (prefill, batched decode from
    `ops.CACHED_MIN_M` rows) skip dequantizing them; batch-1 decode is unchanged, and results
    match the uncached paths to float rounding. On the CPU it keeps copies in the
    model's dtype for every matmul (None, the default: up to `CPU_WEIGHT_CACHE_GIB`; on a GPU
    None is 0); results keep their bits.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str | None = None,
        dtype: str | None = None,
        max_model_len: int | None = None,
        kv_cache_gib: float | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        num_threads: int | None = None,
        gpu_expert_cache_gib: float | None = None,
        host_expert_cache_gib: float = 0.0,
        expert_policy: str = "window",
        speculative: str | SpecConfig = "off",
        draft_model: str | Path | None = None,
        num_speculative_tokens: int | None = None,
        enforce_eager: bool = False,
        deterministic: bool = False,
        expert_zero_copy: bool = False,
        expert_rebalance_steps: int = 64,
        expert_cpu_fraction: float = 0.0,
        expert_cpu_threads: int | None = None,
        expert_prefill_stage: bool = False,
        expert_paging: bool | None = None,
        expert_prediction: bool = True,
        expert_direct_io: bool = False,
        weight_cache_gib: float | None = None,
    ):
        spec = spec_config(model, speculative, draft_model, num_speculative_tokens)
        self.device = resolve_device(device)
        if num_threads is not None and num_threads < 1:
            raise RequestError(f"num_threads must be >= 1, got {num_threads}")
        self.source = open_model(model if model is not None else default_model_path())
        if num_threads is None and self.device.type == "cpu":
            num_threads = default_cpu_threads(self.source)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if dtype is None:
            act = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        elif dtype in _DTYPES:
            act = _DTYPES[dtype]
        else:
            raise RequestError(f"unknown dtype {dtype!r} (use one of {', '.join(_DTYPES)})")
        self.config = self.source.config
        self.tokenizer = self.source.tokenizer()
        self.expert_store = None
        budgets = ExpertBudgets(gpu_expert_cache_gib, host_expert_cache_gib)
        self.zero_copy: list[ZeroCopyExperts] = []
        if expert_zero_copy and not budgets.streaming:
            raise RequestError("expert_zero_copy needs gpu_expert_cache_gib")
        if expert_rebalance_steps < 0:
            raise RequestError(f"expert_rebalance_steps must be >= 0, got {expert_rebalance_steps}")
        if expert_cpu_fraction and not expert_zero_copy:
            raise RequestError("expert_cpu_fraction needs expert_zero_copy")
        if not 0.0 <= expert_cpu_fraction <= 1.0:
            raise RequestError(f"expert_cpu_fraction must be in [0, 1], got {expert_cpu_fraction}")
        if expert_cpu_threads is not None and expert_cpu_threads < 1:
            raise RequestError(f"expert_cpu_threads must be >= 1, got {expert_cpu_threads}")
        self.paged: list[PagedExperts] = []
        others = expert_zero_copy or expert_direct_io
        if expert_paging and (others or not budgets.streaming):
            raise RequestError(
                "expert_paging needs gpu_expert_cache_gib, and neither expert_zero_copy nor "
                "expert_direct_io"
            )
        if expert_paging is None:  # auto: paged on CUDA wherever the budgets allow it
            auto = self.device.type == "cuda" and budgets.streaming and not others
            expert_paging = auto and paging_allowed(self.source, self.config, budgets)
        if expert_prefill_stage and not expert_zero_copy:
            raise RequestError("expert_prefill_stage needs expert_zero_copy")
        if expert_direct_io and (expert_zero_copy or not budgets.streaming):
            raise RequestError(
                "expert_direct_io needs streamed experts (gpu_expert_cache_gib, no zero-copy)"
            )
        if expert_zero_copy:
            # Device slots and pinned host memory, read in place (no streaming); hot experts
            # move to the device between steps (`rebalance_experts`).
            self.model = build_model(defer_expert_tensors(self.source), self.device, act)
            self.zero_copy = attach_zero_copy(
                self.model, float(gpu_expert_cache_gib), host_expert_cache_gib,
                expert_cpu_fraction, expert_cpu_threads, expert_prefill_stage,
            )  # fmt: skip
        elif expert_paging:
            # Every expert in pinned host memory, the routed ones paged into device slots by
            # the GPU before each decode forward of a layer.
            self.model = build_model(defer_expert_tensors(self.source), self.device, act)
            self.paged = attach_paged(
                self.model, float(gpu_expert_cache_gib), host_expert_cache_gib, expert_prediction
            )
        elif budgets.streaming:
            # Experts live in tiers (device slots, host RAM, the file); the rest is resident.
            self.expert_store = build_expert_store(
                self.source, self.config, budgets, self.device, policy=expert_policy,
                direct=expert_direct_io,
            )  # fmt: skip
            self.model = build_model(defer_expert_tensors(self.source), self.device, act)
            attach_expert_store(self.model, self.expert_store, predict=expert_prediction)
        else:
            self.model = build_model(self.source, device=self.device, dtype=act)
        if weight_cache_gib is None:
            weight_cache_gib = CPU_WEIGHT_CACHE_GIB if self.device.type == "cpu" else 0.0
        if weight_cache_gib < 0:
            raise RequestError(f"weight_cache_gib must be >= 0, got {weight_cache_gib}")
        # dequantized copies, taken before the KV pool is sized from what is left
        self.weight_cache_bytes = self.model.cache_weight_values(int(weight_cache_gib * 2**30))
        self.engine = Engine(
            self.model,
            self.tokenizer,
            CacheConfig(block_size, kv_cache_gib, enable_prefix_caching),
            SchedConfig(max_num_seqs, max_num_batched_tokens, max_model_len),
            device=self.device,
            spec=spec,
            vocab_tokens=self.source.metadata.get("tokenizer.ggml.tokens"),
        )
        if self.expert_store is not None:  # its counters by phase (prefill, decode)
            self.engine.runner.before_forward.append(self.expert_store.counters.enter_step)
        if self.paged:  # paged experts' counters by phase
            self.engine.runner.before_forward.append(self.paged[0].phase.enter_step)
        if self.zero_copy and expert_rebalance_steps:
            self.engine.every(expert_rebalance_steps, self.rebalance_experts)
        host_work = next((p.host_work for p in self.zero_copy if p.host_work), None)
        if host_work is not None:  # a step whose host rows went wrong fails
            self.engine.runner.checks.append(host_work.compute.check)
            # the host's experts keep the cores busy during a step: wait for its tokens asleep
            # (with 15 of 16 threads, 71.7 against 68.2 tok/s spinning: bench/RESULTS.md)
            self.engine.runner.reader.set_blocking(True)
        if enforce_eager:  # no CUDA graphs for decode or verify steps (runner/cuda_graph.py)
            self.engine.runner.graphs = None
        # Batch-invariant GPU kernels (kernels/ops.py); the CPU reference is invariant already.
        self.model.batch_invariant = deterministic

    def rebalance_experts(self) -> int:
        """Promote hot experts to the device in every zero-copy layer now; the swaps made."""
        return rebalance_all(self.zero_copy)

    # ---- generation --------------------------------------------------------------------
    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order.

        All prompts are queued at once and run through the engine together (continuous
        batching, chunked prefill, shared prefix cache), not one after another."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if isinstance(sampling_params, Sequence):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise RequestError("one SamplingParams per prompt, or one for all")
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        encoded = [self._encode(p) for p in prompts]
        ids: list[str] = []
        try:
            for e, sp in zip(encoded, params):
                ids.append(self.engine.add_request(e, sp))
            results = self._run_to_completion(ids)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return [
            CompletionOutput(
                request_id=rid,
                prompt=p if isinstance(p, str) else None,
                prompt_token_ids=e,
                text=results[rid][0].text,
                token_ids=results[rid][1],
                finish_reason=results[rid][0].finish_reason,
                num_cached_tokens=results[rid][0].num_cached_tokens,
                logprobs=results[rid][2],
            )
            for rid, p, e in zip(ids, prompts, encoded)
        ]

    def _run_to_completion(
        self, ids: list[str]
    ) -> dict[str, tuple[EngineOutput, list[int], list[TokenLogprobs]]]:
        """Step the engine until every request of `ids` has finished: (last output, all token
        ids, all logprobs) per request."""
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        logprobs: dict[str, list[TokenLogprobs]] = {rid: [] for rid in ids}
        last: dict[str, EngineOutput] = {}
        while len(last) < len(ids):
            for out in self.engine.step():
                if out.request_id not in tokens:
                    continue  # another caller's request sharing the engine
                tokens[out.request_id].extend(out.new_token_ids)
                logprobs[out.request_id].extend(out.logprobs)
                if out.finished:
                    last[out.request_id] = out
        return {rid: (last[rid], tokens[rid], logprobs[rid]) for rid in ids}

    def stream(
        self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None
    ) -> Iterator[EngineOutput]:
        """Generate for one prompt, yielding an `EngineOutput` per step that produced tokens:
        `new_token_ids`, `delta_text` (never a partial stop string), `text` so far, and
        `finished` on the last one. Closing the generator early aborts the request."""
        rid = self.engine.add_request(self._encode(prompt), sampling_params or SamplingParams())
        try:
            done = False
            while not done:
                for out in self.engine.step():
                    if out.request_id == rid:
                        done = out.finished
                        yield out
        finally:
            if not done:
                self.engine.abort(rid)

    # ---- raw logits --------------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int], block_size: int = 16) -> torch.Tensor:
        """Float32 logits [T, V] of every position of `token_ids` (one forward, own KV cache)."""
        ids = self._encode(token_ids)
        if not ids:
            raise RequestError("logits of an empty sequence")
        n_blocks = -(-len(ids) // block_size)
        kv = self.model.make_kv_cache(n_blocks, block_size)
        seqs = [(0, len(ids), list(range(n_blocks)))]
        attn = AttentionMetadata.build(seqs, block_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.arange(len(ids), device=self.device)
        hidden = self.model.forward(input_ids, positions, attn, kv)  # [T, H]
        return self.model.compute_logits(hidden).float().cpu()  # [T, V]

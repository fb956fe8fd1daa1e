"""`LLM`: the offline Python API, as users of vLLM know it.

    from moestream import LLM, SamplingParams
    llm = LLM("model.gguf")
    outs = llm.generate(["def f(x):", "import os"], SamplingParams(temperature=0, max_tokens=64))
    print(outs[0].text)

All prompts of one `generate` call run through the engine together (continuous batching).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moestream.config import CacheConfig, SchedConfig
from moestream.engine import Engine, EngineOutput
from moestream.errors import RequestError
from moestream.layers.attention import AttentionMetadata
from moestream.models.registry import build_model
from moestream.runner.model_runner import TokenLogprobs
from moestream.types import SamplingParams
from moestream.weights.loader import open_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_model_path() -> Path:
    from moestream.cli import DEMO_MODEL

    return DEMO_MODEL


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


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RequestError("--device cuda was asked for but no CUDA device is available")
    return dev


class LLM:
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
    ):
        self.device = resolve_device(device)
        if dtype is None:
            act = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        elif dtype in _DTYPES:
            act = _DTYPES[dtype]
        else:
            raise RequestError(f"unknown dtype {dtype!r} (use one of {', '.join(_DTYPES)})")
        self.source = open_model(model if model is not None else default_model_path())
        self.config = self.source.config
        self.tokenizer = self.source.tokenizer()
        self.model = build_model(self.source, device=self.device, dtype=act)
        self.engine = Engine(
            self.model,
            self.tokenizer,
            CacheConfig(block_size, kv_cache_gib, enable_prefix_caching),
            SchedConfig(max_num_seqs, max_num_batched_tokens, max_model_len),
            device=self.device,
        )

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
        """Generate for every prompt (text or token ids), batched; outputs in prompt order."""
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
        ids = []
        for p, sp in zip(prompts, params):
            ids.append(self.engine.add_request(self._encode(p), sp))
        results: dict[str, EngineOutput] = {}
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        logprobs: dict[str, list[TokenLogprobs]] = {rid: [] for rid in ids}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
                logprobs[out.request_id].extend(out.logprobs)
                if out.finished:
                    results[out.request_id] = out
        outputs = []
        for rid, p in zip(ids, prompts):
            out = results[rid]
            outputs.append(
                CompletionOutput(
                    request_id=rid,
                    prompt=p if isinstance(p, str) else None,
                    prompt_token_ids=self._encode(p),
                    text=out.text,
                    token_ids=tokens[rid],
                    finish_reason=out.finish_reason,
                    num_cached_tokens=out.num_cached_tokens,
                    logprobs=logprobs[rid],
                )
            )
        return outputs

    def stream(
        self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None
    ) -> Iterator[EngineOutput]:
        """Generate for one prompt, yielding each step's new tokens and text."""
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
        attn = AttentionMetadata.build([(0, len(ids), list(range(n_blocks)))], block_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.arange(len(ids), device=self.device)
        hidden = self.model.forward(input_ids, positions, attn, kv)  # [T, H]
        return self.model.compute_logits(hidden).float().cpu()  # [T, V]

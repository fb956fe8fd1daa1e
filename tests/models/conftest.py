"""Tiny random `transformers` models saved as HF folders, shared by the model tests.

Weights are re-drawn after construction (transformers initialises biases to 0 and norms to 1,
which would hide bias and norm bugs): matrices N(0, 1/fan_in), norm scales 1 + N(0, 0.2^2),
biases N(0, 0.2^2). Every draw is seeded.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)

# case name -> (transformers model type, extra config fields)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3moe": ("qwen3moe", dict(MOE, norm_topk_prob=True)),
    "qwen3moe-nonorm": ("qwen3moe", dict(MOE, norm_topk_prob=False)),
    "qwen3": ("qwen3", {}),
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "llama-linear": (
        "llama",
        dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
    ),
    "llama-llama3": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            )
        ),
    ),
    "qwen3-yarn": (
        "qwen3",
        dict(
            max_position_embeddings=256,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
}


def _classes(kind: str):
    import transformers as tf

    return {
        "qwen3moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
    }[kind]


def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def make_tiny_hf(case: str, tied: bool, path: Path, seed: int = 0) -> torch.nn.Module:
    """Build, randomise and save (float32) the tiny model of `case`; returns the HF model."""
    kind, extra = CASES[case]
    config_cls, model_cls = _classes(kind)
    fields = {**COMMON, **extra, "tie_word_embeddings": tied}
    config = config_cls(**fields)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize(model, seed)
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(path)
    return model


def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits [T, V] float32 for one sequence ids [T]."""
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def one_shot(model, ids: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """moestream logits [T, V] (on the CPU) for ids [T] as one sequence in a fresh cache
    (blocks 0..n-1), run on the model's device."""
    from moestream.layers.attention import AttentionMetadata

    t = ids.numel()
    n_blocks = -(-t // block_size)
    kv = model.make_kv_cache(n_blocks, block_size)
    attn = AttentionMetadata.build([(0, t, list(range(n_blocks)))], block_size, model.device)
    positions = torch.arange(t, device=model.device)
    hidden = model.forward(ids.to(model.device), positions, attn, kv)
    return model.compute_logits(hidden).cpu()


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|."""
    return ((a - ref).abs().max() / ref.abs().max()).item()


class Tiny:
    """What the model tests share: `hf(case, tied)` -> (transformers model, saved folder), built
    once per session; `moestream(case, tied)` -> our model built from that folder; and the
    helpers above."""

    hf_logits = staticmethod(hf_logits)
    one_shot = staticmethod(one_shot)
    rel_diff = staticmethod(rel_diff)

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._built: dict[tuple[str, bool], tuple[torch.nn.Module, Path]] = {}

    def hf(self, case: str, tied: bool = False) -> tuple[torch.nn.Module, Path]:
        key = (case, tied)
        if key not in self._built:
            path = self._tmp.mktemp(f"{case}-{'tied' if tied else 'untied'}")
            self._built[key] = (make_tiny_hf(case, tied, path), path)
        return self._built[key]

    def moestream(
        self,
        case: str,
        tied: bool = False,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        from moestream.models.registry import build_model
        from moestream.weights.loader import open_model

        return build_model(open_model(self.hf(case, tied)[1]), device=device, dtype=dtype)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    return Tiny(tmp_path_factory)

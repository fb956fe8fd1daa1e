"""Hyperparameters of known models: `ModelConfig` presets shared by synth, benchmarks and tests.

The real-model numbers come from the models' Hugging Face `config.json` files (Qwen/Qwen3-30B-A3B,
Qwen/Qwen3-235B-A22B, Qwen/Qwen3-8B, Qwen/Qwen3-0.6B); `ffn_size` of the MoE models is their
`intermediate_size`, which llama.cpp's convert writes as `feed_forward_length` although no layer
uses it. `tiny-qwen3-moe` mirrors `../shared/models/tiny-qwen3-moe/config.json`.
"""

from __future__ import annotations

from moestream.config import ModelConfig
from moestream.errors import RequestError

_QWEN3_VOCAB = 151936

QWEN3_30B_A3B = ModelConfig(
    arch="qwen3moe",
    name="Qwen3-30B-A3B",
    n_layers=48,
    hidden_size=2048,
    n_heads=32,
    n_kv_heads=4,
    head_dim=128,
    vocab_size=_QWEN3_VOCAB,
    ffn_size=6144,
    rms_eps=1e-6,
    rope_theta=1e6,
    context_length=40960,
    n_experts=128,
    n_experts_used=8,
    expert_ffn_size=768,
)

QWEN3_235B_A22B = ModelConfig(
    arch="qwen3moe",
    name="Qwen3-235B-A22B",
    n_layers=94,
    hidden_size=4096,
    n_heads=64,
    n_kv_heads=4,
    head_dim=128,
    vocab_size=_QWEN3_VOCAB,
    ffn_size=12288,
    rms_eps=1e-6,
    rope_theta=1e6,
    context_length=40960,
    n_experts=128,
    n_experts_used=8,
    expert_ffn_size=1536,
)

QWEN3_8B = ModelConfig(
    arch="qwen3",
    name="Qwen3-8B",
    n_layers=36,
    hidden_size=4096,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    vocab_size=_QWEN3_VOCAB,
    ffn_size=12288,
    rms_eps=1e-6,
    rope_theta=1e6,
    context_length=40960,
    tie_embeddings=False,
)

QWEN3_0_6B = ModelConfig(
    arch="qwen3",
    name="Qwen3-0.6B",
    n_layers=28,
    hidden_size=1024,
    n_heads=16,
    n_kv_heads=8,
    head_dim=128,
    vocab_size=_QWEN3_VOCAB,
    ffn_size=3072,
    rms_eps=1e-6,
    rope_theta=1e6,
    context_length=40960,
    tie_embeddings=True,
)

TINY_QWEN3_MOE = ModelConfig(
    arch="qwen3moe",
    name="tiny-qwen3-moe",
    n_layers=6,
    hidden_size=512,
    n_heads=8,
    n_kv_heads=2,
    head_dim=64,
    vocab_size=4096,
    ffn_size=1024,
    rms_eps=1e-6,
    rope_theta=1e6,
    context_length=4096,
    n_experts=8,
    n_experts_used=2,
    expert_ffn_size=256,
)

PRESETS: dict[str, ModelConfig] = {
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "qwen3-235b-a22b": QWEN3_235B_A22B,
    "qwen3-8b": QWEN3_8B,
    "qwen3-0.6b": QWEN3_0_6B,
    "tiny-qwen3-moe": TINY_QWEN3_MOE,
}
KNOWN_MODELS: tuple[str, ...] = tuple(PRESETS)


def model_preset(
    like: str, n_layers: int | None = None, n_experts: int | None = None
) -> ModelConfig:
    """The preset named `like`, optionally cut to `n_layers` blocks and `n_experts` experts
    (experts used per token is capped at the new expert count)."""
    config = PRESETS.get(like.lower())
    if config is None:
        raise RequestError(f"unknown model {like!r} (known: {', '.join(KNOWN_MODELS)})")
    if n_layers is not None:
        if n_layers <= 0:
            raise RequestError(f"n_layers must be positive, got {n_layers}")
        config = config.replace(n_layers=n_layers)
    if n_experts is not None:
        if not config.is_moe:
            raise RequestError(f"{like} is a dense model; n_experts does not apply")
        if n_experts <= 0:
            raise RequestError(f"n_experts must be positive, got {n_experts}")
        config = config.replace(
            n_experts=n_experts, n_experts_used=min(config.n_experts_used, n_experts)
        )
    return config

"""Frozen configuration dataclasses, one per concern.

`ModelConfig` describes a model's hyperparameters in one vocabulary for every source: GGUF
metadata (llama.cpp key names) and Hugging Face `config.json` both parse into it, and `convert`
writes it back out as GGUF metadata.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from moestream.errors import ModelFormatError

# Architectures as GGUF names them (general.architecture), with the HF model_type they come from.
HF_TO_GGUF_ARCH = {
    "qwen3_moe": "qwen3moe",
    "qwen3": "qwen3",
    "qwen2": "qwen2",
    "llama": "llama",
    "mistral": "llama",
}
SUPPORTED_ARCHS = ("qwen3moe", "qwen3", "qwen2", "llama")
GGUF_TO_HF_ARCH = {"qwen3moe": "qwen3_moe", "qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama"}
HF_ARCHITECTURES = {
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
}


def _yarn_attn_factor(rope: dict[str, Any]) -> float:
    """HF's yarn `attention_factor` is the whole cos/sin scale; llama.cpp's attn_factor multiplies
    its own 0.1 * ln(factor) + 1. Store llama.cpp's convention."""
    total = rope.get("attention_factor")
    factor = float(rope.get("factor", 1.0))
    if total is None or factor <= 1.0:
        return 1.0
    return float(total) / (0.1 * math.log(factor) + 1.0)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling as GGUF metadata carries it (`{arch}.rope.scaling.*`)."""

    type: str = "none"  # none | linear | yarn | llama3
    factor: float = 1.0
    original_context_length: int = 0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attn_factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def __post_init__(self) -> None:
        if self.type not in ("none", "linear", "yarn", "llama3"):
            raise ModelFormatError(f"unsupported RoPE scaling type {self.type!r}")
        if self.factor <= 0:
            raise ModelFormatError(f"RoPE scaling factor must be positive, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # GGUF architecture name: qwen3moe | qwen3 | qwen2 | llama
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    ffn_size: int = 0  # dense FFN width (0 when every layer is MoE)
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_dim: int = 0  # rotated dims per head; 0 means head_dim
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    context_length: int = 4096
    tie_embeddings: bool = False
    # MoE
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_size: int = 0
    norm_topk_prob: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ModelFormatError(
                f"unknown architecture {self.arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
            )
        for name in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ModelFormatError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ModelFormatError(
                f"head count {self.n_heads} is not a multiple of KV head count {self.n_kv_heads}"
            )
        if self.is_moe and not (0 < self.n_experts_used <= self.n_experts):
            raise ModelFormatError(
                f"experts used per token ({self.n_experts_used}) must be in 1..{self.n_experts}"
            )
        if self.is_moe and self.expert_ffn_size <= 0:
            raise ModelFormatError("MoE model without an expert FFN size")
        if not self.is_moe and self.ffn_size <= 0:
            raise ModelFormatError("dense model without a feed-forward size")

    # derived values
    @property
    def is_moe(self) -> bool:
        return self.arch == "qwen3moe"

    @property
    def has_qk_norm(self) -> bool:
        return self.arch in ("qwen3", "qwen3moe")

    @property
    def has_qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    @property
    def rope_neox(self) -> bool:
        """Qwen models rotate halves (NeoX); llama rotates adjacent pairs on GGUF-permuted Q/K."""
        return self.arch != "llama"

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim or self.head_dim

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- GGUF metadata ---------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], source: str = "GGUF file") -> ModelConfig:
        arch = meta.get("general.architecture")
        if arch is None:
            raise ModelFormatError(f"{source}: missing metadata field general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise ModelFormatError(
                f"{source}: unknown architecture {arch!r} in general.architecture "
                f"(supported: {', '.join(SUPPORTED_ARCHS)})"
            )

        def req(key: str) -> Any:
            full = f"{arch}.{key}"
            if full not in meta:
                raise ModelFormatError(f"{source}: missing metadata field {full}")
            return meta[full]

        def opt(key: str, default: Any) -> Any:
            return meta.get(f"{arch}.{key}", default)

        hidden = int(req("embedding_length"))
        n_heads = int(req("attention.head_count"))
        n_kv = opt("attention.head_count_kv", n_heads)
        head_dim = int(opt("attention.key_length", hidden // n_heads))
        vocab = opt("vocab_size", None)
        if vocab is None:
            tokens = meta.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise ModelFormatError(f"{source}: neither {arch}.vocab_size nor a vocabulary")
            vocab = len(tokens)
        scaling_type = str(opt("rope.scaling.type", "none"))
        scaling = RopeScaling(
            type=scaling_type,
            factor=float(opt("rope.scaling.factor", 1.0) or 1.0),
            original_context_length=int(opt("rope.scaling.original_context_length", 0)),
            beta_fast=float(opt("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(opt("rope.scaling.yarn_beta_slow", 1.0)),
            attn_factor=float(opt("rope.scaling.attn_factor", 1.0)),
        )
        return cls(
            arch=arch,
            name=str(meta.get("general.name", "")),
            n_layers=int(req("block_count")),
            hidden_size=hidden,
            n_heads=n_heads,
            n_kv_heads=int(n_kv),
            head_dim=head_dim,
            vocab_size=int(vocab),
            ffn_size=int(opt("feed_forward_length", 0)),
            rms_eps=float(req("attention.layer_norm_rms_epsilon")),
            rope_theta=float(opt("rope.freq_base", 10000.0)),
            rope_dim=int(opt("rope.dimension_count", 0)),
            rope_scaling=scaling,
            context_length=int(opt("context_length", 4096)),
            tie_embeddings=False,  # decided by the loader: no output.weight means tied
            n_experts=int(opt("expert_count", 0)),
            n_experts_used=int(opt("expert_used_count", 0)),
            expert_ffn_size=int(opt("expert_feed_forward_length", 0)),
            norm_topk_prob=bool(opt("expert_weights_norm", True)),
        )

    def to_gguf_metadata(self) -> dict[str, Any]:
        """Hyperparameters as llama.cpp names them (without the tokenizer and general.*)."""
        a = self.arch
        meta: dict[str, Any] = {
            f"{a}.block_count": self.n_layers,
            f"{a}.context_length": self.context_length,
            f"{a}.embedding_length": self.hidden_size,
            f"{a}.attention.head_count": self.n_heads,
            f"{a}.attention.head_count_kv": self.n_kv_heads,
            f"{a}.attention.key_length": self.head_dim,
            f"{a}.attention.value_length": self.head_dim,
            f"{a}.attention.layer_norm_rms_epsilon": self.rms_eps,
            f"{a}.rope.freq_base": self.rope_theta,
            f"{a}.rope.dimension_count": self.rotary_dim,
            f"{a}.vocab_size": self.vocab_size,
        }
        if self.ffn_size:
            meta[f"{a}.feed_forward_length"] = self.ffn_size
        if self.rope_scaling.type != "none":
            meta[f"{a}.rope.scaling.type"] = self.rope_scaling.type
            meta[f"{a}.rope.scaling.factor"] = self.rope_scaling.factor
            if self.rope_scaling.original_context_length:
                meta[f"{a}.rope.scaling.original_context_length"] = (
                    self.rope_scaling.original_context_length
                )
        if self.is_moe:
            meta[f"{a}.expert_count"] = self.n_experts
            meta[f"{a}.expert_used_count"] = self.n_experts_used
            meta[f"{a}.expert_feed_forward_length"] = self.expert_ffn_size
        return meta

    # ---- Hugging Face config.json ----------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        model_type = cfg.get("model_type")
        arch = HF_TO_GGUF_ARCH.get(model_type or "")
        if arch is None:
            raise ModelFormatError(
                f"{source}: unknown model_type {model_type!r} "
                f"(supported: {', '.join(sorted(HF_TO_GGUF_ARCH))})"
            )
        try:
            hidden = int(cfg["hidden_size"])
            n_heads = int(cfg["num_attention_heads"])
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
            rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
            if rope_type in (None, "default"):
                scaling = RopeScaling()
            else:
                scaling = RopeScaling(
                    type=rope_type,
                    factor=float(rope.get("factor", 1.0)),
                    original_context_length=int(
                        rope.get("original_max_position_embeddings", 0) or 0
                    ),
                    beta_fast=float(rope.get("beta_fast", 32.0)),
                    beta_slow=float(rope.get("beta_slow", 1.0)),
                    attn_factor=_yarn_attn_factor(rope),
                    low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                )
            is_moe = arch == "qwen3moe"
            return cls(
                arch=arch,
                name=str(cfg.get("_name_or_path", "")),
                n_layers=int(cfg["num_hidden_layers"]),
                hidden_size=hidden,
                n_heads=n_heads,
                n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
                head_dim=int(cfg.get("head_dim") or hidden // n_heads),
                vocab_size=int(cfg["vocab_size"]),
                ffn_size=int(cfg.get("intermediate_size", 0) or 0),
                rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                rope_scaling=scaling,
                context_length=int(cfg.get("max_position_embeddings", 4096)),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                n_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
                if is_moe
                else 0,
                n_experts_used=int(cfg.get("num_experts_per_tok", 0) or 0) if is_moe else 0,
                expert_ffn_size=int(cfg.get("moe_intermediate_size", 0) or 0) if is_moe else 0,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if is_moe else True,
            )
        except KeyError as e:
            raise ModelFormatError(f"{source}: missing field {e.args[0]}") from None


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: `num_blocks` blocks of `block_size` tokens, sized from a GiB budget."""

    block_size: int = 16
    kv_cache_gib: float | None = None  # None: 1 GiB on CPU; on a GPU 90% of free memory, less
    # what a step's activations may need (`Engine._activation_reserve`)
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            from moestream.errors import RequestError

            raise RequestError(f"--kv-cache-gib must be positive, got {self.kv_cache_gib}")


@dataclass(frozen=True)
class SchedConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunk size)
    max_model_len: int | None = None  # None: the model's context length

    def __post_init__(self) -> None:
        from moestream.errors import RequestError

        if self.max_num_seqs < 1:
            raise RequestError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise RequestError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise RequestError(f"--max-model-len must be >= 1, got {self.max_model_len}")

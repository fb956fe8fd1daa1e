"""Architecture name (GGUF `general.architecture`) -> model class, and `build_model`."""

from __future__ import annotations

import torch

from moestream.errors import UnsupportedError
from moestream.models.base import CausalLM
from moestream.models.llama import LlamaCausalLM
from moestream.models.qwen3moe import Qwen3MoeCausalLM
from moestream.weights.loader import ModelSource

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaCausalLM,
    "qwen2": LlamaCausalLM,
    "qwen3": LlamaCausalLM,
    "qwen3moe": Qwen3MoeCausalLM,
}


def build_model(
    source: ModelSource, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> CausalLM:
    """The model for `source`, weights moved to `device` once (kept in GGUF block format),
    activations in `dtype`. Unknown architectures raise UnsupportedError."""
    arch = source.config.arch
    cls = MODEL_CLASSES.get(arch)
    if cls is None:
        raise UnsupportedError(
            f"{source.path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(MODEL_CLASSES))})"
        )
    return cls(source.config, source.tensors, device=device, dtype=dtype)

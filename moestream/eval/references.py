"""Reference implementations that `moestream eval` scores our logits against.

A `Reference` maps token ids to float32 logits [T, V] for the same ids, with its own cache:
- `TransformersReference`: a Hugging Face folder through `transformers` in float32;
- `LlamaCppReference`: a GGUF file through llama.cpp (`llama-cpp-python`, the optional extra
  `moestream[llamacpp]`, built from its PyPI source). Without it, `open_reference` raises
  `ReferenceUnavailable`, which the CLI reports as a skip, not a failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from moestream.errors import ModelFormatError, MoestreamError


class ReferenceUnavailable(MoestreamError):
    """The reference needs an optional package that is not installed."""


class Reference(Protocol):
    """Logits of a reference implementation. `logits(ids)` -> Tensor [T, V] float32 on the CPU,
    row t predicting the token after ids[t]; every call starts from an empty context."""

    name: str
    vocab_size: int

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor: ...


class TransformersReference:
    def __init__(self, folder: str | Path, device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        self.name = f"transformers {Path(folder).name} (float32)"
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        self.model.to(self.device).eval()
        self.vocab_size = int(self.model.config.vocab_size)

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, T]
        return self.model(ids, use_cache=False).logits[0].float().cpu()  # [T, V]


class LlamaCppReference:
    def __init__(self, gguf: str | Path, n_ctx: int, device: str = "cpu"):
        try:
            from llama_cpp import Llama
        except ImportError:
            raise ReferenceUnavailable(
                "the llama.cpp reference needs llama-cpp-python, which is not installed "
                "(pip install 'moestream[llamacpp]' builds it from its PyPI source)"
            ) from None
        self.name = f"llama.cpp {Path(gguf).name}"
        self.n_ctx = n_ctx
        self.llama = Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_batch=n_ctx,
            n_ubatch=n_ctx,
            logits_all=True,
            n_gpu_layers=0 if device == "cpu" else -1,
            verbose=False,
        )
        self.vocab_size = int(self.llama.n_vocab())

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        ids = [int(t) for t in token_ids]
        if len(ids) > self.n_ctx:
            raise ValueError(f"{len(ids)} tokens do not fit the llama.cpp context of {self.n_ctx}")
        self.llama.reset()
        self.llama.eval(ids)
        return torch.from_numpy(self.llama.scores[: len(ids)].copy()).float()  # [T, V]


def open_reference(ref: str | Path, n_ctx: int, device: str = "cpu") -> Reference:
    """A Hugging Face folder -> TransformersReference; a .gguf file -> LlamaCppReference."""
    path = Path(ref)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelFormatError(f"reference {path}: a folder without config.json")
        return TransformersReference(path, device)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelFormatError(f"reference {path}: expected a .gguf file or an HF folder")
        return LlamaCppReference(path, n_ctx, device)
    raise ModelFormatError(f"reference {path}: no such file or folder")

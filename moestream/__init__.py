"""moestream: run large Mixture-of-Experts language models from GGUF files."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from moestream.llm import LLM
    from moestream.types import SamplingParams


def __getattr__(name: str):
    # Lazy: `import moestream` must not import torch (the pure-Python cores rely on it).
    if name == "LLM":
        from moestream.llm import LLM

        return LLM
    if name == "SamplingParams":
        from moestream.types import SamplingParams

        return SamplingParams
    raise AttributeError(name)

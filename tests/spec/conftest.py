"""The trained tiny pair shipped in moestream/data (a Qwen3-MoE target and a Qwen3 draft that
share a tokenizer), for speculative-decoding tests through the engine.

Their weights are dequantized once to float32 (bit-exact) so that the CPU reference does not
dequantize every weight in every forward: the tests compare speculative with plain decode of
the same model, and run several times faster.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import moestream

DATA = Path(moestream.__file__).parent / "data"
TARGET = DATA / "tiny-qwen3-moe-Q4_K_M.gguf"
DRAFT = DATA / "tiny-qwen3-draft-Q8_0.gguf"


def load_dequantized(path: Path):
    """(model with float32 weights, its ModelSource)."""
    from moestream.models.registry import build_model
    from moestream.weights.loader import open_model
    from moestream.weights.qtensor import QTensor

    source = open_model(path)
    tensors = {
        n: QTensor.from_float(source.tensors[n].dequantize(torch.float32)) for n in source.tensors
    }
    return build_model(dataclasses.replace(source, tensors=tensors)), source


@pytest.fixture(scope="session")
def demo_pair() -> SimpleNamespace:
    target, source = load_dequantized(TARGET)
    draft, _ = load_dequantized(DRAFT)
    return SimpleNamespace(
        target=target,
        draft=draft,
        tokenizer=source.tokenizer(),
        vocab_tokens=source.metadata.get("tokenizer.ggml.tokens"),
    )


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny ops run fastest, and steadiest on a shared machine, on one thread (module scope:
    before the module-scoped fixtures that already generate)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

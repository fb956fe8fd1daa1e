"""A tiny random Qwen3-MoE (transformers, float32) with the fixture tokenizer, for engine tests.

hidden 64, 2 layers, 8 experts (2 used), vocab 4096 = tests/fixtures/tokenizer.json. Weights are
re-drawn with a seeded generator so that routing and logits are far from uniform.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent.parent / "fixtures"


def make_tiny_moe(path: Path, seed: int = 0) -> Path:
    import transformers as tf

    config = tf.Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = tf.Qwen3MoeForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * noise)
            else:
                # 2x the usual scale: peaked logits, so greedy text has few near-ties
                p.copy_(2 * noise / math.sqrt(p.shape[-1]))
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("tiny-qwen3moe"))


@pytest.fixture(scope="session")
def tiny_moe(tiny_moe_dir):
    """(model, tokenizer) built once per session; engines share the read-only model."""
    from moestream.models.registry import build_model
    from moestream.weights.loader import open_model

    source = open_model(tiny_moe_dir)
    return build_model(source), source.tokenizer()


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny ops run fastest, and steadiest on a shared machine, on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

"""The GGUF path: each architecture's tiny random model, converted to an F32 GGUF by
`moestream convert`, gives the logits of `transformers` (float32) for prompts of 1, 7 and 300
tokens. This covers the llama.cpp name map, the llama Q/K permutation, expert stacking, tied
embeddings and the metadata round trip together with the forward pass."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from moestream.models.registry import build_model
from moestream.weights.convert import convert
from moestream.weights.loader import open_model

LENGTHS = (1, 7, 300)
TOLERANCE = 1e-4


def _byte_tokenizer(folder: Path) -> None:
    """A 256-token byte-level BPE (no merges) to match the tiny models' vocabulary of 256."""
    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"add_bos_token": false}')


@pytest.mark.parametrize(
    "case, tied",
    [("qwen3moe", False), ("qwen3", True), ("llama", False), ("qwen2", True)],
)
def test_f32_gguf_logits_match_transformers(tiny, tmp_path, case: str, tied: bool) -> None:
    hf, folder = tiny.hf(case, tied)
    local = tmp_path / "hf"
    shutil.copytree(folder, local)
    _byte_tokenizer(local)
    out = convert(local, tmp_path / f"{case}.gguf", quant="F32", progress=False)
    source = open_model(out)
    assert source.config.arch == open_model(folder).config.arch
    assert source.config.tie_embeddings == tied
    model = build_model(source)
    for t in LENGTHS:
        ids = tiny_prompt(t)
        rel = tiny.rel_diff(tiny.one_shot(model, ids), tiny.hf_logits(hf, ids))
        assert rel < TOLERANCE, f"{case} GGUF T={t}: relative difference {rel:.2e}"


def tiny_prompt(t: int):
    import torch

    return torch.randint(0, 256, (t,), generator=torch.Generator().manual_seed(7))

"""Bad model files and folders get one clear MoestreamError naming the file and the field or
tensor. Each case starts from a tiny valid GGUF written on the fly and breaks one thing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from safetensors.torch import save_file

from moestream.config import ModelConfig
from moestream.errors import ModelFormatError, MoestreamError, UnsupportedError
from moestream.weights.convert import convert, gguf_metadata
from moestream.weights.layout import expected_shapes
from moestream.weights.loader import open_model
from moestream.weights.writer import TensorToWrite, add_metadata, write_gguf

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# Rows of 256 so that a 256-block type (IQ2_XXS) fits attn_q; no tokenizer, vocab 32.
CFG = ModelConfig(
    arch="qwen3moe", name="tiny", n_layers=1, hidden_size=256, n_heads=2, n_kv_heads=1,
    head_dim=32, vocab_size=32, n_experts=2, n_experts_used=1, expert_ffn_size=32,
)  # fmt: skip


def _tensors(shapes: dict[str, tuple[int, ...]]) -> list[TensorToWrite]:
    g = torch.Generator().manual_seed(0)
    return [
        TensorToWrite(n, s, GGMLQuantizationType.F32, lambda s=s: torch.randn(s, generator=g))
        for n, s in shapes.items()
    ]


def write_tiny(path: Path, meta_config: ModelConfig = CFG, drop: str | None = None, **meta) -> Path:
    """A valid F32 GGUF of CFG's tensors (minus `drop`) with `meta_config`'s metadata."""
    shapes = {n: s for n, s in expected_shapes(CFG).items() if n != drop}
    metadata = {**gguf_metadata(meta_config, 0, {}), **meta}
    return write_gguf(path, metadata["general.architecture"], metadata, _tensors(shapes), False)


@pytest.fixture
def tiny(tmp_path) -> Path:
    path = write_tiny(tmp_path / "tiny.gguf")
    open_model(path)  # the unbroken file loads
    return path


def _fails(path: Path, error: type[MoestreamError], *needles: str) -> MoestreamError:
    with pytest.raises(error) as info:
        open_model(path)
    message = str(info.value)
    assert str(path) in message
    for needle in needles:
        assert needle in message, message
    assert "\n" not in message
    return info.value


def test_truncated_in_half(tiny) -> None:
    data = tiny.read_bytes()
    tiny.write_bytes(data[: len(data) // 2])
    _fails(tiny, ModelFormatError, "truncated", "tensor blk.0.")


def test_truncated_last_bytes_of_tensor_data(tiny) -> None:
    data = tiny.read_bytes()
    tiny.write_bytes(data[:-4])  # output.weight is last, 32 x 256 F32: no padding after it
    _fails(tiny, ModelFormatError, "truncated", "tensor output.weight", f"has {len(data) - 4}")


def test_truncated_inside_metadata(tiny) -> None:
    tiny.write_bytes(tiny.read_bytes()[:100])
    _fails(tiny, ModelFormatError, "truncated", "metadata field general.")


def test_wrong_magic(tiny) -> None:
    tiny.write_bytes(b"GGUX" + tiny.read_bytes()[4:])
    _fails(tiny, ModelFormatError, "not a GGUF file", "magic")


def test_unsupported_gguf_version(tiny) -> None:
    data = bytearray(tiny.read_bytes())
    data[4:8] = (4).to_bytes(4, "little")
    tiny.write_bytes(bytes(data))
    _fails(tiny, UnsupportedError, "GGUF version 4")


def test_unknown_architecture(tmp_path) -> None:
    meta = {k.replace("qwen3moe.", "gpt5."): v for k, v in gguf_metadata(CFG, 0, {}).items()}
    meta["general.architecture"] = "gpt5"
    path = write_gguf(tmp_path / "gpt5.gguf", "gpt5", meta, _tensors(expected_shapes(CFG)), False)
    _fails(path, ModelFormatError, "'gpt5'", "general.architecture")


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.IQ2_XXS, GGMLQuantizationType.TQ1_0])
def test_unsupported_quant_type(tmp_path, qtype) -> None:
    path = tmp_path / "iq.gguf"
    writer = GGUFWriter(path, CFG.arch)
    add_metadata(writer, gguf_metadata(CFG, 0, {}))
    rng = np.random.default_rng(0)
    for name, shape in expected_shapes(CFG).items():
        if name == "blk.0.attn_q.weight":
            block, type_size = GGML_QUANT_SIZES[qtype]
            raw = rng.integers(0, 256, (shape[0], shape[1] // block * type_size), np.uint8)
            writer.add_tensor(name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(name, rng.standard_normal(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _fails(path, UnsupportedError, "tensor blk.0.attn_q.weight", qtype.name)


def test_unknown_tensor_type_id(tiny) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(tiny)
    field = next(t for t in reader.tensors if t.name == "blk.0.ffn_norm.weight").field
    type_offset = field.offset + sum(p.nbytes for p in field.parts[:4])
    data = bytearray(tiny.read_bytes())
    data[type_offset : type_offset + 4] = (250).to_bytes(4, "little")
    tiny.write_bytes(bytes(data))
    _fails(tiny, UnsupportedError, "tensor blk.0.ffn_norm.weight", "type id 250")


def test_tensor_shape_disagrees_with_hyperparameters(tmp_path) -> None:
    path = write_tiny(tmp_path / "shape.gguf", meta_config=CFG.replace(n_heads=4))
    _fails(path, ModelFormatError, "tensor blk.0.attn_q.weight", "[64, 256]", "[128, 256]")


def test_missing_tensor(tmp_path) -> None:
    path = write_tiny(tmp_path / "missing.gguf", drop="blk.0.ffn_norm.weight")
    _fails(path, ModelFormatError, "missing tensor blk.0.ffn_norm.weight")


def test_missing_tokenizer_when_requested(tiny) -> None:
    source = open_model(tiny)  # weights alone load fine
    with pytest.raises(ModelFormatError) as info:
        source.tokenizer()
    assert str(tiny) in str(info.value) and "tokenizer.ggml.tokens" in str(info.value)


# ---- Hugging Face folders --------------------------------------------------------------------
HF_CONFIG = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 4096,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
}  # fmt: skip


@pytest.fixture
def hf_dir(tmp_path) -> Path:
    """A valid tiny Qwen3 folder written by hand (tied embeddings)."""
    h, f, v = 32, 64, 4096
    shapes = {
        "model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
        "model.layers.0.input_layernorm.weight": (h,),
        "model.layers.0.post_attention_layernorm.weight": (h,),
        "model.layers.0.self_attn.q_proj.weight": (32, h),
        "model.layers.0.self_attn.k_proj.weight": (16, h),
        "model.layers.0.self_attn.v_proj.weight": (16, h),
        "model.layers.0.self_attn.o_proj.weight": (h, 32),
        "model.layers.0.self_attn.q_norm.weight": (16,),
        "model.layers.0.self_attn.k_norm.weight": (16,),
        "model.layers.0.mlp.gate_proj.weight": (f, h), "model.layers.0.mlp.up_proj.weight": (f, h),
        "model.layers.0.mlp.down_proj.weight": (h, f),
    }  # fmt: skip
    path = tmp_path / "hf"
    path.mkdir()
    save_file({k: torch.randn(s) for k, s in shapes.items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(HF_CONFIG))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / name, path / name)
    convert(path, tmp_path / "ok.gguf", quant="F32", progress=False)  # the unbroken folder works
    return path


def test_hf_folder_without_config(hf_dir, tmp_path) -> None:
    (hf_dir / "config.json").unlink()
    for action in (lambda: open_model(hf_dir), lambda: convert(hf_dir, tmp_path / "x.gguf")):
        with pytest.raises(ModelFormatError, match="config.json") as info:
            action()
        assert str(hf_dir) in str(info.value)


def test_hf_folder_with_unknown_model_type(hf_dir, tmp_path) -> None:
    (hf_dir / "config.json").write_text(json.dumps({**HF_CONFIG, "model_type": "gpt5"}))
    for action in (lambda: open_model(hf_dir), lambda: convert(hf_dir, tmp_path / "x.gguf")):
        with pytest.raises(ModelFormatError, match="model_type 'gpt5'") as info:
            action()
        assert str(hf_dir / "config.json") in str(info.value)


def test_hf_folder_without_tokenizer(hf_dir, tmp_path) -> None:
    (hf_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelFormatError, match="tokenizer.json") as info:
        convert(hf_dir, tmp_path / "x.gguf", progress=False)
    assert str(hf_dir) in str(info.value)
    assert not (tmp_path / "x.gguf").exists()
    source = open_model(hf_dir)  # the weights alone load
    with pytest.raises(ModelFormatError, match="tokenizer.json"):
        source.tokenizer()

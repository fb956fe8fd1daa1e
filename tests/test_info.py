"""`moestream info`: figures for a tiny MoE converted at Q4_K_M, checked against sums written out
by hand from the shapes and GGML block sizes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from safetensors.torch import save_file

from moestream.errors import ModelFormatError
from moestream.info import format_info, model_info
from moestream.weights.convert import convert

FIXTURES = Path(__file__).resolve().parent / "fixtures"
V, H, E, F, L = 4096, 256, 4, 256, 2  # vocab, hidden, experts, expert ffn, layers
QH, KVH = 128, 64  # 2 heads x 64, 1 KV head x 64
CONFIG = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": V,
    "hidden_size": H, "intermediate_size": 512, "moe_intermediate_size": F,
    "num_hidden_layers": L, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
    "num_experts": E, "num_experts_per_tok": 2, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1024, "tie_word_embeddings": False,
}  # fmt: skip


def _hf_folder(path: Path) -> Path:
    shapes = {
        "model.embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "model.norm.weight": (H,),
    }  # fmt: skip
    for i in range(L):
        b = f"model.layers.{i}."
        shapes |= {
            b + "input_layernorm.weight": (H,), b + "post_attention_layernorm.weight": (H,),
            b + "self_attn.q_proj.weight": (QH, H), b + "self_attn.k_proj.weight": (KVH, H),
            b + "self_attn.v_proj.weight": (KVH, H), b + "self_attn.o_proj.weight": (H, QH),
            b + "self_attn.q_norm.weight": (64,), b + "self_attn.k_norm.weight": (64,),
            b + "mlp.gate.weight": (E, H),
        }  # fmt: skip
        for e in range(E):
            for proj, shape in (("gate_proj", (F, H)), ("up_proj", (F, H)), ("down_proj", (H, F))):
                shapes[f"{b}mlp.experts.{e}.{proj}.weight"] = shape
    g = torch.Generator().manual_seed(0)
    path.mkdir()
    weights = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    save_file(weights, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(CONFIG))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / name, path / name)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("info")
    hf = _hf_folder(tmp / "tiny-moe")
    return hf, convert(hf, tmp / "tiny-moe-Q4_K_M.gguf", quant="Q4_K_M", progress=False)


def nbytes(qtype: str, rows: int, cols: int) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return rows * cols // block * size


PARAMS_EXPERTS = L * 3 * E * F * H
PARAMS_DENSE = 2 * V * H + H + L * (2 * H + 2 * 64 + E * H + 2 * QH * H + 2 * KVH * H)


def test_gguf_info_figures(files) -> None:
    _, gguf = files
    info = model_info(gguf)

    def fields(*keys: str) -> tuple:
        return tuple(info[k] for k in keys)

    assert fields("architecture", "name", "file_type") == ("qwen3moe", "tiny-moe", "Q4_K_M")
    assert fields("n_layers", "hidden_size", "n_heads", "n_kv_heads") == (L, H, 2, 1)
    assert fields("n_experts", "n_experts_used", "context_length") == (E, 2, 1024)
    assert info["params_total"] == PARAMS_DENSE + PARAMS_EXPERTS
    assert info["params_active"] == PARAMS_DENSE + PARAMS_EXPERTS // 2
    assert info["file_size"] == gguf.stat().st_size
    # llama.cpp's Q4_K_M for 2 layers: use_more_bits picks layer 1 (attn_v, ffn_down_exps ->
    # Q6_K); attn_output's rows of 128 fall back from Q4_K to Q5_0.
    assert info["quant_mix"] == {
        "token_embd": {"Q4_K": 1}, "output": {"Q6_K": 1}, "output_norm": {"F32": 1},
        "attn_norm": {"F32": 2}, "ffn_norm": {"F32": 2}, "attn_q_norm": {"F32": 2},
        "attn_k_norm": {"F32": 2}, "ffn_gate_inp": {"F32": 2}, "attn_q": {"Q4_K": 2},
        "attn_k": {"Q4_K": 2}, "attn_v": {"Q4_K": 1, "Q6_K": 1}, "attn_output": {"Q5_0": 2},
        "ffn_gate_exps": {"Q4_K": 2}, "ffn_up_exps": {"Q4_K": 2},
        "ffn_down_exps": {"Q4_K": 1, "Q6_K": 1},
    }  # fmt: skip
    embd = nbytes("Q4_K", V, H)
    layer_dense = (
        4 * (2 * H + 2 * 64 + E * H)
        + nbytes("Q4_K", QH, H) + nbytes("Q4_K", KVH, H) + nbytes("Q5_0", H, QH)
    )  # fmt: skip
    dense = embd + nbytes("Q6_K", V, H) + 4 * H + 2 * layer_dense
    dense += nbytes("Q4_K", KVH, H) + nbytes("Q6_K", KVH, H)  # attn_v of layers 0 and 1
    experts = E * (4 * nbytes("Q4_K", F, H) + nbytes("Q4_K", H, F) + nbytes("Q6_K", H, F))
    assert (info["bytes_dense"], info["bytes_experts"]) == (dense, experts)
    assert info["bytes_per_token"] == dense - embd + embd // V + experts // 2
    assert info["tokenizer"]["present"] and info["tokenizer"]["n_tokens"] == V
    assert info["tokenizer"]["model"] == "gpt2"
    assert info["chat_template"] is True


def test_hf_folder_info_agrees_on_parameters(files) -> None:
    hf, gguf = files
    info, ref = model_info(hf), model_info(gguf)
    assert info["format"] == "hf" and info["name"] == "tiny-moe"
    for key in ("params_total", "params_active", "n_layers", "n_experts", "vocab_size"):
        assert info[key] == ref[key], key
    assert all(types == {"F32": n} for types, n in
               ((t, sum(t.values())) for t in info["quant_mix"].values()))  # fmt: skip
    assert info["bytes_dense"] + info["bytes_experts"] == 4 * info["params_total"]
    assert info["tokenizer"]["n_tokens"] == V and info["chat_template"] is True


def test_format_info(files) -> None:
    text = format_info(model_info(files[1]))
    needles = (
        "qwen3moe", "Q4_K_M", "experts          4 (2 per token", "attn_v", "Q4_K x1, Q6_K x1",
        "read per token", "chat template    yes", "4096 tokens",
    )  # fmt: skip
    for needle in needles:
        assert needle in text, needle
    assert f"{PARAMS_DENSE + PARAMS_EXPERTS:,}" in text


def test_info_on_a_bad_file(tmp_path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a model at all")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        model_info(path)

"""`convert`: tiny random HF models -> GGUF, checked tensor by tensor against transformers' own
weights, mix by mix against llama.cpp's rules (written out here by hand), and logit by logit
against the HF folder run through moestream and against transformers."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from moestream.errors import ModelFormatError, RequestError
from moestream.weights.convert import convert
from moestream.weights.loader import open_model
from moestream.weights.mixes import parse_layer_quant
from moestream.weights.names import unpermute_qk

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VOCAB = 4096  # the fixture tokenizer's size
PROMPT = torch.tensor([5, 300, 17, 4000, 42, 1, 999])  # 7 tokens

# Qwen3-MoE with rows of 256 everywhere (K-quants apply), 4 experts (llama.cpp's 8-expert rules
# do not fire), 2 layers (use_more_bits picks layer 1 only).
MOE = dict(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
    tie_word_embeddings=False,
)  # fmt: skip
# Llama with rows of 64: every K-quant falls back (Q/K rows are permuted for llama.cpp).
LLAMA = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    tie_word_embeddings=False,
)  # fmt: skip


def _make_hf(kind: str, path: Path) -> torch.nn.Module:
    import transformers as tf

    config_cls, model_cls, fields = {
        "qwen3moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, MOE),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, LLAMA),
    }[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**fields)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms away from 1 so a norm mix-up shows
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if p.ndim == 1 else noise / math.sqrt(p.shape[-1]))
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / name, path / name)
    return model


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path]]:
    out = {}
    for kind in ("qwen3moe", "llama"):
        path = tmp_path_factory.mktemp(kind)
        out[kind] = (_make_hf(kind, path), path)
    return out


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def _converted(hf, gguf_dir: Path, kind: str, quant: str, layer_quant=None) -> Path:
    out = gguf_dir / f"{kind}-{quant}-{bool(layer_quant)}.gguf"
    if not out.exists():
        convert(hf[kind][1], out, quant=quant, layer_quant=layer_quant, progress=False)
    return out


def _types(path: Path) -> dict[str, str]:
    source = open_model(path)
    return {name: source.gguf.tensor_type(name).name for name in source.gguf.tensor_names}


def test_f32_tensors_equal_transformers_weights(hf, gguf_dir) -> None:
    model, _ = hf["qwen3moe"]
    sd = model.state_dict()
    g = open_model(_converted(hf, gguf_dir, "qwen3moe", "F32")).tensors
    assert all(t.qtype == Q.F32 for t in g.values())
    assert torch.equal(g["token_embd.weight"].data, sd["model.embed_tokens.weight"])
    assert torch.equal(g["output.weight"].data, sd["lm_head.weight"])
    assert torch.equal(g["output_norm.weight"].data, sd["model.norm.weight"])
    hf_names = {
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm", "ffn_gate_inp": "mlp.gate",
    }  # fmt: skip
    experts = model.model.layers[0].mlp.experts
    for i in range(2):
        for kind, hf_name in hf_names.items():
            ours = g[f"blk.{i}.{kind}.weight"].data
            assert torch.equal(ours, sd[f"model.layers.{i}.{hf_name}.weight"]), (i, kind)
    # Experts stacked [E, out, in]; transformers 5 holds them fused as gate_up [E, 2F, H].
    gate_up = experts.gate_up_proj.detach()
    f = MOE["moe_intermediate_size"]
    assert torch.equal(g["blk.0.ffn_gate_exps.weight"].data, gate_up[:, :f])
    assert torch.equal(g["blk.0.ffn_up_exps.weight"].data, gate_up[:, f:])
    assert torch.equal(g["blk.0.ffn_down_exps.weight"].data, experts.down_proj.detach())
    assert g["blk.0.ffn_down_exps.weight"].shape == (4, 256, 256)


def test_f32_llama_qk_are_permuted_for_llama_cpp(hf, gguf_dir) -> None:
    model, _ = hf["llama"]
    sd = model.state_dict()
    g = open_model(_converted(hf, gguf_dir, "llama", "F32")).tensors
    q, k = g["blk.1.attn_q.weight"].data, g["blk.1.attn_k.weight"].data
    assert not torch.equal(q, sd["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(unpermute_qk(q, 4), sd["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(unpermute_qk(k, 2), sd["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(g["blk.1.attn_v.weight"].data, sd["model.layers.1.self_attn.v_proj.weight"])


def test_every_tensor_matches_the_hf_folder(hf, gguf_dir) -> None:
    for kind in ("qwen3moe", "llama"):
        ref = open_model(hf[kind][1]).tensors
        g = open_model(_converted(hf, gguf_dir, kind, "F32")).tensors
        assert set(g) == set(ref)
        for name, t in ref.items():
            assert torch.equal(g[name].dequantize(), t.dequantize()), name


def _expected_moe(quant: str) -> dict[str, str]:
    """llama.cpp's llama_tensor_get_type for MOE (4 experts, gqa 2, 2 layers: use_more_bits
    selects layer 1), written out by hand."""
    base = {"Q8_0": "Q8_0", "Q4_K_M": "Q4_K", "Q2_K": "Q2_K"}[quant]
    out = {"token_embd.weight": base, "output_norm.weight": "F32"}
    out["output.weight"] = "Q8_0" if quant == "Q8_0" else "Q6_K"
    for i in range(2):
        b = f"blk.{i}."
        for norm in ("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm", "ffn_gate_inp"):
            out[b + norm + ".weight"] = "F32"
        for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_exps", "ffn_up_exps",
                     "ffn_down_exps"):  # fmt: skip
            out[b + kind + ".weight"] = base
    if quant == "Q4_K_M":
        out["blk.1.attn_v.weight"] = out["blk.1.ffn_down_exps.weight"] = "Q6_K"
    if quant == "Q2_K":
        for i in range(2):  # gqa 2 < 4: attn_v Q3_K
            for kind in ("attn_v", "attn_output", "ffn_down_exps"):
                out[f"blk.{i}.{kind}.weight"] = "Q3_K"
    return out


# Relative RMS error of a dequantized Gaussian matrix, with margin.
TOLERANCE = {"F32": 0.0, "Q8_0": 0.01, "Q6_K": 0.03, "Q5_K": 0.05, "Q4_K": 0.1, "Q3_K": 0.2,
             "Q2_K": 0.4, "Q5_0": 0.06, "Q5_1": 0.06, "Q4_0": 0.12}  # fmt: skip


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M", "Q2_K"])
def test_mix_types_and_values(hf, gguf_dir, quant: str) -> None:
    path = _converted(hf, gguf_dir, "qwen3moe", quant)
    assert _types(path) == _expected_moe(quant)
    source = open_model(path)
    assert source.metadata["general.file_type"] == {"Q8_0": 7, "Q4_K_M": 15, "Q2_K": 10}[quant]
    ref = open_model(hf["qwen3moe"][1]).tensors
    for name, t in source.tensors.items():
        a, b = ref[name].dequantize(), t.dequantize()
        err = ((a - b).norm() / a.norm()).item()
        assert err <= TOLERANCE[t.qtype.name] + 1e-7, (name, t.qtype.name, err)
        if t.qtype != Q.F32:
            assert err > 0, name  # really quantized


@pytest.mark.parametrize("quant, dtype", [("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_float_mixes_round_to_nearest(hf, gguf_dir, quant: str, dtype: torch.dtype) -> None:
    g = open_model(_converted(hf, gguf_dir, "llama", quant))
    ref = open_model(hf["llama"][1]).tensors
    for name, t in g.tensors.items():
        expected_type = quant if t.data.ndim == 2 else "F32"  # 1-D norms stay F32
        assert t.qtype.name == expected_type, name
        want = ref[name].dequantize()
        assert torch.equal(t.dequantize(), want.to(dtype).float() if t.data.ndim == 2 else want)
    assert g.metadata["general.file_type"] == {"F16": 1, "BF16": 32}[quant]


def test_rows_not_multiple_of_256_fall_back(hf, gguf_dir) -> None:
    types = _types(_converted(hf, gguf_dir, "llama", "Q4_K_M"))
    assert types["blk.0.attn_q.weight"] == "Q5_0"  # Q4_K -> Q5_0
    assert types["blk.1.ffn_down.weight"] == "Q8_0"  # Q6_K (use_more_bits) -> Q8_0
    assert types["blk.0.ffn_down.weight"] == "Q5_0"
    assert types["output.weight"] == "Q8_0"  # 64 % 256: llama.cpp's output rule
    assert types["blk.0.attn_norm.weight"] == "F32"
    q2 = _types(_converted(hf, gguf_dir, "llama", "Q2_K"))
    assert q2["blk.0.attn_q.weight"] == "Q4_0" and q2["blk.0.ffn_down.weight"] == "Q4_0"


def test_layer_overrides(hf, gguf_dir) -> None:
    path = _converted(hf, gguf_dir, "qwen3moe", "Q2_K", layer_quant={1: "Q4_K"})
    types = _types(path)
    expected = _expected_moe("Q2_K")
    for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_exps", "ffn_up_exps",
                 "ffn_down_exps"):  # fmt: skip
        expected[f"blk.1.{kind}.weight"] = "Q4_K"
    assert types == expected  # layer 0, norms, router, output untouched
    assert open_model(path).metadata["general.file_type"] == 10


def test_parse_layer_quant() -> None:
    assert parse_layer_quant("33-39=Q4_K,40=q6_k") == {range(33, 40): "Q4_K", 40: "Q6_K"}
    assert parse_layer_quant(" 0=Q8_0 , ") == {0: "Q8_0"}
    for bad in ("33-39", "a=Q4_K", "1=Q7_K", "1-=Q4_K", "1=IQ2_XXS"):
        with pytest.raises(RequestError, match="layer-quant"):
            parse_layer_quant(bad)


def test_bad_mix_or_layer_is_a_request_error(hf, tmp_path) -> None:
    with pytest.raises(RequestError, match="Q3_K_XL"):
        convert(hf["qwen3moe"][1], tmp_path / "x.gguf", quant="Q3_K_XL", progress=False)
    with pytest.raises(RequestError, match="layer 7"):
        convert(hf["qwen3moe"][1], tmp_path / "x.gguf", layer_quant={7: "Q4_K"}, progress=False)
    assert not list(tmp_path.iterdir())  # nothing written, not even a partial file


def test_metadata_round_trip(hf, gguf_dir) -> None:
    for kind in ("qwen3moe", "llama"):
        _, folder = hf[kind]
        g = open_model(_converted(hf, gguf_dir, kind, "Q8_0"))
        ref = open_model(folder).config
        # GGUF always states the rotary dims and a name; the HF folder leaves both implicit.
        assert g.config == ref.replace(rope_dim=ref.rotary_dim, name=folder.name)
        meta = g.metadata
        assert meta["general.architecture"] == ref.arch
        assert meta["general.quantization_version"] == 2
        assert meta["general.type"] == "model"
        assert len(meta["tokenizer.ggml.tokens"]) == VOCAB
        assert meta["tokenizer.ggml.model"] == "gpt2"
        tok_config = json.loads((FIXTURES / "tokenizer_config.json").read_text())
        assert meta["tokenizer.chat_template"] == tok_config["chat_template"]


def test_convert_rejects_a_misshapen_folder(hf, tmp_path) -> None:
    folder = tmp_path / "bad"
    shutil.copytree(hf["qwen3moe"][1], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_key_value_heads"] = 4
    (folder / "config.json").write_text(json.dumps(cfg))
    match = r"blk\.0\.attn_k\.weight.*\[128, 256\].*\[256, 256\]"
    with pytest.raises(ModelFormatError, match=match):
        convert(folder, tmp_path / "bad.gguf", quant="F32", progress=False)
    assert not (tmp_path / "bad.gguf").exists()


@pytest.mark.parametrize("kind", ["qwen3moe", "llama"])
def test_f32_gguf_logits_match_hf_folder_and_transformers(hf, gguf_dir, kind: str) -> None:
    from moestream.layers.attention import AttentionMetadata
    from moestream.models.registry import build_model

    def logits(source) -> torch.Tensor:
        model = build_model(source)
        kv = model.make_kv_cache(1, 16)
        attn = AttentionMetadata.build([(0, len(PROMPT), [0])], 16, "cpu")
        return model.compute_logits(model.forward(PROMPT, torch.arange(len(PROMPT)), attn, kv))

    model, folder = hf[kind]
    ours_gguf = logits(open_model(_converted(hf, gguf_dir, kind, "F32")))  # [7, V]
    ours_hf = logits(open_model(folder))
    with torch.no_grad():
        ref = model(PROMPT[None]).logits[0].float()
    scale = ours_hf.abs().max()
    assert ((ours_gguf - ours_hf).abs().max() / scale).item() < 1e-5
    assert ((ours_gguf - ref).abs().max() / ref.abs().max()).item() < 1e-4


# ---- mix rules on real-model shapes (no conversion) ------------------------------------------
def _mix(config, quant: str, tied: bool = False) -> dict[str, str]:
    from moestream.weights.layout import expected_shapes
    from moestream.weights.mixes import tensor_qtypes

    shapes = expected_shapes(config, tied=tied)
    return {n: t.name for n, t in tensor_qtypes(config, shapes, quant).items()}


QWEN3_30B = dict(
    arch="qwen3moe", n_layers=48, hidden_size=2048, n_heads=32, n_kv_heads=4, head_dim=128,
    vocab_size=151936, ffn_size=6144, n_experts=128, n_experts_used=8, expert_ffn_size=768,
)  # fmt: skip
# use_more_bits(i, 48): the first and last 6 layers and every third layer from 8 on.
MORE_BITS_48 = [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45,
                46, 47]  # fmt: skip


def test_q4_k_m_on_qwen3_30b_a3b() -> None:
    from moestream.config import ModelConfig

    types = _mix(ModelConfig(**QWEN3_30B), "Q4_K_M")
    for kind in ("attn_v", "ffn_down_exps"):
        assert [i for i in range(48) if types[f"blk.{i}.{kind}.weight"] == "Q6_K"] == MORE_BITS_48
        assert {types[f"blk.{i}.{kind}.weight"] for i in range(48)} == {"Q4_K", "Q6_K"}
    assert {types[f"blk.{i}.attn_output.weight"] for i in range(48)} == {"Q4_K"}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert types["blk.7.ffn_gate_inp.weight"] == types["blk.7.attn_q_norm.weight"] == "F32"
    # expert down rows are 768 = 3 x 256: no fallback
    q2 = _mix(ModelConfig(**QWEN3_30B), "Q2_K")
    assert q2["blk.0.attn_v.weight"] == "Q4_K"  # gqa 8 >= 4
    assert q2["blk.0.ffn_down_exps.weight"] == q2["blk.0.attn_output.weight"] == "Q3_K"
    assert q2["blk.0.ffn_gate_exps.weight"] == q2["token_embd.weight"] == "Q2_K"


def test_eight_expert_rules() -> None:
    from moestream.config import ModelConfig

    demo = ModelConfig(
        arch="qwen3moe", n_layers=6, hidden_size=512, n_heads=8, n_kv_heads=2, head_dim=64,
        vocab_size=4096, ffn_size=1024, n_experts=8, n_experts_used=2, expert_ffn_size=256,
    )  # fmt: skip
    expected = {  # quant -> (attn_q, attn_k, attn_v, attn_output, ffn_down_exps by layer, output)
        "Q4_K_M": ("Q4_K", "Q8_0", "Q8_0", "Q5_K", ["Q4_K"] * 2 + ["Q6_K"] + ["Q4_K"] * 2
                   + ["Q6_K"], "Q6_K"),
        "Q2_K": ("Q2_K", "Q8_0", "Q8_0", "Q5_K", ["Q3_K"] * 6, "Q6_K"),
        "Q6_K": ("Q6_K", "Q8_0", "Q8_0", "Q6_K", ["Q6_K"] * 6, "Q6_K"),
        "Q4_0": ("Q4_0", "Q8_0", "Q8_0", "Q4_0", ["Q4_0"] * 6, "Q6_K"),
        "Q8_0": ("Q8_0", "Q8_0", "Q8_0", "Q8_0", ["Q8_0"] * 6, "Q8_0"),
        "F16": ("F16", "F16", "F16", "F16", ["F16"] * 6, "F16"),
        "BF16": ("BF16", "BF16", "BF16", "BF16", ["BF16"] * 6, "BF16"),
    }  # fmt: skip
    for quant, (q, k, v, o, down, out) in expected.items():
        t = _mix(demo, quant)
        got = (t["blk.3.attn_q.weight"], t["blk.3.attn_k.weight"], t["blk.3.attn_v.weight"],
               t["blk.3.attn_output.weight"])  # fmt: skip
        assert got == (q, k, v, o), quant
        assert [t[f"blk.{i}.ffn_down_exps.weight"] for i in range(6)] == down, quant
        assert t["output.weight"] == out and t["blk.0.attn_norm.weight"] == "F32", quant
    tied = _mix(demo, "Q4_K_M", tied=True)
    assert tied["token_embd.weight"] == "Q6_K"  # tied: quantized as the output


def test_fallback_rule() -> None:
    from moestream.weights.mixes import fallback_qtype

    cases = [
        (Q.Q2_K, 96, Q.Q4_0), (Q.Q3_K, 64, Q.Q4_0), (Q.Q4_K, 64, Q.Q5_0), (Q.Q5_K, 32, Q.Q5_1),
        (Q.Q6_K, 128, Q.Q8_0), (Q.Q4_K, 48, Q.F16), (Q.Q8_0, 48, Q.F16), (Q.Q4_K, 512, Q.Q4_K),
        (Q.F32, 7, Q.F32), (Q.BF16, 3, Q.BF16),
    ]  # fmt: skip
    for qtype, n, expected in cases:
        assert fallback_qtype(qtype, n) == expected, (qtype, n)

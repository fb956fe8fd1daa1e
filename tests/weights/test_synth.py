"""`moestream synth`: presets, llama.cpp quant mixes, file size, and files written and read back."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, quants

from moestream.config import ModelConfig
from moestream.errors import RequestError, UnsupportedError
from moestream.weights.model_shapes import KNOWN_MODELS, PRESETS, model_preset
from moestream.weights.synth import (
    SYNTH_QUANTS,
    synth_bpe_vocab,
    synth_gguf,
    synth_plan,
    synth_tokenizer_metadata,
)

Q = GGMLQuantizationType
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SHARED_TINY = Path(__file__).resolve().parents[3] / "shared" / "models" / "tiny-qwen3-moe"

# Hugging Face config.json fields of the real models (Qwen/Qwen3-30B-A3B etc.), written out here
# so that a wrong preset fails this test rather than being compared with itself.
HF_CONFIGS = {
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", num_hidden_layers=48, hidden_size=2048,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, vocab_size=151936, rope_theta=1e6,
                          rms_norm_eps=1e-6, max_position_embeddings=40960,
                          tie_word_embeddings=False),
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", num_hidden_layers=94, hidden_size=4096,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                            intermediate_size=12288, moe_intermediate_size=1536, num_experts=128,
                            num_experts_per_tok=8, vocab_size=151936, rope_theta=1e6,
                            rms_norm_eps=1e-6, max_position_embeddings=40960,
                            tie_word_embeddings=False),
    "qwen3-8b": dict(model_type="qwen3", num_hidden_layers=36, hidden_size=4096,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     intermediate_size=12288, vocab_size=151936, rope_theta=1e6,
                     rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False),
    "qwen3-0.6b": dict(model_type="qwen3", num_hidden_layers=28, hidden_size=1024,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       intermediate_size=3072, vocab_size=151936, rope_theta=1e6,
                       rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=True),
    "tiny-qwen3-moe": dict(model_type="qwen3_moe", num_hidden_layers=6, hidden_size=512,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                           intermediate_size=1024, moe_intermediate_size=256, num_experts=8,
                           num_experts_per_tok=2, vocab_size=4096, rope_theta=1e6,
                           rms_norm_eps=1e-6, max_position_embeddings=4096,
                           tie_word_embeddings=False),
}  # fmt: skip


def _same_hparams(a: ModelConfig, b: ModelConfig) -> bool:
    return a.replace(name="") == b.replace(name="")


@pytest.mark.parametrize("like", KNOWN_MODELS)
def test_preset_matches_hf_config(like: str) -> None:
    assert _same_hparams(PRESETS[like], ModelConfig.from_hf_config(HF_CONFIGS[like]))


@pytest.mark.skipif(not (SHARED_TINY / "config.json").is_file(), reason="no shared models")
def test_tiny_preset_matches_shared_model() -> None:
    cfg = json.loads((SHARED_TINY / "config.json").read_text())
    assert _same_hparams(PRESETS["tiny-qwen3-moe"], ModelConfig.from_hf_config(cfg))


def _expected_tensors(cfg: dict, n_layers: int, n_experts: int | None) -> dict[str, tuple]:
    """llama.cpp names and torch-order shapes, written from the HF fields."""
    h, v, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        out["output.weight"] = (v, h)
    for i in range(n_layers):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": (h,), b + "ffn_norm.weight": (h,),
                b + "attn_q.weight": (q, h), b + "attn_k.weight": (kv, h),
                b + "attn_v.weight": (kv, h), b + "attn_output.weight": (h, q),
                b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)}  # fmt: skip
        if cfg["model_type"] == "qwen3_moe":
            e, f = n_experts, cfg["moe_intermediate_size"]
            out |= {b + "ffn_gate_inp.weight": (e, h), b + "ffn_gate_exps.weight": (e, f, h),
                    b + "ffn_up_exps.weight": (e, f, h),
                    b + "ffn_down_exps.weight": (e, h, f)}  # fmt: skip
        else:
            f = cfg["intermediate_size"]
            out |= {b + "ffn_gate.weight": (f, h), b + "ffn_up.weight": (f, h),
                    b + "ffn_down.weight": (h, f)}  # fmt: skip
    return out


def _small(like: str) -> dict:
    return {"n_layers": 2, "n_experts": 4 if PRESETS[like].is_moe else None}


@pytest.mark.parametrize("like", KNOWN_MODELS)
def test_plan_names_and_shapes(like: str) -> None:
    _, plan = synth_plan(like, "Q4_K_M", **_small(like))
    expected = _expected_tensors(HF_CONFIGS[like], 2, _small(like)["n_experts"])
    assert {t.name: t.shape for t in plan} == expected


def _types(like: str, quant: str, **kw) -> dict[str, Q]:
    return {t.name: t.qtype for t in synth_plan(like, quant, **kw)[1]}


def test_q4_k_m_follows_llama_cpp_use_more_bits() -> None:
    # use_more_bits(i, 48): i < 6, i >= 42, or (i - 6) % 3 == 2
    more_30b = [*range(6), *range(8, 42, 3), *range(42, 48)]
    types = _types("qwen3-30b-a3b", "Q4_K_M")
    for kind in ("attn_v", "ffn_down_exps"):
        assert [i for i in range(48) if types[f"blk.{i}.{kind}.weight"] == Q.Q6_K] == more_30b
        assert {types[f"blk.{i}.{kind}.weight"] for i in range(48) if i not in more_30b} == {Q.Q4_K}
    assert types["output.weight"] == Q.Q6_K and types["token_embd.weight"] == Q.Q4_K
    for i in range(48):
        for kind in ("attn_q", "attn_k", "attn_output", "ffn_gate_exps", "ffn_up_exps"):
            assert types[f"blk.{i}.{kind}.weight"] == Q.Q4_K
        for kind in ("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm", "ffn_gate_inp"):
            assert types[f"blk.{i}.{kind}.weight"] == Q.F32
    # dense 36 layers: i < 4, i >= 31, or (i - 4) % 3 == 2
    more_8b = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34, 35]
    types = _types("qwen3-8b", "Q4_K_M")
    assert [i for i in range(36) if types[f"blk.{i}.ffn_down.weight"] == Q.Q6_K] == more_8b
    assert [i for i in range(36) if types[f"blk.{i}.attn_v.weight"] == Q.Q6_K] == more_8b
    assert types["blk.6.ffn_up.weight"] == Q.Q4_K
    # tied embeddings take the output's type; 8 experts bump attn_k/v to Q8_0, attn_output Q5_K
    assert _types("qwen3-0.6b", "Q4_K_M")["token_embd.weight"] == Q.Q6_K
    tiny = _types("tiny-qwen3-moe", "Q4_K_M")
    assert tiny["blk.3.attn_v.weight"] == tiny["blk.3.attn_k.weight"] == Q.Q8_0
    assert tiny["blk.3.attn_output.weight"] == Q.Q5_K
    four = _types("tiny-qwen3-moe", "Q4_K_M", n_experts=4)  # 6 layers: more bits for 2 and 5
    assert [four[f"blk.{i}.attn_v.weight"] for i in (1, 2, 5)] == [Q.Q4_K, Q.Q6_K, Q.Q6_K]


def test_other_mixes() -> None:
    q2 = _types("qwen3-30b-a3b", "Q2_K")
    assert q2["blk.7.ffn_gate_exps.weight"] == q2["blk.7.attn_q.weight"] == Q.Q2_K
    assert q2["blk.7.ffn_down_exps.weight"] == q2["blk.7.attn_output.weight"] == Q.Q3_K
    assert q2["blk.7.attn_v.weight"] == Q.Q4_K  # GQA 8
    assert q2["output.weight"] == Q.Q6_K and q2["token_embd.weight"] == Q.Q2_K
    assert _types("qwen3-0.6b", "Q2_K")["blk.0.attn_v.weight"] == Q.Q3_K  # GQA 2
    pure = _types("qwen3-30b-a3b", "Q4_K", n_layers=2)
    assert {t for n, t in pure.items() if not n.endswith(("norm.weight", "gate_inp.weight"))} == {
        Q.Q4_K
    }
    q40 = _types("qwen3-30b-a3b", "Q4_0", n_layers=2)
    assert q40["output.weight"] == Q.Q6_K
    assert q40["blk.1.ffn_down_exps.weight"] == q40["blk.0.attn_v.weight"] == Q.Q4_0
    for quant, qtype in (("Q8_0", Q.Q8_0), ("F16", Q.F16), ("BF16", Q.BF16)):
        mix = _types("qwen3-30b-a3b", quant, n_layers=2)
        assert {mix["output.weight"], mix["blk.1.ffn_down_exps.weight"]} == {qtype}
    q6 = _types("qwen3-30b-a3b", "Q6_K", n_layers=2)
    assert {q6["output.weight"], q6["blk.0.attn_v.weight"], q6["blk.1.ffn_up_exps.weight"]} == {
        Q.Q6_K
    }


def test_size_of_qwen3_30b_a3b_q4_k_m() -> None:
    total = sum(t.nbytes for t in synth_plan("qwen3-30b-a3b", "Q4_K_M")[1])
    # by hand: Q4_K 4.5 bits (144 B / 256), Q6_K 6.5625 bits (210 B / 256), F32 4 B
    q4, q6 = 144 / 256, 210 / 256
    h, v, e, f = 2048, 151936, 128, 768
    attn_qo = 2 * 4096 * h
    kv = 512 * h
    per_layer_q4 = attn_qo + kv + 2 * e * f * h  # q, o, k, gate_exps, up_exps
    big = 24  # layers with Q6_K attn_v and ffn_down_exps
    layers = 48 * per_layer_q4 * q4 + big * (kv + e * h * f) * q6 + 24 * (kv + e * h * f) * q4
    norms = 48 * (2 * h + 2 * 128 + e * h) * 4 + h * 4
    expected = v * h * q4 + v * h * q6 + layers + norms
    assert total == expected
    assert abs(total / 2**30 - 17.28) < 0.005  # ANCHORS.md: 17.28 GiB


def test_bad_arguments() -> None:
    with pytest.raises(RequestError, match="unknown model"):
        synth_plan("qwen9-1t", "Q4_K_M")
    with pytest.raises(UnsupportedError, match="quant"):
        synth_plan("qwen3-8b", "Q3_K_XL")
    with pytest.raises(RequestError, match="dense"):
        model_preset("qwen3-8b", n_experts=4)
    with pytest.raises(RequestError, match="n_layers"):
        model_preset("qwen3-8b", n_layers=0)


@pytest.mark.parametrize("vocab_size", [300, 151936])
def test_synth_vocab_is_valid_bpe(vocab_size: int) -> None:
    tokens, types, merges = synth_bpe_vocab(vocab_size)
    assert len(tokens) == len(types) == vocab_size == len(set(tokens))
    assert len(merges) == vocab_size - 256 - 3
    ids = {t: i for i, t in enumerate(tokens)}
    for rank, merge in enumerate(merges):
        first, second = merge.split(" ")
        assert ids[first] < 256 + rank and ids[second] < 256
        assert ids[first + second] == 256 + rank
    assert tokens[-3:] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert types[-3:] == [3, 3, 3] and set(types[:-3]) == {1}


def test_synth_tokenizer_loads_in_moestream() -> None:
    from moestream.tokenizer import Tokenizer

    meta = synth_tokenizer_metadata(151936)
    tok = Tokenizer.from_gguf_metadata(meta, source="synth")
    text = "def main():\n    print('Hello, wörld! 123')  # 漢字\n"
    ids = tok.encode(text)
    assert ids and max(ids) < 151936 - 3 and tok.decode(ids) == text
    assert tok.eos_token_id == 151935 and tok.token_to_id("<|im_start|>") == 151934
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")


# ---- files written and read back -------------------------------------------------------------
def _meta(reader: GGUFReader, key: str):
    field = reader.fields[key]
    return field.contents()


def _check_file(path: Path, like: str, quant: str, n_layers: int, n_experts: int | None,
                max_rows: int = 512) -> GGUFReader:  # fmt: skip
    config, plan = synth_plan(like, quant, n_layers, n_experts)
    reader = GGUFReader(path)
    # metadata
    assert _meta(reader, "general.architecture") == config.arch
    assert _meta(reader, "general.name") == config.name
    assert _meta(reader, "general.file_type") == {"Q4_K_M": 15, "Q4_K": 15, "Q6_K": 18,
        "Q2_K": 10, "Q8_0": 7, "Q4_0": 2, "F16": 1, "BF16": 32}[quant]  # fmt: skip
    assert _meta(reader, "general.quantization_version") == 2
    assert _meta(reader, "general.alignment") == 32
    for key, value in config.to_gguf_metadata().items():
        assert _meta(reader, key) == pytest.approx(value), key
    assert _meta(reader, "tokenizer.ggml.model") == "gpt2"
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == config.vocab_size
    assert len(reader.fields["tokenizer.ggml.merges"].data) > 0
    # tensors: names, shapes, types as planned; GGUF `ne` is torch order reversed
    expected = _expected_tensors(HF_CONFIGS[like], n_layers, n_experts)
    assert [t.name for t in reader.tensors] == [t.name for t in plan]
    for t, p in zip(reader.tensors, plan, strict=True):
        assert tuple(int(x) for x in t.shape[::-1]) == expected[t.name] == p.shape, t.name
        assert t.tensor_type == p.qtype, t.name
        assert t.n_bytes == p.nbytes, t.name
        # values: rows sampled from the start and end of big tensors
        data = t.data.reshape(-1, t.data.shape[-1])
        if data.shape[0] > max_rows:
            data = np.concatenate([data[: max_rows // 2], data[-max_rows // 2 :]])
        w = quants.dequantize(data, t.tensor_type)
        assert np.isfinite(w).all(), t.name
        if t.name.endswith("norm.weight"):
            assert abs(w.mean() - 1.0) < 0.01 and w.std() < 0.05, t.name
        else:  # weight matrices, routers, embeddings
            assert 0.01 <= w.std() <= 0.04, (t.name, w.std())
            assert abs(w.mean()) < 0.1 * w.std(), (t.name, w.mean())
    # size: header + metadata + tensor infos, padded, then each tensor padded to 32 bytes
    last = reader.tensors[-1]
    assert reader.data_offset % 32 == 0
    assert path.stat().st_size == last.data_offset + -(-last.n_bytes // 32) * 32
    assert path.stat().st_size == reader.data_offset + sum(-(-p.nbytes // 32) * 32 for p in plan)
    return reader


@pytest.mark.parametrize("quant", SYNTH_QUANTS)
def test_tiny_file_reads_back(tmp_path: Path, quant: str) -> None:
    path = synth_gguf(
        "tiny-qwen3-moe", quant, tmp_path / "m.gguf", progress=False, **_small("tiny-qwen3-moe")
    )
    assert path == tmp_path / "m.gguf" and not (tmp_path / "m.gguf.part").exists()
    _check_file(path, "tiny-qwen3-moe", quant, 2, 4)


def test_tiny_default_loads_in_moestream(tmp_path: Path) -> None:
    from moestream.weights.loader import open_model

    path = synth_gguf("tiny-qwen3-moe", "Q4_K_M", tmp_path / "tiny.gguf", progress=False)
    reader = _check_file(path, "tiny-qwen3-moe", "Q4_K_M", 6, 8)
    counts = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    assert counts == {"Q4_K": 23, "Q6_K": 3, "Q8_0": 12, "Q5_K": 6, "F32": 31}
    source = open_model(path)
    loaded = source.config  # f32 metadata: eps 1e-6 reads back as 9.99999997e-07
    assert loaded.rms_eps == pytest.approx(1e-6) and loaded.rotary_dim == loaded.head_dim
    assert _same_hparams(loaded.replace(rms_eps=1e-6, rope_dim=0), PRESETS["tiny-qwen3-moe"])
    # the real tokenizer of the trained tiny model (tests/fixtures), not a synthesized one
    fixture = json.loads((FIXTURES / "tokenizer.json").read_text())
    assert _meta(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert len(reader.fields["tokenizer.ggml.merges"].data) == len(fixture["model"]["merges"])
    tok = source.tokenizer()
    assert tok.decode(tok.encode("import os\nprint(os.sep)\n")) == "import os\nprint(os.sep)\n"
    experts = source.tensors["blk.0.ffn_gate_exps.weight"]
    assert not np.array_equal(experts[0].data.numpy(), experts[1].data.numpy())


def test_same_seed_same_file(tmp_path: Path) -> None:
    def digest(name: str, seed: int) -> str:
        path = synth_gguf("tiny-qwen3-moe", "Q2_K", tmp_path / name, seed=seed, progress=False,
                          n_layers=1)  # fmt: skip
        return hashlib.sha256(path.read_bytes()).hexdigest()

    assert digest("a.gguf", 0) == digest("b.gguf", 0) != digest("c.gguf", 1)


@pytest.mark.slow
@pytest.mark.parametrize("like", [m for m in KNOWN_MODELS if m != "tiny-qwen3-moe"])
def test_real_shape_file_reads_back(tmp_path: Path, like: str) -> None:
    """~0.2-1 GB each (full vocabulary); GGUFReader takes seconds on 150k-token vocabularies."""
    small = _small(like)
    path = synth_gguf(like, "Q4_K_M", tmp_path / "m.gguf", progress=False, **small)
    reader = _check_file(path, like, "Q4_K_M", 2, small["n_experts"], max_rows=128)
    expected = synth_tokenizer_metadata(PRESETS[like].vocab_size)
    for key in ("tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"):
        assert _meta(reader, key) == expected[key]
    assert _meta(reader, "tokenizer.ggml.merges")[-1] == expected["tokenizer.ggml.merges"][-1]

"""Tokenizer from tokenizer.json and from GGUF metadata, checked against `transformers`."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import Tokenizer as BackendTokenizer

from moestream.errors import ModelFormatError, UnsupportedError
from moestream.tokenizer import StreamDecoder, Tokenizer
from moestream.weights.gguf_vocab import (
    CONTROL,
    LLAMA3_PATTERN,
    NORMAL,
    QWEN2_PATTERN,
    UNUSED,
    USER_DEFINED,
    gguf_tokenizer_metadata,
    pre_tokenizer_for,
)

FIXTURES = Path(__file__).parent / "fixtures"

SAMPLES = [
    "",
    "Hello, world!",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { x[i] = i * 2; }\r\n",
    "   leading and trailing spaces   ",
    "tabs\t\tand\n\n\nnewlines \n \n",
    "numbers 1 12 123 1234 12345 3.14159 1e-9",
    "I'm sure you'll see they've said it's 'RE' and 'LL' we'D",
    "Ünïcödé façade naïve café, Привет мир, 你好世界, こんにちは, 안녕하세요, مرحبا",
    "emoji 🚀🦙 and ZWJ 👩‍👩‍👧‍👦 and flags 🇫🇷 and skin 👍🏽",
    "decomposed e\u0301 vs composed \u00e9",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "inline<|endoftext|>special <|im_end|>tokens<|im_start|>",
    "!!!???... ---=== ``` \"\"\" '''",
]


@pytest.fixture(scope="module")
def auto_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained


def assert_matches_hf(ours: Tokenizer, hf, samples=SAMPLES) -> None:
    for text in samples:
        ids = ours.encode(text)
        assert ids == hf(text).input_ids, text
        assert ours.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False
        )
        assert ours.decode(ids) == hf.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(
            ids, skip_special_tokens=True
        )


# -- the fixture tokenizer (ByteLevel pre-tokenizer, ChatML specials) ---------------------------


def test_hf_dir_matches_transformers(auto_tokenizer):
    ours = Tokenizer.from_hf_dir(FIXTURES)
    assert_matches_hf(ours, auto_tokenizer(FIXTURES))
    assert ours.vocab_size == 4096
    assert ours.token_to_id("<|im_end|>") == 2 and ours.id_to_token(2) == "<|im_end|>"
    assert ours.encode("a<|im_end|>b", add_special_tokens=False)[1] == 2  # never split


def test_gguf_metadata_matches_transformers(auto_tokenizer):
    meta = gguf_tokenizer_metadata(FIXTURES)
    ours = Tokenizer.from_gguf_metadata(meta, "fixture.gguf")
    assert_matches_hf(ours, auto_tokenizer(FIXTURES))


def test_gguf_metadata_fields():
    meta = gguf_tokenizer_metadata(FIXTURES)
    spec = json.loads((FIXTURES / "tokenizer.json").read_text())
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "gpt-2"
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 4096
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert types[:3] == [CONTROL] * 3 and set(types[3:]) == {NORMAL}
    assert all(tokens[i] == t for t, i in spec["model"]["vocab"].items())
    assert meta["tokenizer.ggml.merges"] == [" ".join(pair) for pair in spec["model"]["merges"]]
    assert meta["tokenizer.ggml.eos_token_id"] == 0
    assert meta["tokenizer.ggml.padding_token_id"] == 0
    assert "tokenizer.ggml.bos_token_id" not in meta
    assert meta["tokenizer.ggml.add_bos_token"] is False
    config = json.loads((FIXTURES / "tokenizer_config.json").read_text())
    assert meta["tokenizer.chat_template"] == config["chat_template"]


def test_vocab_holes_are_filled(tmp_path, auto_tokenizer):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / name, tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 4100}))
    meta = gguf_tokenizer_metadata(tmp_path)
    assert meta["tokenizer.ggml.tokens"][4096:] == [f"[PAD{i}]" for i in range(4096, 4100)]
    assert meta["tokenizer.ggml.token_type"][4096:] == [UNUSED] * 4
    ours = Tokenizer.from_gguf_metadata(meta, "padded.gguf")
    assert ours.vocab_size == 4100
    assert_matches_hf(ours, auto_tokenizer(tmp_path), SAMPLES[:6])


# -- a Qwen2-regex tokenizer and a Llama-3-regex tokenizer, trained on the fly -------------------

CORPUS = [
    "def main():\n    print('hello world')\n    return 0\n",
    "The quick brown fox jumps over the lazy dog; it's 2024 and we'll see 12345 tokens.",
    "Ünïcödé façade naïve café 日本語のテキスト 你好世界 🚀🦙 émoji",
    "    for i in range(10):\n        total += i * i  # squares\n\n",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
]


def train_tiny(pattern: str, normalizer, ignore_merges: bool, specials: list[str]):
    backend = BackendTokenizer(models.BPE(ignore_merges=ignore_merges))
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 5, trainer)
    return backend


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen2tok")
    backend = train_tiny(
        QWEN2_PATTERN, normalizers.NFC(), False, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    )
    # Qwen's tool-call markers are added tokens that are not special
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in
                        ("<tool_call>", "</tool_call>")])  # fmt: skip
    backend.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return path


def test_qwen2_pre_detected_and_round_trips(qwen2_dir, auto_tokenizer):
    meta = gguf_tokenizer_metadata(qwen2_dir)
    assert meta["tokenizer.ggml.pre"] == "qwen2"
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert types[tokens.index("<|im_end|>")] == CONTROL
    assert types[tokens.index("<tool_call>")] == USER_DEFINED
    hf = auto_tokenizer(qwen2_dir)
    samples = [*SAMPLES, *CORPUS]
    assert_matches_hf(Tokenizer.from_hf_dir(qwen2_dir), hf, samples)
    from_gguf = Tokenizer.from_gguf_metadata(meta, "qwen2.gguf")
    assert_matches_hf(from_gguf, hf, samples)
    # Qwen2 splits digits one by one, the GPT-2 regex keeps runs together
    pieces = pre_tokenizer_for("qwen2").pre_tokenize_str("x 2024")
    assert [p for p, _ in pieces] == ["x", "Ġ", "2", "0", "2", "4"]


def test_qwen2_eos_ids_from_generation_config(qwen2_dir):
    ours = Tokenizer.from_hf_dir(qwen2_dir)
    assert ours.eos_token_id == 2 and ours.bos_token_id is None
    assert ours.eos_token_ids == {0, 2}


def test_llama3_pre_detected_with_bos(tmp_path, auto_tokenizer):
    backend = train_tiny(LLAMA3_PATTERN, None, True, ["<|begin_of_text|>", "<|eot_id|>"])
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": False}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    meta = gguf_tokenizer_metadata(tmp_path)
    assert meta["tokenizer.ggml.pre"] == "llama-bpe"
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert meta["tokenizer.ggml.bos_token_id"] == 0
    hf = auto_tokenizer(tmp_path)
    assert_matches_hf(Tokenizer.from_hf_dir(tmp_path), hf, SAMPLES[1:])
    assert_matches_hf(Tokenizer.from_gguf_metadata(meta, "llama3.gguf"), hf, SAMPLES[1:])
    assert Tokenizer.from_hf_dir(tmp_path).encode("x")[0] == 0
    # llama.cpp adds BOS for llama-bpe when the file has no add_bos_token key
    del meta["tokenizer.ggml.add_bos_token"]
    assert Tokenizer.from_gguf_metadata(meta, "llama3.gguf").add_bos


def test_default_pre_splits_like_llama_cpp():
    pieces = [p for p, _ in pre_tokenizer_for("default").pre_tokenize_str("hello, world 1234567")]
    assert pieces == ["hello", ",", "Ġworld", "Ġ", "123", "456", "7"]


# -- metadata handling and errors ---------------------------------------------------------------


def test_add_bos_and_eot_from_metadata():
    meta = gguf_tokenizer_metadata(FIXTURES)
    plain = Tokenizer.from_gguf_metadata(meta, "f.gguf")
    meta |= {"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.add_bos_token": True}
    meta |= {"tokenizer.ggml.eot_token_id": 5}
    ours = Tokenizer.from_gguf_metadata(meta, "f.gguf")
    assert ours.encode("hi") == [1, *plain.encode("hi")]
    assert ours.encode("hi", add_special_tokens=False) == plain.encode("hi")
    assert ours.eos_token_ids == {0, 2, 5}


def test_eos_ids_follow_the_template_end_token():
    meta = gguf_tokenizer_metadata(FIXTURES)
    assert Tokenizer.from_gguf_metadata(meta, "f.gguf").eos_token_ids == {0, 2}
    meta["tokenizer.chat_template"] = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    assert Tokenizer.from_gguf_metadata(meta, "f.gguf").eos_token_ids == {0}
    del meta["tokenizer.chat_template"]
    assert Tokenizer.from_gguf_metadata(meta, "f.gguf").eos_token_ids == {0}


def test_metadata_errors():
    meta = gguf_tokenizer_metadata(FIXTURES)
    with pytest.raises(UnsupportedError, match="tokenizer.ggml.pre 'tekken'"):
        Tokenizer.from_gguf_metadata(meta | {"tokenizer.ggml.pre": "tekken"}, "m.gguf")
    with pytest.raises(UnsupportedError, match="tokenizer.ggml.model 'llama'"):
        Tokenizer.from_gguf_metadata(meta | {"tokenizer.ggml.model": "llama"}, "m.gguf")
    with pytest.raises(
        ModelFormatError, match=r"m.gguf: no tokenizer in metadata \(tokenizer.ggml.tokens missing"
    ):
        Tokenizer.from_gguf_metadata({"general.architecture": "qwen3moe"}, "m.gguf")
    broken = meta | {"tokenizer.ggml.merges": ["Ġ Ġ", "nosuch token"]}
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf_metadata(broken, "m.gguf")
    short = meta | {"tokenizer.ggml.token_type": [1, 1]}
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.token_type"):
        Tokenizer.from_gguf_metadata(short, "m.gguf")
    with pytest.raises(ModelFormatError, match="eos token id 99999"):
        Tokenizer.from_gguf_metadata(meta | {"tokenizer.ggml.eos_token_id": 99999}, "m.gguf")


def test_hf_dir_errors(tmp_path):
    with pytest.raises(ModelFormatError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(ModelFormatError, match="no tokenizer.json"):
        gguf_tokenizer_metadata(tmp_path)
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.ByteLevel()
    backend.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UnsupportedError, match="pre_tokenizer"):
        gguf_tokenizer_metadata(tmp_path)


# -- incremental detokenization -----------------------------------------------------------------


def test_stream_decoder_holds_split_characters():
    tok = Tokenizer.from_hf_dir(FIXTURES)
    text = "naïve 日本語 🚀🦙 👩‍👧 <|im_end|> done"
    ids = tok.encode(text)
    decoder = StreamDecoder(tok)
    deltas = [decoder.feed(i) for i in ids]
    assert "".join(deltas) + decoder.finish() == text
    assert all("\ufffd" not in d for d in deltas)
    # the tiny vocabulary splits the CJK and emoji characters into byte tokens
    assert "" in deltas and any(len(d.encode()) == 4 for d in deltas)
    assert len(ids) > len(deltas) - deltas.count("")


def test_stream_decoder_skip_special_and_truncated_tail():
    tok = Tokenizer.from_hf_dir(FIXTURES)
    ids = tok.encode("<|im_start|>hi🚀<|im_end|>")
    decoder = StreamDecoder(tok, skip_special_tokens=True)
    assert "".join(decoder.feed(i) for i in ids) + decoder.finish() == "hi🚀"
    rocket = tok.encode("🚀")
    assert len(rocket) > 1
    decoder = StreamDecoder(tok)
    assert decoder.feed(rocket[0]) == ""
    assert decoder.finish() == "\ufffd" == tok.decode(rocket[:1])


def test_stream_decoder_equals_decode_on_random_ids():
    tok = Tokenizer.from_hf_dir(FIXTURES)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))]
        decoder = StreamDecoder(tok)
        assert "".join(decoder.feed(i) for i in ids) + decoder.finish() == tok.decode(ids)

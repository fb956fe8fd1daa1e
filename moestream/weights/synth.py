"""`synth`: a GGUF with a real model's exact tensors and metadata, filled with random quantized
blocks, written at disk speed. Benchmarks of real-size models use these files (no real weights
can be downloaded here); speed does not depend on weight values.

Nothing is quantized: for each GGML type one pool of random blocks is generated once (payload
bits uniform; the block scales chosen so that dequantized weights are centred near 0 with a
standard deviation of about 0.02), and every tensor is written as windows of that pool starting
at random block offsets, so experts differ from each other while the writer only copies memory.

Quant mixes are `moestream.weights.mixes` (llama.cpp's `llama-quantize` rules, applied to the
tensors `convert_hf_to_gguf.py` writes; norms and the router stay F32); for the presets:
- Q4_K_M (ftype 15): Q4_K; Q6_K on attn_v and ffn_down(_exps) of layers where `use_more_bits`
  holds, and on output (and on token_embd when embeddings are tied).
- Q2_K (ftype 10): Q2_K; attn_v Q4_K (GQA ratio >= 4) or Q3_K; ffn_down(_exps) and attn_output
  Q3_K; output Q6_K.
- Q6_K (ftype 18), Q8_0 (ftype 7): that type everywhere (output Q6_K / Q8_0).
- Q4_K: every matrix Q4_K, output and embeddings included, as `llama-quantize --pure ... Q4_K_M`
  writes it (so general.file_type is 15 as there).
- F16 (ftype 1), BF16 (ftype 32): every matrix in that type, as convert's --outtype writes it.
As in llama.cpp, a model with exactly 8 experts gets Q8_0 attn_k/attn_v (and Q5_K attn_output
in Q2_K and Q4_K_M): that applies to tiny-qwen3-moe.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGML_QUANT_VERSION,
    GGMLQuantizationType,
    GGUFWriter,
    Keys,
    LlamaFileType,
    SpecialVocab,
    TokenType,
)
from gguf.vocab import bytes_to_unicode
from tqdm import tqdm

from moestream.config import ModelConfig
from moestream.errors import ModelFormatError, UnsupportedError
from moestream.weights.layout import expected_shapes, tensor_kind
from moestream.weights.mixes import get_mix, is_quantizable, tensor_qtypes
from moestream.weights.model_shapes import KNOWN_MODELS, model_preset

__all__ = [
    "KNOWN_MODELS",
    "SYNTH_QUANTS",
    "SynthTensor",
    "random_blocks",
    "synth_bpe_vocab",
    "synth_gguf",
    "synth_plan",
    "synth_tokenizer_metadata",
]

Q = GGMLQuantizationType
SYNTH_QUANTS = ("Q4_K_M", "Q4_K", "Q6_K", "Q2_K", "Q8_0", "Q4_0", "F16", "BF16")
WEIGHT_STD = 0.02
POOL_BYTES = 32 << 20  # random blocks generated once per type; tensors are windows of it
ALIGNMENT = 32
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class SynthTensor:
    name: str
    shape: tuple[int, ...]  # torch order
    qtype: GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        block, block_bytes = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block * block_bytes


def synth_plan(
    like: str, quant: str, n_layers: int | None = None, n_experts: int | None = None
) -> tuple[ModelConfig, list[SynthTensor]]:
    """The model config and every tensor (name, shape, type) of the file `synth_gguf` writes."""
    if quant not in SYNTH_QUANTS:
        raise UnsupportedError(
            f"unknown synth quant mix {quant!r} (known: {', '.join(SYNTH_QUANTS)})"
        )
    config = model_preset(like, n_layers, n_experts)
    shapes = expected_shapes(config)
    if quant == "Q4_K":  # llama-quantize --pure: every quantizable matrix in the base type
        types = {n: Q.Q4_K if is_quantizable(n, s) else Q.F32 for n, s in shapes.items()}
    else:
        types = tensor_qtypes(config, shapes, quant)
    return config, [SynthTensor(name, shape, types[name]) for name, shape in shapes.items()]


# ---- random blocks ---------------------------------------------------------------------------
def _f16(x: np.ndarray) -> np.ndarray:
    """[n] values -> [n, 2] little-endian float16 bytes."""
    return x.astype("<f2").view(np.uint8).reshape(-1, 2)


def _pack_k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 8 six-bit scales and 8 six-bit mins per block [n, 8] -> 12 bytes [n, 12]."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _pack_q3_scales(e: np.ndarray) -> np.ndarray:
    """Q3_K: 16 six-bit scales (value = e - 32) [n, 16] -> 12 bytes [n, 12]."""
    low, high = e & 15, e >> 4
    out = np.empty((e.shape[0], 12), np.uint8)
    out[:, 0:8] = low[:, :8] | (low[:, 8:] << 4)
    out[:, 8:12] = high[:, 0:4] | (high[:, 4:8] << 2) | (high[:, 8:12] << 4) | (high[:, 12:] << 6)
    return out


def random_blocks(
    qtype: GGMLQuantizationType, n_blocks: int, rng: np.random.Generator
) -> np.ndarray:
    """`n_blocks` random blocks of `qtype`, uint8 [n_blocks, block_bytes]: payload bits uniform,
    scales such that the values have mean ~0 and std ~WEIGHT_STD (float types: normal values)."""
    block, nb = GGML_QUANT_SIZES[qtype]
    n = n_blocks
    if qtype in (Q.F32, Q.F16):
        vals = rng.normal(0.0, WEIGHT_STD, n).astype("<f4" if qtype == Q.F32 else "<f2")
        return vals.view(np.uint8).reshape(n, nb)
    if qtype == Q.BF16:
        bits = rng.normal(0.0, WEIGHT_STD, n).astype("<f4").view("<u4")
        return ((bits + 0x8000) >> 16).astype("<u2").view(np.uint8).reshape(n, nb)
    b = np.frombuffer(bytearray(rng.bytes(n * nb)), np.uint8).reshape(n, nb)
    jitter = rng.uniform(0.85, 1.15, n)
    # std of the integer codes: uniform over 2^bits levels -> sqrt((4^bits - 1) / 12)
    if qtype == Q.Q8_0:  # d; qs int8
        b[:, 0:2] = _f16(WEIGHT_STD / 73.9 * jitter)
    elif qtype == Q.Q4_0:  # d; qs[16]: 32 nibbles, values (q - 8) * d
        q = rng.integers(1, 16, (n, 32), dtype=np.uint8)  # codes -7..7: mean 0 (8 - 8 too)
        b[:, 2:18] = q[:, :16] | (q[:, 16:] << 4)
        b[:, 0:2] = _f16(WEIGHT_STD / np.sqrt(224 / 12) * jitter)
    elif qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin, scales[12], (qh[32]), qs[128]
        bits, lo, hi = (4, 32, 64) if qtype == Q.Q4_K else (5, 16, 32)
        q_mean, q_std = (2**bits - 1) / 2, np.sqrt((4**bits - 1) / 12)
        sc = rng.integers(lo, hi, (n, 8), dtype=np.uint8)
        d = WEIGHT_STD / (q_std * (lo + hi - 1) / 2) * jitter
        # mins equal to the scales with dmin = q_mean * d put every sub-block's centre at 0
        b[:, 0:2] = _f16(d)
        b[:, 2:4] = _f16(q_mean * d)
        b[:, 4:16] = _pack_k4_scales(sc, sc)
    elif qtype == Q.Q6_K:  # ql[128], qh[64], scales int8[16], d
        sc = rng.integers(8, 16, (n, 16)) * rng.choice(np.array([-1, 1]), (n, 16))
        b[:, 192:208] = sc.astype(np.int8).view(np.uint8)
        b[:, 208:210] = _f16(WEIGHT_STD / (np.sqrt(4095 / 12) * 11.5) * jitter)
    elif qtype == Q.Q3_K:  # hmask[32], qs[64], scales[12], d
        v = rng.integers(12, 32, (n, 16)) * rng.choice(np.array([-1, 1]), (n, 16))
        b[:, 96:108] = _pack_q3_scales((v + 32).astype(np.uint8))
        b[:, 108:110] = _f16(WEIGHT_STD / (np.sqrt(63 / 12) * 21.5) * jitter)
    elif qtype == Q.Q2_K:  # scales[16] (scale | min << 4), qs[64], d, dmin
        sc = rng.integers(8, 16, (n, 16), dtype=np.uint8)
        d = WEIGHT_STD / (np.sqrt(15 / 12) * 11.5) * jitter
        b[:, 0:16] = sc | (sc << 4)
        b[:, 80:82] = _f16(d)
        b[:, 82:84] = _f16(1.5 * d)
    else:
        raise UnsupportedError(f"synth cannot generate {qtype.name} blocks")
    return b


def _fixed_tensor(t: SynthTensor, rng: np.random.Generator) -> np.ndarray:
    """F32 norms (around 1.0) and routers (std WEIGHT_STD), generated whole."""
    if tensor_kind(t.name).endswith("_norm"):
        return (1.0 + rng.normal(0.0, WEIGHT_STD, t.shape)).astype("<f4")
    return rng.normal(0.0, WEIGHT_STD, t.shape).astype("<f4")


# ---- tokenizer -------------------------------------------------------------------------------
def synth_bpe_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """A valid byte-level BPE vocabulary of exactly `vocab_size` tokens: (tokens, token types,
    merges). Ids 0..255 are the 256 byte tokens (GPT-2 order), then tokens made by merges of two
    existing tokens (letters first), then <|endoftext|>, <|im_start|>, <|im_end|> last."""
    n_regular = vocab_size - len(SPECIAL_TOKENS)
    byte_tokens = list(bytes_to_unicode().values())
    if n_regular < len(byte_tokens):
        raise UnsupportedError(
            f"a byte-level vocabulary needs at least 259 tokens, not {vocab_size}"
        )
    # merge order: ASCII letters, then the space marker, digits, then everything else
    rank = {
        c: (0 if c.isascii() and c.isalpha() else 1 if c == "Ġ" else 2 if c.isdigit() else 3)
        for c in byte_tokens
    }
    chars = sorted(byte_tokens, key=lambda c: rank[c])
    tokens, merges = list(byte_tokens), []
    for first, second in islice(_merge_pairs(chars), n_regular - len(byte_tokens)):
        tokens.append(first + second)
        merges.append(f"{first} {second}")
    types = [int(TokenType.NORMAL)] * n_regular + [int(TokenType.CONTROL)] * len(SPECIAL_TOKENS)
    return tokens + list(SPECIAL_TOKENS), types, merges


def _merge_pairs(chars: list[str]) -> Iterator[tuple[str, str]]:
    """(existing token, byte) pairs whose concatenations are all distinct: every byte pair, then
    every byte pair + byte, and so on."""
    level = chars
    while True:
        longer = []
        for first in level:
            for second in chars:
                longer.append(first + second)
                yield first, second
        level = longer


def synth_tokenizer_metadata(vocab_size: int) -> dict[str, Any]:
    """GGUF tokenizer metadata of `synth_bpe_vocab(vocab_size)` as Qwen files carry it: gpt2 BPE
    with the qwen2 pre-tokenizer, BOS = PAD = <|endoftext|> (not added), EOS = <|im_end|>,
    a ChatML chat template."""
    tokens, types, merges = synth_bpe_vocab(vocab_size)
    endoftext, im_end = tokens.index(SPECIAL_TOKENS[0]), tokens.index(SPECIAL_TOKENS[2])
    t = Keys.Tokenizer
    return {
        t.MODEL: "gpt2",
        t.PRE: "qwen2",
        t.LIST: tokens,
        t.TOKEN_TYPE: types,
        t.MERGES: merges,
        t.BOS_ID: endoftext,
        t.EOS_ID: im_end,
        t.PAD_ID: endoftext,
        t.ADD_BOS: False,
        t.CHAT_TEMPLATE: CHATML_TEMPLATE,
    }


def _add_hf_tokenizer(writer: GGUFWriter, tokenizer_dir: Path, vocab_size: int) -> None:
    """The BPE tokenizer of a Hugging Face folder (tokenizer.json, tokenizer_config.json), padded
    with [PADn] tokens to `vocab_size` as llama.cpp's convert does."""
    path = tokenizer_dir / "tokenizer.json"
    try:
        tok = json.loads(path.read_text(encoding="utf-8"))
        model = tok["model"]
        if model["type"] != "BPE":
            raise ModelFormatError(f"{path}: model.type is {model['type']!r}, synth needs BPE")
        entries = {int(i): (text, TokenType.NORMAL) for text, i in model["vocab"].items()}
        for t in tok.get("added_tokens", []):
            kind = TokenType.CONTROL if t.get("special") else TokenType.USER_DEFINED
            entries[int(t["id"])] = (t["content"], kind)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelFormatError(f"{path}: cannot read the tokenizer ({e})") from None
    if max(entries) >= vocab_size:
        raise ModelFormatError(
            f"{path}: token id {max(entries)} is outside the vocabulary of {vocab_size}"
        )
    tokens, types = [], []
    for i in range(vocab_size):
        text, kind = entries.get(i, (f"[PAD{i}]", TokenType.UNUSED))
        tokens.append(text)
        types.append(int(kind))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=vocab_size).add_to_gguf(
        writer, quiet=True
    )


def _default_tokenizer_dir(like: str) -> Path | None:
    """tiny-qwen3-moe's real tokenizer, where this checkout has it (tests/fixtures)."""
    if like != "tiny-qwen3-moe":
        return None
    fixtures = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
    return fixtures if (fixtures / "tokenizer.json").is_file() else None


# ---- writer ----------------------------------------------------------------------------------
def _add_metadata(writer: GGUFWriter, config: ModelConfig, quant: str, seed: int) -> None:
    writer.add_type("model")
    writer.add_name(config.name)
    writer.add_description(
        f"synthetic random weights ({quant}, seed {seed}) written by moestream synth; "
        "not a trained model"
    )
    ftype = LlamaFileType.MOSTLY_Q4_K_M if quant == "Q4_K" else get_mix(quant).ftype
    writer.add_file_type(int(ftype))
    writer.add_quantization_version(GGML_QUANT_VERSION)
    writer.add_custom_alignment(ALIGNMENT)
    for key, value in config.to_gguf_metadata().items():
        _add_kv(writer, key, value)


def _add_kv(writer: GGUFWriter, key: str, value: Any) -> None:
    """Typed as llama.cpp's convert writes them: ints u32, floats f32, lists of str or i32."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        writer.add_string(key, str(value))


def synth_gguf(
    like: str,
    quant: str,
    out_path: str | Path,
    n_layers: int | None = None,
    n_experts: int | None = None,
    seed: int = 0,
    progress: bool = True,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write a GGUF shaped like model `like` (one of KNOWN_MODELS) in quant mix `quant` (one of
    SYNTH_QUANTS) to `out_path` and return that path. `n_layers`/`n_experts` cut the model down.
    The tokenizer is a synthesized byte-level BPE of the model's vocabulary size, or the
    Hugging Face tokenizer in `tokenizer_dir` (tiny-qwen3-moe: its real one from tests/fixtures
    when present). The same arguments and seed give the same file. The file appears whole or
    not at all (written to `<out_path>.part`, then renamed)."""
    config, plan = synth_plan(like, quant, n_layers, n_experts)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    part = out_path.with_name(out_path.name + ".part")
    rng = np.random.default_rng(seed)

    writer = GGUFWriter(part, config.arch)
    _add_metadata(writer, config, quant, seed)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else _default_tokenizer_dir(like)
    if tok_dir is not None:
        _add_hf_tokenizer(writer, tok_dir, config.vocab_size)
    else:
        for key, value in synth_tokenizer_metadata(config.vocab_size).items():
            _add_kv(writer, key, value)
    for t in plan:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)

    largest: dict[GGMLQuantizationType, int] = {}
    for t in plan:
        if t.qtype != Q.F32:
            largest[t.qtype] = max(largest.get(t.qtype, 0), t.nbytes)
    pools = {}
    for qtype, size in largest.items():
        block_bytes = GGML_QUANT_SIZES[qtype][1]
        n_blocks = min(size, POOL_BYTES) // block_bytes
        pools[qtype] = memoryview(random_blocks(qtype, n_blocks, rng).reshape(-1))

    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        fout = writer.fout[0]
        writer.write_padding(fout, fout.tell())
        total = sum(t.nbytes for t in plan)
        with tqdm(
            total=total, unit="B", unit_scale=True, desc=out_path.name, disable=not progress
        ) as bar:
            for t in plan:
                if t.qtype == Q.F32:
                    fout.write(_fixed_tensor(t, rng).tobytes())
                    bar.update(t.nbytes)
                else:
                    _write_windows(
                        fout, pools[t.qtype], GGML_QUANT_SIZES[t.qtype][1], t.nbytes, rng, bar
                    )
                writer.write_padding(fout, t.nbytes)
        writer.close()
        os.replace(part, out_path)
    except BaseException:
        writer.close()
        part.unlink(missing_ok=True)
        raise
    return out_path


def _write_windows(
    fout, pool: memoryview, block_bytes: int, nbytes: int, rng: np.random.Generator, bar: tqdm
) -> None:
    """Write `nbytes` as windows of `pool` (wrapping around) that start at random blocks."""
    n_blocks = pool.nbytes // block_bytes
    while nbytes:
        piece = min(nbytes, pool.nbytes)
        start = int(rng.integers(n_blocks)) * block_bytes
        head = min(piece, pool.nbytes - start)
        fout.write(pool[start : start + head])
        if piece > head:
            fout.write(pool[: piece - head])
        nbytes -= piece
        bar.update(piece)

"""GGUF tokenizer metadata <-> `tokenizers` objects, for byte-level BPE vocabularies.

GGUF stores a byte-level BPE tokenizer as llama.cpp's `convert_hf_to_gguf.py` writes it: model
"gpt2", a pre-tokenizer *name* (`tokenizer.ggml.pre`, whose regexes are compiled into llama.cpp),
tokens in id order with a type each, merges as "a b" strings, special token ids and flags.

- `backend_from_metadata` rebuilds a `tokenizers.Tokenizer` from that metadata.
- `gguf_tokenizer_metadata` writes it from a Hugging Face folder, naming the pre-tokenizer by
  inspecting tokenizer.json's `pre_tokenizer` (llama.cpp hashes the encoding of a test string
  instead; both give the same name for the tokenizers supported here).
- `special_metadata` reads special ids, add-bos/eos flags and the chat template from a Hugging
  Face folder through `gguf.SpecialVocab`, so the HF path and the GGUF path agree by construction.

Round-trip contract: for a folder `d` that `gguf_tokenizer_metadata` accepts,
`backend_from_metadata(gguf_tokenizer_metadata(d))` encodes every string exactly as
tokenizer.json does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from moestream.errors import ModelFormatError, UnsupportedError

K = gguf.Keys.Tokenizer
NORMAL = int(gguf.TokenType.NORMAL)
CONTROL = int(gguf.TokenType.CONTROL)
USER_DEFINED = int(gguf.TokenType.USER_DEFINED)
UNUSED = int(gguf.TokenType.UNUSED)

# Split regexes as the models' tokenizer.json files spell them (llama.cpp runs hand-expanded
# equivalents: `(?i:'s|...)` becomes `'[sS]|...`).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT: each regex splits the pieces the previous one made.
DEFAULT_PATTERNS = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)
# tokenizer.ggml.pre names llama.cpp maps onto the same pre-tokenizer type.
PRE_ALIASES = {
    "default": "default",
    "gpt-2": "gpt-2",
    "phi-2": "gpt-2",
    "llama-bpe": "llama-bpe",
    "llama3": "llama-bpe",
    "llama-v3": "llama-bpe",
    "falcon3": "llama-bpe",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "megrez": "qwen2",
}
# SpecialVocab's token kinds -> GGUF keys (as GGUFWriter.add_{kind}_token_id writes them).
SPECIAL_ID_KEYS = {
    "bos": K.BOS_ID,
    "eos": K.EOS_ID,
    "unk": K.UNK_ID,
    "sep": K.SEP_ID,
    "pad": K.PAD_ID,
    "mask": K.MASK_ID,
    "eot": K.EOT_ID,
    "eom": K.EOM_ID,
}
ADD_FLAG_KEYS = {"bos": K.ADD_BOS, "eos": K.ADD_EOS, "sep": K.ADD_SEP}


def _split(pattern: str) -> pre_tokenizers.Split:
    return pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)


def _byte_level_after_split() -> pre_tokenizers.ByteLevel:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)


def canonical_pre(pre: str, source: str) -> str:
    """The pre-tokenizer family ("default", "gpt-2", "qwen2", "llama-bpe") a GGUF pre name means."""
    family = PRE_ALIASES.get(pre)
    if family is None:
        raise UnsupportedError(
            f"{source}: tokenizer.ggml.pre {pre!r} is not supported "
            f"(supported: {', '.join(sorted(PRE_ALIASES))})"
        )
    return family


def pre_tokenizer_for(family: str) -> pre_tokenizers.PreTokenizer:
    """The `tokenizers` pre-tokenizer that splits and byte-maps text as llama.cpp does for it."""
    if family == "gpt-2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if family == "qwen2":
        return pre_tokenizers.Sequence([_split(QWEN2_PATTERN), _byte_level_after_split()])
    if family == "llama-bpe":
        return pre_tokenizers.Sequence([_split(LLAMA3_PATTERN), _byte_level_after_split()])
    if family == "default":
        splits = [_split(p) for p in DEFAULT_PATTERNS]
        return pre_tokenizers.Sequence([*splits, _byte_level_after_split()])
    raise ValueError(f"unknown pre-tokenizer family {family!r}")


def _required(meta: dict[str, Any], key: str, source: str) -> Any:
    if key not in meta:
        raise ModelFormatError(f"{source}: no tokenizer in metadata ({key} missing)")
    return meta[key]


def backend_from_metadata(meta: dict[str, Any], source: str) -> BackendTokenizer:
    """Build a `tokenizers.Tokenizer` from GGUF tokenizer metadata (model "gpt2" only).

    Control tokens (type 3) become added special tokens, user-defined tokens (type 4) added
    non-special tokens: both are matched before BPE, so text never splits them. A missing
    `tokenizer.ggml.pre` means "default", as in llama.cpp. The "qwen2" family gets Qwen2's NFC
    normalizer, which every Qwen tokenizer.json carries (llama.cpp skips it, so the two differ
    only on text that is not in NFC).
    """
    tokens = _required(meta, K.LIST, source)
    model = _required(meta, K.MODEL, source)
    if model != "gpt2":
        raise UnsupportedError(
            f"{source}: tokenizer.ggml.model {model!r} is not supported "
            "(only 'gpt2', byte-level BPE)"
        )
    merges_text = _required(meta, K.MERGES, source)
    family = canonical_pre(str(meta.get(K.PRE, "default")), source)
    token_types = [int(t) for t in meta.get(K.TOKEN_TYPE, [NORMAL] * len(tokens))]
    if len(token_types) != len(tokens):
        raise ModelFormatError(
            f"{source}: tokenizer.ggml.token_type has {len(token_types)} entries "
            f"for {len(tokens)} tokens"
        )
    merges = []
    for rank, merge in enumerate(merges_text):
        pos = merge.find(" ", 1)  # as llama.cpp: a part may itself be a lone space
        if pos < 0:
            raise ModelFormatError(
                f"{source}: tokenizer.ggml.merges[{rank}] {merge!r} has no space"
            )
        merges.append((merge[:pos], merge[pos + 1 :]))
    vocab = {token: i for i, token in enumerate(tokens)}
    try:
        bpe = models.BPE(vocab, merges, ignore_merges=family == "llama-bpe", fuse_unk=False)
    except Exception as e:  # tokenizers raises a bare Exception on merges outside the vocab
        raise ModelFormatError(
            f"{source}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens ({e})"
        ) from e
    backend = BackendTokenizer(bpe)
    if family == "qwen2":
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizer_for(family)
    backend.decoder = decoders.ByteLevel()
    control = [i for i, t in enumerate(token_types) if t == CONTROL]
    user = [i for i, t in enumerate(token_types) if t == USER_DEFINED]
    backend.add_special_tokens([_added(tokens[i], special=True) for i in control])
    backend.add_tokens([_added(tokens[i], special=False) for i in user])
    return backend


def _added(content: str, special: bool) -> AddedToken:
    return AddedToken(content, normalized=False, special=special)


def detect_pre(spec: dict[str, Any], source: str) -> str:
    """Name the llama.cpp pre-tokenizer of a tokenizer.json, or raise UnsupportedError.

    Recognised: plain ByteLevel with its regex ("gpt-2"), Split(Qwen2 regex) + ByteLevel without
    regex ("qwen2"), Split(Llama-3 regex) + ByteLevel without regex ("llama-bpe").
    """
    pre = spec.get("pre_tokenizer") or {}
    kind = pre.get("type")
    if kind == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return "gpt-2"
    if kind == "Sequence" and len(pre.get("pretokenizers", [])) == 2:
        split, byte_level = pre["pretokenizers"]
        pattern = split.get("pattern", {}).get("Regex")
        if (
            split.get("type") == "Split"
            and split.get("behavior") == "Isolated"
            and not split.get("invert")
            and byte_level.get("type") == "ByteLevel"
            and not byte_level.get("use_regex", True)
            and not byte_level.get("add_prefix_space")
        ):
            if pattern == QWEN2_PATTERN:
                return "qwen2"
            if pattern == LLAMA3_PATTERN:
                return "llama-bpe"
    raise UnsupportedError(
        f"{source}: pre_tokenizer {json.dumps(pre)[:200]} is not one llama.cpp names "
        "(supported: ByteLevel, Qwen2 split, Llama-3 split)"
    )


def _check_byte_level_bpe(spec: dict[str, Any], family: str, source: str) -> None:
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise UnsupportedError(f"{source}: model type {model.get('type')!r} is not byte-level BPE")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise UnsupportedError(f"{source}: BPE with subword prefix/suffix is not supported")
    normalizer = spec.get("normalizer")
    expected = {"type": "NFC"} if family == "qwen2" else None
    if normalizer not in (None, expected):
        raise UnsupportedError(
            f"{source}: normalizer {json.dumps(normalizer)[:200]} has no GGUF equivalent "
            f"for pre-tokenizer {family!r}"
        )
    if (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise UnsupportedError(f"{source}: decoder is not ByteLevel")


def special_metadata(hf_dir: str | Path, n_vocab: int) -> dict[str, Any]:
    """GGUF keys for special token ids, add-bos/eos flags and chat templates of an HF folder.

    Read with `gguf.SpecialVocab` (tokenizer_config.json first, then tokenizer.json's
    post-processor and config.json), exactly as convert_hf_to_gguf.py does.
    """
    return _special_vocab_metadata(gguf.SpecialVocab(Path(hf_dir), n_vocab=n_vocab))


def _special_vocab_metadata(special: gguf.SpecialVocab) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for kind, token_id in special.special_token_ids.items():
        if kind in SPECIAL_ID_KEYS:
            meta[SPECIAL_ID_KEYS[kind]] = int(token_id)
    for kind, flag in special.add_special_token.items():
        if kind in ADD_FLAG_KEYS:
            meta[ADD_FLAG_KEYS[kind]] = bool(flag)
    template = special.chat_template
    if isinstance(template, str):
        meta[K.CHAT_TEMPLATE] = template
    elif isinstance(template, list):  # named templates, as GGUFWriter.add_chat_template stores them
        for choice in template:
            name, text = choice.get("name", ""), choice.get("template")
            if name == "default":
                meta[K.CHAT_TEMPLATE] = text
            elif name and text is not None:
                meta[K.CHAT_TEMPLATE_N.format(name=name)] = text
    return meta


def _looks_special(token: str) -> bool:
    # convert_hf_to_gguf.py's does_token_look_special: such added tokens become CONTROL
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def gguf_tokenizer_metadata(hf_dir: str | Path, vocab_size: int | None = None) -> dict[str, Any]:
    """The GGUF tokenizer metadata convert_hf_to_gguf.py writes for a byte-level BPE folder.

    `vocab_size` (default: config.json's `vocab_size`, else the highest id + 1) sets how many
    tokens the list has; ids with no token are filled with "[PAD{i}]" of type UNUSED (5).
    Added tokens are CONTROL (3) when special or when they look special, else USER_DEFINED (4);
    all others NORMAL (1). Merges come from gguf.SpecialVocab as "a b" strings.
    """
    path = Path(hf_dir)
    json_path = path / "tokenizer.json"
    if not json_path.is_file():
        raise ModelFormatError(f"{path}: no tokenizer.json")
    source = str(json_path)
    try:
        spec = json.loads(json_path.read_text(encoding="utf-8"))
        backend = BackendTokenizer.from_file(str(json_path))
    except Exception as e:  # json.JSONDecodeError, or tokenizers' bare Exception
        raise ModelFormatError(f"{source}: cannot be read ({e})") from e
    family = detect_pre(spec, source)
    _check_byte_level_bpe(spec, family, source)

    id_to_token = {i: t for t, i in backend.get_vocab(with_added_tokens=True).items()}
    added = backend.get_added_tokens_decoder()  # {id: AddedToken}
    if vocab_size is None:
        config_path = path / "config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        vocab_size = int(config.get("vocab_size") or max(id_to_token) + 1)
    if max(id_to_token) >= vocab_size:
        raise ModelFormatError(f"{source}: token id {max(id_to_token)} >= vocab_size {vocab_size}")
    tokens: list[str] = []
    token_types: list[int] = []
    for i in range(vocab_size):
        token = id_to_token.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            token_types.append(UNUSED)
        elif i in added:
            tokens.append(token)
            token_types.append(
                CONTROL if added[i].special or _looks_special(token) else USER_DEFINED
            )
        else:
            tokens.append(token)
            token_types.append(NORMAL)

    special = gguf.SpecialVocab(path, load_merges=True, n_vocab=vocab_size)
    meta: dict[str, Any] = {
        K.MODEL: "gpt2",
        K.PRE: family,
        K.LIST: tokens,
        K.TOKEN_TYPE: token_types,
        K.MERGES: list(special.merges),
    }
    meta.update(_special_vocab_metadata(special))
    return meta

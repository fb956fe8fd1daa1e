"""The model's tokenizer, from GGUF metadata or a Hugging Face folder, through `tokenizers`.

Only byte-level BPE tokenizers (GGUF model "gpt2"; tokenizer.json with a ByteLevel decoder) are
supported: Qwen2/Qwen3 and Llama-3 families. The `tokenizers.Tokenizer` underneath never adds
special tokens itself; `encode` adds BOS (and EOS) from the model's add_bos/add_eos flags, as
llama.cpp does, so both sources behave alike.

End-of-generation ids (`eos_token_ids`), the rule: the EOS id; plus `tokenizer.ggml.eot_token_id`
and `tokenizer.ggml.eom_token_id` when the GGUF has them; plus generation_config.json's
`eos_token_id` (int or list) for a Hugging Face folder; plus the chat template's end-of-turn token,
found by rendering [user, assistant(PROBE)] and taking the special token that follows the
assistant's text (only whitespace may sit between), e.g. <|im_end|> for ChatML, <|eot_id|> for
Llama-3.

`decode` does not clean up tokenization spaces (Qwen's and the fixtures' configs turn it off).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from gguf.vocab import bytes_to_unicode
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders

from moestream.chat_template import ChatTemplate
from moestream.errors import ModelFormatError, RequestError, UnsupportedError
from moestream.weights.gguf_vocab import K, backend_from_metadata, canonical_pre, special_metadata

_PROBE = "MOESTREAM_END_OF_TURN_PROBE"


class Tokenizer:
    """Text <-> token ids, chat template rendering, end-of-generation ids.

    Build with `from_gguf_metadata` or `from_hf_dir`. Immutable after construction.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        source: str,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
        extra_eos_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self.source = source
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        for name, token_id in (("bos", bos_token_id), ("eos", eos_token_id), ("pad", pad_token_id)):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ModelFormatError(
                    f"{source}: {name} token id {token_id} is outside the vocabulary "
                    f"({self.vocab_size} tokens)"
                )
        if add_bos and bos_token_id is None:
            raise ModelFormatError(f"{source}: add_bos_token is set but there is no bos token id")
        if add_eos and eos_token_id is None:
            raise ModelFormatError(f"{source}: add_eos_token is set but there is no eos token id")
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.chat_template = chat_template
        self._extra_eos_ids = frozenset(i for i in extra_eos_ids if 0 <= i < self.vocab_size)
        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        self.special_token_ids = frozenset(i for i, t in added.items() if t.special)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], source: str) -> Tokenizer:
        """Build from GGUF metadata values (already decoded to str/int/list)."""
        backend = backend_from_metadata(meta, source)
        family = canonical_pre(str(meta.get(K.PRE, "default")), source)
        extra = [meta[k] for k in (K.EOT_ID, K.EOM_ID) if meta.get(k) is not None]
        return cls(
            backend,
            source=source,
            bos_token_id=_opt_int(meta.get(K.BOS_ID)),
            eos_token_id=_opt_int(meta.get(K.EOS_ID)),
            pad_token_id=_opt_int(meta.get(K.PAD_ID)),
            # llama.cpp turns BOS on for the Llama-3 pre-tokenizer unless the file says otherwise
            add_bos=bool(meta.get(K.ADD_BOS, family == "llama-bpe")),
            add_eos=bool(meta.get(K.ADD_EOS, False)),
            chat_template=meta.get(K.CHAT_TEMPLATE),
            extra_eos_ids=[int(i) for i in extra],
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face folder: tokenizer.json, tokenizer_config.json (chat template,
        bos/eos, add_bos_token), config.json (special ids), generation_config.json (eos ids)."""
        path = Path(path)
        json_path = path / "tokenizer.json"
        if not json_path.is_file():
            raise ModelFormatError(f"{path}: no tokenizer.json")
        try:
            backend = BackendTokenizer.from_file(str(json_path))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ModelFormatError(f"{json_path}: cannot be read ({e})") from e
        if not isinstance(backend.decoder, decoders.ByteLevel):
            raise UnsupportedError(f"{json_path}: decoder is not ByteLevel (byte-level BPE only)")
        meta = special_metadata(path, backend.get_vocab_size(with_added_tokens=True))
        return cls(
            backend,
            source=str(path),
            bos_token_id=meta.get(K.BOS_ID),
            eos_token_id=meta.get(K.EOS_ID),
            pad_token_id=meta.get(K.PAD_ID),
            add_bos=meta.get(K.ADD_BOS, False),
            add_eos=meta.get(K.ADD_EOS, False),
            chat_template=meta.get(K.CHAT_TEMPLATE),
            extra_eos_ids=_generation_config_eos(path),
        )

    # -- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are always recognised.
        With `add_special_tokens`, BOS/EOS are added where the model's flags say so."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos:
                ids.insert(0, self.bos_token_id)
            if self.add_eos:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """The UTF-8 bytes each id stands for (byte-level tokens mapped back to raw bytes)."""
        byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        added = self._backend.get_added_tokens_decoder()
        table = []
        for i in range(self.vocab_size):
            token = added[i].content if i in added else self._backend.id_to_token(i)
            if token is None:
                table.append(b"")
            elif i in added or not all(c in byte_of for c in token):
                table.append(token.encode("utf-8"))
            else:
                table.append(bytes(byte_of[c] for c in token))
        return table

    # -- chat -----------------------------------------------------------------------------------

    @cached_property
    def _compiled_template(self) -> ChatTemplate:
        if self.chat_template is None:
            raise RequestError(f"{self.source}: the model has no chat template")
        return ChatTemplate(self.chat_template, name=f"{self.source}: chat template")

    def _special_token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's chat template. `bos_token`, `eos_token` and
        `pad_token` are set from the vocabulary; `kwargs` add or override template variables."""
        variables = {
            "bos_token": self._special_token_text(self.bos_token_id),
            "eos_token": self._special_token_text(self.eos_token_id),
            "pad_token": self._special_token_text(self.pad_token_id),
        }
        variables = {k: v for k, v in variables.items() if v is not None} | kwargs
        return self._compiled_template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
        )

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation (see the module docstring for the rule)."""
        ids = set(self._extra_eos_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        end_of_turn = self._template_end_of_turn_id()
        if end_of_turn is not None:
            ids.add(end_of_turn)
        return frozenset(ids)

    def _template_end_of_turn_id(self) -> int | None:
        if self.chat_template is None:
            return None
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
        try:
            text = self.apply_chat_template(probe, add_generation_prompt=False)
        except (RequestError, ModelFormatError):
            return None
        _, found, after = text.rpartition(_PROBE)
        after = after.lstrip()
        specials = [self._backend.id_to_token(i) for i in self.special_token_ids]
        matches = [s for s in specials if found and s and after.startswith(s)]
        return self._backend.token_to_id(max(matches, key=len)) if matches else None


class StreamDecoder:
    """Incremental detokenizer: feed ids one at a time, get text deltas back.

    Works on bytes: a multi-byte character split across tokens is held back until its last byte
    arrives, so no delta ever ends in half a character. Bytes that can never form a character
    come out as U+FFFD, as `Tokenizer.decode` does; `finish` flushes an incomplete tail the same
    way. The concatenated deltas equal `tokenizer.decode(ids, skip_special_tokens)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._token_bytes = tokenizer.token_bytes
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """The text that `token_id` completes (may be empty)."""
        if token_id in self._skip:
            return ""
        return self._utf8.decode(self._token_bytes[token_id])

    def finish(self) -> str:
        """Flush bytes held back at the end of the stream."""
        return self._utf8.decode(b"", final=True)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _generation_config_eos(path: Path) -> list[int]:
    config_path = path / "generation_config.json"
    if not config_path.is_file():
        return []
    try:
        eos = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token_id")
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{config_path}: invalid JSON ({e})") from e
    if isinstance(eos, int):
        return [eos]
    return [int(i) for i in eos] if isinstance(eos, list) else []

"""`moestream info`: what a model file holds and how many bytes a token must read.

`model_info` opens a GGUF file (metadata and tensor headers only, no weights are read) or a
Hugging Face folder (config.json and safetensors headers) and returns plain data; `format_info`
renders it for a terminal.

Bytes per token at batch 1 are the weights one decode step reads: every dense tensor, the
`n_experts_used / n_experts` share of each layer's expert tensors (on average over tokens), and
of the token embedding one row only (all of it when the output projection is tied to it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from moestream.config import ModelConfig
from moestream.weights.layout import expected_shapes, is_expert, tensor_kind

_SAFETENSORS_TYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}


def _tensor_bytes(qtype_name: str, shape: tuple[int, ...]) -> int:
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype_name]]
    return math.prod(shape[:-1]) * (shape[-1] // block) * type_size


def _gguf_tensors(path: Path) -> tuple[ModelConfig, dict[str, tuple[str, tuple]], dict, int]:
    from moestream.weights.loader import open_model

    source = open_model(path)  # checks shapes against the hyperparameters; reads no weights
    file = source.gguf
    assert file is not None
    tensors = {n: (file.tensor_type(n).name, file.tensor_shape(n)) for n in file.tensor_names}
    return source.config, tensors, source.metadata, path.stat().st_size


def _hf_tensors(path: Path) -> tuple[ModelConfig, dict[str, tuple[str, tuple]], dict, int]:
    from safetensors import safe_open

    from moestream.weights.convert import HFTensorIndex, check_shapes
    from moestream.weights.hf import read_hf_config

    config = ModelConfig.from_hf_config(read_hf_config(path), source=str(path / "config.json"))
    index = HFTensorIndex(path, config)
    check_shapes(path, config, index.shapes)
    tensors = {}
    for name in expected_shapes(config):
        shape = index.shapes[name]
        file, key = index.parts[name][0][:2]
        with safe_open(str(file), framework="pt") as f:
            dtype = f.get_slice(key).get_dtype()
        tensors[name] = (_SAFETENSORS_TYPES.get(dtype, "F32"), shape)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return config, tensors, {}, size


def _tokenizer_summary(path: Path, metadata: Mapping[str, Any]) -> dict[str, Any]:
    if metadata:
        tokens = metadata.get("tokenizer.ggml.tokens")
        if tokens is None:
            return {"present": False}
        summary: dict[str, Any] = {
            "present": True,
            "model": metadata.get("tokenizer.ggml.model"),
            "pre": metadata.get("tokenizer.ggml.pre"),
            "n_tokens": len(tokens),
            "n_merges": len(metadata.get("tokenizer.ggml.merges") or []),
        }
        for kind in ("bos", "eos", "padding"):
            token_id = metadata.get(f"tokenizer.ggml.{kind}_token_id")
            if token_id is not None and 0 <= token_id < len(tokens):
                summary[kind] = tokens[token_id]
        return summary
    from tokenizers import Tokenizer

    tok_path = path / "tokenizer.json"
    if not tok_path.is_file():
        return {"present": False}
    backend = Tokenizer.from_file(str(tok_path))
    return {
        "present": True,
        "model": type(backend.model).__name__,
        "n_tokens": backend.get_vocab_size(with_added_tokens=True),
    }


def _has_chat_template(path: Path, metadata: Mapping[str, Any]) -> bool:
    if metadata:
        return any(k.startswith("tokenizer.chat_template") for k in metadata)
    import json

    cfg = path / "tokenizer_config.json"
    if cfg.is_file() and json.loads(cfg.read_text(encoding="utf-8")).get("chat_template"):
        return True
    return (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file()


def model_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A summary of a GGUF file or HF folder as plain JSON-able data (see the module doc).

    Keys: path, format, file_size, architecture, name, file_type, n_layers, hidden_size, n_heads,
    n_kv_heads, head_dim, vocab_size, ffn_size, n_experts, n_experts_used, expert_ffn_size,
    context_length, tie_embeddings, params_total, params_active, quant_mix ({kind: {type: n}}),
    bytes_dense, bytes_experts, bytes_per_token, tokenizer ({present, model, n_tokens, ...}),
    chat_template (bool). Raises ModelFormatError for files the loader rejects.
    """
    path = Path(path)
    fmt = "hf" if path.is_dir() else "gguf"
    config, tensors, metadata, size = (_hf_tensors if fmt == "hf" else _gguf_tensors)(path)
    c = config
    params_total = params_experts = 0
    bytes_dense = bytes_experts = bytes_per_token = 0
    quant_mix: dict[str, dict[str, int]] = {}
    tied = "output.weight" not in tensors
    for name, (qtype, shape) in tensors.items():
        numel, nbytes = math.prod(shape), _tensor_bytes(qtype, shape)
        kind = tensor_kind(name)
        mix = quant_mix.setdefault(kind, {})
        mix[qtype] = mix.get(qtype, 0) + 1
        params_total += numel
        if is_expert(name):
            params_experts += numel
            bytes_experts += nbytes
            bytes_per_token += nbytes * c.n_experts_used // c.n_experts
        else:
            bytes_dense += nbytes
            one_row = name == "token_embd.weight" and not tied
            bytes_per_token += nbytes // shape[0] if one_row else nbytes
    params_active = params_total - params_experts
    if c.is_moe:
        params_active += params_experts * c.n_experts_used // c.n_experts
    file_type = metadata.get("general.file_type")
    if file_type is not None:
        try:
            file_type = LlamaFileType(file_type).name.removeprefix("MOSTLY_")
        except ValueError:
            file_type = str(file_type)
    return {
        "path": str(path),
        "format": fmt,
        "file_size": size,
        "architecture": c.arch,
        "name": str(metadata.get("general.name", c.name)) if metadata else (c.name or path.name),
        "file_type": file_type,
        "n_layers": c.n_layers,
        "hidden_size": c.hidden_size,
        "n_heads": c.n_heads,
        "n_kv_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "ffn_size": c.ffn_size,
        "n_experts": c.n_experts,
        "n_experts_used": c.n_experts_used,
        "expert_ffn_size": c.expert_ffn_size,
        "context_length": c.context_length,
        "tie_embeddings": tied,
        "params_total": params_total,
        "params_active": params_active,
        "quant_mix": quant_mix,
        "bytes_dense": bytes_dense,
        "bytes_experts": bytes_experts,
        "bytes_per_token": bytes_per_token,
        "tokenizer": _tokenizer_summary(path, metadata if fmt == "gguf" else {}),
        "chat_template": _has_chat_template(path, metadata if fmt == "gguf" else {}),
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit} ({n:,})"
    return f"{n:,}"


def format_info(info: Mapping[str, Any]) -> str:
    """`model_info`'s result as aligned text lines."""
    i = info
    lines = [
        f"{'file':16} {i['path']} ({i['format']}, {_mib(i['file_size'])})",
        f"{'architecture':16} {i['architecture']}   name: {i['name'] or '-'}"
        + (f"   file type: {i['file_type']}" if i.get("file_type") else ""),
        f"{'layers':16} {i['n_layers']}   hidden {i['hidden_size']}   heads {i['n_heads']} "
        f"(kv {i['n_kv_heads']}, head dim {i['head_dim']})   vocab {i['vocab_size']}",
    ]
    if i["n_experts"]:
        lines.append(
            f"{'experts':16} {i['n_experts']} ({i['n_experts_used']} per token, "
            f"ffn {i['expert_ffn_size']})"
        )
    else:
        lines.append(f"{'ffn':16} {i['ffn_size']}")
    lines += [
        f"{'context':16} {i['context_length']}",
        f"{'parameters':16} {_count(i['params_total'])} total, "
        f"{_count(i['params_active'])} active per token",
        f"{'weights':16} dense {_mib(i['bytes_dense'])}, experts {_mib(i['bytes_experts'])}",
        f"{'read per token':16} {_mib(i['bytes_per_token'])} at batch 1 "
        f"(dense + {i['n_experts_used'] or 0}/{i['n_experts'] or 0} of the experts, "
        f"one embedding row)",
        "quant mix:",
    ]
    width = max(len(k) for k in i["quant_mix"])
    for kind, types in i["quant_mix"].items():
        mix = ", ".join(f"{t} x{n}" for t, n in sorted(types.items()))
        lines.append(f"  {kind:{width}}  {mix}")
    tok = i["tokenizer"]
    if tok.get("present"):
        parts = [f"{tok.get('model')}", f"{tok.get('n_tokens')} tokens"]
        if tok.get("pre"):
            parts.insert(1, f"pre {tok['pre']}")
        if tok.get("n_merges"):
            parts.append(f"{tok['n_merges']} merges")
        for kind in ("bos", "eos"):
            if tok.get(kind) is not None:
                parts.append(f"{kind} {tok[kind]!r}")
        lines.append(f"{'tokenizer':16} " + ", ".join(parts))
    else:
        lines.append(f"{'tokenizer':16} none")
    lines.append(f"{'chat template':16} {'yes' if i['chat_template'] else 'no'}")
    return "\n".join(lines)

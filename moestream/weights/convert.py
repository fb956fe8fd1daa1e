"""`convert`: a Hugging Face folder -> a llama.cpp-compatible GGUF, quantized with a mix.

Tensors are read lazily from the safetensors files (one GGUF tensor at a time: experts stacked
into [E, out, in], llama-family Q/K rows permuted for llama.cpp's RoPE), quantized and written
before the next is read, so a model larger than RAM converts. Names and layout follow
`names.py` / `hf.py`, so a converted file holds exactly what `open_model(hf_dir)` holds.

Metadata, as convert_hf_to_gguf.py + llama-quantize write it: general.architecture,
general.type, general.name, general.file_type (llama.cpp's ftype number of the mix),
general.quantization_version = 2, the hyperparameters (`ModelConfig.to_gguf_metadata()`), and the
tokenizer (tokenizer.ggml.*, tokenizer.chat_template).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from gguf import GGML_QUANT_VERSION
from safetensors import safe_open

from moestream.config import ModelConfig
from moestream.errors import ModelFormatError
from moestream.weights.gguf_vocab import gguf_tokenizer_metadata
from moestream.weights.hf import read_hf_config
from moestream.weights.layout import expected_shapes
from moestream.weights.mixes import get_mix, tensor_qtypes
from moestream.weights.names import gguf_name, permute_qk
from moestream.weights.writer import TensorToWrite, write_gguf

# (file, key, expert index or None, half of a fused gate_up tensor: 0 gate, 1 up, None whole)
_Part = tuple[Path, str, int | None, int | None]


class HFTensorIndex:
    """Where each GGUF tensor of an HF folder lives; loads one GGUF tensor at a time."""

    def __init__(self, hf_dir: Path, config: ModelConfig):
        self.hf_dir, self.config = hf_dir, config
        self.parts: dict[str, list[_Part]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            raise ModelFormatError(f"{hf_dir}: no *.safetensors files")
        part_shapes: dict[str, tuple[int, ...]] = {}
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                        self._add(file, key, tuple(f.get_slice(key).get_shape()), part_shapes)
            except (OSError, ValueError, RuntimeError) as e:
                raise ModelFormatError(f"{file}: unreadable safetensors file ({e})") from None
        for name, parts in self.parts.items():
            shape = part_shapes[name]
            if parts[0][2] is not None:  # stacked experts
                indices = sorted(p[2] for p in parts)
                if indices != list(range(config.n_experts)):
                    raise ModelFormatError(
                        f"{hf_dir}: {name} has experts {indices}, "
                        f"expected 0..{config.n_experts - 1}"
                    )
                parts.sort(key=lambda p: p[2])
                shape = (len(parts), *shape)
            elif parts[0][3] is not None:  # half of a fused [E, 2F, H]
                shape = (shape[0], shape[1] // 2, *shape[2:])
            self.shapes[name] = shape
        if config.tie_embeddings:
            self.shapes.pop("output.weight", None)
            self.parts.pop("output.weight", None)

    def _add(self, file: Path, key: str, shape: tuple[int, ...], part_shapes: dict) -> None:
        target = gguf_name(key)
        if target is None:
            return
        if isinstance(target, tuple):
            name, expert = target
            self.parts.setdefault(name, []).append((file, key, expert, None))
            part_shapes[name] = shape
        elif target.endswith("ffn_gate_up_exps.weight"):
            for half, kind in enumerate(("ffn_gate_exps", "ffn_up_exps")):
                name = target.replace("ffn_gate_up_exps", kind)
                self.parts[name] = [(file, key, None, half)]
                part_shapes[name] = shape
        else:
            self.parts[target] = [(file, key, None, None)]
            part_shapes[target] = shape

    def load(self, name: str) -> torch.Tensor:
        """One GGUF tensor in float32, GGUF layout (torch order)."""
        parts = self.parts[name]  # experts sorted by index
        pieces: list[torch.Tensor | None] = [None] * len(parts)
        for file in dict.fromkeys(p[0] for p in parts):  # each shard opened once
            with safe_open(str(file), framework="pt") as f:
                for j, (part_file, key, _, half) in enumerate(parts):
                    if part_file != file:
                        continue
                    t = f.get_tensor(key).float()
                    if half is not None:  # one half of a fused gate_up [E, 2F, H]
                        f_size = t.shape[1] // 2
                        t = t[:, half * f_size : (half + 1) * f_size]
                    pieces[j] = t
        t = torch.stack(pieces) if parts[0][2] is not None else pieces[0]  # [E, out, in]
        c = self.config
        if c.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            t = permute_qk(t, c.n_heads if "attn_q" in name else c.n_kv_heads)
        return t.contiguous()


def check_shapes(hf_dir: Path, config: ModelConfig, shapes: Mapping[str, tuple]) -> None:
    for name, shape in expected_shapes(config).items():
        if name not in shapes:
            raise ModelFormatError(f"{hf_dir}: missing tensor {name} (GGUF name)")
        if tuple(shapes[name]) != shape:
            raise ModelFormatError(
                f"{hf_dir}: tensor {name} has shape {list(shapes[name])} but config.json "
                f"({config.arch}) requires {list(shape)}"
            )


def gguf_metadata(config: ModelConfig, ftype: int, tokenizer: Mapping[str, Any]) -> dict[str, Any]:
    """All metadata of a converted file, in the order convert_hf_to_gguf.py writes it."""
    meta: dict[str, Any] = {
        "general.architecture": config.arch,
        "general.type": "model",
        "general.name": config.name,
    }
    meta.update(config.to_gguf_metadata())
    if config.is_moe and not config.norm_topk_prob:
        # llama.cpp's qwen3moe always renormalizes the top-k weights and its convert writes no
        # key; a model that does not (norm_topk_prob false) says so in the key deepseek2 uses.
        meta[f"{config.arch}.expert_weights_norm"] = False
    meta["general.file_type"] = int(ftype)
    meta["general.quantization_version"] = GGML_QUANT_VERSION
    meta.update(tokenizer)
    return meta


def convert(
    hf_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    quant: str = "Q4_K_M",
    layer_quant: Mapping[range | int, str] | None = None,
    progress: bool = True,
) -> Path:
    """Convert an HF folder to a GGUF at `out_path` with mix `quant` (see `mixes.py`) and
    per-layer overrides ({range(33, 40): "Q4_K"}); returns the path written.

    Raises ModelFormatError for a folder that is not a supported model (no config.json, unknown
    model_type, no tokenizer.json, missing or misshapen tensors) before anything is written,
    RequestError for an unknown mix or override.
    """
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    if not hf_dir.is_dir():
        raise ModelFormatError(f"{hf_dir}: not a folder")
    mix = get_mix(quant)
    config = ModelConfig.from_hf_config(read_hf_config(hf_dir), source=str(hf_dir / "config.json"))
    if not config.name:
        config = config.replace(name=hf_dir.resolve().name)
    tokenizer = gguf_tokenizer_metadata(hf_dir, vocab_size=config.vocab_size)
    index = HFTensorIndex(hf_dir, config)
    check_shapes(hf_dir, config, index.shapes)
    shapes = expected_shapes(config)  # file order: as llama.cpp's convert writes it
    qtypes = tensor_qtypes(config, shapes, mix, layer_quant)
    tensors = [
        TensorToWrite(name, shape, qtypes[name], lambda name=name: index.load(name))
        for name, shape in shapes.items()
    ]
    meta = gguf_metadata(config, mix.ftype, tokenizer)
    return write_gguf(out_path, config.arch, meta, tensors, progress=progress)

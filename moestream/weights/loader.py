"""One entry point for model files: `open_model(path)` reads a GGUF file or a Hugging Face folder
and returns a `ModelSource` whose tensors are checked against the hyperparameters."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moestream.config import ModelConfig
from moestream.errors import ModelFormatError, UnsupportedError
from moestream.weights.gguf_file import GGUFFile
from moestream.weights.hf import load_hf_tensors, read_hf_config
from moestream.weights.layout import expected_shapes
from moestream.weights.qtensor import QTensor


@dataclass
class ModelSource:
    path: Path
    format: str  # "gguf" | "hf"
    config: ModelConfig
    tensors: Mapping[str, QTensor]
    metadata: dict[str, Any]  # GGUF metadata (empty for HF folders)
    gguf: GGUFFile | None = None

    def tokenizer(self):  # -> moestream.tokenizer.Tokenizer
        """The model's tokenizer; ModelFormatError naming the file when it has none."""
        if self.format == "gguf":
            if "tokenizer.ggml.tokens" not in self.metadata:
                raise ModelFormatError(
                    f"{self.path}: no tokenizer (metadata field tokenizer.ggml.tokens is missing)"
                )
        elif not (self.path / "tokenizer.json").is_file():
            raise ModelFormatError(f"{self.path}: no tokenizer.json")
        from moestream.tokenizer import Tokenizer

        if self.format == "gguf":
            return Tokenizer.from_gguf_metadata(self.metadata, source=str(self.path))
        return Tokenizer.from_hf_dir(self.path)


class _LazyGGUFTensors(Mapping[str, QTensor]):
    def __init__(self, file: GGUFFile):
        self._file = file

    def __getitem__(self, name: str) -> QTensor:
        if name not in self._file:
            raise KeyError(name)
        return self._file.tensor(name)

    def __iter__(self):
        return iter(self._file.tensor_names)

    def __len__(self) -> int:
        return len(self._file.tensor_names)


def _check_tensors(path: Path, config: ModelConfig, shapes: Mapping[str, tuple[int, ...]]) -> None:
    expected = expected_shapes(config)
    for name, shape in expected.items():
        if name not in shapes:
            raise ModelFormatError(f"{path}: missing tensor {name}")
        if tuple(shapes[name]) != shape:
            raise ModelFormatError(
                f"{path}: tensor {name} has shape {list(shapes[name])} but the hyperparameters "
                f"({config.arch}) require {list(shape)}"
            )


def open_model(path: str | Path) -> ModelSource:
    path = Path(path)
    if path.is_dir():
        return _open_hf(path)
    if not path.exists():
        raise ModelFormatError(f"{path}: no such file or folder")
    return _open_gguf(path)


def _open_gguf(path: Path) -> ModelSource:
    from moestream.weights.dequant import SUPPORTED_QTYPES

    file = GGUFFile(path)
    config = ModelConfig.from_gguf_metadata(file.metadata, source=str(path))
    tied = "output.weight" not in file
    config = config.replace(tie_embeddings=tied)
    shapes = {name: file.tensor_shape(name) for name in file.tensor_names}
    _check_tensors(path, config, shapes)
    for name in file.tensor_names:
        qtype = file.tensor_type(name)
        if qtype not in SUPPORTED_QTYPES:
            raise UnsupportedError(f"{path}: tensor {name} has unsupported type {qtype.name}")
    return ModelSource(path, "gguf", config, _LazyGGUFTensors(file), file.metadata, file)


def _open_hf(path: Path) -> ModelSource:
    config = ModelConfig.from_hf_config(read_hf_config(path), source=str(path / "config.json"))
    tensors = load_hf_tensors(path, config)
    _check_tensors(path, config, {n: t.shape for n, t in tensors.items()})
    return ModelSource(path, "hf", config, tensors, {})

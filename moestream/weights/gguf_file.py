"""Read a GGUF file through the `gguf` package: metadata as plain Python values, tensors as
zero-copy `QTensor` views of the memory map. Every way a file can be wrong becomes one
`ModelFormatError` that names the file and the field or tensor."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

from moestream.errors import ModelFormatError, UnsupportedError
from moestream.weights.qtensor import FLOAT_TYPES, QTensor, row_bytes


def _field_value(field: Any) -> Any:
    if not field.types:
        return None
    if field.types[0] == GGUFValueType.ARRAY and field.types[-1] != GGUFValueType.STRING:
        # Numeric arrays: one numpy slice, not one Python object per element.
        if not field.data:
            return []
        parts = [field.parts[i] for i in field.data]
        return np.concatenate(parts).tolist()
    if field.types[0] == GGUFValueType.FLOAT32:
        # The shortest decimal that is the same float32 (1e-06, not 9.99999997e-07), so a value
        # written from a config reads back equal to it.
        return float(str(np.float32(field.contents())))
    return field.contents()


class _Truncated(Exception):
    """Raised inside the reader when a read runs past the end of the file."""


class _CheckedReader(GGUFReader):
    """`GGUFReader` that says what is cut off or unknown instead of failing in numpy.

    Relies on gguf-py's reader internals (`_get`, `_push_field`, `_build_tensors` and the
    tensor-info field layout), which the pinned gguf range keeps stable.
    """

    def __init__(self, path: Path, mode: str):
        self.last_field = "the header"
        super().__init__(path, mode)  # type: ignore[arg-type]

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
        end = int(offset) + int(count) * np.dtype(dtype).itemsize
        if end > len(self.data):
            raise _Truncated(
                f"reading after metadata field {self.last_field} needs byte {end} "
                f"but the file has {len(self.data)} bytes"
            )
        return super()._get(offset, dtype, count, override_order)

    def _push_field(self, field: Any, skip_sum: bool = False) -> int:
        self.last_field = field.name
        return super()._push_field(field, skip_sum)

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                qtype = GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise UnsupportedError(
                    f"tensor {name} has unknown GGML type id {int(raw_dtype[0])}"
                ) from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(dims.astype(np.int64))) * type_size // block
            end = int(start_offs) + int(offset[0]) + n_bytes
            if end > len(self.data):
                raise _Truncated(
                    f"tensor {name} ends at byte {end} but the file has {len(self.data)} bytes"
                )
        super()._build_tensors(start_offs, fields)


class GGUFFile:
    """A GGUF file opened read-only (copy-on-write memory map: nothing is read until used)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFormatError(f"{self.path}: no such file")
        with open(self.path, "rb") as f:
            header = f.read(8)
        magic = header[:4]
        if magic != b"GGUF":
            raise ModelFormatError(
                f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')"
            )
        if len(header) < 8:
            raise ModelFormatError(f"{self.path}: truncated GGUF (the header has no version)")
        version = int.from_bytes(header[4:8], "little")
        if version & 0xFFFF == 0:  # a big-endian file: gguf-py reads it the other way round
            version = int.from_bytes(header[4:8], "big")
        if version not in READER_SUPPORTED_VERSIONS:
            supported = ", ".join(str(v) for v in READER_SUPPORTED_VERSIONS)
            raise UnsupportedError(
                f"{self.path}: unsupported GGUF version {version} in the header "
                f"(supported: {supported})"
            )
        try:
            self._reader = _CheckedReader(self.path, "c")
        except _Truncated as e:
            raise ModelFormatError(f"{self.path}: truncated GGUF: {e}") from None
        except UnsupportedError as e:
            raise UnsupportedError(f"{self.path}: {e}") from None
        except ValueError as e:
            msg = str(e)
            if "GGMLQuantizationType" in msg:
                raise UnsupportedError(f"{self.path}: unknown tensor type ({msg})") from None
            if "version" in msg.lower():
                raise ModelFormatError(f"{self.path}: unsupported GGUF version ({msg})") from None
            raise ModelFormatError(f"{self.path}: corrupt or truncated GGUF ({msg})") from None
        except (IndexError, OverflowError, KeyError, UnicodeDecodeError, TypeError) as e:
            raise ModelFormatError(f"{self.path}: corrupt or truncated GGUF ({e})") from None
        self.metadata: dict[str, Any] = {}
        for name, field in self._reader.fields.items():
            if name.startswith("GGUF."):
                continue
            try:
                self.metadata[name] = _field_value(field)
            except (UnicodeDecodeError, ValueError) as e:
                raise ModelFormatError(
                    f"{self.path}: unreadable metadata field {name} ({e})"
                ) from None
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._check_extents()

    def _check_extents(self) -> None:
        size = self.path.stat().st_size
        for t in self._reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise ModelFormatError(
                    f"{self.path}: truncated: tensor {t.name} ends at byte {end} "
                    f"but the file has {size} bytes"
                )

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        return GGMLQuantizationType(int(self._tensors[name].tensor_type))

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Torch-order shape (GGUF stores `ne`, innermost first)."""
        return tuple(int(x) for x in reversed(self._tensors[name].shape.tolist()))

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> QTensor:
        """Zero-copy QTensor view of one tensor."""
        if name not in self._tensors:
            raise ModelFormatError(f"{self.path}: missing tensor {name}")
        t = self._tensors[name]
        qtype = self.tensor_type(name)
        shape = self.tensor_shape(name)
        raw = np.asarray(t.data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only views are fine: we never write weights
            if qtype in FLOAT_TYPES:
                if qtype == GGMLQuantizationType.BF16:
                    data = torch.from_numpy(raw.view(np.uint8).reshape(-1)).view(torch.bfloat16)
                else:
                    data = torch.from_numpy(raw.reshape(-1))
                return QTensor(data.reshape(shape), qtype, shape)
            rb = row_bytes(qtype, shape[-1])
            data = torch.from_numpy(raw.view(np.uint8).reshape(*shape[:-1], rb))
        return QTensor(data, qtype, shape)

"""Write a GGUF file tensor by tensor through `gguf.GGUFWriter`.

The header, metadata and every tensor's info go first; then each tensor is loaded, quantized,
written and dropped before the next is loaded, so memory holds one tensor at a time whatever the
model's size. The file appears under its final name only when complete (written to
`<name>.part`, then renamed), so an interrupted write never leaves a truncated model behind.

Metadata values are typed as llama.cpp's convert_hf_to_gguf.py types them: bool -> BOOL,
int -> UINT32 (INT32 when negative, UINT64 when >= 2**32), float -> FLOAT32, str -> STRING, lists
-> ARRAY of STRING / BOOL / INT32 / FLOAT32 by their first element. A value given as
`(value, GGUFValueType)` is written with that type.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter
from tqdm import tqdm

from moestream.weights.quantize import quantize

ARCH_KEY = "general.architecture"


@dataclass(frozen=True)
class TensorToWrite:
    name: str  # GGUF name
    shape: tuple[int, ...]  # logical shape, torch order ([E, out, in] for stacked experts)
    qtype: GGMLQuantizationType
    load: Callable[[], Any]  # -> float values of `shape` (numpy or torch); called once

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape[:-1]) * (self.shape[-1] // block) * type_size


def _scalar_type(value: Any) -> GGUFValueType:
    if isinstance(value, (bool, np.bool_)):
        return GGUFValueType.BOOL
    if isinstance(value, (int, np.integer)):
        if value < 0:
            return GGUFValueType.INT32 if value >= -(2**31) else GGUFValueType.INT64
        return GGUFValueType.UINT32 if value < 2**32 else GGUFValueType.UINT64
    if isinstance(value, (float, np.floating)):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    raise TypeError(f"cannot store {type(value).__name__} as GGUF metadata")


def _array_type(values: Sequence[Any]) -> GGUFValueType:
    first = values[0]
    if isinstance(first, str):
        return GGUFValueType.STRING
    if isinstance(first, (bool, np.bool_)):
        return GGUFValueType.BOOL
    if isinstance(first, (int, np.integer)):
        return GGUFValueType.INT32
    if isinstance(first, (float, np.floating)):
        return GGUFValueType.FLOAT32
    raise TypeError(f"cannot store an array of {type(first).__name__} as GGUF metadata")


def add_metadata(writer: GGUFWriter, metadata: Mapping[str, Any]) -> None:
    """Add every key of `metadata` (in order) to `writer`, typed as the module doc says."""
    for key, value in metadata.items():
        if key == ARCH_KEY:
            continue  # GGUFWriter writes it first, from its `arch`
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], GGUFValueType):
            value, vtype = value
            writer.add_key_value(key, value, vtype)
        elif isinstance(value, (list, tuple, np.ndarray)):
            values = value.tolist() if isinstance(value, np.ndarray) else list(value)
            if not values:
                continue  # GGUF has no empty arrays; convert_hf_to_gguf.py skips them too
            writer.add_key_value(key, values, GGUFValueType.ARRAY, sub_type=_array_type(values))
        else:
            writer.add_key_value(key, value, _scalar_type(value))


def _encode(t: TensorToWrite) -> np.ndarray:
    values = t.load()
    if hasattr(values, "detach"):  # torch tensor
        values = values.detach().float().cpu().numpy()
    values = np.asarray(values, dtype=np.float32)
    if tuple(values.shape) != t.shape:
        raise ValueError(f"{t.name}: loaded shape {values.shape} != planned {t.shape}")
    if t.qtype == GGMLQuantizationType.F32:
        return np.ascontiguousarray(values)
    return quantize(values, t.qtype)  # uint8 [..., row_bytes]


def write_gguf(
    path: str | os.PathLike[str],
    arch: str,
    metadata: Mapping[str, Any],
    tensors: Sequence[TensorToWrite],
    progress: bool = True,
) -> Path:
    """Write a GGUF of `tensors` (in order) and `metadata`; returns the path.

    `arch` becomes general.architecture, the first key. Each tensor's `load()` is called once,
    in order, and its result is quantized to `qtype` and written before the next is loaded.
    A progress bar counts bytes written when `progress` is true.
    """
    path = Path(path)
    part = path.with_name(path.name + ".part")
    writer = GGUFWriter(part, arch)
    add_metadata(writer, metadata)
    for t in tensors:
        # Logical shape with a non-uint8 dtype: GGUFWriter stores it as given (reversed to ne).
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    total = sum(t.nbytes for t in tensors)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=path.name, disable=not progress)
        with bar:
            for t in tensors:
                bar.set_postfix_str(f"{t.name} {t.qtype.name}", refresh=False)
                data = _encode(t)
                if data.nbytes != t.nbytes:
                    raise ValueError(f"{t.name}: encoded {data.nbytes} bytes, planned {t.nbytes}")
                writer.write_tensor_data(data)
                bar.update(data.nbytes)
        writer.close()
        os.replace(part, path)
    except BaseException:
        writer.close()
        part.unlink(missing_ok=True)
        raise
    return path

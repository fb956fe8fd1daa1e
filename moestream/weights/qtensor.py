"""`QTensor`: a weight kept in its GGUF block format.

Shapes follow torch order (the reverse of GGUF's `ne`): a linear weight is [out, in], a stacked
expert weight is [E, out, in]. Quantized rows are stored as raw bytes, `data` of shape
[*outer, row_bytes] (uint8); float types (F32, F16, BF16) are stored as typed tensors of the
logical shape. The last logical dimension is always the one blocks run along.

Q6_K's 210-byte blocks are only 2-byte aligned, so a GPU kernel reads them 16 bits at a time.
`QTensor.aligned()` stores them padded to 224 bytes (every section of a block, and every block,
16-byte aligned; 6.7% more bytes): the same values, read in 32-bit words. `padded` marks that
layout; `dequantize` and every kernel read both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

FLOAT_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


def block_shape(qtype: GGMLQuantizationType) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGML type."""
    return GGML_QUANT_SIZES[qtype]


# Block bytes of the padded layout (`QTensor.aligned`), per type that has one.
PADDED_BLOCK_BYTES = {GGMLQuantizationType.Q6_K: 224}


def row_bytes(qtype: GGMLQuantizationType, n: int, padded: bool = False) -> int:
    """Bytes that a row of `n` values takes in `qtype` (n must be a multiple of the block), in
    the padded layout when `padded`."""
    block, nbytes = block_shape(qtype)
    if n % block:
        raise ValueError(f"row of {n} values is not a multiple of {qtype.name}'s block {block}")
    return n // block * (PADDED_BLOCK_BYTES[qtype] if padded else nbytes)


@dataclass
class QTensor:
    data: torch.Tensor  # uint8 [*outer, row_bytes] for quantized types; typed, logical shape else
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # logical shape, torch order
    # An optional copy of the dequantized values in an activation dtype, [*shape], on the same
    # device (`kernels.dequant_mm.cache_values`; on the CPU `CausalLM.cache_weight_values`):
    # matmuls read it instead of dequantizing on every call. Indexing carries its slice; `to`
    # does not carry it.
    values: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # Blocks stored in the padded layout (`aligned`; PADDED_BLOCK_BYTES), not the file's.
    padded: bool = False

    def __post_init__(self) -> None:
        self.shape = tuple(int(s) for s in self.shape)
        if self.padded and self.qtype not in PADDED_BLOCK_BYTES:
            raise ValueError(f"{self.qtype.name} has no padded layout")
        if self.is_float:
            if tuple(self.data.shape) != self.shape:
                raise ValueError(f"float tensor data {tuple(self.data.shape)} != {self.shape}")
        else:
            expect = (*self.shape[:-1], row_bytes(self.qtype, self.shape[-1], self.padded))
            if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expect:
                raise ValueError(
                    f"{self.qtype.name} data {self.data.dtype} {tuple(self.data.shape)} "
                    f"!= uint8 {expect}"
                )

    @property
    def is_float(self) -> bool:
        return self.qtype in FLOAT_TYPES

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def values_in(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The cached copy of the values (`values`) when it is in `dtype`, else None."""
        return self.values if self.values is not None and self.values.dtype == dtype else None

    @property
    def block_bytes(self) -> int:
        """Bytes from one block to the next along a row (the padded size when `padded`)."""
        if self.padded:
            return PADDED_BLOCK_BYTES[self.qtype]
        return block_shape(self.qtype)[1]

    def with_data(self, data: torch.Tensor, shape: Sequence[int]) -> QTensor:
        """A QTensor of this one's type and block layout (`padded`) over `data`, rows cut from
        or stacked with its own, of logical `shape`."""
        return QTensor(data, self.qtype, tuple(shape), padded=self.padded)

    def to(self, device: torch.device | str, aligned: bool = False) -> QTensor:
        """A copy on `device`; with `aligned`, in the padded layout where the type has one."""
        out = self.with_data(self.data.to(device), self.shape)
        return out.aligned() if aligned else out

    def aligned(self) -> QTensor:
        """This tensor in the padded layout (itself when already padded or without one): each
        block's bytes followed by zeros up to PADDED_BLOCK_BYTES."""
        if self.padded or self.qtype not in PADDED_BLOCK_BYTES:
            return self
        nbytes = block_shape(self.qtype)[1]
        blocks = self.data.reshape(*self.data.shape[:-1], -1, nbytes)
        out = blocks.new_zeros((*blocks.shape[:-1], PADDED_BLOCK_BYTES[self.qtype]))
        out[..., :nbytes] = blocks
        return QTensor(out.flatten(-2), self.qtype, self.shape, padded=True)

    def native(self) -> torch.Tensor:
        """The data in the file's block layout (a copy when padded)."""
        if not self.padded:
            return self.data
        nbytes = block_shape(self.qtype)[1]
        blocks = self.data.reshape(*self.data.shape[:-1], -1, self.block_bytes)
        return blocks[..., :nbytes].flatten(-2)

    def __getitem__(self, index: int) -> QTensor:
        """Slice along the first (outer) dimension, e.g. one expert of a stacked [E, out, in]."""
        if len(self.shape) < 2:
            raise IndexError("cannot index a 1-D QTensor")
        values = self.values[index] if self.values is not None else None
        return QTensor(self.data[index], self.qtype, self.shape[1:], values, self.padded)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reference dequantization (torch, vectorized) to `dtype`, logical shape."""
        from moestream.weights.dequant import dequantize

        return dequantize(self.native(), self.qtype, self.shape).to(dtype)

    @classmethod
    def from_float(cls, t: torch.Tensor) -> QTensor:
        qtype = {v: k for k, v in FLOAT_TYPES.items()}.get(t.dtype)
        if qtype is None:
            raise ValueError(f"no GGML float type for {t.dtype}")
        return cls(t, qtype, tuple(t.shape))

"""`quantize`: float weights -> rows of GGUF blocks, for `moestream convert`, `synth` and tests.

Float types and the legacy block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) go through
`gguf.quants.quantize`, which follows llama.cpp's reference quantizers. The K-quants
(Q2_K..Q6_K), which gguf-py cannot write, come from `quantize_k`, a vectorized port of
llama.cpp's reference algorithms (without importance matrix). The result dequantizes with
`gguf.quants.dequantize` and with llama.cpp.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from moestream.errors import UnsupportedError
from moestream.weights import quantize_k

Q = GGMLQuantizationType

K_QUANTIZERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    Q.Q2_K: quantize_k.quantize_q2_k,
    Q.Q3_K: quantize_k.quantize_q3_k,
    Q.Q4_K: quantize_k.quantize_q4_k,
    Q.Q5_K: quantize_k.quantize_q5_k,
    Q.Q6_K: quantize_k.quantize_q6_k,
}
GGUF_PY_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
QUANTIZABLE_TYPES = (*GGUF_PY_TYPES, *K_QUANTIZERS)

# Super-blocks per call of a K-quantizer: 512 x 256 values keep its float32 working arrays
# (~0.5 MiB each) in L2; larger chunks run slower, smaller ones pay numpy's per-call overhead.
K_CHUNK_BLOCKS = 512


def can_quantize(qtype: GGMLQuantizationType, n: int) -> bool:
    """Whether rows of `n` values can be written as `qtype` (supported, n a block multiple)."""
    return qtype in QUANTIZABLE_TYPES and n % GGML_QUANT_SIZES[qtype][0] == 0


def quantize(x: np.ndarray | torch.Tensor, qtype: GGMLQuantizationType) -> np.ndarray:
    """Quantize `x` [..., n] to uint8 [..., row_bytes] in exact GGUF block layout.

    Blocks run along the last dimension; `n` must be a multiple of the type's block size
    (32 or 256 values; 1 for F32/F16/BF16) and `row_bytes` is n / block * bytes per block.
    Values are taken as float32 and must be finite for block types. Deterministic: the same
    input gives the same bytes. Raises UnsupportedError for a type this module cannot write or a
    row length that is not a multiple of its block.
    """
    qtype = GGMLQuantizationType(qtype)
    if qtype not in QUANTIZABLE_TYPES:
        names = ", ".join(t.name for t in QUANTIZABLE_TYPES)
        raise UnsupportedError(f"cannot quantize to {qtype.name}; supported types: {names}")
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float32).numpy()
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 0:
        raise ValueError("quantize needs at least one dimension, got a scalar")
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = x.shape[-1]
    if n % block:
        raise UnsupportedError(
            f"rows of {n} values cannot be stored as {qtype.name}, whose blocks hold {block} values"
        )
    out_shape = (*x.shape[:-1], n // block * type_size)
    if x.size == 0:
        return np.empty(out_shape, np.uint8)
    if block > 1 and not np.isfinite(x).all():
        raise ValueError(f"cannot quantize to {qtype.name}: the values contain NaN or infinity")
    if qtype in K_QUANTIZERS:
        return _quantize_k(x, qtype).reshape(out_shape)
    return np.ascontiguousarray(gguf_quants.quantize(x, qtype)).view(np.uint8).reshape(out_shape)


def _quantize_k(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = x.reshape(-1, block)  # [B, 256]
    out = np.empty((len(blocks), type_size), np.uint8)  # [B, type_size]
    quantize_blocks = K_QUANTIZERS[qtype]
    for start in range(0, len(blocks), K_CHUNK_BLOCKS):
        stop = start + K_CHUNK_BLOCKS
        out[start:stop] = quantize_blocks(blocks[start:stop])
    return out

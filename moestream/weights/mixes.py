"""Quant mixes: which GGML type each tensor gets, following llama.cpp's `llama-quantize`.

The rules are those of `llama_tensor_get_type` in llama.cpp's src/llama-quant.cpp, restricted to
the architectures and mixes moestream writes. Layer indices come from the tensor name (llama.cpp
orders weights by layer, so its running counters equal the layer index).

- Never quantized (kept F32, as convert_hf_to_gguf.py writes them): 1-D tensors, biases, norms
  (`*_norm.weight`) and the MoE router `ffn_gate_inp`.
- F32 / F16 / BF16: every other tensor in that type.
- Q8_0, Q4_0, Q6_K: the base type, except `output` (and `token_embd` when tied) at Q6_K unless
  the base is Q8_0, and, for models with exactly 8 experts, attn_v and attn_k at Q8_0.
- Q4_K_M (base Q4_K): `output` Q6_K; attn_v and ffn_down / ffn_down_exps at Q6_K on the layers
  `use_more_bits(i, n)` selects (the first and last eighth, and every third layer between);
  with exactly 8 experts attn_v and attn_k go to Q8_0 and attn_output to Q5_K.
- Q2_K (base Q2_K): `output` Q6_K; attn_v Q4_K when n_head / n_head_kv >= 4 else Q3_K (Q8_0 with
  8 experts, as is attn_k); ffn_down / ffn_down_exps Q3_K; attn_output Q3_K (Q5_K with 8
  experts). token_embd stays at the base type in every mix unless tied.
- Llama 70B (80 layers, GQA): an attn_v the rules above put at Q3_K or Q4_K gets Q5_K.
- `output` (and tied `token_embd`) whose rows are not a multiple of the base type's block: Q8_0.

Fallback when a row (the innermost dimension, `ne[0]`) is not a multiple of the chosen type's
block, as llama.cpp's `tensor_type_fallback`: Q2_K, Q3_K -> Q4_0; Q4_K -> Q5_0; Q5_K -> Q5_1;
Q6_K -> Q8_0; and when even that (block 32) does not divide the row, or the chosen type is a
32-block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) that does not, F16 (convert_hf_to_gguf.py's
fallback; llama-quantize would refuse).

Per-layer overrides (`"33-39=Q4_K,40=Q6_K"`) set the type of every quantizable matrix of those
layers, like llama-quantize's `--tensor-type`: the mix rules are skipped for them, the fallback
still applies, and norms and the router stay F32.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from moestream.config import ModelConfig
from moestream.errors import RequestError
from moestream.weights.layout import layer_of, tensor_kind

Q = GGMLQuantizationType


@dataclass(frozen=True)
class QuantMix:
    name: str
    ftype: LlamaFileType  # written to general.file_type
    base: GGMLQuantizationType


MIXES: dict[str, QuantMix] = {
    m.name: m
    for m in (
        QuantMix("F32", LlamaFileType.ALL_F32, Q.F32),
        QuantMix("F16", LlamaFileType.MOSTLY_F16, Q.F16),
        QuantMix("BF16", LlamaFileType.MOSTLY_BF16, Q.BF16),
        QuantMix("Q8_0", LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
        QuantMix("Q4_0", LlamaFileType.MOSTLY_Q4_0, Q.Q4_0),
        QuantMix("Q6_K", LlamaFileType.MOSTLY_Q6_K, Q.Q6_K),
        QuantMix("Q4_K_M", LlamaFileType.MOSTLY_Q4_K_M, Q.Q4_K),
        QuantMix("Q2_K", LlamaFileType.MOSTLY_Q2_K, Q.Q2_K),
    )
}

# Types a tensor may be written in (mix results, fallbacks and per-layer overrides).
WRITABLE_TYPES = (
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
)  # fmt: skip
FLOAT_QTYPES = (Q.F32, Q.F16, Q.BF16)
_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def get_mix(name: str) -> QuantMix:
    mix = MIXES.get(name.upper())
    if mix is None:
        raise RequestError(f"unknown quant mix {name!r} (choose from {', '.join(MIXES)})")
    return mix


def parse_qtype(name: str) -> GGMLQuantizationType:
    """`"q4_k"` -> Q4_K, for the types a tensor may be written in."""
    qtype = Q.__members__.get(name.strip().upper())
    if qtype is None or qtype not in WRITABLE_TYPES:
        choices = ", ".join(t.name for t in WRITABLE_TYPES)
        raise RequestError(f"unknown tensor type {name!r} (choose from {choices})")
    return qtype


def parse_layer_quant(spec: str) -> dict[range | int, str]:
    """`"33-39=Q4_K,40=Q6_K"` -> {range(33, 40): "Q4_K", 40: "Q6_K"} (ranges inclusive)."""
    out: dict[range | int, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        layers, sep, qname = part.partition("=")
        try:
            if not sep:
                raise ValueError
            parse_qtype(qname)
            lo, dash, hi = layers.strip().partition("-")
            key: range | int = range(int(lo), int(hi) + 1) if dash else int(lo)
        except (ValueError, RequestError):
            raise RequestError(
                f"invalid --layer-quant entry {part!r} (expected LAYER=TYPE or FIRST-LAST=TYPE, "
                f"e.g. 33-39=Q4_K)"
            ) from None
        out[key] = qname.strip().upper()
    return out


def _layer_types(
    layer_quant: Mapping[range | int, str] | None, n_layers: int
) -> dict[int, GGMLQuantizationType]:
    types: dict[int, GGMLQuantizationType] = {}
    for key, qname in (layer_quant or {}).items():
        layers = key if isinstance(key, range) else [key]
        for i in layers:
            if not 0 <= i < n_layers:
                raise RequestError(f"--layer-quant layer {i} is out of range (0..{n_layers - 1})")
            types[i] = parse_qtype(qname)
    return types


def is_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """llama.cpp's `tensor_allows_quantization` for these architectures."""
    return (
        len(shape) >= 2
        and name.endswith(".weight")
        and not name.endswith("_norm.weight")
        and "ffn_gate_inp" not in name
    )


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits: the first and last eighth, every third
    layer between."""
    first, last = n_layers // 8, 7 * n_layers // 8
    return i_layer < first or i_layer >= last or (i_layer - first) % 3 == 2


def fallback_qtype(qtype: GGMLQuantizationType, n_cols: int) -> GGMLQuantizationType:
    """The type a row of `n_cols` values can actually be stored in (see the module doc)."""
    if qtype in FLOAT_QTYPES or n_cols % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, Q.F16)
    return qtype if n_cols % GGML_QUANT_SIZES[qtype][0] == 0 else Q.F16


def _is_llama_70b(config: ModelConfig) -> bool:
    """llama.cpp's LLM_TYPE_70B: llama with 80 layers and grouped-query attention."""
    return config.arch == "llama" and config.n_layers == 80 and config.n_heads != config.n_kv_heads


def _mix_type(
    mix: QuantMix, kind: str, layer: int | None, n_cols: int, config: ModelConfig, tied: bool
) -> GGMLQuantizationType:
    ftype, new = mix.ftype, mix.base
    if new in FLOAT_QTYPES:
        return new
    n_layers, eight_experts = config.n_layers, config.n_experts == 8
    n_gqa = config.n_heads // config.n_kv_heads
    if kind == "output" or (tied and kind == "token_embd"):
        if n_cols % GGML_QUANT_SIZES[new][0]:
            return Q.Q8_0
        return new if new == Q.Q8_0 else Q.Q6_K
    if kind == "token_embd" or layer is None:
        return new
    if kind == "attn_v":
        if ftype == LlamaFileType.MOSTLY_Q2_K:
            new = Q.Q4_K if n_gqa >= 4 else Q.Q3_K
        elif ftype == LlamaFileType.MOSTLY_Q4_K_M and use_more_bits(layer, n_layers):
            new = Q.Q6_K
        if _is_llama_70b(config) and new in (Q.Q3_K, Q.Q4_K):
            new = Q.Q5_K  # 8 heads share each attn_v row: more bits cost little
        return Q.Q8_0 if eight_experts else new
    if kind == "attn_k":
        return Q.Q8_0 if eight_experts else new
    if kind in ("ffn_down", "ffn_down_exps"):
        if ftype == LlamaFileType.MOSTLY_Q2_K:
            return Q.Q3_K
        if ftype == LlamaFileType.MOSTLY_Q4_K_M and use_more_bits(layer, n_layers):
            return Q.Q6_K
        return new
    if kind == "attn_output":
        if eight_experts and ftype in (LlamaFileType.MOSTLY_Q2_K, LlamaFileType.MOSTLY_Q4_K_M):
            return Q.Q5_K
        if not eight_experts and ftype == LlamaFileType.MOSTLY_Q2_K:
            return Q.Q3_K
    return new


def tensor_qtypes(
    config: ModelConfig,
    shapes: Mapping[str, tuple[int, ...]],
    mix: str | QuantMix,
    layer_quant: Mapping[range | int, str] | None = None,
) -> dict[str, GGMLQuantizationType]:
    """GGML type of every tensor (`shapes`: GGUF name -> torch-order shape) under a mix."""
    mix = get_mix(mix) if isinstance(mix, str) else mix
    overrides = _layer_types(layer_quant, config.n_layers)
    tied = "output.weight" not in shapes
    types: dict[str, GGMLQuantizationType] = {}
    for name, shape in shapes.items():
        if not is_quantizable(name, shape):
            types[name] = Q.F32
            continue
        layer = layer_of(name)
        if layer in overrides:
            qtype = overrides[layer]
        else:
            qtype = _mix_type(mix, tensor_kind(name), layer, shape[-1], config, tied)
        types[name] = fallback_qtype(qtype, shape[-1])
    return types

"""Tensor names: Hugging Face checkpoint names -> llama.cpp GGUF names.

Inside moestream every weight is addressed by its GGUF name and held in GGUF conventions
(torch-order shapes, stacked experts [E, out, in], llama Q/K rows permuted for llama.cpp's
adjacent-pair RoPE), whichever format it came from.
"""

from __future__ import annotations

import re

import torch

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
_EXPERT_PROJ = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def gguf_name(hf_name: str) -> str | tuple[str, int] | None:
    """GGUF name of an HF tensor; (stacked name, expert index) for one expert of a stack;
    None for tensors llama.cpp does not keep (e.g. rotary inv_freq)."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    m = _LAYER_RE.match(hf_name)
    if not m:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if rest in _LAYER:
        return f"blk.{layer}.{_LAYER[rest]}"
    e = _EXPERT_RE.match(rest)
    if e:
        return (f"blk.{layer}.{_EXPERT_PROJ[e.group(2)]}.weight", int(e.group(1)))
    if rest == "mlp.experts.gate_up_proj":  # fused layout of newer transformers: [E, 2F, H]
        return f"blk.{layer}.ffn_gate_up_exps.weight"
    if rest == "mlp.experts.down_proj":  # fused: [E, H, F]
        return f"blk.{layer}.ffn_down_exps.weight"
    if rest.endswith("rotary_emb.inv_freq"):
        return None
    return None


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF (rotate-half) rows -> llama.cpp (adjacent pairs) rows, as llama.cpp's convert does for
    llama-family Q/K weights. `n_head` is the head count of that projection."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of `permute_qk` (for comparing with HF implementations)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

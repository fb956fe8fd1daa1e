"""The tensors a model of a given `ModelConfig` has: GGUF names and torch-order shapes.

One table serves the loader (every tensor checked against the hyperparameters before use),
`convert`, `synth` and `info`.
"""

from __future__ import annotations

from moestream.config import ModelConfig

# Tensor kinds of a block, as llama.cpp names them (blk.N.<kind>.weight).
ATTN_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output")
EXPERT_KINDS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def expected_shapes(config: ModelConfig, tied: bool | None = None) -> dict[str, tuple[int, ...]]:
    """GGUF name -> shape for every tensor of the model, in file order."""
    c = config
    h = c.hidden_size
    tied = c.tie_embeddings if tied is None else tied
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (c.vocab_size, h)}
    for i in range(c.n_layers):
        b = f"blk.{i}."
        shapes[b + "attn_norm.weight"] = (h,)
        shapes[b + "attn_q.weight"] = (c.q_size, h)
        shapes[b + "attn_k.weight"] = (c.kv_size, h)
        shapes[b + "attn_v.weight"] = (c.kv_size, h)
        if c.has_qkv_bias:
            shapes[b + "attn_q.bias"] = (c.q_size,)
            shapes[b + "attn_k.bias"] = (c.kv_size,)
            shapes[b + "attn_v.bias"] = (c.kv_size,)
        shapes[b + "attn_output.weight"] = (h, c.q_size)
        if c.has_qk_norm:
            shapes[b + "attn_q_norm.weight"] = (c.head_dim,)
            shapes[b + "attn_k_norm.weight"] = (c.head_dim,)
        shapes[b + "ffn_norm.weight"] = (h,)
        if c.is_moe:
            e, f = c.n_experts, c.expert_ffn_size
            shapes[b + "ffn_gate_inp.weight"] = (e, h)
            shapes[b + "ffn_gate_exps.weight"] = (e, f, h)
            shapes[b + "ffn_up_exps.weight"] = (e, f, h)
            shapes[b + "ffn_down_exps.weight"] = (e, h, f)
        else:
            shapes[b + "ffn_gate.weight"] = (c.ffn_size, h)
            shapes[b + "ffn_up.weight"] = (c.ffn_size, h)
            shapes[b + "ffn_down.weight"] = (h, c.ffn_size)
    shapes["output_norm.weight"] = (h,)
    if not tied:
        shapes["output.weight"] = (c.vocab_size, h)
    return shapes


def tensor_kind(name: str) -> str:
    """`blk.3.attn_q.weight` -> `attn_q`; `output.weight` -> `output`."""
    parts = name.split(".")
    return parts[2] if parts[0] == "blk" else parts[0]


def layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" else None


def is_expert(name: str) -> bool:
    return tensor_kind(name) in EXPERT_KINDS

"""RoPE: frequencies of every scaling type against transformers, and the two layouts."""

from __future__ import annotations

import math

import pytest
import torch

from moestream.config import ModelConfig, RopeScaling
from moestream.layers.rope import RotaryEmbedding, apply_rope, default_inv_freq, rope_parameters
from moestream.weights.names import permute_qk, unpermute_qk


def config(arch: str = "llama", head_dim: int = 16, **kw) -> ModelConfig:
    return ModelConfig(
        arch=arch, n_layers=1, hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=head_dim,
        vocab_size=32, ffn_size=32, **kw,
    )  # fmt: skip


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_type="linear", rope_theta=500000.0, factor=3.0),
        dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=8192,
        ),
        dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32768),
        dict(
            rope_type="yarn", rope_theta=1e4, factor=2.0, beta_fast=16, beta_slow=2,
            original_max_position_embeddings=4096,
        ),
    ],
)  # fmt: skip
def test_scaled_frequencies_match_transformers(rope: dict) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(
        hidden_size=512, num_attention_heads=4, head_dim=128, max_position_embeddings=8192,
        rope_parameters=dict(rope),
    )  # fmt: skip
    inv_ref, scale_ref = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    inv, scale = rope_parameters(ModelConfig.from_hf_config(hf.to_dict()))
    assert torch.equal(inv, inv_ref)  # bit for bit (measured)
    assert scale == pytest.approx(scale_ref, rel=1e-12)


def test_default_frequencies() -> None:
    inv, scale = rope_parameters(config(rope_theta=10000.0))
    expect = torch.tensor([10000.0 ** (-i / 16) for i in range(0, 16, 2)], dtype=torch.float64)
    assert scale == 1.0
    torch.testing.assert_close(inv.double(), expect, rtol=1e-6, atol=0)


def test_llama3_rope_freqs_tensor_replaces_config_scaling() -> None:
    """GGUF's rope_freqs.weight divides the base frequencies; it wins over the config type."""
    divisors = torch.linspace(1.0, 8.0, 8)
    c = config(rope_scaling=RopeScaling(type="linear", factor=5.0))
    inv, scale = rope_parameters(c, divisors)
    torch.testing.assert_close(inv, default_inv_freq(10000.0, 16) / divisors, rtol=0, atol=0)
    assert scale == 1.0
    with pytest.raises(ValueError):
        rope_parameters(c, torch.ones(5))


def test_adjacent_layout_on_permuted_rows_equals_neox() -> None:
    """llama in GGUF: adjacent-pair RoPE on permuted Q rows == rotate-half on the original."""
    g = torch.Generator().manual_seed(0)
    t, n, d = 5, 3, 16
    x = torch.randn(t, n * d, generator=g)  # rows of a projection output, HF order
    x_gguf = permute_qk(x.T, n).T  # the same output under GGUF-permuted weight rows
    rope = RotaryEmbedding(config(), "cpu")
    cos, sin = rope.cos_sin(torch.arange(7, 7 + t))
    neox = apply_rope(x.view(t, n, d), cos, sin, neox=True).reshape(t, n * d)
    adjacent = apply_rope(x_gguf.view(t, n, d), cos, sin, neox=False).reshape(t, n * d)
    torch.testing.assert_close(unpermute_qk(adjacent.T, n).T, neox, rtol=0, atol=0)


@pytest.mark.parametrize("neox", [True, False])
def test_rotation_properties(neox: bool) -> None:
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(config("qwen3" if neox else "llama"), "cpu")
    q, k = torch.randn(1, 2, 16, generator=g), torch.randn(1, 2, 16, generator=g)
    cos0, sin0 = rope.cos_sin(torch.tensor([0]))
    assert torch.equal(rope.apply(q, cos0, sin0), q)  # position 0 is the identity

    # q at m and k at m' score the same as at m + s, m' + s: only the distance matters
    def score(m: int, mk: int) -> torch.Tensor:
        qm = rope.apply(q, *rope.cos_sin(torch.tensor([m])))
        kn = rope.apply(k, *rope.cos_sin(torch.tensor([mk])))
        return (qm * kn).sum(-1)

    torch.testing.assert_close(score(9, 4), score(109, 104), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(score(9, 4), score(9, 5), atol=1e-3)
    qm = rope.apply(q, *rope.cos_sin(torch.tensor([33])))
    torch.testing.assert_close(qm.norm(dim=-1), q.norm(dim=-1))  # a rotation keeps norms


def test_partial_rotary_leaves_the_tail() -> None:
    rope = RotaryEmbedding(config("qwen3", rope_dim=8), "cpu")
    x = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(2))
    cos, sin = rope.cos_sin(torch.tensor([1, 2, 3]))
    assert cos.shape == (3, 4)
    y = rope.apply(x, cos, sin)
    assert torch.equal(y[..., 8:], x[..., 8:]) and not torch.allclose(y[..., :8], x[..., :8])


def test_yarn_scales_cos_sin() -> None:
    s = RopeScaling(type="yarn", factor=4.0, original_context_length=64)
    rope = RotaryEmbedding(config("qwen3", rope_scaling=s), "cpu")
    cos, sin = rope.cos_sin(torch.tensor([0]))
    assert cos[0, 0].item() == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-6)

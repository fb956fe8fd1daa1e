"""Rotary position embedding: inverse frequencies for each scaling type, and the two layouts.

Layouts: NeoX (Qwen) rotates dimension i with i + d/2 of the rotated part; the adjacent-pair
layout (llama in GGUF) rotates 2i with 2i + 1, which is what llama.cpp expects of Q/K weights
whose rows were permuted at conversion (`weights.names.permute_qk`). Both give the same
attention as transformers' rotate-half on the unpermuted weights.

Scaling follows transformers (`modeling_rope_utils`): linear divides the frequencies by the
factor; llama3 interpolates between the unscaled and the divided frequencies by wavelength;
yarn mixes them with a linear ramp over the correction range and scales cos/sin by an
attention factor. A GGUF carries llama3 scaling as `rope_freqs.weight`: per-frequency divisors,
used as given when present.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from moestream.config import ModelConfig, RopeScaling


def default_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    """theta^(-2i/d) for i < d/2, float32 [d/2], computed as transformers does."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (theta**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by the factor, short ones kept, a smooth
    interpolation in between (transformers' `_compute_llama3_parameters`)."""
    old_context = s.original_context_length
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_inv_freq(
    theta: float, rotary_dim: int, s: RopeScaling, original_context: int
) -> tuple[torch.Tensor, float]:
    """YaRN frequencies and cos/sin scale (transformers' `_compute_yarn_parameters`, truncated
    correction range as in llama.cpp). `s.attn_factor` multiplies the default 0.1 ln(s) + 1,
    as llama.cpp's `rope.scaling.attn_factor` does."""
    d = rotary_dim
    mscale = 1.0 if s.factor <= 1 else 0.1 * math.log(s.factor) + 1.0

    def correction_dim(rotations: float) -> float:
        return (d * math.log(original_context / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), d - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, d, 2).float() / d)
    inv_extrapolation = 1.0 / pos_freqs
    inv_interpolation = 1.0 / (s.factor * pos_freqs)
    inv_freq = (
        inv_interpolation * (1 - extrapolation_factor) + inv_extrapolation * extrapolation_factor
    )
    return inv_freq, s.attn_factor * mscale


def rope_parameters(
    config: ModelConfig, rope_freqs: torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies float32 [rotary_dim / 2], cos/sin scale) for a model.

    `rope_freqs` [rotary_dim / 2] are GGUF per-frequency divisors (llama3 scaling in GGUF);
    when given they replace the scaling named in the config.
    """
    d, theta, s = config.rotary_dim, config.rope_theta, config.rope_scaling
    inv_freq = default_inv_freq(theta, d)
    if rope_freqs is not None:
        if tuple(rope_freqs.shape) != (d // 2,):
            raise ValueError(f"rope_freqs has shape {tuple(rope_freqs.shape)}, expected {d // 2}")
        return inv_freq / rope_freqs.float().cpu(), 1.0
    original_context = s.original_context_length or config.context_length
    if s.type == "none":
        return inv_freq, 1.0
    if s.type == "linear":
        return inv_freq / s.factor, 1.0
    if s.type == "llama3":
        return llama3_inv_freq(inv_freq, replace(s, original_context_length=original_context)), 1.0
    if s.type == "yarn":
        return yarn_inv_freq(theta, d, s, original_context)
    raise ValueError(f"unknown RoPE scaling type {s.type!r}")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """Rotate the first 2 * cos.shape[-1] dims of each head of x [T, n, D] by positions' angles.

    cos, sin [T, R/2] float32. Math in float32; result in x's dtype.
    """
    half = cos.shape[-1]
    x32 = x.float()
    rot, rest = x32[..., : 2 * half], x32[..., 2 * half :]
    if neox:
        x1, x2 = rot[..., :half], rot[..., half:]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, R/2]
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    out = torch.cat((o1, o2), dim=-1) if neox else torch.stack((o1, o2), dim=-1).flatten(-2)
    if rest.shape[-1]:
        out = torch.cat((out, rest), dim=-1)
    return out.to(x.dtype)


class RotaryEmbedding:
    """A model's RoPE: frequencies fixed at build; angles computed per step from positions.

    On a CUDA device the cos/sin of every position up to the context length are tabulated once
    at build ([L, R] float32: cos then sin), so a step looks its positions up in one gather
    instead of computing them (the same float32 ops per element, so the same values); the CPU
    computes them per step as before.
    """

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str,
        rope_freqs: torch.Tensor | None = None,
    ):
        inv_freq, self.attention_scaling = rope_parameters(config, rope_freqs)
        self.inv_freq = inv_freq.to(device)  # [R/2] float32
        self.neox = config.rope_neox
        self.cos_sin_table: torch.Tensor | None = None  # [L, R] float32 (CUDA only)
        if torch.device(device).type == "cuda":
            positions = torch.arange(config.context_length, device=device)
            self.cos_sin_table = torch.cat(self._angles_cos_sin(positions), dim=-1).contiguous()

    def _angles_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, R/2]
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, R/2] float32 (scaled by the attention factor).

        On CUDA they are views of one gathered [T, R] tensor (unit last stride, row stride R);
        positions must be below the model's context length there."""
        if self.cos_sin_table is not None and positions.is_cuda:
            half = self.inv_freq.shape[0]
            cs = self.cos_sin_table[positions]  # [T, R]
            return cs[:, :half], cs[:, half:]
        return self._angles_cos_sin(positions)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, n, D] -> [T, n, D] rotated in this model's layout."""
        return apply_rope(x, cos, sin, self.neox)

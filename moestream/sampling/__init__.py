"""Batched sampling on the device (torch): penalties, truncation, seeded draws, logprobs and
rejection sampling for speculative decoding."""

from moestream.sampling.logprobs import LogprobsMode, TokenLogprobs, gather_logprobs
from moestream.sampling.penalties import apply_penalties
from moestream.sampling.rejection import rejection_sample
from moestream.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    argmax_only,
    process_logits,
    step_seed,
)

__all__ = [
    "LogprobsMode",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "TokenLogprobs",
    "apply_penalties",
    "argmax_only",
    "gather_logprobs",
    "process_logits",
    "rejection_sample",
    "step_seed",
]

"""The CPU keeps dequantized weight values (`CausalLM.cache_weight_values` on the CPU): every
matmul then reads them instead of dequantizing, and every logit keeps its bits, whole or within
a budget that covers only part of the model."""

from __future__ import annotations

import pytest
import torch

from moestream.cli import DEMO_MODEL
from moestream.layers.attention import AttentionMetadata
from moestream.layers.moe import StackedExperts
from moestream.llm import LLM
from moestream.models.registry import build_model
from moestream.weights.loader import open_model


def logits_of(model, prompt: list[int]) -> torch.Tensor:
    kv = model.make_kv_cache(4, 16)
    attn = AttentionMetadata.build([(0, len(prompt), [0, 1])], 16, "cpu")
    with torch.inference_mode():
        hidden = model.forward(torch.tensor(prompt), torch.arange(len(prompt)), attn, kv)
        return model.compute_logits(hidden)  # [T, V]


@pytest.fixture(scope="module")
def source():
    return open_model(DEMO_MODEL)


@pytest.mark.parametrize("budget_mib", [1, 1024])  # part of one layer; the whole model
def test_cached_values_give_the_same_logits_bit_for_bit(source, budget_mib):
    prompt = [5, 91, 17, 300, 42, 7, 1000, 3, 64, 64, 12]
    model = build_model(source)
    want = logits_of(model, prompt)
    used = model.cache_weight_values(budget_mib * 2**20)
    assert 0 < used <= budget_mib * 2**20
    experts = model.layers[0].ffn.experts
    assert isinstance(experts, StackedExperts)
    cached = experts.gate_exps.values is not None
    assert cached == (budget_mib == 1024)
    # the per-expert views the CPU path multiplies share the stack's values
    assert (experts.weights(3)[0].values is not None) == cached
    if cached:
        assert torch.equal(experts.weights(3)[0].values, experts.gate_exps.values[3])
        assert model.lm_head.values is not None or model.lm_head.is_float
    assert torch.equal(logits_of(model, prompt), want)


def test_matmuls_read_the_cached_values(source, monkeypatch):
    """With the whole model cached, a forward dequantizes no quantized matmul weight (a float
    weight, the router's, is only cast)."""
    from moestream.weights.qtensor import QTensor

    model = build_model(source)
    model.cache_weight_values(2**30)
    calls = []
    dequantize = QTensor.dequantize

    def counting(self, dtype=torch.float32):
        if not self.is_float:
            calls.append(self.shape)
        return dequantize(self, dtype)

    monkeypatch.setattr(QTensor, "dequantize", counting)
    logits_of(model, [5, 91, 17])
    assert all(len(shape) < 2 or shape == model.embed_tokens.shape for shape in calls), calls


def test_llm_caches_on_the_cpu_by_default_and_zero_turns_it_off():
    assert LLM(DEMO_MODEL).weight_cache_bytes > 0
    assert LLM(DEMO_MODEL, weight_cache_gib=0).weight_cache_bytes == 0

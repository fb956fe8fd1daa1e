"""The default KV pool on a GPU leaves room for a step's activations (no device needed: the
free-memory query is replaced)."""

from __future__ import annotations

import pytest
import torch

from moestream.cli import DEMO_MODEL
from moestream.config import CacheConfig, SchedConfig
from moestream.engine import draft_blocks_that_fit
from moestream.errors import CapacityError
from moestream.llm import LLM


def test_default_gpu_budget_keeps_the_activation_reserve(monkeypatch):
    engine = LLM(DEMO_MODEL, device="cpu").engine
    c = engine.model.config
    reserve = engine._activation_reserve()
    experts = c.n_experts * 3 * c.expert_ffn_size * c.hidden_size * 2
    assert reserve > experts > 0  # the MoE's bf16 expert copies are in it
    engine.sched_config = SchedConfig(max_num_batched_tokens=8192)
    assert engine._activation_reserve() > reserve  # more tokens per step: more reserve
    engine.sched_config = SchedConfig()

    free = 4 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 8 << 30))
    engine.device = torch.device("cuda")
    per_block = 2 * c.n_layers * 16 * c.n_kv_heads * c.head_dim * 2
    blocks = engine._num_blocks(CacheConfig(block_size=16), torch.bfloat16)
    assert blocks == int((free - reserve) // per_block)  # below 90% of free: the reserve binds
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 96 << 30))
    blocks = engine._num_blocks(CacheConfig(block_size=16), torch.bfloat16)
    assert blocks == int(0.9 * (80 << 30) // per_block)  # a large GPU: 90% binds
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (reserve // 2, 8 << 30))
    with pytest.raises(CapacityError, match="kept for a step's activations"):
        engine._num_blocks(CacheConfig(block_size=16), torch.bfloat16)


def test_draft_pool_fits_what_is_left():
    assert draft_blocks_that_fit(100 * 1000, 1000, 10, 64) == 64  # capped at the target's
    assert draft_blocks_that_fit(30 * 1000 + 999, 1000, 10, 64) == 30  # what fits
    with pytest.raises(CapacityError, match="9 blocks .* needs 10"):
        draft_blocks_that_fit(9 * 1000, 1000, 10, 64)
    with pytest.raises(CapacityError, match="0 blocks"):
        draft_blocks_that_fit(-5, 1000, 1, 64)  # the reserve alone exceeds free memory

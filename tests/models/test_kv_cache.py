"""The paged KV cache: incremental decode and batched sequences equal the one-shot forward."""

from __future__ import annotations

import pytest
import torch

from moestream.cache.kv_cache import PagedKVCache
from moestream.errors import CapacityError
from moestream.layers.attention import AttentionMetadata

# Incremental vs one-shot differ only by float32 summation order in the matmuls; the measured
# max relative difference over these tests is 7.1e-7.
TOLERANCE = 1e-5


def tokens(t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (t,), generator=torch.Generator().manual_seed(seed))


def step(model, kv, seqs: list[tuple[torch.Tensor, int, int, list[int]]]) -> list[torch.Tensor]:
    """Run one step over sequences given as (all token ids, start, new tokens, block ids);
    returns the logits of each sequence's new tokens."""
    ids = torch.cat([toks[start : start + n] for toks, start, n, _ in seqs])
    positions = torch.cat([torch.arange(start, start + n) for _, start, n, _ in seqs])
    attn = AttentionMetadata.build([(start, n, blocks) for _, start, n, blocks in seqs], 4, "cpu")
    logits = model.compute_logits(model.forward(ids, positions, attn, kv))  # [T, V]
    return list(logits.split(attn.query_lens_cpu))


@pytest.mark.parametrize("case", ["qwen3moe", "llama"])
def test_prefill_then_decode_matches_one_shot(tiny, case: str) -> None:
    """Prefill 7 tokens, decode 5 one at a time, through non-contiguous blocks [5, 2, 9]."""
    model = tiny.moestream(case)
    ids = tokens(12, seed=3)
    full = tiny.one_shot(model, ids)  # [12, V]
    kv = model.make_kv_cache(num_blocks=10, block_size=4)
    blocks = [5, 2, 9]
    (prefill,) = step(model, kv, [(ids, 0, 7, blocks)])
    assert tiny.rel_diff(prefill, full[:7]) < TOLERANCE
    for pos in range(7, 12):
        (decoded,) = step(model, kv, [(ids, pos, 1, blocks)])
        rel = tiny.rel_diff(decoded, full[pos : pos + 1])
        assert rel < TOLERANCE, f"position {pos}: relative difference {rel:.2e}"
    # the K/V went where the block table says: block 9 holds positions 8..11, unused blocks
    # (0, 1, 3, 4, 6, 7, 8) were never written
    written = kv.k[0].flatten(1).abs().sum(-1) > 0  # [num_blocks]
    assert written.tolist() == [b in blocks for b in range(10)]


def test_two_sequences_in_one_batch(tiny) -> None:
    """Two sequences of different lengths share steps: a batched prefill, then a step mixing a
    chunk of prefill with a decode, then batched decodes; each equals its one-shot forward."""
    model = tiny.moestream("qwen3moe")
    a, b = tokens(11, seed=4), tokens(9, seed=5)
    full_a, full_b = tiny.one_shot(model, a), tiny.one_shot(model, b)
    kv = model.make_kv_cache(num_blocks=8, block_size=4)
    blocks_a, blocks_b = [6, 1, 3], [0, 7, 4]
    out_a, out_b = step(model, kv, [(a, 0, 5, blocks_a), (b, 0, 3, blocks_b)])
    assert tiny.rel_diff(out_a, full_a[:5]) < TOLERANCE
    assert tiny.rel_diff(out_b, full_b[:3]) < TOLERANCE
    # a decodes one token while b prefills a chunk of 4
    out_a, out_b = step(model, kv, [(a, 5, 1, blocks_a), (b, 3, 4, blocks_b)])
    assert tiny.rel_diff(out_a, full_a[5:6]) < TOLERANCE
    assert tiny.rel_diff(out_b, full_b[3:7]) < TOLERANCE
    for pos_a, pos_b in ((6, 7), (7, 8)):
        out_a, out_b = step(model, kv, [(a, pos_a, 1, blocks_a), (b, pos_b, 1, blocks_b)])
        assert tiny.rel_diff(out_a, full_a[pos_a : pos_a + 1]) < TOLERANCE
        assert tiny.rel_diff(out_b, full_b[pos_b : pos_b + 1]) < TOLERANCE


def test_forward_is_deterministic(tiny) -> None:
    model = tiny.moestream("qwen3moe")
    ids = tokens(40, seed=6)
    assert torch.equal(tiny.one_shot(model, ids), tiny.one_shot(model, ids))


def test_metadata_build() -> None:
    attn = AttentionMetadata.build([(6, 2, [5, 2]), (0, 3, [9])], block_size=4, device="cpu")
    assert attn.query_start_loc.tolist() == [0, 2, 5]
    assert attn.seq_lens.tolist() == [8, 3]
    assert attn.block_tables.tolist() == [[5, 2], [9, 0]]
    # positions 6, 7 of the first sequence -> block 2, offsets 2, 3; then block 9, offsets 0..2
    assert attn.slot_mapping.tolist() == [10, 11, 36, 37, 38]
    assert attn.slot_mapping.dtype == torch.int64 and attn.block_tables.dtype == torch.int32
    assert (attn.query_lens_cpu, attn.seq_lens_cpu) == ([2, 3], [8, 3])
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([(4, 1, [0])], block_size=4, device="cpu")


def test_cache_shapes_and_budget(tiny) -> None:
    model = tiny.moestream("qwen3")
    kv = model.make_kv_cache(num_blocks=3, block_size=4)
    c = model.config
    assert len(kv.k) == len(kv.v) == c.n_layers
    assert kv.k[1].shape == (3, 4, c.n_kv_heads, c.head_dim) and kv.v[0].dtype == torch.float32
    # 2 (K, V) x 2 layers x 4 tokens x 2 heads x 16 dims x 4 bytes
    assert kv.bytes_per_block == 2 * 2 * 4 * 2 * 16 * 4
    half = model.make_kv_cache(num_blocks=1, block_size=4, dtype=torch.bfloat16)
    assert half.bytes_per_block == kv.bytes_per_block // 2
    n = PagedKVCache.blocks_for_budget(c, 1.0, 16, torch.bfloat16)
    assert n == 2**30 // (2 * 2 * 16 * 2 * 16 * 2)
    with pytest.raises(CapacityError):
        PagedKVCache.blocks_for_budget(c, 1e-9, 16, torch.float32)

"""The paged prefill-attention kernel (several new tokens per sequence, causal, GQA) against the
engine's reference attention over metadata built by `AttentionMetadata.build`, with fresh random
caches and shuffled block tables. Without CUDA the Triton interpreter runs it on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

from moestream.layers.attention import AttentionMetadata, paged_attention_per_query

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # the modules above do not import triton; the kernel module below does
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

pytest.importorskip("triton", reason="triton is not installed")

from moestream.kernels.prefill_attention import (  # noqa: E402
    DEFAULT_CONFIG,
    PrefillAttnConfig,
    paged_prefill_attention,
)

# Small tiles so that the tiny prompts below span many tiles and blocks of queries; every
# interpreter-visible choice (rows, tile, split loop, block-table load) is covered.
SMALL = PrefillAttnConfig(rows=16, block_n=16, split_loop=False)
CONFIGS = [
    SMALL,
    PrefillAttnConfig(rows=16, block_n=16),
    PrefillAttnConfig(rows=32, block_n=16, bt_tile=True),
    PrefillAttnConfig(rows=64, block_n=32, split_loop=False, bt_tile=True),
    PrefillAttnConfig(rows=32, block_n=32),
]


def case(n, g, d, block_size, seqs, dtype, seed):
    """Caches with random contents; per sequence (cached tokens, new tokens) -> metadata whose
    block lists are disjoint shuffled blocks, q [T, n, D] for the new tokens."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + t) // block_size) for c, t in seqs]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, block_size, g, d, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, block_size, g, d, generator=gen).to(DEVICE, dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    rows, at = [], 0
    for (cached, new), nb in zip(seqs, need, strict=True):
        rows.append((cached, new, perm[at : at + nb]))
        at += nb
    attn = AttentionMetadata.build(rows, block_size, DEVICE)
    q = torch.randn(attn.num_tokens, n, d, generator=gen).to(DEVICE, dtype)
    return q, k_cache, v_cache, attn


def run(q, k, v, attn, scale, config=SMALL):
    out = torch.full_like(q, float("nan"))
    return paged_prefill_attention(
        q, k, v, attn.block_tables, attn.query_start_loc, attn.seq_lens, scale,
        max(attn.query_lens_cpu), out=out, config=config,
    )  # fmt: skip


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.label)
@pytest.mark.parametrize(
    "n, g, d, block_size",
    [(8, 2, 32, 4), (4, 4, 16, 8), (6, 2, 24, 16), (16, 1, 16, 16)],
)
def test_matches_reference_float32(n, g, d, block_size, config):
    """GQA groups of 4, 1, 3 (padded to 4) and 16; head dims 32, 16, 24 (padded); a fresh
    prompt, a chunk after cached context, a single token, a chunk spanning several tiles."""
    seqs = [(0, 5), (9, 7), (20, 1), (3, 37)]
    q, k, v, attn = case(n, g, d, block_size, seqs, torch.float32, seed=n + d)
    out = run(q, k, v, attn, d**-0.5, config)
    ref = paged_attention_per_query(q, k, v, attn, d**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "config, prompt, cuts",
    [
        # 40 tokens in 4-token blocks over 16-key tiles: many diagonal and full tiles
        (PrefillAttnConfig(rows=16, block_n=16), 40, (17, 33, 39)),
        (SMALL, 40, (17, 33, 39)),
        # the engine's config: 32 tokens per block over 64-key tiles; cut 100 puts token 130
        # in a block whose tile 64 is diagonal, where the whole prompt's block sees it whole
        (DEFAULT_CONFIG, 150, (100, 129, 149)),
    ],
    ids=["split-small", "masked-small", "default"],
)
def test_query_result_does_not_depend_on_chunking_or_neighbours(config, prompt, cuts):
    """A prompt prefilled whole, in chunks, or beside another sequence, and its last token as a
    one-token step (what batch-invariant mode runs decode steps as): the same bits for each
    token (tiles start at position 0, masked tiles past a query change nothing, and a tile
    seen whole gives the same bits on the masked and the unmasked path)."""
    q, k, v, attn = case(8, 2, 32, 8, [(0, prompt), (0, 13)], torch.float32, seed=5)
    both = run(q, k, v, attn, 0.2, config)
    blocks = attn.block_tables[0].tolist()
    for cut in cuts:  # the first sequence's tail as its own chunk (the last: one token)
        rows = [(cut, prompt - cut, blocks)]
        part = AttentionMetadata.build(rows, 8, DEVICE)
        alone = run(q[cut:prompt].contiguous(), k, v, part, 0.2, config)
        assert torch.equal(alone, both[cut:prompt])


def test_bfloat16_close_to_reference():
    q, k, v, attn = case(8, 2, 64, 16, [(30, 20), (0, 9), (100, 60)], torch.bfloat16, seed=2)
    for config in (SMALL, DEFAULT_CONFIG):
        out = run(q, k, v, attn, 0.125, config)
        ref = paged_attention_per_query(q.float(), k.float(), v.float(), attn, 0.125)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_padding_sequences_read_nothing():
    """A CUDA-graph padding sequence (seq_len 0 under its query rows) gets zeros and reads no
    block table entry (its table row is out of range on purpose)."""
    q, k, v, attn = case(8, 2, 32, 8, [(0, 6), (5, 3)], torch.float32, seed=4)
    seq_lens = attn.seq_lens.clone()
    seq_lens[1] = 0
    tables = attn.block_tables.clone()
    tables[1] = 1 << 30
    out = paged_prefill_attention(
        q, k, v, tables, attn.query_start_loc, seq_lens, 0.3, 6, config=DEFAULT_CONFIG
    )
    ref = paged_attention_per_query(q, k, v, attn, 0.3)
    torch.testing.assert_close(out[:6], ref[:6], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[6:], torch.zeros_like(out[6:]))


def test_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="rows"):
        PrefillAttnConfig(rows=48)
    with pytest.raises(ValueError, match="block_n"):
        PrefillAttnConfig(block_n=8)
    with pytest.raises(ValueError, match="num_warps"):
        PrefillAttnConfig(num_warps=3)


def test_rejects_bad_arguments():
    q, k, v, attn = case(8, 2, 32, 8, [(0, 4)], torch.float32, seed=1)
    with pytest.raises(ValueError, match="query heads"):
        paged_prefill_attention(
            q[:, :7], k, v, attn.block_tables, attn.query_start_loc, attn.seq_lens, 1.0, 4
        )
    with pytest.raises(ValueError, match="B\\+1"):
        paged_prefill_attention(
            q, k, v, attn.block_tables, attn.query_start_loc[:1], attn.seq_lens, 1.0, 4
        )

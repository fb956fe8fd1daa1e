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

from moestream.kernels.prefill_attention import paged_prefill_attention  # noqa: E402


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


def run(q, k, v, attn, scale):
    out = torch.full_like(q, float("nan"))
    return paged_prefill_attention(
        q, k, v, attn.block_tables, attn.query_start_loc, attn.seq_lens, scale,
        max(attn.query_lens_cpu), out=out, block_n=16,
    )  # fmt: skip


@pytest.mark.parametrize(
    "n, g, d, block_size",
    [(8, 2, 32, 4), (4, 4, 16, 8), (6, 2, 24, 16), (16, 1, 16, 16)],
)
def test_matches_reference_float32(n, g, d, block_size):
    """GQA groups of 4, 1, 3 (padded to 4) and 16; head dims 32, 16, 24 (padded); a fresh
    prompt, a chunk after cached context, a single token, a chunk spanning several tiles."""
    seqs = [(0, 5), (9, 7), (20, 1), (3, 37)]
    q, k, v, attn = case(n, g, d, block_size, seqs, torch.float32, seed=n + d)
    out = run(q, k, v, attn, d**-0.5)
    ref = paged_attention_per_query(q, k, v, attn, d**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_query_result_does_not_depend_on_chunking_or_neighbours():
    """A prompt prefilled whole, in chunks, or beside another sequence, and its last token as a
    one-token step (what batch-invariant mode runs decode steps as): the same bits for each
    token (tiles start at position 0 and masked tiles change nothing)."""
    q, k, v, attn = case(8, 2, 32, 8, [(0, 40), (0, 13)], torch.float32, seed=5)
    both = run(q, k, v, attn, 0.2)
    blocks = attn.block_tables[0].tolist()
    for cut in (17, 33, 39):  # the first sequence's tail as its own chunk (39: one token)
        rows = [(cut, 40 - cut, blocks)]
        part = AttentionMetadata.build(rows, 8, DEVICE)
        alone = run(q[cut:40].contiguous(), k, v, part, 0.2)
        assert torch.equal(alone, both[cut:40])


def test_bfloat16_close_to_reference():
    q, k, v, attn = case(8, 2, 64, 16, [(30, 20), (0, 9)], torch.bfloat16, seed=2)
    out = run(q, k, v, attn, 0.125)
    ref = paged_attention_per_query(q.float(), k.float(), v.float(), attn, 0.125)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


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

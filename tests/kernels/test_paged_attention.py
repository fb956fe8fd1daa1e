"""The paged decode-attention kernel against its torch references (`paged_decode_ref`, same
signature, and the engine's `paged_attention_ref`), with fresh random caches and block tables.
Without CUDA the Triton interpreter runs it on the CPU; on a CUDA machine the compiled kernel."""

from __future__ import annotations

import os

import pytest
import torch

from moestream.layers.attention import AttentionMetadata, paged_attention_ref, paged_decode_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # the modules above do not import triton; the kernel module below does
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

pytest.importorskip("triton", reason="triton is not installed")

from moestream.kernels.paged_attention import paged_decode_attention  # noqa: E402


def case(n: int, g: int, d: int, block_size: int, seq_lens: list[int], dtype, seed: int):
    """q [B, n, D], caches with random contents, block tables of distinct shuffled blocks (each
    row padded with random ids past its sequence's last block), seq_lens [B] int32."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-s // block_size) for s in seq_lens) + 2
    num_blocks = width * len(seq_lens) + 3
    k_cache = torch.randn(num_blocks, block_size, g, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, g, d, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: width * len(seq_lens)].view(len(seq_lens), width).to(torch.int32)
    q = torch.randn(len(seq_lens), n, d, generator=gen)
    to = {"device": DEVICE}
    return (
        q.to(dtype=dtype, **to),
        k_cache.to(dtype=dtype, **to),
        v_cache.to(dtype=dtype, **to),
        tables.to(**to),
        torch.tensor(seq_lens, dtype=torch.int32, **to),
    )


@pytest.mark.parametrize(
    "n, g, d, block_size, num_splits",
    [(8, 2, 32, 4, 1), (8, 2, 32, 16, 3), (4, 4, 64, 8, 16), (16, 1, 16, 16, 2)],
)
def test_matches_reference_float32(n, g, d, block_size, num_splits):
    """GQA groups of 4, 1 and 16; one split (direct store) and several (merged); sequences of 1
    token, exactly one and two tiles (64, 128), just past a tile, and a padding row (0)."""
    seq_lens = [1, 64, 65, 0, 130]
    q, k, v, tables, lens = case(n, g, d, block_size, seq_lens, torch.float32, seed=n + d)
    out = paged_decode_attention(q, k, v, tables, lens, d**-0.5, num_splits=num_splits)
    ref = paged_decode_ref(q, k, v, tables, lens, d**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[3], torch.zeros_like(out[3]))  # padding row


def test_matches_engine_reference():
    """Same numbers as the attention the CPU engine runs (per-query reference over metadata
    built from the block tables) for every real sequence."""
    seq_lens = [3, 70, 17]
    bs = 8
    q, k, v, tables, lens = case(8, 2, 32, bs, seq_lens, torch.float32, seed=7)
    out = paged_decode_attention(q, k, v, tables, lens, 0.2, num_splits=4)
    rows = [(s - 1, 1, tables[i, : -(-s // bs)].tolist()) for i, s in enumerate(seq_lens)]
    attn = AttentionMetadata.build(rows, bs, DEVICE)
    assert attn.is_decode
    ref = paged_attention_ref(q, k, v, attn, 0.2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_sequence_result_does_not_depend_on_batch():
    """Splits follow each sequence's own length: alone or next to others, the same bits."""
    q, k, v, tables, lens = case(8, 2, 32, 16, [40, 300, 5], torch.float32, seed=3)
    both = paged_decode_attention(q, k, v, tables, lens, 0.1)
    alone = paged_decode_attention(q[1:2], k, v, tables[1:2], lens[1:2], 0.1)
    assert torch.equal(both[1:2], alone)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    q, k, v, tables, lens = case(8, 2, 64, 16, [1, 90, 200], dtype, seed=11)
    out = paged_decode_attention(q, k, v, tables, lens, 64**-0.5, num_splits=4)
    assert out.dtype == dtype
    ref = paged_decode_ref(q.float(), k.float(), v.float(), tables, lens, 64**-0.5)
    # bf16 output rounding (and the interpreter's truncating bf16 stores) bound the error
    assert (out.float() - ref).abs().max().item() < 3e-2


def test_strided_query_and_output_buffer():
    """q may be a view with a row stride (the merged QKV projection's output)."""
    q, k, v, tables, lens = case(4, 2, 32, 8, [9, 33], torch.float32, seed=5)
    qkv = torch.randn(2, 4 * 32 + 2 * 2 * 32, device=DEVICE)
    qkv[:, : 4 * 32] = q.reshape(2, -1)
    q_view = qkv[:, : 4 * 32].view(2, 4, 32)
    out = torch.full((2, 4, 32), float("nan"), device=DEVICE)
    paged_decode_attention(q_view, k, v, tables, lens, 0.3, out=out, num_splits=2)
    torch.testing.assert_close(out, paged_decode_ref(q, k, v, tables, lens, 0.3))


def test_rejects_bad_arguments():
    q, k, v, tables, lens = case(8, 2, 32, 8, [5, 6], torch.float32, seed=1)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, k, v, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="group"):
        paged_decode_attention(q[:, :7], k, v, tables, lens, 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(q, k, v, tables, lens[:1], 1.0)

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

from moestream.kernels.mmvq import empty_q8, quantize_q8  # noqa: E402
from moestream.kernels.paged_attention import (  # noqa: E402
    NUM_SPLITS,
    decode_num_splits,
    paged_decode_attention,
)


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


@pytest.mark.parametrize(
    "n, g, block_size, block_n, num_splits",
    [(8, 2, 16, 64, 5), (4, 2, 4, 16, 12), (16, 1, 16, 128, 3), (6, 2, 8, 32, 7)],
)
def test_last_program_merge_matches_reference(n, g, block_size, block_n, num_splits):
    """The merge done by the last split to finish (counters given) against the reference and
    the merge kernel: GQA groups of 4, 2, 16 and 3 (padded rows), tiles of 16-128 tokens, more
    splits than tiles (12 splits of 16-token tiles over at most 130 tokens), a padding row."""
    seq_lens = [1, 64, 0, 130, 17]
    q, k, v, tables, lens = case(n, g, 32, block_size, seq_lens, torch.float32, seed=n + g)
    counters = torch.zeros(len(seq_lens) * g + 3, dtype=torch.int32, device=DEVICE)
    args = (q, k, v, tables, lens, 32**-0.5)
    fused = paged_decode_attention(*args, num_splits=num_splits, counters=counters, block_n=block_n)
    merged = paged_decode_attention(*args, num_splits=num_splits, block_n=block_n)
    ref = paged_decode_ref(*args)
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused[2], torch.zeros_like(fused[2]))  # padding row
    assert not counters.any()  # left zero for the next launch


def test_counters_survive_replays():
    """Launched again on the same counter buffer (as a replayed CUDA graph does), the fused
    merge gives the same bits, also after a launch with another batch and split count."""
    q, k, v, tables, lens = case(8, 2, 32, 8, [70, 3, 33], torch.float32, seed=9)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    first = paged_decode_attention(q, k, v, tables, lens, 0.2, num_splits=6, counters=counters)
    paged_decode_attention(q[:1], k, v, tables[:1], lens[:1], 0.2, num_splits=3, counters=counters)
    again = paged_decode_attention(q, k, v, tables, lens, 0.2, num_splits=6, counters=counters)
    assert torch.equal(first, again)
    assert not counters.any()
    counters[0] = 6  # a stale count: no program of (sequence 0, KV head 0) sees itself last
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k, v, tables, lens, 0.2, out, num_splits=6, counters=counters)
    assert out[0, :4].isnan().all() and torch.equal(out[0, 4:], first[0, 4:])
    assert counters.tolist() == [12] + [0] * 7


@pytest.mark.parametrize("block_n", [16, 128])
def test_tile_sizes_half_precision(block_n):
    """Other tile sizes, bfloat16 caches, both merges."""
    q, k, v, tables, lens = case(8, 2, 64, 16, [5, 150, 0], torch.bfloat16, seed=block_n)
    ref = paged_decode_ref(q.float(), k.float(), v.float(), tables, lens, 64**-0.5)
    counters = torch.zeros(6, dtype=torch.int32, device=DEVICE)
    for c in (None, counters):
        out = paged_decode_attention(
            q, k, v, tables, lens, 64**-0.5, num_splits=3, counters=c, block_n=block_n
        )
        assert (out.float() - ref).abs().max().item() < 3e-2


def test_split_count_rule():
    """At least 2 programs per SM when the batch alone cannot fill the GPU, never fewer than
    NUM_SPLITS; a function of (B, g, SMs) only."""
    assert decode_num_splits(1, 4, 132) == 66  # 264 programs on 132 SMs
    assert decode_num_splits(2, 4, 132) == 33
    assert decode_num_splits(4, 4, 132) == 17
    assert decode_num_splits(8, 4, 132) == NUM_SPLITS
    assert decode_num_splits(32, 4, 132) == NUM_SPLITS
    assert decode_num_splits(1, 4, 0) == NUM_SPLITS  # not a CUDA device
    for b in range(1, 40):
        s = decode_num_splits(b, 4, 132)
        assert s >= NUM_SPLITS and b * 4 * s >= 2 * 132
        assert s == NUM_SPLITS or b * 4 * (s - 1) < 2 * 132  # the least that fills


@pytest.mark.parametrize(
    "dtype, num_splits, fused, d", [(torch.bfloat16, 3, False, 64), (torch.float32, 1, False, 32),
                                    (torch.bfloat16, 5, True, 32), (torch.float16, 16, False, 128)],
)  # fmt: skip
def test_q8_output_is_quantize_q8_of_the_output(dtype, num_splits, fused, d):
    """With `q8` the kernel also writes the output rows' q8 rounding: bit for bit
    `quantize_q8(out.view(B, n * D))`, whichever kernel stores the output (the split kernel at
    one split, the merge kernel, the last split to arrive), with the output itself unchanged;
    a padding row's blocks are zeros. The poisoned buffers show every block is written."""
    q, k, v, tables, lens = case(8, 2, d, 16, [7, 150, 0, 40], dtype, seed=d + num_splits)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE) if fused else None
    args = (q, k, v, tables, lens, d**-0.5)
    plain = paged_decode_attention(*args, num_splits=num_splits, counters=counters)
    xa = empty_q8(4, 8 * d, DEVICE)
    for t in xa:
        t.fill_(-7 if t.dtype == torch.int32 else float("nan"))
    out = paged_decode_attention(*args, num_splits=num_splits, counters=counters, q8=xa)
    assert torch.equal(out, plain)
    ref = quantize_q8(out.view(4, 8 * d))
    for got, want in zip(xa, ref):
        assert torch.equal(got, want)
    assert not xa.q[2].any() and not xa.d[2].any()


def test_rejects_bad_arguments():
    q, k, v, tables, lens = case(8, 2, 32, 8, [5, 6], torch.float32, seed=1)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, k, v, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="group"):
        paged_decode_attention(q[:, :7], k, v, tables, lens, 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(q, k, v, tables, lens[:1], 1.0)
    with pytest.raises(ValueError, match="counters"):
        paged_decode_attention(q, k, v, tables, lens, 1.0, counters=torch.zeros(3))
    with pytest.raises(ValueError, match="block_n"):
        paged_decode_attention(q, k, v, tables, lens, 1.0, block_n=48)
    with pytest.raises(ValueError, match="q8 output"):
        paged_decode_attention(q, k, v, tables, lens, 1.0, q8=empty_q8(2, 8 * 16, DEVICE))
    q16, k16, v16, tables, lens = case(8, 2, 16, 8, [5, 6], torch.float32, seed=1)
    with pytest.raises(ValueError, match="head dim"):
        paged_decode_attention(q16, k16, v16, tables, lens, 1.0, q8=empty_q8(2, 8 * 16, DEVICE))

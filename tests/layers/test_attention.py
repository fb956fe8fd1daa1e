"""Paged reference attention against SDPA on contiguous K/V."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moestream.layers.attention import AttentionMetadata, paged_attention_ref, write_kv

N_HEADS, N_KV, D, BS = 4, 2, 8, 4


def sdpa_causal_tail(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [Tq, n, D] are the last Tq positions of k, v [L, g, D] -> [Tq, n, D]."""
    tq, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - tq, ctx)[:, None]  # [Tq, L]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(0, 1)


def test_paged_attention_matches_sdpa() -> None:
    g = torch.Generator().manual_seed(0)
    # sequence 0: 5 cached + 3 new; sequence 1: 0 cached + 6 new; scattered blocks
    seqs = [(5, 3, [7, 2]), (0, 6, [0, 5])]
    lens = [8, 6]
    k_full = [torch.randn(n, N_KV, D, generator=g) for n in lens]
    v_full = [torch.randn(n, N_KV, D, generator=g) for n in lens]
    k_cache = torch.zeros(8, BS, N_KV, D)
    v_cache = torch.zeros(8, BS, N_KV, D)
    # the cached prefix of sequence 0, as an earlier step would have written it
    prefix = AttentionMetadata.build([(0, 5, [7, 2])], BS, "cpu")
    write_kv(k_full[0][:5], v_full[0][:5], k_cache, v_cache, prefix.slot_mapping)
    attn = AttentionMetadata.build(seqs, BS, "cpu")
    new_k = torch.cat([k_full[0][5:], k_full[1]])
    new_v = torch.cat([v_full[0][5:], v_full[1]])
    write_kv(new_k, new_v, k_cache, v_cache, attn.slot_mapping)
    q = torch.randn(9, N_HEADS, D, generator=g)
    out = paged_attention_ref(q, k_cache, v_cache, attn, D**-0.5)
    ref = torch.cat([
        sdpa_causal_tail(q[:3], k_full[0], v_full[0]),
        sdpa_causal_tail(q[3:], k_full[1], v_full[1]),
    ])  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    # a sequence's result does not depend on its batch neighbours (bit for bit)
    alone = AttentionMetadata.build([seqs[1]], BS, "cpu")
    assert torch.equal(paged_attention_ref(q[3:], k_cache, v_cache, alone, D**-0.5), out[3:])


def test_bf16_cache_and_activations() -> None:
    g = torch.Generator().manual_seed(1)
    k_cache = torch.zeros(2, BS, N_KV, D, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    attn = AttentionMetadata.build([(0, 5, [1, 0])], BS, "cpu")
    k, v = torch.randn(5, N_KV, D, generator=g), torch.randn(5, N_KV, D, generator=g)
    write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
    q = torch.randn(5, N_HEADS, D, generator=g).bfloat16()
    out = paged_attention_ref(q, k_cache, v_cache, attn, D**-0.5)
    assert out.dtype == torch.bfloat16
    ref = sdpa_causal_tail(q.float(), k.bfloat16().float(), v.bfloat16().float())
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)

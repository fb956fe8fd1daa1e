"""Paged attention for steps with several new tokens per sequence (prefill chunks, verification
of drafted tokens): FlashAttention-style over the paged KV cache, causal, GQA.

Each program owns one (sequence, KV head, block of BLOCK_Q new tokens) and stacks the R query
heads of that KV head's group under each token: BLOCK_Q * R_PAD rows of queries, so every K/V
tile gathered through the block table is read once for the whole group. It walks the context in
tiles of BLOCK_N tokens from position 0 up to the block's last query, with an online softmax in
float32 (exp2, scores pre-scaled by log2 e), and masks keys past each query's own position.

A query's result does not depend on the other queries of its block or step: the tiles start at
position 0 whatever the chunking, and a tile that lies wholly past a query's position leaves
its running max, sum and accumulator unchanged bit for bit (scale 1, zero added). So a prompt
gives the same bits prefilled in one chunk or many, alone or beside other sequences.

The grid is (B, g, cdiv(max_query_len, BLOCK_Q)); programs past a sequence's own new tokens
return at once. Lengths are read on the device (query_start_loc, seq_lens): no host sync.

Letters: T new tokens, B sequences, n query heads, g KV heads, R = n / g, D head dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moestream.kernels.paged_attention import attend_tile

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr, scale_log2e,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ot, stride_oh,
    REP: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    KV_BLOCK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, WHILE_LOOP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    qb = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    n_q = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    ctx0 = seq_len - n_q  # position of the sequence's first new token
    BLOCK_M: tl.constexpr = BLOCK_Q * R_PAD
    row = tl.arange(0, BLOCK_M)
    i = qb * BLOCK_Q + row // R_PAD  # [BLOCK_M] new-token index within the sequence
    rh = row % R_PAD
    head = kvh * REP + rh
    row_ok = (i < n_q) & (rh < REP)
    pos = ctx0 + i  # [BLOCK_M] query positions
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    tok = (q_start + i).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, D_PAD]
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # keys up to the block's last query (0 when the block is past the sequence's new tokens)
    end = tl.minimum(ctx0 + tl.minimum(qb * BLOCK_Q + BLOCK_Q, n_q), seq_len)
    end = tl.where(qb * BLOCK_Q < n_q, end, 0)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    if WHILE_LOOP:  # the interpreter cannot range() over loaded values
        t0 = end * 0
        while t0 < end:
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, t0, end, pos, bt_row, k_base, v_base, d, d_ok, scale_log2e,
                stride_kb, stride_kt, stride_vb, stride_vt, KV_BLOCK, BLOCK_N, DOT_F32, True,
            )  # fmt: skip
            t0 += BLOCK_N
    else:
        for t0 in range(0, end, BLOCK_N):
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, t0, end, pos, bt_row, k_base, v_base, d, d_ok, scale_log2e,
                stride_kb, stride_kt, stride_vb, stride_vt, KV_BLOCK, BLOCK_N, DOT_F32, True,
            )  # fmt: skip
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def check_prefill_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Shapes, dtypes and devices the kernel needs (ValueError otherwise)."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"q [T, n, D], caches [blocks, block_size, g, D]: {q.shape} {k_cache.shape}"
        )
    n, g, d = q.shape[1], k_cache.shape[2], q.shape[2]
    if k_cache.shape[3] != d or n % g:
        raise ValueError(f"{n} query heads of dim {d} do not fit KV heads {tuple(k_cache.shape)}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the head dim must have unit stride in q and the caches")
    b = seq_lens.shape[0]
    if query_start_loc.shape != (b + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != b:
        raise ValueError("query_start_loc [B+1], seq_lens [B], block_tables [B, max_blocks]")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    for t in (k_cache, v_cache, block_tables, query_start_loc, seq_lens):
        if t.device != q.device:
            raise ValueError(f"all inputs must be on {q.device}, one is on {t.device}")


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Causal attention of a step's new tokens: q [T, n, D] -> [T, n, D] in q's dtype.

    Sequence b's new tokens are rows query_start_loc[b]:[b+1] of q, the last of its
    seq_lens[b] context tokens, whose K/V are already in k_cache/v_cache [blocks, block_size,
    g, D] at the slots of block_tables[b]. `max_query_len` (a host int, >= every sequence's
    new tokens) sizes the grid. Same contract as `layers.attention.paged_attention_ref`.
    """
    check_prefill_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    t, n, d = q.shape
    g = k_cache.shape[2]
    rep = n // g
    r_pad = triton.next_power_of_2(rep)
    block_q = max(1, 64 // r_pad)  # 64 query rows per program
    if out is None:
        out = torch.empty_like(q)
    b = seq_lens.shape[0]
    if t == 0 or b == 0:
        return out
    # float32 (and the interpreter) take full-precision dots: tl.dot on float32 is tf32 by default
    dot_f32 = q.device.type != "cuda" or torch.float32 in (q.dtype, k_cache.dtype)
    grid = (b, g, triton.cdiv(max(max_query_len, 1), block_q))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        REP=rep, R_PAD=r_pad, D=d, D_PAD=triton.next_power_of_2(d),
        KV_BLOCK=k_cache.shape[1], BLOCK_Q=block_q, BLOCK_N=block_n, DOT_F32=dot_f32,
        WHILE_LOOP=not q.is_cuda, num_warps=4, num_stages=2,
    )  # fmt: skip
    return out

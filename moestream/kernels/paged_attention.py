"""Paged attention for decode steps: one new query token per sequence over the paged KV cache.

Flash-decoding: each program owns one (sequence, KV head, context split) and attends all query
heads of that KV head's GQA group ([R, D] queries, padded to 16 rows for `tl.dot`) over its
part of the context, in tiles of BLOCK_N tokens gathered through the block table, with an
online softmax. A sequence's context is cut into `num_splits` parts of whole tiles, sized from
its own length on the device (short sequences leave the later splits empty), so the grid is
fixed by (B, g, num_splits) alone: nothing comes back to the host and a launch can be captured
in a CUDA graph once per batch size. A second kernel merges the splits' partial results by
their log-sum-exp. The split count does not depend on the batch, so a sequence's result does
not depend on its neighbours.

A sequence with seq_lens[b] == 0 (padding rows of a CUDA graph bucket) reads nothing and gets
zeros. Keys at positions >= seq_lens[b] are never read, so block table entries past a
sequence's last block may hold anything.

Letters: B sequences, n query heads, g KV heads, R = n / g, D head dim, S splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # context tokens per tile (one tl.dot per tile)
NUM_SPLITS = 16  # default context splits per (sequence, KV head)
_LOG2E = 1.4426950408889634


@triton.jit
def attend_tile(
    q, m_i, l_i, acc, t0, end, pos, bt_row, k_base, v_base, d, d_ok, scale_log2e,
    stride_kb, stride_kt, stride_vb, stride_vt,
    KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, CAUSAL: tl.constexpr,
):  # fmt: skip
    """One online-softmax step of rows q [M, D_PAD] over context tokens t0 .. t0 + BLOCK_N - 1
    (those < end), gathered through the block-table row `bt_row`; with CAUSAL, row i sees only
    the keys at positions <= pos[i]. Returns the new (running max, sum, accumulator)."""
    t = t0 + tl.arange(0, BLOCK_N)
    t_ok = t < end
    block = tl.load(bt_row + t // KV_BLOCK, mask=t_ok, other=0).to(tl.int64)
    offset = t % KV_BLOCK
    kv_mask = t_ok[:, None] & d_ok[None, :]
    k = tl.load(
        k_base + block[:, None] * stride_kb + offset[:, None] * stride_kt + d[None, :],
        mask=kv_mask,
        other=0.0,
    )  # [BLOCK_N, D_PAD]
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q.to(k.dtype), tl.trans(k))  # [M, BLOCK_N] float32
    if CAUSAL:
        s = tl.where(t_ok[None, :] & (t[None, :] <= pos[:, None]), s * scale_log2e, float("-inf"))
    else:  # every key of the range is visible (pos unused)
        s = tl.where(t_ok[None, :], s * scale_log2e, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    v = tl.load(
        v_base + block[:, None] * stride_vb + offset[:, None] * stride_vt + d[None, :],
        mask=kv_mask,
        other=0.0,
    )  # [BLOCK_N, D_PAD]
    if DOT_F32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_ptr, lse_ptr,
    scale_log2e, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
    stride_vh, stride_bt, stride_ob, stride_oh,
    N_HEADS: tl.constexpr, REP: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr,
    D_PAD: tl.constexpr, KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_F32: tl.constexpr, WHILE_LOOP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    r = tl.arange(0, R_PAD)
    d = tl.arange(0, D_PAD)
    head = kvh * REP + r  # [R_PAD] query heads of this KV head
    r_ok = r < REP
    d_ok = d < D
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + d[None, :],
        mask=r_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [R_PAD, D_PAD]
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([R_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    acc = tl.zeros([R_PAD, D_PAD], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    kv_off = kvh * stride_kh
    vv_off = kvh * stride_vh
    if WHILE_LOOP:  # the interpreter cannot range() over loaded values
        t0 = start
        while t0 < end:
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, t0, end, 0, bt_row, k_ptr + kv_off, v_ptr + vv_off, d, d_ok,
                scale_log2e, stride_kb, stride_kt, stride_vb, stride_vt, KV_BLOCK, BLOCK_N,
                DOT_F32, False,
            )  # fmt: skip
            t0 += BLOCK_N
    else:
        for t0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, t0, end, 0, bt_row, k_ptr + kv_off, v_ptr + vv_off, d, d_ok,
                scale_log2e, stride_kb, stride_kt, stride_vb, stride_vt, KV_BLOCK, BLOCK_N,
                DOT_F32, False,
            )  # fmt: skip
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # zeros for an empty split
    if NUM_SPLITS == 1:
        dst = out_ptr + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
    else:
        row = (b.to(tl.int64) * N_HEADS + head) * NUM_SPLITS + split  # [R_PAD]
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=r_ok)
        tl.store(part_ptr + row[:, None] * D + d[None, :], o, mask=r_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, stride_ob, stride_oh,
    N_HEADS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    row = (b.to(tl.int64) * N_HEADS + h) * NUM_SPLITS + s  # [S_PAD]
    lse = tl.load(lse_ptr + row, mask=s < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # [S_PAD], 0 for empty splits
    used = w > 0
    part = tl.load(
        part_ptr + row[:, None] * D + d[None, :], mask=used[:, None] & (d < D)[None, :], other=0.0
    )  # [S_PAD, D_PAD]
    total = tl.sum(w, axis=0)
    o = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    dst = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=d < D)


def check_decode_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Shapes, strides, dtypes and devices the kernels need (ValueError otherwise)."""
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [B, n, D] with unit last stride, got {tuple(q.shape)}")
    b, n, d = q.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[-1] != d:
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} for D={d}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("caches must have unit stride along the head dimension")
    if n % k_cache.shape[2]:
        raise ValueError(f"{n} query heads do not group over {k_cache.shape[2]} KV heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.stride(-1) != 1:
        raise ValueError(f"block_tables must be [B={b}, max_blocks], got {block_tables.shape}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if seq_lens.shape != (b,) or not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens must be a contiguous [B={b}], got {tuple(seq_lens.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens)):  # fmt: skip
        if t.device != q.device:
            raise ValueError(f"{name} on {t.device}, q on {q.device}")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int = NUM_SPLITS,
) -> torch.Tensor:
    """softmax(q k^T * scale) v for one query per sequence -> [B, n, D] in q's dtype.

    q [B, n, D] (unit last stride; the query of sequence b sits at position seq_lens[b] - 1 and
    sees keys 0 .. seq_lens[b] - 1); k_cache, v_cache [num_blocks, block_size, g, D];
    block_tables [B, max_blocks] int32; seq_lens [B] int32 (0: padding, output zeros). Query
    head h reads KV head h // (n / g). Same contract as `layers.attention.paged_decode_ref`.
    No host synchronisation; the launch grid depends only on B, g and `num_splits`.
    """
    check_decode_args(q, k_cache, v_cache, block_tables, seq_lens)
    b, n, d = q.shape
    g, kv_block = k_cache.shape[2], k_cache.shape[1]
    rep = n // g
    if out is None:
        out = torch.empty((b, n, d), dtype=q.dtype, device=q.device)
    elif out.shape != (b, n, d) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{b}, {n}, {d}] with unit last stride")
    if b == 0:
        return out
    d_pad = triton.next_power_of_2(d)
    dot_f32 = q.device.type != "cuda" or torch.float32 in (q.dtype, k_cache.dtype)
    if num_splits > 1:
        part = torch.empty((b, n, num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((b, n, num_splits), dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # unused
    _decode_split_kernel[(b, g, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part, lse,
        scale * _LOG2E, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        N_HEADS=n, REP=rep, R_PAD=max(16, triton.next_power_of_2(rep)), D=d, D_PAD=d_pad,
        KV_BLOCK=kv_block, BLOCK_N=BLOCK_N, NUM_SPLITS=num_splits, DOT_F32=dot_f32,
        WHILE_LOOP=q.device.type != "cuda", num_warps=4,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(b, n)](
            part, lse, out, out.stride(0), out.stride(1),
            N_HEADS=n, D=d, D_PAD=d_pad, NUM_SPLITS=num_splits,
            S_PAD=triton.next_power_of_2(num_splits), num_warps=2,
        )  # fmt: skip
    return out

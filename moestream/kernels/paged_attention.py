"""Paged attention for decode steps: one new query token per sequence over the paged KV cache.

Flash-decoding: each program owns one (sequence, KV head, context split) and attends all query
heads of that KV head's GQA group ([R, D] queries, padded to 16 rows for `tl.dot`) over its
part of the context, in tiles of BLOCK_N tokens gathered through the block table, with an
online softmax. A sequence's context is cut into `num_splits` parts of whole tiles, sized from
its own length on the device (short sequences leave the later splits empty), so the grid is
fixed by (B, g, num_splits) alone: nothing comes back to the host and a launch can be captured
in a CUDA graph once per batch size. `decode_num_splits` picks the split count from B, g and
the number of SMs so that a batch of one still fills the GPU.

The splits' partial results are merged by their log-sum-exp, either by a second kernel or, when
the caller passes a `counters` buffer, by the last program of each (sequence, KV head) to
finish: every program bumps an int32 counter after storing its partial; the one that sees
num_splits - 1 resets it to 0 (so the buffer is zero again for the next launch or graph replay)
and merges all the splits' partials from memory in a fixed order, so the bits do not depend on
which program came last (the two merges may differ from each other in the last bits).

The tile loop is software-pipelined by Triton (num_stages): the block-table entries of a tile
are loaded a stage ahead of its K/V rows, which are copied asynchronously into shared memory.
On sm_90 (Triton 3.6) num_stages=5 double-buffers K/V, so the next tile's copy is in flight
while one is computed; at 3 the copy of tile i + 1 is issued only after tile i is used, and
loads and compute do not overlap. The last-program merge's loop is pipelined the same way.

A sequence with seq_lens[b] == 0 (padding rows of a CUDA graph bucket) reads nothing and gets
zeros. Keys at positions >= seq_lens[b] are never read, so block table entries past a
sequence's last block may hold anything. For a given num_splits and block_n a sequence's
result does not depend on the other sequences of the batch.

Letters: B sequences, n query heads, g KV heads, R = n / g, D head dim, S splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moestream.kernels.arrival import check_counters, last_to_arrive
from moestream.kernels.mmvq import QBLOCK, Q8Act, check_q8_out, store_q8_blocks
from moestream.kernels.pdl import pdl_args, pdl_start

BLOCK_N = 64  # context tokens per tile (one tl.dot per tile)
NUM_SPLITS = 16  # the least number of context splits per (sequence, KV head)
NUM_STAGES = 5  # software-pipeline stages of the tile loop on CUDA
NUM_WARPS = 4
PROGRAMS_PER_SM = 2  # split kernel programs per SM `decode_num_splits` aims for
_LOG2E = 1.4426950408889634


def decode_num_splits(
    batch: int, num_kv_heads: int, num_sms: int, programs_per_sm: int = PROGRAMS_PER_SM
) -> int:
    """Context splits per (sequence, KV head) so that the grid (batch, num_kv_heads, splits)
    holds at least `programs_per_sm` programs per SM, never fewer than NUM_SPLITS. Depends on
    the batch size and the device only (never on context lengths): one CUDA graph per batch."""
    pairs = max(1, batch * num_kv_heads)
    return max(NUM_SPLITS, -(-programs_per_sm * num_sms // pairs))


def device_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 0 for other devices."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def attend_tile(
    q, m_i, l_i, acc, t0, end, pos, bt_row, k_base, v_base, d, d_ok, scale_log2e,
    stride_kb, stride_kt, stride_vb, stride_vt,
    KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, CAUSAL: tl.constexpr,
):  # fmt: skip
    """One online-softmax step of rows q [M, D_PAD] over context tokens t0 .. t0 + BLOCK_N - 1
    (those < end), gathered through the block-table row `bt_row`; with CAUSAL, row i sees only
    the keys at positions <= pos[i] (the prefill kernel's use). Returns the new (running max,
    sum, accumulator)."""
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
def split_bounds(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """(tiles per split, splits that hold at least one token) for a context of seq_len."""
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(n_tiles, num_splits)
    return tiles_per_split, tl.cdiv(n_tiles, tl.maximum(tiles_per_split, 1))


@triton.jit
def merge_splits(
    part_ptr, lse_ptr, out_ptr, q8_ptr, q8d_ptr, q8s_ptr, b, head0, n_used, num_splits,
    stride_ob, stride_oh, stride_q8, stride_q8d,
    N_HEADS: tl.constexpr, H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr,
    D_PAD: tl.constexpr, S_PAD: tl.constexpr, CHUNK: tl.constexpr, WHILE_LOOP: tl.constexpr,
    Q8: tl.constexpr,
):  # fmt: skip
    """out[b, head0 : head0 + H] = the log-sum-exp weighted mean of the first n_used splits'
    partials (the rest are empty), CHUNK splits at a time in split order (`store_heads`)."""
    r = tl.arange(0, H_PAD)
    r_ok = r < H
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    base = (b.to(tl.int64) * N_HEADS + head0 + r) * num_splits  # [H_PAD] row of split 0
    s = tl.arange(0, S_PAD)
    lse = tl.load(
        lse_ptr + base[:, None] + s[None, :],
        mask=r_ok[:, None] & (s < n_used)[None, :],
        other=float("-inf"),
        cache_modifier=".cg",
    )  # [H_PAD, S_PAD]
    m = tl.max(lse, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lse - m[:, None]), axis=1)  # [H_PAD], 0 for a padding row
    acc = tl.zeros([H_PAD, D_PAD], tl.float32)
    c = tl.arange(0, CHUNK)
    if WHILE_LOOP:  # the interpreter cannot range() over loaded values
        s0 = 0
        while s0 < n_used:
            acc = merge_chunk(part_ptr, lse_ptr, acc, base, s0 + c, n_used, m, r_ok, d, d_ok, D)
            s0 += CHUNK
    else:
        for s0 in tl.range(0, n_used, CHUNK, num_stages=3):
            acc = merge_chunk(part_ptr, lse_ptr, acc, base, s0 + c, n_used, m, r_ok, d, d_ok, D)
    o = acc / tl.where(total > 0, total, 1.0)[:, None]
    store_heads(
        o, out_ptr, q8_ptr, q8d_ptr, q8s_ptr, b, head0, r, r_ok, d, d_ok, stride_ob, stride_oh,
        stride_q8, stride_q8d, H, H_PAD, D, Q8,
    )  # fmt: skip


@triton.jit
def store_heads(
    o, out_ptr, q8_ptr, q8d_ptr, q8s_ptr, b, head0, r, r_ok, d, d_ok, stride_ob, stride_oh,
    stride_q8, stride_q8d, H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr,
    Q8: tl.constexpr,
):  # fmt: skip
    """Rows o [H_PAD, D_PAD] float32 (those with r_ok) to out[b, head0 + r] in out's dtype. With
    Q8 also the q8 rounding of the stored values, as `mmvq.quantize_q8` writes row b of
    out.view(B, n * D) (D a power of 2 >= 32): the output projection's integer-dot GEMV then
    needs no quantization launch of its own."""
    o = o.to(out_ptr.dtype.element_ty)
    dst = out_ptr + b.to(tl.int64) * stride_ob + (head0 + r)[:, None] * stride_oh + d[None, :]
    tl.store(dst, o, mask=r_ok[:, None] & d_ok[None, :])
    if Q8:
        nbh: tl.constexpr = D // 32  # q8 blocks per head
        x = tl.reshape(o.to(tl.float32), [H_PAD * nbh, 8, 4])  # block, word, byte
        blk = (head0 + r)[:, None] * nbh + tl.arange(0, nbh)[None, :]
        store_q8_blocks(
            x, tl.reshape(blk, [H_PAD * nbh]), (head0 + H) * nbh,
            q8_ptr + b.to(tl.int64) * stride_q8, q8d_ptr + b.to(tl.int64) * stride_q8d,
            q8s_ptr + b.to(tl.int64) * stride_q8d,
        )  # fmt: skip


@triton.jit
def merge_chunk(part_ptr, lse_ptr, acc, base, sc, n_used, m, r_ok, d, d_ok, D: tl.constexpr):
    """acc [H_PAD, D_PAD] + the splits sc's partials weighted by exp2(lse - m)."""
    lse = tl.load(
        lse_ptr + base[:, None] + sc[None, :],
        mask=r_ok[:, None] & (sc < n_used)[None, :],
        other=float("-inf"),
        cache_modifier=".cg",
    )  # [H_PAD, CHUNK]
    w = tl.exp2(lse - m[:, None])  # 0 for empty splits
    rows = base[:, None, None] + sc[None, :, None]  # [H_PAD, CHUNK, 1]
    part = tl.load(
        part_ptr + rows * D + d[None, None, :],
        mask=(w > 0)[:, :, None] & d_ok[None, None, :],
        other=0.0,
        cache_modifier=".cg",
    )  # [H_PAD, CHUNK, D_PAD]
    return acc + tl.sum(part * w[:, :, None], axis=1)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_ptr, lse_ptr, counter_ptr,
    q8_ptr, q8d_ptr, q8s_ptr, scale_log2e, num_splits, stride_qb, stride_qh, stride_kb,
    stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt, stride_ob, stride_oh,
    stride_q8, stride_q8d,
    N_HEADS: tl.constexpr, REP: tl.constexpr, R_PAD: tl.constexpr, REP_PAD: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    MERGE: tl.constexpr, S_PAD: tl.constexpr, CHUNK: tl.constexpr, DOT_F32: tl.constexpr,
    WHILE_LOOP: tl.constexpr, Q8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(PDL)
    # MERGE: 0 one split, store the output; 1 store partials (merge kernel); 2 store partials,
    # the last program of this (b, kvh) merges them.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    tiles_per_split, n_used = split_bounds(seq_len, num_splits, BLOCK_N)
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
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    if WHILE_LOOP:  # the interpreter cannot range() over loaded values
        t0 = start
        while t0 < end:
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, t0, end, 0, bt_row, k_base, v_base, d, d_ok, scale_log2e,
                stride_kb, stride_kt, stride_vb, stride_vt, KV_BLOCK, BLOCK_N, DOT_F32, False,
            )  # fmt: skip
            t0 += BLOCK_N
    else:
        for t0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, t0, end, 0, bt_row, k_base, v_base, d, d_ok, scale_log2e,
                stride_kb, stride_kt, stride_vb, stride_vt, KV_BLOCK, BLOCK_N, DOT_F32, False,
            )  # fmt: skip
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # zeros for an empty split
    if MERGE == 0:
        store_heads(
            o, out_ptr, q8_ptr, q8d_ptr, q8s_ptr, b, kvh * REP, r, r_ok, d, d_ok, stride_ob,
            stride_oh, stride_q8, stride_q8d, REP, R_PAD, D, Q8,
        )  # fmt: skip
    else:
        row = (b.to(tl.int64) * N_HEADS + head) * num_splits + split  # [R_PAD]
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=r_ok)
        used = r_ok & (l_i > 0)  # an empty split's partial is never read
        tl.store(part_ptr + row[:, None] * D + d[None, :], o, mask=used[:, None] & d_ok[None, :])
        if MERGE == 2:  # noqa: SIM102 (constexpr: no atomic in the other variants)
            # the last split of this (b, kvh) to arrive merges them all
            if last_to_arrive(counter_ptr + b * tl.num_programs(1) + kvh, num_splits):
                merge_splits(
                    part_ptr, lse_ptr, out_ptr, q8_ptr, q8d_ptr, q8s_ptr, b, kvh * REP, n_used,
                    num_splits, stride_ob, stride_oh, stride_q8, stride_q8d, N_HEADS, REP,
                    REP_PAD, D, D_PAD, S_PAD, CHUNK, WHILE_LOOP, Q8,
                )  # fmt: skip


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, seq_lens_ptr, out_ptr, q8_ptr, q8d_ptr, q8s_ptr, num_splits, stride_ob,
    stride_oh, stride_q8, stride_q8d,
    N_HEADS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, S_PAD: tl.constexpr, CHUNK: tl.constexpr, WHILE_LOOP: tl.constexpr,
    Q8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(PDL)
    b = tl.program_id(0)
    seq_len = tl.load(seq_lens_ptr + b)
    _, n_used = split_bounds(seq_len, num_splits, BLOCK_N)
    merge_splits(
        part_ptr, lse_ptr, out_ptr, q8_ptr, q8d_ptr, q8s_ptr, b, tl.program_id(1) * HEADS,
        n_used, num_splits, stride_ob, stride_oh, stride_q8, stride_q8d, N_HEADS, HEADS, HEADS,
        D, D_PAD, S_PAD, CHUNK, WHILE_LOOP, Q8,
    )  # fmt: skip


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
    counters: torch.Tensor | None = None,
    block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS,
    num_stages: int | None = None,
    q8: Q8Act | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v for one query per sequence -> [B, n, D] in q's dtype.

    q [B, n, D] (unit last stride; the query of sequence b sits at position seq_lens[b] - 1 and
    sees keys 0 .. seq_lens[b] - 1); k_cache, v_cache [num_blocks, block_size, g, D];
    block_tables [B, max_blocks] int32; seq_lens [B] int32 (0: padding, output zeros). Query
    head h reads KV head h // (n / g). Same contract as `layers.attention.paged_decode_ref`.
    No host synchronisation; the launch grid is (B, g, num_splits).

    counters: None merges the splits with a second kernel; a contiguous int32 tensor of at
    least B * g zeros makes the last program of each (sequence, KV head) merge them instead and
    leaves the tensor zero again (one buffer can serve every layer and graph; launches sharing
    it must not run concurrently). block_n (tokens per tile), num_warps and num_stages are
    launch choices: they change the speed and, through the tiling, the last bits.

    q8: an empty Q8Act of B rows and n * D values (`mmvq.empty_q8`) that the kernel fills with
    `mmvq.quantize_q8(out.view(B, n * D))`, bit for bit, as it stores out (D a power of 2 >= 32).
    """
    check_decode_args(q, k_cache, v_cache, block_tables, seq_lens)
    if num_stages is None:
        # H200 (bench/attention_gpu.py, 2026-11-30): 5 stages pay where the split count is
        # raised for small batches (batch 1, 32k: 28.7 us against 31.4 with 3); at the floor of
        # NUM_SPLITS, 3 were faster (batch 8: 28.1 against 33.6 us at 4k, 152 against 176
        # at 32k).
        num_stages = NUM_STAGES if num_splits > NUM_SPLITS else 3
    b, n, d = q.shape
    g, kv_block = k_cache.shape[2], k_cache.shape[1]
    rep = n // g
    if out is None:
        out = torch.empty((b, n, d), dtype=q.dtype, device=q.device)
    elif out.shape != (b, n, d) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{b}, {n}, {d}] with unit last stride")
    if num_splits < 1 or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"num_splits {num_splits} < 1 or block_n {block_n} not a power of 2")
    if counters is not None:
        check_counters(counters, b * g, q.device)
    if q8 is not None:
        check_q8_out(q8, b, n * d, q.device, f"attention output of head dim {d}")
        if d < QBLOCK or d & (d - 1):
            raise ValueError(f"q8 output needs a head dim that is a power of 2 >= 32, got {d}")
    if b == 0:
        return out
    d_pad = triton.next_power_of_2(d)
    s_pad = triton.next_power_of_2(num_splits)
    dot_f32 = q.device.type != "cuda" or torch.float32 in (q.dtype, k_cache.dtype)
    interpret = q.device.type != "cuda"
    merge = 0 if num_splits == 1 else 1 if counters is None else 2
    if merge:
        part = torch.empty((b, n, num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((b, n, num_splits), dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # unused
    rep_pad = triton.next_power_of_2(rep)
    q8q, q8d, q8s = (out, out, out) if q8 is None else q8  # unused without q8
    q8_args = (q8q, q8d, q8s)
    q8_strides = (q8q.stride(0), q8d.stride(0))
    _decode_split_kernel[(b, g, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part, lse,
        out if counters is None else counters, *q8_args,
        scale * _LOG2E, num_splits, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1), *q8_strides,
        N_HEADS=n, REP=rep, R_PAD=max(16, rep_pad), REP_PAD=rep_pad, D=d, D_PAD=d_pad,
        KV_BLOCK=kv_block, BLOCK_N=block_n, MERGE=merge, S_PAD=s_pad,
        CHUNK=min(s_pad, max(1, 16 * num_warps // rep_pad)), DOT_F32=dot_f32, WHILE_LOOP=interpret,
        Q8=q8 is not None, num_warps=num_warps, num_stages=num_stages, **pdl_args(q.device),
    )  # fmt: skip
    if merge == 1:
        _merge_splits_kernel[(b, n)](
            part, lse, seq_lens, out, *q8_args, num_splits, out.stride(0), out.stride(1),
            *q8_strides, N_HEADS=n, HEADS=1, D=d, D_PAD=d_pad, BLOCK_N=block_n, S_PAD=s_pad,
            CHUNK=min(s_pad, 32), WHILE_LOOP=interpret, Q8=q8 is not None, num_warps=4,
            **pdl_args(q.device),
        )  # fmt: skip
    return out

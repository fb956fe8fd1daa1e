"""Paged attention for steps with several new tokens per sequence (prefill chunks, verification
of drafted tokens): FlashAttention-style over the paged KV cache, causal, GQA.

Each program owns one (sequence, KV head, block of BLOCK_Q new tokens) and stacks the R query
heads of that KV head's group under each token: BLOCK_Q * R_PAD rows of queries, so every K/V
tile gathered through the block table is read once for the whole group. It walks the context in
tiles of BLOCK_N tokens from position 0 up to the block's last query, with an online softmax in
float32 (exp2, scores pre-scaled by log2 e), and masks keys past each query's own position.
With `split_loop` the walk has two parts: the tiles wholly visible to every row of the block
(no causal mask, no bounds checks) and the few diagonal tiles after them (masked).

A query's result does not depend on the other queries of its block or step: the tiles start at
position 0 whatever the chunking, a tile that lies wholly past a query's position leaves its
running max, sum and accumulator unchanged bit for bit (scale 1, zero added), and a tile it
sees whole gives the same bits masked or not (the mask selects after the same arithmetic: the
exponent is an explicit fma in both parts, so no compiler contraction can differ between
them). So a prompt gives the same bits prefilled in one chunk or many, alone or beside other
sequences, for a given config. BLOCK_N (and, through the reduction layouts, the rest of the
config) sets the last bits: the engine uses `DEFAULT_CONFIG` alone; other configs exist for
the sweep (bench/prefill_attention_gpu.py) and the tests.

The grid is (B, g, cdiv(max_query_len, BLOCK_Q)); the blocks of new tokens are taken last
first (the longest key walks start first), and programs past a sequence's own new tokens return
at once. Lengths are read on the device (query_start_loc, seq_lens): no host sync.

Letters: T new tokens, B sequences, n query heads, g KV heads, R = n / g, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # context tokens per tile: fixed per build (it sets the last bits of every query)
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillAttnConfig:
    """Launch shape of the prefill kernel.

    rows: query rows per program (BLOCK_Q = rows // R_PAD new tokens, at least one); block_n:
    keys per tile (keep `BLOCK_N` outside a sweep); num_warps, num_stages: Triton's;
    split_loop: walk the tiles visible to every row without the mask, then the diagonal ones
    masked; bt_tile: load a tile's block-table entries once ([block_n / block_size]) and
    broadcast them to its keys, instead of one load per key.
    """

    rows: int = 128
    block_n: int = BLOCK_N
    num_warps: int = 8
    num_stages: int = 5
    split_loop: bool = True
    bt_tile: bool = False

    def __post_init__(self) -> None:
        for name in ("rows", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of 2 >= 16, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"num_warps {self.num_warps}, num_stages {self.num_stages}")

    @property
    def label(self) -> str:
        """Short name for tables: r128 n64 w8 s3 split bt."""
        flags = ["split"] * self.split_loop + ["bt"] * self.bt_tile
        shape = f"r{self.rows} n{self.block_n} w{self.num_warps} s{self.num_stages}"
        return " ".join([shape, *flags])


# H200, 30B heads (`python bench/prefill_attention_gpu.py --quick`, 2026-11-30, bench/RESULTS.md):
# 2048 new tokens over a 32k context 2,615 us (407 TFLOP/s) against 4,038 for the shape before
# (64 rows, 4 warps, 2 stages, every tile masked), 1024 over 32k 1,334 against 2,086; the
# fastest of 7 shapes in each case. 5 stages because the K/V addresses come from a block-table
# load: at 3 or 4 (Triton 3.6, sm_90) the next tile's copy is issued only after the current one
# is used, at 5 it is in flight (129 KiB of shared memory, 184 registers, no spills).
DEFAULT_CONFIG = PrefillAttnConfig(bt_tile=True)


@triton.jit
def _tile_blocks(bt_row, t, t0, end, KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASK: tl.constexpr, BT_TILE: tl.constexpr):  # fmt: skip
    """[BLOCK_N] int64 cache block of each key t of the tile starting at t0 (0 past `end`)."""
    if BT_TILE:
        NB: tl.constexpr = BLOCK_N // KV_BLOCK
        j = t0 // KV_BLOCK + tl.arange(0, NB)
        if MASK:
            blk = tl.load(bt_row + j, mask=j * KV_BLOCK < end, other=0)
        else:
            blk = tl.load(bt_row + j)
        blk = tl.reshape(tl.broadcast_to(blk[:, None], (NB, KV_BLOCK)), (BLOCK_N,))
    else:
        if MASK:
            blk = tl.load(bt_row + t // KV_BLOCK, mask=t < end, other=0)
        else:
            blk = tl.load(bt_row + t // KV_BLOCK)
    return blk.to(tl.int64)


@triton.jit
def _load_tile(base, block, offset, t_ok, d, d_ok, stride_b, stride_t,
               MASK: tl.constexpr, EVEN_D: tl.constexpr):  # fmt: skip
    """K or V rows [BLOCK_N, D_PAD] of the keys at (block, offset); 0 where not t_ok / d_ok."""
    ptrs = base + block[:, None] * stride_b + offset[:, None] * stride_t + d[None, :]
    if MASK:
        return tl.load(ptrs, mask=t_ok[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=d_ok[None, :], other=0.0)


@triton.jit
def _prefill_tile(
    q, m_i, l_i, acc, t0, end, pos, bt_row, k_base, v_base, d, d_ok, scale_log2e,
    stride_kb, stride_kt, stride_vb, stride_vt,
    KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, MASK: tl.constexpr,
    EVEN_D: tl.constexpr, BT_TILE: tl.constexpr, SUM_DOT: tl.constexpr,
):  # fmt: skip
    """One online-softmax step of rows q [M, D_PAD] over keys t0 .. t0 + BLOCK_N - 1. MASK:
    row i sees only keys <= pos[i] and < end; without it the caller guarantees every key of the
    tile is < end and <= every row's position. Row results are the same bits either way when
    the row sees the whole tile: the mask only selects after the shared arithmetic."""
    t = t0 + tl.arange(0, BLOCK_N)
    t_ok = t < end
    block = _tile_blocks(bt_row, t, t0, end, KV_BLOCK, BLOCK_N, MASK, BT_TILE)
    offset = t % KV_BLOCK
    k = _load_tile(k_base, block, offset, t_ok, d, d_ok, stride_kb, stride_kt, MASK, EVEN_D)
    if SUM_DOT:  # the interpreter: numpy's matmul may round a row by its place in the tile
        qk = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    elif DOT_F32:
        qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q.to(k.dtype), tl.trans(k))  # [M, BLOCK_N] float32
    x = qk * scale_log2e
    if MASK:
        visible = t[None, :] <= pos[:, None]
        x = tl.where(visible, x, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(x, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(tl.fma(qk, scale_log2e, -m_safe[:, None]))
    if MASK:
        p = tl.where(visible, p, 0.0)
    v = _load_tile(v_base, block, offset, t_ok, d, d_ok, stride_vb, stride_vt, MASK, EVEN_D)
    if SUM_DOT:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    elif DOT_F32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv


@triton.jit
def _prefill_span(
    q, m_i, l_i, acc, lo, hi, end, pos, bt_row, k_base, v_base, d, d_ok, scale_log2e,
    stride_kb, stride_kt, stride_vb, stride_vt,
    KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, MASK: tl.constexpr,
    EVEN_D: tl.constexpr, BT_TILE: tl.constexpr, WHILE_LOOP: tl.constexpr,
):  # fmt: skip
    """`_prefill_tile` over the tiles starting at lo, lo + BLOCK_N, ... below hi. WHILE_LOOP
    (the interpreter): a while loop (it cannot range() over loaded values), else a range; and
    the tiles' dots as sums of products (`_prefill_tile`'s SUM_DOT), each row on its own."""
    if WHILE_LOOP:
        t0 = lo
        while t0 < hi:
            m_i, l_i, acc = _prefill_tile(
                q, m_i, l_i, acc, t0, end, pos, bt_row, k_base, v_base, d, d_ok, scale_log2e,
                stride_kb, stride_kt, stride_vb, stride_vt, KV_BLOCK, BLOCK_N, DOT_F32, MASK,
                EVEN_D, BT_TILE, WHILE_LOOP,
            )  # fmt: skip
            t0 += BLOCK_N
    else:
        for t0 in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q, m_i, l_i, acc, t0, end, pos, bt_row, k_base, v_base, d, d_ok, scale_log2e,
                stride_kb, stride_kt, stride_vb, stride_vt, KV_BLOCK, BLOCK_N, DOT_F32, MASK,
                EVEN_D, BT_TILE, WHILE_LOOP,
            )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr, scale_log2e,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ot, stride_oh,
    REP: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    KV_BLOCK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, WHILE_LOOP: tl.constexpr, SPLIT: tl.constexpr,
    BT_TILE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    qb = tl.num_programs(2) - 1 - tl.program_id(2)  # last blocks (longest walks) first
    q_start = tl.load(qsl_ptr + b)
    n_q = tl.load(qsl_ptr + b + 1) - q_start
    if qb * BLOCK_Q >= n_q:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx0 = seq_len - n_q  # position of the sequence's first new token
    BLOCK_M: tl.constexpr = BLOCK_Q * R_PAD
    EVEN_D: tl.constexpr = D == D_PAD
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
    # keys up to the block's last query
    end = ctx0 + tl.minimum(qb * BLOCK_Q + BLOCK_Q, n_q)
    if SPLIT:  # tiles wholly at or below the block's first query: visible to every row
        full_end = tl.maximum(ctx0 + qb * BLOCK_Q + 1, 0) // BLOCK_N * BLOCK_N
    else:
        full_end = end * 0
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    m_i, l_i, acc = _prefill_span(
        q, m_i, l_i, acc, 0, full_end, end, pos, bt_row, k_base, v_base, d, d_ok, scale_log2e,
        stride_kb, stride_kt, stride_vb, stride_vt, KV_BLOCK, BLOCK_N, DOT_F32, False, EVEN_D,
        BT_TILE, WHILE_LOOP,
    )  # fmt: skip
    m_i, l_i, acc = _prefill_span(
        q, m_i, l_i, acc, full_end, end, end, pos, bt_row, k_base, v_base, d, d_ok,
        scale_log2e, stride_kb, stride_kt, stride_vb, stride_vt, KV_BLOCK, BLOCK_N, DOT_F32,
        True, EVEN_D, BT_TILE, WHILE_LOOP,
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
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables must have unit stride along its blocks")
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
    config: PrefillAttnConfig | None = None,
) -> torch.Tensor:
    """Causal attention of a step's new tokens: q [T, n, D] -> [T, n, D] in q's dtype.

    Sequence b's new tokens are rows query_start_loc[b]:[b+1] of q, the last of its
    seq_lens[b] context tokens, whose K/V are already in k_cache/v_cache [blocks, block_size,
    g, D] at the slots of block_tables[b]. `max_query_len` (a host int, >= every sequence's
    new tokens) sizes the grid. Same contract as `layers.attention.paged_attention_ref`.
    `config` (None: `DEFAULT_CONFIG`, the only one the engine uses) sets the launch shape; a
    query's bits depend on it but never on the chunking or the other sequences.
    """
    check_prefill_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    cfg = DEFAULT_CONFIG if config is None else config
    t, n, d = q.shape
    g, kv_block = k_cache.shape[2], k_cache.shape[1]
    rep = n // g
    r_pad = triton.next_power_of_2(rep)
    if out is None:
        out = torch.empty_like(q)
    b = seq_lens.shape[0]
    if t == 0 or b == 0:
        return out
    # float32 (and the interpreter) take full-precision dots: tl.dot on float32 is tf32 by default
    dot_f32 = q.device.type != "cuda" or torch.float32 in (q.dtype, k_cache.dtype)
    rows, num_stages = cfg.rows, cfg.num_stages
    if dot_f32 and q.is_cuda:  # float32 tiles take twice the registers and shared memory
        rows, num_stages = min(rows, 64), min(num_stages, 2)
    block_q = max(1, rows // r_pad)
    bt_tile = cfg.bt_tile and kv_block <= cfg.block_n and cfg.block_n % kv_block == 0
    grid = (b, g, triton.cdiv(max(max_query_len, 1), block_q))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        REP=rep, R_PAD=r_pad, D=d, D_PAD=triton.next_power_of_2(d), KV_BLOCK=kv_block,
        BLOCK_Q=block_q, BLOCK_N=cfg.block_n, DOT_F32=dot_f32, WHILE_LOOP=not q.is_cuda,
        SPLIT=cfg.split_loop, BT_TILE=bt_tile, num_warps=cfg.num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out

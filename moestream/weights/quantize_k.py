"""K-quant quantizers (Q2_K..Q6_K): llama.cpp's reference algorithms, vectorized over blocks.

Each `quantize_qN_k(blocks)` takes float32 super-blocks [B, 256] and returns their GGUF bytes
[B, type_size] (uint8), following `quantize_row_qN_K_ref` in ggml-quants.c (no importance
matrix): the per-sub-block scale (and min) search of `make_qkx2_quants` (Q2_K, Q4_K, Q5_K),
`make_q3_quants` (Q3_K) or `make_qx_quants` (Q6_K), then 4-, 6- or 8-bit quantization of those
scales against one fp16 super-block scale, then re-quantization of every value against its
quantized sub-block scale. Loops run over search steps or over the 16 positions of a sub-block,
never over blocks. Callers keep B small enough for the working arrays to stay in cache.

Letters in shape comments: B super-blocks, S sub-blocks (B * 256 / n), n values per sub-block.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
GROUP_MAX_EPS = 1e-15  # below this |max| a sub-block counts as all zero (ggml-quants.c)


def _fp16(a: np.ndarray) -> np.ndarray:
    """Round to fp16 (round to nearest even, as GGML_FP32_TO_FP16) and back to float32."""
    return a.astype(np.float16).astype(np.float32)


def _f16_bytes(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).view(np.uint8).reshape(-1, 2)  # [B, 2]


def _dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", a, b)  # row-wise dot, [S, n] x [S, n] -> [S]


def _requantize(x: np.ndarray, d: np.ndarray, offset: np.ndarray | None, lo: int, hi: int):
    """Levels clip(rint((x + offset) / d), lo, hi) per sub-block; 0 where d == 0.

    x [S, n], d and offset [S]. Where d == 0 the reference leaves the levels of the scale search
    in place; they do not matter because dequantization multiplies them by 0.
    """
    num = x if offset is None else x + offset[:, None]
    levels = np.zeros_like(x)
    np.divide(num, d[:, None], out=levels, where=(d != 0)[:, None])
    np.rint(levels, out=levels)
    np.clip(levels, lo, hi, out=levels)
    return levels.astype(np.int8)


def _qkx2_scale_min(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> tuple[np.ndarray, np.ndarray]:
    """make_qkx2_quants over all sub-blocks: (scale [S], the_min [S]) with x ~ scale*L - the_min.

    x, w: [S, n]. Tries nstep + 1 inverse scales (rmin + rdelta*step + nmax) / (max - min); for
    each, assigns levels L = rint(iscale * (x - min)), fits scale and min to them by weighted
    least squares and keeps the fit if its weighted error (squared, or absolute if use_mad) is
    the smallest yet. As in the reference, `min` moves to each better fit, so later steps start
    from it. Levels are not returned: every caller recomputes them from the quantized scales.
    """
    xmax = x.max(axis=1)  # [S]
    cur_min = np.minimum(x.min(axis=1), 0)
    flat = xmax == cur_min
    flat_min = cur_min[flat]
    cur_min[flat] = xmax[flat] - 1  # any span: the result is overwritten below
    sum_w = w.sum(axis=1, dtype=np.float64)
    wx = w * x
    sum_x = wx.sum(axis=1, dtype=np.float64)
    levels = np.empty_like(x)
    wl = np.empty_like(x)
    fmax = np.float32(nmax)

    def assign(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        np.subtract(x, cur_min[:, None], out=levels)
        np.multiply(levels, iscale[:, None], out=levels)
        np.rint(levels, out=levels)
        np.clip(levels, np.float32(0), fmax, out=levels)
        np.multiply(w, levels, out=wl)
        sum_l = np.einsum("ij->i", wl).astype(np.float64)
        return sum_l, _dot(wl, levels).astype(np.float64), _dot(wl, x).astype(np.float64)

    def error(scale, mn, sum_l, sum_l2, sum_xl):
        if use_mad:
            diff = levels * scale.astype(np.float32)[:, None]
            diff += mn.astype(np.float32)[:, None]
            diff -= x
            np.abs(diff, out=diff)
            return _dot(w, diff).astype(np.float64)
        # sum w (scale*l + mn - x)^2 without its constant sum w x^2, which cancels in comparisons
        return (
            scale * scale * sum_l2
            + mn * mn * sum_w
            + 2 * scale * mn * sum_l
            - 2 * scale * sum_xl
            - 2 * mn * sum_x
        )

    iscale = fmax / (xmax - cur_min)
    best_scale = (1 / iscale).astype(np.float64)
    best_error = error(best_scale, cur_min.astype(np.float64), *assign(iscale))
    rmin, rdelta = np.float32(rmin), np.float32(rdelta)
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * np.float32(step) + fmax) / (xmax - cur_min)
        sum_l, sum_l2, sum_xl = assign(iscale)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        det[~ok] = 1
        scale = (sum_w * sum_xl - sum_x * sum_l) / det
        mn = (sum_l2 * sum_x - sum_l * sum_xl) / det
        pos = (mn > 0) & (sum_l2 > 0)
        mn[pos] = 0
        scale[pos] = sum_xl[pos] / sum_l2[pos]
        err = error(scale, mn, sum_l, sum_l2, sum_xl)
        better = ok & (err < best_error)
        best_error = np.where(better, err, best_error)
        best_scale = np.where(better, scale, best_scale)
        np.copyto(cur_min, mn, where=better, casting="same_kind")
    best_scale[flat] = 0
    cur_min[flat] = flat_min
    return best_scale.astype(np.float32), -cur_min


def _signed_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(value of largest magnitude, its magnitude) per row of x [S, n]; the first one on ties."""
    idx = np.abs(x).argmax(axis=1)
    vmax = x[np.arange(len(x)), idx]
    return vmax, np.abs(vmax)


def _qx_scale(x: np.ndarray, nmax: int) -> np.ndarray:
    """make_qx_quants(rmse_type=1, no importance weights): scale [S] of x [S, n] ~ scale*L.

    Levels L in [-nmax, nmax - 1]; tries 19 inverse scales -(nmax + 0.1 k) / max, k in -9..9,
    keeping the one that maximizes (sum w x L)^2 / sum w L^2 with w = x^2.
    """
    vmax, amax = _signed_max(x)
    zero = amax < GROUP_MAX_EPS
    vmax[zero] = 1
    w = x * x
    wx = w * x
    levels = np.empty_like(x)

    def sums(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        np.multiply(x, iscale[:, None], out=levels)
        np.rint(levels, out=levels)
        np.clip(levels, -nmax, nmax - 1, out=levels)
        sum_lx = _dot(wx, levels).astype(np.float64)
        return sum_lx, _dot(w * levels, levels).astype(np.float64)

    sum_lx, sum_l2 = sums(-np.float32(nmax) / vmax)
    scale = np.where(sum_l2 > 0, sum_lx / np.where(sum_l2 > 0, sum_l2, 1), 0)
    best = scale * sum_lx
    for k in range(-9, 10):
        if k == 0:
            continue
        sum_lx, sum_l2 = sums(-(np.float32(nmax) + np.float32(0.1) * np.float32(k)) / vmax)
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        scale = np.where(better, sum_lx / np.where(better, sum_l2, 1), scale)
        best = np.where(better, scale * sum_lx, best)
    scale[zero] = 0
    return scale.astype(np.float32)


def _q3_scale(x: np.ndarray, nmax: int) -> np.ndarray:
    """make_q3_quants(do_rmse=True): scale [S] of x [S, n] ~ scale*L, L in [-nmax, nmax - 1].

    Starts from L = rint(-nmax x / max) and runs up to 5 sweeps of coordinate descent: each value
    in turn moves to the level that is best given all the others, if that raises
    (sum w x L)^2 / sum w L^2 (w = x^2). The sweep is sequential within a sub-block, so the loop
    runs over positions and is vectorized over sub-blocks.
    """
    vmax, amax = _signed_max(x)
    zero = amax < GROUP_MAX_EPS
    vmax[zero] = 1
    xt = np.ascontiguousarray(x.T)  # [n, S]: one position of every sub-block is contiguous
    lt = np.clip(np.rint(xt * (-np.float32(nmax) / vmax)), -nmax, nmax - 1)
    wt = xt * xt
    sum_lx = np.einsum("ij,ij->j", wt * xt, lt)
    sum_l2 = np.einsum("ij,ij->j", wt * lt, lt)
    for _ in range(5):
        changed = False
        for i in range(len(xt)):
            xi, wi, li = xt[i], wt[i], lt[i]
            slx = sum_lx - wi * xi * li
            sl2 = sum_l2 - wi * li * li
            pos = slx > 0
            new_l = np.divide(xi * sl2, slx, out=np.zeros_like(slx), where=pos)
            new_l = np.clip(np.rint(new_l), -nmax, nmax - 1)
            slx += wi * xi * new_l
            sl2 += wi * new_l * new_l
            accept = pos & (new_l != li) & (sl2 > 0) & (slx * slx * sum_l2 > sum_lx * sum_lx * sl2)
            if accept.any():
                changed = True
                lt[i] = np.where(accept, new_l, li)
                sum_lx = np.where(accept, slx, sum_lx)
                sum_l2 = np.where(accept, sl2, sum_l2)
        if not changed:
            break
    scale = np.divide(sum_lx, sum_l2, out=np.zeros_like(sum_lx), where=sum_l2 > 0)
    scale[zero] = 0
    return scale


def _pack_2bit(levels: np.ndarray) -> np.ndarray:
    """[B, 256] values in 0..3 -> [B, 64]: byte 32c + l holds values 128c + 32k + l at bits 2k."""
    q = levels.astype(np.uint8).reshape(-1, 2, 4, 32) << np.array([0, 2, 4, 6], np.uint8)[:, None]
    return np.bitwise_or.reduce(q, axis=2).reshape(-1, 64)


def _pack_nibbles(levels: np.ndarray) -> np.ndarray:
    """[B, 256] values in 0..15 -> [B, 128]: byte 32c + l holds 64c + l (low), 64c + 32 + l."""
    q = levels.astype(np.uint8).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _pack_k4_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [B, 8] -> the 12 bytes that get_scale_min_k4 reads."""
    out = np.empty((len(ls), 12), np.uint8)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return out


def _quantize_min_scales(values: np.ndarray, top: np.ndarray, bits_max: int) -> np.ndarray:
    """Sub-block scales or mins [B, m] (>= 0) as integers 0..bits_max against top / bits_max."""
    inv = np.divide(np.float32(bits_max), top, out=np.zeros_like(top), where=top > 0)
    return np.clip(np.rint(inv[:, None] * values), 0, bits_max).astype(np.uint8)


def _quantize_scale_min_k(blocks: np.ndarray, nmax: int, rmin: float, nstep: int) -> np.ndarray:
    """Common body of Q4_K and Q5_K: header (d, dmin, scales: 16 bytes) and levels [B, 256]."""
    x = blocks.reshape(-1, 32)  # [S, 32]
    av_x = np.sqrt(np.einsum("ij,ij->i", x, x) / 32)
    w = av_x[:, None] + np.abs(x)
    scales, mins = _qkx2_scale_min(x, w, nmax, rmin, 0.1, nstep, use_mad=False)
    scales, mins = scales.reshape(-1, 8), mins.reshape(-1, 8)  # [B, 8]
    max_scale, max_min = scales.max(axis=1), mins.max(axis=1)
    ls = _quantize_min_scales(scales, max_scale, 63)
    lm = _quantize_min_scales(mins, max_min, 63)
    d, dmin = max_scale / np.float32(63), max_min / np.float32(63)
    sub_d = (_fp16(d)[:, None] * ls).reshape(-1)  # [S]
    sub_m = (_fp16(dmin)[:, None] * lm).reshape(-1)
    levels = _requantize(x, sub_d, sub_m, 0, nmax).reshape(-1, QK_K)
    header = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k4_scales(ls, lm)], axis=1)
    return header, levels


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """float32 [B, 256] -> Q4_K bytes [B, 144]: d, dmin, scales[12], qs[128]."""
    header, levels = _quantize_scale_min_k(blocks, 15, -1.0, 20)
    return np.concatenate([header, _pack_nibbles(levels)], axis=1)


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """float32 [B, 256] -> Q5_K bytes [B, 176]: d, dmin, scales[12], qh[32], qs[128]."""
    header, levels = _quantize_scale_min_k(blocks, 31, -0.5, 15)
    high = (levels.astype(np.uint8) >> 4).reshape(-1, 8, 32)
    high <<= np.arange(8, dtype=np.uint8)[:, None]
    qh = np.bitwise_or.reduce(high, axis=1)  # bit 2c (+1) of qh[l]: value 64c (+ 32) + l
    return np.concatenate([header, qh, _pack_nibbles(levels & 0xF)], axis=1)


def quantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    """float32 [B, 256] -> Q2_K bytes [B, 84]: scales[16] (scale | min << 4), qs[64], d, dmin."""
    x = blocks.reshape(-1, 16)  # [S, 16]
    scales, mins = _qkx2_scale_min(x, np.abs(x), 3, -0.5, 0.1, 15, use_mad=True)
    scales, mins = scales.reshape(-1, 16), mins.reshape(-1, 16)  # [B, 16]
    max_scale, max_min = scales.max(axis=1), mins.max(axis=1)
    ls = _quantize_min_scales(scales, max_scale, 15)
    lm = _quantize_min_scales(mins, max_min, 15)
    d, dmin = max_scale / np.float32(15), max_min / np.float32(15)
    sub_d = (_fp16(d)[:, None] * ls).reshape(-1)
    sub_m = (_fp16(dmin)[:, None] * lm).reshape(-1)
    levels = _requantize(x, sub_d, sub_m, 0, 3).reshape(-1, QK_K)
    return np.concatenate(
        [ls | (lm << 4), _pack_2bit(levels), _f16_bytes(d), _f16_bytes(dmin)], axis=1
    )


def quantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    """float32 [B, 256] -> Q3_K bytes [B, 110]: hmask[32], qs[64], scales[12], d."""
    x = blocks.reshape(-1, 16)  # [S, 16]
    scales = _q3_scale(x, 4).reshape(-1, 16)  # [B, 16]
    max_scale, amax = _signed_max(scales)
    live = amax > 0
    iscale = np.divide(np.float32(-32), max_scale, out=np.zeros_like(max_scale), where=live)
    ls = np.clip(np.rint(iscale[:, None] * scales), -32, 31) + 32
    ls = np.where(live[:, None], ls, 0).astype(np.uint8)  # 6-bit, biased by 32
    d = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=live)
    packed_scales = np.empty((len(ls), 12), np.uint8)
    packed_scales[:, :8] = (ls[:, :8] & 0xF) | ((ls[:, 8:] & 0xF) << 4)
    high = (ls >> 4).reshape(-1, 4, 4) << np.array([0, 2, 4, 6], np.uint8)[:, None]
    packed_scales[:, 8:] = np.bitwise_or.reduce(high, axis=1)  # byte 8 + j%4, bits 2*(j/4)
    sub_d = (_fp16(d)[:, None] * (ls.astype(np.float32) - 32)).reshape(-1)
    levels = (_requantize(x, sub_d, None, -4, 3) + 4).astype(np.uint8).reshape(-1, QK_K)
    high = (levels >> 2).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]
    hmask = np.bitwise_or.reduce(high, axis=1)  # bit j // 32 of hmask[j % 32]: level j >= 4
    return np.concatenate([hmask, _pack_2bit(levels & 3), packed_scales, _f16_bytes(d)], axis=1)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """float32 [B, 256] -> Q6_K bytes [B, 210]: ql[128], qh[64], scales[16] (int8), d."""
    x = blocks.reshape(-1, 16)  # [S, 16]
    scales = _qx_scale(x, 32).reshape(-1, 16)  # [B, 16]
    max_scale, amax = _signed_max(scales)
    live = amax >= GROUP_MAX_EPS
    iscale = np.divide(np.float32(-128), max_scale, out=np.zeros_like(max_scale), where=live)
    ls = np.clip(np.rint(iscale[:, None] * scales), -128, 127).astype(np.int8)
    d = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=live)
    sub_d = (_fp16(d)[:, None] * ls).reshape(-1)
    levels = (_requantize(x, sub_d, None, -32, 31) + 32).astype(np.uint8)
    q = levels.reshape(-1, 2, 4, 32)  # [B, half, quarter, 32]
    ql = np.concatenate(
        [q[:, :, 0] & 0xF | (q[:, :, 2] & 0xF) << 4, q[:, :, 1] & 0xF | (q[:, :, 3] & 0xF) << 4],
        axis=2,
    ).reshape(-1, 128)
    qh = np.bitwise_or.reduce((q >> 4) << np.array([0, 2, 4, 6], np.uint8)[:, None], axis=2)
    out = np.concatenate([ql, qh.reshape(-1, 64), ls.view(np.uint8), _f16_bytes(d)], axis=1)
    out[~live] = 0  # an all-zero super-block is all zero bytes
    return out

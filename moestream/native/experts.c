/* The decode MoE's expert arithmetic on the CPU, operation for operation as the GPU kernels
 * compute it (moestream/kernels/exact.py explains why those round every operation as written),
 * so that an expert computed here gives the bits it gives on the GPU.
 *
 * Built by moestream/native/__init__.py with -ffp-contract=off and without -ffast-math: every
 * float expression below rounds as written (C11, FLT_EVAL_METHOD 0 on x86-64 and aarch64),
 * fmaf is the correctly rounded fused multiply-add.
 *
 * gate_up_q4_k: one token's h = silu(gate x) * (up x) over F rows of Q4_K gate and up weights
 * (rows of K / 256 blocks of 144 bytes), x given as q8 blocks (the GPU's quantize_q8: int8
 * values xq, per 32 values the scale xd and xd * sum(q) xs), rounded to q8 blocks of h. The
 * order is `moe_mmvq._gate_up_once_kernel`'s: per row, for K steps of G groups of 256, the
 * partial sum of each (group-in-step, 32-byte run c of the group's quants, half h of the run's
 * 8 words) as `mmvq_once._once_q4_k`, added to its slot ("parts" [4G][2], from 0.0); then the
 * 8G slots summed by `mmvq.tree_sum` (pairwise by index, slot 2r + h).
 *
 * down_q4_k, down_q6_k: one expert's down rows against one assignment's q8 h, times its routing
 * weight, in the order of `moe_mmvq._down_mmvq_kernel` launched with `REPRODUCIBLE_DOWN` (one
 * expert per chunk, tree sums, the [1, rows, runs, words] tile of `mmvq.acc_runs`; all F / 256
 * groups in one step): per row, the tile's 8 * 4G elements (slot 8r + lane, r = 4 * group + run
 * c) as `mmvq._acc_q4_k` / `mmvq._acc_q6_k` accumulate them from 0.0, summed by `tree_sum`. The
 * kernel adds the experts' sums in selection order: y = ((0 + T_0) + T_1) + ...
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while (!(man & 0x400u));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3FFu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* exact.exp_rn: Cody-Waite reduction, degree-7 Taylor polynomial in fmas, 2^k from its bits. */
static float exp_rn(float x) {
    x = fminf(fmaxf(x, -87.0f), 88.0f);
    float k = floorf(x * 1.4426950408889634f + 0.5f);
    float r = fmaf(k, -0.693145751953125f, x);
    r = fmaf(k, -1.4286067653302226e-06f, r);
    float p = fmaf(r, (float)(1.0 / 5040.0), (float)(1.0 / 720.0));
    p = fmaf(p, r, (float)(1.0 / 120.0));
    p = fmaf(p, r, (float)(1.0 / 24.0));
    p = fmaf(p, r, (float)(1.0 / 6.0));
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    uint32_t bits = (uint32_t)((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

static float silu_rn(float g) { return g / (1.0f + exp_rn(-g)); }

/* mmvq.k_scale_min_words: the 6-bit scale and min of sub-block s (0..7). */
static void scale_min(const uint8_t *q, int s, float *sc, float *mn) {
    int a, b;
    if (s < 4) {
        a = q[s] & 63;
        b = q[s + 4] & 63;
    } else {
        a = (q[s + 4] & 15) | ((q[s - 4] >> 6) << 4);
        b = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
    }
    *sc = (float)a;
    *mn = (float)b;
}

/* The dot product of 4 words (16 values) of quants (low or high nibbles) with int8 values. */
static int32_t dot16(const uint8_t *qs, int high, const int8_t *x) {
    int32_t s = 0;
    for (int i = 0; i < 16; i++) {
        int q = high ? (qs[i] >> 4) : (qs[i] & 15);
        s += q * (int32_t)x[i];
    }
    return s;
}

/* mmvq_once._once_q4_k for one row, group sb (zero where sb >= groups, as masked loads),
 * run c, half h. */
static float part_q4_k(const uint8_t *row, int sb, int groups, int c, int h, const int8_t *xq,
                       const float *xd, const float *xs) {
    float d = 0.0f, dmin = 0.0f, sc0 = 0.0f, mn0 = 0.0f, sc1 = 0.0f, mn1 = 0.0f;
    float xd0 = 0.0f, xd1 = 0.0f, xs0 = 0.0f, xs1 = 0.0f;
    int32_t s0 = 0, s1 = 0;
    if (sb < groups) {
        const uint8_t *blk = row + (size_t)sb * 144;
        d = f16_to_f32((uint16_t)(blk[0] | (blk[1] << 8)));
        dmin = f16_to_f32((uint16_t)(blk[2] | (blk[3] << 8)));
        scale_min(blk + 4, 2 * c, &sc0, &mn0);
        scale_min(blk + 4, 2 * c + 1, &sc1, &mn1);
        const uint8_t *qs = blk + 16 + 32 * c + 16 * h; /* words 4h .. 4h + 3 of run c */
        const int8_t *xa = xq + (size_t)sb * 256 + 64 * c + 16 * h;
        s0 = dot16(qs, 0, xa);
        s1 = dot16(qs, 1, xa + 32);
        int b0 = sb * 8 + 2 * c;
        xd0 = xd[b0];
        xd1 = xd[b0 + 1];
        xs0 = xs[b0];
        xs1 = xs[b0 + 1];
    }
    float part = ((d * sc1) * xd1) * (float)s1;
    part = fmaf((d * sc0) * xd0, (float)s0, part);
    float m = fmaf(mn0, xs0, mn1 * xs1);
    return fmaf(h == 0 ? -dmin : 0.0f, m, part);
}

/* mmvq.tree_sum over n (a power of two) values, in place. */
static float tree_sum(float *v, int n) {
    for (; n > 1; n >>= 1) {
        for (int i = 0; i < n / 2; i++) {
            v[i] = v[2 * i] + v[2 * i + 1];
        }
    }
    return v[0];
}

static float row_q4_k(const uint8_t *row, int groups, int G, const int8_t *xq, const float *xd,
                      const float *xs) {
    float parts[2 * 4 * 32];
    int R = 4 * G;
    for (int i = 0; i < 2 * R; i++) {
        parts[i] = 0.0f;
    }
    for (int i = 0; i < groups; i += G) {
        for (int r = 0; r < R; r++) {
            for (int h = 0; h < 2; h++) {
                parts[2 * r + h] =
                    parts[2 * r + h] + part_q4_k(row, i + r / 4, groups, r % 4, h, xq, xd, xs);
            }
        }
    }
    return tree_sum(parts, 2 * R);
}

/* mmvq._store_q8 of 32 values: int8 q into hq, the scale into *hd, scale * sum(q) into *hs. */
static void store_q8(const float *h, int8_t *hq, float *hd, float *hs) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) {
        amax = fmaxf(amax, fabsf(h[i]));
    }
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < 32; i++) {
        int32_t q = (int32_t)floorf(h[i] * inv + 0.5f);
        hq[i] = (int8_t)q;
        sum += q;
    }
    float d = amax / 127.0f;
    *hd = d;
    *hs = d * (float)sum;
}

/* Rows n0 .. n1 - 1 (multiples of 32) of one token's gate/up against one expert: h rounded to
 * q8 blocks into hq[n0 ..], hd[n0 / 32 ..], hs[n0 / 32 ..], and h itself into hf[n0 ..] unless
 * hf is NULL. G: groups of 256 per K step (the launch's: min(up_groups, next power of two of
 * K / 256)), at most 32. Returns 0, or -1 for arguments it cannot take. */
int gate_up_q4_k(const uint8_t *gate, const uint8_t *up, int64_t row_bytes, int k, int n0,
                 int n1, int G, const int8_t *xq, const float *xd, const float *xs, int8_t *hq,
                 float *hd, float *hs, float *hf) {
    if (k % 256 || n0 % 32 || n1 % 32 || G < 1 || G > 32 || (G & (G - 1)) ||
        row_bytes < (int64_t)(k / 256) * 144) {
        return -1;
    }
    int groups = k / 256;
    float h[32];
    for (int b = n0; b < n1; b += 32) {
        for (int i = 0; i < 32; i++) {
            float g = row_q4_k(gate + (size_t)(b + i) * row_bytes, groups, G, xq, xd, xs);
            float u = row_q4_k(up + (size_t)(b + i) * row_bytes, groups, G, xq, xd, xs);
            h[i] = silu_rn(g) * u;
        }
        store_q8(h, hq + b, hd + b / 32, hs + b / 32);
        if (hf) {
            memcpy(hf + b, h, sizeof h);
        }
    }
    return 0;
}

/* silu_rn of n values (for tests: exact.silu_rn_ref gives the same bits). */
void silu_rn_n(const float *g, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        out[i] = silu_rn(g[i]);
    }
}


/* mmvq._acc_q4_k's element (run c of group sb, lane w: word w of the run) from 0.0, the block
 * scales times wt. */
static float down_elem_q4_k(const uint8_t *row, int sb, int groups, int c, int w,
                            const int8_t *xq, const float *xd, const float *xs, float wt) {
    if (sb >= groups) {
        return 0.0f; /* masked: every load 0; the fmas give +0 */
    }
    const uint8_t *blk = row + (size_t)sb * 144;
    float d = f16_to_f32((uint16_t)(blk[0] | (blk[1] << 8))) * wt;
    float dmin = f16_to_f32((uint16_t)(blk[2] | (blk[3] << 8))) * wt;
    float sc0, mn0, sc1, mn1;
    scale_min(blk + 4, 2 * c, &sc0, &mn0);
    scale_min(blk + 4, 2 * c + 1, &sc1, &mn1);
    const uint8_t *qs = blk + 16 + 32 * c + 4 * w;
    const int8_t *xa = xq + (size_t)sb * 256 + 64 * c + 4 * w;
    int32_t f0 = 0, f1 = 0;
    for (int i = 0; i < 4; i++) {
        f0 += (qs[i] & 15) * (int32_t)xa[i];
        f1 += (qs[i] >> 4) * (int32_t)xa[32 + i];
    }
    int b0 = sb * 8 + 2 * c;
    float acc = fmaf((d * sc0) * xd[b0], (float)f0, 0.0f);
    acc = fmaf((d * sc1) * xd[b0 + 1], (float)f1, acc);
    float m = fmaf(mn0, xs[b0], mn1 * xs[b0 + 1]);
    return fmaf(w == 0 ? -dmin : 0.0f, m, acc);
}

/* mmvq._acc_q6_k's element (run c = 2n + t of group sb, lane L: word 3L mod 8 of file blocks,
 * which the kernel reads in that order) from 0.0. */
static float down_elem_q6_k(const uint8_t *row, int sb, int groups, int c, int lane,
                            const int8_t *xq, const float *xd, float wt) {
    if (sb >= groups) {
        return 0.0f;
    }
    int w = (3 * lane) % 8, n = c / 2, t = c % 2;
    const uint8_t *blk = row + (size_t)sb * 210;
    const uint8_t *ql = blk + 64 * n + 32 * t + 4 * w;
    const uint8_t *qh = blk + 128 + 32 * n + 4 * w;
    int sc0 = (int8_t)blk[192 + 8 * n + 2 * t + w / 4];
    int sc1 = (int8_t)blk[192 + 8 * n + 2 * t + w / 4 + 4];
    float d = f16_to_f32((uint16_t)(blk[208] | (blk[209] << 8))) * wt;
    const int8_t *x0 = xq + (size_t)sb * 256 + 128 * n + 32 * t + 4 * w;
    int32_t s0 = 0, s1 = 0;
    for (int i = 0; i < 4; i++) {
        int v0 = (ql[i] & 15) | (((qh[i] >> (2 * t)) & 3) << 4);
        int v1 = (ql[i] >> 4) | (((qh[i] >> (2 * t + 4)) & 3) << 4);
        s0 += (v0 - 32) * (int32_t)x0[i];
        s1 += (v1 - 32) * (int32_t)x0[64 + i];
    }
    int b0 = sb * 8 + 4 * n + t;
    float acc = fmaf(d * xd[b0], (float)(sc0 * s0), 0.0f);
    return fmaf(d * xd[b0 + 2], (float)(sc1 * s1), acc);
}

/* Rows n0 .. n1 - 1 of one expert's down projection (rows of F / 256 blocks, row_bytes apart;
 * Q4_K when q6 is 0, else Q6_K) against one assignment's q8 h (hq int8 [F], hd and hs
 * [F / 32]), the block scales times wt: y[n] = T(n) as the reproducible down kernel sums one
 * expert. G: the launch's groups per step (min(down_groups, next power of two of F / 256)),
 * which must cover F in one step. Returns 0, or -1 for arguments it cannot take. */
int down_rows(const uint8_t *w, int64_t row_bytes, int q6, int f, int n0, int n1, int G,
              const int8_t *hq, const float *hd, const float *hs, float wt, float *y) {
    int groups = f / 256;
    if (f % 256 || G < groups || G > 32 || (G & (G - 1)) || n0 < 0 || n1 < n0 ||
        row_bytes < (int64_t)groups * (q6 ? 210 : 144)) {
        return -1;
    }
    float tile[8 * 4 * 32];
    int R = 4 * G;
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * row_bytes;
        for (int r = 0; r < R; r++) {
            for (int lane = 0; lane < 8; lane++) {
                tile[8 * r + lane] =
                    q6 ? down_elem_q6_k(row, r / 4, groups, r % 4, lane, hq, hd, wt)
                       : down_elem_q4_k(row, r / 4, groups, r % 4, lane, hq, hd, hs, wt);
            }
        }
        y[n] = tree_sum(tile, 8 * R);
    }
    return 0;
}

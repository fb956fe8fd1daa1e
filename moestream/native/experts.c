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
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

/* The integer dot products of one 32-byte run of 4-bit quants: lo[w] = sum over the 4 low
 * nibbles of bytes 4w .. 4w + 3 times x_lo[4w ..], hi[w] likewise with the high nibbles and
 * x_hi (dp4a per word, as the GPU kernels compute them; integers, so exact however summed). */
static void nibble_words_scalar(const uint8_t *q, const int8_t *x_lo, const int8_t *x_hi,
                                int32_t lo[8], int32_t hi[8]) {
    for (int w = 0; w < 8; w++) {
        int32_t a = 0, b = 0;
        for (int i = 4 * w; i < 4 * w + 4; i++) {
            a += (q[i] & 15) * (int32_t)x_lo[i];
            b += (q[i] >> 4) * (int32_t)x_hi[i];
        }
        lo[w] = a;
        hi[w] = b;
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
/* nibble_words_scalar's lo and hi as two vectors of 8 int32 (the same integers). */
__attribute__((target("avx2"))) static inline void nibble_words_vec(const uint8_t *q,
                                                                    const int8_t *x_lo,
                                                                    const int8_t *x_hi,
                                                                    __m256i *lo, __m256i *hi) {
    const __m256i mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256i v = _mm256_loadu_si256((const __m256i *)q);
    __m256i l = _mm256_and_si256(v, mask);
    __m256i h = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    /* u8 x s8 pairs (at most 2 * 15 * 128: no saturation), then pairs of pairs: one int32
     * per 4 bytes */
    *lo = _mm256_madd_epi16(
        _mm256_maddubs_epi16(l, _mm256_loadu_si256((const __m256i *)x_lo)), ones);
    *hi = _mm256_madd_epi16(
        _mm256_maddubs_epi16(h, _mm256_loadu_si256((const __m256i *)x_hi)), ones);
}
#endif

/* Where the CPU has AVX2, FMA and F16C, the integer dot products and the per-block float
 * arithmetic run 8 lanes at a time (each lane's operations are the scalar code's, so the bits
 * are the same); else the portable scalar code. -1: not yet asked. */
static int avx2_on = -1;

/* Tests: 1 runs the portable scalar code even where AVX2 is present, 0 the default. */
void native_force_scalar(int scalar) { avx2_on = scalar ? 0 : -1; }

static int use_avx2(void) {
#ifdef HAVE_AVX2_PATH
    int on = avx2_on;
    if (on < 0) {
        __builtin_cpu_init();
        on = avx2_on = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                               __builtin_cpu_supports("f16c")
                           ? 1
                           : 0;
    }
    return on;
#else
    return 0;
#endif
}

/* The integer dot products of one Q6_K run (half n, quarter t): s0[w] = sum over bytes 4w ..
 * 4w + 3 of (v0 - 32) * x0, v0 = low nibble of ql | bits 2t of qh << 4; s1 likewise with the high
 * nibble, bits 2t + 4 and x1 (the kernel's two dp4a per word). */
static void q6_words_scalar(const uint8_t *ql, const uint8_t *qh, int t, const int8_t *x0,
                            const int8_t *x1, int32_t s0[8], int32_t s1[8]) {
    for (int w = 0; w < 8; w++) {
        int32_t a = 0, b = 0;
        for (int i = 4 * w; i < 4 * w + 4; i++) {
            int v0 = (ql[i] & 15) | (((qh[i] >> (2 * t)) & 3) << 4);
            int v1 = (ql[i] >> 4) | (((qh[i] >> (2 * t + 4)) & 3) << 4);
            a += (v0 - 32) * (int32_t)x0[i];
            b += (v1 - 32) * (int32_t)x1[i];
        }
        s0[w] = a;
        s1[w] = b;
    }
}

#ifdef HAVE_AVX2_PATH
/* q6_words_scalar's s0 and s1 as two vectors of 8 int32 (the same integers). */
__attribute__((target("avx2"))) static inline void q6_words_vec(const uint8_t *ql,
                                                                const uint8_t *qh, int t,
                                                                const int8_t *x0,
                                                                const int8_t *x1, __m256i *s0,
                                                                __m256i *s1) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    const __m256i ones16 = _mm256_set1_epi16(1), ones8 = _mm256_set1_epi8(1);
    __m256i l = _mm256_loadu_si256((const __m256i *)ql);
    __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    __m128i sh0 = _mm_cvtsi32_si128(2 * t), sh1 = _mm_cvtsi32_si128(2 * t + 4);
    /* 16-bit shifts, then byte masks: no bit crosses into the next byte's field */
    __m256i v0 = _mm256_or_si256(
        _mm256_and_si256(l, m4),
        _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, sh0), m2), 4));
    __m256i v1 = _mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi16(l, 4), m4),
        _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, sh1), m2), 4));
    __m256i a = _mm256_loadu_si256((const __m256i *)x0);
    __m256i b = _mm256_loadu_si256((const __m256i *)x1);
    /* v in 0..63: u8 x s8 pairs at most 2 * 63 * 128, no saturation; minus 32 * sum(x) */
    __m256i d0 = _mm256_madd_epi16(_mm256_maddubs_epi16(v0, a), ones16);
    __m256i d1 = _mm256_madd_epi16(_mm256_maddubs_epi16(v1, b), ones16);
    __m256i x0s = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, a), ones16);
    __m256i x1s = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, b), ones16);
    *s0 = _mm256_sub_epi32(d0, _mm256_slli_epi32(x0s, 5));
    *s1 = _mm256_sub_epi32(d1, _mm256_slli_epi32(x1s, 5));
}
#endif

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

/* One Q4_K block's header: d, dmin and the 8 sub-block scales and mins as floats. */
typedef struct {
    float d, dmin, sc[8], mn[8];
} q4k_head;

#ifdef HAVE_AVX2_PATH
/* scale_min of all 8 sub-blocks at once: the 6-bit fields gathered by 32-bit word masks
 * (bytes 0-7 the scales, 8-15 the mins, as scale_min takes them apart), then widened to
 * floats (exact: small integers). */
__attribute__((target("avx2"))) static void scales_mins_avx2(const uint8_t *q, float sc[8],
                                                             float mn[8]) {
    uint32_t w[4], out[4];
    memcpy(w, q, 12);
    const uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    out[0] = w[0] & m6;                                     /* sc 0-3: q[s] & 63 */
    out[1] = (w[2] & m4) | (((w[0] >> 6) & m2) << 4);       /* sc 4-7 */
    out[2] = w[1] & m6;                                     /* mn 0-3: q[s + 4] & 63 */
    out[3] = ((w[2] >> 4) & m4) | (((w[1] >> 6) & m2) << 4); /* mn 4-7 */
    __m128i b = _mm_loadu_si128((const __m128i *)out);
    _mm256_storeu_ps(sc, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
    _mm256_storeu_ps(mn, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))));
}

/* f16_to_f32 of two halves at once by the F16C instruction (exact, subnormals included). */
__attribute__((target("f16c"))) static void f16_pair_f16c(const uint8_t *p, float *a,
                                                          float *b) {
    uint32_t w;
    memcpy(&w, p, 4);
    __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)w));
    *a = _mm_cvtss_f32(f);
    *b = _mm_cvtss_f32(_mm_shuffle_ps(f, f, 1));
}
#endif

static void q4_k_head(const uint8_t *blk, q4k_head *hd) {
#ifdef HAVE_AVX2_PATH
    if (use_avx2()) {
        f16_pair_f16c(blk, &hd->d, &hd->dmin);
        scales_mins_avx2(blk + 4, hd->sc, hd->mn);
        return;
    }
#endif
    hd->d = f16_to_f32((uint16_t)(blk[0] | (blk[1] << 8)));
    hd->dmin = f16_to_f32((uint16_t)(blk[2] | (blk[3] << 8)));
    for (int s = 0; s < 8; s++) {
        scale_min(blk + 4, s, &hd->sc[s], &hd->mn[s]);
    }
}

#ifdef HAVE_AVX2_PATH
/* parts_q4_k's 8 lanes at once: s0 and s1 by horizontal integer adds (exact in any order), then
 * lane p's float operations as the scalar code writes them, with c = p / 2's scales and
 * activation scales moved into lane p. */
__attribute__((target("avx2,fma"))) static void parts_q4_k_avx2(const uint8_t *blk,
                                                                const q4k_head *hd,
                                                                const int8_t *x,
                                                                const float *xdb,
                                                                const float *xsb, float out[8]) {
    __m256i pl[4], ph[4];
    for (int c = 0; c < 4; c++) {
        nibble_words_vec(blk + 16 + 32 * c, x + 64 * c, x + 64 * c + 32, &pl[c], &ph[c]);
    }
    /* hadd, hadd: [r0 w0-3, r1 w0-3, r2 w0-3, r3 w0-3 | r0 w4-7, ...]; then lane 2c + half */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i s0 = _mm256_permutevar8x32_epi32(
        _mm256_hadd_epi32(_mm256_hadd_epi32(pl[0], pl[1]), _mm256_hadd_epi32(pl[2], pl[3])),
        order);
    __m256i s1 = _mm256_permutevar8x32_epi32(
        _mm256_hadd_epi32(_mm256_hadd_epi32(ph[0], ph[1]), _mm256_hadd_epi32(ph[2], ph[3])),
        order);
    const __m256i even = _mm256_setr_epi32(0, 0, 2, 2, 4, 4, 6, 6);
    const __m256i odd = _mm256_setr_epi32(1, 1, 3, 3, 5, 5, 7, 7);
    __m256 sc = _mm256_loadu_ps(hd->sc), mn = _mm256_loadu_ps(hd->mn);
    __m256 xd8 = _mm256_loadu_ps(xdb), xs8 = _mm256_loadu_ps(xsb);
    __m256 d = _mm256_set1_ps(hd->d);
    __m256 a1 = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_permutevar8x32_ps(sc, odd)),
                              _mm256_permutevar8x32_ps(xd8, odd));
    __m256 a0 = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_permutevar8x32_ps(sc, even)),
                              _mm256_permutevar8x32_ps(xd8, even));
    __m256 part = _mm256_mul_ps(a1, _mm256_cvtepi32_ps(s1));
    part = _mm256_fmadd_ps(a0, _mm256_cvtepi32_ps(s0), part);
    __m256 m = _mm256_fmadd_ps(
        _mm256_permutevar8x32_ps(mn, even), _mm256_permutevar8x32_ps(xs8, even),
        _mm256_mul_ps(_mm256_permutevar8x32_ps(mn, odd), _mm256_permutevar8x32_ps(xs8, odd)));
    float nd = -hd->dmin;
    __m256 dm = _mm256_setr_ps(nd, 0.0f, nd, 0.0f, nd, 0.0f, nd, 0.0f);
    _mm256_storeu_ps(out, _mm256_fmadd_ps(dm, m, part));
}
#endif

/* The 8 partials of group sb of one Q4_K row (slot 2c + h: run c, half h), as
 * mmvq_once._once_q4_k computes them (all zero where sb >= groups). The lanes are independent
 * elementwise chains: a compiler may run them side by side without changing a bit. */
static void parts_q4_k(const uint8_t *row, int sb, int groups, const int8_t *xq,
                       const float *xd, const float *xs, float out[8]) {
    if (sb >= groups) {
        for (int p = 0; p < 8; p++) {
            out[p] = 0.0f; /* every load masked: the fmas give +0 */
        }
        return;
    }
    const uint8_t *blk = row + (size_t)sb * 144;
    q4k_head hd;
    q4_k_head(blk, &hd);
#ifdef HAVE_AVX2_PATH
    if (use_avx2()) {
        parts_q4_k_avx2(blk, &hd, xq + (size_t)sb * 256, xd + sb * 8, xs + sb * 8, out);
        return;
    }
#endif
    const uint8_t *qs = blk + 16;
    const int8_t *x = xq + (size_t)sb * 256;
    int32_t s0[8], s1[8];
    for (int c = 0; c < 4; c++) { /* run c: words 0-3 are half 0, 4-7 half 1 */
        int32_t lo[8], hi[8];
        nibble_words_scalar(qs + 32 * c, x + 64 * c, x + 64 * c + 32, lo, hi);
        s0[2 * c] = (lo[0] + lo[1]) + (lo[2] + lo[3]);
        s0[2 * c + 1] = (lo[4] + lo[5]) + (lo[6] + lo[7]);
        s1[2 * c] = (hi[0] + hi[1]) + (hi[2] + hi[3]);
        s1[2 * c + 1] = (hi[4] + hi[5]) + (hi[6] + hi[7]);
    }
    const float *xdb = xd + sb * 8, *xsb = xs + sb * 8;
    for (int p = 0; p < 8; p++) {
        int c = p / 2;
        float part = ((hd.d * hd.sc[2 * c + 1]) * xdb[2 * c + 1]) * (float)s1[p];
        part = fmaf((hd.d * hd.sc[2 * c]) * xdb[2 * c], (float)s0[p], part);
        float m = fmaf(hd.mn[2 * c], xsb[2 * c], hd.mn[2 * c + 1] * xsb[2 * c + 1]);
        out[p] = fmaf(p % 2 == 0 ? -hd.dmin : 0.0f, m, part);
    }
}

#ifdef HAVE_AVX2_PATH
/* The first three levels of tree_sum over n values (n a multiple of 32), in registers: v[j] =
 * the tree sum of v[8j .. 8j + 7], for j < n / 8. Four runs of 8 at a time: hadd pairs
 * neighbours within each 128-bit half (level 1), hadd again pairs those (level 2: each half now
 * holds four runs' sums of 4), and the two halves added give level 3 in run order. */
__attribute__((target("avx2"))) static void tree_runs_avx2(float *v, int n) {
    for (int j = 0; j < n / 8; j += 4) {
        const float *r = v + 8 * j;
        __m256 a = _mm256_hadd_ps(_mm256_loadu_ps(r), _mm256_loadu_ps(r + 8));
        __m256 b = _mm256_hadd_ps(_mm256_loadu_ps(r + 16), _mm256_loadu_ps(r + 24));
        __m256 q = _mm256_hadd_ps(a, b); /* [lo4 of runs 0-3 | hi4 of runs 0-3] */
        _mm_storeu_ps(v + j, _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
    }
}

/* The tree sum of m = 8 or 16 values: the same levels as tree_runs_avx2 over one or two runs
 * (a second hadd of a vector with itself pairs the first's sums), then the two runs' sums. */
__attribute__((target("avx2"))) static float tree_tail_avx2(const float *v, int m) {
    __m256 a = _mm256_loadu_ps(v);
    __m256 q = _mm256_hadd_ps(a, m == 16 ? _mm256_loadu_ps(v + 8) : a);
    q = _mm256_hadd_ps(q, q); /* [a0-3, b0-3, a0-3, b0-3 | a4-7, b4-7, a4-7, b4-7] */
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1));
    return m == 8 ? _mm_cvtss_f32(r) : _mm_cvtss_f32(_mm_add_ss(r, _mm_shuffle_ps(r, r, 1)));
}
#endif

/* mmvq.tree_sum over n (a power of two) values, in place. */
static float tree_sum(float *v, int n) {
#ifdef HAVE_AVX2_PATH
    if (use_avx2() && n % 32 == 0) {
        tree_runs_avx2(v, n);
        for (n /= 8; n > 16; n >>= 1) {
            for (int i = 0; i < n / 2; i++) {
                v[i] = v[2 * i] + v[2 * i + 1];
            }
        }
        if (n >= 8) {
            return tree_tail_avx2(v, n);
        }
    }
#endif
    for (; n > 1; n >>= 1) {
        for (int i = 0; i < n / 2; i++) {
            v[i] = v[2 * i] + v[2 * i + 1];
        }
    }
    return v[0];
}

#ifdef HAVE_AVX2_PATH
__attribute__((target("avx2"))) static void add8_avx2(float *acc, const float *step) {
    _mm256_storeu_ps(acc, _mm256_add_ps(_mm256_loadu_ps(acc), _mm256_loadu_ps(step)));
}
#endif

/* acc[p] += step[p] for 8 slots (lane by lane: the same adds either way). */
static void add8(float *acc, const float *step) {
#ifdef HAVE_AVX2_PATH
    if (use_avx2()) {
        add8_avx2(acc, step);
        return;
    }
#endif
    for (int p = 0; p < 8; p++) {
        acc[p] = acc[p] + step[p];
    }
}

/* One row's sum: per K step of G groups, group j's 8 partials added to slots 8j .. 8j + 7
 * (slot 2r + h with r = 4j + c), from 0.0; then the tree over the 8G slots. */
static float row_q4_k(const uint8_t *row, int groups, int G, const int8_t *xq, const float *xd,
                      const float *xs) {
    float parts[8 * 32], step[8];
    for (int i = 0; i < 8 * G; i++) {
        parts[i] = 0.0f;
    }
    for (int i = 0; i < groups; i += G) {
        for (int j = 0; j < G; j++) {
            parts_q4_k(row, i + j, groups, xq, xd, xs, step);
            add8(parts + 8 * j, step);
        }
    }
    return tree_sum(parts, 8 * G);
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


#ifdef HAVE_AVX2_PATH
/* tile_q4_k's 8 words of a run at once (lane w: the scalar code's operations for word w). */
__attribute__((target("avx2,fma"))) static void tile_q4_k_avx2(const uint8_t *blk,
                                                               const q4k_head *hd, float d,
                                                               float dmin, const int8_t *x,
                                                               const float *xdb,
                                                               const float *xsb, float out[32]) {
    const __m256 dm = _mm256_setr_ps(-dmin, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f);
    for (int c = 0; c < 4; c++) {
        __m256i f0, f1;
        nibble_words_vec(blk + 16 + 32 * c, x + 64 * c, x + 64 * c + 32, &f0, &f1);
        float a0 = (d * hd->sc[2 * c]) * xdb[2 * c];
        float a1 = (d * hd->sc[2 * c + 1]) * xdb[2 * c + 1];
        float m = fmaf(hd->mn[2 * c], xsb[2 * c], hd->mn[2 * c + 1] * xsb[2 * c + 1]);
        __m256 acc = _mm256_fmadd_ps(_mm256_set1_ps(a0), _mm256_cvtepi32_ps(f0),
                                     _mm256_setzero_ps());
        acc = _mm256_fmadd_ps(_mm256_set1_ps(a1), _mm256_cvtepi32_ps(f1), acc);
        _mm256_storeu_ps(out + 8 * c, _mm256_fmadd_ps(dm, _mm256_set1_ps(m), acc));
    }
}

/* tile_q6_k's 8 lanes of a run at once (lane L: word 3L mod 8, the scalar code's operations). */
__attribute__((target("avx2,fma"))) static void tile_q6_k_avx2(const uint8_t *blk, float d,
                                                               const int8_t *x, const float *xd,
                                                               int sb, float out[32]) {
    const __m256i perm = _mm256_setr_epi32(0, 3, 6, 1, 4, 7, 2, 5);
    for (int c = 0; c < 4; c++) {
        int n = c / 2, t = c % 2;
        const uint8_t *ql = blk + 64 * n + 32 * t, *qh = blk + 128 + 32 * n;
        const int8_t *x0 = x + 128 * n + 32 * t;
        __m256i s0, s1;
        q6_words_vec(ql, qh, t, x0, x0 + 64, &s0, &s1);
        const uint8_t *sc = blk + 192 + 8 * n + 2 * t; /* lane L: sc[w / 4], sc[w / 4 + 4] */
        int lo = (int8_t)sc[0], hi = (int8_t)sc[1], lo4 = (int8_t)sc[4], hi4 = (int8_t)sc[5];
        __m256i sc0 = _mm256_setr_epi32(lo, lo, hi, lo, hi, hi, lo, hi);
        __m256i sc1 = _mm256_setr_epi32(lo4, lo4, hi4, lo4, hi4, hi4, lo4, hi4);
        __m256i p0 = _mm256_mullo_epi32(sc0, _mm256_permutevar8x32_epi32(s0, perm));
        __m256i p1 = _mm256_mullo_epi32(sc1, _mm256_permutevar8x32_epi32(s1, perm));
        int b0 = sb * 8 + 4 * n + t;
        float a0 = d * xd[b0], a1 = d * xd[b0 + 2];
        __m256 acc = _mm256_fmadd_ps(_mm256_set1_ps(a0), _mm256_cvtepi32_ps(p0),
                                     _mm256_setzero_ps());
        _mm256_storeu_ps(out + 8 * c,
                         _mm256_fmadd_ps(_mm256_set1_ps(a1), _mm256_cvtepi32_ps(p1), acc));
    }
}
#endif

/* The 32 tile elements of group sb of one Q4_K down row (slot 8c + w: run c, word w), as
 * mmvq._acc_q4_k accumulates them from 0.0 with the block scales times wt. */
static void tile_q4_k(const uint8_t *row, int sb, const int8_t *xq, const float *xd,
                      const float *xs, float wt, float out[32]) {
    const uint8_t *blk = row + (size_t)sb * 144;
    q4k_head hd;
    q4_k_head(blk, &hd);
    float d = hd.d * wt, dmin = hd.dmin * wt;
    const int8_t *x = xq + (size_t)sb * 256;
    const float *xdb = xd + sb * 8, *xsb = xs + sb * 8;
#ifdef HAVE_AVX2_PATH
    if (use_avx2()) {
        tile_q4_k_avx2(blk, &hd, d, dmin, x, xdb, xsb, out);
        return;
    }
#endif
    for (int c = 0; c < 4; c++) {
        int32_t f0[8], f1[8];
        nibble_words_scalar(blk + 16 + 32 * c, x + 64 * c, x + 64 * c + 32, f0, f1);
        float a0 = (d * hd.sc[2 * c]) * xdb[2 * c];
        float a1 = (d * hd.sc[2 * c + 1]) * xdb[2 * c + 1];
        float m = fmaf(hd.mn[2 * c], xsb[2 * c], hd.mn[2 * c + 1] * xsb[2 * c + 1]);
        for (int w = 0; w < 8; w++) {
            float acc = fmaf(a0, (float)f0[w], 0.0f);
            acc = fmaf(a1, (float)f1[w], acc);
            out[8 * c + w] = fmaf(w == 0 ? -dmin : 0.0f, m, acc);
        }
    }
}

/* The 32 tile elements of group sb of one Q6_K down row (file blocks of 210 bytes; slot 8c + L:
 * run c = 2n + t, lane L holding word 3L mod 8, the order the kernel reads file blocks in), as
 * mmvq._acc_q6_k accumulates them from 0.0. */
static void tile_q6_k(const uint8_t *row, int sb, const int8_t *xq, const float *xd, float wt,
                      float out[32]) {
    const uint8_t *blk = row + (size_t)sb * 210;
    float d = f16_to_f32((uint16_t)(blk[208] | (blk[209] << 8))) * wt;
    const int8_t *x = xq + (size_t)sb * 256;
#ifdef HAVE_AVX2_PATH
    if (use_avx2()) {
        tile_q6_k_avx2(blk, d, x, xd, sb, out);
        return;
    }
#endif
    for (int c = 0; c < 4; c++) {
        int n = c / 2, t = c % 2;
        const uint8_t *ql = blk + 64 * n + 32 * t, *qh = blk + 128 + 32 * n;
        const int8_t *x0 = x + 128 * n + 32 * t;
        int32_t s0[8], s1[8];
        q6_words_scalar(ql, qh, t, x0, x0 + 64, s0, s1);
        int b0 = sb * 8 + 4 * n + t;
        float a0 = d * xd[b0], a1 = d * xd[b0 + 2];
        for (int lane = 0; lane < 8; lane++) {
            int w = (3 * lane) % 8;
            int sc0 = (int8_t)blk[192 + 8 * n + 2 * t + w / 4];
            int sc1 = (int8_t)blk[192 + 8 * n + 2 * t + w / 4 + 4];
            float acc = fmaf(a0, (float)(sc0 * s0[w]), 0.0f);
            out[8 * c + lane] = fmaf(a1, (float)(sc1 * s1[w]), acc);
        }
    }
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
    float tile[32 * 32];
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * row_bytes;
        for (int sb = 0; sb < G; sb++) { /* group sb's runs are tile rows 4sb .. 4sb + 3 */
            if (sb >= groups) {
                memset(tile + 32 * sb, 0, 32 * sizeof(float)); /* masked: +0 */
            } else if (q6) {
                tile_q6_k(row, sb, hq, hd, wt, tile + 32 * sb);
            } else {
                tile_q4_k(row, sb, hq, hd, hs, wt, tile + 32 * sb);
            }
        }
        y[n] = tree_sum(tile, 32 * G);
    }
    return 0;
}

/* A layer's host experts for a batch of assignments, spread over `threads` threads (OpenMP
 * where the build has it): assignment i is token tok[i]'s expert whose weights are at gate[i],
 * up[i], down[i] (down Q6_K where q6[i], its rows down_row_bytes[i] apart), routing weight
 * wt[i]. Phase 1 computes every
 * assignment's q8 h in blocks of 32 rows (hq [n][F], hd and hs [n][F / 32] scratch), phase 2
 * its weighted down sums in blocks of 64 rows into rows [n][H]: each value as gate_up_q4_k and
 * down_rows give it, whatever the threads. x: the tokens' q8 rows xq [T][H], xd and xs
 * [T][H / 32]. Returns 0, or -1 for arguments the row functions cannot take. */
int moe_host_rows(int n, const uint64_t *gate, const uint64_t *up, const uint64_t *down,
                  const int32_t *q6, const int32_t *tok, const float *wt, int64_t gu_row_bytes,
                  const int64_t *down_row_bytes, int h, int f, int up_g, int down_g,
                  const int8_t *xq, const float *xd, const float *xs, int8_t *hq, float *hd,
                  float *hs, float *rows, int threads) {
    int up_blocks = f / 32, down_blocks = (h + 63) / 64, bad = 0;
    if (f % 256 || h % 256 || n < 0) {
        return -1;
    }
    (void)threads;
    /* one team for both phases (a fork and a join a call, the phases apart by the barrier at
     * the end of the first loop) */
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(| : bad)
#endif
    {
#ifdef _OPENMP
#pragma omp for schedule(dynamic)
#endif
        for (int task = 0; task < n * up_blocks; task++) {
            int i = task / up_blocks, b = task % up_blocks;
            const int8_t *x = xq + (size_t)tok[i] * h;
            const float *d = xd + (size_t)tok[i] * (h / 32);
            const float *s = xs + (size_t)tok[i] * (h / 32);
            bad |= gate_up_q4_k((const uint8_t *)(uintptr_t)gate[i],
                                (const uint8_t *)(uintptr_t)up[i], gu_row_bytes, h, 32 * b,
                                32 * b + 32, up_g, x, d, s, hq + (size_t)i * f,
                                hd + (size_t)i * (f / 32), hs + (size_t)i * (f / 32), NULL) != 0;
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic)
#endif
        for (int task = 0; task < n * down_blocks; task++) {
            int i = task / down_blocks, b = task % down_blocks;
            int n1 = 64 * b + 64 < h ? 64 * b + 64 : h;
            bad |= down_rows((const uint8_t *)(uintptr_t)down[i], down_row_bytes[i], q6[i], f,
                             64 * b, n1, down_g, hq + (size_t)i * f, hd + (size_t)i * (f / 32),
                             hs + (size_t)i * (f / 32), wt[i], rows + (size_t)i * h) != 0;
        }
    }
    return bad ? -1 : 0;
}

/* One MoE layer's host work for one launch, as a CUDA host function (`cuLaunchHostFunc`: the
 * stream runs it between the copies that bring the routing in and take the rows out, so a CUDA
 * graph can hold it) or called directly (CPU tests). The layer's tables say which experts the
 * host computes (marked[e]) and where their bytes are; the launch's buffers hold the routing of
 * t tokens of k experts (ids int64, weights float32), their q8 activations and the rows
 * [t * k][h] to fill: row a for each assignment a whose expert is marked (the others are left
 * as they are). Counters: calls, assignments computed, nanoseconds; status -1 if a call failed
 * (out of memory, or shapes moe_host_rows refuses; its rows are then not valid). */
typedef struct {
    const int8_t *marked;       /* [E] nonzero: computed here */
    const uint64_t *gate, *up, *down; /* [E] host addresses of each expert's rows */
    int64_t gu_row_bytes, down_row_bytes;
    int32_t q6, h, f, up_g, down_g, threads;
    int32_t t, k;
    const int64_t *ids;
    const float *weights;
    const int8_t *xq;
    const float *xd, *xs;
    float *rows;
    int64_t calls, assignments, nanoseconds;
    int32_t status;
} host_layer_args;

void host_layer(void *arg) {
    host_layer_args *p = (host_layer_args *)arg;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int a_all = p->t * p->k, n = 0, rc = 0;
    int *sel = malloc(sizeof(int) * (size_t)(a_all ? a_all : 1));
    if (sel == NULL) {
        p->status = -1;
        return;
    }
    for (int a = 0; a < a_all; a++) {
        if (p->marked[p->ids[a]]) {
            sel[n++] = a;
        }
    }
    if (n) {
        size_t fb = (size_t)p->f, hb = (size_t)p->h, nn = (size_t)n;
        /* one scratch block a call, carved by decreasing alignment: 8-byte words (3 addresses
         * and the down row bytes each), 4-byte floats and ints, then bytes */
        size_t words = 4 * nn, floats = nn + 2 * (fb / 32) * nn + hb * nn, ints = 2 * nn;
        char *scratch = malloc(8 * words + 4 * floats + 4 * ints + fb * nn);
        if (scratch == NULL) {
            rc = -1;
        } else {
            uint64_t *ptr = (uint64_t *)scratch; /* gate, up, down addresses */
            int64_t *drb = (int64_t *)(ptr + 3 * nn);
            float *wt = (float *)(drb + nn), *hd = wt + nn, *hs = hd + (fb / 32) * nn;
            float *out = hs + (fb / 32) * nn;
            int32_t *q6 = (int32_t *)(out + hb * nn), *tok = q6 + nn;
            int8_t *hq = (int8_t *)(tok + nn);
            for (int i = 0; i < n; i++) {
                int a = sel[i];
                int64_t e = p->ids[a];
                ptr[i] = p->gate[e];
                ptr[n + i] = p->up[e];
                ptr[2 * n + i] = p->down[e];
                q6[i] = p->q6;
                tok[i] = a / p->k;
                drb[i] = p->down_row_bytes;
                wt[i] = p->weights[a];
            }
            rc = moe_host_rows(n, ptr, ptr + n, ptr + 2 * n, q6, tok, wt, p->gu_row_bytes, drb,
                               p->h, p->f, p->up_g, p->down_g, p->xq, p->xd, p->xs, hq, hd, hs,
                               out, p->threads);
            for (int i = 0; i < n && rc == 0; i++) {
                memcpy(p->rows + (size_t)sel[i] * hb, out + (size_t)i * hb, sizeof(float) * hb);
            }
        }
        free(scratch);
    }
    free(sel);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    p->calls += 1;
    p->assignments += n;
    p->nanoseconds += (int64_t)(t1.tv_sec - t0.tv_sec) * 1000000000 + (t1.tv_nsec - t0.tv_nsec);
    if (rc != 0) {
        p->status = -1;
    }
}

/* ---- a host thread that waits for the GPU instead of a CUDA host function -----------------
 * The GPU posts a layer's host work by one 8-byte store into mapped pinned memory, go = seq << 16
 * | job (the job: an index into `table`), after its routing and activations have been copied
 * there; this thread, spinning on go, runs host_layer(table[job]) and then stores done = seq,
 * for which a one-thread kernel on the GPU waits before the rows are copied back
 * (`experts.host_compute`, poll mode). It spins for spin_ns after each job (a decode step's
 * layers are ~0.3-0.5 ms apart), then polls every sleep_ns, and every millisecond once idle
 * for a second. flags: [go, done, errors, timeouts] (the last the wait kernel's). */
typedef struct {
    int64_t *flags;                /* pinned [4]: go, done, errors (jobs naming no table entry) */
    host_layer_args **table;       /* [n] */
    int64_t n;
    int64_t spin_ns, sleep_ns;
    int64_t jobs;                  /* jobs run */
    _Atomic int stop;
    pthread_t tid;
} host_poller;

static int64_t poll_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void *poller_main(void *arg) {
    host_poller *p = (host_poller *)arg;
    /* done, not go: a job posted before this thread first looks is still to run */
    int64_t last = __atomic_load_n(&p->flags[1], __ATOMIC_ACQUIRE);
    int64_t idle_since = poll_now_ns();
    struct timespec nap = {0, (long)p->sleep_ns}, long_nap = {0, 1000000};
    while (!atomic_load(&p->stop)) {
        int64_t go = __atomic_load_n(&p->flags[0], __ATOMIC_ACQUIRE);
        if (go >> 16 != last) {
            int64_t job = go & 0xFFFF;
            if (job < p->n && p->table[job] != NULL) {
                host_layer(p->table[job]);
            } else {
                __atomic_fetch_add(&p->flags[2], 1, __ATOMIC_RELAXED);
            }
            last = go >> 16;
            p->jobs += 1;
            __atomic_store_n(&p->flags[1], last, __ATOMIC_RELEASE);
            idle_since = poll_now_ns();
        } else if (poll_now_ns() - idle_since < p->spin_ns) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        } else {  /* idle for a second or more (a server between requests): 1 ms naps */
            nanosleep(poll_now_ns() - idle_since < 1000000000 ? &nap : &long_nap, NULL);
        }
    }
    return NULL;
}

/* Start the thread on a zeroed poller whose flags, table and n are set; 0 or an errno. */
int host_poller_start(host_poller *p) {
    atomic_store(&p->stop, 0);
    return pthread_create(&p->tid, NULL, poller_main, p);
}

/* Stop and join it (jobs posted after this are not run). */
void host_poller_stop(host_poller *p) {
    atomic_store(&p->stop, 1);
    pthread_join(p->tid, NULL);
}

size_t host_poller_size(void) { return sizeof(host_poller); }

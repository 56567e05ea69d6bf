/* y = x~ @ dequant(w).T with the activations quantized per block of 32, as llama.cpp's Q8_0
 * dot products do (W8A8, W4A8): AVX2 integer dot products, fp32 sums.
 *
 * Each row of x (bf16 [M, K]) is quantized on its own, block by block of 32 inputs:
 *   d = amax / 127 (fp32), q = nearest-even(x * (1 / d)), x~ = q * d;
 * hal.quant.quantize_activations computes the same x~ (the conformance kit's reference).
 * w is hal/quant.py's layout: int8 [N, K] with bf16 scale [N] (int8) or [N, K / group]
 * (int8g); int4 comes repacked eight rows at a time (see rlt_linear_int4_a8_avx2 below).
 *
 * int8 and int8g, y[m, n]: for each block b in order, the block's integer dot product (exact,
 * int32 lanes: int8 with the sign trick and vpmaddubsw / vpmaddwd) converted to fp32 and added
 * with one FMA times its scale (int8: d[m, b]; int8g: d[m, b] * scale[n, group of b]) into an
 * 8-lane accumulator; then a fixed horizontal sum, an int8 K tail (scalar), the int8 channel
 * scale, bf16 rounding. The same sequence for every (m, n) wherever the row falls: row- and
 * column-invariant by construction. Decode is bound by the integer dot products, which take
 * about half the instructions of widening each weight to fp32 (linear_quant_avx2.c), and by
 * how the weights stream in: each thread reads its rows in order (see linear_a8).
 *
 * Per token (linear_token: vllm-ascend's W8A8 dynamic, npu_dynamic_quant then
 * npu_quant_matmul; hal.quant.token_linear is the reference): each row of x quantized with one
 * scale as CANN's DynamicQuant does, inv = 127 / amax, q = nearest-even(x * inv), d = 1 / inv
 * in fp32; the integer dot products summed in
 * int32 lanes over the whole row (exact, so in any order), then y = bf16((float(acc) *
 * scale[n]) * d[m]).
 */
#include "bf16.h"
#include "rlt_cpu.h"
#include <math.h>

/* The exported names: built as it is, rlt_*_avx2; included by linear_a8_vnni.c, rlt_*_vnni,
 * whose integer dot products are vpdpbusd (AVX512-VNNI on 256-bit registers) where this file
 * has vpmaddubsw then vpmaddwd: the same int32 lanes, so the same bits. */
#ifdef RLT_A8_VNNI
#define A8(name) name##_vnni
#else
#define A8(name) name##_avx2
#endif

#define QB 32        /* inputs per activation block */
#define MB 4        /* input rows per register block */
#define PREFETCH 512 /* bytes ahead of a weight row's read position */

#define INLINE static inline __attribute__((always_inline))

/* One row quantized: xq [blocks * 32] (a partial last block zero-padded), d [blocks]; sums
 * (if not NULL) [blocks]: each block's sum of xq. Full blocks eight lanes at a time, a partial
 * one in scalar code: the same values (the maximum is exact in any order, each product and
 * its rounding to the nearest even integer are elementwise, the sums are exact integers). */
static void quantize_row(const uint16_t *x, int K, int8_t *xq, float *d, int32_t *sums) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int b = 0, k0 = 0;
    for (; k0 + QB <= K; b++, k0 += QB) {
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = load_bf16x8(x + k0 + 8 * i);
            m = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), m); /* a NaN lane keeps m */
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
        float db = amax / 127.0f;
        float id = db != 0.0f ? 1.0f / db : 0.0f;
        d[b] = db;
        __m256 iv = _mm256_set1_ps(id);
        __m256i q[4], t = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q[i] = _mm256_cvtps_epi32(r);
            t = _mm256_add_epi32(t, q[i]);
        }
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + k0), _mm256_permutevar8x32_epi32(p, order));
        if (sums) {
            __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4e));
            sums[b] = _mm_cvtsi128_si32(_mm_add_epi32(u, _mm_shuffle_epi32(u, 0xb1)));
        }
    }
    if (k0 < K) {
        int n = K - k0;
        float amax = 0.0f;
        for (int k = 0; k < n; k++) {
            float v = fabsf(bf16_to_f32(x[k0 + k]));
            amax = v > amax ? v : amax;
        }
        float db = amax / 127.0f;
        float id = db != 0.0f ? 1.0f / db : 0.0f;
        int32_t t = 0;
        d[b] = db;
        for (int k = 0; k < QB; k++) {
            xq[k0 + k] = k < n ? (int8_t)nearbyintf(bf16_to_f32(x[k0 + k]) * id) : 0;
            t += xq[k0 + k];
        }
        if (sums) sums[b] = t;
    }
}

/* Eight int32 lanes, each the sum of four of the 32 products a * b, with a = |sgn| and b
 * carrying sgn's sign: vpmaddubsw takes |sgn| as its unsigned operand. With sgn = wq (a =
 * |wq|, b = xq) an int8 weight may be -128 (|-128| is 128 unsigned; compressed-tensors' int8
 * range has it) while xq, in [-127, 127], takes the sign; with sgn = xq (a = |xq|, computed
 * once for every weight row) -128 would turn into itself. Pair sums stay below 2^15 either
 * way. */
INLINE __m256i dot32(__m256i a, __m256i b, __m256i sgn) {
#ifdef RLT_A8_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, _mm256_sign_epi8(b, sgn));
#else
    __m256i p = _mm256_maddubs_epi16(a, _mm256_sign_epi8(b, sgn));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}

/* Block b of input row j (at offset o of xq, xa) against the weight block wv (aw = |wv| when
 * full): dot32's eight int32 lanes, with the weight's sign trick or the input's. */
INLINE __m256i block8(const int8_t *xq, const int8_t *xa, size_t o, __m256i wv, __m256i aw,
                      int full) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + o));
    if (full) return dot32(aw, xv, wv);
    return dot32(_mm256_loadu_si256((const __m256i *)(xa + o)), wv, xv);
}

/* R weight rows far apart at once (R > 1: the VNNI build, whose 32 vector registers hold
 * their accumulators): R streams a thread, block b of each in turn, each row's arithmetic the
 * same as alone (row8: R = 1): the same bits. Decode (one register block of input rows) reads
 * STREAMS rows at once: over 24 layers of ouro-1.4b-shape (4.93 GB a token, not
 * cache-resident, 2 threads) 244-266 ms a token against 317-320 ms with two (AVX-512 Xeon);
 * more input rows keep two (6 streams' 24 accumulators: 25-26 ms against 23 ms for 64 rows of
 * an 11264 x 2048 projection). */
#define STREAMS 6
INLINE void row8_multi(const int8_t *xq, const int8_t *xa, const float *d, int ldq, int mb,
                       const int8_t *const *ws, const uint16_t *const *scales,
                       uint16_t *const *ys, int K, int group, int ldy, int full, int R) {
    int nblk = K / QB, ldd = ldq / QB;
    const uint16_t *next[STREAMS];
    __m256 acc[STREAMS][MB];
    int per = group / QB, left[STREAMS];
    float sg[STREAMS];
    for (int r = 0; r < R; r++) {
        next[r] = scales[r];
        left[r] = 0;
        sg[r] = 1.0f;
        for (int j = 0; j < MB; j++) acc[r][j] = _mm256_setzero_ps();
    }
    for (int b = 0; b < nblk; b++) {
        for (int r = 0; r < R; r++) {
            const int8_t *w = ws[r];
            if (b % 2 == 0) _mm_prefetch((const char *)(w + b * QB) + PREFETCH, _MM_HINT_T0);
            if (per && left[r]-- == 0) {
                sg[r] = bf16_to_f32(*next[r]++);
                left[r] = per - 1;
            }
            __m256i wv = _mm256_loadu_si256((const __m256i *)(w + b * QB));
            __m256i aw = full ? _mm256_abs_epi8(wv) : wv;
            for (int j = 0; j < mb; j++) {
                __m256i lanes = block8(xq, xa, (size_t)j * ldq + b * QB, wv, aw, full);
                __m256 sum = _mm256_cvtepi32_ps(lanes);
                acc[r][j] = _mm256_fmadd_ps(sum, _mm256_set1_ps(d[(size_t)j * ldd + b] * sg[r]),
                                            acc[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < mb; j++) {
            float t = hsum(acc[r][j]);
            const int8_t *xj = xq + (size_t)j * ldq;
            int tail = 0;
            for (int k = nblk * QB; k < K; k++) tail += xj[k] * ws[r][k];
            if (nblk * QB < K) t += (float)tail * d[(size_t)j * ldd + nblk]; /* int8 only */
            ys[r][(size_t)j * ldy] = f32_to_bf16(group ? t : t * bf16_to_f32(scales[r][0]));
        }
}
/* int8: one weight row against mb quantized input rows (xq, their absolute values xa, their
 * block scales d: ldq inputs and ldq / QB scales a row). full: the weight may hold -128
 * (then |w| takes vpmaddubsw's unsigned side, one more instruction a block: 1.04-1.10x the
 * time of one row here; xa is not read). */
INLINE void row8(const int8_t *xq, const int8_t *xa, const float *d, int ldq, int mb,
                 const int8_t *w, const uint16_t *scale, int K, int group, uint16_t *y, int ldy,
                 int full) {
    const int8_t *ws[1] = {w};
    const uint16_t *ss[1] = {scale};
    uint16_t *ys[1] = {y};
    row8_multi(xq, xa, d, ldq, mb, ws, ss, ys, K, group, ldy, full, 1);
}


/* int8 (group 0: one scale a row) or int8g. */
static int linear_a8(const uint16_t *x, const int8_t *w, const uint16_t *scale, uint16_t *y, int M,
                     int N, int K, int group, int full) {
    int blocks = (K + QB - 1) / QB, ldq = blocks * QB;
    /* Scratch: xq, then |xq|, and the scales d. */
    int8_t *xq = malloc((size_t)M * ldq * 2);
    float *d = malloc((size_t)M * blocks * sizeof(float));
    if (!xq || !d) {
        free(xq);
        free(d);
        return -1;
    }
    int8_t *xa = xq + (size_t)M * ldq;
    for (int m = 0; m < M; m++) {
        int8_t *q = xq + (size_t)m * ldq;
        quantize_row(x + (size_t)m * K, K, q, d + (size_t)m * blocks, NULL);
        if (!full)
            for (int b = 0; b < blocks; b++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(q + b * QB));
                _mm256_storeu_si256((__m256i *)(xa + (size_t)m * ldq + b * QB), _mm256_abs_epi8(v));
            }
    }
    size_t srow = group ? (size_t)(K / group) : 1;
    /* Each thread takes a contiguous run of weight rows and reads them in order, one
     * stream (the four rows of the previous register block were four streams: measured
     * 1.5x slower on one int8 row, on a 2-core EPYC), one row at a time; the VNNI build
     * reads rows n and n + N / 2 together (two streams: 1.06-1.14x faster on a 2-core
     * AVX-512 Xeon). */
#ifdef RLT_A8_VNNI
    int R = M <= MB ? STREAMS : 2;
    int part = N / R; /* rows n, n + part, ... together: R streams a thread */
#pragma omp parallel for schedule(static)
    for (int n = 0; n < part; n++) {
        const int8_t *ws[STREAMS];
        const uint16_t *ss[STREAMS];
        for (int r = 0; r < R; r++) {
            ws[r] = w + (size_t)(n + r * part) * K;
            ss[r] = scale + (n + r * part) * srow;
        }
        for (int j0 = 0; j0 < M; j0 += MB) {
            int mb = M - j0 < MB ? M - j0 : MB;
            const int8_t *xb = xq + (size_t)j0 * ldq, *ab = xa + (size_t)j0 * ldq;
            const float *db = d + (size_t)j0 * blocks;
            uint16_t *ys[STREAMS];
            for (int r = 0; r < R; r++) ys[r] = y + (size_t)j0 * N + n + r * part;
#define ROW8_MULTI(FULL)                                                                  \
    if (R == 2 && mb == MB) row8_multi(xb, ab, db, ldq, MB, ws, ss, ys, K, group, N, FULL, 2); \
    else if (R == 2) row8_multi(xb, ab, db, ldq, mb, ws, ss, ys, K, group, N, FULL, 2);    \
    else if (mb == 1) row8_multi(xb, ab, db, ldq, 1, ws, ss, ys, K, group, N, FULL, STREAMS); \
    else row8_multi(xb, ab, db, ldq, mb, ws, ss, ys, K, group, N, FULL, STREAMS);
            if (full) {
                ROW8_MULTI(1)
            } else {
                ROW8_MULTI(0)
            }
#undef ROW8_MULTI
        }
    }
    int first = R * part; /* rows left over: one stream */
#else
    int first = 0;
#endif
#pragma omp parallel for schedule(static)
    for (int n = first; n < N; n++) {
        const int8_t *wr = w + (size_t)n * K;
        const uint16_t *sn = scale + n * srow;
        for (int j0 = 0; j0 < M; j0 += MB) {
            int mb = M - j0 < MB ? M - j0 : MB;
            const int8_t *xb = xq + (size_t)j0 * ldq, *ab = xa + (size_t)j0 * ldq;
            const float *db = d + (size_t)j0 * blocks;
            uint16_t *yb = y + (size_t)j0 * N + n;
            /* Constant block sizes keep the accumulators in registers; the arithmetic per
             * (m, n) is the same in every branch. */
#define ROW8(FULL)                                                                         \
    if (mb == MB) row8(xb, ab, db, ldq, MB, wr, sn, K, group, yb, N, FULL);                 \
    else if (mb == 1) row8(xb, ab, db, ldq, 1, wr, sn, K, group, yb, N, FULL);              \
    else row8(xb, ab, db, ldq, mb, wr, sn, K, group, yb, N, FULL);
            if (full) {
                ROW8(1)
            } else {
                ROW8(0)
            }
#undef ROW8
        }
    }
    free(xq);
    free(d);
    return 0;
}

/* Per token: one row quantized with one scale (see the top), xq [ldq] zero-padded; a row of
 * zeros gives q = 0 and d = 0. */
static void quantize_row_token(const uint16_t *x, int K, int ldq, int8_t *xq, float *d) {
    float amax = 0.0f;
    for (int k = 0; k < K; k++) {
        float v = fabsf(bf16_to_f32(x[k]));
        amax = v > amax ? v : amax;
    }
    float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
    *d = amax != 0.0f ? 1.0f / inv : 0.0f;
    for (int k = 0; k < ldq; k++) xq[k] = k < K ? (int8_t)nearbyintf(bf16_to_f32(x[k]) * inv) : 0;
}

INLINE int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* Per token: one int8 weight row (scale s) against mb input rows, row8's dot products summed
 * in int32 lanes. */
INLINE void row8_token(const int8_t *xq, const int8_t *xa, const float *d, int ldq, int mb,
                       const int8_t *w, float s, int K, uint16_t *y, int ldy, int full) {
    int nblk = K / QB;
    __m256i acc[MB];
    for (int j = 0; j < MB; j++) acc[j] = _mm256_setzero_si256();
    for (int b = 0; b < nblk; b++) {
        if (b % 2 == 0) _mm_prefetch((const char *)(w + b * QB) + PREFETCH, _MM_HINT_T0);
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + b * QB));
        __m256i aw = full ? _mm256_abs_epi8(wv) : wv;
        for (int j = 0; j < mb; j++) {
            __m256i lanes = block8(xq, xa, (size_t)j * ldq + b * QB, wv, aw, full);
            acc[j] = _mm256_add_epi32(acc[j], lanes);
        }
    }
    for (int j = 0; j < mb; j++) {
        const int8_t *xj = xq + (size_t)j * ldq;
        int32_t t = hsum_epi32(acc[j]);
        for (int k = nblk * QB; k < K; k++) t += xj[k] * w[k];
        y[(size_t)j * ldy] = f32_to_bf16(((float)t * s) * d[j]);
    }
}

int A8(rlt_linear_int8_token)(const uint16_t *x, const int8_t *w, const uint16_t *scale,
                               uint16_t *y, int M, int N, int K, int full) {
    int ldq = (K + QB - 1) / QB * QB;
    int8_t *xq = malloc((size_t)M * ldq * 2);
    float *d = malloc((size_t)M * sizeof(float));
    if (!xq || !d) {
        free(xq);
        free(d);
        return -1;
    }
    int8_t *xa = xq + (size_t)M * ldq;
    for (int m = 0; m < M; m++) {
        int8_t *q = xq + (size_t)m * ldq;
        quantize_row_token(x + (size_t)m * K, K, ldq, q, d + m);
        if (!full)
            for (int b = 0; b < ldq; b += QB) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(q + b));
                _mm256_storeu_si256((__m256i *)(xa + (size_t)m * ldq + b), _mm256_abs_epi8(v));
            }
    }
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const int8_t *wr = w + (size_t)n * K;
        float s = bf16_to_f32(scale[n]);
        for (int j0 = 0; j0 < M; j0 += MB) {
            int mb = M - j0 < MB ? M - j0 : MB;
            const int8_t *xb = xq + (size_t)j0 * ldq, *ab = xa + (size_t)j0 * ldq;
            uint16_t *yb = y + (size_t)j0 * N + n;
#define ROWT(FULL)                                                                        \
    if (mb == MB) row8_token(xb, ab, d + j0, ldq, MB, wr, s, K, yb, N, FULL);              \
    else if (mb == 1) row8_token(xb, ab, d + j0, ldq, 1, wr, s, K, yb, N, FULL);           \
    else row8_token(xb, ab, d + j0, ldq, mb, wr, s, K, yb, N, FULL);
            if (full) {
                ROWT(1)
            } else {
                ROWT(0)
            }
#undef ROWT
        }
    }
    free(xq);
    free(d);
    return 0;
}

int A8(rlt_linear_int8_a8)(const uint16_t *x, const int8_t *w, const uint16_t *scale, uint16_t *y,
                            int M, int N, int K, int full) {
    return linear_a8(x, w, scale, y, M, N, K, 0, full);
}

int A8(rlt_linear_int8g_a8)(const uint16_t *x, const int8_t *w, const uint16_t *scale,
                             uint16_t *y, int M, int N, int K, int group, int full) {
    return linear_a8(x, w, scale, y, M, N, K, group, full);
}

/* W4A8 on int4 weights repacked eight rows at a time (quant_kernels.int4_octets):
 * w8 [N8 / 8, K / 32, 4, 8, 4]: for each octet of rows and block of 32 inputs, four groups of
 * 32 bytes, group v holding each row's packed bytes 4v..4v+3 in turn (hal.quant's nibble
 * order: low nibbles inputs 4v..4v+3, high ones 16+4v..16+4v+3), so that lane i of every
 * 256-bit load is row i and an octet's blocks are one stream; s8 [N8 / 8, K / group, 8] bf16:
 * the octet's scales, row i in lane i. N8 is N rounded up to 8 (zero rows).
 *
 * y[m, n] = bf16(sum over blocks b in order of fma: float(dot_b) * (d[m, b] * scale[n, group
 * of b])), dot_b the block's exact integer dot product of q = u - 8 with xq (u * x summed
 * with vpmaddubsw, eight of them a block added in int16 lanes (at most 8 * 2 * 15 * 127 =
 * 30480), then vpmaddwd; less 8 * the block's sum of x). The same sequence for every (m, n)
 * wherever the row falls: row- and column-invariant by construction. Each row's sums stay in
 * its own lane (no horizontal adds), and what the per-row layout spent on each row and block
 * (the scale products, the offset, the conversion and the FMA) is spent once an octet here,
 * vectorized over its eight rows. */
/* R octets far apart in one pass (R > 1: the VNNI build, whose 32 vector registers hold
 * their accumulators): R weight streams a thread instead of one, block b of each in turn,
 * each octet's lanes doing what they do alone (octet4: R = 1), in the same order: the same
 * bits. Decode (one
 * register block of input rows) reads OCTET_STREAMS octets at once: over 24 layers of
 * ouro-1.4b-shape (2.77 GB a token, not cache-resident, 2 threads) 151-181 ms (median 156)
 * against 164-184 ms (median 175) with two (AVX-512 Xeon, load 1.5-1.8); more input rows keep
 * two (four: 10.4-10.5 ms against 9.4-9.6 ms for 64 rows of an 11264 x 2048 projection). */
#define OCTET_STREAMS 4
INLINE void octet4_multi(const int8_t *xq, const int32_t *sx8, const float *d, int ldq, int mb,
                         const uint8_t *const *ws, const uint16_t *const *ss,
                         uint16_t *const *ys, const int *nvs, int K, int group, int ldy,
                         int R) {
    int nblk = K / QB, ldd = ldq / QB, per = group / QB;
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256 acc[OCTET_STREAMS][MB], sc[OCTET_STREAMS];
    for (int q = 0; q < R; q++) {
        sc[q] = _mm256_setzero_ps();
        for (int j = 0; j < MB; j++) acc[q][j] = _mm256_setzero_ps();
    }
    for (int b = 0; b < nblk; b++) {
        for (int q = 0; q < R; q++) {
            const uint8_t *wb = ws[q] + (size_t)b * 128;
            _mm_prefetch((const char *)wb + 8 * PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)wb + 8 * PREFETCH + 64, _MM_HINT_T0);
            if (b % per == 0) {
                __m128i h = _mm_loadu_si128((const __m128i *)(ss[q] + (size_t)(b / per) * 8));
                sc[q] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            }
            __m256i lo[4], hi[4];
            for (int v = 0; v < 4; v++) {
                __m256i u = _mm256_loadu_si256((const __m256i *)(wb + 32 * v));
                lo[v] = _mm256_and_si256(u, m4);
                hi[v] = _mm256_and_si256(_mm256_srli_epi16(u, 4), m4);
            }
            for (int j = 0; j < mb; j++) {
                const int8_t *xb = xq + (size_t)j * ldq + b * QB;
                __m256i a = _mm256_setzero_si256();
                for (int v = 0; v < 4; v++) {
                    int32_t xl, xh; /* inputs 4v..4v+3 and 16+4v..16+4v+3, in every lane */
                    memcpy(&xl, xb + 4 * v, 4);
                    memcpy(&xh, xb + 16 + 4 * v, 4);
#ifdef RLT_A8_VNNI /* int32 lanes throughout: the same exact sums */
                    a = _mm256_dpbusd_epi32(a, lo[v], _mm256_set1_epi32(xl));
                    a = _mm256_dpbusd_epi32(a, hi[v], _mm256_set1_epi32(xh));
#else
                    a = _mm256_add_epi16(a, _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo[v], _mm256_set1_epi32(xl)),
                        _mm256_maddubs_epi16(hi[v], _mm256_set1_epi32(xh))));
#endif
                }
#ifndef RLT_A8_VNNI
                a = _mm256_madd_epi16(a, _mm256_set1_epi16(1));
#endif
                __m256i h = _mm256_sub_epi32(a, _mm256_set1_epi32(sx8[(size_t)j * ldd + b]));
                __m256 c = _mm256_mul_ps(_mm256_set1_ps(d[(size_t)j * ldd + b]), sc[q]);
                acc[q][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), c, acc[q][j]);
            }
        }
    }
    for (int q = 0; q < R; q++)
        for (int j = 0; j < mb; j++) {
            float o[8];
            _mm256_storeu_ps(o, acc[q][j]);
            for (int t = 0; t < nvs[q]; t++) ys[q][(size_t)j * ldy + t] = f32_to_bf16(o[t]);
        }
}
INLINE void octet4(const int8_t *xq, const int32_t *sx8, const float *d, int ldq, int mb,
                   const uint8_t *w, const uint16_t *s, int K, int group, uint16_t *y, int ldy,
                   int nv) {
    const uint8_t *ws[1] = {w};
    const uint16_t *ss[1] = {s};
    uint16_t *ys[1] = {y};
    const int nvs[1] = {nv};
    octet4_multi(xq, sx8, d, ldq, mb, ws, ss, ys, nvs, K, group, ldy, 1);
}


int A8(rlt_linear_int4_a8)(const uint16_t *x, const uint8_t *w8, const uint16_t *s8,
                             uint16_t *y, int M, int N, int K, int group) {
    int blocks = K / QB, ldq = K;
    int8_t *xq = malloc((size_t)M * ldq);
    int32_t *sx8 = malloc((size_t)M * blocks * sizeof(int32_t));
    float *d = malloc((size_t)M * blocks * sizeof(float));
    if (!xq || !sx8 || !d) {
        free(xq);
        free(sx8);
        free(d);
        return -1;
    }
    for (int m = 0; m < M; m++) {
        int8_t *q = xq + (size_t)m * ldq;
        int32_t *sm = sx8 + (size_t)m * blocks;
        quantize_row(x + (size_t)m * K, K, q, d + (size_t)m * blocks, sm);
        for (int b = 0; b < blocks; b++) sm[b] *= 8;
    }
    int octets = (N + 7) / 8;
    size_t wo = (size_t)blocks * 128, so = (size_t)(K / group) * 8;
#ifdef RLT_A8_VNNI
    int R = M <= MB ? OCTET_STREAMS : 2;
    int part = octets / R; /* octets p, p + part, ... together */
#pragma omp parallel for schedule(static)
    for (int p = 0; p < part; p++) {
        const uint8_t *ws[OCTET_STREAMS];
        const uint16_t *ss[OCTET_STREAMS];
        int nvs[OCTET_STREAMS], ns[OCTET_STREAMS];
        for (int q = 0; q < R; q++) {
            int o = p + q * part;
            ns[q] = o * 8;
            nvs[q] = N - ns[q] < 8 ? N - ns[q] : 8;
            ws[q] = w8 + o * wo;
            ss[q] = s8 + o * so;
        }
        for (int j0 = 0; j0 < M; j0 += MB) {
            int mb = M - j0 < MB ? M - j0 : MB;
            const int8_t *xb = xq + (size_t)j0 * ldq;
            const int32_t *sb = sx8 + (size_t)j0 * blocks;
            const float *db = d + (size_t)j0 * blocks;
            uint16_t *ys[OCTET_STREAMS];
            for (int q = 0; q < R; q++) ys[q] = y + (size_t)j0 * N + ns[q];
            if (R == 2 && mb == MB)
                octet4_multi(xb, sb, db, ldq, MB, ws, ss, ys, nvs, K, group, N, 2);
            else if (R == 2) octet4_multi(xb, sb, db, ldq, mb, ws, ss, ys, nvs, K, group, N, 2);
            else if (mb == 1)
                octet4_multi(xb, sb, db, ldq, 1, ws, ss, ys, nvs, K, group, N, OCTET_STREAMS);
            else octet4_multi(xb, sb, db, ldq, mb, ws, ss, ys, nvs, K, group, N, OCTET_STREAMS);
        }
    }
    int first = R * part; /* octets left over: one stream */
#else
    int first = 0;
#endif
#pragma omp parallel for schedule(static)
    for (int o = first; o < octets; o++) {
        int n = o * 8, nv = N - n < 8 ? N - n : 8;
        for (int j0 = 0; j0 < M; j0 += MB) {
            int mb = M - j0 < MB ? M - j0 : MB;
            const int8_t *xb = xq + (size_t)j0 * ldq;
            const int32_t *sb = sx8 + (size_t)j0 * blocks;
            const float *db = d + (size_t)j0 * blocks;
            uint16_t *yb = y + (size_t)j0 * N + n;
            const uint8_t *wn = w8 + o * wo;
            const uint16_t *sn = s8 + o * so;
            if (mb == MB) octet4(xb, sb, db, ldq, MB, wn, sn, K, group, yb, N, nv);
            else if (mb == 1) octet4(xb, sb, db, ldq, 1, wn, sn, K, group, yb, N, nv);
            else octet4(xb, sb, db, ldq, mb, wn, sn, K, group, yb, N, nv);
        }
    }
    free(xq);
    free(sx8);
    free(d);
    return 0;
}

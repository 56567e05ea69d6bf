/* y = x~ @ dequant(w).T with the activations quantized per block of 32, as llama.cpp's Q8_0
 * dot products do (W8A8, W4A8): AVX2 integer dot products, fp32 sums.
 *
 * Each row of x (bf16 [M, K]) is quantized on its own, block by block of 32 inputs:
 *   d = amax / 127 (fp32), q = nearest-even(x * (1 / d)), x~ = q * d;
 * hal.quant.quantize_activations computes the same x~ (the conformance kit's reference).
 * w is hal/quant.py's layout: int8 [N, K] with bf16 scale [N], or int4 nibbles [N, K / 2]
 * with bf16 scale [N, K / group] (group a multiple of 32).
 *
 * y[m, n]: for each block b in order, the block's integer dot product (exact, int32: the
 * sign trick with vpmaddubsw / vpmaddwd) converted to fp32 and added with one FMA times its
 * scale (int8: d[m, b]; int4: d[m, b] * scale[n, group of b]) into an 8-lane accumulator;
 * then a fixed horizontal sum, an int8 K tail (scalar), the int8 channel scale, bf16
 * rounding. The same sequence for every (m, n) wherever the row falls: row- and
 * column-invariant by construction. Decode is bound by the integer dot products, which take
 * about half the instructions of widening each weight to fp32 (linear_quant_avx2.c), and by
 * how the weights stream in: each thread reads its rows in order (see linear_a8).
 */
#include "bf16.h"
#include "rlt_cpu.h"
#include <math.h>

#define QB 32        /* inputs per activation block */
#define NR 2        /* weight rows per register block */
#define MB 4        /* input rows per register block */
#define PREFETCH 512 /* bytes ahead of a weight row's read position */

#define INLINE static inline __attribute__((always_inline))

/* One row quantized: xq [blocks * 32] (a partial last block zero-padded), d [blocks]. */
static void quantize_row(const uint16_t *x, int K, int8_t *xq, float *d) {
    for (int b = 0, k0 = 0; k0 < K; b++, k0 += QB) {
        int n = K - k0 < QB ? K - k0 : QB;
        float amax = 0.0f;
        for (int k = 0; k < n; k++) {
            float v = fabsf(bf16_to_f32(x[k0 + k]));
            amax = v > amax ? v : amax;
        }
        float db = amax / 127.0f;
        float id = db != 0.0f ? 1.0f / db : 0.0f;
        d[b] = db;
        for (int k = 0; k < QB; k++)
            xq[k0 + k] = k < n ? (int8_t)nearbyintf(bf16_to_f32(x[k0 + k]) * id) : 0;
    }
}

/* Eight int32 lanes, each the sum of four of the 32 products xq * wq (|values| <= 127);
 * ax = |xq|. */
INLINE __m256i dot32(__m256i ax, __m256i xq, __m256i wq) {
    __m256i p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wq, xq));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* 32 int4 weights (16 bytes) as signed bytes in input order. */
INLINE __m256i load_i4x32(const uint8_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(15);
    __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
    return _mm256_sub_epi8(u, _mm256_set1_epi8(8));
}

/* nr adjacent weight rows against mb quantized input rows (xq, their absolute values xa,
 * their block scales d: ldq inputs and ldq / QB scales a row). int4 when group > 0. */
INLINE void rows(const int8_t *xq, const int8_t *xa, const float *d, int ldq, int mb,
                 const uint8_t *w, const uint16_t *scale, int nr, int K, int group, uint16_t *y,
                 int ldy) {
    int nblk = K / QB, ldd = ldq / QB, srow = group ? K / group : 1;
    size_t wblk = group ? QB / 2 : QB, wrow = nblk * wblk + (group ? 0 : K % QB);
    __m256 acc[NR][MB];
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < MB; j++) acc[i][j] = _mm256_setzero_ps();
    for (int b = 0; b < nblk; b++) {
        __m256i xv[MB], av[MB];
        for (int j = 0; j < mb; j++) {
            xv[j] = _mm256_loadu_si256((const __m256i *)(xq + (size_t)j * ldq + b * QB));
            av[j] = _mm256_loadu_si256((const __m256i *)(xa + (size_t)j * ldq + b * QB));
        }
        for (int i = 0; i < nr; i++) {
            const uint8_t *wi = w + i * wrow + b * wblk;
            /* A prefetch ahead of the hardware's: one request per cache line. */
            if ((b * wblk) % 64 == 0) _mm_prefetch((const char *)wi + PREFETCH, _MM_HINT_T0);
            __m256i wv;
            float s = 1.0f;
            if (group) {
                wv = load_i4x32(wi);
                s = bf16_to_f32(scale[(size_t)i * srow + b * QB / group]);
            } else {
                wv = _mm256_loadu_si256((const __m256i *)wi);
            }
            for (int j = 0; j < mb; j++) {
                __m256 sum = _mm256_cvtepi32_ps(dot32(av[j], xv[j], wv));
                float c = group ? d[(size_t)j * ldd + b] * s : d[(size_t)j * ldd + b];
                acc[i][j] = _mm256_fmadd_ps(sum, _mm256_set1_ps(c), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < mb; j++) {
            float t = hsum(acc[i][j]);
            if (!group) {
                const int8_t *wi = (const int8_t *)w + i * wrow, *xj = xq + (size_t)j * ldq;
                int tail = 0;
                for (int k = nblk * QB; k < K; k++) tail += xj[k] * wi[k];
                if (nblk * QB < K) t += (float)tail * d[(size_t)j * ldd + nblk];
                t *= bf16_to_f32(scale[i]);
            }
            y[(size_t)j * ldy + i] = f32_to_bf16(t);
        }
}

static int linear_a8(const uint16_t *x, const void *w, const uint16_t *scale, uint16_t *y, int M,
                     int N, int K, int group) {
    int blocks = (K + QB - 1) / QB, ldq = blocks * QB;
    int8_t *xq = malloc((size_t)2 * M * ldq);
    float *d = malloc((size_t)M * blocks * sizeof(float));
    if (!xq || !d) {
        free(xq);
        free(d);
        return -1;
    }
    int8_t *xa = xq + (size_t)M * ldq;
    for (int m = 0; m < M; m++) {
        quantize_row(x + (size_t)m * K, K, xq + (size_t)m * ldq, d + (size_t)m * blocks);
        for (int k = 0; k < ldq; k++) xa[(size_t)m * ldq + k] = (int8_t)abs(xq[(size_t)m * ldq + k]);
    }
    size_t wrow = group ? (size_t)K / 2 : (size_t)K;
    size_t srow = group ? (size_t)(K / group) : 1;
    /* Each thread takes a contiguous run of weight rows and reads them in order, one
     * stream (the four rows of the previous register block were four streams: measured
     * 1.5x slower on one int8 row). int8 rows go one at a time; int4 rows, with more to
     * compute a byte, in pairs, two independent sums in flight. */
    int nrb = group ? NR : 1, nblocks = (N + nrb - 1) / nrb;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < nblocks; p++) {
        int n = p * nrb, nr = N - n < nrb ? N - n : nrb;
        const uint8_t *wn = (const uint8_t *)w + n * wrow;
        const uint16_t *sn = scale + n * srow;
        for (int j0 = 0; j0 < M; j0 += MB) {
            int mb = M - j0 < MB ? M - j0 : MB;
            const int8_t *xb = xq + (size_t)j0 * ldq, *ab = xa + (size_t)j0 * ldq;
            const float *db = d + (size_t)j0 * blocks;
            uint16_t *yb = y + (size_t)j0 * N + n;
            /* Constant block sizes keep the accumulators in registers; the arithmetic per
             * (m, n) is the same in every branch. */
#define ROWS(NB_, MB_) rows(xb, ab, db, ldq, MB_, wn, sn, NB_, K, group, yb, N)
            if (nr == NR && mb == MB) ROWS(NR, MB);
            else if (nr == NR && mb == 1) ROWS(NR, 1);
            else if (nr == NR) ROWS(NR, mb);
            else if (mb == MB) ROWS(1, MB);
            else if (mb == 1) ROWS(1, 1);
            else ROWS(1, mb);
#undef ROWS
        }
    }
    free(xq);
    free(d);
    return 0;
}

int rlt_linear_int8_a8_avx2(const uint16_t *x, const int8_t *w, const uint16_t *scale, uint16_t *y,
                            int M, int N, int K) {
    return linear_a8(x, w, scale, y, M, N, K, 0);
}

int rlt_linear_int4_a8_avx2(const uint16_t *x, const uint8_t *w, const uint16_t *scale, uint16_t *y,
                            int M, int N, int K, int group) {
    return linear_a8(x, w, scale, y, M, N, K, group);
}

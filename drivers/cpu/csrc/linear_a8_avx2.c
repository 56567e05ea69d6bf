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
 * about half the instructions of widening each weight to fp32 (linear_quant_avx2.c).
 */
#include "bf16.h"
#include "rlt_cpu.h"
#include <math.h>

#define QB 32 /* inputs per activation block */
#define NB 4  /* weight rows per register block */
#define MB 2  /* input rows per register block */

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

/* Eight int32 lanes, each the sum of four of the 32 products xq * wq (|values| <= 127). */
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

/* One register block: nb weight rows x mb input rows. int4 when group > 0. */
INLINE void block(const int8_t *xq, const float *d, int ldq, int mb, const void *w,
                  const uint16_t *scale, int nb, int K, int group, uint16_t *y, int ldy) {
    int nblk = K / QB, groups = group ? K / group : 1;
    __m256 acc[NB][MB];
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++) acc[i][j] = _mm256_setzero_ps();
    for (int b = 0; b < nblk; b++) {
        __m256i xv[MB], ax[MB];
        for (int j = 0; j < mb; j++) {
            xv[j] = _mm256_loadu_si256((const __m256i *)(xq + (size_t)j * ldq + b * QB));
            ax[j] = _mm256_sign_epi8(xv[j], xv[j]);
        }
        for (int i = 0; i < nb; i++) {
            __m256i wv;
            float s = 1.0f;
            if (group) {
                wv = load_i4x32((const uint8_t *)w + (size_t)i * (K / 2) + b * (QB / 2));
                s = bf16_to_f32(scale[(size_t)i * groups + b * QB / group]);
            } else {
                wv = _mm256_loadu_si256((const __m256i *)((const int8_t *)w + (size_t)i * K + b * QB));
            }
            for (int j = 0; j < mb; j++) {
                __m256 sum = _mm256_cvtepi32_ps(dot32(ax[j], xv[j], wv));
                float c = group ? d[(size_t)j * ldq / QB + b] * s : d[(size_t)j * ldq / QB + b];
                acc[i][j] = _mm256_fmadd_ps(sum, _mm256_set1_ps(c), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) {
            float t = hsum(acc[i][j]);
            if (!group) {
                const int8_t *wi = (const int8_t *)w + (size_t)i * K;
                const int8_t *xj = xq + (size_t)j * ldq;
                int tail = 0;
                for (int k = nblk * QB; k < K; k++) tail += xj[k] * wi[k];
                if (nblk * QB < K) t += (float)tail * d[(size_t)j * ldq / QB + nblk];
                t *= bf16_to_f32(scale[i]);
            }
            y[(size_t)j * ldy + i] = f32_to_bf16(t);
        }
}

static int linear_a8(const uint16_t *x, const void *w, const uint16_t *scale, uint16_t *y, int M,
                     int N, int K, int group) {
    int blocks = (K + QB - 1) / QB, ldq = blocks * QB;
    int8_t *xq = malloc((size_t)M * ldq);
    float *d = malloc((size_t)M * blocks * sizeof(float));
    if (!xq || !d) {
        free(xq);
        free(d);
        return -1;
    }
    for (int m = 0; m < M; m++) quantize_row(x + (size_t)m * K, K, xq + (size_t)m * ldq, d + (size_t)m * blocks);
    size_t wrow = group ? (size_t)K / 2 : (size_t)K;
    size_t srow = group ? (size_t)(K / group) : 1;
    int nblocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < nblocks; b++) {
        int n0 = b * NB, nb = N - n0 < NB ? N - n0 : NB;
        const void *wb = (const uint8_t *)w + n0 * wrow;
        const uint16_t *sb = scale + n0 * srow;
        for (int j0 = 0; j0 < M; j0 += MB) {
            int mb = M - j0 < MB ? M - j0 : MB;
            const int8_t *xb = xq + (size_t)j0 * ldq;
            const float *db = d + (size_t)j0 * blocks;
            uint16_t *yb = y + (size_t)j0 * N + n0;
            /* Constant block sizes keep the accumulators in registers; the arithmetic per
             * (m, n) is the same in every branch. */
            if (nb == NB && mb == MB) block(xb, db, ldq, MB, wb, sb, NB, K, group, yb, N);
            else if (nb == NB && mb == 1) block(xb, db, ldq, 1, wb, sb, NB, K, group, yb, N);
            else block(xb, db, ldq, mb, wb, sb, nb, K, group, yb, N);
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

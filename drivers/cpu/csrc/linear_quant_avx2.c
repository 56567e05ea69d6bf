/* y = x @ dequant(w).T for bf16 x [M, K] and weight-only quantized w (hal/quant.py's layout):
 * AVX2 + FMA, activations widened to fp32 (never quantized), fp32 sums.
 *
 * int8: w int8 [N, K], scale bf16 [N]. y[m, n] = bf16(scale[n] * s), s the sum of
 *   x[m, k] * q[n, k] in linear_avx2.c's order: one 8-lane accumulator walked over k in order
 *   with FMA (q widened with vpmovsxbd + vcvtdq2ps), a fixed horizontal sum, the scalar tail.
 * int4: w uint8 [N, K / 2] (each 32 inputs in 16 bytes, byte j holding q + 8 of input j in
 *   its low nibble and of input j + 16 in its high one), scale bf16 [N, K / group]. Each
 *   weight is dequantized exactly, w = fma(u, scale, -8 * scale) = q * scale (4 bits times a
 *   bf16 scale fit an fp32), then summed as in linear_avx2.c: one 8-lane accumulator over k
 *   in order, a fixed horizontal sum, bf16 rounding. K is a multiple of 32.
 * int8g: w int8 [N, K], scale bf16 [N, K / group] (group a multiple of 32): each weight
 *   dequantized exactly, w = q * scale (8 bits times a bf16 scale fit an fp32), then summed
 *   as int4's.
 *
 * Which block a row falls in changes nothing in those sequences, so both kernels are
 * row-invariant (and column-invariant) by construction, like linear_avx2.c.
 */
#include "bf16.h"
#include "rlt_cpu.h"
#include <stdlib.h>

#define NB 4  /* weight rows per register block */
#define MB 2  /* input rows per register block */
#define MC 32 /* input rows per cache block (fp32, kept in L2) */

#define INLINE static inline __attribute__((always_inline))

/* Eight int8 weights widened to fp32 (exact). */
INLINE __m256 load_i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

INLINE void block_int8(const float *x, int ldx, int mb, const int8_t *w, const uint16_t *scale,
                       int nb, int K, uint16_t *y, int ldy) {
    __m256 acc[NB][MB];
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++) acc[i][j] = _mm256_setzero_ps();
    int K8 = K & ~7;
    for (int k = 0; k < K8; k += 8) {
        __m256 xv[MB];
        for (int j = 0; j < mb; j++) xv[j] = _mm256_loadu_ps(x + (size_t)j * ldx + k);
        for (int i = 0; i < nb; i++) {
            __m256 wv = load_i8x8(w + (size_t)i * K + k);
            for (int j = 0; j < mb; j++) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < nb; i++) {
        const int8_t *wi = w + (size_t)i * K;
        float s = bf16_to_f32(scale[i]);
        for (int j = 0; j < mb; j++) {
            const float *xj = x + (size_t)j * ldx;
            float t = hsum(acc[i][j]);
            for (int k = K8; k < K; k++) t += xj[k] * (float)wi[k];
            y[(size_t)j * ldy + i] = f32_to_bf16(t * s);
        }
    }
}

/* 32 int4 weights (16 bytes) dequantized to four vectors of eight, inputs in order. */
INLINE void load_i4x32(const uint8_t *p, __m256 s, __m256 s8, __m256 out[4]) {
    const __m256i low = _mm256_set1_epi32(15);
    __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));       /* bytes 0-7 */
    __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))); /* 8-15 */
    __m256i u[4] = {_mm256_and_si256(b0, low), _mm256_and_si256(b1, low),
                    _mm256_srli_epi32(b0, 4), _mm256_srli_epi32(b1, 4)};
    for (int v = 0; v < 4; v++) out[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(u[v]), s, s8);
}

/* 32 int8 weights dequantized to four vectors of eight, inputs in order. */
INLINE void load_i8x32(const int8_t *p, __m256 s, __m256 out[4]) {
    for (int v = 0; v < 4; v++) out[v] = _mm256_mul_ps(load_i8x8(p + 8 * v), s);
}

/* int4 (bits 4) or int8g (bits 8): weights dequantized per group, then fp32 FMA sums. */
INLINE void block_grouped(const float *x, int ldx, int mb, const uint8_t *w,
                          const uint16_t *scale, int nb, int K, int group, uint16_t *y, int ldy,
                          int bits) {
    __m256 acc[NB][MB];
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++) acc[i][j] = _mm256_setzero_ps();
    int groups = K / group;
    for (int k = 0; k < K; k += 32) {
        int g = k / group;
        for (int i = 0; i < nb; i++) {
            float sf = bf16_to_f32(scale[(size_t)i * groups + g]);
            __m256 wv[4];
            if (bits == 4)
                load_i4x32(w + (size_t)i * (K / 2) + k / 2, _mm256_set1_ps(sf),
                           _mm256_set1_ps(-8.0f * sf), wv);
            else
                load_i8x32((const int8_t *)w + (size_t)i * K + k, _mm256_set1_ps(sf), wv);
            for (int v = 0; v < 4; v++)
                for (int j = 0; j < mb; j++)
                    acc[i][j] = _mm256_fmadd_ps(
                        wv[v], _mm256_loadu_ps(x + (size_t)j * ldx + k + 8 * v), acc[i][j]);
        }
    }
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) y[(size_t)j * ldy + i] = f32_to_bf16(hsum(acc[i][j]));
}

int rlt_linear_int8_avx2(const uint16_t *x, const int8_t *w, const uint16_t *scale, uint16_t *y,
                         int M, int N, int K) {
    float *xf = widen_rows(x, M, K);
    if (!xf) return -1;
    int nblocks = (N + NB - 1) / NB;
    for (int m0 = 0; m0 < M; m0 += MC) {
        int mc = M - m0 < MC ? M - m0 : MC;
#pragma omp parallel for schedule(static)
        for (int b = 0; b < nblocks; b++) {
            int n0 = b * NB, nb = N - n0 < NB ? N - n0 : NB;
            for (int j0 = 0; j0 < mc; j0 += MB) {
                int mb = mc - j0 < MB ? mc - j0 : MB;
                const float *xb = xf + (size_t)(m0 + j0) * K;
                uint16_t *yb = y + (size_t)(m0 + j0) * N + n0;
                const int8_t *wb = w + (size_t)n0 * K;
                const uint16_t *sb = scale + n0;
                if (nb == NB && mb == MB) block_int8(xb, K, MB, wb, sb, NB, K, yb, N);
                else if (nb == NB && mb == 1) block_int8(xb, K, 1, wb, sb, NB, K, yb, N);
                else block_int8(xb, K, mb, wb, sb, nb, K, yb, N);
            }
        }
    }
    free(xf);
    return 0;
}

static int linear_grouped(const uint16_t *x, const uint8_t *w, const uint16_t *scale,
                          uint16_t *y, int M, int N, int K, int group, int bits) {
    float *xf = widen_rows(x, M, K);
    if (!xf) return -1;
    int nblocks = (N + NB - 1) / NB;
    size_t wrow = (size_t)K * bits / 8;
    for (int m0 = 0; m0 < M; m0 += MC) {
        int mc = M - m0 < MC ? M - m0 : MC;
#pragma omp parallel for schedule(static)
        for (int b = 0; b < nblocks; b++) {
            int n0 = b * NB, nb = N - n0 < NB ? N - n0 : NB;
            for (int j0 = 0; j0 < mc; j0 += MB) {
                int mb = mc - j0 < MB ? mc - j0 : MB;
                const float *xb = xf + (size_t)(m0 + j0) * K;
                uint16_t *yb = y + (size_t)(m0 + j0) * N + n0;
                const uint8_t *wb = w + (size_t)n0 * wrow;
                const uint16_t *sb = scale + (size_t)n0 * (K / group);
                /* Constant bits and block sizes: one specialised body each. */
#define BLOCK(BITS)                                                                               \
    if (nb == NB && mb == MB) block_grouped(xb, K, MB, wb, sb, NB, K, group, yb, N, BITS);       \
    else if (nb == NB && mb == 1) block_grouped(xb, K, 1, wb, sb, NB, K, group, yb, N, BITS);    \
    else block_grouped(xb, K, mb, wb, sb, nb, K, group, yb, N, BITS);
                if (bits == 4) {
                    BLOCK(4)
                } else {
                    BLOCK(8)
                }
#undef BLOCK
            }
        }
    }
    free(xf);
    return 0;
}

int rlt_linear_int4_avx2(const uint16_t *x, const uint8_t *w, const uint16_t *scale, uint16_t *y,
                         int M, int N, int K, int group) {
    return linear_grouped(x, w, scale, y, M, N, K, group, 4);
}

int rlt_linear_int8g_avx2(const uint16_t *x, const int8_t *w, const uint16_t *scale, uint16_t *y,
                          int M, int N, int K, int group) {
    return linear_grouped(x, (const uint8_t *)w, scale, y, M, N, K, group, 8);
}

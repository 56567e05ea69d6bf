/* y = x @ w.T for bf16 x [M, K], w [N, K], y [M, N] with AVX-512 BF16 dot products.
 *
 * Built with the other kernels by drivers/cpu/kernels.py and offered only where the CPU has
 * avx512_bf16 (rlt_has_avx512bf16) and torch's own dispatch is AVX-512. Each output
 * y[m, n] is one 16-lane fp32 accumulator fed by vdpbf16ps over k in order, 32 elements a
 * step (a masked step for the tail), then a fixed horizontal sum, then round-to-nearest-even
 * to bf16. Which register block a row falls in changes nothing in that sequence, so the
 * kernel is row-invariant (and column-invariant) by construction. vdpbf16ps flushes
 * denormals, and its sums run in another order than torch's: it is not HF-exact.
 *
 * Register block: 4 input rows x 6 weight rows (24 accumulators). Measured on a 2-core
 * EPYC with avx512_bf16 against 2x8, 4x4, 6x4, 3x8 and 5x5 blocks: best at 1, 8, 64 and
 * 256 rows (docs/benchmarks.md). N is split across the OpenMP threads torch also uses.
 */
#include "bf16.h"
#include "rlt_cpu.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))
#define NB 6  /* weight rows per register block */
#define MB 4  /* input rows per register block */
#define MC 64 /* input rows per cache block (bf16, kept in L2) */

int rlt_has_avx512bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}

TARGET static inline float hsum16(__m512 v) {
    __m256 lo = _mm512_castps512_ps256(v);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return hsum(_mm256_add_ps(lo, hi));
}

TARGET static inline __attribute__((always_inline)) void block(const uint16_t *x, int mb,
                                                               const uint16_t *w, int nb, int K,
                                                               uint16_t *y, int ldy) {
    __m512 acc[MB][NB];
    for (int j = 0; j < MB; j++)
        for (int i = 0; i < NB; i++) acc[j][i] = _mm512_setzero_ps();
    int K32 = K & ~31;
    for (int k = 0; k < K32; k += 32) {
        __m512bh xv[MB];
        for (int j = 0; j < mb; j++) xv[j] = (__m512bh)_mm512_loadu_si512(x + (size_t)j * K + k);
        for (int i = 0; i < nb; i++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (size_t)i * K + k);
            for (int j = 0; j < mb; j++) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], xv[j], wv);
        }
    }
    if (K32 < K) { /* the tail: zeros beyond K add nothing */
        __mmask32 m = (__mmask32)((1ull << (K - K32)) - 1);
        __m512bh xv[MB];
        for (int j = 0; j < mb; j++)
            xv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, x + (size_t)j * K + K32);
        for (int i = 0; i < nb; i++) {
            __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + (size_t)i * K + K32);
            for (int j = 0; j < mb; j++) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], xv[j], wv);
        }
    }
    for (int j = 0; j < mb; j++)
        for (int i = 0; i < nb; i++) y[(size_t)j * ldy + i] = f32_to_bf16(hsum16(acc[j][i]));
}

TARGET int rlt_linear_avx512bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int M, int N,
                                 int K) {
    int nblocks = (N + NB - 1) / NB;
    for (int m0 = 0; m0 < M; m0 += MC) {
        int mc = M - m0 < MC ? M - m0 : MC;
#pragma omp parallel for schedule(static)
        for (int b = 0; b < nblocks; b++) {
            int n0 = b * NB, nb = N - n0 < NB ? N - n0 : NB;
            const uint16_t *wb = w + (size_t)n0 * K;
            for (int j0 = 0; j0 < mc; j0 += MB) {
                int mb = mc - j0 < MB ? mc - j0 : MB;
                const uint16_t *xb = x + (size_t)(m0 + j0) * K;
                uint16_t *yb = y + (size_t)(m0 + j0) * N + n0;
                /* Constant block sizes keep the accumulators in registers; the arithmetic
                 * per (m, n) is the same in every branch. */
                if (nb == NB && mb == MB) block(xb, MB, wb, NB, K, yb, N);
                else if (nb == NB && mb == 1) block(xb, 1, wb, NB, K, yb, N);
                else block(xb, mb, wb, nb, K, yb, N);
            }
        }
    }
    return 0;
}

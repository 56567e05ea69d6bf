/* y = x @ w.T for bf16 x [M, K], w [N, K], y [M, N]: fp32 accumulation, AVX2 + FMA.
 *
 * Built and loaded by drivers/cpu/kernels.py. Each output y[m, n] is computed the same
 * way whatever M is and wherever row m falls in the call: one 8-lane fp32 accumulator
 * walked over k in order with FMA, then a fixed horizontal sum, then the scalar tail, then
 * round-to-nearest-even to bf16. So the kernel is row-invariant by construction (the
 * deterministic-mode self-check still verifies it). It is not HF-exact: torch's bf16 GEMM
 * sums in another order.
 *
 * Decode (M of 1 to 8) is bound by reading w once. A register block is 4 weight rows x 2
 * input rows (8 accumulators; a one-row call still runs 4 independent FMA chains), and N is
 * split across the OpenMP threads that torch also uses. (A 2 x 4 block measured the same.)
 */
#include "bf16.h"
#include "rlt_cpu.h"

#define NB 4   /* weight rows per register block */
#define MB 2   /* input rows per register block */
#define MC 32  /* input rows per cache block (fp32, kept in L2) */

/* The tail (K % 8) and the final sum, identical for every (m, n). */
static inline float finish(__m256 acc, const float *x, const uint16_t *w, int k0, int K) {
    float s = hsum(acc);
    for (int k = k0; k < K; k++) s += x[k] * bf16_to_f32(w[k]);
    return s;
}

static inline __attribute__((always_inline)) void block(const float *x, int ldx, int mb, const uint16_t *w, int nb, int K,
                  uint16_t *y, int ldy) {
    __m256 acc[NB][MB];
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < MB; j++) acc[i][j] = _mm256_setzero_ps();
    int K8 = K & ~7;
    for (int k = 0; k < K8; k += 8) {
        __m256 xv[MB];
        for (int j = 0; j < mb; j++) xv[j] = _mm256_loadu_ps(x + (size_t)j * ldx + k);
        for (int i = 0; i < nb; i++) {
            __m256 wv = load_bf16x8(w + (size_t)i * K + k);
            for (int j = 0; j < mb; j++) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++)
            y[(size_t)j * ldy + i] =
                f32_to_bf16(finish(acc[i][j], x + (size_t)j * ldx, w + (size_t)i * K, K8, K));
}

int rlt_linear_avx2(const uint16_t *x, const uint16_t *w, uint16_t *y, int M, int N, int K) {
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
                const uint16_t *wb = w + (size_t)n0 * K;
                /* Constant block sizes let the compiler keep the accumulators in registers;
                 * the arithmetic per (m, n) is the same in every branch. */
                if (nb == NB && mb == MB) block(xb, K, MB, wb, NB, K, yb, N);
                else if (nb == NB && mb == 1) block(xb, K, 1, wb, NB, K, yb, N);
                else block(xb, K, mb, wb, nb, K, yb, N);
            }
        }
    }
    free(xf);
    return 0;
}

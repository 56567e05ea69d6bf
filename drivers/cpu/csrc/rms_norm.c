/* RMSNorm for deterministic mode: y = w * bf16(x * rsqrt(mean(x^2) + eps)), AVX2 + FMA.
 *
 * Built and loaded by drivers/cpu/kernels.py. It keeps Hugging Face's two roundings (the
 * normalised row is rounded to bf16, then multiplied by the bf16 weight and rounded again);
 * only the sum of squares runs in its own fixed order (8-lane fp32 FMA over the row, a fixed
 * horizontal sum, the scalar tail), so each row's bits depend on that row alone. One call
 * replaces the ten torch operations of HF's form.
 */
#include "bf16.h"
#include "rlt_cpu.h"
#include <math.h>

/* x, y: [rows, n] contiguous bf16; w: [n] bf16. */
void rlt_rms_norm(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int n, float eps) {
#pragma omp parallel for schedule(static) if (rows >= 8)
    for (int r = 0; r < rows; r++) {
        const uint16_t *xr = x + (size_t)r * n;
        uint16_t *yr = y + (size_t)r * n;
        __m256 acc = _mm256_setzero_ps();
        int n8 = n & ~7;
        for (int i = 0; i < n8; i += 8) {
            __m256 v = load_bf16x8(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum(acc);
        for (int i = n8; i < n; i++) ss += bf16_to_f32(xr[i]) * bf16_to_f32(xr[i]);
        float scale = 1.0f / sqrtf(ss / (float)n + eps);
        for (int i = 0; i < n; i++) {
            float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[i]) * scale));
            yr[i] = f32_to_bf16(bf16_to_f32(w[i]) * normed);
        }
    }
}

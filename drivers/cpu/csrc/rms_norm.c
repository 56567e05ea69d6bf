/* RMSNorm for deterministic mode: y = w * bf16(x * rsqrt(mean(x^2) + eps)), AVX2 + FMA.
 *
 * Built and loaded by drivers/cpu/kernels.py. It keeps Hugging Face's two roundings (the
 * normalised row is rounded to bf16, then multiplied by the bf16 weight and rounded again);
 * only the sum of squares runs in its own fixed order (8-lane fp32 FMA over the row, a fixed
 * horizontal sum, the scalar tail), so each row's bits depend on that row alone. One call
 * replaces the ten torch operations of HF's form.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline __m256 load_bf16x8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
    return _mm_cvtss_f32(s);
}

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

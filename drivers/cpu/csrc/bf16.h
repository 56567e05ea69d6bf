/* bf16 <-> fp32 and AVX2 helpers shared by the cpu driver's kernels. */
#ifndef RLT_BF16_H
#define RLT_BF16_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Eight bf16 values widened to fp32 (exact: bf16 is the top half of an fp32). */
static inline __m256 load_bf16x8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The eight lanes summed in one fixed order. */
static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);                 /* lanes i + i+4 */
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));        /* (0+4)+(2+6), (1+5)+(3+7) */
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55)); /* + the other pair */
    return _mm_cvtss_f32(s);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's .to(torch.bfloat16) does. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* x [M, K] bf16 widened to a new fp32 buffer (the caller frees it), or NULL. */
static inline float *widen_rows(const uint16_t *x, int M, int K) {
    float *xf = malloc((size_t)M * K * sizeof(float));
    if (xf)
        for (size_t i = 0; i < (size_t)M * K; i++) xf[i] = bf16_to_f32(x[i]);
    return xf;
}

#endif

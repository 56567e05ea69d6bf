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

/* Eight fp32 values rounded to bf16 as f32_to_bf16 rounds them (NaN
 * included), kept as fp32. */
static inline __m256 round_bf16x8(__m256 v) {
    __m256i u = _mm256_castps_si256(v), hi = _mm256_set1_epi32((int)0xffff0000u);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), hi);
    __m256i quiet = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)), hi);
    __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(quiet), nan);
}

/* Eight rounded values (bf16 in the upper halves) stored as bf16. */
static inline void store_bf16x8(uint16_t *p, __m256 rounded) {
    __m256i u = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
    __m128i lo = _mm256_castsi256_si128(u), hi = _mm256_extracti128_si256(u, 1);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(lo, hi));
}

/* x [M, K] bf16 widened to a new fp32 buffer (the caller frees it), or NULL. */
static inline float *widen_rows(const uint16_t *x, int M, int K) {
    float *xf = malloc((size_t)M * K * sizeof(float));
    if (xf)
        for (size_t i = 0; i < (size_t)M * K; i++) xf[i] = bf16_to_f32(x[i]);
    return xf;
}

#endif

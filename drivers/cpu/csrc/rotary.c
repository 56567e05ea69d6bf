/* Hugging Face's apply_rotary_pos_emb (NeoX rotate_half) on one step's queries and keys, with
 * its three bf16 roundings: out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), where
 * rotate_half(x) = [-x2, x1] (the sign flipped, exactly). Each product of two bf16 values is exact in fp32 and the sum is
 * rounded to fp32 and then to bf16, as torch's bf16 elementwise ops compute, so the result has
 * HF's bits (the conformance kit checks it against the torch form), and each element's bits
 * depend on its own inputs alone. One call replaces the dozen torch operations of HF's form.
 *
 * Built with the other kernels by drivers/cpu/kernels.py.
 */
#include "bf16.h"
#include "rlt_cpu.h"

static inline float rounded(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* One head vector x (d values) into y. */
static void rotate(const uint16_t *x, const uint16_t *c, const uint16_t *s, uint16_t *y, int d) {
    int half = d / 2, h8 = half & ~7;
    for (int i = 0; i < h8; i += 8) {
        __m256 x1 = load_bf16x8(x + i), x2 = load_bf16x8(x + half + i);
        __m256 a = round_bf16x8(_mm256_mul_ps(x1, load_bf16x8(c + i)));
        __m256 b = round_bf16x8(_mm256_mul_ps(_mm256_xor_ps(x2, _mm256_set1_ps(-0.0f)), load_bf16x8(s + i)));
        store_bf16x8(y + i, round_bf16x8(_mm256_add_ps(a, b)));
        a = round_bf16x8(_mm256_mul_ps(x2, load_bf16x8(c + half + i)));
        b = round_bf16x8(_mm256_mul_ps(x1, load_bf16x8(s + half + i)));
        store_bf16x8(y + half + i, round_bf16x8(_mm256_add_ps(a, b)));
    }
    for (int i = h8; i < half; i++) {
        float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[half + i]);
        float a = rounded(x1 * bf16_to_f32(c[i])), b = rounded(-x2 * bf16_to_f32(s[i]));
        y[i] = f32_to_bf16(a + b);
        a = rounded(x2 * bf16_to_f32(c[half + i]));
        b = rounded(x1 * bf16_to_f32(s[half + i]));
        y[half + i] = f32_to_bf16(a + b);
    }
}

void rlt_rotary(const uint16_t *q, long q_row, const uint16_t *k, long k_row, const uint16_t *cos,
                const uint16_t *sin, long cs_row, uint16_t *qo, uint16_t *ko, int n, int hq,
                int hk, int d) {
#pragma omp parallel for schedule(static) if (n >= 16)
    for (int r = 0; r < n; r++) {
        const uint16_t *c = cos + r * cs_row, *s = sin + r * cs_row;
        for (int h = 0; h < hq; h++)
            rotate(q + r * q_row + (long)h * d, c, s, qo + ((long)r * hq + h) * d, d);
        for (int h = 0; h < hk; h++)
            rotate(k + r * k_row + (long)h * d, c, s, ko + ((long)r * hk + h) * d, d);
    }
}

/* The MLP's activation, as Hugging Face rounds it: y = bf16(bf16(silu(gate)) * up), AVX2.
 *
 * Built with the other kernels by drivers/cpu/kernels.py. torch computes silu with a
 * vectorised exp for most elements and a scalar one for a loop's remainder, so an element's
 * bits can depend on where it falls in a call. Here every element goes through the same
 * eight-lane code (a remainder is padded to eight lanes), so its bits depend on its value
 * alone. exp is Cephes' single-precision polynomial (about 1 ulp): not torch's bits, so the
 * kernel is not HF-exact, but well inside one bf16 rounding.
 */
#include "bf16.h"
#include "rlt_cpu.h"

static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* Eight elements: bf16(bf16(g / (1 + exp(-g))) * u). */
static inline void silu_mul8(const uint16_t *g, const uint16_t *u, uint16_t *y) {
    __m256 gv = load_bf16x8(g), uv = load_bf16x8(u);
    __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
    store_bf16x8(y, round_bf16x8(_mm256_mul_ps(round_bf16x8(s), uv)));
}

void rlt_silu_mul(const uint16_t *gate, const uint16_t *up, long ld, uint16_t *y, int rows,
                  int cols) {
#pragma omp parallel for schedule(static) if ((long)rows * cols >= 65536)
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = gate + r * ld, *u = up + r * ld;
        uint16_t *yr = y + (long)r * cols;
        int c8 = cols & ~7;
        for (int c = 0; c < c8; c += 8) silu_mul8(g + c, u + c, yr + c);
        if (c8 < cols) {
            uint16_t gp[8] = {0}, upad[8] = {0}, yp[8];
            memcpy(gp, g + c8, sizeof(uint16_t) * (cols - c8));
            memcpy(upad, u + c8, sizeof(uint16_t) * (cols - c8));
            silu_mul8(gp, upad, yp);
            memcpy(yr + c8, yp, sizeof(uint16_t) * (cols - c8));
        }
    }
}

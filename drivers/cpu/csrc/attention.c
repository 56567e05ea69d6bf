/* Deterministic-mode attention over one plane of the paged KV cache: fp32, AVX2 + FMA.
 *
 * Built and loaded by drivers/cpu/kernels.py. Query row r (bf16, heads x d) attends to the
 * first len[r] slots of its request's slot list (slots + off[r]), that is exactly positions
 * 0..p of its own context, read straight from the bf16 cache. Each (row, query head) is
 * computed alone, in a fixed order that depends on nothing but the row's own length:
 *   s_t = (q * scaling) . k_t     8-lane fp32 FMA over d, fixed horizontal sum, scalar tail
 *   p_t = exp(s_t - max s) / sum  sums in position order
 *   o   = sum_t p_t v_t           fp32 FMA in position order, rounded to bf16 once
 * so a row's bits are the same whether it arrives in a 256-row prefill chunk, alone, or in a
 * batch with other requests (row invariance, as deterministic mode requires). Rows x KV heads
 * are split over the OpenMP threads; query heads sharing a KV head (GQA) read each K/V row once.
 */
#include "bf16.h"
#include "rlt_cpu.h"
#include <math.h>
#include <stdlib.h>

/* q (fp32, d) . k (bf16, d) */
static inline float dot(const float *q, const uint16_t *k, int d) {
    __m256 acc = _mm256_setzero_ps();
    int d8 = d & ~7;
    for (int i = 0; i < d8; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_bf16x8(k + i), acc);
    float s = hsum(acc);
    for (int i = d8; i < d; i++) s += q[i] * bf16_to_f32(k[i]);
    return s;
}

/* o (fp32, d) += p * v (bf16, d) */
static inline void axpy(float *o, float p, const uint16_t *v, int d) {
    __m256 pv = _mm256_set1_ps(p);
    int d8 = d & ~7;
    for (int i = 0; i < d8; i += 8)
        _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pv, load_bf16x8(v + i), _mm256_loadu_ps(o + i)));
    for (int i = d8; i < d; i++) o[i] += p * bf16_to_f32(v[i]);
}

/* q: row r, head h at q + r * q_row + h * q_head (d contiguous elements).
 * k, v: one plane, [slots, kv_heads, d] contiguous. out: [rows, heads, d] contiguous.
 * Returns 0, or -1 when scratch memory cannot be allocated. */
int rlt_paged_attention(const uint16_t *q, long q_row, long q_head, const uint16_t *k,
                        const uint16_t *v, const int64_t *slots, const int64_t *off,
                        const int64_t *len, uint16_t *out, int rows, int heads, int kv_heads,
                        int d, float scaling) {
    int n_rep = heads / kv_heads, failed = 0;
#pragma omp parallel for schedule(static)
    for (long task = 0; task < (long)rows * kv_heads; task++) {
        int r = (int)(task / kv_heads), g = (int)(task % kv_heads);
        long n = len[r];
        const int64_t *sl = slots + off[r];
        /* per query head of the group: q (d), o (d), scores (n) */
        float *buf = malloc(sizeof(float) * (size_t)n_rep * (2 * (size_t)d + (size_t)n));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float *qf = buf, *of = buf + (size_t)n_rep * d, *sc = buf + (size_t)n_rep * 2 * d;
        for (int j = 0; j < n_rep; j++) {
            const uint16_t *qr = q + r * q_row + (long)(g * n_rep + j) * q_head;
            for (int i = 0; i < d; i++) qf[j * d + i] = bf16_to_f32(qr[i]) * scaling;
            memset(of + (size_t)j * d, 0, sizeof(float) * d);
        }
        for (long t = 0; t < n; t++) {
            const uint16_t *kr = k + (sl[t] * kv_heads + g) * d;
            for (int j = 0; j < n_rep; j++) sc[j * n + t] = dot(qf + j * d, kr, d);
        }
        for (int j = 0; j < n_rep; j++) {
            float *s = sc + j * n, m = -INFINITY, sum = 0.0f;
            for (long t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
            for (long t = 0; t < n; t++) sum += (s[t] = expf(s[t] - m));
            for (long t = 0; t < n; t++) s[t] /= sum;
        }
        for (long t = 0; t < n; t++) {
            const uint16_t *vr = v + (sl[t] * kv_heads + g) * d;
            for (int j = 0; j < n_rep; j++) axpy(of + j * d, sc[j * n + t], vr, d);
        }
        for (int j = 0; j < n_rep; j++) {
            uint16_t *o = out + ((long)r * heads + g * n_rep + j) * d;
            for (int i = 0; i < d; i++) o[i] = f32_to_bf16(of[j * d + i]);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

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
 * batch with other requests (row invariance, as deterministic mode requires). Rows and runs
 * of KV heads are split over the OpenMP threads; query heads sharing a KV head (GQA) read each
 * K/V row once.
 */
#include "bf16.h"
#include "rlt_cpu.h"
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#define AHEAD 4 /* positions a task's K/V rows are fetched before they are read */

/* bytes from p into the cache, a line at a time */
static inline void fetch(const uint16_t *p, long bytes) {
    for (long i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T0);
}

/* q (fp32, d) . k (bf16, d) */
static inline float dot(const float *q, const uint16_t *k, int d) {
    __m256 acc = _mm256_setzero_ps();
    int d8 = d & ~7;
    for (int i = 0; i < d8; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_bf16x8(k + i), acc);
    float s = hsum(acc);
    for (int i = d8; i < d; i++) s += q[i] * bf16_to_f32(k[i]);
    return s;
}

/* dot() of four queries with their keys, interleaved: each sum in dot()'s order, so the same
 * bits, but four independent FMA chains instead of one. */
static inline void dot4(const float *q, int qs, const uint16_t *k, int ks, int d, float *s, int ss) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int d8 = d & ~7;
    for (int i = 0; i < d8; i += 8) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_bf16x8(k + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + qs + i), load_bf16x8(k + ks + i), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * qs + i), load_bf16x8(k + 2 * ks + i), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 3 * qs + i), load_bf16x8(k + 3 * ks + i), a3);
    }
    float r[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
    for (int h = 0; h < 4; h++) {
        for (int i = d8; i < d; i++) r[h] += q[h * qs + i] * bf16_to_f32(k[h * ks + i]);
        s[h * ss] = r[h];
    }
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
 * A task is one row and a run of its KV heads: at each position it reads the run's K/V
 * vectors, which lie side by side (one head alone would jump kv_heads * d values a position),
 * and asks for those AHEAD positions on (a position's run lies a page or more from the next:
 * the hardware prefetcher does not cross). How heads are grouped into tasks (so that every
 * thread has one when a step has few rows) changes no head's arithmetic.
 * Returns 0, or -1 when scratch memory cannot be allocated. */
int rlt_paged_attention(const uint16_t *q, long q_row, long q_head, const uint16_t *k,
                        const uint16_t *v, const int64_t *slots, const int64_t *off,
                        const int64_t *len, uint16_t *out, int rows, int heads, int kv_heads,
                        int d, float scaling) {
    int n_rep = heads / kv_heads, failed = 0;
    int threads = omp_get_max_threads(), runs = 1;
    while (runs < kv_heads && (long)rows * runs < threads) runs *= 2;
    int per = (kv_heads + runs - 1) / runs; /* KV heads a task */
    runs = (kv_heads + per - 1) / per;
#pragma omp parallel for schedule(static)
    for (long task = 0; task < (long)rows * runs; task++) {
        int r = (int)(task / runs), g0 = (int)(task % runs) * per;
        int ng = kv_heads - g0 < per ? kv_heads - g0 : per, nq = ng * n_rep;
        long n = len[r];
        const int64_t *sl = slots + off[r];
        /* per query head of the run: q (d), o (d), scores (n) */
        float *buf = malloc(sizeof(float) * (size_t)nq * (2 * (size_t)d + (size_t)n));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float *qf = buf, *of = buf + (size_t)nq * d, *sc = buf + (size_t)nq * 2 * d;
        for (int j = 0; j < nq; j++) {
            const uint16_t *qr = q + r * q_row + (long)(g0 * n_rep + j) * q_head;
            for (int i = 0; i < d; i++) qf[j * d + i] = bf16_to_f32(qr[i]) * scaling;
            memset(of + (size_t)j * d, 0, sizeof(float) * d);
        }
        long run = (long)ng * d * 2; /* bytes of the run's K (V) at one position */
        for (long t = 0; t < n && t < AHEAD; t++) fetch(k + (sl[t] * kv_heads + g0) * d, run);
        for (long t = 0; t < n; t++) {
            const uint16_t *kr = k + (sl[t] * kv_heads + g0) * d;
            long ahead = t + AHEAD; /* then the first V rows, read next */
            if (ahead < n) fetch(k + (sl[ahead] * kv_heads + g0) * d, run);
            else if (ahead - n < n) fetch(v + (sl[ahead - n] * kv_heads + g0) * d, run);
            int j = 0;
            if (n_rep == 1)  /* four heads at once: their keys lie side by side */
                for (; j + 4 <= nq; j += 4) dot4(qf + j * d, d, kr + j * d, d, d, sc + j * n + t, (int)n);
            for (; j < nq; j++) sc[j * n + t] = dot(qf + j * d, kr + (j / n_rep) * d, d);
        }
        for (int j = 0; j < nq; j++) {
            float *s = sc + j * n, m = -INFINITY, sum = 0.0f;
            for (long t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
            for (long t = 0; t < n; t++) sum += (s[t] = expf(s[t] - m));
            for (long t = 0; t < n; t++) s[t] /= sum;
        }
        for (long t = 0; t < n; t++) {
            const uint16_t *vr = v + (sl[t] * kv_heads + g0) * d;
            if (t + AHEAD < n) fetch(v + (sl[t + AHEAD] * kv_heads + g0) * d, run);
            for (int j = 0; j < nq; j++) axpy(of + j * d, sc[j * n + t], vr + (j / n_rep) * d, d);
        }
        for (int j = 0; j < nq; j++) {
            uint16_t *o = out + ((long)r * heads + g0 * n_rep + j) * d;
            for (int i = 0; i < d; i++) o[i] = f32_to_bf16(of[j * d + i]);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* A step's K/V rows into one plane of the paged cache: row r of key and value (kv_heads * d
 * contiguous values, rows k_row and v_row apart) to slot slots[r] of the plane, in row order
 * (a slot named twice keeps the later row, as the reference's index_put_ does on cpu).
 * Returns 0, or -1 (writing nothing) when a slot lies outside [0, limit). */
int rlt_write_kv(const uint16_t *key, long k_row, const uint16_t *value, long v_row,
                 const int64_t *slots, int rows, uint16_t *k_cache, uint16_t *v_cache,
                 long limit, int width) {
    for (int r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= limit) return -1;
    size_t bytes = (size_t)width * sizeof(uint16_t);
    for (int r = 0; r < rows; r++) {
        memcpy(k_cache + slots[r] * width, key + r * k_row, bytes);
        memcpy(v_cache + slots[r] * width, value + r * v_row, bytes);
    }
    return 0;
}

/* The cpu driver's kernels: the one declaration of their C interface.
 *
 * The compiler checks every definition against it (each source includes this file), and
 * drivers/cpu/kernels.py hands the same text to cffi, so the signatures are written once.
 * Keep it to plain prototypes: cffi parses it without a preprocessor (lines starting with
 * '#' are dropped before cffi reads it).
 *
 * Tensors are bf16 passed as uint16_t (quantized weights: int8_t or packed uint8_t, in
 * hal/quant.py's layout), row-major and contiguous unless a stride is given.
 * Functions that allocate scratch memory return 0, or -1 when it cannot be allocated.
 */
#ifndef RLT_CPU_H
#define RLT_CPU_H
#include <stdint.h>

/* y [M, N] = x [M, K] @ w [N, K]^T, fp32 sums, AVX2 + FMA. */
int rlt_linear_avx2(const uint16_t *x, const uint16_t *w, uint16_t *y, int M, int N, int K);

/* The same with AVX-512 BF16 dot products (vdpbf16ps): only where rlt_has_avx512bf16(). */
int rlt_linear_avx512bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int M, int N, int K);
int rlt_has_avx512bf16(void);

/* Weight-only quantized projections (hal/quant.py's layout), x and y bf16, fp32 sums, AVX2 +
 * FMA. int8: w int8 [N, K], scale bf16 [N]. int4: w uint8 [N, K / 2] (two inputs a byte),
 * scale bf16 [N, K / group], K a multiple of 32 and of group. */
int rlt_linear_int8_avx2(const uint16_t *x, const int8_t *w, const uint16_t *scale, uint16_t *y,
                         int M, int N, int K);
int rlt_linear_int4_avx2(const uint16_t *x, const uint8_t *w, const uint16_t *scale, uint16_t *y,
                         int M, int N, int K, int group);

/* The same with x quantized per block of 32 (llama.cpp's Q8_0 activations) and int8 dot
 * products: W8A8 and W4A8 (see linear_a8_avx2.c). full: the int8 weight may hold -128. */
int rlt_linear_int8_a8_avx2(const uint16_t *x, const int8_t *w, const uint16_t *scale, uint16_t *y,
                            int M, int N, int K, int full);
/* W4A8 on int4 repacked eight rows at a time (see linear_a8_avx2.c): w8 uint8 [N8 / 8, K / 32,
 * 8, 16], s8 bf16 [N8 / 8, K / group, 8], N8 = N rounded up to 8. */
int rlt_linear_int4_a8_avx2(const uint16_t *x, const uint8_t *w8, const uint16_t *s8,
                             uint16_t *y, int M, int N, int K, int group);
/* int8 with one scale per group of inputs (int8g: scale bf16 [N, K / group]). */
int rlt_linear_int8g_avx2(const uint16_t *x, const int8_t *w, const uint16_t *scale, uint16_t *y,
                          int M, int N, int K, int group);
int rlt_linear_int8g_a8_avx2(const uint16_t *x, const int8_t *w, const uint16_t *scale,
                             uint16_t *y, int M, int N, int K, int group, int full);
/* W8A8 dynamic (vllm-ascend's): x quantized per row with one scale, exact int32 sums, then
 * y = bf16((float(acc) * scale[n]) * d[m]) (hal.quant.token_linear); K below 132104. */
int rlt_linear_int8_token_avx2(const uint16_t *x, const int8_t *w, const uint16_t *scale,
                               uint16_t *y, int M, int N, int K, int full);
/* The four W8A8 / W4A8 kernels above with AVX512-VNNI dot products (linear_a8_vnni.c): the
 * same arguments, the same bits; only where rlt_has_avx512vnni(). */
int rlt_has_avx512vnni(void);
int rlt_linear_int8_a8_vnni(const uint16_t *x, const int8_t *w, const uint16_t *scale, uint16_t *y,
                            int M, int N, int K, int full);
int rlt_linear_int4_a8_vnni(const uint16_t *x, const uint8_t *w8, const uint16_t *s8,
                             uint16_t *y, int M, int N, int K, int group);
int rlt_linear_int8g_a8_vnni(const uint16_t *x, const int8_t *w, const uint16_t *scale,
                             uint16_t *y, int M, int N, int K, int group, int full);
int rlt_linear_int8_token_vnni(const uint16_t *x, const int8_t *w, const uint16_t *scale,
                               uint16_t *y, int M, int N, int K, int full);

/* Deterministic attention over one plane of the paged cache (see attention.c). */
int rlt_paged_attention(const uint16_t *q, long q_row, long q_head, const uint16_t *k,
                        const uint16_t *v, const int64_t *slots, const int64_t *off,
                        const int64_t *len, uint16_t *out, int rows, int heads, int kv_heads,
                        int d, float scaling);

/* A step's K/V rows (width = kv_heads * d values each) into slots of one plane of the paged
 * cache ([limit, width] from the plane on); -1 when a slot lies outside it (see attention.c). */
int rlt_write_kv(const uint16_t *key, long k_row, const uint16_t *value, long v_row,
                 const int64_t *slots, int rows, uint16_t *k_cache, uint16_t *v_cache,
                 long limit, int width);

/* HF's rotary embedding (see rotary.c): q [n, hq, d] and k [n, hk, d], rows q_row and k_row
 * elements apart (heads contiguous), cos and sin [n, d] rows cs_row apart, into contiguous qo
 * [n, hq, d] and ko [n, hk, d]; d even. */
void rlt_rotary(const uint16_t *q, long q_row, const uint16_t *k, long k_row, const uint16_t *cos,
                const uint16_t *sin, long cs_row, uint16_t *qo, uint16_t *ko, int n, int hq,
                int hk, int d);

/* HF's RMSNorm over rows of n: y = w * bf16(x * rsqrt(mean(x^2) + eps)). */
void rlt_rms_norm(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int n, float eps);

/* y [rows, cols] = bf16(bf16(silu(gate)) * up); gate and up rows are ld elements apart. */
void rlt_silu_mul(const uint16_t *gate, const uint16_t *up, long ld, uint16_t *y, int rows,
                  int cols);

#endif

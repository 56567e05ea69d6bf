/* linear_a8_avx2.c's W8A8 / W4A8 kernels with AVX512-VNNI dot products: the same source
 * built again with RLT_A8_VNNI (exported as rlt_*_vnni), vpdpbusd on 256-bit registers
 * (AVX512-VL) in place of vpmaddubsw + vpmaddwd. Each block's int32 lanes are the same exact
 * integers, so every output has the AVX2 kernels' bits; the cpu driver offers these only where
 * the CPU has avx512_vnni and avx512_vl (rlt_has_avx512vnni). Its W4A8 kernel also reads two
 * octets far apart at once (octet4_two: two weight streams a thread, which its 32 vector
 * registers hold), 20 GB/s where one stream read 16-18 on a 2-core AVX-512 Xeon; its W8A8
 * kernels read rows n and n + N/2 together (row8_two): 15-16 GB/s where one stream read 14. */
#include <immintrin.h>

int rlt_has_avx512vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw");
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")
#define RLT_A8_VNNI 1
#include "linear_a8_avx2.c"
#pragma GCC pop_options

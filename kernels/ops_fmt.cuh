/*
 * ops_fmt.cuh — the number formats of the cuda backend's kernels (bf16 and
 * e4m3 from float, bf16 to float), bit-identical to kernels/host_ops.c's, so
 * that a job's output is the same on either backend.  ops_dev.cuh includes it.
 */
#ifndef DEP_OPS_FMT_CUH
#define DEP_OPS_FMT_CUH

#include <stdint.h>

__device__ __forceinline__ float bf2f(uint32_t b) { return __uint_as_float((b & 0xffffu) << 16); }

__device__ __forceinline__ uint32_t f2bf(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return ((u >> 16) | 0x40u) & 0xffffu;
  u += 0x7fffu + ((u >> 16) & 1u);
  return u >> 16;
}

__device__ __forceinline__ uint32_t f2e4m3(float f) {
  uint32_t u = __float_as_uint(f);
  uint32_t sign = (u >> 24) & 0x80u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u)
    return sign | 0x7fu;
  if (a >= 0x43e00000u)
    return sign | 0x7eu;
  if (a < 0x3c800000u) {
    if (a < 0x00800000u)
      return sign;
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    int e = (int)(a >> 23) - 127;
    unsigned shift = (unsigned)(14 - e);
    if (shift > 25)
      return sign;
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u)))
      q++;
    return sign | q;
  }
  uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  uint32_t code = r - (120u << 3);
  return sign | (code > 0x7eu ? 0x7eu : code);
}

#endif /* DEP_OPS_FMT_CUH */

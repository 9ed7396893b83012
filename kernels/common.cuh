/*
 * common.cuh — helpers shared by the kernels: the 16-bit activation types and their
 * conversions, warp/block reductions in a fixed order, asynchronous copies into shared memory,
 * and the dispatch from a precision code to a template instantiation.
 *
 * Determinism: every reduction here combines values in an order fixed by thread indices
 * (shuffle trees, then warps in index order); nothing uses floating-point atomics, so the
 * same inputs give the same bits on every run.
 */
#ifndef M3_KERNELS_COMMON_CUH
#define M3_KERNELS_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "m3_kernels.h"

typedef __nv_bfloat16 bf16;
typedef __half f16;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(f16 x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ f16 from_f<f16>(float x) { return __float2half_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/* Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
 * red holds 32 values; the call ends with a barrier so red can be reused at once. */
template <typename V> __device__ __forceinline__ V block_sum(V v, V *red) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) red[w] = v;
  __syncthreads();
  V t = 0;
  for (int i = 0; i < nw; i++) t += red[i];
  __syncthreads();
  return t;
}

__device__ __forceinline__ float sigmoidf_(float v) { return 1.0f / (1.0f + expf(-v)); }

/* Asynchronous copies global -> shared (cp.async; sm_80+): cp16 moves 16 bytes (both addresses
 * 16-byte aligned), cp4 4 bytes. They complete at cp_wait_all() (every copy of the thread) or
 * cp_wait_prev() (all but the last cp_commit() group); a barrier then publishes them to the block. */
__device__ __forceinline__ void cp16(void *dst, const void *src) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp4(void *dst, const void *src) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_wait_prev() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

static inline unsigned grid_for(int64_t n, int threads) {
  int64_t b = (n + threads - 1) / threads;
  return (unsigned)(b < 1 ? 1 : b);
}

/* Calls body<T>() with T the activation type of `prec`. */
#define M3K_DISPATCH(prec, body)            \
  do {                                      \
    switch (prec) {                         \
      case M3K_BF16: { typedef bf16 T; body; } break; \
      case M3K_F16: { typedef f16 T; body; } break;   \
      default: { typedef float T; body; } break;      \
    }                                       \
  } while (0)

#endif

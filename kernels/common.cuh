/*
 * common.cuh — helpers shared by the kernels: the 16-bit activation types and their
 * conversions, warp/block reductions in a fixed order, asynchronous and bulk (TMA) copies between
 * global and shared memory, and the dispatch from a precision code to a template instantiation.
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

/* V (1, 2 or 4) consecutive values at p (float32 or 16-bit) to or from float32 registers: one vector access
 * when V is 2 or 4 (p then aligned to V elements). */
template <int V, typename T> __device__ __forceinline__ void ld_v(const T *p, float (&v)[V]) {
  if constexpr (V == 4 && sizeof(T) == 4) {
    const float4 t = *(const float4 *)p;
    v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
  } else if constexpr (V == 4) {
    const uint2 u = *(const uint2 *)p;
    const T *t = (const T *)&u;
    for (int k = 0; k < 4; k++) v[k] = to_f(t[k]);
  } else if constexpr (V == 2 && sizeof(T) == 4) {
    const float2 t = *(const float2 *)p;
    v[0] = t.x, v[1] = t.y;
  } else if constexpr (V == 2) {
    const unsigned u = *(const unsigned *)p;
    const T *t = (const T *)&u;
    v[0] = to_f(t[0]), v[1] = to_f(t[1]);
  } else {
    for (int k = 0; k < V; k++) v[k] = to_f(p[k]);
  }
}
template <int V, typename T> __device__ __forceinline__ void st_v(T *p, const float (&v)[V]) {
  if constexpr (V == 4 && sizeof(T) == 4) {
    *(float4 *)p = make_float4(v[0], v[1], v[2], v[3]);
  } else if constexpr (V == 4) {
    const T t[4] = {from_f<T>(v[0]), from_f<T>(v[1]), from_f<T>(v[2]), from_f<T>(v[3])};
    *(uint2 *)p = *(const uint2 *)t;
  } else if constexpr (V == 2 && sizeof(T) == 4) {
    *(float2 *)p = make_float2(v[0], v[1]);
  } else if constexpr (V == 2) {
    const T t[2] = {from_f<T>(v[0]), from_f<T>(v[1])};
    *(unsigned *)p = *(const unsigned *)t;
  } else {
    for (int k = 0; k < V; k++) p[k] = from_f<T>(v[k]);
  }
}

/* Eight 16-bit values (16-byte aligned) to and from float32: ld8 by the read-only path (global memory the
 * kernel does not write), st8 with one 16-byte store (two for float32 values, 32-byte aligned). */
template <typename T> __device__ __forceinline__ void ld8(const T *p, float *v) {
  const uint4 r = __ldg((const uint4 *)p);
  const T *e = (const T *)&r;
#pragma unroll
  for (int k = 0; k < 8; k++) v[k] = to_f(e[k]);
}
template <typename T> __device__ __forceinline__ void st8(T *p, const float *v) {
  if constexpr (sizeof(T) == 4) {
    ((float4 *)p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    ((float4 *)p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint4 r;
    T *e = (T *)&r;
#pragma unroll
    for (int k = 0; k < 8; k++) e[k] = from_f<T>(v[k]);
    *(uint4 *)p = r;
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/* 1 / RMS (eps 1e-5): rms_inv from the float32 sum of squares ss of n values; warp_rstd of x [n] in every
 * lane of the warp: each lane sums the squares of its elements lane, lane + 32, ..., then warp_sum. Every
 * RMSNorm of the kernels sums this way, so a fused kernel reproduces the unfused one's rstd bitwise. */
__device__ __forceinline__ float rms_inv(float ss, int n) { return 1.0f / sqrtf(ss / (float)n + 1e-5f); }
template <typename V> __device__ __forceinline__ float warp_rstd(const V *x, int n) {
  float ss = 0;
  for (int j = threadIdx.x & 31; j < n; j += 32) {
    const float v = to_f(x[j]);
    ss += v * v;
  }
  ss = warp_sum(ss);
  return rms_inv(ss, n);
}

/* Column sums in a fixed order (reduce.cu's m3k_colsum, and the kernels that take its chunks in their CTAs):
 * rows are cut into chunks of COLSUM_CHUNK; a CTA of COLSUM_WARPS warps sums one chunk for 32 columns
 * (lane = column), warp w the rows of its slice in order (COLSUM_SLICE rows; a short chunk's rows split
 * evenly, so that no warp walks them alone: NOTES.md runs 231-233), then warp 0 the warps' sums in warp order. */
enum { COLSUM_CHUNK = 256, COLSUM_WARPS = 8, COLSUM_SLICE = COLSUM_CHUNK / COLSUM_WARPS };

/* The CTA's sum of the chunk of rows from chunk_row0 (up to rows) for the lane's column; value(r) is row
 * r's entry, read only where col_ok. Every thread of the CTA calls it; the sum is valid in warp 0. */
template <typename F>
__device__ __forceinline__ float colsum_chunk(F value, int64_t chunk_row0, int64_t rows, bool col_ok) {
  __shared__ float part[COLSUM_WARPS][32];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t len = rows - chunk_row0 < COLSUM_CHUNK ? rows - chunk_row0 : COLSUM_CHUNK;
  const int64_t slice = (len + COLSUM_WARPS - 1) / COLSUM_WARPS; /* COLSUM_SLICE but in a short chunk */
  const int64_t r0 = chunk_row0 + (int64_t)w * slice;
  const int64_t r1 = r0 + slice < chunk_row0 + len ? r0 + slice : chunk_row0 + len;
  float acc = 0;
  if (col_ok) {
#pragma unroll COLSUM_SLICE /* every row's loads in flight */
    for (int64_t r = r0; r < r1; r++) acc += value(r);
  }
  part[w][lane] = acc;
  __syncthreads();
  if (w == 0)
    for (int k = 1; k < COLSUM_WARPS; k++) acc += part[k][lane];
  return acc;
}

/* Where column j of a column-sum job adds its sum */
__device__ __forceinline__ float *colsum_dst(const m3k_colsum_job &job, int32_t j) {
  return j < job.split ? job.dst + j : job.dst_hi + (j - job.split);
}

/* A job's sum for CTA c's 32 columns (lane = column) over the chunk of rows from chunk_row0: valid in
 * warp 0; every thread of the CTA calls it. */
__device__ __forceinline__ float colsum_job_chunk(const m3k_colsum_job &job, unsigned c, int64_t chunk_row0,
                                                  int64_t rows) {
  const int32_t j = (int32_t)c * 32 + (threadIdx.x & 31);
  return colsum_chunk([&](int64_t r) { return job.src[r * job.ld + j]; }, chunk_row0, rows, j < job.cols);
}

/* Chunks of COLSUM_CHUNK rows over `rows` rows (m3k_colsum_chunks) */
__host__ __device__ inline int64_t colsum_chunks(int64_t rows) { return (rows + COLSUM_CHUNK - 1) / COLSUM_CHUNK; }

/* Where chunk `chunk`'s sum acc (valid in warp 0) of column j goes: added to the job's destination when
 * the rows fit one chunk, else into partials[chunk, j] for the final pass. Every thread may call it. */
__device__ __forceinline__ void colsum_put(const m3k_colsum_job &job, int64_t chunk, int64_t rows, int32_t j,
                                           float acc) {
  if ((threadIdx.x >> 5) != 0 || j >= job.cols) return;
  if (colsum_chunks(rows) <= 1)
    *colsum_dst(job, j) += acc;
  else
    job.partials[chunk * job.cols + j] = acc;
}

/* A job's chunk sums: CTA c of col_ctas * chunks, 32 columns of one chunk (the column block varies fastest) */
__device__ __forceinline__ void colsum_job_cta(const m3k_colsum_job &job, unsigned c, int64_t rows) {
  const unsigned col_ctas = (unsigned)(job.cols + 31) / 32, cb = c % col_ctas;
  const int64_t chunk = c / col_ctas;
  const float acc = colsum_job_chunk(job, cb, chunk * COLSUM_CHUNK, rows);
  colsum_put(job, chunk, rows, (int32_t)cb * 32 + (threadIdx.x & 31), acc);
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
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

/* silu(z) = z sigmoid(z) and its derivative sigmoid(z) (1 + z (1 - sigmoid(z))), for the gate's backward */
__device__ __forceinline__ void silu_and_grad(float z, float &silu, float &dsilu) {
  const float sg = sigmoidf_(z);
  silu = z * sg;
  dsilu = sg * (1 + z * (1 - sg));
}

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

/* Bulk copies on the tensor memory accelerator (sm_90): one thread moves a contiguous block of
 * `bytes` (a multiple of 16, both addresses 16-byte aligned) with one instruction, streamed (L2
 * evict-first: every byte moves once). Into shared memory: bar_init once (by the issuing thread),
 * bulk_load arms the barrier with the byte count and starts the copy, and bar_wait(bar, 0) returns
 * once every byte has landed (visible to all threads that wait; the barrier must be published to
 * them by a __syncthreads() first). Out of shared memory: each thread that wrote the block calls
 * bulk_store_fence() before a __syncthreads(); then one thread calls bulk_store, and
 * bulk_store_drain() before the block exits (the source must stay valid until it has been read). */
__device__ __forceinline__ unsigned smem_u32(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ void bar_init(uint64_t *bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void bar_expect_tx(uint64_t *bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_load(void *dst, const void *src, unsigned bytes, uint64_t *bar) {
  bar_expect_tx(bar, bytes);
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(evict_first_policy())
               : "memory");
}
/* Several copies into one barrier: bar_expect_tx(bar, their total) once, then bulk_copy_in for each (no
 * cache hint: for data every launch reads again, such as weights). */
__device__ __forceinline__ void bulk_copy_in(void *dst, const void *src, unsigned bytes, uint64_t *bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
__device__ __forceinline__ void bar_wait(uint64_t *bar, unsigned phase) {
  unsigned done;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(smem_u32(bar)), "r"(phase)
                 : "memory");
  } while (!done);
}
__device__ __forceinline__ void bulk_store_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_store(void *dst, const void *src, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;\n" ::"l"(dst),
               "r"(smem_u32(src)), "r"(bytes), "l"(evict_first_policy())
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_store_drain() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }

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

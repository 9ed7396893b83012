/*
 * optim.cu — the optimizer tail over the flat gradient arena (SPEC.md §7, backend.h):
 *
 *   1. grad_sumsq: g *= grad_unscale (f16 loss scaling; skipped when 1), and per block of
 *      NORM_BLOCK elements the sum of g^2 in double (each thread's float4s, strided by the block
 *      and loaded at once, in order; then a shuffle/warp tree).
 *   2. grad_norm: one block adds the block partials in a fixed order -> norm (double),
 *      finite flag, clip scale = max_norm / (norm + 1e-6) when that is < 1. For arenas of at
 *      most FOLD_BLOCKS blocks every AdamW block adds them itself instead (the same order, so
 *      the same bits; block 0 writes the metrics): a launch fewer.
 *   3. adamw: when finite, per element (PyTorch order, float32 as the CPU backend):
 *      g' = g clip;  m = b1 m + (1 - b1) g';  v = b2 v + (1 - b2) g'^2  (1 - b rounded from double);
 *      w = w (1 - lr wd) - step_size m / (sqrt(v) / sqrt(1 - b2^t) + eps)
 *      then the 16-bit weight shadow is refreshed from the new master weight.
 *      A non-finite norm leaves weights, moments and shadows untouched (the step is skipped).
 *
 * Thread mapping: one element per thread for AdamW; grid-blocks of NORM_BLOCK elements for
 * the norm. Every sum has a fixed order, so the norm (and everything after it) is bitwise
 * repeatable.
 */
#include <math.h>

#include "common.cuh"

enum { NORM_BLOCK = 8192, NORM_THREADS = 256, FOLD_BLOCKS = 256 };

/* g: 16-byte aligned. Each thread's float4s of the block are loaded at once, then summed in order. */
__global__ void __launch_bounds__(NORM_THREADS)
    grad_sumsq_kernel(const m3k_step *step, float *__restrict__ g, int64_t n, double *__restrict__ partial) {
  enum { PER = NORM_BLOCK / 4 / NORM_THREADS };
  __shared__ double red[32];
  const float u = step->grad_unscale;
  const int64_t base = (int64_t)blockIdx.x * NORM_BLOCK;
  const int len = (int)(base + NORM_BLOCK < n ? NORM_BLOCK : n - base), quads = len / 4, tid = threadIdx.x;
  float4 *g4 = (float4 *)(g + base);
  float4 v[PER];
#pragma unroll
  for (int e = 0; e < PER; e++) {
    const int q = tid + NORM_THREADS * e;
    v[e] = q < quads ? g4[q] : make_float4(0, 0, 0, 0);
  }
  double acc = 0;
#pragma unroll
  for (int e = 0; e < PER; e++) {
    const int q = tid + NORM_THREADS * e;
    if (u != 1.0f) {
      v[e] = make_float4(v[e].x * u, v[e].y * u, v[e].z * u, v[e].w * u);
      if (q < quads) g4[q] = v[e];
    }
    acc += (double)v[e].x * v[e].x;
    acc += (double)v[e].y * v[e].y;
    acc += (double)v[e].z * v[e].z;
    acc += (double)v[e].w * v[e].w;
  }
  for (int i = 4 * quads + tid; i < len; i += NORM_THREADS) { /* the last block's tail */
    float x = g[base + i];
    if (u != 1.0f) {
      x *= u;
      g[base + i] = x;
    }
    acc += (double)x * x;
  }
  acc = block_sum(acc, red);
  if (tid == 0) partial[blockIdx.x] = acc;
}

/* The fixed-order sum of the block partials (every thread of a NORM_THREADS block gets it) */
__device__ __forceinline__ double partials_sum(const double *__restrict__ partial, int64_t nblocks, double *red) {
  double acc = 0;
  for (int64_t i = threadIdx.x; i < nblocks; i += NORM_THREADS) acc += partial[i];
  return block_sum(acc, red);
}

__device__ __forceinline__ float clip_scale_of(const m3k_step *step, double norm) {
  return step->clip > 0 && step->clip / (norm + 1e-6) < 1 ? (float)(step->clip / (norm + 1e-6)) : 1.0f;
}

__device__ __forceinline__ void write_norm(const m3k_step *step, double sumsq, m3k_metrics *metrics) {
  const double norm = sqrt(sumsq);
  metrics->norm_sq = sumsq;
  metrics->grad_norm = norm;
  metrics->finite = isfinite(norm) ? 1 : 0;
  metrics->clip_scale = clip_scale_of(step, norm);
}

__global__ void __launch_bounds__(NORM_THREADS) grad_norm_kernel(const m3k_step *step,
                                                                 const double *__restrict__ partial,
                                                                 int64_t nblocks, m3k_metrics *metrics) {
  __shared__ double red[32];
  const double sumsq = partials_sum(partial, nblocks, red);
  if (threadIdx.x == 0) write_norm(step, sumsq, metrics);
}

/* partial NULL: grad_norm_kernel has written the metrics; else this block sums the partials itself */
template <typename T>
__global__ void __launch_bounds__(NORM_THREADS)
    adamw_kernel(const m3k_step *__restrict__ step, m3k_metrics *metrics, const double *__restrict__ partial,
                 int64_t nblocks, float *__restrict__ w, const float *__restrict__ g, float *__restrict__ m,
                 float *__restrict__ v, T *__restrict__ shadow, const uint8_t *__restrict__ decay_flags, int64_t n) {
  __shared__ double red[32];
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  float clip_scale;
  if (partial) {
    const double sumsq = partials_sum(partial, nblocks, red);
    if (blockIdx.x == 0 && threadIdx.x == 0) write_norm(step, sumsq, metrics);
    const double norm = sqrt(sumsq);
    if (!isfinite(norm)) return;
    clip_scale = clip_scale_of(step, norm);
  } else {
    if (!metrics->finite) return;
    clip_scale = metrics->clip_scale;
  }
  if (i >= n) return;
  const float lr = step->lr, b1 = step->beta1, b2 = step->beta2, eps = step->eps;
  const float c1 = step->one_minus_beta1, c2 = step->one_minus_beta2;
  const float wd = (step->no_decay && !decay_flags[i >> 6]) ? 0.0f : step->weight_decay;
  const float decay = 1 - lr * wd;
  const float gi = g[i] * clip_scale;
  const float mi = b1 * m[i] + c1 * gi;
  const float vi = b2 * v[i] + c2 * gi * gi;
  const float wi = w[i] * decay - step->step_size * mi / (sqrtf(vi) / step->bc2_sqrt + eps);
  m[i] = mi;
  v[i] = vi;
  w[i] = wi;
  if (shadow) shadow[i] = from_f<T>(wi);
}

extern "C" int64_t m3k_norm_blocks(int64_t n) { return (n + NORM_BLOCK - 1) / NORM_BLOCK; }

extern "C" cudaError_t m3k_grad_sumsq(cudaStream_t s, const m3k_step *step, float *g, int64_t n, double *partial) {
  if ((uintptr_t)g % 16 != 0) return cudaErrorMisalignedAddress;
  grad_sumsq_kernel<<<(unsigned)m3k_norm_blocks(n), NORM_THREADS, 0, s>>>(step, g, n, partial);
  return cudaGetLastError();
}

extern "C" cudaError_t m3k_adamw(cudaStream_t s, int prec, const m3k_step *step, const double *partial,
                                 int64_t nblocks, m3k_metrics *metrics, float *w, const float *g, float *m, float *v,
                                 void *shadow, const uint8_t *decay_flags, int64_t n) {
  const bool fold = nblocks <= FOLD_BLOCKS;
  if (!fold) {
    grad_norm_kernel<<<1, NORM_THREADS, 0, s>>>(step, partial, nblocks, metrics);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  M3K_DISPATCH(prec, (adamw_kernel<T><<<grid_for(n, NORM_THREADS), NORM_THREADS, 0, s>>>(
                         step, metrics, fold ? partial : NULL, nblocks, w, g, m, v, (T *)shadow, decay_flags, n)));
  return cudaGetLastError();
}

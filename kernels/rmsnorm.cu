/*
 * rmsnorm.cu — RMSNorm over rows (eps 1e-5, SPEC.md §3) for the layer norms and norm_f.
 *
 *   forward:  r = 1 / sqrt(mean(x^2) + eps),  y = x r w
 *   backward: dx = r (w dy) - x r^3 mean(x w dy),  dL/dw_j = sum over rows of x_j r dy_j
 *
 * Thread mapping: one warp per row; lanes stride over the n columns (the backward four at a time
 * where n % 4 == 0), the row statistics are warp-shuffle sums (fixed order). The backward writes
 * dx "=" (or "+=" into the residual gradient when `accumulate`) and adds the column sums of the
 * per-row terms x r dy to the weight gradient in m3k_colsum's fixed row order (no atomics, bitwise
 * repeatable): rows of one colsum chunk are summed by extra CTAs of the same launch, straight from
 * x, rstd and dy; longer inputs write the terms to `wcontrib` for m3k_colsum. Riders (riders.cuh:
 * the layer's B_norm | C_norm column sums and its in_proj weight gradient) take more CTAs of the
 * launch.
 */
#include "riders.cuh"

template <typename T>
__global__ void rmsnorm_fwd_kernel(const float *__restrict__ x, const float *__restrict__ w, T *y_act,
                                   float *y_f32, float *__restrict__ rstd, int64_t rows, int32_t n) {
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const float *xr = x + row * n; // [n]
  const float r = warp_rstd(xr, n);
  if (lane == 0) rstd[row] = r;
  for (int j = lane; j < n; j += 32) {
    const float v = xr[j] * r * w[j];
    if (y_act) y_act[row * n + j] = from_f<T>(v);
    if (y_f32) y_f32[row * n + j] = v;
  }
}

/* One row of the backward, the lane's columns V at a time (j = V lane + 32 V i + k). */
template <int V, typename T>
__device__ __forceinline__ void rmsnorm_bwd_row(const float *xr, const float *w, const float *dyr, float sc, float r,
                                                float *wc, float *dxr, T *dar, int32_t n, int accumulate) {
  const int lane = threadIdx.x & 31;
  float dot = 0;
  for (int j = lane * V; j < n; j += 32 * V) {
    float xv[V], wv[V], dv[V];
    ld_v<V>(xr + j, xv);
    ld_v<V>(w + j, wv);
    ld_v<V>(dyr + j, dv);
#pragma unroll
    for (int k = 0; k < V; k++) dot += xv[k] * wv[k] * (sc * dv[k]);
  }
  dot = warp_sum(dot);
  const float c = dot / (float)n * r * r * r;
  for (int j = lane * V; j < n; j += 32 * V) {
    float xv[V], wv[V], dv[V], g[V], t[V];
    ld_v<V>(xr + j, xv);
    ld_v<V>(w + j, wv);
    ld_v<V>(dyr + j, dv);
    if (accumulate) ld_v<V>(dxr + j, g);
#pragma unroll
    for (int k = 0; k < V; k++) {
      const float d = sc * dv[k];
      t[k] = xv[k] * r * d;
      const float v = r * wv[k] * d - xv[k] * c;
      g[k] = accumulate ? g[k] + v : v;
    }
    if (wc) st_v<V>(wc + j, t);
    st_v<V>(dxr + j, g);
    if (dar) st_v<V>(dar + j, g);
  }
}

template <typename T>
__global__ void rmsnorm_bwd_kernel(const float *__restrict__ x, const float *__restrict__ w,
                                   const float *__restrict__ rstd, const float *dy, const m3k_step *dy_scale,
                                   float *dx, T *dx_act, float *__restrict__ wcontrib, float *__restrict__ dw,
                                   m3k_riders riders, unsigned row_ctas, unsigned dw_ctas, int64_t rows, int32_t n,
                                   int accumulate) {
  const float sc = dy_scale ? dy_scale->weight : 1.0f;
  if (blockIdx.x >= row_ctas + dw_ctas) {
    ride<T>(riders, blockIdx.x - row_ctas - dw_ctas, rows);
    return;
  }
  if (blockIdx.x >= row_ctas) { /* dw's column sums, 32 columns a CTA (wcontrib NULL) */
    const int32_t j = (blockIdx.x - row_ctas) * 32 + (threadIdx.x & 31);
    const float acc = colsum_chunk([&](int64_t r) { return x[r * n + j] * rstd[r] * (sc * dy[r * n + j]); }, 0, rows,
                                   j < n);
    if ((threadIdx.x >> 5) == 0 && j < n) dw[j] += acc;
    return;
  }
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const float *xr = x + row * n, *dyr = dy + row * n; // [n] each
  if ((n & 3) == 0) /* every row 16-byte aligned: four columns per access */
    rmsnorm_bwd_row<4>(xr, w, dyr, sc, rstd[row], wcontrib ? wcontrib + row * n : NULL, dx + row * n,
                       dx_act ? dx_act + row * n : NULL, n, accumulate);
  else
    rmsnorm_bwd_row<1>(xr, w, dyr, sc, rstd[row], wcontrib ? wcontrib + row * n : NULL, dx + row * n,
                       dx_act ? dx_act + row * n : NULL, n, accumulate);
}

extern "C" cudaError_t m3k_rmsnorm_fwd(cudaStream_t s, int prec, const float *x, const float *w, void *y_act,
                                       float *y_f32, float *rstd, int64_t rows, int32_t n) {
  const int threads = 256, per = threads / 32;
  M3K_DISPATCH(prec, (rmsnorm_fwd_kernel<T><<<grid_for(rows, per), threads, 0, s>>>(x, w, (T *)y_act, y_f32, rstd,
                                                                                      rows, n)));
  return cudaGetLastError();
}

extern "C" cudaError_t m3k_rmsnorm_bwd(cudaStream_t s, int prec, const float *x, const float *w, const float *rstd,
                                       const float *dy, const m3k_step *dy_scale, float *dx, void *dx_act,
                                       float *wcontrib, float *dw, const m3k_riders *riders, float *scratch,
                                       int64_t rows, int32_t n, int accumulate) {
  const int threads = 256, per = threads / 32;
  static_assert(256 == RIDER_THREADS, "the column-sum and rider CTAs are the row CTAs' size");
  const unsigned row_ctas = grid_for(rows, per);
  const bool fold = m3k_colsum_chunks(rows) <= 1; /* one chunk: the column sums in this launch */
  m3k_riders along = riders ? *riders : m3k_riders{};
  if (!fold && along.colsum.cols) { /* before the launch: its src may be wcontrib */
    const cudaError_t e = m3k_colsum(s, &along.colsum, rows, scratch);
    if (e != cudaSuccess) return e;
    along.colsum.cols = 0;
  }
  if (!riders_fit(along, rows)) return cudaErrorInvalidValue;
  const unsigned dw_ctas = fold ? grid_for(n, 32) : 0;
  const unsigned ctas = row_ctas + dw_ctas + rider_ctas(along);
  M3K_DISPATCH(prec, (rmsnorm_bwd_kernel<T><<<ctas, threads, 0, s>>>(x, w, rstd, dy, dy_scale, dx, (T *)dx_act,
                                                                      fold ? NULL : wcontrib, fold ? dw : NULL, along,
                                                                      row_ctas, dw_ctas, rows, n, accumulate)));
  if (fold) return cudaGetLastError();
  const cudaError_t e = cudaGetLastError();
  const m3k_colsum_job own = {wcontrib, n, n, n, dw, NULL};
  return e != cudaSuccess ? e : m3k_colsum(s, &own, rows, scratch);
}

/*
 * rmsnorm.cu — RMSNorm over rows (eps 1e-5, SPEC.md §3) for the layer norms and norm_f.
 *
 *   forward:  r = 1 / sqrt(mean(x^2) + eps),  y = x r w
 *   backward: dx = r (w dy) - x r^3 mean(x w dy),  dL/dw_j = sum over rows of x_j r dy_j
 *
 * Thread mapping: one warp per row; lanes stride over the n columns (the backward four at a time
 * where n % 4 == 0), the row statistics are warp-shuffle sums (fixed order). The backward writes
 * dx "=" (or "+=" into the residual gradient when `accumulate`); the column sums of the per-row
 * terms x r dy (the weight gradient, in m3k_colsum's fixed row order: no atomics, bitwise
 * repeatable) are taken by extra CTAs of the same launch, a colsum chunk of rows each, straight from
 * x, rstd and dy: into the weight gradient for one chunk, else into partials that m3k_colsum_finish
 * adds later (one launch for the backward's norms). Riders (riders.cuh: the layer's B_norm | C_norm
 * column sums and its in_proj weight gradient) take more CTAs of the launch.
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
                                                float *dxr, T *dar, int32_t n, int accumulate) {
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
    float xv[V], wv[V], dv[V], g[V];
    ld_v<V>(xr + j, xv);
    ld_v<V>(w + j, wv);
    ld_v<V>(dyr + j, dv);
    if (accumulate) ld_v<V>(dxr + j, g);
#pragma unroll
    for (int k = 0; k < V; k++) {
      const float d = sc * dv[k];
      const float v = r * wv[k] * d - xv[k] * c;
      g[k] = accumulate ? g[k] + v : v;
    }
    st_v<V>(dxr + j, g);
    if (dar) st_v<V>(dar + j, g);
  }
}

/* The backward's CTAs, a group per colsum chunk of rows: the chunk's row CTAs (NORM_ROWS_PER_CTA rows, a
 * warp a row; row_ctas = NORM_ROW_CTAS, fewer only for one short chunk), then its column-sum CTAs (32
 * columns each), which read the rows that the CTAs just before them read (from L2); the riders after the
 * last group. */
enum { NORM_ROWS_PER_CTA = 8, NORM_ROW_CTAS = COLSUM_CHUNK / NORM_ROWS_PER_CTA };

template <typename T>
__global__ void rmsnorm_bwd_kernel(const float *__restrict__ x, const float *__restrict__ w,
                                   const float *__restrict__ rstd, const float *dy, const m3k_step *dy_scale,
                                   float *dx, T *dx_act, const m3k_colsum_job dw, m3k_riders riders,
                                   unsigned row_ctas, int64_t rows, int32_t n, int accumulate) {
  const float sc = dy_scale ? dy_scale->weight : 1.0f;
  const unsigned col_ctas = (unsigned)(n + 31) / 32, group = row_ctas + col_ctas;
  const unsigned own_ctas = group * (unsigned)colsum_chunks(rows);
  if (blockIdx.x >= own_ctas) {
    ride<T>(riders, blockIdx.x - own_ctas, rows);
    return;
  }
  const int64_t chunk = blockIdx.x / group;
  const unsigned in_group = blockIdx.x % group;
  if (in_group >= row_ctas) { /* dw's column sums over the chunk (as colsum_job_cta) */
    const int32_t j = (int32_t)(in_group - row_ctas) * 32 + (threadIdx.x & 31);
    /* each term rounded, not fused into the sum: the bits of the terms m3k_colsum summed (NOTES.md run 230) */
    const float acc = colsum_chunk(
        [&](int64_t r) { return __fmul_rn(x[r * n + j] * rstd[r], sc * dy[r * n + j]); }, chunk * COLSUM_CHUNK,
        rows, j < n);
    colsum_put(dw, chunk, rows, j, acc);
    return;
  }
  const int64_t row = chunk * COLSUM_CHUNK + in_group * NORM_ROWS_PER_CTA + (threadIdx.x >> 5);
  if (row >= rows) return;
  const float *xr = x + row * n, *dyr = dy + row * n; // [n] each
  if ((n & 3) == 0) /* every row 16-byte aligned: four columns per access */
    rmsnorm_bwd_row<4>(xr, w, dyr, sc, rstd[row], dx + row * n, dx_act ? dx_act + row * n : NULL, n, accumulate);
  else
    rmsnorm_bwd_row<1>(xr, w, dyr, sc, rstd[row], dx + row * n, dx_act ? dx_act + row * n : NULL, n, accumulate);
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
                                       const m3k_colsum_job *dw, const m3k_riders *riders, int64_t rows, int32_t n,
                                       int accumulate) {
  static_assert(32 * NORM_ROWS_PER_CTA == RIDER_THREADS, "the column-sum and rider CTAs are the row CTAs' size");
  const m3k_riders along = riders ? *riders : m3k_riders{};
  if (!riders_fit(along, rows) || dw->cols != n || (colsum_chunks(rows) > 1 && !dw->partials))
    return cudaErrorInvalidValue;
  const unsigned groups = (unsigned)colsum_chunks(rows);
  const unsigned row_ctas = groups > 1 ? (unsigned)NORM_ROW_CTAS : grid_for(rows, NORM_ROWS_PER_CTA);
  const unsigned ctas = groups * (row_ctas + grid_for(n, 32)) + rider_ctas(along, rows);
  M3K_DISPATCH(prec, (rmsnorm_bwd_kernel<T><<<ctas, RIDER_THREADS, 0, s>>>(x, w, rstd, dy, dy_scale, dx, (T *)dx_act,
                                                                            *dw, along, row_ctas, rows, n,
                                                                            accumulate)));
  return cudaGetLastError();
}

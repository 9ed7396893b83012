/*
 * bcnorm_row.cuh — the B/C RMSNorm of one (position, B|C, group) row in one warp, forward and backward,
 * shared by bcnorm.cu's kernels and the chunked scan (scan_chunked.cu): its angle walk runs the forward rows
 * in extra CTAs of its launch, and its post kernel applies the backward to the sums of a group's heads it
 * holds in shared memory instead of writing them out for bcnorm_bwd. The same formulas, sums and
 * roundings, so either launch gives the same bits.
 *
 *   forward:  r = 1 / RMS(x) (warp_rstd), x_hat = x r w
 *   backward: dx = r (w ds) - x r^3 mean(x w ds),  wc += x r ds  (x: the raw row of proj, w the weights)
 */
#ifndef M3_KERNELS_BCNORM_ROW_CUH
#define M3_KERNELS_BCNORM_ROW_CUH

#include "common.cuh"

enum { BC_MAX_PER_LANE = 8 }; /* N <= 256 */

/* Row item = (m, which, g) of proj [M, dipp] (item < M 2 G) -> bc_hat [M, 2, G, N], bc_rstd [M, 2, G]. */
template <typename T>
__device__ __forceinline__ void bcnorm_fwd_row(const m3k_dims &d, const T *proj, const float *wB, const float *wC,
                                               float *bc_hat, float *bc_rstd, int64_t item) {
  const int lane = threadIdx.x & 31, g = (int)(item % d.G), which = (int)((item / d.G) % 2);
  const int64_t m = item / (2 * d.G);
  const T *x = proj + m * d.dipp + (which ? d.C_off : d.B_off) + (int64_t)g * d.N; // [N]
  const float *w = which ? wC : wB;
  const float r = warp_rstd(x, d.N);
  if (lane == 0) bc_rstd[item] = r;
  for (int n = lane; n < d.N; n += 32) bc_hat[item * d.N + n] = to_f(x[n]) * r * w[n];
}

/* Lane l holds ds[k], the gradient at column l + 32 k (< N); dx goes to dx_row (=), the weight terms add to wc. */
template <typename T>
__device__ __forceinline__ void bcnorm_bwd_row(const T *x, const float *w, float r, const float (&ds)[BC_MAX_PER_LANE],
                                               int N, T *dx_row, float (&wc)[BC_MAX_PER_LANE]) {
  const int lane = threadIdx.x & 31;
  float dot = 0;
#pragma unroll
  for (int k = 0; k < BC_MAX_PER_LANE; k++) {
    const int n = lane + 32 * k;
    if (n < N) dot += to_f(x[n]) * w[n] * ds[k];
  }
  dot = warp_sum(dot);
  const float c = dot / (float)N * r * r * r;
#pragma unroll
  for (int k = 0; k < BC_MAX_PER_LANE; k++) {
    const int n = lane + 32 * k;
    if (n < N) {
      const float xv = to_f(x[n]);
      wc[k] += xv * r * ds[k];
      dx_row[n] = from_f<T>(r * w[n] * ds[k] - xv * c);
    }
  }
}

/* Lane l's weight terms wc[k] (column l + 32 k < N, bcnorm_bwd_row) to wc_row [N]. */
__device__ __forceinline__ void bcnorm_store_wc(float *wc_row, const float (&wc)[BC_MAX_PER_LANE], int N) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int k = 0; k < BC_MAX_PER_LANE; k++)
    if (lane + 32 * k < N) wc_row[lane + 32 * k] = wc[k];
}

#endif

/*
 * bcnorm_row.cuh — the B/C RMSNorm backward of one (position, B|C, group) row in one warp, shared by
 * bcnorm.cu's kernel and the chunked scan's post kernel (scan_chunked.cu), which applies it to the sums of a
 * group's heads it holds in shared memory instead of writing them out for bcnorm_bwd: the same formula,
 * sums and roundings, so either launch gives the same bits.
 *
 *   dx = r (w ds) - x r^3 mean(x w ds),  wc += x r ds  (x: the raw row of proj, r its 1 / RMS, w the weights)
 */
#ifndef M3_KERNELS_BCNORM_ROW_CUH
#define M3_KERNELS_BCNORM_ROW_CUH

#include "common.cuh"

enum { BC_MAX_PER_LANE = 8 }; /* N <= 256 */

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

#endif

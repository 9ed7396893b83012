/*
 * bcnorm.cu — the per-position parts of the mixer around the scan that mix heads:
 *
 * forward: B_hat = RMSNorm_N(B_g; B_norm), C_hat = RMSNorm_N(C_g; C_norm) per group g
 *   (SPEC.md §3 step 5), saved as bc_hat [M, 2, G, N] with the reciprocal RMS bc_rstd [M, 2, G].
 *   One warp per (position, B|C, group); lanes stride over N.
 *
 * backward: B and C are shared by the H/G heads of a group, so the scan's per-head gradients
 *   dL/d(B_hat + bias_h) (dbc [M, G, slots, 2, N]: slots = H/G per-head values, or 1 when the scan
 *   summed them already) are summed over the group's heads in head order, then pushed through the
 *   RMSNorm:
 *     dx = r (w ds) - x r^3 mean(x w ds)   -> dproj's B / C columns ("=")
 *     wcontrib[m, which*N + n] = sum_g x r ds  (B_norm / C_norm weight terms, column-summed later)
 *   and the angle logits, shared by all heads, get the sum over heads of the per-head shares
 *   (dang_head [M, H, S], the activation type) -> dproj's angle columns ("="). Two warps per
 *   position (warp 0 does B, warp 1 C, each looping over groups in order, then both share the
 *   angles), four positions a CTA. More CTAs of the same launch add the scan's per-(row, head)
 *   partials, summed over rows in row order, to the small-parameter gradients ("+="): dt_bias, D,
 *   B_bias, C_bias (and out_norm); a thread per gradient. Then the riders (riders.cuh: the layer's
 *   out_proj weight gradient). The B_norm / C_norm column sums of wcontrib are the caller's (a rider
 *   of the layer norm's backward). Without dbc the scan's chunked post kernel has done the B/C part
 *   (bcnorm_row.cuh, the same bits) and only the angle sums, partials and riders run here.
 */
#include "bcnorm_row.cuh"
#include "riders.cuh"

enum { BC_BWD_THREADS = RIDER_THREADS, BC_BWD_POSITIONS = BC_BWD_THREADS / 64 };

/* The small-parameter gradients from the scan's partials: [dt_bias, D, B_bias, C_bias] of each head,
 * then out_norm's; add_row_partial adds item k < row_partial_items. */
__host__ __device__ inline int32_t row_partial_items(const m3k_dims &d) {
  return d.H * (2 + 2 * d.N) + (d.outproj_norm ? d.H * d.P : 0);
}
__device__ __forceinline__ void add_row_partial(const m3k_dims &d, const m3k_scan_partials &sp, int32_t k) {
  const int32_t width = 2 + 2 * d.N, n_scan = d.H * width;
  if (k < n_scan) {
    const int32_t h = k / width, e = k - h * width;
    float acc = 0;
    for (int32_t b = 0; b < sp.rows; b++) acc += sp.part[((int64_t)b * d.H + h) * width + e];
    if (e == 0) sp.g_dt_bias[h] += acc;
    else if (e == 1) sp.g_D[h] += acc;
    else if (e < 2 + d.N) sp.g_B_bias[(int64_t)h * d.N + (e - 2)] += acc;
    else sp.g_C_bias[(int64_t)h * d.N + (e - 2 - d.N)] += acc;
    return;
  }
  k -= n_scan;
  const int32_t n_norm = d.H * d.P;
  float acc = 0;
  for (int32_t b = 0; b < sp.rows; b++) acc += sp.part_norm[(int64_t)b * n_norm + k];
  sp.g_norm[k] += acc;
}

template <typename T>
__global__ void bcnorm_fwd_kernel(m3k_dims d, const T *__restrict__ proj, const float *__restrict__ wB,
                                  const float *__restrict__ wC, float *__restrict__ bc_hat,
                                  float *__restrict__ bc_rstd, int64_t M) {
  const int64_t item = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); /* (m, which, g) */
  if (item < M * 2 * d.G) bcnorm_fwd_row(d, proj, wB, wC, bc_hat, bc_rstd, item);
}

/* four CTAs a multiprocessor (64 registers, was 71-76: three): rl-batch 11.1 -> 9.7 us a launch (NOTES.md run 221) */
template <typename T>
__global__ void __launch_bounds__(BC_BWD_THREADS, 4)
    bcnorm_bwd_kernel(m3k_dims d, const T *__restrict__ proj, const float *__restrict__ wB, const float *__restrict__ wC,
                      const float *__restrict__ bc_rstd, const float *__restrict__ dbc, int slots,
                      const T *__restrict__ dang_head, T *__restrict__ dproj, float *__restrict__ wcontrib,
                      m3k_scan_partials sp, m3k_riders riders, unsigned pos_ctas, unsigned part_ctas, int64_t M) {
  if (blockIdx.x >= pos_ctas + part_ctas) {
    ride<T>(riders, blockIdx.x - pos_ctas - part_ctas, M);
    return;
  }
  if (blockIdx.x >= pos_ctas) { /* the small-parameter gradients (they read only the scan's partials) */
    const int32_t k = (int32_t)(blockIdx.x - pos_ctas) * BC_BWD_THREADS + threadIdx.x;
    if (k < row_partial_items(d)) add_row_partial(d, sp, k);
    return;
  }
  const int64_t m = (int64_t)blockIdx.x * BC_BWD_POSITIONS + (threadIdx.x >> 6);
  const int which = (threadIdx.x >> 5) & 1, lane = threadIdx.x & 31;
  if (m >= M) return;
  if (dbc) { /* (NULL: the scan did this part: m3k_scan_bwd_bc_stage) */
    float wc[BC_MAX_PER_LANE];
#pragma unroll
    for (int k = 0; k < BC_MAX_PER_LANE; k++) wc[k] = 0;
    for (int g = 0; g < d.G; g++) {
      const int64_t col = (which ? d.C_off : d.B_off) + (int64_t)g * d.N;
      float ds[BC_MAX_PER_LANE];
#pragma unroll
      for (int k = 0; k < BC_MAX_PER_LANE; k++) {
        const int n = lane + 32 * k;
        float acc = 0;
        if (n < d.N)
#pragma unroll 8 /* the heads' loads in flight together */
          for (int h = g * slots; h < (g + 1) * slots; h++) acc += dbc[((m * d.G * slots + h) * 2 + which) * d.N + n];
        ds[k] = acc;
      }
      bcnorm_bwd_row(proj + m * d.dipp + col, which ? wC : wB, bc_rstd[(m * 2 + which) * d.G + g], ds, d.N,
                     dproj + m * d.dipp + col, wc);
    }
    bcnorm_store_wc(wcontrib + (m * 2 + which) * d.N, wc, d.N);
  }
  for (int a = threadIdx.x & 63; a < d.S; a += 64) {
    float acc = 0;
#pragma unroll 8
    for (int h = 0; h < d.H; h++) acc += to_f(dang_head[(m * d.H + h) * d.S + a]);
    dproj[m * d.dipp + d.ang_off + a] = from_f<T>(acc);
  }
}

extern "C" cudaError_t m3k_bcnorm_fwd(cudaStream_t s, int prec, const m3k_dims *d, const void *proj, const float *wB,
                                      const float *wC, float *bc_hat, float *bc_rstd, int64_t M) {
  const int threads = 256;
  const int64_t items = M * 2 * d->G;
  M3K_DISPATCH(prec, (bcnorm_fwd_kernel<T><<<grid_for(items, threads / 32), threads, 0, s>>>(
                         *d, (const T *)proj, wB, wC, bc_hat, bc_rstd, M)));
  return cudaGetLastError();
}

extern "C" cudaError_t m3k_bcnorm_bwd(cudaStream_t s, int prec, const m3k_dims *d, const void *proj, const float *wB,
                                      const float *wC, const float *bc_rstd, const float *dbc, int32_t slots,
                                      const void *dang_head, void *dproj, float *wcontrib,
                                      const m3k_scan_partials *sp, const m3k_riders *riders, int64_t M) {
  const m3k_riders along = riders ? *riders : m3k_riders{};
  if (!riders_fit(along, M)) return cudaErrorInvalidValue;
  const unsigned pos_ctas = grid_for(M, BC_BWD_POSITIONS), part_ctas = grid_for(row_partial_items(*d), BC_BWD_THREADS);
  const unsigned ctas = pos_ctas + part_ctas + rider_ctas(along, M);
  M3K_DISPATCH(prec, (bcnorm_bwd_kernel<T><<<ctas, BC_BWD_THREADS, 0, s>>>(
                         *d, (const T *)proj, wB, wC, bc_rstd, dbc, slots, (const T *)dang_head, (T *)dproj, wcontrib,
                         *sp, along, pos_ctas, part_ctas, M)));
  return cudaGetLastError();
}

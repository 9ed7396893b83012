/*
 * riders.cuh — work that rides along in extra CTAs of another kernel's launch (m3k_riders): a column
 * sum's chunks, and a weight gradient over a window of at most M3K_RIDER_K positions.
 * A host kernel whose own CTAs leave the GPU mostly idle (a 32-position window fills a few
 * multiprocessors) launches rider_ctas() more CTAs of RIDER_THREADS threads and hands each to ride():
 * the work is the same, a launch (~3-4 us at rl) less. The host must not write what a rider reads.
 *
 * Weight gradient G[M, N] += A[K, M]^T B[K, N]: a CTA per WG_TM x WG_TN tile of G stages the tile's
 * K x WG_TM slice of A and K x WG_TN slice of B as float32 in shared memory, every load in flight at
 * once (with G's old values), then each thread sums its 1 x WG_Q outputs over k = 0 .. K-1 in order
 * (float32 FMAs; true float32 for float32 operands) and adds them to G. The order is fixed by the
 * shape: bitwise repeatable. Tiles of 16 x 32 keep the riders within their hosts' time at rl better
 * than 32 x 64, 16 x 64, 16 x 16 or 8 x 32 (NOTES.md runs 130-134).
 */
#ifndef M3_KERNELS_RIDERS_CUH
#define M3_KERNELS_RIDERS_CUH

#include "common.cuh"

enum { RIDER_THREADS = 32 * COLSUM_WARPS, WG_TM = 16, WG_TN = 32 };
enum { WG_Q = WG_TM * WG_TN / RIDER_THREADS, WG_TJ = WG_TN / WG_Q }; /* a thread's outputs: one row, WG_Q columns */
static_assert(RIDER_THREADS == 256 && WG_TM * WG_TJ == RIDER_THREADS, "the threads cover the tile");

/* the column sum's CTAs: 32 columns of one chunk of the host kernel's rows each */
__host__ __device__ inline unsigned rider_colsum_ctas(const m3k_riders &r, int64_t rows) {
  return (unsigned)(r.colsum.cols + 31) / 32 * (unsigned)colsum_chunks(rows);
}
__host__ __device__ inline unsigned rider_wgrad_ctas(const m3k_riders &r) {
  return r.wgrad.K ? (unsigned)((r.wgrad.M + WG_TM - 1) / WG_TM) * (unsigned)((r.wgrad.N + WG_TN - 1) / WG_TN) : 0;
}
__host__ __device__ inline unsigned rider_ctas(const m3k_riders &r, int64_t rows) {
  return rider_colsum_ctas(r, rows) + rider_wgrad_ctas(r);
}

/* Whether the riders can ride a launch over `rows` rows (else the launcher returns cudaErrorInvalidValue) */
inline bool riders_fit(const m3k_riders &r, int64_t rows) {
  return (r.colsum.cols == 0 || colsum_chunks(rows) <= 1 || r.colsum.partials) && r.wgrad.K <= M3K_RIDER_K;
}

template <typename T> __device__ __forceinline__ void wgrad_tile(const m3k_wgrad &w, unsigned c) {
  __shared__ __align__(16) float Xs[M3K_RIDER_K][WG_TM]; /* [k][i]: A's slice */
  __shared__ __align__(16) float Ys[M3K_RIDER_K][WG_TN]; /* [k][j]: B's slice */
  const unsigned tiles_n = (unsigned)(w.N + WG_TN - 1) / WG_TN;
  const int i0 = (int)(c / tiles_n) * WG_TM, j0 = (int)(c % tiles_n) * WG_TN;
  const int tid = threadIdx.x, ti = tid / WG_TJ, tj = tid % WG_TJ; /* row i0 + ti, columns j0 + WG_Q tj + q */
  const int lda = (int)w.lda, ldb = (int)w.ldb, K = w.K;        /* A, B: at most M3K_RIDER_K rows */
  const T *A = (const T *)w.A + i0, *B = (const T *)w.B + j0;
  const bool row_ok = i0 + ti < w.M;
  float *g = w.G + (int64_t)(i0 + ti) * w.ldg + j0 + WG_Q * tj;
  float old[WG_Q];
#pragma unroll
  for (int q = 0; q < WG_Q; q++) old[q] = row_ok && j0 + WG_Q * tj + q < w.N ? g[q] : 0.0f;
#pragma unroll 4
  for (int s = tid; s < K * WG_TM; s += RIDER_THREADS) {
    const int k = s / WG_TM, i = s % WG_TM;
    Xs[k][i] = i0 + i < w.M ? to_f(__ldg(A + k * lda + i)) : 0.0f;
  }
#pragma unroll 16
  for (int s = tid; s < K * WG_TN; s += RIDER_THREADS) {
    const int k = s / WG_TN, j = s % WG_TN;
    Ys[k][j] = j0 + j < w.N ? to_f(__ldg(B + k * ldb + j)) : 0.0f;
  }
  __syncthreads();
  float acc[WG_Q];
#pragma unroll
  for (int q = 0; q < WG_Q; q++) acc[q] = 0;
#pragma unroll 8
  for (int k = 0; k < K; k++) {
    const float x = Xs[k][ti];
#pragma unroll
    for (int q = 0; q < WG_Q; q++) acc[q] = fmaf(x, Ys[k][WG_Q * tj + q], acc[q]);
  }
  if (!row_ok) return;
#pragma unroll
  for (int q = 0; q < WG_Q; q++)
    if (j0 + WG_Q * tj + q < w.N) g[q] = acc[q] + old[q];
}

/* Rider CTA c (every thread of a RIDER_THREADS-thread CTA calls it); rows: the host kernel's */
template <typename T> __device__ __forceinline__ void ride(const m3k_riders &r, unsigned c, int64_t rows) {
  if (c < rider_colsum_ctas(r, rows)) {
    colsum_job_cta(r.colsum, c, rows);
    return;
  }
  wgrad_tile<T>(r.wgrad, c - rider_colsum_ctas(r, rows));
}

#endif

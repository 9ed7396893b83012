/*
 * reduce.cu — small elementwise kernels (f32 -> 16-bit conversion, bias broadcast) and the
 * deterministic reductions every gradient path uses.
 *
 * Column sums (parameter gradients of norm weights and biases): dst[j] += sum_r src[r, j]
 * (m3k_colsum_job: the destination may be two tensors).
 * Rows are cut into fixed chunks of COLSUM_CHUNK; a CTA sums one chunk for 32 columns, each of its
 * COLSUM_WARPS warps a slice of the chunk's rows (lane = column: coalesced rows), then the warps'
 * sums in warp order. Each chunk's sum goes to the job's partials[chunk, j], and a final pass adds the
 * chunks in index order (m3k_colsum_finish: for many jobs at once, whose chunk sums other kernels took
 * as riders). Short inputs (one chunk) add straight into the destination. The order of additions
 * depends only on the shape, never on scheduling: results are bitwise repeatable.
 */
#include "common.cuh"

template <typename T> __global__ void to_act_kernel(const float *__restrict__ src, T *__restrict__ dst, int64_t n) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = from_f<T>(src[i]);
}

__global__ void fill_rows_kernel(const float *__restrict__ src, float *__restrict__ dst, int64_t rows, int32_t cols) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < rows * cols) dst[i] = src[i % cols];
}

/* A job's chunk sums: CTA per 32 columns of one chunk */
__global__ void __launch_bounds__(32 * COLSUM_WARPS) colsum_chunk_kernel(m3k_colsum_job job, int64_t rows) {
  colsum_job_cta(job, blockIdx.x, rows);
}

/* The final pass: job blockIdx.y's column j adds its chunks' sums in chunk order */
struct colsum_jobs {
  m3k_colsum_job job[M3K_FINISH_JOBS];
};
__global__ void colsum_finish_kernel(const colsum_jobs jobs, int64_t chunks) {
  const m3k_colsum_job &job = jobs.job[blockIdx.y];
  const int32_t j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= job.cols) return;
  float acc = 0;
#pragma unroll 16 /* the loads in flight */
  for (int64_t c = 0; c < chunks; c++) acc += job.partials[c * job.cols + j];
  *colsum_dst(job, j) += acc;
}

__global__ void loss_sum_kernel(const double *__restrict__ row_loss, const int32_t *__restrict__ row_hit, int64_t n,
                                m3k_metrics *metrics) {
  __shared__ double red[32];
  __shared__ double redh[32];
  double s = 0, hits = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    s += row_loss[i];
    if (row_hit) hits += row_hit[i];
  }
  s = block_sum(s, red);
  hits = block_sum(hits, redh);
  if (threadIdx.x == 0) {
    metrics->loss_sum = s;
    metrics->correct = (int64_t)hits;
  }
}

extern "C" cudaError_t m3k_to_act(cudaStream_t s, int prec, const float *src, void *dst, int64_t n) {
  M3K_DISPATCH(prec, (to_act_kernel<T><<<grid_for(n, 256), 256, 0, s>>>(src, (T *)dst, n)));
  return cudaGetLastError();
}

extern "C" cudaError_t m3k_fill_rows(cudaStream_t s, const float *src, float *dst, int64_t rows, int32_t cols) {
  fill_rows_kernel<<<grid_for(rows * cols, 256), 256, 0, s>>>(src, dst, rows, cols);
  return cudaGetLastError();
}

extern "C" int64_t m3k_colsum_chunks(int64_t rows) { return colsum_chunks(rows); }

extern "C" int64_t m3k_colsum_partials(int64_t rows, int32_t cols) {
  return colsum_chunks(rows) > 1 ? colsum_chunks(rows) * cols : 0;
}

extern "C" cudaError_t m3k_colsum_finish(cudaStream_t s, const m3k_colsum_job *jobs, int32_t n, int64_t rows) {
  for (int32_t i = 0; i < n; i++)
    if (!jobs[i].partials) return cudaErrorInvalidValue;
  for (int32_t i0 = 0; i0 < n; i0 += M3K_FINISH_JOBS) {
    const int32_t k = n - i0 < M3K_FINISH_JOBS ? n - i0 : M3K_FINISH_JOBS;
    colsum_jobs batch;
    int32_t cols = 0;
    for (int32_t i = 0; i < k; i++) {
      batch.job[i] = jobs[i0 + i];
      if (jobs[i0 + i].cols > cols) cols = jobs[i0 + i].cols;
    }
    colsum_finish_kernel<<<dim3(grid_for(cols, 128), (unsigned)k), 128, 0, s>>>(batch, colsum_chunks(rows));
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

extern "C" cudaError_t m3k_colsum(cudaStream_t s, const m3k_colsum_job *job, int64_t rows) {
  if (colsum_chunks(rows) > 1 && !job->partials) return cudaErrorInvalidValue;
  const unsigned ctas = grid_for(job->cols, 32) * (unsigned)colsum_chunks(rows);
  colsum_chunk_kernel<<<ctas, 32 * COLSUM_WARPS, 0, s>>>(*job, rows);
  const cudaError_t e = cudaGetLastError();
  return e != cudaSuccess || colsum_chunks(rows) <= 1 ? e : m3k_colsum_finish(s, job, 1, rows);
}

extern "C" cudaError_t m3k_loss_sum(cudaStream_t s, const double *row_loss, const int32_t *row_hit, int64_t n,
                                    m3k_metrics *metrics) {
  loss_sum_kernel<<<1, 1024, 0, s>>>(row_loss, row_hit, n, metrics);
  return cudaGetLastError();
}

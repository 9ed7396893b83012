/*
 * reduce.cu — small elementwise kernels (f32 -> 16-bit conversion, bias broadcast) and the
 * deterministic reductions every gradient path uses.
 *
 * Column sums (parameter gradients of norm weights and biases): dst[j] += sum_r src[r, j]
 * (m3k_colsum_job: the destination may be two tensors).
 * Rows are cut into fixed chunks of COLSUM_CHUNK; a CTA sums one chunk for 32 columns, each of its
 * COLSUM_WARPS warps a slice of the chunk's rows (lane = column: coalesced rows), then the warps'
 * sums in warp order. Each chunk's sum goes to scratch[chunk, j], and a second pass adds the
 * chunks in index order. Short inputs (one chunk) add straight into the destination. The order of additions
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

/* Chunk blockIdx.y's column sums for 32 columns a CTA: into scratch [chunks, cols], or (scratch NULL, one
 * chunk) added to the job's destinations. */
__global__ void __launch_bounds__(32 * COLSUM_WARPS) colsum_chunk_kernel(m3k_colsum_job job, int64_t rows,
                                                                         float *__restrict__ scratch) {
  if (!scratch) {
    colsum_job_add(job, blockIdx.x, rows);
    return;
  }
  const float acc = colsum_job_chunk(job, blockIdx.x, (int64_t)blockIdx.y * COLSUM_CHUNK, rows);
  const int32_t j = blockIdx.x * 32 + (threadIdx.x & 31);
  if ((threadIdx.x >> 5) == 0 && j < job.cols) scratch[(int64_t)blockIdx.y * job.cols + j] = acc;
}

__global__ void colsum_final_kernel(const float *__restrict__ scratch, int64_t chunks, m3k_colsum_job job) {
  const int32_t j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= job.cols) return;
  float acc = 0;
  for (int64_t c = 0; c < chunks; c++) acc += scratch[c * job.cols + j];
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

extern "C" int64_t m3k_colsum_scratch(int64_t rows, int32_t cols) {
  const int64_t chunks = (rows + COLSUM_CHUNK - 1) / COLSUM_CHUNK;
  return chunks > 1 ? chunks * cols : 0;
}

extern "C" int64_t m3k_colsum_chunks(int64_t rows) { return (rows + COLSUM_CHUNK - 1) / COLSUM_CHUNK; }

extern "C" cudaError_t m3k_colsum(cudaStream_t s, const m3k_colsum_job *job, int64_t rows, float *scratch) {
  const int64_t chunks = m3k_colsum_chunks(rows);
  const dim3 grid(grid_for(job->cols, 32), (unsigned)(chunks > 1 ? chunks : 1));
  colsum_chunk_kernel<<<grid, 32 * COLSUM_WARPS, 0, s>>>(*job, rows, chunks > 1 ? scratch : NULL);
  if (chunks > 1) colsum_final_kernel<<<grid_for(job->cols, 128), 128, 0, s>>>(scratch, chunks, *job);
  return cudaGetLastError();
}

extern "C" cudaError_t m3k_loss_sum(cudaStream_t s, const double *row_loss, const int32_t *row_hit, int64_t n,
                                    m3k_metrics *metrics) {
  loss_sum_kernel<<<1, 1024, 0, s>>>(row_loss, row_hit, n, metrics);
  return cudaGetLastError();
}

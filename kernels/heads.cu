/*
 * heads.cu — the input embedding and the losses of SPEC.md §6 on the device.
 *
 * embed_fwd:  h0[m, :] = emb[tokens[m], :] (one thread per element).
 * embed_bwd:  gemb[tok, :] += sum of dh0[m, :] over the positions m holding tok. The host sorts
 *   the window's tokens (counting sort, stable) into segments; one block per segment adds its
 *   rows in position order, so no two blocks touch the same embedding row and the sum order is
 *   fixed (no atomics). The grid is sized for the largest window; blocks past nseg return.
 * ce:  "lm" cross-entropy of a block of positions from logits [nb, V] in the activation type (the head
 *   GEMM's output, as any activation: SPEC.md §8; float32 for f32 training): one block per
 *   position (its row staged in shared memory by one bulk copy where it fits: ce_launch); one pass
 *   of online max / argmax / sum of exp in float32, four logits at a time per thread (merged over
 *   lanes and warps in a fixed order), log-sum-exp = max + log(sum);
 *   row_loss = lse - logit[target] (double), row_hit = argmax == target (first maximal index);
 *   dlogits = weight (softmax - onehot) / count, written as the GEMM operand type (zeros for
 *   ignored positions, target -1).
 * mse: one warp per position: diff = pred + bias - target (0 where masked); row_loss = sum diff^2
 *   (double); dpred = 2 weight diff / count (f32 for the bias gradient, act for the GEMMs).
 * The per-row losses are summed in order by m3k_loss_sum (reduce.cu).
 */
#include <float.h>

#include "common.cuh"

__global__ void embed_fwd_kernel(const int32_t *__restrict__ tokens, const float *__restrict__ emb,
                                 float *__restrict__ h0, int64_t M, int32_t dm) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= M * dm) return;
  const int64_t m = i / dm;
  h0[i] = emb[(int64_t)tokens[m] * dm + (i - m * dm)];
}

__global__ void embed_bwd_kernel(const m3k_batch_info *__restrict__ info, const int32_t *__restrict__ seg_tok,
                                 const int32_t *__restrict__ seg_start, const int32_t *__restrict__ perm,
                                 const float *__restrict__ dh0, float *__restrict__ gemb, int32_t dm) {
  const int32_t sidx = blockIdx.x;
  if (sidx >= info->nseg) return;
  float *dst = gemb + (int64_t)seg_tok[sidx] * dm; // [dm]
  const int32_t i0 = seg_start[sidx], i1 = seg_start[sidx + 1];
  for (int32_t j = threadIdx.x; j < dm; j += blockDim.x) {
    float acc = 0;
    for (int32_t i = i0; i < i1; i++) acc += dh0[(int64_t)perm[i] * dm + j];
    dst[j] += acc;
  }
}

/* ce reads a row four logits at a time: one vector where V allows (V % 4 == 0: every row aligned to four
 * values), else four scalars with -inf past the end; the gradient goes back the same way. */
template <typename T>
__device__ __forceinline__ void ce_load4(const T *lg, int32_t v0, int32_t V, bool vec, float (&x)[4]) {
  if (vec) return ld_v<4>(lg + v0, x);
#pragma unroll
  for (int k = 0; k < 4; k++) x[k] = v0 + k < V ? to_f(lg[v0 + k]) : -INFINITY;
}
template <typename T>
__device__ __forceinline__ void ce_store4(T *dl, int32_t v0, int32_t V, bool vec, const float (&p)[4]) {
  if (vec) return st_v<4>(dl + v0, p);
#pragma unroll
  for (int k = 0; k < 4; k++)
    if (v0 + k < V) dl[v0 + k] = from_f<T>(p[k]);
}

/* STAGED: the row is first copied into shared memory by one bulk copy (ce_launch), and both passes read
 * it there: the logits leave DRAM once instead of twice. The same sums in the same order either way. */
template <typename T, bool STAGED>
__global__ void ce_kernel(const m3k_step *__restrict__ step, const m3k_batch_info *__restrict__ info,
                          const T *__restrict__ logits, const int32_t *__restrict__ targets, T *__restrict__ dlogits,
                          double *__restrict__ row_loss, int32_t *__restrict__ row_hit, int32_t V, int want_grad) {
  extern __shared__ __align__(16) unsigned char ce_row[];
  __shared__ float redv[32];
  __shared__ int redi[32];
  __shared__ float red[32];
  __shared__ uint64_t bar;
  const int64_t row = blockIdx.x;
  const T *lg = logits + row * V; // [V]
  T *dl = dlogits ? dlogits + row * V : NULL;
  const int32_t tgt = targets[row];
  if (STAGED && tgt >= 0) {
    if (threadIdx.x == 0) bar_init(&bar);
    __syncthreads();
    if (threadIdx.x == 0) bulk_load(ce_row, lg, (unsigned)(V * sizeof(T)), &bar);
    bar_wait(&bar, 0);
    lg = (const T *)ce_row;
  }
  if (tgt < 0) {
    if (threadIdx.x == 0) {
      row_loss[row] = 0;
      row_hit[row] = 0;
    }
    if (want_grad)
      for (int32_t v = threadIdx.x; v < V; v += blockDim.x) dl[v] = from_f<T>(0.0f);
    return;
  }
  /* online max / first argmax / sum of exp over the thread's groups of four (the sum rescaled when a
   * group raises the max), then merged over lanes and warps in a fixed order */
  const bool vec = (V & 3) == 0;
  float mx = -FLT_MAX, se = 0;
  int arg = 0x7fffffff;
  for (int32_t v0 = 4 * threadIdx.x; v0 < V; v0 += 4 * blockDim.x) {
    float x[4];
    ce_load4(lg, v0, V, vec, x);
    float gm = x[0];
    int ga = v0;
#pragma unroll
    for (int k = 1; k < 4; k++)
      if (x[k] > gm) gm = x[k], ga = v0 + k;
    if (gm > mx) {
      se *= expf(mx - gm);
      mx = gm;
      arg = ga;
    }
#pragma unroll
    for (int k = 0; k < 4; k++) se += expf(x[k] - mx);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float om = __shfl_xor_sync(0xffffffffu, mx, o);
    const float os = __shfl_xor_sync(0xffffffffu, se, o);
    const int oa = __shfl_xor_sync(0xffffffffu, arg, o);
    const float nm = fmaxf(mx, om);
    se = se * expf(mx - nm) + os * expf(om - nm);
    if (om > mx || (om == mx && oa < arg)) arg = oa;
    mx = nm;
  }
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) {
    redv[w] = mx;
    redi[w] = arg;
    red[w] = se;
  }
  __syncthreads();
  mx = redv[0];
  arg = redi[0];
  se = red[0];
  for (int i = 1; i < nw; i++) {
    const float nm = fmaxf(mx, redv[i]);
    se = se * expf(mx - nm) + red[i] * expf(redv[i] - nm);
    if (redv[i] > mx || (redv[i] == mx && redi[i] < arg)) arg = redi[i];
    mx = nm;
  }
  const float lse = mx + logf(se);
  if (threadIdx.x == 0) {
    row_loss[row] = (double)lse - (double)to_f(lg[tgt]);
    row_hit[row] = arg == tgt;
  }
  if (!want_grad) return;
  const float scale = info->count > 0 ? step->weight / (float)info->count : 0.0f;
  if constexpr (STAGED) { /* eight at a time: 16-byte reads and stores (V % 8 == 0: ce_launch) */
    for (int32_t v0 = 8 * threadIdx.x; v0 < V; v0 += 8 * blockDim.x) {
      float x[2][4], p[8];
      ld_v<4>(lg + v0, x[0]);
      ld_v<4>(lg + v0 + 4, x[1]);
#pragma unroll
      for (int k = 0; k < 8; k++) p[k] = expf(x[k >> 2][k & 3] - lse) * scale - (v0 + k == tgt ? scale : 0.0f);
      st8(dl + v0, p);
    }
  } else {
    for (int32_t v0 = 4 * threadIdx.x; v0 < V; v0 += 4 * blockDim.x) {
      float x[4], p[4];
      ce_load4(lg, v0, V, vec, x);
#pragma unroll
      for (int k = 0; k < 4; k++) p[k] = expf(x[k] - lse) * scale - (v0 + k == tgt ? scale : 0.0f);
      ce_store4(dl, v0, V, vec, p);
    }
  }
}

template <typename T>
__global__ void mse_kernel(const m3k_step *__restrict__ step, const m3k_batch_info *__restrict__ info,
                           const float *__restrict__ pred, const float *__restrict__ bias,
                           const float *__restrict__ target, const uint8_t *__restrict__ mask, float *__restrict__ dpred,
                           T *dpred_act, double *__restrict__ row_loss, int64_t M, int32_t od, int want_grad) {
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= M) return;
  const int counted = mask ? mask[row] != 0 : 1;
  const float scale = info->count > 0 ? 2 * step->weight / (float)info->count : 0.0f;
  double acc = 0;
  for (int32_t j = lane; j < od; j += 32) {
    const float diff = counted ? pred[row * od + j] + bias[j] - target[row * od + j] : 0.0f;
    acc += (double)diff * diff;
    if (want_grad) {
      const float g = diff * scale;
      dpred[row * od + j] = g;
      if (dpred_act) dpred_act[row * od + j] = from_f<T>(g);
    }
  }
  acc = warp_sum_d(acc);
  if (lane == 0) row_loss[row] = acc;
}

extern "C" cudaError_t m3k_embed_fwd(cudaStream_t s, const int32_t *tokens, const float *emb, float *h0, int64_t M,
                                     int32_t dm) {
  embed_fwd_kernel<<<grid_for(M * dm, 256), 256, 0, s>>>(tokens, emb, h0, M, dm);
  return cudaGetLastError();
}

extern "C" cudaError_t m3k_embed_bwd(cudaStream_t s, const m3k_batch_info *info, const int32_t *seg_tok,
                                     const int32_t *seg_start, const int32_t *perm, const float *dh0, float *gemb,
                                     int64_t M, int32_t dm) {
  embed_bwd_kernel<<<(unsigned)M, 128, 0, s>>>(info, seg_tok, seg_start, perm, dh0, gemb, dm);
  return cudaGetLastError();
}

/* A row is staged in shared memory when two CTAs still share a multiprocessor and it moves in whole 16-byte
 * pieces (lm130, bf16: 100.6 KB): its bytes, or 0 where it is not. */
static size_t ce_staged_bytes(int32_t V, size_t elem) {
  const size_t row_bytes = (size_t)V * elem;
  return V % 8 == 0 && row_bytes <= 110 * 1024 ? row_bytes : 0;
}

extern "C" cudaError_t m3k_ce_prepare(int prec, int32_t V) {
  cudaError_t e = cudaSuccess;
  M3K_DISPATCH(prec, {
    const size_t bytes = ce_staged_bytes(V, sizeof(T));
    if (bytes) e = cudaFuncSetAttribute(ce_kernel<T, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
  });
  return e;
}

template <typename T>
static cudaError_t ce_launch(cudaStream_t s, const m3k_step *step, const m3k_batch_info *info, const T *logits,
                             const int32_t *targets, T *dlogits, double *row_loss, int32_t *row_hit, int64_t nb,
                             int32_t V, int want_grad) {
  const size_t row_bytes = ce_staged_bytes(V, sizeof(T));
  if (row_bytes)
    ce_kernel<T, true><<<(unsigned)nb, 512, row_bytes, s>>>(step, info, logits, targets, dlogits, row_loss, row_hit,
                                                           V, want_grad);
  else
    ce_kernel<T, false><<<(unsigned)nb, 512, 0, s>>>(step, info, logits, targets, dlogits, row_loss, row_hit, V,
                                                     want_grad);
  return cudaGetLastError();
}

extern "C" cudaError_t m3k_ce(cudaStream_t s, int prec, const m3k_step *step, const m3k_batch_info *info,
                              const void *logits, const int32_t *targets, void *dlogits, double *row_loss,
                              int32_t *row_hit, int64_t nb, int32_t V, int want_grad) {
  cudaError_t e = cudaSuccess;
  M3K_DISPATCH(prec, (e = ce_launch<T>(s, step, info, (const T *)logits, targets, (T *)dlogits, row_loss, row_hit, nb,
                                       V, want_grad)));
  return e;
}

extern "C" cudaError_t m3k_mse(cudaStream_t s, int prec, const m3k_step *step, const m3k_batch_info *info,
                               const float *pred, const float *bias, const float *target, const uint8_t *mask,
                               float *dpred, void *dpred_act, double *row_loss, int64_t M, int32_t od, int want_grad) {
  M3K_DISPATCH(prec, (mse_kernel<T><<<grid_for(M, 8), 256, 0, s>>>(step, info, pred, bias, target, mask, dpred,
                                                                     (T *)dpred_act, row_loss, M, od, want_grad)));
  return cudaGetLastError();
}

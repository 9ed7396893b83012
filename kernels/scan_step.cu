/*
 * scan_step.cu — the forward scan of a one-token window (a decode step, or a training window of
 * length 1): SPEC.md §3 steps 2-10 for one token,
 *   theta = (theta_in + pi tanh(ang) dt) mod 2 pi,  k, q = rot(B_hat + B_bias, C_hat + C_bias; theta)
 *   H = alpha H_in + beta x_in k_in^T + gamma x k^T,  y = H q + D x,  gated = [RMSNorm_P] y * silu(z)
 * with the same inputs, outputs and formulas as scan_fwd_kernel (scan.cu), which m3k_scan_fwd
 * keeps for longer windows. The backward of a one-token training window (scan_bwd_kernel) reads
 * the theta, y and y_rstd written here.
 *
 * A single token has no recurrence to walk: the work is moving the P x N float32 state of every
 * (row, head) in and out once, so the kernel is built for bandwidth. One CTA of 8 warps per
 * (head h, row b), at most 80 registers so that 3 CTAs share a multiprocessor. First the
 * per-(b, h) work, into shared memory, one item per thread: the token scalars (every thread
 * computes them: no barrier), the angle and rotated k, q of each rotation unit, beta x_in and
 * gamma x of each row p. Then the state: a row p belongs to a group of LW lanes (the power of two
 * covering the row's vectors, at most 32; 32 / LW rows per warp at a time), lane j of a group
 * holding the row's vectors j, j + LW, ... A vector is a float4 (V = 4) when the groups cover the
 * rows exactly (N = 4 LW, or N = 256: two per lane) and the state buffers are 16-byte aligned,
 * else one float (V = 1). Each lane keeps the loads of R rows (32 floats) in flight, the first
 * batch issued before the per-(b, h) work so that the two overlap; loads and stores are streaming
 * (every element moves once). y[p] = H[p, :] q is summed per lane, then over the group by shuffle
 * butterflies (the R rows' interleaved). Last, warp 0 adds D x and applies the optional per-head
 * RMSNorm and the gate exactly as scan_fwd_kernel's epilogue does.
 *
 * In place: decode passes the carried state as both in_* and fin_*. Each element of in_ssm is read
 * and then written by the same thread and never read again, and so is each angle; in_k and in_v
 * are read before the barrier, fin_k and fin_v written after it. A reset at the token counts the
 * incoming state (H, k, x, angles) as zero, as the CPU reference does (the loads are discarded).
 * Every sum has a fixed order: bitwise repeatable.
 */
#include "scan_math.cuh"

enum { STEP_THREADS = 256, STEP_WARPS = STEP_THREADS / 32 };

/* V floats per vector, NJ vectors per lane and row (N <= V NJ LW), lw = LW lanes per row. */
template <int V, int NJ, bool DENSE, typename T>
__global__ void __launch_bounds__(STEP_THREADS, 3) scan_step_kernel(const m3k_scan_args a, const int lw) {
  enum { R = 32 / (V * NJ) }; /* rows per lane group and batch */
  __shared__ float s_kin[256], s_k[256], s_q[256];                  /* [N] incoming k, rotated k, q */
  __shared__ float s_bx[128], s_gx[128], s_x[128], s_z[128], s_y[128]; /* [P] */
  const m3k_dims &d = a.d;
  const int h = blockIdx.x, b = blockIdx.y, g = h / d.hpg;
  const int P = d.P, N = d.N, S = d.S, H = d.H, E = d.E, nv = N / V;
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  const int rw = 32 / lw, lj = lane & (lw - 1);
  const int slot = wid * rw + lane / lw, RS = STEP_WARPS * rw; /* row p = p0 + RS r + slot */
  const int64_t bh = (int64_t)b * H + h, m = b;                 /* m: the token's position */
  const float *hin = a.in_ssm ? a.in_ssm + bh * P * N : NULL;
  float *hout = a.fin_ssm ? a.fin_ssm + bh * P * N : NULL;

  /* The vectors of row p = p0 + RS r + slot at offsets RSTR r + JSTR j from hin + (p0 + slot) N + lj V:
   * compile-time offsets when the lane groups cover the rows exactly (DENSE: N = V NJ LW). */
  const int RSTR = DENSE ? STEP_THREADS * NJ * V : RS * N, JSTR = DENSE ? 32 * V : lw * V;
  float hv[R][NJ][V];
  auto load = [&](int p0) {
    const int64_t o = (int64_t)(p0 + slot) * N + lj * V;
#pragma unroll
    for (int r = 0; r < R; r++) {
      const bool pv = p0 + RS * r + slot < P;
#pragma unroll
      for (int j = 0; j < NJ; j++) {
        if (hin && pv && lj + lw * j < nv) {
          state_vec<V>::load(hin + o + RSTR * r + JSTR * j, hv[r][j]);
        } else {
#pragma unroll
          for (int e = 0; e < V; e++) hv[r][j][e] = 0;
        }
      }
    }
  };
  load(0);

  /* the per-(b, h) work, one item per thread (N - S <= N <= 256 = STEP_THREADS, P <= 128) */
  const T *pr = (const T *)a.proj + m * d.dipp;
  const tok_scalars ts = token_scalars(to_f(pr[d.dt_off + h]), a.dt_bias[h], to_f(pr[d.A_off + h]),
                                       to_f(pr[d.trap_off + h]), d.a_floor);
  const bool rs = a.resets && a.resets[m];
  const float al = rs ? 0.0f : ts.alpha, be = rs ? 0.0f : ts.beta, ga = ts.gamma;
  if (tid < N - S) { /* rotation unit tid: the pair (2 tid, 2 tid + 1), or a passing column */
    float c = 1, sn = 0;
    if (tid < S) {
      const float th0 = a.in_angle && !rs ? a.in_angle[bh * S + tid] : 0.0f;
      const float th = wrap_sum(th0, PI_F * tanhf(to_f(pr[d.ang_off + tid])) * ts.dt);
      a.theta[(m * H + h) * S + tid] = th;
      if (a.fin_angle) a.fin_angle[bh * S + tid] = th;
      sincosf(th, &sn, &c);
    }
    rot_unit<T>(a, m, h, g, tid, c, sn, s_k, s_q);
  }
  if (tid < N) s_kin[tid] = a.in_k && !rs ? a.in_k[bh * N + tid] : 0.0f;
  if (tid < P) {
    const T *px = pr + (int64_t)h * P + tid;
    const float x = to_f(px[d.x_off]);
    s_bx[tid] = be * (a.in_v && !rs ? a.in_v[bh * P + tid] : 0.0f);
    s_gx[tid] = ga * x;
    s_x[tid] = x;
    s_z[tid] = to_f(px[d.z_off]);
  }
  __syncthreads();
  /* every read of in_k and in_v is done: k and x are the final state */
  if (a.fin_k && tid < N) a.fin_k[bh * N + tid] = s_k[tid];
  if (a.fin_v && tid < P) a.fin_v[bh * P + tid] = s_x[tid];

  /* the state, R rows per lane group at a time */
  float kin[NJ][V], kc[NJ][V], qc[NJ][V];
#pragma unroll
  for (int j = 0; j < NJ; j++) {
    const int f = lj + lw * j;
#pragma unroll
    for (int e = 0; e < V; e++) {
      const int n = f * V + e;
      kin[j][e] = f < nv ? s_kin[n] : 0.0f;
      kc[j][e] = f < nv ? s_k[n] : 0.0f;
      qc[j][e] = f < nv ? s_q[n] : 0.0f;
    }
  }
  for (int p0 = 0; p0 < P; p0 += RS * R) {
    if (p0 > 0) load(p0);
    const int64_t o = (int64_t)(p0 + slot) * N + lj * V;
    if (rs) {
#pragma unroll
      for (int r = 0; r < R; r++)
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
          for (int e = 0; e < V; e++) hv[r][j][e] = 0;
    }
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
      const int p = p0 + RS * r + slot;
      const bool pv = p < P;
      const float bx = pv ? s_bx[p] : 0.0f, gx = pv ? s_gx[p] : 0.0f;
      acc[r] = 0;
#pragma unroll
      for (int j = 0; j < NJ; j++)
#pragma unroll
        for (int e = 0; e < V; e++) {
          hv[r][j][e] = al * hv[r][j][e] + bx * kin[j][e] + gx * kc[j][e];
          acc[r] += hv[r][j][e] * qc[j][e];
        }
      if (hout && pv) {
#pragma unroll
        for (int j = 0; j < NJ; j++)
          if (lj + lw * j < nv) state_vec<V>::store(hout + o + RSTR * r + JSTR * j, hv[r][j]);
      }
    }
    /* y over the lane group: the R rows' butterflies interleaved */
    for (int w = 1; w < lw; w <<= 1)
#pragma unroll
      for (int r = 0; r < R; r++) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], w);
#pragma unroll
    for (int r = 0; r < R; r++) {
      const int p = p0 + RS * r + slot;
      if (p < P && lj == 0) s_y[p] = acc[r];
    }
  }
  __syncthreads();

  /* epilogue (warp 0): D x, the mixer norm and the gate, as scan_fwd_kernel's */
  if (wid == 0) {
    T *gated = (T *)a.gated + m * E + (int64_t)h * P;
    float yv[4];
    const float ss = warp_head_y(s_y, s_x, a.D[h], P, a.y + m * E + (int64_t)h * P, yv);
    warp_norm_gate<T>(a, m, h, yv, ss, s_z, gated);
  }
}

template <typename T> static void launch_step(cudaStream_t s, const m3k_scan_args &a) {
  const step_tile t = step_tile_for(a.d.N, ((uintptr_t)a.in_ssm | (uintptr_t)a.fin_ssm) % 16 == 0);
  const dim3 grid(a.d.H, a.rows);
  if (t.V == 1) scan_step_kernel<1, 8, false, T><<<grid, STEP_THREADS, 0, s>>>(a, t.lw);
  else if (t.NJ == 1) scan_step_kernel<4, 1, true, T><<<grid, STEP_THREADS, 0, s>>>(a, t.lw);
  else scan_step_kernel<4, 2, true, T><<<grid, STEP_THREADS, 0, s>>>(a, t.lw);
}

cudaError_t m3k_scan_step(cudaStream_t s, int prec, const m3k_scan_args *a) {
  M3K_DISPATCH(prec, launch_step<T>(s, *a));
  return cudaGetLastError();
}

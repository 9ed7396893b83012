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
 * (head h, row b). When the state moves as float4 vectors (below) it moves in bulk: thread 0
 * starts one TMA copy of the (b, h) state (contiguous, P N floats) into shared memory before
 * anything else, the update runs in place there, and one bulk store writes it back; no registers
 * hold loads in flight, so four CTAs share a multiprocessor. Meanwhile the per-(b, h) work, into
 * shared memory, one item per thread, with every global load issued before any is waited on (one
 * round trip, not a chain): the token scalars (every thread computes them), the angle and rotated
 * k, q of each rotation unit, beta x_in and gamma x of each row p. B and C of the head's group are
 * normalised here from proj (warps 0 and 1 sum the squares as bcnorm_fwd_kernel does, and every value
 * is x r w with its rounding: bitwise its B_hat, C_hat), one launch per layer fewer; the group's first
 * head stores them in bc_hat and bc_rstd for the backward (not when bc_hat is NULL: one-token
 * inference). Then the state: a row p belongs to a group of LW lanes (the power of two covering the
 * row's vectors, at most 32; 32 / LW rows per warp at a time), lane j of a group holding the row's
 * vectors j, j + LW, ... A vector is a float4 (V = 4) when the groups cover the rows exactly (N = 4
 * LW, or N = 256: two per lane) and the state buffers are 16-byte aligned, else one float (V = 1):
 * then each lane loads straight from global memory, keeping the loads of R rows (32 floats) in flight,
 * the first batch issued before the per-(b, h) work so that the two overlap, and stores the same way
 * (streaming: every element moves once). y[p] = H[p, :] q is summed per lane, then over the group by
 * shuffle butterflies (the R rows' interleaved). Last, warp 0 adds D x and applies the optional
 * per-head RMSNorm and the gate exactly as scan_fwd_kernel's epilogue does. (A persistent,
 * double-buffered variant measured no faster: kernels/NOTES.md, runs 22-24.)
 *
 * In place: decode passes the carried state as both in_* and fin_*. Each element of in_ssm is read
 * before it is written (by the bulk copy in, or by the thread that writes it) and never read
 * again, and so is each angle; in_k and in_v are read before the barrier, fin_k and fin_v written
 * after it. A reset at the token counts the incoming state (H, k, x, angles) as zero, as the CPU
 * reference does (the loads are discarded). Every sum has a fixed order: bitwise repeatable.
 */
#include "scan_math.cuh"

enum { STEP_THREADS = 256, STEP_WARPS = STEP_THREADS / 32 };

/* V floats per vector, NJ vectors per lane and row (N <= V NJ LW), lw = LW lanes per row. With V = 4
 * the state moves in bulk through s_state (P N floats of dynamic shared memory). */
template <int V, int NJ, bool DENSE, typename T>
__global__ void __launch_bounds__(STEP_THREADS, V == 4 ? 4 : 3) scan_step_kernel(const m3k_scan_args a, const int lw) {
  enum { BULK = V == 4, R = (BULK ? 16 : 32) / (V * NJ) }; /* R: rows per lane group and batch */
  extern __shared__ __align__(16) float s_state[];                  /* BULK: the (b, h) state [P][N] */
  __shared__ float s_kin[256], s_k[256], s_q[256];                  /* [N] incoming k, rotated k, q */
  __shared__ float s_bx[128], s_gx[128], s_x[128], s_z[128], s_y[128]; /* [P] */
  __shared__ float s_bk[256], s_bq[256];                            /* [N] the head's B_bias, C_bias */
  __shared__ float s_rbc[2];                                        /* inline B/C norm: 1 / RMS of B, C */
  __shared__ uint64_t s_bar;                                        /* BULK: the copy in has landed */
  const m3k_dims &d = a.d;
  const int h = grid_x(d.H), b = grid_row(d.H), g = h / d.hpg;
  const int P = d.P, N = d.N, S = d.S, H = d.H, E = d.E, nv = N / V;
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  const int rw = 32 / lw, lj = lane & (lw - 1);
  const int slot = wid * rw + lane / lw, RS = STEP_WARPS * rw; /* row p = p0 + RS r + slot */
  const int64_t bh = (int64_t)b * H + h, m = b;                 /* m: the token's position */
  const float *hin = a.in_ssm ? a.in_ssm + bh * P * N : NULL;
  float *hout = a.fin_ssm ? a.fin_ssm + bh * P * N : NULL;
  const unsigned state_bytes = (unsigned)(P * N * sizeof(float));
  if (BULK && tid == 0) {
    bar_init(&s_bar);
    if (hin) bulk_load(s_state, hin, state_bytes, &s_bar);
  }

  /* The vectors of row p = p0 + RS r + slot at offsets RSTR r + JSTR j from (p0 + slot) N + lj V:
   * compile-time offsets when the lane groups cover the rows exactly (DENSE: N = V NJ LW). */
  const int RSTR = DENSE ? STEP_THREADS * NJ * V : RS * N, JSTR = DENSE ? 32 * V : lw * V;
  float hv[R][NJ][V];
  auto load = [&](int p0) {
    const int o = (p0 + slot) * N + lj * V; /* < P N <= 32768 */
#pragma unroll
    for (int r = 0; r < R; r++) {
      const bool pv = p0 + RS * r + slot < P;
#pragma unroll
      for (int j = 0; j < NJ; j++) {
        const int oe = o + RSTR * r + JSTR * j;
        if (hin && pv && lj + lw * j < nv) {
          if (BULK) {
            const float4 t = *(const float4 *)(s_state + oe);
            hv[r][j][0] = t.x, hv[r][j][1] = t.y, hv[r][j][2] = t.z, hv[r][j][3] = t.w;
          } else {
            state_vec<V>::load(hin + oe, hv[r][j]);
          }
        } else {
#pragma unroll
          for (int e = 0; e < V; e++) hv[r][j][e] = 0;
        }
      }
    }
  };
  if (!BULK) load(0);

  /* the per-(b, h) work, one item per thread (N - S <= N <= 256 = STEP_THREADS, P <= 128): every
   * load first (nothing waits on one before all are issued), then the math */
  const T *pr = (const T *)a.proj + m * d.dipp;
  const float dd_dt = to_f(pr[d.dt_off + h]), dt_bias = a.dt_bias[h], dd_A = to_f(pr[d.A_off + h]);
  const float trap = to_f(pr[d.trap_off + h]);
  const bool rs = a.resets && a.resets[m];
  const int U = N - S;
  float ang = 0, th0 = 0, kin0 = 0, x = 0, z = 0, vin = 0; /* kin0: this thread's in_k element */
  unit_raw raw = {0, 0, 0, 0}, wbc = {0, 0, 0, 0}; /* wbc: the B/C norm weights of the unit */
  if (tid < S) {
    ang = to_f(pr[d.ang_off + tid]);
    if (a.in_angle) th0 = a.in_angle[bh * S + tid];
  }
  const T *pB = pr + d.B_off + (int64_t)g * N, *pC = pr + d.C_off + (int64_t)g * N; /* raw B, C of group g */
  if (tid < U) {
    raw = unit_load(pB, pC, tid, S);
    wbc = unit_load(a.B_norm, a.C_norm, tid, S);
  }
  if (tid < N) {
    cp4(s_bk + tid, a.B_bias + (int64_t)h * N + tid);
    cp4(s_bq + tid, a.C_bias + (int64_t)h * N + tid);
    if (a.in_k) kin0 = a.in_k[bh * N + tid];
  }
  if (tid < P) {
    const T *px = pr + (int64_t)h * P + tid;
    x = to_f(px[d.x_off]);
    z = to_f(px[d.z_off]);
    if (a.in_v) vin = a.in_v[bh * P + tid];
  }
  if (wid < 2) { /* B (warp 0), C (warp 1): 1 / RMS over N, summed as bcnorm_fwd_kernel does */
    const float r = warp_rstd(wid ? pC : pB, N);
    if (lane == 0) s_rbc[wid] = r;
  }
  cp_wait_all();
  __syncthreads(); /* s_bk, s_bq, s_rbc */
  /* B_hat, C_hat of the unit = x r w, bcnorm_fwd_kernel's rounding */
  raw.k0 = raw.k0 * s_rbc[0] * wbc.k0;
  raw.k1 = raw.k1 * s_rbc[0] * wbc.k1;
  raw.q0 = raw.q0 * s_rbc[1] * wbc.q0;
  raw.q1 = raw.q1 * s_rbc[1] * wbc.q1;
  if (a.bc_hat && h % d.hpg == 0) { /* kept for the backward by the group's first head */
    float *bk = a.bc_hat + ((m * 2 + 0) * d.G + g) * N, *bq = a.bc_hat + ((m * 2 + 1) * d.G + g) * N;
    if (tid < U) {
      const int n0 = unit_col(tid, S);
      bk[n0] = raw.k0;
      bq[n0] = raw.q0;
      if (tid < S) {
        bk[n0 + 1] = raw.k1;
        bq[n0 + 1] = raw.q1;
      }
    }
    if (tid < 2) a.bc_rstd[(m * 2 + tid) * d.G + g] = s_rbc[tid];
  }

  const tok_scalars ts = token_scalars(dd_dt, dt_bias, dd_A, trap, d.a_floor);
  const float al = rs ? 0.0f : ts.alpha, be = rs ? 0.0f : ts.beta, ga = ts.gamma;
  if (tid < U) { /* rotation unit tid: the pair (2 tid, 2 tid + 1), or a passing column */
    float th = 0;
    if (tid < S) {
      th = wrap_sum(rs ? 0.0f : th0, PI_F * tanhf(ang) * ts.dt);
      a.theta[(m * H + h) * S + tid] = th;
      if (a.fin_angle) a.fin_angle[bh * S + tid] = th;
    }
    const unit_kq r = unit_make(raw, s_bk, s_bq, tid, S, th);
    s_k[r.n0] = r.k0;
    s_q[r.n0] = r.q0;
    if (r.pair) {
      s_k[r.n0 + 1] = r.k1;
      s_q[r.n0 + 1] = r.q1;
    }
  }
  if (tid < N) s_kin[tid] = rs ? 0.0f : kin0;
  if (tid < P) {
    s_bx[tid] = be * (rs ? 0.0f : vin);
    s_gx[tid] = ga * x;
    s_x[tid] = x;
    s_z[tid] = z;
  }
  __syncthreads();
  /* every read of in_k and in_v is done: k and x are the final state */
  if (a.fin_k && tid < N) a.fin_k[bh * N + tid] = s_k[tid];
  if (a.fin_v && tid < P) a.fin_v[bh * P + tid] = s_x[tid];
  if (BULK && hin) bar_wait(&s_bar, 0);

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
    if (BULK || p0 > 0) load(p0);
    const int o = (p0 + slot) * N + lj * V;
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
          if (lj + lw * j < nv) {
            const int oe = o + RSTR * r + JSTR * j;
            if (BULK) *(float4 *)(s_state + oe) = make_float4(hv[r][j][0], hv[r][j][1], hv[r][j][2], hv[r][j][3]);
            else state_vec<V>::store(hout + oe, hv[r][j]);
          }
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
  if (BULK) bulk_store_fence();
  __syncthreads();
  if (BULK && hout && tid == 0) bulk_store(hout, s_state, state_bytes);

  /* epilogue (warp 0): D x, the mixer norm and the gate, as scan_fwd_kernel's */
  if (wid == 0) {
    T *gated = (T *)a.gated + m * E + (int64_t)h * P;
    float yv[4];
    const float ss = warp_head_y(s_y, s_x, a.D[h], P, (T *)a.y + m * E + (int64_t)h * P, yv);
    warp_norm_gate<T>(a, m, h, yv, ss, s_z, gated);
  }
  if (BULK && tid == 0) bulk_store_drain();
}

template <typename T> static void launch_step(cudaStream_t s, const m3k_scan_args &a) {
  const step_tile t = step_tile_for(a.d.N, ((uintptr_t)a.in_ssm | (uintptr_t)a.fin_ssm) % 16 == 0);
  const dim3 grid = rows_grid(a.d.H, a.rows);
  const size_t smem = m3k_step_smem(a.d.P, a.d.N);
  if (t.V == 1) scan_step_kernel<1, 8, false, T><<<grid, STEP_THREADS, 0, s>>>(a, t.lw);
  else if (t.NJ == 1) scan_step_kernel<4, 1, true, T><<<grid, STEP_THREADS, smem, s>>>(a, t.lw);
  else scan_step_kernel<4, 2, true, T><<<grid, STEP_THREADS, smem, s>>>(a, t.lw);
}

template <typename T> static cudaError_t step_prepare(int smem) {
  cudaError_t e = cudaFuncSetAttribute(scan_step_kernel<4, 1, true, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(scan_step_kernel<4, 2, true, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  return e;
}

cudaError_t m3k_scan_step_prepare(int prec, int32_t smem) {
  M3K_DISPATCH(prec, return step_prepare<T>(smem));
  return cudaSuccess;
}

cudaError_t m3k_scan_step(cudaStream_t s, int prec, const m3k_scan_args *a) {
  M3K_DISPATCH(prec, launch_step<T>(s, *a));
  return cudaGetLastError();
}

/*
 * scan_warp.cu — the forward scan (SPEC.md §3 steps 2-10, as scan_fwd_kernel in scan.cu) of small
 * states, for the shapes of warp_fwd_shape (16 x 16, the rl configs): the recurrence on two warps,
 * pipelined with the work around it.
 *
 * scan_fwd_kernel spreads a (row, head) over a CTA of one thread per state element; at 16 x 16 that
 * CTA spends its time in barriers and cross-warp sums, one phase after another (kernels/NOTES.md,
 * run 91: a warp alone is no faster, every phase a chain of latencies). Here a CTA of seven warps walks
 * the row's tokens in chunks of WCH = 32 (16 for windows of at most 64, such as rl's 32, so that they
 * still overlap their steps), four chunks in flight (a ring of four slots of shared memory), one step
 * per chunk, a barrier of the CTA after each step:
 *   warps 3-6 (loaders)  A(c): every load of chunk c in flight at once (the token scalars, tanh of the
 *            angle logits, x and z, the raw B and C), then B_hat + B_bias and C_hat + C_bias (the B/C
 *            RMSNorm here, a token's N values on N lanes, summed and rounded as bcnorm_fwd_kernel does;
 *            the group's first head stores B_hat, C_hat and their 1 / RMS for the backward), then
 *            E(c - 3): D x, the optional per-head RMSNorm and the gate, two tokens a warp at a time;
 *   warp 2   B(c - 1): the angle walk (one lane per rotated pair, sequential as scan_fwd_kernel's),
 *            then C(c - 1): the pairs of k and q rotated in place, and the next chunk's row 0;
 *   warps 0-1  D(c - 2): the recurrence H_t = alpha H_{t-1} + beta x_{t-1} k_{t-1}^T + gamma x_t k_t^T
 *            and H_t q_t. Rows of the state are independent, so each warp keeps P / 2 of them in its
 *            registers: lane l holds NS consecutive elements of one row, LPR lanes a row, and y = H q
 *            is an in-lane sum and a butterfly over the row's lanes.
 * In training (a.chunk_states set) the D warps also keep the state entering each 64-token chunk after the first,
 * for the small states' backward (scan_small.cu, small_bwd_states).
 * The sums round as scan_fwd_kernel's: y over n pairwise in lane order (the in-lane tree, then the
 * butterfly), the norm's sum of squares in warp_sum's order. Resets, carried states and any window
 * length as there.
 */
#include "scan_math.cuh"

enum { NSLOT = 4, DW = 2, WALK = DW, LW = 4, LOAD0 = DW + 1 }; /* ring slots; warp roles */
enum { WARP_THREADS = 32 * (DW + 1 + LW), NL = 32 * LW };       /* threads; loader threads */

template <int P, int N, int WCH> struct warp_slot {
  float k[WCH + 1][N];   /* rotated k; row 0: the token before the chunk */
  float q[WCH][N];       /* rotated q */
  float x[WCH + 1][P];   /* row 0: the token before the chunk */
  float z[WCH][P];
  float y[WCH][P];       /* H q */
  float th[WCH][N / 2];  /* tanh of the angle logits, then the angles */
  float sc[WCH][4];      /* alpha and beta (0 at a reset), gamma, dt */
  float rs[WCH];         /* 1 at a reset */
};

template <int P, int N, int WCH, typename T>
__global__ void __launch_bounds__(WARP_THREADS) scan_fwd_warp_kernel(const m3k_scan_args a) {
  constexpr int RPW = P / DW, NS = RPW * N / 32, LPR = N / NS; /* rows a D warp, state a lane, lanes a row */
  constexpr int RX = WCH * P / NL, RK = WCH * N / NL;           /* A's items a loader */
  static_assert(P % DW == 0 && RPW * N % 32 == 0 && NS % 4 == 0 && N % NS == 0 && 32 % P == 0 && 32 % N == 0 &&
                    WCH * P % NL == 0 && NL % N == 0 && N / 2 <= 32,
                "a shape the lane layouts cover");
  __shared__ __align__(16) warp_slot<P, N, WCH> ring[NSLOT];
  const m3k_dims &d = a.d;
  const int h = grid_x(a.d.H), b = grid_row(a.d.H), tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int S = d.S, H = d.H, E = d.E, g = h / d.hpg, nch = (a.len + WCH - 1) / WCH;
  const int nch64 = (a.len + M3K_CHUNK - 1) / M3K_CHUNK;
  if (nch == 0) return;
  const int64_t bh = (int64_t)b * H + h;
  const T *proj = (const T *)a.proj;
  const int chunk_len_last = a.len - (nch - 1) * WCH;
  auto chunk_len = [&](int c) { return c == nch - 1 ? chunk_len_last : WCH; };

  /* D warps: their rows of the state; the walk warp, lanes j < S: the angle of pair j */
  const int prow = warp * RPW + lane / LPR, c0 = (lane % LPR) * NS;
  float hs[NS];
  if (warp < DW) {
#pragma unroll
    for (int e = 0; e < NS; e++) hs[e] = a.in_ssm ? a.in_ssm[(bh * P + prow) * N + c0 + e] : 0.0f;
  }
  float run = warp == WALK && lane < S && a.in_angle ? a.in_angle[bh * S + lane] : 0.0f;
  const int lt = tid - 32 * LOAD0; /* loaders: 0 .. NL - 1 */
  const float kbias = warp >= LOAD0 ? a.B_bias[(int64_t)h * N + lt % N] : 0.0f; /* the column of lt + NL r */
  const float qbias = warp >= LOAD0 ? a.C_bias[(int64_t)h * N + lt % N] : 0.0f;
  const float kw = warp >= LOAD0 ? a.B_norm[lt % N] : 0.0f, qw = warp >= LOAD0 ? a.C_norm[lt % N] : 0.0f;
  const bool keeps_bc = a.bc_hat && h % d.hpg == 0; /* stores B_hat, C_hat for the backward */

  for (int s = 0; s < nch + 3; s++) {
    if (warp < DW) {
      const int c = s - 2;
      if (c >= 0 && c < nch) { /* D(c) */
        warp_slot<P, N, WCH> &r = ring[c % NSLOT];
        const int nb = chunk_len(c);
#pragma unroll 4
        for (int i = 0; i < nb; i++) {
          const float al = r.sc[i][0], bx = r.sc[i][1] * r.x[i][prow], gx = r.sc[i][2] * r.x[i + 1][prow];
          float kp[NS], kc[NS], v[NS];
#pragma unroll
          for (int e = 0; e < NS; e += 4) {
            *(float4 *)&kp[e] = *(const float4 *)&r.k[i][c0 + e];
            *(float4 *)&kc[e] = *(const float4 *)&r.k[i + 1][c0 + e];
            *(float4 *)&v[e] = *(const float4 *)&r.q[i][c0 + e];
          }
#pragma unroll
          for (int e = 0; e < NS; e++) {
            hs[e] = al * hs[e] + bx * kp[e] + gx * kc[e];
            v[e] *= hs[e];
          }
#pragma unroll
          for (int o = 1; o < NS; o <<= 1)
#pragma unroll
            for (int e = 0; e < NS; e += 2 * o) v[e] += v[e + o];
          float acc = v[0];
#pragma unroll
          for (int o = 1; o < LPR; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
          if (lane % LPR == 0) r.y[i][prow] = acc;
        }
        if (a.chunk_states && ((c + 1) * WCH) % M3K_CHUNK == 0 && (c + 1) * WCH < a.len) { /* small_bwd_states */
          float *st = a.chunk_states + (bh * nch64 + (c + 1) * WCH / M3K_CHUNK) * P * N + prow * N + c0;
#pragma unroll
          for (int e = 0; e < NS; e++) st[e] = hs[e];
        }
      }
    } else if (warp == WALK) {
      const int c = s - 1;
      if (c >= 0 && c < nch) {
        warp_slot<P, N, WCH> &r = ring[c % NSLOT];
        const int nb = chunk_len(c);
        const int64_t m0 = (int64_t)b * a.len + (int64_t)c * WCH;
        if (lane < S) { /* B(c): the increments first, then a chain of selects and adds */
          float inc[WCH], rsf[WCH];
#pragma unroll
          for (int i = 0; i < WCH; i++) {
            inc[i] = i < nb ? PI_F * r.th[i][lane] * r.sc[i][3] : 0.0f;
            rsf[i] = i < nb ? r.rs[i] : 0.0f;
          }
#pragma unroll
          for (int i = 0; i < WCH; i++) {
            if (i < nb) {
              if (rsf[i] != 0) run = 0;
              run = wrap_sum(run, inc[i]);
              r.th[i][lane] = run;
            }
          }
        }
        __syncwarp();
        for (int idx = lane; idx < nb * S; idx += 32) { /* C(c) */
          const int i = idx / S, j = idx - i * S;
          const float th = r.th[i][j];
          rotate_pair(&r.k[i + 1][2 * j], &r.q[i][2 * j], th);
          __stcg(a.theta + ((m0 + i) * H + h) * S + j, th);
        }
        __syncwarp();
        if (c + 1 < nch) { /* the next chunk's row 0: this chunk's last token (nb = WCH) */
          warp_slot<P, N, WCH> &nx = ring[(c + 1) % NSLOT];
          if (lane < N) nx.k[0][lane] = r.k[WCH][lane];
          if (lane < P) nx.x[0][lane] = r.x[WCH][lane];
        }
      }
    } else {
      if (s < nch) { /* A(s) */
        warp_slot<P, N, WCH> &r = ring[s % NSLOT];
        const int nb = chunk_len(s);
        const int64_t m0 = (int64_t)b * a.len + (int64_t)s * WCH;
        float xr[RX], zr[RX], kr[RK], qr[RK], tr[RK];
#pragma unroll
        for (int k = 0; k < RX; k++) {
          const int idx = lt + NL * k, i = idx / P, p = idx % P;
          const T *pr = proj + (m0 + i) * d.dipp + (int64_t)h * P + p;
          xr[k] = i < nb ? to_f(pr[d.x_off]) : 0.0f;
          zr[k] = i < nb ? to_f(pr[d.z_off]) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < RK; k++) {
          const int idx = lt + NL * k, i = idx / N, n = idx % N;
          const T *pb = proj + (m0 + i) * d.dipp + d.B_off + (int64_t)g * N + n;
          kr[k] = i < nb ? to_f(pb[0]) : 0.0f;
          qr[k] = i < nb ? to_f(pb[d.C_off - d.B_off]) : 0.0f;
          const int it = S ? idx / S : 0, j = idx - it * S; /* S = 0: no rotated pairs */
          tr[k] = idx < nb * S ? to_f(proj[(m0 + it) * d.dipp + d.ang_off + j]) : 0.0f;
        }
        if (lt < nb) {
          const T *pr = proj + (m0 + lt) * d.dipp;
          const tok_scalars ts = row_scalars(a, pr, h);
          const bool rs = a.resets && a.resets[m0 + lt];
          r.sc[lt][0] = rs ? 0.0f : ts.alpha;
          r.sc[lt][1] = rs ? 0.0f : ts.beta;
          r.sc[lt][2] = ts.gamma;
          r.sc[lt][3] = ts.dt;
          r.rs[lt] = rs ? 1.0f : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < RX; k++) {
          const int idx = lt + NL * k, i = idx / P, p = idx % P;
          r.x[i + 1][p] = xr[k];
          r.z[i][p] = zr[k];
        }
#pragma unroll
        for (int k = 0; k < RK; k++) { /* B_hat, C_hat: warp_rstd's sums (its first stage adds lanes >= N's zeros) */
          const int idx = lt + NL * k, i = idx / N, n = idx % N;
          float sk = kr[k] * kr[k], sq = qr[k] * qr[k];
#pragma unroll
          for (int o = N / 2; o >= 1; o >>= 1) {
            sk += __shfl_xor_sync(0xffffffffu, sk, o);
            sq += __shfl_xor_sync(0xffffffffu, sq, o);
          }
          const float rk = rms_inv(sk, N), rq = rms_inv(sq, N);
          kr[k] = kr[k] * rk * kw;
          qr[k] = qr[k] * rq * qw;
          if (keeps_bc && i < nb) {
            float *bc = a.bc_hat + ((m0 + i) * 2 * d.G + g) * N + n;
            bc[0] = kr[k];
            bc[(int64_t)d.G * N] = qr[k];
            if (n == 0) {
              a.bc_rstd[((m0 + i) * 2 + 0) * d.G + g] = rk;
              a.bc_rstd[((m0 + i) * 2 + 1) * d.G + g] = rq;
            }
          }
        }
#pragma unroll
        for (int k = 0; k < RK; k++) {
          const int idx = lt + NL * k, i = idx / N, n = idx % N;
          r.k[i + 1][n] = kr[k] + kbias;
          r.q[i][n] = qr[k] + qbias;
          const int it = S ? idx / S : 0, j = idx - it * S;
          if (idx < nb * S) r.th[it][j] = tanhf(tr[k]);
        }
        if (s == 0) { /* chunk 0's row 0: the carried state */
          if (lt < N) r.k[0][lt] = a.in_k ? a.in_k[bh * N + lt] : 0.0f;
          if (lt < P) r.x[0][lt] = a.in_v ? a.in_v[bh * P + lt] : 0.0f;
        }
      }
      const int c = s - 3;
      if (c >= 0 && c < nch) { /* E(c) */
        const warp_slot<P, N, WCH> &r = ring[c % NSLOT];
        const int nb = chunk_len(c), p = lane % P;
        const int64_t m0 = (int64_t)b * a.len + (int64_t)c * WCH;
        const float Dh = a.D[h];
        T *gated = (T *)a.gated;
#pragma unroll
        for (int i0 = (warp - LOAD0) * (32 / P); i0 < WCH; i0 += LW * (32 / P)) {
          const int i = i0 + lane / P;
          const bool ok = i < nb;
          const float y = ok ? r.y[i][p] + Dh * r.x[i + 1][p] : 0.0f;
          const int64_t mi = m0 + i;
          float rn = 1;
          if (d.outproj_norm) {
            float ss = y * y;
#pragma unroll
            for (int o = P / 2; o >= 1; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            rn = rms_inv(ss, P);
          }
          if (ok) {
            __stcg((T *)a.y + mi * E + (int64_t)h * P + p, from_f<T>(y));
            if (d.outproj_norm && p == 0) __stcg(a.y_rstd + mi * H + h, rn);
            __stcg(gated + mi * E + (int64_t)h * P + p, from_f<T>(gate_value(a, h, p, y, rn, r.z[i][p])));
          }
        }
      }
    }
    __syncthreads();
  }

  /* the carried state: the last chunk's last token */
  if (warp < DW && a.fin_ssm) {
#pragma unroll
    for (int e = 0; e < NS; e++) a.fin_ssm[(bh * P + prow) * N + c0 + e] = hs[e];
  }
  if (warp == WALK) {
    const warp_slot<P, N, WCH> &last = ring[(nch - 1) % NSLOT];
    if (a.fin_k && lane < N) a.fin_k[bh * N + lane] = last.k[chunk_len_last][lane];
    if (a.fin_v && lane < P) a.fin_v[bh * P + lane] = last.x[chunk_len_last][lane];
    if (a.fin_angle && lane < S) a.fin_angle[bh * S + lane] = run;
  }
}

template <typename T> static void warp_fwd(cudaStream_t s, const m3k_scan_args &a) {
  const dim3 grid = rows_grid(a.d.H, a.rows);
  if (a.len <= 64) scan_fwd_warp_kernel<16, 16, 16, T><<<grid, WARP_THREADS, 0, s>>>(a);
  else scan_fwd_warp_kernel<16, 16, 32, T><<<grid, WARP_THREADS, 0, s>>>(a);
}

cudaError_t m3k_warp_fwd(cudaStream_t s, int prec, const m3k_scan_args *a) {
  M3K_DISPATCH(prec, warp_fwd<T>(s, *a));
  return cudaGetLastError();
}

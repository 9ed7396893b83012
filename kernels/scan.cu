/*
 * scan.cu — the Mamba-3 SISO mixer core of SPEC.md §3 steps 2-10 (and §4, §5) on the GPU:
 * per token t and head h (group g)
 *   dt = softplus(dd_dt + dt_bias), A = min(-f(dd_A), -a_floor), lam = sigmoid(trap)
 *   alpha = exp(A dt), beta = (1 - lam) dt alpha, gamma = lam dt
 *   theta_t = (theta_{t-1} + pi tanh(ang_t) dt) mod 2 pi        (float32, saved per token)
 *   k = rot(B_hat + B_bias[h], theta_t), q = rot(C_hat + C_bias[h], theta_t)
 *   H_t = alpha H_{t-1} + beta x_{t-1} k_{t-1}^T + gamma x_t k_t^T,  y = H_t q + D x_t
 *   gated = y * silu(z)   or   RMSNorm_P(y; norm) * silu(z)   (outproj_norm)
 * with the carried state (theta, H, k_prev, x_prev) entering at t = 0 and resets zeroing it
 * before a token.
 *
 * Thread mapping (both directions): one CTA per (head, row) walks the row's tokens in order;
 * the P x N float32 state lives in registers, thread (ti, tj) owning rows p = ti + pth r
 * (r < RP) and columns n = tj + nth c (c < RN). Per block of TB tokens the CTA first loads,
 * in parallel, everything the block needs from global memory (token scalars, tanh of the angle
 * logits, x, z, ...) into shared memory, so the few sequential walks (the angle cumsum, the
 * decay recursion) touch shared memory only; then every thread advances its state elements
 * through the block (the recurrence is elementwise: no communication inside a token).
 * Reductions over n are warp-shuffle butterflies over the tj lanes; reductions over p are
 * butterflies over the ti lanes of a warp, then per-warp partials in shared memory summed per
 * token in warp order (in sub-blocks of SB tokens, to bound shared memory). Every sum has a
 * fixed order. Any window length works (the last block is partial); P <= 128 and N <= 256
 * (m3k_scan_make_plan). Both kernels are also compiled for the fixed shapes of SHAPE_DISPATCH
 * (SIMT_DISPATCH: P, N, the tile and the thread counts as constants, so that the index arithmetic
 * and the butterflies fold; NOTES.md run 74). The forward of the shapes of warp_fwd_shape (16 x 16)
 * is scan_warp.cu's instead: a pipeline of seven warps per (row, head), the recurrence on two; their
 * backward over windows of more than one 64-token chunk is scan_small.cu's (takes_small_bwd), chunked.
 *
 * Backward (one kernel, two sweeps over the row; nothing is saved but theta and y):
 *   sweep F (forward in time) rebuilds H_t from the incoming state and forms
 *     dq_t = H_t^T dy_t, then dq-part of the rotation backward and psi_t = dq_t . q_t;
 *     it also runs the gate backward (dz, dy, the mixer norm) and dD.
 *   sweep R (reverse in time) carries dH (dH_{t-1} = alpha_t (dH_t + dy_t q_t^T), cut at resets)
 *     and needs only two reductions per token: w_t = g_t k_{t-1} (over n) and
 *     u_t = g_t^T x_{t-1} (over p), with g_t = dH_t + dy_t q_t^T. Everything else follows:
 *       hk_t  = dy_t (q_t.k_t) + alpha_{t+1} w_{t+1},   dHtx_t = (dy_t.x_t) q_t + alpha_{t+1} u_{t+1}
 *       dx_t  = beta_{t+1} w_{t+1} + D dy_t + gamma_t hk_t,   dk_t = beta_{t+1} u_{t+1} + gamma_t dHtx_t
 *       dgamma_t = x_t.hk_t,   dbeta_t = x_{t-1}.w_t
 *     and the decay gradient alpha_t dL/dalpha_t = <g_t, alpha_t H_{t-1}> from the scalar recursion
 *       phi_t = <g_t, H_t> = psi_t + alpha-valid (phi_{t+1} - beta_{t+1} dbeta_{t+1} - gamma_{t+1} dgamma_{t+1}),
 *       alpha_t dL/dalpha_t = phi_t - beta_t dbeta_t - gamma_t dgamma_t,
 *     so no state history is stored. Then the rotation backward, the angle gradient (a reverse
 *     cumulative sum stopped at resets) and the scalar chain to dd_dt, dd_A, trap.
 *   Sweep R starts with the window's last block, which sweep F left in shared memory: only the blocks
 *   before it are loaded twice (a window of one block, rl's, loads once).
 *   At 16 x 16 the sweeps' token loops are sweep_f16 / sweep_r16 (four tokens at a time). Loops that
 *   run once or hold no latency are not unrolled: a one-block window runs each phase's code once,
 *   so the kernel's time follows its code size (instruction fetch; NOTES.md runs 110-114).
 * Outputs: activation gradients "=" (dproj columns z, x, dd_dt, dd_A, trap of head h; per-head
 * dbc_head / dang_head, summed over heads by bcnorm.cu); parameter gradients as per-(row, head)
 * partials "=" (part, part_norm), added "+=" to the gradient arena in row order by extra CTAs of
 * the B/C norm backward's launch (bcnorm.cu). Every sum has a fixed order: bitwise repeatable.
 *
 * Numerics: float32 throughout, precise expf/log1pf/tanhf/sincosf/fmodf (no fast math), the
 * same formulas and clamps as the CPU reference (engine/src/cpu/scan.c).
 */
#include <stdio.h>
#include <stdlib.h>

#include "scan_math.cuh"

enum { SC_W = 20 }; /* scalars per token in the backward's shared table */
enum { S_ALPHA = 0, S_BETA, S_GAMMA, S_DT, S_LAM, S_DSP, S_DAD, S_A, S_RESET, S_ALPHA_RAW, S_BETA_RAW, S_QK, S_DYX,
       S_DGAMMA, S_DBETA, S_PSI, S_AD, S_DV };

/* token-loop unrolling of the recurrence: small thread tiles interleave tokens */
template <int RP, int RN> struct unroll_of {
  static constexpr int value = RP * RN <= 4 ? 4 : (RP * RN <= 16 ? 2 : 1);
};

/* ---- geometry and reductions ---------------------------------------------------------------- */

__host__ __device__ constexpr int pow2_at_least(int v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

/* The thread tile of (P, N): the first of the tiles (rp x rn state elements per thread) whose
 * pth x nth threads (powers of two covering P and N) number at most 256, else 512; pth doubled up
 * to whole warps. rp = 0: none fits. The plan (m3k_scan_make_plan) and the kernels compiled for a
 * fixed shape (SIMT_DISPATCH) both take it from here. */
struct simt_tile {
  int rp, rn, pth, nth;
};
__host__ __device__ constexpr simt_tile simt_tile_for(int P, int N) {
  constexpr int tiles[][2] = {{1, 1}, {1, 2}, {2, 2}, {2, 4}, {4, 4}, {4, 8}, {4, 16}};
  for (int limit = 256; limit <= 512; limit *= 2)
    for (const auto &t : tiles) {
      simt_tile g = {t[0], t[1], pow2_at_least((P + t[0] - 1) / t[0]), pow2_at_least((N + t[1] - 1) / t[1])};
      if (g.pth * g.nth > limit) continue;
      while (g.pth * g.nth < 32) g.pth *= 2; /* whole warps: every lane takes part in the shuffles */
      return g;
    }
  return simt_tile{0, 0, 0, 0};
}

/* Thread (ti, tj) = (tid / nth, tid % nth); pth * nth >= 32 and both are powers of two, so a
 * warp holds whole groups of tj lanes (nth <= 32) or a slice of one group (nth > 32). */
struct geo {
  int pth, nth, TB, SB;
  int YQ;  /* partials per (token, p) after the in-warp sum over tj: max(1, nth / 32) */
  int LT;  /* ti values per warp: max(1, 32 / nth) */
  int UQ;  /* partials per (token, n) after the in-warp sum over ti: pth / LT */
  int UQ1; /* UQ rounded up to odd (bank-conflict-free row stride) */
};

__host__ __device__ inline geo make_geo(int pth, int nth, int TB, int SB) {
  geo g;
  g.pth = pth;
  g.nth = nth;
  g.TB = TB;
  g.SB = SB;
  g.YQ = nth > 32 ? nth / 32 : 1;
  g.LT = nth < 32 ? 32 / nth : 1;
  g.UQ = pth / g.LT;
  g.UQ1 = g.UQ | 1;
  return g;
}

/* The launch's geometry; for a kernel compiled for a fixed shape (PK, NK > 0) pth and nth (and what
 * follows from them) are constants: the tile simt_tile_for picks, which is the plan's. */
template <int RP, int RN, int PK, int NK> __device__ __forceinline__ geo kernel_geo(const geo &run) {
  if constexpr (PK == 0) {
    return run;
  } else {
    constexpr simt_tile t = simt_tile_for(PK, NK);
    static_assert(t.rp == RP && t.rn == RN, "a fixed shape runs the tile simt_tile_for picks");
    return make_geo(t.pth, t.nth, run.TB, run.SB);
  }
}

/* sum over the tj lanes of this thread's group inside the warp (fixed butterfly order) */
__device__ __forceinline__ float sum_tj(float v, int nth) {
  const int w = nth < 32 ? nth : 32;
#pragma unroll
  for (int o = 1; o < w; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/* sum over the ti lanes of this warp that share tj */
__device__ __forceinline__ float sum_ti(float v, int nth) {
#pragma unroll
  for (int o = nth; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/* Per-token sums over a token's P (or N) values, several tokens a warp: groups of tok_lanes(w) lanes (the
 * power of two covering w, the widest sum of the loop, at most 32), lane l of a group taking elements l,
 * l + L, ... and group_sum adding them in the order of warp_sum's last log2 L stages. Where a warp held
 * one token, warp_sum's first stages only added the idle lanes' zeros: the sums are the same, with fewer
 * shuffles in the chain and every lane busy. */
__host__ __device__ constexpr int tok_lanes(int w) { return w >= 32 ? 32 : pow2_at_least(w); }

__device__ __forceinline__ float group_sum(float v, int L) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    if (o < L) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/* body(i, on, l, slot) for the block's tokens i < nb by groups of L lanes (l: the lane in its group; slot:
 * the group's index in the block, nw * 32 / L of them). Every lane runs every round for the shuffles: on
 * is false for a group past the last token. */
template <typename F> __device__ __forceinline__ void token_groups(int nb, int L, int nw, F body) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, per_warp = 32 / L, gi = lane / L;
#pragma unroll 1
  for (int i0 = wid * per_warp; i0 < nb; i0 += nw * per_warp)
    body(i0 + gi, i0 + gi < nb, lane - gi * L, wid * per_warp + gi);
}

/* ---- shared-memory layouts (floats) ---------------------------------------------------------- */

struct fwd_smem {
  float *kbuf;  /* [TB+1][Np] rotated k; slot 0: the previous token */
  float *qbuf;  /* [TB][Np] rotated q */
  float *xbuf;  /* [TB+1][Pp] x; slot 0: the previous token */
  float *zbuf;  /* [TB][Pp] z */
  float *yq;    /* [TB][Pp][YQ] y partials (over n) */
  float *tnb;   /* [TB][S] tanh of the angle logits */
  float *scal;  /* [TB][4] alpha_eff, beta_eff, gamma, dt */
  float *rst;   /* [TB] reset flags */
  float *thbuf; /* [TB][S] angles after each token */
  float *th;    /* [S] running angle */
};

__host__ __device__ inline int64_t fwd_smem_floats(const geo &g, int Pp, int Np, int S) {
  const int64_t TB = g.TB;
  return (TB + 1) * Np + TB * Np + (TB + 1) * Pp + TB * Pp + TB * Pp * g.YQ + TB * S + TB * 4 + TB + TB * S + S;
}

__device__ inline fwd_smem carve_fwd(float *sm, const geo &g, int Pp, int Np, int S) {
  const int TB = g.TB;
  fwd_smem m;
  m.kbuf = sm;
  m.qbuf = m.kbuf + (TB + 1) * Np;
  m.xbuf = m.qbuf + TB * Np;
  m.zbuf = m.xbuf + (TB + 1) * Pp;
  m.yq = m.zbuf + TB * Pp;
  m.tnb = m.yq + TB * Pp * g.YQ;
  m.scal = m.tnb + TB * S;
  m.rst = m.scal + TB * 4;
  m.thbuf = m.rst + TB;
  m.th = m.thbuf + TB * S;
  return m;
}

struct bwd_smem {
  float *kbuf;  /* [TB+1][Np] rotated k; slot 0: token t0 - 1 */
  float *qbuf;  /* [TB][Np] */
  float *xbuf;  /* [TB+1][Pp] */
  float *dybuf; /* [TB][Pp] dL/dy */
  float *gy;    /* [TB][Pp] y (mixer norm backward) */
  float *gd;    /* [TB][Pp] dL/d(normed y) */
  float *wq;    /* [TB][Pp][YQ] w partials (over n) */
  float *upart; /* [SB][Np][UQ1] u (sweep R) or dq (sweep F) partials (over p) of a sub-block */
  float *wfin;  /* [TB+1][Pp] w per token; slot TB: the next token (from the block after) */
  float *ufin;  /* [TB+1][Np] u per token (sweep R), unrotated dq (sweep F); slot TB: next token */
  float *hkb;   /* [TB][Pp] hk */
  float *dkb;   /* [TB][Np] dk (sweep R) or dq (sweep F) */
  float *cst;   /* [TB+1][S] cos of the angles (same slots) */
  float *snt;   /* [TB+1][S] sin of the angles */
  float *tab;   /* [TB][S] tanh of the angle logits */
  float *dthb;  /* [TB][S] angle gradient of each token */
  float *dda;   /* [TB][S] pi Dth tanh(ang): terms of dL/d dt */
  float *scal;  /* [TB+1][SC_W] token scalars; slot TB: the next token */
  float *Dth;   /* [S] running angle gradient (reverse cumulative sum) */
  float *pBb;   /* [Np] B_bias gradient partial */
  float *pCb;   /* [Np] C_bias gradient partial */
  float *pOn;   /* [ngroups][Pp] mixer norm weight partials per token group (token_groups' slots) */
  float *misc;  /* [16]: 0 pD, 1 pdtb, 2 ad of the next token (0: none, or a reset) */
};

__host__ __device__ inline int64_t bwd_smem_floats(const geo &g, int Pp, int Np, int S, int ngroups) {
  const int64_t TB = g.TB;
  return (TB + 1) * Np + TB * Np + (TB + 1) * Pp + 3 * TB * Pp + TB * Pp * g.YQ + (int64_t)g.SB * Np * g.UQ1 +
         (TB + 1) * Pp + (TB + 1) * Np + TB * Pp + TB * Np + 2 * (TB + 1) * S + 3 * TB * S + (TB + 1) * SC_W + S +
         2 * (int64_t)Np + (int64_t)ngroups * Pp + 16;
}

__device__ inline bwd_smem carve_bwd(float *sm, const geo &g, int Pp, int Np, int S, int ngroups) {
  const int TB = g.TB;
  bwd_smem m;
  m.kbuf = sm;
  m.qbuf = m.kbuf + (TB + 1) * Np;
  m.xbuf = m.qbuf + TB * Np;
  m.dybuf = m.xbuf + (TB + 1) * Pp;
  m.gy = m.dybuf + TB * Pp;
  m.gd = m.gy + TB * Pp;
  m.wq = m.gd + TB * Pp;
  m.upart = m.wq + TB * Pp * g.YQ;
  m.wfin = m.upart + g.SB * Np * g.UQ1;
  m.ufin = m.wfin + (TB + 1) * Pp;
  m.hkb = m.ufin + (TB + 1) * Np;
  m.dkb = m.hkb + TB * Pp;
  m.cst = m.dkb + TB * Np;
  m.snt = m.cst + (TB + 1) * S;
  m.tab = m.snt + (TB + 1) * S;
  m.dthb = m.tab + TB * S;
  m.dda = m.dthb + TB * S;
  m.scal = m.dda + TB * S;
  m.Dth = m.scal + (TB + 1) * SC_W;
  m.pBb = m.Dth + S;
  m.pCb = m.pBb + Np;
  m.pOn = m.pCb + Np;
  m.misc = m.pOn + ngroups * Pp;
  return m;
}

/* ---- forward ------------------------------------------------------------------------------------ */

template <int RP, int RN, int PK, int NK, typename T>
__global__ void __launch_bounds__(512) scan_fwd_kernel(const m3k_scan_args a, const geo run_gm) {
  extern __shared__ float sm[];
  const m3k_dims &d = a.d;
  const geo gm = kernel_geo<RP, RN, PK, NK>(run_gm);
  const int h = grid_x(d.H), b = grid_row(d.H), g = h / d.hpg;
  const int P = PK ? PK : d.P, N = NK ? NK : d.N, S = d.S, H = d.H, E = d.E;
  const int pth = gm.pth, nth = gm.nth, TB = gm.TB;
  const int Pp = pth * RP, Np = nth * RN;
  const int tid = threadIdx.x, nthreads = pth * nth, lane = tid & 31, wid = tid >> 5, nw = nthreads >> 5;
  const int ti = tid / nth, tj = tid - ti * nth;
  const bool ywriter = (tj & 31) == 0;
  const int yq_i = tj >> 5;
  const T *proj = (const T *)a.proj; // [M, dipp]
  T *gated = (T *)a.gated;           // [M, E]
  fwd_smem s = carve_fwd(sm, gm, Pp, Np, S);
  const int64_t bh = (int64_t)b * H + h;
  const float Dh = a.D[h];

  float hs[RP][RN];
#pragma unroll
  for (int r = 0; r < RP; r++)
#pragma unroll
    for (int c = 0; c < RN; c++) {
      const int p = ti + pth * r, n = tj + nth * c;
      hs[r][c] = (a.in_ssm && p < P && n < N) ? a.in_ssm[(bh * P + p) * N + n] : 0.0f;
    }
  for (int n = tid; n < Np; n += nthreads) s.kbuf[n] = (a.in_k && n < N) ? a.in_k[bh * N + n] : 0.0f;
  for (int p = tid; p < Pp; p += nthreads) s.xbuf[p] = (a.in_v && p < P) ? a.in_v[bh * P + p] : 0.0f;
  for (int j = tid; j < S; j += nthreads) s.th[j] = a.in_angle ? a.in_angle[bh * S + j] : 0.0f;
  __syncthreads();

  for (int t0 = 0; t0 < a.len; t0 += TB) {
    const int nb = min(TB, a.len - t0);
    const int64_t m0 = (int64_t)b * a.len + t0;
    /* everything the block needs from global memory, in parallel */
    if (tid < nb) {
      const T *pr = proj + (m0 + tid) * d.dipp;
      const tok_scalars ts = row_scalars(a, pr, h);
      const bool rs = a.resets && a.resets[m0 + tid];
      s.scal[tid * 4 + 0] = rs ? 0.0f : ts.alpha;
      s.scal[tid * 4 + 1] = rs ? 0.0f : ts.beta;
      s.scal[tid * 4 + 2] = ts.gamma;
      s.scal[tid * 4 + 3] = ts.dt;
      s.rst[tid] = rs ? 1.0f : 0.0f;
    }
#pragma unroll 4
    for (int idx = tid; idx < nb * S; idx += nthreads) {
      const int i = idx / S, j = idx - i * S;
      s.tnb[idx] = angle_tanh(proj, d, m0 + i, j);
    }
#pragma unroll 4
    for (int idx = tid; idx < nb * Pp; idx += nthreads) {
      const int i = idx / Pp, p = idx - i * Pp;
      const T *pr = proj + (m0 + i) * d.dipp + (int64_t)h * P + p;
      s.xbuf[(i + 1) * Pp + p] = p < P ? to_f(pr[d.x_off]) : 0.0f;
      s.zbuf[i * Pp + p] = p < P ? to_f(pr[d.z_off]) : 0.0f;
    }
    /* B_hat + B_bias and C_hat + C_bias (k and q before the rotation; the padding 0) */
#pragma unroll 2
    for (int idx = tid; idx < nb * Np; idx += nthreads) {
      const int i = idx / Np, n = idx - i * Np;
      const int64_t m = m0 + i;
      float kv = 0, qv = 0;
      if (n < N) {
        kv = a.bc_hat[((m * 2 + 0) * d.G + g) * N + n] + a.B_bias[(int64_t)h * N + n];
        qv = a.bc_hat[((m * 2 + 1) * d.G + g) * N + n] + a.C_bias[(int64_t)h * N + n];
      }
      s.kbuf[(i + 1) * Np + n] = kv;
      s.qbuf[i * Np + n] = qv;
    }
    __syncthreads();
    /* angles: a sequential walk per rotated pair, in shared memory */
    for (int j = tid; j < S; j += nthreads) {
      float v = s.th[j];
#pragma unroll 4
      for (int i = 0; i < nb; i++) {
        if (s.rst[i] != 0) v = 0;
        v = wrap_sum(v, PI_F * s.tnb[i * S + j] * s.scal[i * 4 + 3]);
        s.thbuf[i * S + j] = v;
        a.theta[((m0 + i) * H + h) * S + j] = v;
      }
      s.th[j] = v;
    }
    __syncthreads();
    /* the pairs of k and q rotated in place, one per item */
#pragma unroll 2
    for (int idx = tid; idx < nb * S; idx += nthreads) {
      const int i = idx / S, n0 = 2 * (idx - i * S);
      rotate_pair(s.kbuf + (i + 1) * Np + n0, s.qbuf + i * Np + n0, s.thbuf[idx]);
    }
    __syncthreads();
    /* the recurrence through the block; y partials summed over the tj lanes */
#pragma unroll unroll_of<RP, RN>::value
    for (int i = 0; i < nb; i++) {
      const float al = s.scal[i * 4 + 0], be = s.scal[i * 4 + 1], ga = s.scal[i * 4 + 2];
      float bx[RP], gx[RP], acc[RP];
#pragma unroll
      for (int r = 0; r < RP; r++) {
        const int p = ti + pth * r;
        bx[r] = be * s.xbuf[i * Pp + p];
        gx[r] = ga * s.xbuf[(i + 1) * Pp + p];
        acc[r] = 0;
      }
#pragma unroll
      for (int c = 0; c < RN; c++) {
        const int n = tj + nth * c;
        const float kp = s.kbuf[i * Np + n], kc = s.kbuf[(i + 1) * Np + n], qc = s.qbuf[i * Np + n];
#pragma unroll
        for (int r = 0; r < RP; r++) {
          hs[r][c] = al * hs[r][c] + bx[r] * kp + gx[r] * kc;
          acc[r] += hs[r][c] * qc;
        }
      }
#pragma unroll
      for (int r = 0; r < RP; r++) {
        const float v = sum_tj(acc[r], nth);
        if (ywriter) s.yq[(i * Pp + ti + pth * r) * gm.YQ + yq_i] = v;
      }
    }
    __syncthreads();
    /* epilogue: one warp per token adds D x, applies the gate */
    for (int i = wid; i < nb; i += nw) {
      const int64_t mi = m0 + i;
      float yv[4];
      float ss = 0;
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const int p = lane + 32 * k;
        yv[k] = 0;
        if (p < P) {
          float y = 0;
          for (int q = 0; q < gm.YQ; q++) y += s.yq[(i * Pp + p) * gm.YQ + q];
          y += Dh * s.xbuf[(i + 1) * Pp + p];
          yv[k] = y;
          ((T *)a.y)[mi * E + (int64_t)h * P + p] = from_f<T>(y);
          ss += y * y;
        }
      }
      warp_norm_gate<T>(a, mi, h, yv, ss, s.zbuf + i * Pp, gated + mi * E + (int64_t)h * P);
    }
    /* the block's last token becomes the previous token of the next block */
    for (int n = tid; n < Np; n += nthreads) s.kbuf[n] = s.kbuf[nb * Np + n];
    for (int p = tid; p < Pp; p += nthreads) s.xbuf[p] = s.xbuf[nb * Pp + p];
    __syncthreads();
  }

  if (a.fin_ssm) {
#pragma unroll
    for (int r = 0; r < RP; r++)
#pragma unroll
      for (int c = 0; c < RN; c++) {
        const int p = ti + pth * r, n = tj + nth * c;
        if (p < P && n < N) a.fin_ssm[(bh * P + p) * N + n] = hs[r][c];
      }
  }
  if (a.fin_k)
    for (int n = tid; n < N; n += nthreads) a.fin_k[bh * N + n] = s.kbuf[n];
  if (a.fin_v)
    for (int p = tid; p < P; p += nthreads) a.fin_v[bh * P + p] = s.xbuf[p];
  if (a.fin_angle)
    for (int j = tid; j < S; j += nthreads) a.fin_angle[bh * S + j] = s.th[j];
}

/* ---- backward -------------------------------------------------------------------------------------- */

/* The token scalar table for tokens [t0, t0 + nb). */
template <typename T>
__device__ __forceinline__ void bwd_scalars(const m3k_scan_args &a, const bwd_smem &s, int64_t m0, int nb, int h,
                                            int with_psi) {
  const m3k_dims &d = a.d;
  const T *proj = (const T *)a.proj;
  const int tid = threadIdx.x;
  if (tid < nb) {
    const T *pr = proj + (m0 + tid) * d.dipp;
    const tok_scalars ts = row_scalars(a, pr, h);
    const bool rs = a.resets && __ldg(a.resets + m0 + tid);
    float *sc = s.scal + tid * SC_W;
    sc[S_ALPHA] = rs ? 0.0f : ts.alpha;
    sc[S_BETA] = rs ? 0.0f : ts.beta;
    sc[S_GAMMA] = ts.gamma;
    sc[S_DT] = ts.dt;
    sc[S_LAM] = ts.lam;
    sc[S_DSP] = ts.dsp;
    sc[S_DAD] = ts.dAd;
    sc[S_A] = ts.A;
    sc[S_RESET] = rs ? 1.0f : 0.0f;
    sc[S_ALPHA_RAW] = ts.alpha;
    sc[S_BETA_RAW] = ts.beta;
    if (with_psi) sc[S_PSI] = a.psi[(m0 + tid) * d.H + h];
  }
}

/* The block's per-token B (which 0) or C (1) gradients of head h, col[i * Np + n], into dbc_head (the
 * column sums walk shared memory only; these stores run in parallel beside them). */
__device__ __forceinline__ void store_dbc_head(const m3k_scan_args &a, const float *col, int64_t m0, int nb, int h,
                                               int which, int Np, int tid, int nthreads) {
  const int N = a.d.N, H = a.d.H;
#pragma unroll 1
  for (int idx = tid; idx < nb * N; idx += nthreads) {
    const int i = idx / N, n = idx - i * N;
    a.dbc_head[(((m0 + i) * H + h) * 2 + which) * N + n] = col[i * Np + n];
  }
}

/* q.k of the block's token i (its group of L lanes, l the lane's index there; on as token_groups), into
 * its S_QK */
__device__ __forceinline__ void token_qk(const bwd_smem &s, int i, bool on, int l, int L, int Np, int N) {
  float qk = 0;
#pragma unroll 1
  for (int n = l; on && n < N; n += L) qk += s.qbuf[i * Np + n] * s.kbuf[(i + 1) * Np + n];
  qk = group_sum(qk, L);
  if (on && l == 0) s.scal[i * SC_W + S_QK] = qk;
}

/* *total += the sum of the block's nb token scalars col[i * SC_W] (one warp: lane-strided partials,
 * then the butterfly). */
__device__ __forceinline__ void block_token_sum(const float *col, int nb, float *total, int lane) {
  float v = 0;
#pragma unroll 1
  for (int i = lane; i < nb; i += 32) v += col[i * SC_W];
  v = warp_sum(v);
  if (lane == 0) *total += v;
}

/* The decay gradient alpha_t dL/dalpha_t of the block's tokens (S_AD), from the last: the recursion
 *   ad_t = reset_t ? 0 : (psi_t - beta_t dbeta_t - gamma_t dgamma_t) + ad_{t+1}
 * (a reset's ad is 0, so a reset cuts the sum) as suffix_round's scan, 32 tokens a round (one warp);
 * *next holds ad of the token after the block and gets the block's first. */
__device__ __forceinline__ void phi_scan(float *scal, int nb, float *next, int lane) {
  float carry = *next;
  for (int hi = nb; hi > 0; hi -= 32) {
    const int i = hi - 32 + lane;
    float c = 0, m = 0;
    if (i >= 0) {
      const float *sc = scal + i * SC_W;
      if (sc[S_RESET] == 0) {
        c = sc[S_PSI] - sc[S_BETA_RAW] * sc[S_DBETA] - sc[S_GAMMA] * sc[S_DGAMMA];
        m = 1;
      }
    }
    const float ad = suffix_round(c, m, carry, lane);
    if (i >= 0) scal[i * SC_W + S_AD] = ad;
    carry = __shfl_sync(0xffffffffu, ad, hi >= 32 ? 0 : 32 - hi);
  }
  __syncwarp(); /* every lane has read *next (a shuffle orders no memory) */
  if (lane == 0) *next = carry;
}

/* The angle gradient of pair j over the block, from the last token: D_t = dth_t + D_{t+1}, where a reset
 * at t + 1 cuts D_{t+1} (the angle restarts there) and D after the block is Dth[j] (already cut), as
 * suffix_round's scan (one warp). D_t replaces the token's share dth_t (dthb), pi D_t tanh(ang_t) goes to
 * dda, and Dth[j] gets D of the block's first token, cut by its reset. */
__device__ __forceinline__ void angle_scan(const bwd_smem &s, int nb, int S, int j, int lane) {
  float carry = s.Dth[j];
  for (int hi = nb; hi > 0; hi -= 32) {
    const int i = hi - 32 + lane;
    float c = 0, m = 1;
    if (i >= 0) {
      c = s.dthb[i * S + j];
      if (i + 1 < nb && s.scal[(i + 1) * SC_W + S_RESET] != 0) m = 0;
    }
    const float D = suffix_round(c, m, carry, lane);
    if (i >= 0) {
      s.dthb[i * S + j] = D;
      s.dda[i * S + j] = PI_F * D * s.tab[i * S + j];
    }
    carry = __shfl_sync(0xffffffffu, D, hi >= 32 ? 0 : 32 - hi);
  }
  __syncwarp(); /* every lane has read Dth[j] */
  if (lane == 0) s.Dth[j] = s.scal[S_RESET] != 0 ? 0.0f : carry;
}

/* Unit u of position m's rotated k, and q with the pair's cos and sin where q is not NULL, from the angle
 * the forward saved; read-only loads, so that the compiler may issue the next unit's ahead of this one's
 * stores. */
__device__ __forceinline__ void bwd_unit(const m3k_scan_args &a, int64_t m, int h, int g, int u, float *k, float *q,
                                         float *cs, float *sn) {
  const int S = a.d.S;
  const float theta = u < S ? __ldg(a.theta + (m * a.d.H + h) * S + u) : 0.0f;
  rot_unit<true>(a, m, h, g, u, theta, k, q, cs, sn);
}

/* Rotated k (slots 1..nb) and q of the block; the cos and sin of each pair are kept (cst, snt, same
 * slots) for the rotation backward. It reads only global memory, so it runs among the block's loads
 * (their latencies overlap; no barrier between). */
__device__ __forceinline__ void bwd_rotate_block(const m3k_scan_args &a, const bwd_smem &s, int64_t m0, int nb, int h,
                                                 int g, int Np, int nthreads) {
  const int tid = threadIdx.x, S = a.d.S, Up = Np - S;
#pragma unroll 1
  for (int idx = tid; idx < nb * Up; idx += nthreads) {
    const int i = idx / Up, u = idx - i * Up;
    bwd_unit(a, m0 + i, h, g, u, s.kbuf + (i + 1) * Np, s.qbuf + i * Np, s.cst + (i + 1) * S + u,
             s.snt + (i + 1) * S + u);
  }
}

/* ---- the 16 x 16 recurrences --------------------------------------------------------------------
 * At P x N = 16 x 16 (one state element a thread: 16 tj lanes and two ti a warp) both sweeps' token
 * loops take four tokens at a time: the group's operands first, then the state's chain, then the sums
 * as butterflies whose first stages pass half of the four values instead of adding all of them
 * (sweep R: 7 shuffles for four tokens' w and u instead of 20), then the stores. Fewer shared-memory
 * and shuffle instructions per token: the loops were bound by them (NOTES.md runs 105-109). */

/* The four values v[] of each lane summed with those of the lane that differs in bit o: a lane
 * without the bit (hi false) gets the sums of values 0 and 1, its partner those of 2 and 3. */
__device__ __forceinline__ void pass_half(const float v[4], int o, bool hi, float out[2]) {
  out[0] = (hi ? v[2] : v[0]) + __shfl_xor_sync(0xffffffffu, hi ? v[0] : v[2], o);
  out[1] = (hi ? v[3] : v[1]) + __shfl_xor_sync(0xffffffffu, hi ? v[1] : v[3], o);
}

/* Sweep F over tokens [i0, i1) of a sub-block: H_t rebuilt in hs, dq_t = H_t^T dy_t summed over the
 * warp's two ti into upart (the lane of even ti writes tokens 0 and 1 of a group, its partner 2, 3). */
__device__ __forceinline__ void sweep_f16(float &hs, const bwd_smem &s, int i0, int i1, int ti, int tj, int UQ1) {
  const bool hi = ti & 1;
  const int uq = ti >> 1;
  for (int i = i0; i < i1; i += 4) {
    float al[4], be[4], ga[4], dy[4], x[5], k[5], dq[4], sum[2];
#pragma unroll
    for (int u = 0; u < 4; u++) { /* a token past the sub-block leaves the state as it is */
      const bool on = i + u < i1;
      const float *sc = s.scal + (on ? i + u : i) * SC_W;
      al[u] = on ? sc[S_ALPHA] : 1.0f;
      be[u] = on ? sc[S_BETA] : 0.0f;
      ga[u] = on ? sc[S_GAMMA] : 0.0f;
      dy[u] = s.dybuf[(on ? i + u : i) * 16 + ti];
    }
#pragma unroll
    for (int u = 0; u < 5; u++) {
      const int t = min(i + u, i1);
      x[u] = s.xbuf[t * 16 + ti];
      k[u] = s.kbuf[t * 16 + tj];
    }
#pragma unroll
    for (int u = 0; u < 4; u++) {
      hs = al[u] * hs + be[u] * x[u] * k[u] + ga[u] * x[u + 1] * k[u + 1];
      dq[u] = hs * dy[u];
    }
    pass_half(dq, 16, hi, sum);
#pragma unroll
    for (int e = 0; e < 2; e++) {
      const int t = i + (hi ? 2 : 0) + e;
      if (t < i1) s.upart[((t - i0) * 16 + tj) * UQ1 + uq] = sum[e];
    }
  }
}

/* Sweep R over tokens [i0, i1) of a sub-block, from the last: dH in hs; w_t = g_t k_{t-1} summed over
 * the 16 tj lanes into wq (lanes tj = 0, 4, 8, 12 hold one token each), u_t = g_t^T x_{t-1} over the
 * two ti into upart (as sweep_f16). */
__device__ __forceinline__ void sweep_r16(float &hs, const bwd_smem &s, int i0, int i1, int ti, int tj, int UQ1) {
  const bool hi = ti & 1, b8 = tj & 8, b4 = tj & 4;
  const int uq = ti >> 1;
  for (int i = i1 - 1; i >= i0; i -= 4) {
    float al[4], dy[4], xp[4], kp[4], qc[4], w[4], up[4], wh[2], uh[2];
#pragma unroll
    for (int u = 0; u < 4; u++) { /* a token before the sub-block leaves dH as it is */
      const bool on = i - u >= i0;
      const int t = on ? i - u : i;
      al[u] = on ? s.scal[t * SC_W + S_ALPHA] : 1.0f;
      dy[u] = on ? s.dybuf[t * 16 + ti] : 0.0f;
      xp[u] = s.xbuf[t * 16 + ti];
      kp[u] = s.kbuf[t * 16 + tj];
      qc[u] = s.qbuf[t * 16 + tj];
    }
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const float gv = hs + dy[u] * qc[u];
      w[u] = gv * kp[u];
      up[u] = gv * xp[u];
      hs = al[u] * gv;
    }
    pass_half(w, 8, b8, wh);
    float wv = b4 ? wh[1] : wh[0];
    wv += __shfl_xor_sync(0xffffffffu, b4 ? wh[0] : wh[1], 4);
    wv += __shfl_xor_sync(0xffffffffu, wv, 2);
    wv += __shfl_xor_sync(0xffffffffu, wv, 1);
    pass_half(up, 16, hi, uh);
    const int tw = i - ((b8 ? 2 : 0) + (b4 ? 1 : 0));
    if ((tj & 3) == 0 && tw >= i0) s.wq[tw * 16 + ti] = wv;
#pragma unroll
    for (int e = 0; e < 2; e++) {
      const int t = i - (hi ? 2 : 0) - e;
      if (t >= i0) s.upart[((t - i0) * 16 + tj) * UQ1 + uq] = uh[e];
    }
  }
}

template <int RP, int RN, int PK, int NK, typename T>
__global__ void __launch_bounds__(512) scan_bwd_kernel(const m3k_scan_args a, const geo run_gm) {
  extern __shared__ float sm[];
  const m3k_dims &d = a.d;
  const geo gm = kernel_geo<RP, RN, PK, NK>(run_gm);
  const int h = grid_x(d.H), b = grid_row(d.H), g = h / d.hpg;
  const int P = PK ? PK : d.P, N = NK ? NK : d.N, S = d.S, H = d.H, E = d.E;
  const int pth = gm.pth, nth = gm.nth, TB = gm.TB, SB = gm.SB;
  const int Pp = pth * RP, Np = nth * RN;
  const int tid = threadIdx.x, nthreads = pth * nth, lane = tid & 31, wid = tid >> 5, nw = nthreads >> 5;
  const int ti = tid / nth, tj = tid - ti * nth;
  const bool wwriter = (tj & 31) == 0, uwriter = (ti % gm.LT) == 0;
  const int wq_i = tj >> 5, uq_i = ti / gm.LT;
  const T *proj = (const T *)a.proj; // [M, dipp]
  T *dproj = (T *)a.dproj;           // [M, dipp]
  const int TL = tok_lanes(P > N ? P : N); /* lanes per token of the per-token sums (token_groups) */
  bwd_smem s = carve_bwd(sm, gm, Pp, Np, S, nw * (32 / TL));
  const int64_t bh = (int64_t)b * H + h;
  const float Dh = a.D[h];
  const int U = S + (N - 2 * S); /* rotation units: pairs, then single columns */
  /* ===== sweep F: forward in time ===== */
  float hs[RP][RN];
#pragma unroll
  for (int r = 0; r < RP; r++)
#pragma unroll
    for (int c = 0; c < RN; c++) {
      const int p = ti + pth * r, n = tj + nth * c;
      hs[r][c] = (a.in_ssm && p < P && n < N) ? a.in_ssm[(bh * P + p) * N + n] : 0.0f;
    }
#pragma unroll 1
  for (int n = tid; n < Np; n += nthreads) {
    s.kbuf[n] = (a.in_k && n < N) ? a.in_k[bh * N + n] : 0.0f;
    s.pBb[n] = 0;
    s.pCb[n] = 0;
  }
#pragma unroll 1
  for (int p = tid; p < Pp; p += nthreads) s.xbuf[p] = (a.in_v && p < P) ? a.in_v[bh * P + p] : 0.0f;
#pragma unroll 1
  for (int k = tid; k < nw * (32 / TL) * Pp; k += nthreads) s.pOn[k] = 0;
#pragma unroll 1
  for (int j = tid; j < S; j += nthreads) s.Dth[j] = 0;
  if (tid < 16) s.misc[tid] = 0;
  __syncthreads();

  for (int t0 = 0; t0 < a.len; t0 += TB) {
    const int nb = min(TB, a.len - t0);
    const int64_t m0 = (int64_t)b * a.len + t0;
    /* The last block stays for sweep R: what sweep F loaded and computed (the token scalars, x, dy, the
     * rotated k and q with their angles, q.k, dy.x) and its psi and angle share stay in shared memory,
     * and sweep R starts there at its recurrence. The blocks before hand dy, psi and the angle share
     * over in global memory. */
    const bool last = t0 + TB >= a.len;
    /* loads: scalars, x, the gate backward's elementwise part, and the rotated k and q */
    bwd_scalars<T>(a, s, m0, nb, h, 0);
#pragma unroll 2
    for (int idx = tid; idx < nb * Pp; idx += nthreads) {
      const int i = idx / Pp, p = idx - i * Pp;
      const int64_t mi = m0 + i;
      float xv = 0, dyn = 0, yv = 0;
      if (p < P) {
        const T *pr = proj + mi * d.dipp + (int64_t)h * P + p;
        xv = to_f(__ldg(pr + d.x_off));
        const int64_t o = mi * E + (int64_t)h * P + p;
        const float dg = to_f(__ldg((const T *)a.dgated + o)), z = to_f(__ldg(pr + d.z_off));
        yv = to_f(__ldg((const T *)a.y + o));
        float silu, dsilu;
        silu_and_grad(z, silu, dsilu);
        const float yn =
            d.outproj_norm ? yv * __ldg(a.y_rstd + mi * H + h) * __ldg(a.out_norm + (int64_t)h * P + p) : yv;
        dproj[mi * d.dipp + d.z_off + (int64_t)h * P + p] = from_f<T>(dg * yn * dsilu);
        dyn = dg * silu;
      }
      s.xbuf[(i + 1) * Pp + p] = xv;
      s.gy[i * Pp + p] = yv;
      s.gd[i * Pp + p] = dyn;
    }
    bwd_rotate_block(a, s, m0, nb, h, g, Np, nthreads);
    __syncthreads();
    /* dy through the mixer norm, dy . x (token_groups) */
    token_groups(nb, TL, nw, [&](int i, bool on, int l, int slot) {
      const int64_t mi = m0 + i;
      float rn = 1, cn = 0;
      if (d.outproj_norm) {
        float dot = 0;
        if (on) {
          rn = a.y_rstd[mi * H + h];
#pragma unroll 1
          for (int p = l; p < P; p += TL) dot += s.gy[i * Pp + p] * a.out_norm[(int64_t)h * P + p] * s.gd[i * Pp + p];
        }
        cn = group_sum(dot, TL) / (float)P * rn * rn * rn;
      }
      float dyx = 0;
#pragma unroll 1
      for (int p = l; on && p < Pp; p += TL) {
        float dy = 0;
        if (p < P) {
          const float yv = s.gy[i * Pp + p], dyn = s.gd[i * Pp + p];
          if (d.outproj_norm) {
            const float wn = a.out_norm[(int64_t)h * P + p];
            s.pOn[slot * Pp + p] += yv * rn * dyn;
            dy = rn * wn * dyn - yv * cn;
          } else {
            dy = dyn;
          }
          if (!last) a.dy[mi * E + (int64_t)h * P + p] = dy;
          dyx += dy * s.xbuf[(i + 1) * Pp + p];
        }
        s.dybuf[i * Pp + p] = dy;
      }
      dyx = group_sum(dyx, TL);
      if (on && l == 0) s.scal[i * SC_W + S_DYX] = dyx;
      if (last) token_qk(s, i, on, l, TL, Np, N);
    });
    __syncthreads();
    if (wid == 0) block_token_sum(s.scal + S_DYX, nb, s.misc + 0, lane);
    /* rebuild H_t; dq_t = H_t^T dy_t, summed over p in sub-blocks */
    for (int i0 = 0; i0 < nb; i0 += SB) {
      const int i1 = min(nb, i0 + SB);
      if constexpr (PK == 16 && NK == 16) sweep_f16(hs[0][0], s, i0, i1, ti, tj, gm.UQ1);
      else
#pragma unroll unroll_of<RP, RN>::value
      for (int i = i0; i < i1; i++) {
        const float al = s.scal[i * SC_W + S_ALPHA], be = s.scal[i * SC_W + S_BETA], ga = s.scal[i * SC_W + S_GAMMA];
        float bx[RP], gx[RP], dy[RP];
#pragma unroll
        for (int r = 0; r < RP; r++) {
          const int p = ti + pth * r;
          bx[r] = be * s.xbuf[i * Pp + p];
          gx[r] = ga * s.xbuf[(i + 1) * Pp + p];
          dy[r] = s.dybuf[i * Pp + p];
        }
#pragma unroll
        for (int c = 0; c < RN; c++) {
          const int n = tj + nth * c;
          const float kp = s.kbuf[i * Np + n], kc = s.kbuf[(i + 1) * Np + n];
          float dq = 0;
#pragma unroll
          for (int r = 0; r < RP; r++) {
            hs[r][c] = al * hs[r][c] + bx[r] * kp + gx[r] * kc;
            dq += hs[r][c] * dy[r];
          }
          dq = sum_ti(dq, nth);
          if (uwriter) s.upart[((i - i0) * Np + n) * gm.UQ1 + uq_i] = dq;
        }
      }
      __syncthreads();
      for (int idx = tid; idx < (i1 - i0) * Np; idx += nthreads) {
        const int i = idx / Np, n = idx - i * Np;
        const float *up = s.upart + (i * Np + n) * gm.UQ1;
        float acc = 0;
        for (int k = 0; k < gm.UQ; k++) acc += up[k];
        s.dkb[(i0 + i) * Np + n] = acc;
      }
      __syncthreads();
    }
    /* dq: rotation backward (C part) and the angle share from q; psi = dq . q */
    for (int idx = tid; idx < nb * U; idx += nthreads) {
      const int i = idx / U, u = idx - i * U;
      const float *dq = s.dkb + i * Np, *q = s.qbuf + i * Np;
      float *e = s.ufin + i * Np;
      if (u < S) {
        const int n0 = 2 * u;
        const float cs = s.cst[(i + 1) * S + u], sn = s.snt[(i + 1) * S + u];
        const float d0 = dq[n0], d1 = dq[n0 + 1];
        e[n0] = cs * d0 + sn * d1;
        e[n0 + 1] = -sn * d0 + cs * d1;
        const float dth = -d0 * q[n0 + 1] + d1 * q[n0];
        if (last) s.dthb[i * S + u] = dth;
        else a.dthq[((m0 + i) * H + h) * S + u] = dth;
      } else {
        const int n = 2 * S + (u - S);
        e[n] = dq[n];
      }
    }
    token_groups(nb, TL, nw, [&](int i, bool on, int l, int) {
      float acc = 0;
#pragma unroll 1
      for (int n = l; on && n < N; n += TL) acc += s.dkb[i * Np + n] * s.qbuf[i * Np + n];
      acc = group_sum(acc, TL);
      if (on && l == 0) {
        if (last) s.scal[i * SC_W + S_PSI] = acc;
        else a.psi[(m0 + i) * H + h] = acc;
      }
    });
    __syncthreads();
#pragma unroll 1
    for (int n = tid; n < N; n += nthreads) {
      float acc = s.pCb[n];
      for (int i = 0; i < nb; i++) acc += s.ufin[i * Np + n];
      s.pCb[n] = acc;
    }
    store_dbc_head(a, s.ufin, m0, nb, h, 1, Np, tid, nthreads);
    if (last) { /* sweep R's tanh of the angle logits */
#pragma unroll 1
      for (int idx = (tid + nthreads - 32) & (nthreads - 1); idx < nb * S; idx += nthreads)
        s.tab[idx] = angle_tanh(proj, d, m0 + idx / S, idx % S);
    } else {
#pragma unroll 1
      for (int n = tid; n < Np; n += nthreads) s.kbuf[n] = s.kbuf[nb * Np + n];
#pragma unroll 1
      for (int p = tid; p < Pp; p += nthreads) s.xbuf[p] = s.xbuf[nb * Pp + p];
    }
    __syncthreads();
  }

  /* ===== sweep R: reverse in time ===== */
#pragma unroll
  for (int r = 0; r < RP; r++)
#pragma unroll
    for (int c = 0; c < RN; c++) hs[r][c] = 0; /* now dH: the gradient reaching H_t from later tokens */
#pragma unroll 1
  for (int p = tid; p < Pp; p += nthreads) s.wfin[TB * Pp + p] = 0;
#pragma unroll 1
  for (int n = tid; n < Np; n += nthreads) s.ufin[TB * Np + n] = 0;
  if (tid < SC_W) s.scal[TB * SC_W + tid] = 0;
  if (tid == 0) s.misc[2] = 0; /* alpha_t dL/dalpha_t of the next token */
  __syncthreads();

  const int nblk = (a.len + TB - 1) / TB;
  for (int kb = nblk - 1; kb >= 0; kb--) {
    const int t0 = kb * TB, nb = min(TB, a.len - t0);
    const int64_t m0 = (int64_t)b * a.len + t0;
    if (kb < nblk - 1) { /* loads, and the rotated k (with token t0 - 1's) and q */
      bwd_scalars<T>(a, s, m0, nb, h, 1);
#pragma unroll 1
      for (int idx = tid; idx < nb * S; idx += nthreads) {
        const int i = idx / S, j = idx - i * S;
        const int64_t mi = m0 + i;
        s.tab[idx] = angle_tanh(proj, d, mi, j);
        s.dthb[idx] = a.dthq[(mi * H + h) * S + j];
      }
#pragma unroll 4
      for (int idx = tid; idx < (nb + 1) * Pp; idx += nthreads) {
        const int i = idx / Pp, p = idx - i * Pp; /* slot i: token t0 + i - 1 */
        float xv = 0;
        if (p < P) {
          if (i > 0 || t0 > 0) xv = to_f(__ldg(proj + (m0 + i - 1) * d.dipp + d.x_off + (int64_t)h * P + p));
          else if (a.in_v) xv = __ldg(a.in_v + bh * P + p);
        }
        s.xbuf[idx] = xv;
        if (i < nb) s.dybuf[idx] = p < P ? a.dy[(m0 + i) * E + (int64_t)h * P + p] : 0.0f;
      }
      bwd_rotate_block(a, s, m0, nb, h, g, Np, nthreads);
      if (t0 > 0) { /* slot 0: token t0 - 1 */
#pragma unroll 1
        for (int u = tid; u < Np - S; u += nthreads) bwd_unit(a, m0 - 1, h, g, u, s.kbuf, NULL, NULL, NULL);
      } else { /* or the incoming state */
#pragma unroll 1
        for (int n = tid; n < Np; n += nthreads) s.kbuf[n] = (a.in_k && n < N) ? a.in_k[bh * N + n] : 0.0f;
      }
      __syncthreads();
      /* per token: q.k and dy.x */
      token_groups(nb, TL, nw, [&](int i, bool on, int l, int) {
        token_qk(s, i, on, l, TL, Np, N);
        float dyx = 0;
#pragma unroll 1
        for (int p = l; on && p < P; p += TL) dyx += s.dybuf[i * Pp + p] * s.xbuf[(i + 1) * Pp + p];
        dyx = group_sum(dyx, TL);
        if (on && l == 0) s.scal[i * SC_W + S_DYX] = dyx;
      });
    }
    /* the reverse recurrence: g = dH + dy q^T; w = g k_prev (over n); u = g^T x_prev (over p);
     * dH = alpha g. Sub-blocks from the last. */
    const int nsub = (nb + SB - 1) / SB;
    for (int sbk = nsub - 1; sbk >= 0; sbk--) {
      const int i0 = sbk * SB, i1 = min(nb, i0 + SB);
      if constexpr (PK == 16 && NK == 16) sweep_r16(hs[0][0], s, i0, i1, ti, tj, gm.UQ1);
      else
#pragma unroll unroll_of<RP, RN>::value
      for (int i = i1 - 1; i >= i0; i--) {
        const float al = s.scal[i * SC_W + S_ALPHA];
        float dy[RP], xp[RP], wp[RP];
#pragma unroll
        for (int r = 0; r < RP; r++) {
          const int p = ti + pth * r;
          dy[r] = s.dybuf[i * Pp + p];
          xp[r] = s.xbuf[i * Pp + p];
          wp[r] = 0;
        }
#pragma unroll
        for (int c = 0; c < RN; c++) {
          const int n = tj + nth * c;
          const float kp = s.kbuf[i * Np + n], qc = s.qbuf[i * Np + n];
          float up = 0;
#pragma unroll
          for (int r = 0; r < RP; r++) {
            const float gv = hs[r][c] + dy[r] * qc;
            wp[r] += gv * kp;
            up += gv * xp[r];
            hs[r][c] = al * gv;
          }
          up = sum_ti(up, nth);
          if (uwriter) s.upart[((i - i0) * Np + n) * gm.UQ1 + uq_i] = up;
        }
#pragma unroll
        for (int r = 0; r < RP; r++) {
          const float v = sum_tj(wp[r], nth);
          if (wwriter) s.wq[(i * Pp + ti + pth * r) * gm.YQ + wq_i] = v;
        }
      }
      __syncthreads();
      for (int idx = tid; idx < (i1 - i0) * Np; idx += nthreads) {
        const int i = idx / Np, n = idx - i * Np;
        const float *up = s.upart + (i * Np + n) * gm.UQ1;
        float acc = 0;
        for (int k = 0; k < gm.UQ; k++) acc += up[k];
        s.ufin[(i0 + i) * Np + n] = s.scal[(i0 + i) * SC_W + S_RESET] != 0 ? 0.0f : acc;
      }
      __syncthreads();
    }
    for (int idx = tid; idx < nb * Pp; idx += nthreads) {
      const int i = idx / Pp;
      float acc = 0;
      for (int q = 0; q < gm.YQ; q++) acc += s.wq[idx * gm.YQ + q];
      s.wfin[idx] = s.scal[i * SC_W + S_RESET] != 0 ? 0.0f : acc;
    }
    __syncthreads();
    /* hk, dx (per row p) and dk (per column n) */
    for (int idx = tid; idx < nb * P; idx += nthreads) {
      const int i = idx / P, p = idx - i * P;
      const int nx = i + 1 < nb ? i + 1 : TB;
      const float *sc = s.scal + i * SC_W, *sn = s.scal + nx * SC_W;
      const float wn = s.wfin[nx * Pp + p], dyv = s.dybuf[i * Pp + p];
      const float hk = dyv * sc[S_QK] + sn[S_ALPHA] * wn;
      s.hkb[i * Pp + p] = hk;
      const float dx = sn[S_BETA] * wn + Dh * dyv + sc[S_GAMMA] * hk;
      dproj[(m0 + i) * d.dipp + d.x_off + (int64_t)h * P + p] = from_f<T>(dx);
    }
    for (int idx = tid; idx < nb * N; idx += nthreads) {
      const int i = idx / N, n = idx - i * N;
      const int nx = i + 1 < nb ? i + 1 : TB;
      const float *sc = s.scal + i * SC_W, *sn = s.scal + nx * SC_W;
      const float un = s.ufin[nx * Np + n];
      const float dhtx = sc[S_DYX] * s.qbuf[i * Np + n] + sn[S_ALPHA] * un;
      s.dkb[i * Np + n] = sn[S_BETA] * un + sc[S_GAMMA] * dhtx;
    }
    __syncthreads();
    /* dgamma = x . hk, dbeta = x_prev . w; dk: rotation backward (B part) in place and the angle
     * gradient of each token */
    token_groups(nb, TL, nw, [&](int i, bool on, int l, int) {
      float dgm = 0, dbt = 0;
#pragma unroll 1
      for (int p = l; on && p < P; p += TL) {
        dgm += s.xbuf[(i + 1) * Pp + p] * s.hkb[i * Pp + p];
        dbt += s.xbuf[i * Pp + p] * s.wfin[i * Pp + p];
      }
      dgm = group_sum(dgm, TL);
      dbt = group_sum(dbt, TL);
      if (on && l == 0) {
        s.scal[i * SC_W + S_DGAMMA] = dgm;
        s.scal[i * SC_W + S_DBETA] = dbt;
      }
    });
    for (int idx = tid; idx < nb * S; idx += nthreads) {
      const int i = idx / S, u = idx - i * S;
      float *dk = s.dkb + i * Np;
      const float *k = s.kbuf + (i + 1) * Np;
      const int n0 = 2 * u;
      const float cs = s.cst[(i + 1) * S + u], sn = s.snt[(i + 1) * S + u];
      const float d0 = dk[n0], d1 = dk[n0 + 1];
      dk[n0] = cs * d0 + sn * d1;
      dk[n0 + 1] = -sn * d0 + cs * d1;
      s.dthb[idx] += -d0 * k[n0 + 1] + d1 * k[n0];
    }
    __syncthreads();
    for (int n = tid; n < N; n += nthreads) {
      float acc = s.pBb[n];
      for (int i = nb - 1; i >= 0; i--) acc += s.dkb[i * Np + n];
      s.pBb[n] = acc;
    }
    /* beside them, the angle gradient (angle_scan, one pair a warp from the second warp on: the column
     * sums above start at thread 0) and the decay gradients (phi_scan, the last warp) */
    {
      const int first = nw > 1 ? 1 : 0;
#pragma unroll 1
      for (int j = wid - first; j >= 0 && j < S; j += nw - first) angle_scan(s, nb, S, j, lane);
    }
    if (wid == nw - 1) phi_scan(s.scal, nb, s.misc + 2, lane);
    store_dbc_head(a, s.dkb, m0, nb, h, 0, Np, tid, nthreads);
    __syncthreads();
    /* each token's angle-logit gradient, from its D */
#pragma unroll 1
    for (int idx = tid; idx < nb * S; idx += nthreads) {
      const int i = idx / S, j = idx - i * S;
      const float ta = s.tab[idx];
      const float share = PI_F * s.dthb[idx] * s.scal[i * SC_W + S_DT] * (1 - ta * ta);
      ((T *)a.dang_head)[((m0 + i) * H + h) * S + j] = from_f<T>(share);
    }
    /* the scalar chain to dd_dt, dd_A, trap, one thread per token, with the angle part of dL/d dt
     * (the token's dda summed in four interleaved partials) */
    if (tid < nb) {
      const int64_t mi = m0 + tid;
      float *sc = s.scal + tid * SC_W;
      float ang[4] = {0, 0, 0, 0};
#pragma unroll 1
      for (int j = 0; j < S; j += 4)
#pragma unroll
        for (int e = 0; e < 4; e++)
          if (j + e < S) ang[e] += s.dda[tid * S + j + e];
      const float dgm = sc[S_DGAMMA], dbt = sc[S_DBETA], be = sc[S_BETA_RAW], al = sc[S_ALPHA_RAW];
      const float lam = sc[S_LAM], dt = sc[S_DT];
      const float adb = sc[S_AD] + dbt * be; /* alpha * (dL/dalpha + dL/dbeta dbeta/dalpha) */
      const float ddt = adb * sc[S_A] + dbt * (1 - lam) * al + dgm * lam + ((ang[0] + ang[1]) + (ang[2] + ang[3]));
      const float dA = adb * dt;
      const float dlam = -dbt * dt * al + dgm * dt;
      const float dv = ddt * sc[S_DSP];
      T *drow = dproj + mi * d.dipp;
      drow[d.dt_off + h] = from_f<T>(dv);
      drow[d.A_off + h] = from_f<T>(dA * sc[S_DAD]);
      drow[d.trap_off + h] = from_f<T>(dlam * lam * (1 - lam));
      sc[S_DV] = dv;
    }
    __syncthreads();
    if (wid == 0) block_token_sum(s.scal + S_DV, nb, s.misc + 1, lane);
    /* the block's first token is the next token of the block before it */
#pragma unroll 1
    for (int p = tid; p < Pp; p += nthreads) s.wfin[TB * Pp + p] = s.wfin[p];
#pragma unroll 1
    for (int n = tid; n < Np; n += nthreads) s.ufin[TB * Np + n] = s.ufin[n];
    if (tid < SC_W) s.scal[TB * SC_W + tid] = s.scal[tid];
    __syncthreads();
  }

  /* per-(row, head) parameter partials */
  float *part = a.part + bh * (2 + 2 * (int64_t)N); // [2 + 2N]
  if (tid == 0) {
    part[0] = s.misc[1];
    part[1] = s.misc[0];
  }
#pragma unroll 1
  for (int n = tid; n < N; n += nthreads) {
    part[2 + n] = s.pBb[n];
    part[2 + N + n] = s.pCb[n];
  }
  if (d.outproj_norm)
#pragma unroll 1
    for (int p = tid; p < P; p += nthreads) {
      float acc = 0;
#pragma unroll 1
      for (int w = 0; w < nw * (32 / TL); w++) acc += s.pOn[w * Pp + p];
      a.part_norm[bh * P + p] = acc;
    }
}

/* ---- host side: plans and launches ------------------------------------------------------------------ */

/* A plan's count from the environment variable name (clamped to [0, INT32_MAX]), else dflt */
static int32_t env_count(const char *name, int64_t dflt) {
  const char *s = getenv(name);
  const int64_t v = s ? atoll(s) : dflt;
  return (int32_t)(v < 0 ? 0 : v > INT32_MAX ? INT32_MAX : v);
}

extern "C" int m3k_scan_make_plan(int32_t P, int32_t N, int32_t S, int32_t max_smem, int32_t sms, m3k_scan_plan *out,
                                  char *why) {
  if (P < 1 || P > 128 || N < 1 || N > 256) {
    snprintf(why, 256, "headdim %d x d_state %d: the CUDA scan supports headdim <= 128 and d_state <= 256", P, N);
    return 0;
  }
  const simt_tile tile = simt_tile_for(P, N);
  if (tile.rp == 0) {
    snprintf(why, 256, "headdim %d x d_state %d: no thread tile of the CUDA scan fits", P, N);
    return 0;
  }
  m3k_scan_plan p;
  p.P = P;
  p.N = N;
  p.S = S;
  p.rp = tile.rp;
  p.rn = tile.rn;
  p.pth = tile.pth;
  p.nth = tile.nth;
  p.threads = p.pth * p.nth;
  const int Pp = p.pth * p.rp, Np = p.nth * p.rn, ngroups = p.threads / tok_lanes(P > N ? P : N);
  /* Token blocks as large as fit (two CTAs per multiprocessor when possible), at most 64 tokens
   * and at most one per thread (the token scalars and the backward's scalar chain give each token
   * of a block its own thread; 32-thread plans, P x N <= 32, get 32-token blocks): the forward
   * takes the largest; the backward minimises the per-token share of block (~10 barriers) and
   * sub-block (2 barriers) overheads. */
  const int64_t budget = max_smem < 110 * 1024 ? max_smem : 110 * 1024;
  const int tb_max = p.threads < 64 ? p.threads : 64;
  p.tb_fwd = p.tb_bwd = p.sb = 0;
  for (int tb = tb_max; tb >= 1 && !p.tb_fwd; tb /= 2)
    if (fwd_smem_floats(make_geo(p.pth, p.nth, tb, 1), Pp, Np, S) * 4 <= budget) p.tb_fwd = tb;
  double best = 1e30;
  for (int tb = tb_max; tb >= 1; tb /= 2)
    for (int sb = tb; sb >= 1; sb /= 2)
      if (bwd_smem_floats(make_geo(p.pth, p.nth, tb, sb), Pp, Np, S, ngroups) * 4 <= budget) {
        const double cost = 10.0 / tb + 2.0 / sb;
        if (cost < best) {
          best = cost;
          p.tb_bwd = tb;
          p.sb = sb;
        }
        break;
      }
  if (!p.tb_fwd || !p.tb_bwd) {
    snprintf(why, 256, "headdim %d x d_state %d: the CUDA scan needs more shared memory than the device's %d bytes",
             P, N, max_smem);
    return 0;
  }
  p.smem_fwd = (int32_t)(fwd_smem_floats(make_geo(p.pth, p.nth, p.tb_fwd, 1), Pp, Np, S) * 4);
  p.smem_bwd = (int32_t)(bwd_smem_floats(make_geo(p.pth, p.nth, p.tb_bwd, p.sb), Pp, Np, S, ngroups) * 4);
  p.smem_step = m3k_step_smem(P, N);
  /* The chunked tensor-core scan (16-bit precisions) where its tiles fit in shared memory; which
   * windows take it: takes_chunked. M3_SCAN_CHUNK_MIN_STATE overrides the P x N threshold (the GPU
   * tests set 0), M3_SCAN_SIMT turns the chunked scan off; M3_SCAN_POST_SUM_MIN_CTAS overrides where
   * its post kernel sums a group's heads (m3k_chunked_sums_heads), M3_SCAN_WALK_SPLIT_MAX_CTAS where its
   * walks split a state's rows or the angles' pairs. M3_SCAN_SMALL_BWD=0 turns off the small states' chunked
   * backward (takes_small_bwd). */
  const int64_t cf = m3k_chunked_smem(M3K_CHUNKED_FWD, P, N, S), cb = m3k_chunked_smem(M3K_CHUNKED_BWD, P, N, S);
  const int64_t cp = m3k_chunked_smem(M3K_CHUNKED_PREP, P, N, S), cq = m3k_chunked_smem(M3K_CHUNKED_POST, P, N, S);
  const int64_t cqs = m3k_chunked_smem(M3K_CHUNKED_POST_SUM, P, N, S);
  p.chunked = cf <= max_smem && cb <= max_smem && cp <= max_smem && cq <= max_smem && getenv("M3_SCAN_SIMT") == NULL;
  p.chunk_min_state = env_count("M3_SCAN_CHUNK_MIN_STATE", 1024);
  p.smem_cfwd = p.chunked ? (int32_t)cf : 0;
  p.smem_cbwd = p.chunked ? (int32_t)cb : 0;
  p.smem_cprep = p.chunked ? (int32_t)cp : 0;
  p.smem_cpost = p.chunked ? (int32_t)cq : 0;
  p.smem_cpost_sum = p.chunked && cqs <= max_smem ? (int32_t)cqs : 0;
  p.post_sum_min_ctas = env_count("M3_SCAN_POST_SUM_MIN_CTAS", 128);
  p.walk_split_max_ctas = env_count("M3_SCAN_WALK_SPLIT_MAX_CTAS", 2 * (int64_t)sms);
  p.sms = sms;
  p.simt_bwd_slots = 0;
  p.small_bwd = small_bwd_shape(P, N) && env_count("M3_SCAN_SMALL_BWD", 1) != 0;
  p.small_bwd_slots = 0;
  *out = p;
  return 1;
}

/* Calls body with RP, RN bound to the plan's tile as compile-time constants. */
#define SCAN_TILE_DISPATCH(plan, body)                                             \
  do {                                                                             \
    const int rp_ = (plan)->rp, rn_ = (plan)->rn;                                  \
    if (rp_ == 1 && rn_ == 1) { enum { RP = 1, RN = 1 }; body; }                   \
    else if (rp_ == 1 && rn_ == 2) { enum { RP = 1, RN = 2 }; body; }              \
    else if (rp_ == 2 && rn_ == 2) { enum { RP = 2, RN = 2 }; body; }              \
    else if (rp_ == 2 && rn_ == 4) { enum { RP = 2, RN = 4 }; body; }              \
    else if (rp_ == 4 && rn_ == 4) { enum { RP = 4, RN = 4 }; body; }              \
    else if (rp_ == 4 && rn_ == 8) { enum { RP = 4, RN = 8 }; body; }              \
    else { enum { RP = 4, RN = 16 }; body; }                                       \
  } while (0)

/* SHAPE_DISPATCH on the plan's shape, then SCAN_TILE_DISPATCH: a fixed shape instantiates only its
 * own tile (simt_tile_for: the plan's), other shapes every tile with P and N read at run time. */
__host__ __device__ constexpr bool tile_serves(int PK, int NK, int RP, int RN) {
  return PK == 0 || (simt_tile_for(PK, NK).rp == RP && simt_tile_for(PK, NK).rn == RN);
}
#define SIMT_DISPATCH(plan, body) \
  SHAPE_DISPATCH((plan)->P, (plan)->N, SCAN_TILE_DISPATCH(plan, if constexpr (tile_serves(PK, NK, RP, RN)) body))

extern "C" int64_t m3k_scan_max_rows(int32_t H, int32_t len) {
  return (int64_t)INT32_MAX / ((int64_t)H * ((len + M3K_CHUNK - 1) / M3K_CHUNK));
}

extern "C" int64_t m3k_scan_chunk_scratch(const m3k_scan_plan *plan, int prec, int32_t rows, int32_t len, int32_t H,
                                          int32_t P, int32_t N, int backward) {
  if (prec == M3K_F32 || !plan->chunked) return 0;
  return m3k_chunked_scratch(rows, len, H, P, N, backward);
}

extern "C" int64_t m3k_scan_chunk_states(const m3k_scan_plan *plan, int prec, int32_t rows, int32_t len, int32_t H,
                                         int32_t P, int32_t N) {
  if (prec != M3K_F32 && plan->chunked) return m3k_chunked_kept(rows, len, H, P, N);
  return plan->small_bwd ? small_bwd_states(rows, len, H, P, N) : 0;
}

/* The SIMT kernels' launches and limits (templates, so that SIMT_DISPATCH's discarded tiles are never
 * instantiated). */
template <typename T> static cudaError_t simt_prepare(const m3k_scan_plan *plan) {
  cudaError_t e = cudaSuccess;
  SIMT_DISPATCH(plan, {
    if constexpr (!warp_fwd_shape(PK, NK))
      e = cudaFuncSetAttribute(scan_fwd_kernel<RP, RN, PK, NK, T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               plan->smem_fwd);
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(scan_bwd_kernel<RP, RN, PK, NK, T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               plan->smem_bwd);
  });
  return e;
}

template <typename T> static void simt_fwd(cudaStream_t s, const m3k_scan_plan *plan, const m3k_scan_args &a) {
  const dim3 grid = rows_grid(a.d.H, a.rows);
  const geo gm = make_geo(plan->pth, plan->nth, plan->tb_fwd, 1);
  SIMT_DISPATCH(plan, {
    if constexpr (!warp_fwd_shape(PK, NK))
      (scan_fwd_kernel<RP, RN, PK, NK, T><<<grid, plan->threads, plan->smem_fwd, s>>>(a, gm));
  });
}

template <typename T> static void simt_bwd(cudaStream_t s, const m3k_scan_plan *plan, const m3k_scan_args &a) {
  const dim3 grid = rows_grid(a.d.H, a.rows);
  const geo gm = make_geo(plan->pth, plan->nth, plan->tb_bwd, plan->sb);
  SIMT_DISPATCH(plan, (scan_bwd_kernel<RP, RN, PK, NK, T><<<grid, plan->threads, plan->smem_bwd, s>>>(a, gm)));
}

/* CTAs of the SIMT backward a multiprocessor holds at once */
template <typename T> static cudaError_t simt_bwd_per_sm(const m3k_scan_plan *plan, int *n) {
  cudaError_t e = cudaSuccess;
  SIMT_DISPATCH(plan, e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, scan_bwd_kernel<RP, RN, PK, NK, T>,
                                                                         plan->threads, plan->smem_bwd));
  return e;
}

extern "C" cudaError_t m3k_scan_prepare(int prec, m3k_scan_plan *plan) {
  int per_sm = 0;
  cudaError_t e = m3k_chunked_prepare(prec, plan);
  if (e == cudaSuccess) e = m3k_scan_step_prepare(prec, plan->smem_step);
  if (e == cudaSuccess) M3K_DISPATCH(prec, e = simt_prepare<T>(plan));
  if (e == cudaSuccess) M3K_DISPATCH(prec, e = simt_bwd_per_sm<T>(plan, &per_sm));
  plan->simt_bwd_slots = per_sm * plan->sms;
  int32_t small_per_sm = 0;
  if (e == cudaSuccess && plan->small_bwd) e = m3k_small_bwd_prepare(prec, &small_per_sm);
  plan->small_bwd_slots = small_per_sm * plan->sms;
  return e;
}

/* The longest window the SIMT backward takes; longer ones take the chunked kernels (H200, NOTES.md):
 * at P x N = 256 the SIMT kernel wins on one-chunk windows (rl, B 1 x T 32: 0.409 vs 0.432 ms per step;
 * the chunked scan's extra launches) and loses on longer ones (rl-batch, B 16 x T 256: 2.206 vs 1.832
 * ms); from P x N = 2048 (mid) the chunked one wins. A window of one token (a decode step) never takes
 * them (the forward has scan_step.cu, the backward the SIMT kernel): they would spend a whole 64-token
 * tile on it. f32, and plans whose chunked tiles do not fit, take the SIMT kernels at every length. */
static int32_t simt_window_max(int prec, const m3k_scan_plan *plan) {
  if (prec == M3K_F32 || !plan->chunked) return INT32_MAX;
  return (int64_t)plan->P * plan->N >= plan->chunk_min_state ? 1 : M3K_CHUNK;
}

static bool takes_chunked(int prec, const m3k_scan_plan *plan, const m3k_scan_args *a) {
  return a->chunk_scratch && a->len > simt_window_max(prec, plan);
}

/* The small states' chunked backward (scan_small.cu) takes the windows of more than one chunk that the 16-bit chunked
 * kernels do not (it reads the chunk states the small-state forward kept); on one chunk the SIMT backward is faster
 * (rl, B 1 x T 32 at 16 x 16: 14.2 vs 16.6 us, kernels/NOTES.md run 273). */
static bool takes_small_bwd(const m3k_scan_plan *plan, int32_t len) { return plan->small_bwd && len > M3K_CHUNK; }

extern "C" int64_t m3k_scan_dy_floats(const m3k_scan_plan *plan, int prec, int32_t rows, int32_t len, int32_t E) {
  int32_t simt_len = len < simt_window_max(prec, plan) ? len : simt_window_max(prec, plan);
  if (takes_small_bwd(plan, simt_len)) simt_len = M3K_CHUNK; /* the longer windows take the small states' kernel */
  return simt_len > plan->tb_bwd ? (int64_t)rows * len * E : 0;
}

/* scan_step and scan_fwd_warp normalise B and C themselves, the chunked forward in its angle walk's launch where
 * m3k_chunked_bc_rides; the others read bc_hat from m3k_bcnorm_fwd */
extern "C" cudaError_t m3k_scan_fwd(cudaStream_t s, int prec, const m3k_scan_plan *plan, const m3k_scan_args *a) {
  if (a->len == 1) return m3k_scan_step(s, prec, a);
  const bool chunked = takes_chunked(prec, plan, a);
  if (!chunked && warp_fwd_shape(a->d.P, a->d.N)) return m3k_warp_fwd(s, prec, a);
  if (!chunked || !m3k_chunked_bc_rides(plan, a)) {
    const cudaError_t e = m3k_bcnorm_fwd(s, prec, &a->d, a->proj, a->B_norm, a->C_norm, a->bc_hat, a->bc_rstd,
                                         (int64_t)a->rows * a->len);
    if (e != cudaSuccess) return e;
  }
  if (chunked) return m3k_chunked_fwd(s, prec, plan, a);
  M3K_DISPATCH(prec, simt_fwd<T>(s, plan, *a));
  return cudaGetLastError();
}

static bool bwd_chunked(int prec, const m3k_scan_plan *plan, const m3k_scan_args *a) {
  return takes_chunked(prec, plan, a) && a->chunk_states;
}

/* The small states' chunked backward runs the window (it reads the chunk states the small-state forward kept) */
static bool bwd_small(int prec, const m3k_scan_plan *plan, const m3k_scan_args *a) {
  return !bwd_chunked(prec, plan, a) && takes_small_bwd(plan, a->len) && a->chunk_states;
}

extern "C" int m3k_scan_bwd_bc_stage(int prec, const m3k_scan_plan *plan, const m3k_scan_args *a) {
  if (!bwd_chunked(prec, plan, a) || !m3k_chunked_sums_heads(plan, a)) return M3K_BC_PER_HEAD;
  return m3k_chunked_norms_bc(a) ? M3K_BC_NORMED : M3K_BC_SUMMED;
}

extern "C" int m3k_scan_bwd_fills_device(int prec, const m3k_scan_plan *plan, const m3k_scan_args *a) {
  const int64_t slots = bwd_small(prec, plan, a) ? plan->small_bwd_slots : plan->simt_bwd_slots;
  return !bwd_chunked(prec, plan, a) && slots > 0 && 10 * (int64_t)a->d.H * a->rows >= 9 * slots;
}

extern "C" cudaError_t m3k_scan_bwd(cudaStream_t s, int prec, const m3k_scan_plan *plan, const m3k_scan_args *a) {
  if (bwd_chunked(prec, plan, a)) return m3k_chunked_bwd(s, prec, plan, a);
  if (bwd_small(prec, plan, a)) return m3k_small_bwd(s, prec, a);
  M3K_DISPATCH(prec, simt_bwd<T>(s, plan, *a));
  return cudaGetLastError();
}

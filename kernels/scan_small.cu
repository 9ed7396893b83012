/*
 * scan_small.cu — the backward scan (SPEC.md §5 of §3 steps 2-10, the outputs of scan.cu's
 * scan_bwd_kernel) of small states (small_bwd_shape: 16 x 16, the rl configs) in one launch for every
 * precision, in the chunked form: a CTA of P x N = 256 threads per (row, head), thread (p, n) owning
 * state element (p, n); the window in chunks of CH = 64 tokens; within a chunk every gradient is a
 * small matrix product in float32 over the chunk's tokens, and only the state gradient goes from
 * chunk to chunk in sequence.
 *
 * Within a chunk (tokens t, s = 0 .. e; x_s, k_s, q_t rotated as the forward; D_t the decay from the
 * chunk's start, cum_t = sum of A dt over the chunk's tokens up to t):
 *   S0' = S0 + b'_0 x_prev k_prev^T      (the state before the chunk and the beta term of its first
 *                                         token, b' = (1 - lam) dt; x_prev, k_prev: the token before)
 *   y_t = D_t S0' q_t + sum_{s <= t} C(t, s) (q_t . k_s) x_s + D x_t
 *   S_e = D_e S0' + sum_s C(e, s) x_s k_s^T
 * with C(t, t) = gamma_t, C(t, s) = scale_s P(t, s) for s < t, scale_s = gamma_s + b'_{s+1},
 * P(t, s) = exp(cum_t - cum_s) and D_t = exp(cum_t), both 0 across a reset (SPEC.md §4's identity).
 * Given dy (the gate's backward) and Sh = dL/dS_e (what the later chunks hand back: 0 for the window's
 * last), with Mb = C . (dy_t . x_s), Mf = C . (q_t . k_s), cbar = (q_t . k_s)(dy_t . x_s):
 *   dq_t = sum_s Mb(t, s) k_s + D_t S0'^T dy_t
 *   dk_s = sum_t Mb(t, s) q_t + C(e, s) Sh^T x_s        dx_s = sum_t Mf(t, s) dy_t + C(e, s) Sh k_s + D dy_s
 *   dS0' = D_e Sh + sum_t D_t dy_t q_t^T                (the earlier chunk's Sh)
 *   dC(t, s) = cbar(t, s) (+ x_s^T Sh k_s on row e),   dD_t = dy_t^T S0' q_t (+ <Sh, S0'> at e)
 * and the token scalars from dC, dD: dgamma_s = dC(s, s) + Q_s with Q_s = sum_{t > s} dC(t, s) P(t, s) (Q_s also
 * goes to b'_{s+1}); d(A dt)_r = the sum over t >= r of dD_t D_t + sum_{s < t} scale_s dC(t, s) P(t, s)
 * - scale_t Q_t (the pairs s < r <= t: test_chunked_scan.c's dc_t), 0 at a reset; and b'_0's part of S0'
 * hands b'_0 dS0' k_prev, b'_0 dS0'^T x_prev to the earlier chunk's last token. Then the rotation backward,
 * the angle gradient (a reverse cumulative sum over the window, cut at resets) and the scalar chain to
 * dd_dt, dd_A, trap, as scan_bwd_kernel.
 *
 * A chunk in seven phases between barriers: A the loads and the gate's backward; B the decays (one warp),
 * S0' and x_s^T Sh k_s; C the products Q K^T and dY X^T as 4 x 4 register tiles a thread, and from them the
 * chunk's matrices; D dq, dk, dx and dS0' as 4 x 4 output tiles a thread (two warps each); E the decay
 * gradient (a warp's suffix scan), the carries, the rotation backward; F the B/C gradients out, the angle
 * walk; G the scalar chain. The state entering each chunk after the first is what the small-state forward
 * (scan_warp.cu) kept in a.chunk_states (small_bwd_states). m3k_scan_bwd gives it the windows of more than one
 * chunk that the 16-bit chunked kernels do not take (f32; 16-bit with those off). Every sum has a fixed order:
 * bitwise repeatable.
 */
#include "scan_math.cuh"

constexpr int SP = 16, SN = 16, CH = 64, NT = SP * SN; /* headdim, d_state, chunk, threads */
constexpr int RS = SN + 4;                              /* row stride of token vectors (float4 rows, no conflicts) */
constexpr int MS = CH + 4;                              /* row stride of the chunk's matrices (float4 rows) */
constexpr int SMAX = SN / 2;                            /* rotated pairs at most */
static_assert(SP == SN, "token vectors of x and k share a row stride");
static_assert(small_bwd_shape(SP, SN) && warp_fwd_shape(SP, SN),
              "the small-state forward keeps the chunk states read here");

/* per-token scalars of a chunk (index [name][token]) */
enum { T_DT, T_A, T_LAM, T_DSP, T_DAD, T_AD, T_GAM, T_BP, T_RST, T_CUM, T_SEG, T_D, T_SCALE, T_GD, T_DBAR, T_ROW,
       T_Q, T_ABAR, T_NSC };

struct small_smem {
  alignas(16) float x[CH + 1][RS]; /* x; row 0: the token before the chunk */
  alignas(16) float k[CH + 1][RS]; /* rotated k; row 0: the token before the chunk */
  alignas(16) float q[CH][RS];     /* rotated q */
  alignas(16) float yb[CH][RS];    /* dL/dy */
  alignas(16) float kb[CH][RS];    /* dL/dk, then dL/d(B_hat + B_bias) */
  alignas(16) float qb[CH][RS];    /* dL/dq, then dL/d(C_hat + C_bias) */
  float cs[CH][SMAX], sn[CH][SMAX], tn[CH][SMAX], dth[CH][SMAX]; /* cos, sin, tanh(ang), angle gradient */
  alignas(16) float Mb[CH][MS];  /* C(t, s) (dy_t . x_s), 0 for s > t */
  alignas(16) float MbT[CH][MS]; /* its transpose */
  alignas(16) float Mf[CH][MS];  /* C(t, s) (q_t . k_s) */
  float colp[16][CH];            /* column sums of dC P over each thread row of the tiles */
  alignas(16) float S[SP][SN];   /* Sh */
  alignas(16) float ST[SN][SP];  /* its transpose */
  alignas(16) float S0p[SP][SN]; /* S0' */
  alignas(16) float Sb[SP][SN];  /* dS0': the earlier chunk's Sh */
  float sc[T_NSC][CH];
  float Pe[CH];              /* P(e, s) */
  float zeta[CH + 1];        /* x_s^T Sh k_s, s = -1 .. e */
  float kbias[SN], qbias[SN];
  alignas(16) float xc[SP];
  alignas(16) float kc[SN]; /* xc, kc: the later chunk's gradients of this chunk's last x and k */
  float dthc[SMAX];          /* the angle gradient entering from the later chunk */
  float bbar0;               /* dL/db'_0 */
  float red[NT];             /* reductions */
};

/* The raw global values of a chunk that phase A turns into shared-memory rows (issue_loads puts every load in
 * flight before any arithmetic): per thread, the gate's inputs of four (token i, column p) items (thread 16 i + p
 * modulo the CTA), the biased-to-be B/C values and angle of four units (token i's unit u on thread 16 i + u), two
 * angle logits, and token tid's dd_dt, dd_A, trap and reset */
struct chunk_loads {
  float gx[4], gz[4], gdg[4], gy[4], grn[4];
  unit_raw uw[4];
  float uth[4], ta[2];
  float dd_dt, dd_A, trap;
  bool rst;
};
static_assert(CH * SP / NT == 4 && CH * SN / NT == 4 && CH * SMAX / NT == 2, "chunk_loads' item counts");

template <typename T>
__device__ __forceinline__ void issue_loads(const m3k_scan_args &a, int64_t m0, int nb, int h, int g, chunk_loads &L) {
  const m3k_dims &d = a.d;
  const int tid = threadIdx.x, S = d.S;
  const T *proj = (const T *)a.proj;
#pragma unroll
  for (int r = 0; r < 4; r++) {
    const int idx = tid + NT * r, i = idx / SP, p = idx % SP;
    L.gx[r] = L.gz[r] = L.gdg[r] = L.gy[r] = 0;
    L.grn[r] = 1;
    if (i < nb) {
      const int64_t mi = m0 + i, o = mi * d.E + (int64_t)h * SP + p;
      const T *pr = proj + mi * d.dipp + (int64_t)h * SP + p;
      L.gx[r] = to_f(__ldg(pr + d.x_off));
      L.gz[r] = to_f(__ldg(pr + d.z_off));
      L.gdg[r] = to_f(__ldg((const T *)a.dgated + o));
      L.gy[r] = to_f(__ldg((const T *)a.y + o));
      if (d.outproj_norm) L.grn[r] = __ldg(a.y_rstd + mi * d.H + h);
    }
  }
#pragma unroll
  for (int r = 0; r < 4; r++) {
    const int idx = tid + NT * r, i = idx / SN, u = idx % SN;
    L.uth[r] = 0;
    L.uw[r] = unit_raw{0, 0, 0, 0};
    if (i < nb && u < SN - S) {
      const int64_t m = m0 + i;
      L.uw[r] = unit_load<true>(a.bc_hat + ((m * 2 + 0) * d.G + g) * SN, a.bc_hat + ((m * 2 + 1) * d.G + g) * SN, u, S);
      if (u < S) L.uth[r] = __ldg(a.theta + (m * d.H + h) * S + u);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int idx = tid + NT * r;
    L.ta[r] = idx < nb * S ? to_f(__ldg(proj + (m0 + idx / S) * d.dipp + d.ang_off + idx % S)) : 0.0f;
  }
  L.dd_dt = L.dd_A = L.trap = 0;
  L.rst = false;
  if (tid < nb) {
    const T *row = proj + (m0 + tid) * d.dipp;
    L.dd_dt = to_f(__ldg(row + d.dt_off + h));
    L.dd_A = to_f(__ldg(row + d.A_off + h));
    L.trap = to_f(__ldg(row + d.trap_off + h));
    L.rst = a.resets && a.resets[m0 + tid];
  }
}

/* The rotated k and q (with the pairs' cos and sin) of the chunk's tokens into rows 1 .. nb of s.k and 0 .. nb - 1
 * of s.q, the tanh of the angle logits, and the token scalars, from issue_loads' values */
__device__ __forceinline__ void finish_loads(const m3k_scan_args &a, small_smem &s, int nb, int h,
                                             const chunk_loads &L) {
  const int tid = threadIdx.x, S = a.d.S;
#pragma unroll
  for (int r = 0; r < 4; r++) {
    const int idx = tid + NT * r, i = idx / SN, u = idx % SN;
    if (i < nb && u < SN - S) {
      const unit_kq k = unit_make(L.uw[r], s.kbias, s.qbias, u, S, L.uth[r]);
      s.k[i + 1][k.n0] = k.k0;
      s.q[i][k.n0] = k.q0;
      if (k.pair) {
        s.k[i + 1][k.n0 + 1] = k.k1;
        s.q[i][k.n0 + 1] = k.q1;
        s.cs[i][u] = k.cs;
        s.sn[i][u] = k.sn;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int idx = tid + NT * r;
    if (idx < nb * S) s.tn[idx / S][idx % S] = tanhf(L.ta[r]);
  }
  if (tid < nb) {
    const int i = tid;
    const tok_scalars ts = token_scalars(L.dd_dt, __ldg(a.dt_bias + h), L.dd_A, L.trap, a.d.a_floor);
    s.sc[T_DT][i] = ts.dt;
    s.sc[T_A][i] = ts.A;
    s.sc[T_LAM][i] = ts.lam;
    s.sc[T_DSP][i] = ts.dsp;
    s.sc[T_DAD][i] = ts.dAd;
    s.sc[T_AD][i] = ts.A * ts.dt;
    s.sc[T_GAM][i] = ts.gamma;
    s.sc[T_BP][i] = (1 - ts.lam) * ts.dt;
    s.sc[T_RST][i] = L.rst ? 1.0f : 0.0f;
  }
}

/* Row 0 of s.x and s.k: x and the rotated k of the token before chunk c (warp 7), or the carried state's for
 * c = 0 */
template <typename T>
__device__ __forceinline__ void load_prev(const m3k_scan_args &a, small_smem &s, int c, int64_t m0, int64_t bh, int h,
                                          int g) {
  const m3k_dims &d = a.d;
  const int tid = threadIdx.x, lane = tid & 31, S = d.S;
  if (c == 0) {
    if (tid < SP) s.x[0][tid] = a.in_v ? a.in_v[bh * SP + tid] : 0.0f;
    if (tid < SN) s.k[0][tid] = a.in_k ? a.in_k[bh * SN + tid] : 0.0f;
  } else if (tid >= NT - 32) {
    const int64_t m = m0 - 1;
    if (lane < SP) s.x[0][lane] = to_f(__ldg((const T *)a.proj + m * d.dipp + d.x_off + (int64_t)h * SP + lane));
    if (lane < SN - S) {
      const float th = lane < S ? __ldg(a.theta + (m * d.H + h) * S + lane) : 0.0f;
      rot_unit<true>(a, m, h, g, lane, th, s.k[0], NULL, NULL, NULL);
    }
  }
}

/* P(t, s) for s < t: exp(cum_t - cum_s), 0 when a reset lies in (s, t] */
__device__ __forceinline__ float decay_between(const small_smem &s, int t, int sidx) {
  return s.sc[T_SEG][t] <= (float)sidx ? expf(s.sc[T_CUM][t] - s.sc[T_CUM][sidx]) : 0.0f;
}

/* One warp: cum (inclusive sums of A dt), seg (the last reset at or before the token, -1: none), D and
 * scale of the chunk's tokens, then Pe = P(e, s) of the last token e */
__device__ __forceinline__ void chunk_decays(small_smem &s, int nb) {
  const int lane = threadIdx.x & 31;
  float carry = 0, segc = -1;
  for (int h0 = 0; h0 < CH; h0 += 32) {
    const int i = h0 + lane;
    const bool on = i < nb;
    float c = on ? s.sc[T_AD][i] : 0.0f, r = on && s.sc[T_RST][i] != 0 ? (float)i : -1.0f;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float c2 = __shfl_up_sync(0xffffffffu, c, o), r2 = __shfl_up_sync(0xffffffffu, r, o);
      if (lane >= o) {
        c += c2;
        r = fmaxf(r, r2);
      }
    }
    c += carry;
    r = fmaxf(r, segc);
    if (on) {
      s.sc[T_CUM][i] = c;
      s.sc[T_SEG][i] = r;
      s.sc[T_D][i] = r < 0 ? expf(c) : 0.0f;
      s.sc[T_SCALE][i] = s.sc[T_GAM][i] + (i + 1 < nb ? s.sc[T_BP][i + 1] : 0.0f);
    }
    carry = __shfl_sync(0xffffffffu, c, 31);
    segc = __shfl_sync(0xffffffffu, r, 31);
  }
  __syncwarp();
  for (int i = lane; i < nb - 1; i += 32) s.Pe[i] = decay_between(s, nb - 1, i);
}

/* C(e, s) of the chunk's last token e (Pe filled) */
__device__ __forceinline__ float end_coef(const small_smem &s, int e, int sidx) {
  return sidx == e ? s.sc[T_GAM][e] : s.sc[T_SCALE][sidx] * s.Pe[sidx];
}

/* row . row of 16 floats (float4 rows) */
__device__ __forceinline__ float dot16(const float *u, const float *v) {
  float acc = 0;
#pragma unroll
  for (int j = 0; j < 16; j += 4) {
    const float4 a = *(const float4 *)(u + j), b = *(const float4 *)(v + j);
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
    acc = fmaf(a.z, b.z, acc);
    acc = fmaf(a.w, b.w, acc);
  }
  return acc;
}

/* sum over the 16 lanes of a half warp (every lane of the warp calls it) */
__device__ __forceinline__ float half_sum(float v) {
#pragma unroll
  for (int o = 8; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float dot4(const float4 &a, const float4 &b) {
  return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, a.x * b.x)));
}
__device__ __forceinline__ float4 add4(const float4 &a, const float4 &b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}
__device__ __forceinline__ void fma4(float4 &acc, float m, const float4 &v) {
  acc.x = fmaf(m, v.x, acc.x);
  acc.y = fmaf(m, v.y, acc.y);
  acc.z = fmaf(m, v.z, acc.z);
  acc.w = fmaf(m, v.w, acc.w);
}

template <typename T> __global__ void __launch_bounds__(NT, 2) scan_bwd_small_kernel(const m3k_scan_args a) {
  extern __shared__ __align__(16) unsigned char small_raw[];
  small_smem &s = *(small_smem *)small_raw;
  const m3k_dims &d = a.d;
  const int h = grid_x(a.d.H), b = grid_row(a.d.H), tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  const int S = d.S, H = d.H, g = h / d.hpg, nch = (a.len + CH - 1) / CH;
  const int pp = tid / SN, nn = tid % SN; /* this thread's state element */
  const int64_t bh = (int64_t)b * H + h, row0 = (int64_t)b * a.len;
  auto chunk_len = [&](int c) { return c == nch - 1 ? a.len - c * CH : CH; };
  if (tid < SN) {
    s.kbias[tid] = a.B_bias[(int64_t)h * SN + tid];
    s.qbias[tid] = a.C_bias[(int64_t)h * SN + tid];
  }
  __syncthreads();

  /* the chunks from the last, carrying Sh = dL/dS_e */
  T *dproj = (T *)a.dproj;
  const float Dh = a.D[h];
  const float wn = d.outproj_norm ? a.out_norm[(int64_t)h * SP + (tid % SP)] : 1.0f;
  float p_dy_x = 0, p_norm = 0;      /* partials: D (sum dy . x), the mixer norm weight (column tid % SP) */
  float p_dv = 0, p_bias = 0;        /* dt_bias (token tid), B_bias | C_bias (warp 2: column lane of 2 N) */
  if (tid < SP) s.xc[tid] = 0;
  if (tid < SN) s.kc[tid] = 0;
  if (tid < SMAX) s.dthc[tid] = 0;
  s.Sb[pp][nn] = 0;
  for (int c = nch - 1; c >= 0; c--) {
    const int nb = chunk_len(c), e = nb - 1;
    const int64_t m0 = row0 + (int64_t)c * CH;
    /* A: every load of the chunk in flight (issue_loads, the state entering it, the token before it), then the gate
     * backward, the rotations, the token scalars */
    chunk_loads L;
    issue_loads<T>(a, m0, nb, h, g, L);
    const float s0 = c ? __ldg(a.chunk_states + (bh * nch + c) * NT + tid) : a.in_ssm ? a.in_ssm[bh * NT + tid] : 0.0f;
    load_prev<T>(a, s, c, m0, bh, h, g);
    const float sh = s.Sb[pp][nn]; /* Sh (p, n) */
    s.S[pp][nn] = sh;
    s.ST[nn][pp] = sh;
    finish_loads(a, s, nb, h, L);
#pragma unroll
    for (int r = 0; r < CH * SP / NT; r++) {
      const int idx = tid + NT * r, i = idx / SP, p = idx % SP;
      const bool on = i < nb;
      const int64_t mi = m0 + (on ? i : 0);
      const float yf = L.gy[r], z = L.gz[r], dg = L.gdg[r], xv = L.gx[r], rn = L.grn[r];
      float silu, dsilu;
      silu_and_grad(z, silu, dsilu);
      const float yn = d.outproj_norm ? yf * rn * wn : yf;
      const float dyn = dg * silu;
      float dy = dyn;
      if (d.outproj_norm) {
        const float cn = half_sum(yf * wn * dyn) / (float)SP * rn * rn * rn;
        dy = rn * wn * dyn - yf * cn;
        p_norm += yf * rn * dyn;
      }
      if (on) {
        dproj[mi * d.dipp + d.z_off + (int64_t)h * SP + p] = from_f<T>(dg * yn * dsilu);
        s.yb[i][p] = dy;
        s.x[i + 1][p] = xv;
        p_dy_x += dy * xv;
      }
    }
    __syncthreads();
    /* B: decays (warp 0); S0' (every thread) and the parts of <Sh, S0'> (a warp sum each); zeta_s = x_s^T Sh k_s
     * for s = -1 (the token before) .. e (warps 1..) */
    {
      s.S0p[pp][nn] = s0 + s.sc[T_BP][0] * s.x[0][pp] * s.k[0][nn];
      const float ip = warp_sum(sh * s0);
      if (lane == 0) s.red[wid] = ip;
    }
    if (wid == 0) {
      chunk_decays(s, nb);
    } else {
      for (int base = (wid - 1) * 32; base < (CH + 1) * SP; base += (NT / 32 - 1) * 32) {
        const int idx = base + lane, i = idx / SP - 1, p = idx % SP;
        const float v = i < nb ? s.x[i + 1][p] * dot16(s.S[p], s.k[i + 1]) : 0.0f;
        const float z = half_sum(v);
        if (p == 0 && i < nb) s.zeta[i + 1] = z;
      }
    }
    __syncthreads();
    /* C: the chunk's matrices from the products G = Q K^T and YX = dY X^T (thread tile: rows t = tid / 16 + 16 r,
     * columns s = tid % 16 + 16 j, four columns of n at a time); the row sums of scale_s dC(t, s) P(t, s) and
     * partial column sums of dC P (s < t) */
    {
      const int tg = tid / 16, sg = tid % 16;
      float G[4][4], YX[4][4];
#pragma unroll
      for (int r = 0; r < 4; r++)
#pragma unroll
        for (int j = 0; j < 4; j++) G[r][j] = YX[r][j] = 0;
#pragma unroll
      for (int n = 0; n < SN; n += 4) {
        float4 qv[4], yv[4], kv[4], xv[4];
#pragma unroll
        for (int r = 0; r < 4; r++) {
          qv[r] = *(const float4 *)&s.q[tg + 16 * r][n];
          yv[r] = *(const float4 *)&s.yb[tg + 16 * r][n];
          kv[r] = *(const float4 *)&s.k[sg + 16 * r + 1][n];
          xv[r] = *(const float4 *)&s.x[sg + 16 * r + 1][n];
        }
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
          for (int j = 0; j < 4; j++) {
            G[r][j] += dot4(qv[r], kv[j]);
            YX[r][j] += dot4(yv[r], xv[j]);
          }
      }
      float colp[4] = {0, 0, 0, 0}, cum_s[4], scale_s[4], zeta_s[4];
#pragma unroll
      for (int j = 0; j < 4; j++) { /* the columns' token values, read once */
        const int si = sg + 16 * j;
        cum_s[j] = s.sc[T_CUM][si];
        scale_s[j] = s.sc[T_SCALE][si];
        zeta_s[j] = s.zeta[si + 1];
      }
#pragma unroll
      for (int r = 0; r < 4; r++) {
        const int t = tg + 16 * r;
        const float cum_t = s.sc[T_CUM][t], seg_t = s.sc[T_SEG][t];
        float rowp = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) {
          const int si = sg + 16 * j;
          float mb = 0, mf = 0;
          if (t < nb && si <= t) {
            const float gq = G[r][j], yx = YX[r][j];
            if (si == t) {
              const float gm = s.sc[T_GAM][t];
              mb = gm * yx;
              mf = gm * gq;
              s.sc[T_GD][t] = gq * yx + (t == e ? zeta_s[j] : 0.0f);
            } else {
              const float pv = seg_t <= (float)si ? expf(cum_t - cum_s[j]) : 0.0f, cv = scale_s[j] * pv;
              mb = cv * yx;
              mf = cv * gq;
              const float cp = (gq * yx + (t == e ? zeta_s[j] : 0.0f)) * pv;
              rowp = fmaf(scale_s[j], cp, rowp);
              colp[j] += cp;
            }
          }
          s.Mb[t][si] = mb;
          s.MbT[si][t] = mb;
          s.Mf[t][si] = mf;
        }
        rowp = half_sum(rowp);
        if (sg == 0 && t < nb) s.sc[T_ROW][t] = rowp;
      }
#pragma unroll
      for (int j = 0; j < 4; j++) s.colp[tg][sg + 16 * j] = colp[j];
    }
    __syncthreads();
    /* D: four products on two warps each, a 4 x 4 output tile a thread (rows r0 .. r0 + 3, columns c0 .. c0 + 3):
     * dq and dD (warps 0-1), dk (2-3), dx (4-5); dS0' and the column sums Q_s (6-7) */
    {
      const int grp = wid / 2, i = tid % 64, r0 = (i / 4) * 4, c0 = (i % 4) * 4;
      float4 acc[4], aux[4];
#pragma unroll
      for (int r = 0; r < 4; r++) acc[r] = aux[r] = make_float4(0, 0, 0, 0);
      if (grp == 0) {
        const int smax = min(r0 + 4, nb);
        for (int si = 0; si < smax; si++) {
          const float4 m = *(const float4 *)&s.MbT[si][r0], kv = *(const float4 *)&s.k[si + 1][c0];
          fma4(acc[0], m.x, kv), fma4(acc[1], m.y, kv), fma4(acc[2], m.z, kv), fma4(acc[3], m.w, kv);
        }
#pragma unroll 4
        for (int p = 0; p < SP; p++) { /* S0'^T dy_t */
          const float4 sv = *(const float4 *)&s.S0p[p][c0];
#pragma unroll
          for (int r = 0; r < 4; r++) fma4(aux[r], s.yb[r0 + r][p], sv);
        }
#pragma unroll
        for (int r = 0; r < 4; r++) {
          const int t = r0 + r;
          const float4 qv = *(const float4 *)&s.q[t][c0];
          float db = dot4(aux[r], qv); /* dD_t = (S0'^T dy_t) . q_t */
          db += __shfl_xor_sync(0xffffffffu, db, 1);
          db += __shfl_xor_sync(0xffffffffu, db, 2);
          if (t < nb) {
            fma4(acc[r], s.sc[T_D][t], aux[r]);
            *(float4 *)&s.qb[t][c0] = acc[r];
            if (c0 == 0) {
              float ip = 0; /* <Sh, S0'> at e */
              if (t == e) {
                for (int w = 0; w < NT / 32; w++) ip += s.red[w];
                ip += s.sc[T_BP][0] * s.zeta[0];
              }
              s.sc[T_DBAR][t] = db + ip;
            }
          }
        }
      } else if (grp == 1 || grp == 2) {
        const float(*M)[MS] = grp == 1 ? s.Mb : s.Mf;
        const float(*V)[RS] = grp == 1 ? s.q : s.yb;
        for (int t = r0; t < nb; t++) {
          const float4 m = *(const float4 *)&M[t][r0], v = *(const float4 *)&V[t][c0];
          fma4(acc[0], m.x, v), fma4(acc[1], m.y, v), fma4(acc[2], m.z, v), fma4(acc[3], m.w, v);
        }
        if (grp == 1) {
#pragma unroll 4
          for (int p = 0; p < SP; p++) { /* Sh^T x_s */
            const float4 sv = *(const float4 *)&s.S[p][c0];
#pragma unroll
            for (int r = 0; r < 4; r++) fma4(aux[r], s.x[r0 + r + 1][p], sv);
          }
        } else {
#pragma unroll 4
          for (int n = 0; n < SN; n++) { /* Sh k_s */
            const float4 sv = *(const float4 *)&s.ST[n][c0];
#pragma unroll
            for (int r = 0; r < 4; r++) fma4(aux[r], s.k[r0 + r + 1][n], sv);
          }
        }
#pragma unroll
        for (int r = 0; r < 4; r++) {
          const int si = r0 + r;
          if (si >= nb) break;
          fma4(acc[r], end_coef(s, e, si), aux[r]);
          if (grp == 1) {
            if (si == e) acc[r] = add4(acc[r], *(const float4 *)&s.kc[c0]);
            *(float4 *)&s.kb[si][c0] = acc[r];
          } else {
            fma4(acc[r], Dh, *(const float4 *)&s.yb[si][c0]);
            if (si == e) acc[r] = add4(acc[r], *(const float4 *)&s.xc[c0]);
            const float o[4] = {acc[r].x, acc[r].y, acc[r].z, acc[r].w};
            st_v<4>(dproj + (m0 + si) * d.dipp + d.x_off + (int64_t)h * SP + c0, o);
          }
        }
      } else {
        const int p = i / 4;
        float4 sb = *(const float4 *)&s.S[p][c0];
        const float De = s.sc[T_D][e];
        sb = make_float4(De * sb.x, De * sb.y, De * sb.z, De * sb.w);
        for (int t = 0; t < nb; t++) fma4(sb, s.sc[T_D][t] * s.yb[t][p], *(const float4 *)&s.q[t][c0]);
        *(float4 *)&s.Sb[p][c0] = sb;
        if (i < nb) {
          float q = 0;
          for (int tg = 0; tg < 16; tg++) q += s.colp[tg][i];
          s.sc[T_Q][i] = q;
        }
      }
    }
    __syncthreads();
    /* E: d(A dt) = the reverse sums of dD_t D_t + row_t - scale_t Q_t (warp 0, 0 at a reset); b'_0's gradient and
     * the carries (warp 2); the rotation backward and each token's angle gradient (warps 3..) */
    if (wid == 0) {
      float carry = 0;
      for (int hi = nb; hi > 0; hi -= 32) {
        const int i = hi - 32 + lane;
        const float cv = i >= 0 ? fmaf(s.sc[T_DBAR][i], s.sc[T_D][i], s.sc[T_ROW][i]) - s.sc[T_SCALE][i] * s.sc[T_Q][i]
                                : 0.0f;
        const float ad = suffix_round(cv, 1.0f, carry, lane);
        if (i >= 0) s.sc[T_ABAR][i] = s.sc[T_RST][i] != 0 ? 0.0f : ad;
        carry = __shfl_sync(0xffffffffu, ad, hi >= 32 ? 0 : 32 - hi);
      }
    } else if (wid == 2) {
      float bb = 0;
      for (int idx = lane; idx < NT; idx += 32) bb += s.x[0][idx / SN] * s.Sb[idx / SN][idx % SN] * s.k[0][idx % SN];
      bb = warp_sum(bb);
      const float bp0 = s.sc[T_BP][0];
      float cxk = 0;
      if (lane < SP) {
        for (int n = 0; n < SN; n++) cxk = fmaf(s.Sb[lane][n], s.k[0][n], cxk);
      } else {
        for (int p = 0; p < SP; p++) cxk = fmaf(s.Sb[p][lane - SP], s.x[0][p], cxk);
      }
      if (lane < SP) s.xc[lane] = bp0 * cxk;
      else s.kc[lane - SP] = bp0 * cxk;
      if (lane == 0) s.bbar0 = bb;
    } else if (wid >= 3) {
      for (int idx = tid - 96; idx < nb * S; idx += NT - 96) {
        const int i = idx / S, u = idx % S, n0 = 2 * u;
        const float c0 = s.cs[i][u], s0 = s.sn[i][u];
        const float dk0 = s.kb[i][n0], dk1 = s.kb[i][n0 + 1], dq0 = s.qb[i][n0], dq1 = s.qb[i][n0 + 1];
        s.dth[i][u] = (-dk0 * s.k[i + 1][n0 + 1] + dk1 * s.k[i + 1][n0]) + (-dq0 * s.q[i][n0 + 1] + dq1 * s.q[i][n0]);
        s.kb[i][n0] = c0 * dk0 + s0 * dk1;
        s.kb[i][n0 + 1] = -s0 * dk0 + c0 * dk1;
        s.qb[i][n0] = c0 * dq0 + s0 * dq1;
        s.qb[i][n0 + 1] = -s0 * dq0 + c0 * dq1;
      }
    }
    __syncthreads();
    /* F: the B/C gradients out and their bias partials (warp 2); the angle gradient's reverse sums, cut at resets
     * (warps 4..) */
    if (wid == 2) {
      const int which = lane / SN, n = lane % SN;
      const float(*src)[RS] = which ? s.qb : s.kb;
      for (int i = 0; i < nb; i++) {
        const float v = src[i][n];
        a.dbc_head[(((m0 + i) * H + h) * 2 + which) * SN + n] = v;
        p_bias += v;
      }
    } else if (wid >= 4) {
      for (int u = wid - 4; u < S; u += NT / 32 - 4) {
        float carry = s.dthc[u];
        for (int hi = nb; hi > 0; hi -= 32) {
          const int i = hi - 32 + lane;
          float cv = 0, mv = 1;
          if (i >= 0) {
            cv = s.dth[i][u];
            if (i + 1 < nb && s.sc[T_RST][i + 1] != 0) mv = 0;
          }
          const float Dv = suffix_round(cv, mv, carry, lane);
          if (i >= 0) {
            s.dth[i][u] = Dv;
            const float ta = s.tn[i][u];
            ((T *)a.dang_head)[((m0 + i) * H + h) * S + u] = from_f<T>(PI_F * Dv * s.sc[T_DT][i] * (1 - ta * ta));
          }
          carry = __shfl_sync(0xffffffffu, Dv, hi >= 32 ? 0 : 32 - hi);
        }
        __syncwarp();
        if (lane == 0) s.dthc[u] = s.sc[T_RST][0] != 0 ? 0.0f : carry;
      }
    }
    __syncthreads();
    /* G: the scalar chain of each token to dd_dt, dd_A, trap */
    if (tid < nb) {
      const int i = tid;
      float ang = 0;
      for (int u = 0; u < S; u++) ang = fmaf(PI_F * s.dth[i][u], s.tn[i][u], ang);
      const float dgm = s.sc[T_GD][i] + s.sc[T_Q][i];
      const float dbp = i == 0 ? s.bbar0 : s.sc[T_Q][i - 1];
      const float ad = s.sc[T_ABAR][i], lam = s.sc[T_LAM][i], dt = s.sc[T_DT][i];
      const float ddt = ad * s.sc[T_A][i] + dgm * lam + dbp * (1 - lam) + ang;
      const float dv = ddt * s.sc[T_DSP][i];
      T *drow = dproj + (m0 + i) * d.dipp;
      drow[d.dt_off + h] = from_f<T>(dv);
      drow[d.A_off + h] = from_f<T>(ad * dt * s.sc[T_DAD][i]);
      drow[d.trap_off + h] = from_f<T>((dgm - dbp) * dt * lam * (1 - lam));
      p_dv += dv;
    }
    __syncthreads();
  }

  /* per-(row, head) parameter partials, summed in thread order */
  float *part = a.part + bh * (2 + 2 * SN);
  if (wid == 2) part[2 + lane] = p_bias; /* B_bias | C_bias */
  s.red[tid] = p_norm;
  const float sv = warp_sum(p_dv), sd = warp_sum(p_dy_x);
  __syncthreads();
  if (d.outproj_norm && tid < SP) {
    float acc = 0;
    for (int k = 0; k < NT / SP; k++) acc += s.red[tid + SP * k];
    a.part_norm[bh * SP + tid] = acc;
  }
  __syncthreads();
  if (lane == 0) {
    s.red[wid] = sv;
    s.red[32 + wid] = sd;
  }
  __syncthreads();
  if (tid == 0) {
    float v = 0, dd = 0;
    for (int w = 0; w < NT / 32; w++) {
      v += s.red[w];
      dd += s.red[32 + w];
    }
    part[0] = v;
    part[1] = dd;
  }
}

template <typename T> static cudaError_t small_prepare() {
  return cudaFuncSetAttribute(scan_bwd_small_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              (int)sizeof(small_smem));
}

cudaError_t m3k_small_bwd_prepare(int prec, int32_t *per_sm) {
  cudaError_t e = cudaSuccess;
  M3K_DISPATCH(prec, {
    e = small_prepare<T>();
    if (e == cudaSuccess)
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, scan_bwd_small_kernel<T>, NT, sizeof(small_smem));
  });
  return e;
}

cudaError_t m3k_small_bwd(cudaStream_t s, int prec, const m3k_scan_args *a) {
  const dim3 grid = rows_grid(a->d.H, a->rows);
  M3K_DISPATCH(prec, (scan_bwd_small_kernel<T><<<grid, NT, sizeof(small_smem), s>>>(*a)));
  return cudaGetLastError();
}

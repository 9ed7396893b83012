/*
 * scan_chunked.cu — the Mamba-3 SISO scan of SPEC.md §3 steps 2-10 for the 16-bit precisions
 * (bf16, f16) as a chunked scan on tensor cores (KERNELS.md §1.3, §1.4). Same inputs, outputs
 * and meaning as the SIMT kernels of scan.cu (m3k_scan_args); float32 keeps those.
 *
 * Math (validated in float64 by engine/tests/test_chunked_scan.c). Per head, token t:
 *   a_t = A_t dt_t (log decay), gamma_t = lam_t dt_t, bp_t = (1 - lam_t) dt_t (0 at a reset),
 *   q_t, k_t = rotated C_hat + C_bias, B_hat + B_bias (float32, as scan.cu),
 *   scale_s = gamma_s + bp_{s+1} (the second term only inside the window),
 *   chunks of Q = 64 tokens (the last may be partial), c_t = chunk-local inclusive cumsum of a,
 *   seg_t = local index of the last reset <= t (-1: none), EC_t = [seg_t < 0] e^{c_t},
 *   W_s = [s >= seg_last] e^{c_last - c_s}, dec = [seg_last < 0] e^{c_last}, ktil_s = scale_s k_s,
 *   E = the state entering the chunk (float32; E_0 = H_in + bp_0 v_in k_in^T):
 *     y_t = EC_t E q_t + sum_{seg_t <= s < t} e^{c_t - c_s} (q_t.ktil_s) x_s + (gamma_t q_t.k_t + D) x_t
 *     E  <- dec E + sum_s W_s x_s ktil_s^T
 *   i.e. per chunk the matrix products S = q ktil^T (Q x Q), Y = (L o S) x + diag(EC) q E^T and
 *   E += (diag(W) x)^T ktil, with L the masked decay matrix, on tensor cores (wmma 16x16x16,
 *   bf16 operands, float32 accumulation; bf16 also for f16 training: its range holds the loss-
 *   scaled gradients). Everything else (scalars, cumsums, masks, norms, gate, rotation, angles)
 *   is float32 with the formulas of scan.cu.
 *   Backward (reverse chunk walk; dE = gradient of the state leaving the chunk, float32 in shared
 *   memory; the entering states are recomputed by a forward sweep over the chunks first and kept
 *   in the scratch a.chunk_states): with S1 = q ktil^T, S2 = dY x^T, L1 = L o S1, L2 = L o S2,
 *     dq_t    = EC_t (dY E)_t + (L2 ktil)_t + gamma_t (dY_t.x_t) k_t
 *     dktil_s = W_s (x dE)_s + (L2^T q)_s,           dk_s = scale_s dktil_s + gamma_s (dY_s.x_s) q_s
 *     dx_s    = W_s (ktil dE^T)_s + (L1^T dY)_s + (gamma_s q_s.k_s + D) dY_s
 *     dE     <- dec dE + (diag(EC) dY)^T q
 *     dscale_s = dktil_s.k_s (-> dgamma_s and dbp_{s+1}); dgamma_s += (dY_s.x_s)(q_s.k_s)
 *     dc_t = r_t + rowsum_t(M) - colsum_t(M) - v_t (+ dec <dE, E> + sum_s v_s at the last token),
 *       M = L o S1 o S2, r_t = EC_t q_t.(dY E)_t, v_s = W_s ktil_s.(x dE)_s; da_t = suffix sum of dc
 *       (0 at a reset); dbp_0 = v_in^T dE_0 k_in (the window's pending beta term).
 *   The token-0 scalars of a chunk wait for dscale of the chunk before it (processed next in the
 *   reverse walk): they are finished one chunk later ("pending"). Then the rotation backward,
 *   the angle gradient (reverse cumulative sum carried across chunks, stopped at resets) and the
 *   scalar chain to dd_dt, dd_A, trap exactly as scan.cu.
 *
 * Mapping: one CTA (8 warps) per (head, row) walks the row's chunks; operand tiles live in shared
 * memory (bf16, padded rows: +8 elements), the state E / dE in shared memory (float32); each
 * product's 16 x 16 output tiles are distributed over the warps. Every sum has a fixed order (no
 * atomics): bitwise repeatable. The forward (scan_fwd_chunked_r) keeps E in the warps' accumulator
 * registers instead: no float32 S tile, W x in place; 128 registers and ~103 KB shared memory on
 * lm130, two CTAs per SM (NOTES.md run 8). It holds at most CWARPS x FR_MAXT 16 x 16 tiles of E
 * (Pp x Np <= 8192, e.g. lm130's 64 x 128): larger states, and shapes whose tiles do not fit in
 * shared memory, keep the SIMT kernels (m3k_chunked_smem answers INT64_MAX / a size above the limit).
 */
#include <mma.h>

#include "scan_math.cuh"

using namespace nvcuda;

typedef __nv_bfloat16 OT; /* tensor-core operand type */

enum { CQ = 64, CTHREADS = 256, CWARPS = 8 };

/* per-token scalar table: sc[i * FW + F_x], i < CQ + 1 (slot CQ... unused; slot nb = next token) */
enum { F_A = 0, F_GAM, F_BP, F_DT, F_RST, F_LAM, F_AA, F_DSP, F_DAD, F_C, F_SEG, F_EC, F_SCALE, F_W, F_QK, F_DYX,
       F_R, F_ROW, F_COL, F_V, F_DSCALE, F_DGAM, F_DA, F_DTANG, F_DV, FW };
/* pending token (the first of the chunk processed last) */
enum { PN_DA = 0, PN_DGAM, PN_DT, PN_LAM, PN_AA, PN_DSP, PN_DAD, PN_DTANG, PN_RST, PN_VALID, PN_W };

struct cdims {
  int Pp, Np;            /* P, N rounded up to 16 */
  int lqn, lqp, lqq;     /* row strides of bf16 tiles N, P, Q wide */
  int lfn, lfp, lfq;     /* row strides of float32 tiles */
};

__host__ __device__ inline cdims make_cdims(int P, int N) {
  cdims c;
  c.Pp = (P + 15) / 16 * 16;
  c.Np = (N + 15) / 16 * 16;
  c.lqn = c.Np + 8;
  c.lqp = c.Pp + 8;
  c.lqq = CQ + 8;
  c.lfn = c.Np + 4;
  c.lfp = c.Pp + 4;
  c.lfq = CQ + 4;
  return c;
}

struct csmem {
  OT *sq;    /* [CQ][lqn] q (rotated) */
  OT *sk;    /* [CQ][lqn] ktil = scale k */
  OT *sx;    /* [CQ][lqp] x */
  OT *sxw;   /* [CQ][lqp] bwd: dY (the forward forms W x in place in sx) */
  OT *syw;   /* [CQ][lqp] bwd: EC dY */
  OT *sE;    /* [Pp][lqn] the entering state E (bf16) */
  OT *sdE;   /* [Pp][lqn] bwd: dE (bf16) */
  OT *sL1;   /* [CQ][lqq] fwd: L o S; bwd: L o S1 */
  OT *sL2;   /* [CQ][lqq] bwd: L o S2 */
  float *sEf;  /* [Pp][lfn] bwd: dE (float32; the forward keeps E in registers) */
  float *sR;   /* fwd: per-warp scratch, then Y [CQ][lfp]; bwd: per-warp S1, S2 tiles + M partials, then [CQ][max(lfn, lfp)] */
  float *th;   /* [CQ][S] fwd: tanh(ang) then theta; bwd: tanh(ang) */
  float *thv;  /* [CQ][S] bwd: theta of the chunk (staged from a.theta) */
  float *sbk, *sbq; /* [Np] B_bias[h], C_bias[h] */
  float *dth;  /* [CQ][S] bwd: angle gradient per token, then pi D tanh */
  float *sc;   /* [CQ + 1][FW] */
  float *kl;   /* [Np] fwd: k (rotated, unscaled) of the window's last token */
  float *thr;  /* [S] fwd: running angle; bwd: running angle gradient */
  float *pB, *pC; /* [Np] bwd: B_bias, C_bias partials */
  float *pOn;  /* [CWARPS][Pp] bwd: mixer norm weight partials per warp */
  float *red;  /* [32] */
  float *pend; /* [PN_W] bwd: the pending token; plus misc: [PN_W..PN_W+8) */
};

__host__ __device__ inline size_t cs_take(size_t &off, size_t bytes) {
  const size_t o = (off + 127) & ~(size_t)127;
  off = o + bytes;
  return o;
}

/* Carves the backward's shared memory (base NULL: only the size). */
__host__ __device__ inline size_t carve_c(unsigned char *base, int P, int N, int S, csmem *m) {
  const cdims c = make_cdims(P, N);
  size_t off = 0;
  csmem t;
#define CT(field, type, n) t.field = (type *)(base + cs_take(off, (size_t)(n) * sizeof(type)))
  CT(sq, OT, CQ * c.lqn);
  CT(sk, OT, CQ * c.lqn);
  CT(sx, OT, CQ * c.lqp);
  CT(sxw, OT, CQ * c.lqp);
  CT(syw, OT, CQ * c.lqp);
  CT(sE, OT, c.Pp * c.lqn);
  CT(sdE, OT, c.Pp * c.lqn);
  CT(sL1, OT, CQ * c.lqq);
  CT(sL2, OT, CQ * c.lqq);
  CT(sEf, float, c.Pp * c.lfn);
  {
    /* per-warp S1, S2 scratch tiles + the row / column partials of M, then [CQ][max(lfn, lfp)] */
    size_t r = (size_t)CWARPS * 512 + 2 * CQ * (CQ / 16);
    const size_t o = (size_t)CQ * (c.lfn > c.lfp ? c.lfn : c.lfp);
    if (o > r) r = o;
    CT(sR, float, r);
  }
  CT(th, float, CQ * S + 1);
  CT(dth, float, CQ * S + 1);
  CT(thv, float, CQ * S + 1);
  CT(sbk, float, c.Np);
  CT(sbq, float, c.Np);
  CT(sc, float, (CQ + 1) * FW);
  CT(kl, float, c.Np);
  CT(thr, float, S + 1);
  CT(pB, float, c.Np);
  CT(pC, float, c.Np);
  CT(pOn, float, CWARPS * c.Pp);
  CT(red, float, 32);
  CT(pend, float, PN_W + 8);
#undef CT
  if (m) *m = t;
  return off + 128;
}

/* Forward, E in registers (scan_fwd_chunked_r): the float32 state E lives in wmma accumulator
 * fragments (tile wid + CWARPS j of the Pp x Np state for warp wid, j < FR_MAXT), so neither the
 * float32 copy of E nor the float32 S tile nor a separate W x tile are in shared memory (lm130:
 * 168 -> 103 KB: two CTAs per SM). Shapes with more E tiles take the SIMT kernels. */
enum { FR_MAXT = 4, FR_UD = 2 }; /* FR_UD: units in flight per lane in c_build */

__host__ __device__ inline bool fwd_in_regs(int P, int N) {
  const cdims c = make_cdims(P, N);
  return (c.Pp / 16) * (c.Np / 16) <= CWARPS * FR_MAXT;
}

__host__ __device__ inline size_t carve_r(unsigned char *base, int P, int N, int S, csmem *m) {
  const cdims c = make_cdims(P, N);
  size_t off = 0;
  csmem t;
#define CT(field, type, n) t.field = (type *)(base + cs_take(off, (size_t)(n) * sizeof(type)))
  CT(sq, OT, CQ * c.lqn);
  CT(sk, OT, CQ * c.lqn);
  CT(sx, OT, CQ * c.lqp); /* x, then (after Y) W x in place */
  t.sxw = NULL;
  t.syw = NULL;
  CT(sE, OT, c.Pp * c.lqn);
  t.sdE = NULL;
  CT(sL1, OT, CQ * c.lqq); /* L o S; after Y: per-warp 16 x 16 float32 scratch (E -> bf16) */
  t.sL2 = NULL;
  t.sEf = NULL;
  {
    size_t r = (size_t)CQ * c.lfp; /* Y; before Y: per-warp 16 x 16 float32 scratch (S tiles) */
    if (r < (size_t)CWARPS * 256) r = (size_t)CWARPS * 256;
    CT(sR, float, r);
  }
  CT(th, float, CQ * S + 1);
  t.dth = NULL;
  t.thv = NULL;
  CT(sbk, float, c.Np);
  CT(sbq, float, c.Np);
  CT(sc, float, (CQ + 1) * FW);
  CT(kl, float, c.Np);
  CT(thr, float, S + 1);
  t.pB = t.pC = t.pOn = NULL;
  CT(red, float, 32);
  CT(pend, float, PN_W + 8);
#undef CT
  if (m) *m = t;
  return off + 128;
}

/* ---- tensor-core block product -------------------------------------------------------------------- */

template <typename L> struct is_row { static constexpr bool v = false; };
template <> struct is_row<wmma::row_major> { static constexpr bool v = true; };

/* C[M x Nn] (float32, row stride ldc) (+)= A[M x K] B[K x Nn]; A row-major (A[i lda + k]) or
 * column-major (A[k lda + i]), B row-major (B[k ldb + j]) or column-major (B[j ldb + k]); M, Nn,
 * K multiples of 16. The 16 x 16 output tiles are spread over the CTA's warps; each tile's
 * K loop runs in order (deterministic). */
template <typename LA, typename LB>
__device__ __forceinline__ void bmm(float *C, int ldc, const OT *A, int lda, const OT *B, int ldb, int M, int Nn,
                                    int K, bool acc) {
  const int wid = threadIdx.x >> 5;
  const int tn = Nn / 16, nt = (M / 16) * tn;
  for (int tile = wid; tile < nt; tile += CWARPS) {
    const int i0 = tile / tn * 16, j0 = tile % tn * 16;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
    float *cp = C + (size_t)i0 * ldc + j0;
    if (acc) wmma::load_matrix_sync(c, cp, ldc, wmma::mem_row_major);
    else wmma::fill_fragment(c, 0.0f);
    for (int k = 0; k < K; k += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, OT, LA> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, OT, LB> fb;
      wmma::load_matrix_sync(fa, is_row<LA>::v ? A + (size_t)i0 * lda + k : A + (size_t)k * lda + i0, lda);
      wmma::load_matrix_sync(fb, is_row<LB>::v ? B + (size_t)k * ldb + j0 : B + (size_t)j0 * ldb + k, ldb);
      wmma::mma_sync(c, fa, fb, c);
    }
    wmma::store_matrix_sync(cp, c, ldc, wmma::mem_row_major);
  }
}
typedef wmma::row_major RM;
typedef wmma::col_major CM;

/* ---- per-chunk pieces shared by both directions ----------------------------------------------------- */

/* Token scalars of tokens [t0, t0 + nb] (slot nb: the next token, if inside the window). */
template <typename T>
__device__ __forceinline__ void c_scalars(const m3k_scan_args &a, float *sc, int64_t m0, int t0, int nb, int h) {
  const m3k_dims &d = a.d;
  const T *proj = (const T *)a.proj;
  for (int i = threadIdx.x; i <= nb; i += blockDim.x) {
    float *s = sc + i * FW;
    if (t0 + i >= a.len) {
      s[F_BP] = 0;
      s[F_RST] = 0;
      continue;
    }
    const T *pr = proj + (m0 + i) * d.dipp;
    const tok_scalars ts = token_scalars(to_f(pr[d.dt_off + h]), a.dt_bias[h], to_f(pr[d.A_off + h]),
                                         to_f(pr[d.trap_off + h]), d.a_floor);
    const bool rs = a.resets && a.resets[m0 + i];
    s[F_A] = ts.A * ts.dt;
    s[F_GAM] = ts.gamma;
    s[F_BP] = rs ? 0.0f : (1 - ts.lam) * ts.dt;
    s[F_DT] = ts.dt;
    s[F_RST] = rs ? 1.0f : 0.0f;
    s[F_LAM] = ts.lam;
    s[F_AA] = ts.A;
    s[F_DSP] = ts.dsp;
    s[F_DAD] = ts.dAd;
  }
}

/* Warp 0: chunk-local cumsum c, reset segments, EC, scale, W of the nb tokens (2 per lane, a
 * shuffle scan); misc[0] = dec. */
__device__ __forceinline__ void c_prep(float *sc, int nb, float *misc) {
  const int lane = threadIdx.x & 31;
  const int j0 = 2 * lane, j1 = j0 + 1;
  const float a0 = j0 < nb ? sc[j0 * FW + F_A] : 0.0f, a1 = j1 < nb ? sc[j1 * FW + F_A] : 0.0f;
  const int r0 = (j0 < nb && sc[j0 * FW + F_RST] != 0) ? j0 : -1;
  const int r1 = (j1 < nb && sc[j1 * FW + F_RST] != 0) ? j1 : -1;
  float s = a0 + a1;
  int rg = r0 > r1 ? r0 : r1;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float v = __shfl_up_sync(0xffffffffu, s, o);
    const int rv = __shfl_up_sync(0xffffffffu, rg, o);
    if (lane >= o) {
      s += v;
      rg = rg > rv ? rg : rv;
    }
  }
  float ex = __shfl_up_sync(0xffffffffu, s, 1);
  int rex = __shfl_up_sync(0xffffffffu, rg, 1);
  if (lane == 0) {
    ex = 0;
    rex = -1;
  }
  const float c0 = ex + a0, c1 = c0 + a1;
  const int sg0 = rex > r0 ? rex : r0, sg1 = sg0 > r1 ? sg0 : r1;
  const int last = nb - 1;
  const float clast = __shfl_sync(0xffffffffu, (last & 1) ? c1 : c0, last >> 1);
  const int seglast = __shfl_sync(0xffffffffu, (last & 1) ? sg1 : sg0, last >> 1);
#pragma unroll
  for (int k = 0; k < 2; k++) {
    const int j = k ? j1 : j0;
    if (j >= nb) continue;
    const float c = k ? c1 : c0;
    const int sg = k ? sg1 : sg0;
    float *t = sc + j * FW;
    t[F_C] = c;
    t[F_SEG] = (float)sg;
    t[F_EC] = sg < 0 ? expf(c) : 0.0f;
    t[F_SCALE] = t[F_GAM] + (j + 1 <= nb ? sc[(j + 1) * FW + F_BP] : 0.0f);
    t[F_W] = j >= seglast ? expf(fminf(clast - c, 0.0f)) : 0.0f;
  }
  if (lane == 0) misc[0] = seglast < 0 ? expf(clast) : 0.0f;
}

/* The rotated k and q (float32) of unit u of a position (u < S: pair (2u, 2u+1) rotated by theta;
 * else the passing column 2S + u - S): the raw B_hat, C_hat values are loaded first (unit_load,
 * read-only path, several units per lane in flight), then biased and rotated (unit_make). */
struct unit_kq {
  int n0, pair;
  float k0, k1, q0, q1, cs, sn;
};
struct unit_raw {
  float k0, k1, q0, q1;
};

__device__ __forceinline__ int unit_col(int u, int S) { return u < S ? 2 * u : 2 * S + (u - S); }

__device__ __forceinline__ unit_raw unit_load(const float *bk, const float *bq, int u, int S) {
  unit_raw r;
  const int n0 = unit_col(u, S);
  r.k0 = __ldg(bk + n0);
  r.q0 = __ldg(bq + n0);
  r.k1 = r.q1 = 0;
  if (u < S) {
    r.k1 = __ldg(bk + n0 + 1);
    r.q1 = __ldg(bq + n0 + 1);
  }
  return r;
}

__device__ __forceinline__ unit_kq unit_make(const unit_raw &w, const float *sbk, const float *sbq, int u, int S,
                                             float theta) {
  unit_kq r;
  const int n0 = unit_col(u, S);
  r.n0 = n0;
  if (u < S) {
    float c, sn;
    sincosf(theta, &sn, &c);
    const float k0 = w.k0 + sbk[n0], k1 = w.k1 + sbk[n0 + 1];
    const float q0 = w.q0 + sbq[n0], q1 = w.q1 + sbq[n0 + 1];
    r.pair = 1;
    r.k0 = k0 * c - k1 * sn;
    r.k1 = k0 * sn + k1 * c;
    r.q0 = q0 * c - q1 * sn;
    r.q1 = q0 * sn + q1 * c;
    r.cs = c;
    r.sn = sn;
  } else {
    r.pair = 0;
    r.k0 = w.k0 + sbk[n0];
    r.q0 = w.q0 + sbq[n0];
    r.k1 = r.q1 = 0;
    r.cs = 1;
    r.sn = 0;
  }
  return r;
}

/* Calls body(unit_kq, u) for the units u = lane, lane + 32, ... of local token i (position m),
 * loading up to 4 units per lane before using them. th: [CQ][S] angles of the chunk. */
template <int UD = 4, typename F>
__device__ __forceinline__ void for_units(const m3k_scan_args &a, const csmem &s, const float *th, int64_t m, int g,
                                          int i, F body) {
  const int lane = threadIdx.x & 31, N = a.d.N, S = a.d.S, U = N - S;
  const float *bk = a.bc_hat + ((m * 2 + 0) * a.d.G + g) * N; // [N] B_hat
  const float *bq = a.bc_hat + ((m * 2 + 1) * a.d.G + g) * N; // [N] C_hat
  for (int u0 = lane; u0 < U; u0 += 32 * UD) {
    unit_raw w[UD];
    float tv[UD];
#pragma unroll
    for (int j = 0; j < UD; j++) {
      const int u = u0 + 32 * j;
      if (u < U) {
        w[j] = unit_load(bk, bq, u, S);
        tv[j] = u < S ? th[i * S + u] : 0.0f;
      }
    }
#pragma unroll
    for (int j = 0; j < UD; j++) {
      const int u = u0 + 32 * j;
      if (u < U) body(unit_make(w[j], s.sbk, s.sbq, u, S, tv[j]), u);
    }
  }
}

/* q (bf16, if want_q), ktil (bf16), q.k (float32) of the chunk, warp per token; rows >= nb and
 * columns >= N are zero. Angles from th [CQ][S]. kl: the window's last k (or NULL). */
template <int UD = 4>
__device__ __forceinline__ void c_build(const m3k_scan_args &a, const csmem &s, const cdims &cd, int64_t m0, int t0,
                                        int nb, int g, bool want_q, const float *th, float *kl) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const int N = a.d.N;
  for (int i = wid; i < CQ; i += CWARPS) {
    OT *q = s.sq + i * cd.lqn, *k = s.sk + i * cd.lqn;
    if (i >= nb) {
      for (int n = lane; n < cd.Np; n += 32) {
        q[n] = __float2bfloat16_rn(0.0f);
        k[n] = __float2bfloat16_rn(0.0f);
      }
      continue;
    }
    const float sc = s.sc[i * FW + F_SCALE];
    const bool last = kl && (t0 + i == a.len - 1);
    float qk = 0;
    for_units<UD>(a, s, th, m0 + i, g, i, [&](const unit_kq &r, int) {
      qk += r.q0 * r.k0 + r.q1 * r.k1;
      k[r.n0] = __float2bfloat16_rn(sc * r.k0);
      if (want_q) q[r.n0] = __float2bfloat16_rn(r.q0);
      if (last) kl[r.n0] = r.k0;
      if (r.pair) {
        k[r.n0 + 1] = __float2bfloat16_rn(sc * r.k1);
        if (want_q) q[r.n0 + 1] = __float2bfloat16_rn(r.q1);
        if (last) kl[r.n0 + 1] = r.k1;
      }
    });
    for (int n = N + lane; n < cd.Np; n += 32) {
      q[n] = __float2bfloat16_rn(0.0f);
      k[n] = __float2bfloat16_rn(0.0f);
    }
    qk = warp_sum(qk);
    if (lane == 0) s.sc[i * FW + F_QK] = qk;
  }
}

/* Read-only activation loads (the non-coherent path: never for data this kernel writes). */
template <typename T> __device__ __forceinline__ float ldact(const T *p) { return to_f(__ldg(p)); }
template <> __device__ __forceinline__ float ldact<float>(const float *p) { return __ldg(p); }

/* B_bias[h], C_bias[h] into shared memory (padded with zeros). */
__device__ __forceinline__ void c_biases(const m3k_scan_args &a, const csmem &s, const cdims &cd, int h) {
  for (int n = threadIdx.x; n < cd.Np; n += blockDim.x) {
    s.sbk[n] = n < a.d.N ? a.B_bias[(int64_t)h * a.d.N + n] : 0.0f;
    s.sbq[n] = n < a.d.N ? a.C_bias[(int64_t)h * a.d.N + n] : 0.0f;
  }
}

/* ---- forward ---------------------------------------------------------------------------------------- */

/* Forward with E in accumulator registers (see carve_r). Per chunk: S tiles (lower triangle only:
 * the mask zeroes the rest) through a per-warp scratch straight into L o S (bf16); each warp's
 * Y tiles = EC-scaled q E^T plus (L o S) x without leaving the warp; W x in place in sx after Y;
 * E = dec E + (W x)^T ktil in registers, converted to bf16 through the per-warp scratch. */
static_assert(CQ * (CQ + 8) * sizeof(OT) >= CWARPS * 256 * sizeof(float), "sL1 holds the per-warp scratch");

template <typename T>
__global__ void __launch_bounds__(CTHREADS, 2) scan_fwd_chunked_r(const m3k_scan_args a) {
  extern __shared__ __align__(128) unsigned char smraw[];
  const m3k_dims &d = a.d;
  const int h = blockIdx.x, b = blockIdx.y, g = h / d.hpg;
  const int P = d.P, N = d.N, S = d.S, H = d.H, E = d.E;
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  const cdims cd = make_cdims(P, N);
  csmem s;
  carve_r(smraw, P, N, S, &s);
  const T *proj = (const T *)a.proj; // [M, dipp]
  T *gated = (T *)a.gated;           // [M, E]
  const int64_t bh = (int64_t)b * H + h;
  const float Dh = a.D[h];
  float *misc = s.pend + PN_W;
  const int etn = cd.Np / 16, ent = (cd.Pp / 16) * etn; /* E tiles (row-major over Pp x Np) */
  float *wscr = s.sR + wid * 256;           /* per-warp scratch in the Y area (before Y exists) */
  float *escr = (float *)s.sL1 + wid * 256; /* per-warp scratch in the L o S area (after Y) */
  float *sY = s.sR;                         /* [CQ][lfp] */
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> eacc[FR_MAXT];

  /* E_0 = H_in + bp_0 v_in k_in^T (only read where no reset precedes: masks) */
  c_scalars<T>(a, s.sc, (int64_t)b * a.len, 0, 0, h);
  c_biases(a, s, cd, h);
  for (int j = tid; j < S; j += CTHREADS) s.thr[j] = a.in_angle ? a.in_angle[bh * S + j] : 0.0f;
  __syncthreads();
  {
    const float bp0 = s.sc[F_BP];
#pragma unroll
    for (int j = 0; j < FR_MAXT; j++) {
      const int tile = wid + CWARPS * j;
      if (tile < ent) {
        const int i0 = tile / etn * 16, j0 = tile % etn * 16;
        for (int e = lane; e < 256; e += 32) {
          const int p = i0 + (e >> 4), n = j0 + (e & 15);
          float v = 0;
          if (p < P && n < N) {
            if (a.in_ssm) v = a.in_ssm[(bh * P + p) * N + n];
            if (a.in_v && a.in_k) v += bp0 * a.in_v[bh * P + p] * a.in_k[bh * N + n];
          }
          wscr[e] = v;
          s.sE[p * cd.lqn + n] = __float2bfloat16_rn(v);
        }
        __syncwarp();
        wmma::load_matrix_sync(eacc[j], wscr, 16, wmma::mem_row_major);
        __syncwarp();
      } else {
        wmma::fill_fragment(eacc[j], 0.0f);
      }
    }
  }
  __syncthreads();

  for (int t0 = 0; t0 < a.len; t0 += CQ) {
    const int nb = min(CQ, a.len - t0);
    const int64_t m0 = (int64_t)b * a.len + t0;
    /* 1. loads: scalars, tanh of the angle logits, x */
    c_scalars<T>(a, s.sc, m0, t0, nb, h);
#pragma unroll 4
    for (int idx = tid; idx < nb * S; idx += CTHREADS) {
      const int i = idx / S, j = idx - i * S;
      s.th[idx] = tanhf(ldact(proj + (m0 + i) * d.dipp + d.ang_off + j));
    }
#pragma unroll 4
    for (int idx = tid; idx < CQ * cd.Pp; idx += CTHREADS) {
      const int i = idx / cd.Pp, p = idx - i * cd.Pp;
      const float xv = (i < nb && p < P) ? ldact(proj + (m0 + i) * d.dipp + d.x_off + (int64_t)h * P + p) : 0.0f;
      s.sx[i * cd.lqp + p] = __float2bfloat16_rn(xv);
    }
    __syncthreads();
    /* 2. warp 0: cumsums and masks; the other warps: the angle walk (as scan.cu) */
    if (wid == 0) {
      c_prep(s.sc, nb, misc);
    } else {
      for (int j = tid - 32; j < S; j += CTHREADS - 32) {
        float v = s.thr[j];
#pragma unroll 4
        for (int i = 0; i < nb; i++) {
          if (s.sc[i * FW + F_RST] != 0) v = 0;
          v = wrap_sum(v, PI_F * s.th[i * S + j] * s.sc[i * FW + F_DT]);
          s.th[i * S + j] = v;
          a.theta[((m0 + i) * H + h) * S + j] = v;
        }
        s.thr[j] = v;
      }
    }
    __syncthreads();
    /* 3. q, ktil, q.k */
    c_build<FR_UD>(a, s, cd, m0, t0, nb, g, true, s.th, s.kl);
    __syncthreads();
    /* 4. L o S, S = q ktil^T, tile by tile through the warp's scratch (tiles above the diagonal: 0) */
    for (int tile = wid; tile < (CQ / 16) * (CQ / 16); tile += CWARPS) {
      const int ti = tile / (CQ / 16), tj = tile % (CQ / 16);
      OT *l1 = s.sL1 + ti * 16 * cd.lqq + tj * 16;
      if (tj > ti) {
        for (int e = lane; e < 256; e += 32) l1[(e >> 4) * cd.lqq + (e & 15)] = __float2bfloat16_rn(0.0f);
        continue;
      }
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
      wmma::fill_fragment(c, 0.0f);
      for (int k = 0; k < cd.Np; k += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, OT, RM> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, OT, CM> fb;
        wmma::load_matrix_sync(fa, s.sq + (size_t)ti * 16 * cd.lqn + k, cd.lqn);
        wmma::load_matrix_sync(fb, s.sk + (size_t)tj * 16 * cd.lqn + k, cd.lqn);
        wmma::mma_sync(c, fa, fb, c);
      }
      wmma::store_matrix_sync(wscr, c, 16, wmma::mem_row_major);
      __syncwarp();
      for (int e = lane; e < 256; e += 32) {
        const int t = ti * 16 + (e >> 4), u = tj * 16 + (e & 15);
        float v = 0;
        if (t < nb && u < t && u >= (int)s.sc[t * FW + F_SEG])
          v = expf(fminf(s.sc[t * FW + F_C] - s.sc[u * FW + F_C], 0.0f)) * wscr[e];
        l1[(e >> 4) * cd.lqq + (e & 15)] = __float2bfloat16_rn(v);
      }
      __syncwarp();
    }
    __syncthreads();
    /* 5-6. Y = diag(EC) q E^T + (L o S) x, each output tile within one warp */
    {
      const int tn = cd.Pp / 16, nt = (CQ / 16) * tn;
      for (int tile = wid; tile < nt; tile += CWARPS) {
        const int i0 = tile / tn * 16, j0 = tile % tn * 16;
        float *yp = sY + (size_t)i0 * cd.lfp + j0;
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
        wmma::fill_fragment(c, 0.0f);
        for (int k = 0; k < cd.Np; k += 16) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, OT, RM> fa;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, OT, CM> fb;
          wmma::load_matrix_sync(fa, s.sq + (size_t)i0 * cd.lqn + k, cd.lqn);
          wmma::load_matrix_sync(fb, s.sE + (size_t)j0 * cd.lqn + k, cd.lqn);
          wmma::mma_sync(c, fa, fb, c);
        }
        wmma::store_matrix_sync(yp, c, cd.lfp, wmma::mem_row_major);
        __syncwarp();
        for (int e = lane; e < 256; e += 32) {
          const int t = i0 + (e >> 4);
          yp[(e >> 4) * cd.lfp + (e & 15)] *= t < nb ? s.sc[t * FW + F_EC] : 0.0f;
        }
        __syncwarp();
        wmma::load_matrix_sync(c, yp, cd.lfp, wmma::mem_row_major);
        for (int k = 0; k < CQ; k += 16) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, OT, RM> fa;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, OT, RM> fb;
          wmma::load_matrix_sync(fa, s.sL1 + (size_t)i0 * cd.lqq + k, cd.lqq);
          wmma::load_matrix_sync(fb, s.sx + (size_t)k * cd.lqp + j0, cd.lqp);
          wmma::mma_sync(c, fa, fb, c);
        }
        wmma::store_matrix_sync(yp, c, cd.lfp, wmma::mem_row_major);
      }
    }
    __syncthreads();
    /* W x in place (x is read from global memory again by the epilogue) */
    for (int idx = tid; idx < CQ * cd.Pp; idx += CTHREADS) {
      const int i = idx / cd.Pp, p = idx - i * cd.Pp;
      const float w = i < nb ? s.sc[i * FW + F_W] : 0.0f;
      s.sx[i * cd.lqp + p] = __float2bfloat16_rn(w * __bfloat162float(s.sx[i * cd.lqp + p]));
    }
    __syncthreads();
    /* 6'. E <- dec E + (W x)^T ktil in the warps' registers; E -> bf16 (sE) through the scratch */
    {
      const float dec = misc[0];
#pragma unroll
      for (int j = 0; j < FR_MAXT; j++) {
        const int tile = wid + CWARPS * j;
        if (tile < ent) {
          const int i0 = tile / etn * 16, j0 = tile % etn * 16;
#pragma unroll
          for (int e = 0; e < eacc[j].num_elements; e++) eacc[j].x[e] *= dec;
          for (int k = 0; k < CQ; k += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, OT, CM> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, OT, RM> fb;
            wmma::load_matrix_sync(fa, s.sx + (size_t)k * cd.lqp + i0, cd.lqp);
            wmma::load_matrix_sync(fb, s.sk + (size_t)k * cd.lqn + j0, cd.lqn);
            wmma::mma_sync(eacc[j], fa, fb, eacc[j]);
          }
          wmma::store_matrix_sync(escr, eacc[j], 16, wmma::mem_row_major);
          __syncwarp();
          for (int e = lane; e < 256; e += 32)
            s.sE[(i0 + (e >> 4)) * cd.lqn + j0 + (e & 15)] = __float2bfloat16_rn(escr[e]);
          __syncwarp();
        }
      }
    }
    /* 7. epilogue (as scan.cu): y = Y + (gamma q.k + D) x; the per-head norm; the gate */
#pragma unroll 4
    for (int idx = tid; idx < nb * P; idx += CTHREADS) {
      const int i = idx / P, p = idx - i * P;
      const int64_t mi = m0 + i;
      const float xv = ldact(proj + mi * d.dipp + d.x_off + (int64_t)h * P + p);
      const float y = sY[i * cd.lfp + p] + (s.sc[i * FW + F_GAM] * s.sc[i * FW + F_QK] + Dh) * xv;
      sY[i * cd.lfp + p] = y;
      a.y[mi * E + (int64_t)h * P + p] = y;
    }
    if (d.outproj_norm) {
      __syncthreads();
      for (int i = wid; i < nb; i += CWARPS) {
        float ss = 0;
        for (int p = lane; p < P; p += 32) ss += sY[i * cd.lfp + p] * sY[i * cd.lfp + p];
        ss = warp_sum(ss);
        const float rn = 1.0f / sqrtf(ss / (float)P + 1e-5f);
        if (lane == 0) {
          s.sc[i * FW + F_R] = rn;
          a.y_rstd[(m0 + i) * H + h] = rn;
        }
      }
    }
    __syncthreads();
#pragma unroll 4
    for (int idx = tid; idx < nb * P; idx += CTHREADS) {
      const int i = idx / P, p = idx - i * P;
      const int64_t mi = m0 + i;
      const float z = ldact(proj + mi * d.dipp + d.z_off + (int64_t)h * P + p);
      const float y = sY[i * cd.lfp + p];
      const float yn = d.outproj_norm ? y * s.sc[i * FW + F_R] * a.out_norm[(int64_t)h * P + p] : y;
      gated[mi * E + (int64_t)h * P + p] = from_f<T>(yn * (z * sigmoidf_(z)));
    }
    __syncthreads();
  }

  if (a.fin_ssm) {
#pragma unroll
    for (int j = 0; j < FR_MAXT; j++) {
      const int tile = wid + CWARPS * j;
      if (tile < ent) {
        const int i0 = tile / etn * 16, j0 = tile % etn * 16;
        wmma::store_matrix_sync(escr, eacc[j], 16, wmma::mem_row_major);
        __syncwarp();
        for (int e = lane; e < 256; e += 32) {
          const int p = i0 + (e >> 4), n = j0 + (e & 15);
          if (p < P && n < N) a.fin_ssm[bh * P * N + (int64_t)p * N + n] = escr[e];
        }
        __syncwarp();
      }
    }
  }
  if (a.fin_k)
    for (int n = tid; n < N; n += CTHREADS) a.fin_k[bh * N + n] = s.kl[n];
  if (a.fin_v)
    for (int p = tid; p < P; p += CTHREADS)
      a.fin_v[bh * P + p] = to_f(proj[((int64_t)b * a.len + a.len - 1) * d.dipp + d.x_off + (int64_t)h * P + p]);
  if (a.fin_angle)
    for (int j = tid; j < S; j += CTHREADS) a.fin_angle[bh * S + j] = s.thr[j];
}

/* ---- backward --------------------------------------------------------------------------------------- */

/* The scalar chain of one token (as scan.cu): dproj's dd_dt, dd_A, trap columns; returns dL/d dd_dt. */
template <typename T>
__device__ __forceinline__ float c_finish(const m3k_scan_args &a, int64_t m, int h, float da, float dgam, float dbp,
                                          float dt, float lam, float A, float dsp, float dAd, float dtang) {
  const m3k_dims &d = a.d;
  const float ddt = da * A + dgam * lam + dbp * (1 - lam) + dtang;
  const float dA = da * dt;
  const float dlam = (dgam - dbp) * dt;
  const float dv = ddt * dsp;
  T *drow = (T *)a.dproj + m * d.dipp;
  drow[d.dt_off + h] = from_f<T>(dv);
  drow[d.A_off + h] = from_f<T>(dA * dAd);
  drow[d.trap_off + h] = from_f<T>(dlam * lam * (1 - lam));
  return dv;
}

/* MINB = 2 (128 registers) for shapes whose shared memory lets two CTAs share an SM (bwd_two_ctas). */
template <typename T, int MINB>
__global__ void __launch_bounds__(CTHREADS, MINB) scan_bwd_chunked(const m3k_scan_args a) {
  extern __shared__ __align__(128) unsigned char smraw[];
  const m3k_dims &d = a.d;
  const int h = blockIdx.x, b = blockIdx.y, g = h / d.hpg;
  const int P = d.P, N = d.N, S = d.S, H = d.H, E = d.E;
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  constexpr int BUD = MINB == 2 ? 2 : 4; /* units in flight per lane in the unit loops */
  const cdims cd = make_cdims(P, N);
  csmem s;
  carve_c(smraw, P, N, S, &s);
  const T *proj = (const T *)a.proj; // [M, dipp]
  T *dproj = (T *)a.dproj;           // [M, dipp]
  const int64_t bh = (int64_t)b * H + h;
  const float Dh = a.D[h];
  float *misc = s.pend + PN_W; /* 0 dec, 1 pD, 2 pdtb */
  const int nch = (a.len + CQ - 1) / CQ;
  float *states = a.chunk_states + bh * (int64_t)nch * P * N; // [nch][P][N]

  /* ===== sweep F: the state entering every chunk ===== */
  c_scalars<T>(a, s.sc, (int64_t)b * a.len, 0, 0, h);
  c_biases(a, s, cd, h);
  __syncthreads();
  {
    const float bp0 = s.sc[F_BP];
    for (int idx = tid; idx < cd.Pp * cd.Np; idx += CTHREADS) {
      const int p = idx / cd.Np, n = idx - p * cd.Np;
      float v = 0;
      if (p < P && n < N) {
        if (a.in_ssm) v = a.in_ssm[(bh * P + p) * N + n];
        if (a.in_v && a.in_k) v += bp0 * a.in_v[bh * P + p] * a.in_k[bh * N + n];
      }
      s.sEf[p * cd.lfn + n] = v;
    }
  }
  __syncthreads();
  for (int ch = 0; ch < nch; ch++) {
    const int t0 = ch * CQ, nb = min(CQ, a.len - t0);
    const int64_t m0 = (int64_t)b * a.len + t0;
    c_scalars<T>(a, s.sc, m0, t0, nb, h);
#pragma unroll 4
    for (int idx = tid; idx < nb * S; idx += CTHREADS) {
      const int i = idx / S, j = idx - i * S;
      s.thv[idx] = __ldg(a.theta + ((m0 + i) * H + h) * S + j);
    }
#pragma unroll 4
    for (int idx = tid; idx < CQ * cd.Pp; idx += CTHREADS) {
      const int i = idx / cd.Pp, p = idx - i * cd.Pp;
      const float xv = (i < nb && p < P) ? ldact(proj + (m0 + i) * d.dipp + d.x_off + (int64_t)h * P + p) : 0.0f;
      s.sx[i * cd.lqp + p] = __float2bfloat16_rn(xv);
    }
    __syncthreads();
    if (wid == 0) c_prep(s.sc, nb, misc);
    __syncthreads();
    c_build<BUD>(a, s, cd, m0, t0, nb, g, false, s.thv, NULL);
    for (int idx = tid; idx < CQ * cd.Pp; idx += CTHREADS) {
      const int i = idx / cd.Pp, p = idx - i * cd.Pp;
      const float w = i < nb ? s.sc[i * FW + F_W] : 0.0f;
      s.sxw[i * cd.lqp + p] = __float2bfloat16_rn(w * __bfloat162float(s.sx[i * cd.lqp + p]));
    }
    {
      const float dec = misc[0];
      for (int idx = tid; idx < cd.Pp * cd.Np; idx += CTHREADS) {
        const int p = idx / cd.Np, n = idx - p * cd.Np;
        const float v = s.sEf[p * cd.lfn + n];
        if (p < P && n < N) states[((int64_t)ch * P + p) * N + n] = v;
        s.sEf[p * cd.lfn + n] = dec * v;
      }
    }
    __syncthreads();
    bmm<CM, RM>(s.sEf, cd.lfn, s.sxw, cd.lqp, s.sk, cd.lqn, cd.Pp, cd.Np, CQ, true);
    __syncthreads();
  }

  /* ===== sweep R: reverse ===== */
  for (int idx = tid; idx < cd.Pp * cd.Np; idx += CTHREADS) {
    const int p = idx / cd.Np, n = idx - p * cd.Np;
    s.sEf[p * cd.lfn + n] = 0; /* dE: nothing flows from the final state */
    s.sdE[p * cd.lqn + n] = __float2bfloat16_rn(0.0f);
  }
  for (int n = tid; n < cd.Np; n += CTHREADS) {
    s.pB[n] = 0;
    s.pC[n] = 0;
  }
  for (int k = tid; k < CWARPS * cd.Pp; k += CTHREADS) s.pOn[k] = 0;
  for (int j = tid; j < S; j += CTHREADS) s.thr[j] = 0;
  if (tid < PN_W + 8) s.pend[tid] = 0;
  __syncthreads();

  float *sF = s.sR;
  for (int ch = nch - 1; ch >= 0; ch--) {
    const int t0 = ch * CQ, nb = min(CQ, a.len - t0);
    const int64_t m0 = (int64_t)b * a.len + t0;
    /* 1. loads: scalars, tanh of the angle logits, angles */
    c_scalars<T>(a, s.sc, m0, t0, nb, h);
#pragma unroll 4
    for (int idx = tid; idx < nb * S; idx += CTHREADS) {
      const int i = idx / S, j = idx - i * S;
      s.th[idx] = tanhf(ldact(proj + (m0 + i) * d.dipp + d.ang_off + j));
      s.thv[idx] = __ldg(a.theta + ((m0 + i) * H + h) * S + j);
    }
    __syncthreads();
    /* 2. warp 0: cumsums and masks; the others: E (bf16) from the scratch and <dE, E> partials */
    if (wid == 0) {
      c_prep(s.sc, nb, misc);
      if (lane == 0) s.red[0] = 0;
    } else {
      const float *Ec = states + (int64_t)ch * P * N;
      float part = 0;
      if ((N & 3) == 0) { /* rows of N floats, 16-byte aligned: vector loads */
        const int N4 = N / 4, Np4 = cd.Np / 4;
#pragma unroll 4
        for (int idx = tid - 32; idx < cd.Pp * Np4; idx += CTHREADS - 32) {
          const int p = idx / Np4, n = (idx - p * Np4) * 4;
          float4 v = make_float4(0, 0, 0, 0);
          if (p < P && n < N) v = *(const float4 *)(Ec + (int64_t)p * N + n);
          OT *e = s.sE + p * cd.lqn + n;
          const float *f = s.sEf + p * cd.lfn + n;
          e[0] = __float2bfloat16_rn(v.x);
          e[1] = __float2bfloat16_rn(v.y);
          e[2] = __float2bfloat16_rn(v.z);
          e[3] = __float2bfloat16_rn(v.w);
          part += v.x * f[0] + v.y * f[1] + v.z * f[2] + v.w * f[3];
          (void)N4;
        }
      } else {
#pragma unroll 4
        for (int idx = tid - 32; idx < cd.Pp * cd.Np; idx += CTHREADS - 32) {
          const int p = idx / cd.Np, n = idx - p * cd.Np;
          const float v = (p < P && n < N) ? Ec[(int64_t)p * N + n] : 0.0f;
          s.sE[p * cd.lqn + n] = __float2bfloat16_rn(v);
          part += v * s.sEf[p * cd.lfn + n];
        }
      }
      part = warp_sum(part);
      if (lane == 0) s.red[wid] = part;
    }
    __syncthreads();
    /* 3. the gate backward (warp per token, as scan.cu): dz, dy (a.dy), EC dy, dy.x; q, ktil, q.k */
    for (int i = wid; i < CQ; i += CWARPS) {
      OT *xr = s.sx + i * cd.lqp, *dyr = s.sxw + i * cd.lqp, *ywr = s.syw + i * cd.lqp;
      if (i >= nb) {
        for (int p = lane; p < cd.Pp; p += 32) {
          xr[p] = __float2bfloat16_rn(0.0f);
          dyr[p] = __float2bfloat16_rn(0.0f);
          ywr[p] = __float2bfloat16_rn(0.0f);
        }
        continue;
      }
      const int64_t mi = m0 + i;
      float yv[4], dg[4], zv[4], xv[4], dyn[4];
      const float rn = d.outproj_norm ? __ldg(a.y_rstd + mi * H + h) : 1.0f;
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const int p = lane + 32 * k;
        yv[k] = dg[k] = zv[k] = xv[k] = 0;
        if (p < P) {
          const T *pr = proj + mi * d.dipp + (int64_t)h * P + p;
          const int64_t o = mi * E + (int64_t)h * P + p;
          xv[k] = ldact(pr + d.x_off);
          zv[k] = ldact(pr + d.z_off);
          dg[k] = __ldg(a.dgated + o);
          yv[k] = __ldg(a.y + o);
        }
      }
      float dot = 0;
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const int p = lane + 32 * k;
        dyn[k] = 0;
        if (p < P) {
          const float z = zv[k];
          const float sg = sigmoidf_(z), silu = z * sg, dsilu = sg * (1 + z * (1 - sg));
          const float wn = d.outproj_norm ? __ldg(a.out_norm + (int64_t)h * P + p) : 1.0f;
          const float yn = d.outproj_norm ? yv[k] * rn * wn : yv[k];
          dproj[mi * d.dipp + d.z_off + (int64_t)h * P + p] = from_f<T>(dg[k] * yn * dsilu);
          dyn[k] = dg[k] * silu;
          if (d.outproj_norm) dot += yv[k] * wn * dyn[k];
        }
      }
      float cn = 0;
      if (d.outproj_norm) cn = warp_sum(dot) / (float)P * rn * rn * rn;
      const float ec = s.sc[i * FW + F_EC];
      float dyx = 0;
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const int p = lane + 32 * k;
        if (p < cd.Pp) {
          float dy = 0;
          if (p < P) {
            if (d.outproj_norm) {
              const float wn = __ldg(a.out_norm + (int64_t)h * P + p);
              s.pOn[wid * cd.Pp + p] += yv[k] * rn * dyn[k];
              dy = rn * wn * dyn[k] - yv[k] * cn;
            } else {
              dy = dyn[k];
            }
            a.dy[mi * E + (int64_t)h * P + p] = dy;
            dyx += dy * xv[k];
          }
          xr[p] = __float2bfloat16_rn(xv[k]);
          dyr[p] = __float2bfloat16_rn(dy);
          ywr[p] = __float2bfloat16_rn(ec * dy);
        }
      }
      dyx = warp_sum(dyx);
      if (lane == 0) s.sc[i * FW + F_DYX] = dyx;
    }
    c_build<BUD>(a, s, cd, m0, t0, nb, g, true, s.thv, NULL);
    __syncthreads();
    /* 4-5. S1 = q ktil^T, S2 = dY x^T tile by tile (warp's scratch; tiles above the diagonal: 0):
     * L1 = L o S1, L2 = L o S2 (bf16); M = L o S1 o S2 (u < t) summed per tile row and column */
    {
      float *s1 = s.sR + wid * 512, *s2 = s1 + 256;
      float *rowp = s.sR + CWARPS * 512, *colp = rowp + CQ * (CQ / 16); /* [CQ][CQ / 16] */
      for (int tile = wid; tile < (CQ / 16) * (CQ / 16); tile += CWARPS) {
        const int ti = tile / (CQ / 16), tj = tile % (CQ / 16);
        OT *l1 = s.sL1 + ti * 16 * cd.lqq + tj * 16, *l2 = s.sL2 + ti * 16 * cd.lqq + tj * 16;
        if (tj > ti) {
          for (int e = lane; e < 256; e += 32) {
            l1[(e >> 4) * cd.lqq + (e & 15)] = __float2bfloat16_rn(0.0f);
            l2[(e >> 4) * cd.lqq + (e & 15)] = __float2bfloat16_rn(0.0f);
          }
          if (lane < 16) {
            rowp[(ti * 16 + lane) * (CQ / 16) + tj] = 0;
            colp[(tj * 16 + lane) * (CQ / 16) + ti] = 0;
          }
          continue;
        }
        {
          wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
          wmma::fill_fragment(c, 0.0f);
          for (int k = 0; k < cd.Np; k += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, OT, RM> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, OT, CM> fb;
            wmma::load_matrix_sync(fa, s.sq + (size_t)ti * 16 * cd.lqn + k, cd.lqn);
            wmma::load_matrix_sync(fb, s.sk + (size_t)tj * 16 * cd.lqn + k, cd.lqn);
            wmma::mma_sync(c, fa, fb, c);
          }
          wmma::store_matrix_sync(s1, c, 16, wmma::mem_row_major);
        }
        {
          wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
          wmma::fill_fragment(c, 0.0f);
          for (int k = 0; k < cd.Pp; k += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, OT, RM> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, OT, CM> fb;
            wmma::load_matrix_sync(fa, s.sxw + (size_t)ti * 16 * cd.lqp + k, cd.lqp);
            wmma::load_matrix_sync(fb, s.sx + (size_t)tj * 16 * cd.lqp + k, cd.lqp);
            wmma::mma_sync(c, fa, fb, c);
          }
          wmma::store_matrix_sync(s2, c, 16, wmma::mem_row_major);
        }
        __syncwarp();
        for (int e = lane; e < 256; e += 32) {
          const int t = ti * 16 + (e >> 4), u = tj * 16 + (e & 15);
          float l = 0;
          if (t < nb && u < t && u >= (int)s.sc[t * FW + F_SEG])
            l = expf(fminf(s.sc[t * FW + F_C] - s.sc[u * FW + F_C], 0.0f));
          const float v1 = l * s1[e], v2 = l * s2[e];
          l1[(e >> 4) * cd.lqq + (e & 15)] = __float2bfloat16_rn(v1);
          l2[(e >> 4) * cd.lqq + (e & 15)] = __float2bfloat16_rn(v2);
          s1[e] = u < t ? v1 * s2[e] : 0.0f;
        }
        __syncwarp();
        if (lane < 16) { /* row lane of the tile: sum over its 16 columns, in order */
          float acc = 0;
#pragma unroll
          for (int c = 0; c < 16; c++) acc += s1[lane * 16 + c];
          rowp[(ti * 16 + lane) * (CQ / 16) + tj] = acc;
        } else { /* column lane - 16: sum over the 16 rows, in order */
          const int c = lane - 16;
          float acc = 0;
#pragma unroll
          for (int r = 0; r < 16; r++) acc += s1[r * 16 + c];
          colp[(tj * 16 + c) * (CQ / 16) + ti] = acc;
        }
        __syncwarp();
      }
      __syncthreads();
      if (tid < CQ) { /* row sums of M: the tiles' partials in order */
        float acc = 0;
#pragma unroll
        for (int j = 0; j < CQ / 16; j++) acc += rowp[tid * (CQ / 16) + j];
        s.sc[tid * FW + F_ROW] = acc;
      } else if (tid < 2 * CQ) { /* column sums */
        const int u = tid - CQ;
        float acc = 0;
#pragma unroll
        for (int j = 0; j < CQ / 16; j++) acc += colp[u * (CQ / 16) + j];
        s.sc[u * FW + F_COL] = acc;
      }
      __syncthreads();
    }
    /* 6. dq = EC (dY E) + L2 ktil (+ diagonal); r_t */
    bmm<RM, RM>(sF, cd.lfn, s.sxw, cd.lqp, s.sE, cd.lqn, CQ, cd.Np, cd.Pp, false);
    __syncthreads();
    for (int i = wid; i < CQ; i += CWARPS) {
      const float ec = i < nb ? s.sc[i * FW + F_EC] : 0.0f;
      float r = 0;
      for (int n = lane; n < cd.Np; n += 32) {
        const float v = sF[i * cd.lfn + n];
        r += v * __bfloat162float(s.sq[i * cd.lqn + n]);
        sF[i * cd.lfn + n] = ec * v;
      }
      r = warp_sum(r);
      if (lane == 0 && i < nb) s.sc[i * FW + F_R] = ec * r;
    }
    __syncthreads();
    bmm<RM, RM>(sF, cd.lfn, s.sL2, cd.lqq, s.sk, cd.lqn, CQ, cd.Np, CQ, true);
    __syncthreads();
    /* post q (warp per token): diagonal term, rotation backward (C part), angle gradient from q */
    for (int i = wid; i < nb; i += CWARPS) {
      const float gd = s.sc[i * FW + F_GAM] * s.sc[i * FW + F_DYX];
      float *f = sF + i * cd.lfn;
      for_units<BUD>(a, s, s.thv, m0 + i, g, i, [&](const unit_kq &r, int u) {
        if (r.pair) {
          const float d0 = f[r.n0] + gd * r.k0, d1 = f[r.n0 + 1] + gd * r.k1;
          f[r.n0] = r.cs * d0 + r.sn * d1;
          f[r.n0 + 1] = -r.sn * d0 + r.cs * d1;
          s.dth[i * S + u] = -d0 * r.q1 + d1 * r.q0;
        } else {
          f[r.n0] += gd * r.k0;
        }
      });
    }
    __syncthreads();
    for (int n = tid; n < N; n += CTHREADS) {
      float acc = s.pC[n];
#pragma unroll 4
      for (int i = nb - 1; i >= 0; i--) {
        const float v = sF[i * cd.lfn + n];
        acc += v;
        a.dbc_head[(((m0 + i) * H + h) * 2 + 1) * N + n] = v;
      }
      s.pC[n] = acc;
    }
    __syncthreads();
    /* 7. dktil = W (x dE) + L2^T q; v_s; post k: dscale, dk, rotation backward (B part) */
    bmm<RM, RM>(sF, cd.lfn, s.sx, cd.lqp, s.sdE, cd.lqn, CQ, cd.Np, cd.Pp, false);
    __syncthreads();
    for (int i = wid; i < CQ; i += CWARPS) {
      const float w = i < nb ? s.sc[i * FW + F_W] : 0.0f;
      float v = 0;
      for (int n = lane; n < cd.Np; n += 32) {
        const float e = sF[i * cd.lfn + n];
        v += e * __bfloat162float(s.sk[i * cd.lqn + n]);
        sF[i * cd.lfn + n] = w * e;
      }
      v = warp_sum(v);
      if (lane == 0 && i < nb) s.sc[i * FW + F_V] = w * v;
    }
    __syncthreads();
    bmm<CM, RM>(sF, cd.lfn, s.sL2, cd.lqq, s.sq, cd.lqn, CQ, cd.Np, CQ, true);
    __syncthreads();
    for (int i = wid; i < nb; i += CWARPS) {
      const float sc = s.sc[i * FW + F_SCALE], gd = s.sc[i * FW + F_GAM] * s.sc[i * FW + F_DYX];
      float *f = sF + i * cd.lfn;
      float ds = 0;
      for_units<BUD>(a, s, s.thv, m0 + i, g, i, [&](const unit_kq &r, int u) {
        if (r.pair) {
          const float e0 = f[r.n0], e1 = f[r.n0 + 1];
          ds += e0 * r.k0 + e1 * r.k1;
          const float d0 = sc * e0 + gd * r.q0, d1 = sc * e1 + gd * r.q1;
          f[r.n0] = r.cs * d0 + r.sn * d1;
          f[r.n0 + 1] = -r.sn * d0 + r.cs * d1;
          s.dth[i * S + u] += -d0 * r.k1 + d1 * r.k0;
        } else {
          const float e0 = f[r.n0];
          ds += e0 * r.k0;
          f[r.n0] = sc * e0 + gd * r.q0;
        }
      });
      ds = warp_sum(ds);
      if (lane == 0) {
        s.sc[i * FW + F_DSCALE] = ds;
        s.sc[i * FW + F_DGAM] = ds + s.sc[i * FW + F_DYX] * s.sc[i * FW + F_QK];
      }
    }
    __syncthreads();
    for (int n = tid; n < N; n += CTHREADS) {
      float acc = s.pB[n];
#pragma unroll 4
      for (int i = nb - 1; i >= 0; i--) {
        const float v = sF[i * cd.lfn + n];
        acc += v;
        a.dbc_head[(((m0 + i) * H + h) * 2 + 0) * N + n] = v;
      }
      s.pB[n] = acc;
    }
    __syncthreads();
    /* 8. dx = W (ktil dE^T) + L1^T dY (+ diagonal, D); dE <- dec dE + (EC dY)^T q */
    bmm<RM, CM>(sF, cd.lfp, s.sk, cd.lqn, s.sdE, cd.lqn, CQ, cd.Pp, cd.Np, false);
    {
      const float dec = misc[0];
      for (int idx = tid; idx < cd.Pp * cd.Np; idx += CTHREADS) {
        const int p = idx / cd.Np, n = idx - p * cd.Np;
        s.sEf[p * cd.lfn + n] *= dec;
      }
    }
    __syncthreads();
    for (int idx = tid; idx < CQ * cd.Pp; idx += CTHREADS) {
      const int i = idx / cd.Pp, p = idx - i * cd.Pp;
      sF[i * cd.lfp + p] *= i < nb ? s.sc[i * FW + F_W] : 0.0f;
    }
    __syncthreads();
    bmm<CM, RM>(sF, cd.lfp, s.sL1, cd.lqq, s.sxw, cd.lqp, CQ, cd.Pp, CQ, true);
    bmm<CM, RM>(s.sEf, cd.lfn, s.syw, cd.lqp, s.sq, cd.lqn, cd.Pp, cd.Np, CQ, true);
    __syncthreads();
#pragma unroll 4
    for (int idx = tid; idx < nb * P; idx += CTHREADS) {
      const int i = idx / P, p = idx - i * P;
      const int64_t mi = m0 + i;
      const float dg = s.sc[i * FW + F_GAM] * s.sc[i * FW + F_QK] + Dh;
      const float dx = sF[i * cd.lfp + p] + dg * a.dy[mi * E + (int64_t)h * P + p];
      dproj[mi * d.dipp + d.x_off + (int64_t)h * P + p] = from_f<T>(dx);
    }
    for (int idx = tid; idx < cd.Pp * cd.Np; idx += CTHREADS) {
      const int p = idx / cd.Np, n = idx - p * cd.Np;
      s.sdE[p * cd.lqn + n] = __float2bfloat16_rn(s.sEf[p * cd.lfn + n]);
    }
    /* 9. decay gradient (warp 0), angle gradient (one thread per pair, carried across chunks) */
    if (wid == 0) { /* two tokens per lane; sums and the suffix scan by shuffles (fixed order) */
      float dEE = 0;
      for (int w = 0; w < CWARPS; w++) dEE += s.red[w];
      const int j0 = 2 * lane, j1 = j0 + 1;
      const float v0 = j0 < nb ? s.sc[j0 * FW + F_V] : 0.0f, v1 = j1 < nb ? s.sc[j1 * FW + F_V] : 0.0f;
      const float sumv = warp_sum(v0 + v1);
      const float y0 = j0 < nb ? s.sc[j0 * FW + F_DYX] : 0.0f, y1 = j1 < nb ? s.sc[j1 * FW + F_DYX] : 0.0f;
      const float sdyx = warp_sum(y0 + y1);
      float dc[2];
#pragma unroll
      for (int k = 0; k < 2; k++) {
        const int j = j0 + k;
        dc[k] = 0;
        if (j < nb) {
          const float *t = s.sc + j * FW;
          dc[k] = t[F_R] + t[F_ROW] - t[F_COL] - t[F_V];
          if (j == nb - 1) dc[k] += misc[0] * dEE + sumv;
        }
      }
      float sfx = dc[0] + dc[1];
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const float v = __shfl_down_sync(0xffffffffu, sfx, o);
        if (lane + o < 32) sfx += v;
      }
      float ex = __shfl_down_sync(0xffffffffu, sfx, 1);
      if (lane == 31) ex = 0;
      if (j1 < nb) s.sc[j1 * FW + F_DA] = s.sc[j1 * FW + F_RST] != 0 ? 0.0f : ex + dc[1];
      if (j0 < nb) s.sc[j0 * FW + F_DA] = s.sc[j0 * FW + F_RST] != 0 ? 0.0f : ex + dc[1] + dc[0];
      if (lane == 0) misc[1] += sdyx;
    } else if (tid >= 32 && tid - 32 < S) {
      const int j = tid - 32;
      float D = s.thr[j];
#pragma unroll 4
      for (int i = nb - 1; i >= 0; i--) {
        const float *t = s.sc + i * FW;
        D += s.dth[i * S + j];
        const float ta = s.th[i * S + j];
        s.dth[i * S + j] = PI_F * D * ta;
        a.dang_head[((m0 + i) * H + h) * S + j] = PI_F * D * t[F_DT] * (1 - ta * ta);
        if (t[F_RST] != 0) D = 0;
      }
      s.thr[j] = D;
    }
    __syncthreads();
    for (int i = wid; i < nb; i += CWARPS) {
      float acc = 0;
      for (int j = lane; j < S; j += 32) acc += s.dth[i * S + j];
      acc = warp_sum(acc);
      if (lane == 0) s.sc[i * FW + F_DTANG] = acc;
    }
    __syncthreads();
    /* the scalar chain: tokens 1..nb-1 now; token 0 when dscale of the token before it is known */
    if (tid >= 1 && tid < nb) {
      const float *t = s.sc + tid * FW;
      const float dbp = t[F_RST] != 0 ? 0.0f : s.sc[(tid - 1) * FW + F_DSCALE];
      s.sc[tid * FW + F_DV] = c_finish<T>(a, m0 + tid, h, t[F_DA], t[F_DGAM], dbp, t[F_DT], t[F_LAM], t[F_AA],
                                         t[F_DSP], t[F_DAD], t[F_DTANG]);
    } else if (tid == CTHREADS - 1 && s.pend[PN_VALID] != 0) {
      const float *pn = s.pend;
      const float dbp = pn[PN_RST] != 0 ? 0.0f : s.sc[(nb - 1) * FW + F_DSCALE];
      misc[3] = c_finish<T>(a, m0 + nb, h, pn[PN_DA], pn[PN_DGAM], dbp, pn[PN_DT], pn[PN_LAM], pn[PN_AA], pn[PN_DSP],
                            pn[PN_DAD], pn[PN_DTANG]);
    }
    __syncthreads();
    if (tid == 0) {
      float pd = misc[2];
      if (s.pend[PN_VALID] != 0) pd += misc[3];
      for (int i = nb - 1; i >= 1; i--) pd += s.sc[i * FW + F_DV];
      misc[2] = pd;
      const float *t = s.sc;
      float *pn = s.pend;
      pn[PN_DA] = t[F_DA];
      pn[PN_DGAM] = t[F_DGAM];
      pn[PN_DT] = t[F_DT];
      pn[PN_LAM] = t[F_LAM];
      pn[PN_AA] = t[F_AA];
      pn[PN_DSP] = t[F_DSP];
      pn[PN_DAD] = t[F_DAD];
      pn[PN_DTANG] = t[F_DTANG];
      pn[PN_RST] = t[F_RST];
      pn[PN_VALID] = 1;
    }
    __syncthreads();
  }

  /* the window's first token: dbp_0 = v_in^T dE_0 k_in (no reset at 0) */
  {
    float part = 0;
    if (a.in_v && a.in_k && s.pend[PN_RST] == 0)
      for (int idx = tid; idx < P * N; idx += CTHREADS) {
        const int p = idx / N, n = idx - p * N;
        part += a.in_v[bh * P + p] * s.sEf[p * cd.lfn + n] * a.in_k[bh * N + n];
      }
    part = warp_sum(part);
    if (lane == 0) s.red[wid] = part;
    __syncthreads();
    if (tid == 0) {
      float dbp = 0;
      for (int w = 0; w < CWARPS; w++) dbp += s.red[w];
      const float *pn = s.pend;
      const float dv = c_finish<T>(a, (int64_t)b * a.len, h, pn[PN_DA], pn[PN_DGAM], dbp, pn[PN_DT], pn[PN_LAM],
                                   pn[PN_AA], pn[PN_DSP], pn[PN_DAD], pn[PN_DTANG]);
      float *part_ = a.part + bh * (2 + 2 * (int64_t)N); // [2 + 2N]
      part_[0] = misc[2] + dv;
      part_[1] = misc[1];
    }
  }
  float *part = a.part + bh * (2 + 2 * (int64_t)N);
  for (int n = tid; n < N; n += CTHREADS) {
    part[2 + n] = s.pB[n];
    part[2 + N + n] = s.pC[n];
  }
  if (d.outproj_norm)
    for (int p = tid; p < P; p += CTHREADS) {
      float acc = 0;
      for (int w = 0; w < CWARPS; w++) acc += s.pOn[w * cd.Pp + p];
      a.part_norm[bh * P + p] = acc;
    }
}

/* ---- host side ------------------------------------------------------------------------------------------ */

/* Two CTAs per SM fit when each takes at most half of the SM's 228 KB less the 1 KB reserved per CTA. */
static bool bwd_two_ctas(int32_t smem) { return smem <= 228 * 1024 / 2 - 1024; }

int64_t m3k_chunked_smem(int fwd, int32_t P, int32_t N, int32_t S) {
  if (fwd) return fwd_in_regs(P, N) ? (int64_t)carve_r(NULL, P, N, S, NULL) : INT64_MAX;
  return (int64_t)carve_c(NULL, P, N, S, NULL);
}

cudaError_t m3k_chunked_prepare(int prec, const m3k_scan_plan *plan) {
  cudaError_t e = cudaSuccess;
  if (prec == M3K_F32 || !plan->chunked) return e;
  if (prec == M3K_BF16) {
    e = cudaFuncSetAttribute(scan_fwd_chunked_r<bf16>, cudaFuncAttributeMaxDynamicSharedMemorySize, plan->smem_cfwd);
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(scan_fwd_chunked_r<bf16>, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(scan_bwd_chunked<bf16, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, plan->smem_cbwd);
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(scan_bwd_chunked<bf16, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, plan->smem_cbwd);
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(scan_bwd_chunked<bf16, 2>, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
  } else {
    e = cudaFuncSetAttribute(scan_fwd_chunked_r<f16>, cudaFuncAttributeMaxDynamicSharedMemorySize, plan->smem_cfwd);
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(scan_fwd_chunked_r<f16>, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(scan_bwd_chunked<f16, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, plan->smem_cbwd);
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(scan_bwd_chunked<f16, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, plan->smem_cbwd);
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(scan_bwd_chunked<f16, 2>, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
  }
  return e;
}

cudaError_t m3k_chunked_fwd(cudaStream_t s, int prec, const m3k_scan_plan *plan, const m3k_scan_args *a) {
  const dim3 grid(a->d.H, a->rows);
  if (prec == M3K_BF16) scan_fwd_chunked_r<bf16><<<grid, CTHREADS, plan->smem_cfwd, s>>>(*a);
  else scan_fwd_chunked_r<f16><<<grid, CTHREADS, plan->smem_cfwd, s>>>(*a);
  return cudaGetLastError();
}

cudaError_t m3k_chunked_bwd(cudaStream_t s, int prec, const m3k_scan_plan *plan, const m3k_scan_args *a) {
  const dim3 grid(a->d.H, a->rows);
  if (bwd_two_ctas(plan->smem_cbwd)) {
    if (prec == M3K_BF16) scan_bwd_chunked<bf16, 2><<<grid, CTHREADS, plan->smem_cbwd, s>>>(*a);
    else scan_bwd_chunked<f16, 2><<<grid, CTHREADS, plan->smem_cbwd, s>>>(*a);
  } else {
    if (prec == M3K_BF16) scan_bwd_chunked<bf16, 1><<<grid, CTHREADS, plan->smem_cbwd, s>>>(*a);
    else scan_bwd_chunked<f16, 1><<<grid, CTHREADS, plan->smem_cbwd, s>>>(*a);
  }
  return cudaGetLastError();
}

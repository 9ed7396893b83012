/*
 * scan_math.cuh — the per-token math shared by the scan kernels (scan.cu: the float32 SIMT
 * scan; scan_chunked.cu: the tensor-core chunked scan for the 16-bit precisions; scan_warp.cu: the
 * forward of small states; scan_step.cu: the forward of one-token windows; decode_fused.cu: the
 * fused one-token inference step), so that all compute the token scalars, the angle walk, the
 * rotation, y and the gate with the same formulas as the CPU reference (engine/src/cpu/scan.c);
 * the one-token state tile; the shapes compiled as constants; and the launchers of the chunked,
 * small-state and one-token scans that scan.cu dispatches to.
 */
#ifndef M3_KERNELS_SCAN_MATH_CUH
#define M3_KERNELS_SCAN_MATH_CUH

#include "common.cuh"

#define PI_F 3.14159265358979323846f
#define TWO_PI_F 6.28318530717958647692f

struct tok_scalars {
  float dt, A, lam, alpha, beta, gamma, dsp, dAd;
};

__device__ __forceinline__ tok_scalars token_scalars(float dd_dt, float dt_bias, float dd_A, float trap,
                                                     float a_floor) {
  tok_scalars s;
  const float v = dd_dt + dt_bias, av = fabsf(v);
  s.dt = (v > 0 ? v : 0) + log1pf(expf(-av));
  s.dsp = 1 / (1 + expf(-v));
  const float f = dd_A >= 0 ? 1 + dd_A : 1 / (1 - dd_A);
  const float fp = dd_A >= 0 ? 1 : 1 / ((1 - dd_A) * (1 - dd_A));
  if (-f <= -a_floor) {
    s.A = -f;
    s.dAd = -fp;
  } else {
    s.A = -a_floor;
    s.dAd = 0;
  }
  s.lam = 1 / (1 + expf(-trap));
  s.alpha = expf(s.A * s.dt);
  s.beta = (1 - s.lam) * s.dt * s.alpha;
  s.gamma = s.lam * s.dt;
  return s;
}

/* The token scalars of position m from its in_proj row (dd_dt, dd_A, trap of head h; read-only) */
template <typename T> __device__ __forceinline__ tok_scalars row_scalars(const m3k_scan_args &a, const T *row, int h) {
  const m3k_dims &d = a.d;
  return token_scalars(to_f(__ldg(row + d.dt_off + h)), __ldg(a.dt_bias + h), to_f(__ldg(row + d.A_off + h)),
                       to_f(__ldg(row + d.trap_off + h)), d.a_floor);
}

/* tanh of position m's angle logit j (read-only), the angle's rate per unit dt over pi */
template <typename T> __device__ __forceinline__ float angle_tanh(const T *proj, const m3k_dims &d, int64_t m, int j) {
  return tanhf(to_f(__ldg(proj + m * d.dipp + d.ang_off + j)));
}

__device__ __forceinline__ float wrap_angle(float v) {
  v = fmodf(v, TWO_PI_F);
  if (v < 0) v += TWO_PI_F;
  if (v >= TWO_PI_F) v -= TWO_PI_F;
  return v;
}

/* theta + inc wrapped into [0, 2 pi) exactly as wrap_angle(theta + inc), without fmodf in the
 * common case (-2 pi < result before wrapping < 4 pi: the additions are exact there, as fmod is),
 * with selects rather than branches there (it is the whole chain of a sequential angle walk). */
__device__ __forceinline__ float wrap_sum(float v, float inc) {
  const float w = v + inc;
  float t = w < 0 ? w + TWO_PI_F : w;
  t = t >= TWO_PI_F ? t - TWO_PI_F : t;
  if (!(w > -TWO_PI_F && w < 2 * TWO_PI_F)) t = wrap_angle(w);
  return t;
}

/* The rotated k and q (float32) of unit u of a position (u < S: pair (2u, 2u+1) rotated by theta;
 * else the passing column 2S + u - S): the raw B_hat, C_hat values are loaded first (unit_load,
 * read-only path, several units in flight), then biased and rotated (unit_rotate; unit_make adds the
 * head's B_bias, C_bias from shared memory first, scan_step's way; rot_unit loads them with unit_load
 * too; scan_chunked.cu's group_rotated takes four columns at a time). */
struct unit_kq {
  int n0, pair;
  float k0, k1, q0, q1, cs, sn;
};
struct unit_raw {
  float k0, k1, q0, q1;
};

__device__ __forceinline__ int unit_col(int u, int S) { return u < S ? 2 * u : 2 * S + (u - S); }

/* (V: float, or the activation type for the raw in_proj values of scan_step's inline B/C norm; RO: the
 * read-only path, for global memory the kernel does not write, else plain loads, as for shared memory) */
template <bool RO, typename V> __device__ __forceinline__ float unit_ld(const V *p) { return to_f(RO ? __ldg(p) : *p); }
template <bool RO = true, typename V>
__device__ __forceinline__ unit_raw unit_load(const V *bk, const V *bq, int u, int S) {
  unit_raw r;
  const int n0 = unit_col(u, S);
  r.k0 = unit_ld<RO>(bk + n0);
  r.q0 = unit_ld<RO>(bq + n0);
  r.k1 = r.q1 = 0;
  if (u < S) {
    r.k1 = unit_ld<RO>(bk + n0 + 1);
    r.q1 = unit_ld<RO>(bq + n0 + 1);
  }
  return r;
}

/* a b + c d rounded one fixed way, fma(c, d, a b): left to itself the compiler may fuse either product,
 * and may choose differently in two kernels built from the same source (scan_post_chunked's two
 * variants must agree bitwise). */
__device__ __forceinline__ float dot2(float a, float b, float c, float d) { return __fmaf_rn(c, d, __fmul_rn(a, b)); }

/* Unit of first column n0 from its biased B/C values (k1, q1: the pair's second column, unused for a
 * passing column): rotated by theta when it is a pair. FAST takes the hardware's sine and cosine
 * (__sincosf, as the public Triton kernels' cos/sin.approx) of theta moved into [-pi, pi), where CUDA
 * bounds their absolute error by 2^-21.41, instead of sincosf's range reduction and polynomials: for
 * the chunked 16-bit kernels, whose products take q and k in bf16 anyway. */
template <bool FAST = false>
__device__ __forceinline__ unit_kq unit_rotate(int n0, bool pair, float k0, float k1, float q0, float q1, float theta) {
  unit_kq r;
  r.n0 = n0;
  if (pair) {
    float c, sn;
    if (FAST) __sincosf(theta >= PI_F ? theta - TWO_PI_F : theta, &sn, &c); /* theta in [0, 2 pi) */
    else sincosf(theta, &sn, &c);
    r.pair = 1;
    r.k0 = dot2(k0, c, -k1, sn);
    r.k1 = dot2(k0, sn, k1, c);
    r.q0 = dot2(q0, c, -q1, sn);
    r.q1 = dot2(q0, sn, q1, c);
    r.cs = c;
    r.sn = sn;
  } else {
    r.pair = 0;
    r.k0 = k0;
    r.q0 = q0;
    r.k1 = r.q1 = 0;
    r.cs = 1;
    r.sn = 0;
  }
  return r;
}

/* A rotated pair of k (k[0], k[1]) and q rotated in place by theta (unit_rotate's formulas) */
__device__ __forceinline__ void rotate_pair(float *k, float *q, float theta) {
  const unit_kq r = unit_rotate(0, true, k[0], k[1], q[0], q[1], theta);
  k[0] = r.k0;
  k[1] = r.k1;
  q[0] = r.q0;
  q[1] = r.q1;
}

__device__ __forceinline__ unit_kq unit_make(const unit_raw &w, const float *sbk, const float *sbq, int u, int S,
                                             float theta) {
  const int n0 = unit_col(u, S);
  if (u < S)
    return unit_rotate(n0, true, w.k0 + sbk[n0], w.k1 + sbk[n0 + 1], w.q0 + sbq[n0], w.q1 + sbq[n0 + 1], theta);
  return unit_rotate(n0, false, w.k0 + sbk[n0], 0.0f, w.q0 + sbq[n0], 0.0f, theta);
}

/* The rotated k and q (q may be NULL) of unit u of position m, from bc_hat and the head's biases (unit_load
 * with RO as there, then unit_rotate by theta, the pair's angle; the cos and sin go to cs, sn where cs is not
 * NULL and u is a pair). Units from N - S on are the zero padding up to the padded width. */
template <bool RO>
__device__ __forceinline__ void rot_unit(const m3k_scan_args &a, int64_t m, int h, int g, int u, float theta,
                                         float *k, float *q, float *cs, float *sn) {
  const m3k_dims &d = a.d;
  const int S = d.S, U = d.N - S;
  if (u >= U) {
    k[d.N + (u - U)] = 0;
    if (q) q[d.N + (u - U)] = 0;
    return;
  }
  const int n0 = unit_col(u, S);
  const bool pair = u < S;
  const unit_raw w = unit_load<RO>(a.bc_hat + ((m * 2 + 0) * d.G + g) * d.N, a.bc_hat + ((m * 2 + 1) * d.G + g) * d.N,
                                   u, S);
  const unit_raw bias = unit_load<RO>(a.B_bias + (int64_t)h * d.N, a.C_bias + (int64_t)h * d.N, u, S);
  const unit_kq r = unit_rotate(n0, pair, w.k0 + bias.k0, w.k1 + bias.k1, w.q0 + bias.q0, w.q1 + bias.q1, theta);
  k[n0] = r.k0;
  if (pair) k[n0 + 1] = r.k1;
  if (q) {
    q[n0] = r.q0;
    if (pair) q[n0 + 1] = r.q1;
  }
  if (cs && pair) {
    *cs = r.cs;
    *sn = r.sn;
  }
}

/* One token's y = H q + D x of one head, held by a warp: yv[k] = hq[p] + Dh x[p] at p = lane + 32 k
 * (P <= 128), also stored to y when not NULL; returns the lane's sum of y^2 (warp_norm_gate's ss). */
template <typename Y>
__device__ __forceinline__ float warp_head_y(const float *hq, const float *x, float Dh, int P, Y *y, float yv[4]) {
  const int lane = threadIdx.x & 31;
  float ss = 0;
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const int p = lane + 32 * k;
    yv[k] = 0;
    if (p < P) {
      yv[k] = hq[p] + Dh * x[p];
      if (y) y[p] = from_f<Y>(yv[k]);
      ss += yv[k] * yv[k];
    }
  }
  return ss;
}

/* The gate output of element p of head h: (the mixer norm's y rn w_p when outproj_norm, else y) silu(z) */
__device__ __forceinline__ float gate_value(const m3k_scan_args &a, int h, int p, float y, float rn, float z) {
  const float yn = a.d.outproj_norm ? y * rn * a.out_norm[(int64_t)h * a.d.P + p] : y;
  return yn * (z * sigmoidf_(z));
}

/* The end of one token's scan output for one head, held by a warp: yv[k] = y at p = lane + 32 k
 * (P <= 128), ss = the lane's sum of y^2. The mixer norm (outproj_norm: y_rstd of position m) and
 * the gate: gated[p] = norm(y)_p silu(z[p]) (z: the token's z values, float32). */
template <typename T>
__device__ __forceinline__ void warp_norm_gate(const m3k_scan_args &a, int64_t m, int h, const float yv[4], float ss,
                                               const float *z, T *gated) {
  const m3k_dims &d = a.d;
  const int lane = threadIdx.x & 31, P = d.P;
  float rn = 1;
  if (d.outproj_norm) {
    rn = rms_inv(warp_sum(ss), P);
    if (lane == 0) a.y_rstd[m * d.H + h] = rn;
  }
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const int p = lane + 32 * k;
    if (p < P) gated[p] = from_f<T>(gate_value(a, h, p, yv[k], rn, z[p]));
  }
}

/* One round of a warp's suffix scan of the maps x -> c + m x, a token's map taking the value of the token
 * after it, over 32 tokens (lane l: token hi - 32 + l): the lane gets its map composed with those of the
 * tokens after it in the round, applied to carry (the value of the token after the round). A lane before
 * the block's first token may hold any map: only lower lanes read it. */
__device__ __forceinline__ float suffix_round(float c, float m, float carry, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float c2 = __shfl_down_sync(0xffffffffu, c, o), m2 = __shfl_down_sync(0xffffffffu, m, o);
    if (lane + o < 32) {
      c += m * c2;
      m *= m2;
    }
  }
  return c + m * carry;
}

/* V consecutive state floats (streaming: evict-first loads and stores) */
template <int V> struct state_vec;
template <> struct state_vec<4> {
  static __device__ __forceinline__ void load(const float *p, float *v) {
    const float4 t = __ldcs((const float4 *)p);
    v[0] = t.x;
    v[1] = t.y;
    v[2] = t.z;
    v[3] = t.w;
  }
  static __device__ __forceinline__ void store(float *p, const float *v) {
    __stcs((float4 *)p, make_float4(v[0], v[1], v[2], v[3]));
  }
};
template <> struct state_vec<1> {
  static __device__ __forceinline__ void load(const float *p, float *v) { v[0] = __ldcs(p); }
  static __device__ __forceinline__ void store(float *p, const float *v) { __stcs(p, v[0]); }
};

/* The lane tile of a one-token state update (scan_step.cu, decode_fused.cu): a row of N floats
 * belongs to lw lanes (the power of two covering the row's vectors, at most 32), lane j holding
 * the row's vectors j, j + lw, ... (NJ of them). A vector is a float4 (V = 4) when the groups
 * cover the rows exactly (N = 4 lw, or N = 256: two per lane) and the state is 16-byte aligned,
 * else one float (V = 1, NJ = 8: N <= 256). */
struct step_tile {
  int V, NJ, lw;
};
static inline step_tile step_tile_for(int N, bool aligned) {
  const int nv = N / 4;
  const bool pow2 = nv > 0 && (nv & (nv - 1)) == 0;
  const bool vec = N % 4 == 0 && pow2 && nv <= 64 && aligned;
  step_tile t = {vec ? 4 : 1, vec ? (nv <= 32 ? 1 : 2) : 8, 1};
  while (t.lw < (vec ? nv : N) && t.lw < 32) t.lw <<= 1;
  return t;
}

/* ---- launch grids: a CTA per (x, row) ----------------------------------------------------------- */

/* The scan kernels put a window's rows in grid.x after the X CTAs of a row (its heads, or its chunks x heads or
 * groups), so that any row count launches (grid.y and grid.z stop at 65535) and the CTAs keep the order of an
 * (X, rows) grid: rows_grid launches X x rows CTAs (z parts in grid.z); grid_x and grid_row give a CTA its x and its
 * row back. */
static inline dim3 rows_grid(int64_t X, int32_t rows, unsigned z = 1) { return dim3((unsigned)(X * rows), 1, z); }
__device__ __forceinline__ int grid_x(int X) { return (int)(blockIdx.x % (unsigned)X); }
__device__ __forceinline__ int grid_row(int X) { return (int)(blockIdx.x / (unsigned)X); }

/* ---- shapes compiled as constants (scan.cu, scan_chunked.cu) ------------------------------------ */

/* Binds PK, NK (P, N as compile-time constants; 0: read at run time) for the shapes that the scan
 * kernels are also compiled for, so that their index arithmetic and reduction loops fold and they
 * need fewer registers (NOTES.md runs 68-72): the public configs' headdim 64 x d_state 128, and
 * DESIGN.md's 32 x 64 and 16 x 16. */
#define SHAPE_DISPATCH(P_, N_, body)                                                \
  do {                                                                              \
    if ((P_) == 64 && (N_) == 128) { enum { PK = 64, NK = 128 }; body; }            \
    else if ((P_) == 32 && (N_) == 64) { enum { PK = 32, NK = 64 }; body; }         \
    else if ((P_) == 16 && (N_) == 16) { enum { PK = 16, NK = 16 }; body; }         \
    else { enum { PK = 0, NK = 0 }; body; }                                         \
  } while (0)

/* ---- the chunked scan (scan_chunked.cu) ---------------------------------------------------------- */

enum { M3K_CHUNK = 64 }; /* tokens per chunk */

/* Dynamic shared memory of a chunked kernel for (P, N, S) (INT64_MAX: the forward walk does not apply);
 * POST_SUM: the post kernel that sums a group's heads. */
enum { M3K_CHUNKED_BWD = 0, M3K_CHUNKED_FWD, M3K_CHUNKED_PREP, M3K_CHUNKED_POST, M3K_CHUNKED_POST_SUM };
int64_t m3k_chunked_smem(int which, int32_t P, int32_t N, int32_t S);
/* Floats of the chunk scratch (forward part only when bwd = 0). */
int64_t m3k_chunked_scratch(int32_t rows, int32_t len, int32_t H, int32_t P, int32_t N, int bwd);
/* Floats of what a training forward keeps for its backward, per layer (m3k_scan_args.chunk_states). */
int64_t m3k_chunked_kept(int32_t rows, int32_t len, int32_t H, int32_t P, int32_t N);
cudaError_t m3k_chunked_prepare(int prec, const m3k_scan_plan *plan);
cudaError_t m3k_chunked_fwd(cudaStream_t s, int prec, const m3k_scan_plan *plan, const m3k_scan_args *a);
cudaError_t m3k_chunked_bwd(cudaStream_t s, int prec, const m3k_scan_plan *plan, const m3k_scan_args *a);
/* Whether m3k_chunked_bwd sums the B/C gradients over each group's heads (into a->dbc_group, or through the
 * B/C norm backward where m3k_chunked_norms_bc). */
bool m3k_chunked_sums_heads(const m3k_scan_plan *plan, const m3k_scan_args *a);
/* Whether the chunked forward normalises B and C in extra CTAs of its angle walk's launch (else m3k_scan_fwd runs
 * m3k_bcnorm_fwd first). */
bool m3k_chunked_bc_rides(const m3k_scan_plan *plan, const m3k_scan_args *a);
/* Whether the post kernel that sums a group's heads also runs the B/C norm backward on the sums (one group and
 * a->wcontrib given): dproj's B and C columns and a->wcontrib instead of a->dbc_group. */
__host__ __device__ inline bool m3k_chunked_norms_bc(const m3k_scan_args *a) { return a->d.G == 1 && a->wcontrib; }

/* ---- the forward of small states (scan_warp.cu): a pipeline of warps per (row, head) ---------------- */

/* The shapes it is compiled for; m3k_scan_fwd gives them every window the SIMT kernel would take. */
__host__ __device__ constexpr bool warp_fwd_shape(int P, int N) { return P == 16 && N == 16; }
cudaError_t m3k_warp_fwd(cudaStream_t s, int prec, const m3k_scan_args *a);

/* ---- the backward of small states (scan_small.cu): chunked, a CTA per (row, head) ------------------- */

/* The shapes it is compiled for (m3k_scan_bwd: takes_small_bwd). */
__host__ __device__ constexpr bool small_bwd_shape(int P, int N) { return P == 16 && N == 16; }
/* Floats of what it reads from m3k_scan_args.chunk_states, which the small-state forward (scan_warp.cu) writes in
 * training: the state entering each 64-token chunk, [rows, H, chunks, P, N] (chunk 0's slot unused: the carried
 * state is in_ssm). */
static inline int64_t small_bwd_states(int32_t rows, int32_t len, int32_t H, int32_t P, int32_t N) {
  return (int64_t)rows * H * ((len + M3K_CHUNK - 1) / M3K_CHUNK) * P * N;
}
/* Raises its dynamic shared-memory limit; *per_sm = its CTAs a multiprocessor holds at once. */
cudaError_t m3k_small_bwd_prepare(int prec, int32_t *per_sm);
cudaError_t m3k_small_bwd(cudaStream_t s, int prec, const m3k_scan_args *a);

/* ---- the one-token forward (scan_step.cu): m3k_scan_fwd when a->len == 1 --------------------------- */

/* Dynamic shared memory of the one-token kernels' bulk variants: one (row, head) state. */
static inline int32_t m3k_step_smem(int32_t P, int32_t N) { return P * N * (int32_t)sizeof(float); }
cudaError_t m3k_scan_step(cudaStream_t s, int prec, const m3k_scan_args *a);
/* Raises the one-token kernels' dynamic shared-memory limit to smem (the plan's smem_step). */
cudaError_t m3k_scan_step_prepare(int prec, int32_t smem);

#endif

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
 *   E += (diag(W) x)^T ktil, with L the masked decay matrix, on tensor cores (mma.sync m16n8k16
 *   with ldmatrix, mma_tile.cuh; bf16 operands, float32 accumulation; bf16 also for f16 training:
 *   its range holds the loss-scaled gradients). Everything else (scalars, cumsums, masks, norms, gate,
 *   rotation, angles) is float32 with the formulas of scan.cu; the angle walks along the sequence
 *   (theta, and its gradient's reverse sum) run in two levels, so their sums round in another order.
 *   Backward (dE = gradient of the state leaving the chunk: a reverse walk over the chunks runs only
 *   its recurrence, then every chunk in parallel, with the entering states as the forward kept them
 *   in a.chunk_states): with S1 = q ktil^T, S2 = dY x^T, L1 = L o S1, L2 = L o S2,
 *     dq_t    = EC_t (dY E)_t + (L2 ktil)_t + gamma_t (dY_t.x_t) k_t
 *     dktil_s = W_s (x dE)_s + (L2^T q)_s,           dk_s = scale_s dktil_s + gamma_s (dY_s.x_s) q_s
 *     dx_s    = W_s (ktil dE^T)_s + (L1^T dY)_s + (gamma_s q_s.k_s + D) dY_s
 *     dE     <- dec dE + (diag(EC) dY)^T q
 *     dscale_s = dktil_s.k_s (-> dgamma_s and dbp_{s+1}); dgamma_s += (dY_s.x_s)(q_s.k_s)
 *     dc_t = r_t + rowsum_t(M) - colsum_t(M) - v_t (+ dec <dE, E> + sum_s v_s at the last token),
 *       M = L o S1 o S2, r_t = EC_t q_t.(dY E)_t, v_s = W_s ktil_s.(x dE)_s; da_t = suffix sum of dc
 *       (0 at a reset); dbp_0 = v_in^T dE_0 k_in (the beta term of the window's first token).
 *   The products' dq and dktil (before the diagonal and gamma terms) pass to the next kernel in bf16,
 *   like the activations (r_t and v_s are taken from them in float32 before that rounding); dx's
 *   diagonal term takes dY in bf16, as its products do.
 *   Then the rotation backward, the angle gradient (reverse cumulative sum along the sequence,
 *   stopped at resets) and the scalar chain to dd_dt, dd_A, trap as scan.cu.
 *
 * Pipeline (launchers at the end). Forward: scan_angles_chunked (theta, a two-level walk per pair; on small launches
 * its extra CTAs run the B/C norm), scan_prep_chunked (per chunk, in parallel: token scalars, cumsums, masks, q, ktil),
 * scan_fwd_chunked_r (the walk; in training it keeps the state entering each chunk: with q, ktil and the scalars, what
 * the forward keeps in a.chunk_states). Backward: scan_gate_bwd_chunked (per chunk, in parallel: the gate backward),
 * scan_dstate_chunked (the reverse walk of dE alone: dE leaving each chunk, dbp_0), scan_bwd_chunked (per chunk, in
 * parallel: the products, raw dq / dktil in bf16 over the kept q / ktil, da into the table), scan_post_chunked (per
 * chunk, in parallel: the diagonal terms, rotation backward, dscale, the angle shares, B/C bias partials; on large
 * launches it also sums each group's heads, so that the per-head B/C gradients are never written back, and with one
 * group runs the B/C norm backward on the sums), scan_post_seq_chunked (per (head, row): the angle gradient along the
 * sequence, the scalar chain, the per-(row, head) partials). All but the angle walks and post_seq are also compiled for
 * a few fixed (P, N) (SHAPE_DISPATCH). The walks keep only the work that is sequential over the chunks: one CTA (8
 * warps) per (head, row) (either walk may split a state's rows over two: fwd_launch, dstate_launch); operand tiles in
 * shared memory (bf16, padded rows: +8 elements); each product's 16 x 16 output tiles spread over the warps. Every sum
 * has a fixed order (no atomics): bitwise repeatable. The walks keep the float32 state E / dE in the warps' accumulator
 * registers (no float32 S tile, W x in place; NOTES.md run 8); they hold at most CWARPS x FR_MAXT 16 x 16 tiles of it
 * (Pp x Np <= 8192, e.g. lm130's 64 x 128): larger states, and shapes whose tiles do not fit in shared memory, keep the
 * SIMT kernels (m3k_chunked_smem answers INT64_MAX / a size above the limit).
 */
#include "bcnorm_row.cuh"
#include "mma_tile.cuh"
#include "scan_math.cuh"

typedef __nv_bfloat16 OT; /* tensor-core operand type */

enum { CQ = M3K_CHUNK, CTHREADS = 256, CWARPS = 8 };
/* The backward's products in registers: a [CQ][KB] column block is the CTA's CWARPS x BMM_ILP 16 x 16
 * accumulator tiles (bmm_regs). */
enum { BMM_ILP = 4, KB = CWARPS * BMM_ILP / (CQ / 16) * 16 };
static_assert(CQ * (KB / 16) <= 2 * CQ * (CQ / 16), "carve_c: sR holds kgrad_regs' partials");

/* per-token scalar table: sc[i * FW + F_x], i < CQ + 1 (slot CQ... unused; slot nb = next token) */
enum { F_A = 0, F_GAM, F_BP, F_DT, F_RST, F_LAM, F_AA, F_DSP, F_DAD, F_C, F_SEG, F_EC, F_SCALE, F_W, F_QK, F_DYX,
       F_R, F_ROW, F_COL, F_V, FW };

struct cdims {
  int Pp, Np;            /* P, N rounded up to 16 */
  int lqn, lqp, lqq;     /* row strides of bf16 tiles N, P, Q wide */
  int lfp;               /* row stride of float32 tiles P wide */
};

__host__ __device__ inline cdims make_cdims(int P, int N) {
  cdims c;
  c.Pp = (P + 15) / 16 * 16;
  c.Np = (N + 15) / 16 * 16;
  c.lqn = c.Np + 8;
  c.lqp = c.Pp + 8;
  c.lqq = CQ + 8;
  c.lfp = c.Pp + 4;
  return c;
}

struct csmem {
  OT *sq;    /* [CQ][lqn] q (rotated) */
  OT *sk;    /* [CQ][lqn] ktil = scale k */
  OT *sx;    /* [CQ][lqp] x */
  OT *sxw;   /* [CQ][lqp] bwd: dY (the forward forms W x in place in sx); dstate: [2][CQ][lqp] dY, then EC dY */
  OT *sE;    /* [Pp][lqn] the entering state E (bf16) */
  OT *sdE;   /* [Pp][lqn] bwd: dE (bf16; its own space, or sE's after E's last use: carve_c) */
  OT *sL1;   /* [CQ][lqq] fwd: L o S; bwd: L o S1 */
  OT *sL2;   /* [CQ][lqq] bwd: L o S2 */
  float *sR;   /* fwd: Y [CQ][lfp]; bwd: M's row / column partials, then the row dots' tile partials */
  float *th;   /* [CQ][S] post_seq: tanh of the angle logits */
  float *dth;  /* [CQ][S] post_seq: angle gradient of the chunk, then pi D tanh */
  float *sc;   /* [CQ + 1][FW] token scalars (post_seq: [CQ][TW] table rows) */
  float *kl;   /* [Np] prep: k (rotated, unscaled) of the window's last token */
  float *pOn;  /* [CWARPS][Pp] gate backward: mixer norm weight partials per warp */
  float *pbw;  /* [CWARPS][2N] post: B_bias, C_bias partials per warp */
  float *gsum; /* [CQ][2N] post summing a group's heads: each token's dk | dq over the heads so far */
  float *seg_in; /* [G][S] post_seq: the angle gradient entering each segment from the later tokens */
  int *seg_cut;  /* [G] post_seq: each segment's last reset (-1: none) */
  float *red;  /* [32] */
  float *misc; /* [8]: misc[0] = dec of the chunk */
};

__host__ __device__ inline size_t cs_take(size_t &off, size_t bytes) {
  const size_t o = (off + 127) & ~(size_t)127;
  off = o + bytes;
  return o;
}

/* The carves below: CT(field, type, n) takes n elements for t.field (128-byte aligned). */
#define CT(field, type, n) t.field = (type *)(base + cs_take(off, (size_t)(n) * sizeof(type)))

/* The most shared memory a CTA may take for two of them to share a multiprocessor (228 KB on sm_90, 1 KB
 * of it reserved per CTA). */
enum { SMEM_TWO_CTAS = 228 * 1024 / 2 - 1024 };

/* Carves the backward's shared memory (base NULL: only the size). dE gets a space of its own (so that it
 * loads with the chunk's other operands) where two CTAs still share a multiprocessor; else E's, after dq. */
__host__ __device__ inline size_t carve_c_de(unsigned char *base, int P, int N, csmem *m, bool own_de) {
  const cdims c = make_cdims(P, N);
  size_t off = 0;
  csmem t = {};
  CT(sq, OT, CQ * c.lqn);
  CT(sk, OT, CQ * c.lqn);
  CT(sx, OT, CQ * c.lqp);
  CT(sxw, OT, CQ * c.lqp);
  CT(sE, OT, c.Pp * c.lqn);
  if (own_de) CT(sdE, OT, c.Pp * c.lqn);
  else t.sdE = t.sE;
  CT(sL1, OT, CQ * c.lqq);
  CT(sL2, OT, CQ * c.lqq);
  CT(sR, float, 2 * CQ * (CQ / 16)); /* the row / column partials of M, then [CQ][KB / 16] (kgrad_regs) */
  CT(sc, float, (CQ + 1) * FW);
  CT(red, float, 32);
  CT(misc, float, 8);
  if (m) *m = t;
  return off + 128;
}
__host__ __device__ inline size_t carve_c(unsigned char *base, int P, int N, csmem *m) {
  return carve_c_de(base, P, N, m, carve_c_de(NULL, P, N, NULL, true) <= SMEM_TWO_CTAS);
}

/* Shared memory of scan_dstate_chunked: q, dY and the table of two chunks (the next one loads while the
 * current one computes). */
__host__ __device__ inline size_t carve_d(unsigned char *base, int P, int N, csmem *m) {
  const cdims c = make_cdims(P, N);
  size_t off = 0;
  csmem t = {};
  CT(sq, OT, 2 * CQ * c.lqn);
  CT(sxw, OT, 2 * CQ * c.lqp);
  CT(sc, float, 2 * (CQ + 1) * FW);
  CT(red, float, 32);
  CT(misc, float, 8);
  if (m) *m = t;
  return off + 128;
}

/* Forward, E in registers (scan_fwd_chunked_r): the float32 state E lives in mma accumulator
 * tiles (acc16; tile wid + CWARPS j of the Pp x Np state for warp wid, j < FR_MAXT), so neither the
 * float32 copy of E nor the float32 S tile nor a separate W x tile are in shared memory (lm130:
 * 168 -> 103 KB: two CTAs per SM). Shapes with more E tiles take the SIMT kernels. */
enum { FR_MAXT = 4 };
/* The walks may split a state's independent rows over up to WALK_PARTS_MAX CTAs (fwd_launch, dstate_launch). */
enum { WALK_PARTS_MAX = 2 };

__host__ __device__ inline bool fwd_in_regs(int P, int N) {
  const cdims c = make_cdims(P, N);
  return (c.Pp / 16) * (c.Np / 16) <= CWARPS * FR_MAXT;
}

/* The walks' register state (acc16 [FR_MAXT] per warp): f(j, i0, j0) for each of the warp's tiles j, the
 * Pp x Np state's tile wid + CWARPS j (row-major over its 16 x 16 tiles) at row i0, column j0. */
template <typename F> __device__ __forceinline__ void for_state_tiles(const cdims &cd, F f) {
  const int wid = threadIdx.x >> 5, etn = cd.Np / 16, ent = (cd.Pp / 16) * etn;
#pragma unroll
  for (int j = 0; j < FR_MAXT; j++) {
    const int tile = wid + CWARPS * j;
    if (tile < ent) f(j, tile / etn * 16, tile % etn * 16);
  }
}
/* f(j, e, p, n) for element e of each of the warp's state tiles j: state row p, column n. */
template <typename F> __device__ __forceinline__ void for_state_elems(const cdims &cd, F f) {
  for_state_tiles(cd, [&](int j, int i0, int j0) {
#pragma unroll
    for (int e = 0; e < 8; e++) f(j, e, i0 + acc_row(e), j0 + acc_col(e));
  });
}
/* The walks' state to global memory in bf16, [Pp][Np] (its padding too: the walks keep it zero). */
__device__ __forceinline__ void state_keep(OT *dst, const acc16 (&st)[FR_MAXT], const cdims &cd) {
  for_state_tiles(cd, [&](int j, int i0, int j0) {
#pragma unroll
    for (int e = 0; e < 8; e += 2)
      *(__nv_bfloat162 *)(dst + (i0 + acc_row(e)) * cd.Np + j0 + acc_col(e)) =
          __floats2bfloat162_rn(st[j].v[e], st[j].v[e + 1]);
  });
}
/* The walks' recurrence: state <- dec state + X^T Y, X [CQ][Pp] (row stride ldx), Y [CQ][Np] (ldy). */
__device__ __forceinline__ void state_update(acc16 (&st)[FR_MAXT], const cdims &cd, float dec, const OT *X, int ldx,
                                             const OT *Y, int ldy) {
  for_state_tiles(cd, [&](int j, int i0, int j0) {
#pragma unroll
    for (int e = 0; e < 8; e++) st[j].v[e] *= dec;
    mma_tile<false, true>(st[j], X + i0, ldx, Y + j0, ldy, CQ);
  });
}

__host__ __device__ inline size_t carve_r(unsigned char *base, int P, int N, csmem *m) {
  const cdims c = make_cdims(P, N);
  size_t off = 0;
  csmem t = {};
  CT(sq, OT, CQ * c.lqn);
  CT(sk, OT, CQ * c.lqn);
  CT(sx, OT, CQ * c.lqp); /* x, then (after Y) W x in place */
  CT(sE, OT, c.Pp * c.lqn);
  CT(sL1, OT, CQ * c.lqq); /* L o S */
  CT(sR, float, CQ * c.lfp); /* Y */
  CT(sc, float, (CQ + 1) * FW);
  CT(misc, float, 8);
  if (m) *m = t;
  return off + 128;
}

/* The chunk scratch (m3k_scan_args.chunk_scratch): per unit u = (b H + h) nch + c, i.e. per (row, head,
 * chunk), what the parallel kernels around the walks exchange with them (the walks run the products):
 *   q, k   [u][CQ][Np] bf16: q (rotated), ktil = scale k (rotated); rows >= nb and columns >= N zero
 *   tab    [u][CQ][TW] float: per token the scalars F_A .. F_QK of scan_prep_chunked, then T_DEC (row
 *          0: the chunk's dec), and in the backward F_DYX (scan_gate_bwd_chunked), T_DA (the per-chunk
 *          kernel), T_DSCALE, T_DGAM (scan_post_chunked), T_DBP0 (unit 0: v_in^T dE_0 k_in, the dE
 *          walk, in rows 0 .. WALK_PARTS_MAX - 1: the walk's parts, walk_parts_sum); rows >= nb zero
 *   kl     [rows H][N] float: the window's last k (rotated, unscaled), from scan_prep_chunked to the
 *          forward walk, which writes fin_k only after reading in_k (in evaluation both are the
 *          carried state itself)
 * and for the backward only:
 *   dy     [u][CQ][Pp] bf16: dL/dy after the gate backward; rows >= nb and columns >= P zero
 *   de     [u][Pp][Np] bf16: dE leaving the chunk (scan_dstate_chunked; padding zero)
 *   pon    [u][Pp] float: the chunk's mixer-norm weight partials (outproj_norm)
 *   pbc    [u][2][N] float: the chunk's B_bias, C_bias gradient partials
 * In training (a.chunk_states set) the forward keeps what its backward reads in a.chunk_states, per
 * layer (kept_views): the state entering each chunk, states [u][Pp][Np] bf16 (the forward walk; the
 * per-chunk products read E in bf16 anyway; padding zero), and q, k, tab as above (the scratch has
 * none of them then): the backward does not prepare them again. The per-chunk backward, their last
 * reader, overwrites q and k with the raw dq and dktil ([u][CQ][Np] bf16) that scan_post_chunked reads. */
enum { TW = 24, T_DEC = 16, T_DA, T_DSCALE, T_DGAM, T_DBP0, T_DV, TAB_FIELDS = F_DYX + 1 };
static_assert(TAB_FIELDS <= T_DEC && T_DV < TW && (int)TW >= (int)FW, "table layout"); /* T_DV: post_seq's own */

struct cviews {
  OT *q, *k, *dy, *states, *de;
  float *tab, *kl, *pon, *pbc;
};

#define CV(field, type, n) t.field = (type *)(b + cs_take(off, (size_t)(n) * sizeof(type)))

/* q, k, tab at off of b (see chunk_views). */
__host__ __device__ inline void carve_qkt(unsigned char *b, size_t &off, const cdims &c, size_t units, cviews &t) {
  CV(q, OT, units * CQ * c.Np);
  CV(k, OT, units * CQ * c.Np);
  CV(tab, float, units * CQ * TW);
}

/* Carves one layer's a.chunk_states at base (NULL: only the size): states, then q, k, tab; returns
 * its size in floats. */
__host__ __device__ inline int64_t kept_views(float *base, int rows, int len, int H, int P, int N, cviews *v) {
  const cdims c = make_cdims(P, N);
  const size_t units = (size_t)rows * H * ((len + CQ - 1) / CQ);
  size_t off = 0;
  unsigned char *b = (unsigned char *)base;
  cviews t = {};
  CV(states, OT, units * c.Pp * c.Np);
  carve_qkt(b, off, c, units, t);
  if (v) *v = t;
  return (int64_t)((off + 127) / sizeof(float));
}

/* Carves the scratch at base (NULL: only the size). Training (kept, a.chunk_states; the size for
 * the backward) takes states, q, k and tab from kept, inference q, k and tab from the scratch.
 * Returns the scratch's size in floats. */
__host__ __device__ inline int64_t chunk_views(float *base, float *kept, int rows, int len, int H, int P, int N,
                                               bool bwd, cviews *v) {
  const cdims c = make_cdims(P, N);
  const size_t units = (size_t)rows * H * ((len + CQ - 1) / CQ);
  size_t off = 0;
  unsigned char *b = (unsigned char *)base;
  cviews t = {};
  if (kept) kept_views(kept, rows, len, H, P, N, &t);
  else if (!bwd) carve_qkt(b, off, c, units, t);
  CV(kl, float, (size_t)rows * H * N);
  if (bwd) {
    CV(dy, OT, units * CQ * c.Pp);
    CV(de, OT, units * c.Pp * c.Np);
    CV(pon, float, units * c.Pp);
    CV(pbc, float, units * 2 * N);
  }
  if (v) *v = t;
  return (int64_t)((off + 127) / sizeof(float));
}
#undef CV

/* Shared memory of scan_prep_chunked. */
__host__ __device__ inline size_t carve_p(unsigned char *base, int P, int N, csmem *m) {
  const cdims c = make_cdims(P, N);
  size_t off = 0;
  csmem t = {};
  CT(sq, OT, CQ * c.lqn);
  CT(sk, OT, CQ * c.lqn);
  CT(sc, float, (CQ + 1) * FW);
  CT(kl, float, c.Np);
  CT(misc, float, 8);
  if (m) *m = t;
  return off + 128;
}

/* Shared memory of scan_gate_bwd_chunked. */
__host__ __device__ inline size_t carve_g(unsigned char *base, int P, csmem *m) {
  const cdims c = make_cdims(P, 16);
  size_t off = 0;
  csmem t = {};
  CT(sc, float, CQ * FW);
  CT(pOn, float, CWARPS * c.Pp);
  if (m) *m = t;
  return off + 128;
}

/* Shared memory of scan_post_chunked: two heads' tables of the chunk (FW layout; the next one loads while
 * the current one is used), the warps' B/C bias partials, and when it sums a group's heads (sum) the
 * running sums. */
__host__ __device__ inline size_t carve_q(unsigned char *base, int N, bool sum, csmem *m) {
  size_t off = 0;
  csmem t = {};
  CT(sc, float, 2 * (CQ + 1) * FW);
  CT(pbw, float, CWARPS * 2 * N);
  if (sum) CT(gsum, float, CQ * 2 * N);
  CT(misc, float, 8);
  if (m) *m = t;
  return off + 128;
}

/* The two-level walks along the sequence (scan_angles_chunked's angles, scan_post_seq_chunked's angle
 * gradient): one thread per (pair, segment), G = walk_segs(S) segments a block. */
__host__ __device__ inline int walk_segs(int S) { return S > 0 ? min(CTHREADS / S, 64) : 1; }

/* Shared memory of scan_post_seq_chunked (rows = seq_block(S)): th: tanh of the angle logits, dth: the
 * angle gradient, sc: table rows (TW layout), the walk's segment carries. */
__host__ __device__ inline size_t carve_post(unsigned char *base, int S, int rows, csmem *m) {
  size_t off = 0;
  csmem t = {};
  CT(th, float, rows * S + 1);
  CT(dth, float, rows * S + 1);
  CT(sc, float, (rows + 1) * TW);
  CT(seg_in, float, walk_segs(S) * S + 1);
  CT(seg_cut, int, walk_segs(S));
  if (m) *m = t;
  return off + 128;
}
#undef CT

/* ---- tensor-core block product -------------------------------------------------------------------- */


/* The warp's tile j (< BMM_ILP) of a [CQ][16 tn] product: false past the last; else its first row i0
 * and column j0. Tiles go round the warps (tile wid + CWARPS j, row-major), so when tn divides CWARPS
 * all of a warp's tiles lie in one column. */
__device__ __forceinline__ bool reg_tile(int j, int tn, int &i0, int &j0) {
  const int tile = (threadIdx.x >> 5) + CWARPS * j;
  i0 = tile / tn * 16;
  j0 = tile % tn * 16;
  return tile < (CQ / 16) * tn;
}

/* c[j] += the warp's tiles (reg_tile) of A[CQ x K] B[K x 16 tn], tn <= KB / 16: A row-major (A[i lda + k])
 * or column-major (A[k lda + i]), B row-major (B[k ldb + j]) or column-major (B[j ldb + k]); K a
 * multiple of 16. The tiles' chains run side by side, k outermost, each in order (deterministic);
 * tiles of one column load each k step's B fragment once. */
template <bool A_ROW, bool B_ROW>
__device__ __forceinline__ void bmm_regs(acc16 (&c)[BMM_ILP], const OT *A, int lda, const OT *B, int ldb, int tn,
                                         int K) {
  int i0, j0;
  if (!reg_tile(0, tn, i0, j0)) return; /* (tn < CWARPS / 4: this warp has no tile) */
  const unsigned as = k16_step(A_ROW, lda), bs = k16_step(!B_ROW, ldb);
  unsigned aa[BMM_ILP], ba[BMM_ILP];
#pragma unroll
  for (int j = 0; j < BMM_ILP; j++) {
    if (!reg_tile(j, tn, i0, j0)) break;
    aa[j] = lds_addr(A_ROW ? A + (size_t)i0 * lda : A + i0, lda, A_ROW);
    ba[j] = lds_addr(B_ROW ? B + j0 : B + (size_t)j0 * ldb, ldb, B_ROW);
  }
  if (CWARPS % tn == 0) {
    for (int k = 0; k < K; k += 16, ba[0] += bs) {
      unsigned bf[4];
      ldsm_b<B_ROW>(ba[0], bf);
#pragma unroll
      for (int j = 0; j < BMM_ILP; j++) {
        if (!reg_tile(j, tn, i0, j0)) break;
        mma_k16_a<A_ROW>(c[j], aa[j], bf);
        aa[j] += as;
      }
    }
  } else {
    for (int k = 0; k < K; k += 16) {
#pragma unroll
      for (int j = 0; j < BMM_ILP; j++) {
        if (!reg_tile(j, tn, i0, j0)) break;
        mma_k16<A_ROW, B_ROW>(c[j], aa[j], ba[j]);
        aa[j] += as;
        ba[j] += bs;
      }
    }
  }
}

/* f(j, e, i, col) for each even element e of the warp's tiles j (reg_tile) of a [CQ][16 tn] product whose
 * columns start at c0: its row i and the first col of its two columns (v[e], v[e + 1]). */
template <typename F> __device__ __forceinline__ void for_reg_pairs(int tn, int c0, F f) {
#pragma unroll
  for (int j = 0; j < BMM_ILP; j++) {
    int i0, j0;
    if (!reg_tile(j, tn, i0, j0)) break;
#pragma unroll
    for (int e = 0; e < 8; e += 2) f(j, e, i0 + acc_row(e), c0 + j0 + acc_col(e));
  }
}
/* Row i of the warp's tiles c (reg_tile, [CQ][16 tn]) times sc[i][f], 0 past nb. */
__device__ __forceinline__ void scale_reg_rows(acc16 (&c)[BMM_ILP], int tn, const float *sc, int f, int nb) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < BMM_ILP; j++) {
    int i0, j0;
    if (!reg_tile(j, tn, i0, j0)) break;
    const int r0 = i0 + lane / 4;
    const float s0 = r0 < nb ? sc[r0 * FW + f] : 0.0f, s1 = r0 + 8 < nb ? sc[(r0 + 8) * FW + f] : 0.0f;
#pragma unroll
    for (int e = 0; e < 8; e++) c[j].v[e] *= (e >> 1) & 1 ? s1 : s0;
  }
}

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
    const tok_scalars ts = row_scalars(a, pr, h);
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

/* ---- q and k of a token in groups of four columns on a few lanes (scan_prep_chunked, scan_post_chunked) - */

/* A token's Np columns are Np / 4 groups of four (each pair (2a, 2a + 1) inside one group) on LPT lanes, a
 * power of two, with GPL groups a lane (1 up to Np = 128, else 2): 32 / LPT tokens a warp at once. Lane l
 * takes token slot l / LPT and groups l % LPT + LPT r (r < GPL): its columns are the same at every token,
 * so a token costs it two 16-byte loads (B_hat, C_hat), its angles and two 8-byte stores (q, ktil), with
 * no per-unit index arithmetic (NOTES.md run 290: the per-unit form spent ~300 instructions a token). */
__host__ __device__ constexpr int groups_per_lane(int Np) { return Np > 128 ? 2 : 1; }
__device__ __forceinline__ int group_lanes(int Np) {
  int l = 4;
  while (l < 32 && 4 * l < Np) l <<= 1;
  return l;
}
/* Binds GPL = groups_per_lane(Np) (only the one a fixed NK allows). */
#define GROUPS_DISPATCH(N_, body)                                              \
  do {                                                                         \
    if (groups_per_lane(((N_) + 15) / 16 * 16) == 1) {                         \
      enum { GPL = 1 };                                                        \
      if constexpr (NK == 0 || NK <= 128) body;                                \
    } else {                                                                   \
      enum { GPL = 2 };                                                        \
      if constexpr (NK == 0 || NK > 128) body;                                 \
    }                                                                          \
  } while (0)

/* A token's raw values at one lane: B_hat, C_hat of its groups' columns, the angles of their two pairs. */
template <int GPL> struct group_raw {
  float4 k[GPL], q[GPL];
  float th[GPL][2];
};

/* Four columns from c0 of a float row of N values: one 16-byte load where the rows are 16-byte aligned
 * (vec: bc_hat's, N % 4 == 0), else one at a time; zero from column N on. */
__device__ __forceinline__ float4 ld_group(const float *row, int c0, int N, bool vec) {
  if (vec) return c0 < N ? __ldg((const float4 *)(row + c0)) : make_float4(0, 0, 0, 0);
  float v[4];
#pragma unroll
  for (int e = 0; e < 4; e++) v[e] = c0 + e < N ? __ldg(row + c0 + e) : 0.0f;
  return make_float4(v[0], v[1], v[2], v[3]);
}

/* A token's raw values at the lane's groups (c0): B_hat, C_hat of bc_hat's row rk (C_hat GN further), the
 * angles of the groups' pairs (row th of theta). */
template <int GPL>
__device__ __forceinline__ void group_load(const float *rk, int GN, const float *th, int S, const int (&c0)[GPL], int N,
                                           group_raw<GPL> &t) {
#pragma unroll
  for (int r = 0; r < GPL; r++) {
    t.k[r] = ld_group(rk, c0[r], N, N % 4 == 0);
    t.q[r] = ld_group(rk + GN, c0[r], N, N % 4 == 0);
    const int p = c0[r] / 2; /* the group's first pair */
    t.th[r][0] = p < S ? __ldg(th + p) : 0.0f;
    t.th[r][1] = p + 1 < S ? __ldg(th + p + 1) : 0.0f;
  }
}

/* Group r of a token biased (bk, bq: the head's B_bias, C_bias at the group) and its pairs rotated by their
 * angles (unit_rotate's FAST formulas): k, q of the four columns; cs, sn of each pair (1, 0 where the two
 * columns pass unrotated). */
template <int GPL>
__device__ __forceinline__ void group_rotated(const group_raw<GPL> &t, float4 bk, float4 bq, int r, int c0, int S,
                                              float (&k)[4], float (&q)[4], float (&cs)[2], float (&sn)[2]) {
  k[0] = t.k[r].x + bk.x, k[1] = t.k[r].y + bk.y, k[2] = t.k[r].z + bk.z, k[3] = t.k[r].w + bk.w;
  q[0] = t.q[r].x + bq.x, q[1] = t.q[r].y + bq.y, q[2] = t.q[r].z + bq.z, q[3] = t.q[r].w + bq.w;
#pragma unroll
  for (int e = 0; e < 2; e++) {
    cs[e] = 1;
    sn[e] = 0;
    if (c0 / 2 + e < S) {
      const unit_kq u = unit_rotate<true>(0, true, k[2 * e], k[2 * e + 1], q[2 * e], q[2 * e + 1], t.th[r][e]);
      k[2 * e] = u.k0, k[2 * e + 1] = u.k1, q[2 * e] = u.q0, q[2 * e + 1] = u.q1;
      cs[e] = u.cs;
      sn[e] = u.sn;
    }
  }
}

/* The head's B_bias, C_bias at the lane's groups. */
template <int GPL>
__device__ __forceinline__ void group_biases(const m3k_scan_args &a, int h, const int (&c0)[GPL], float4 (&bk)[GPL],
                                             float4 (&bq)[GPL]) {
  const int N = a.d.N;
#pragma unroll
  for (int r = 0; r < GPL; r++) {
    bk[r] = ld_group(a.B_bias + (int64_t)h * N, c0[r], N, false);
    bq[r] = ld_group(a.C_bias + (int64_t)h * N, c0[r], N, false);
  }
}

/* The lane's groups: column c0[r] = 4 (lane % LPT + LPT r). */
template <int GPL> __device__ __forceinline__ void group_cols(int LPT, int (&c0)[GPL]) {
#pragma unroll
  for (int r = 0; r < GPL; r++) c0[r] = 4 * ((int)(threadIdx.x & 31) % LPT + LPT * r);
}

/* q, ktil (bf16) and q.k (float32) of the chunk; rows >= nb and columns >= N are zero. kl: the window's
 * last k (or NULL). Each round a warp takes 32 / LPT tokens, and loads the next round's while it finishes
 * this one's. */
template <int GPL>
__device__ __forceinline__ void c_build(const m3k_scan_args &a, const csmem &s, const cdims &cd, int N, int64_t m0,
                                        int t0, int nb, int h, int g, float *kl) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, S = a.d.S, GN = a.d.G * N, H = a.d.H;
  const int LPT = group_lanes(cd.Np), TPW = 32 / LPT, slot = lane / LPT, per_round = CWARPS * TPW;
  int c0[GPL];
  float4 bk[GPL], bq[GPL];
  group_cols(LPT, c0);
  group_biases(a, h, c0, bk, bq);
  const auto load = [&](int i, group_raw<GPL> &t) {
    if (i < nb)
      group_load(a.bc_hat + ((m0 + i) * 2 * a.d.G + g) * N, GN, a.theta + ((m0 + i) * H + h) * S, S, c0, N, t);
  };
  group_raw<GPL> cur = {}, nxt = {};
  load(wid * TPW + slot, cur);
  for (int i = wid * TPW + slot; i < CQ; i += per_round) { /* every lane the same rounds: the shuffles */
    nxt = group_raw<GPL>{};
    load(i + per_round, nxt);
    const bool live = i < nb, last = kl && live && t0 + i == a.len - 1;
    const float sc = live ? s.sc[i * FW + F_SCALE] : 0.0f;
    OT *q = s.sq + i * cd.lqn, *k = s.sk + i * cd.lqn;
    float qk = 0;
#pragma unroll
    for (int r = 0; r < GPL; r++) {
      if (c0[r] >= cd.Np) continue;
      float kv[4], qv[4], cs[2], sn[2];
      group_rotated(cur, bk[r], bq[r], r, c0[r], S, kv, qv, cs, sn);
      if (!live) kv[0] = kv[1] = kv[2] = kv[3] = qv[0] = qv[1] = qv[2] = qv[3] = 0;
#pragma unroll
      for (int e = 0; e < 4; e++) qk = __fmaf_rn(qv[e], kv[e], qk);
      const __nv_bfloat162 qs[2] = {__floats2bfloat162_rn(qv[0], qv[1]), __floats2bfloat162_rn(qv[2], qv[3])};
      const __nv_bfloat162 ks[2] = {__floats2bfloat162_rn(sc * kv[0], sc * kv[1]),
                                    __floats2bfloat162_rn(sc * kv[2], sc * kv[3])};
      *(uint2 *)(q + c0[r]) = *(const uint2 *)qs;
      *(uint2 *)(k + c0[r]) = *(const uint2 *)ks;
      if (last)
#pragma unroll
        for (int e = 0; e < 4; e++)
          if (c0[r] + e < N) kl[c0[r] + e] = kv[e];
    }
    for (int o = LPT / 2; o > 0; o >>= 1) qk += __shfl_xor_sync(0xffffffffu, qk, o);
    if (live && lane % LPT == 0) s.sc[i * FW + F_QK] = qk;
    cur = nxt;
  }
}

/* Read-only activation loads (the non-coherent path: never for data this kernel writes). */
template <typename T> __device__ __forceinline__ float ldact(const T *p) { return to_f(__ldg(p)); }

/* The angle logits of a token load as 16-byte vectors of 8 when they are aligned so (tanh8: the tanh of
 * the 8 in u), else one at a time. */
__device__ inline bool angles_vec8(const m3k_dims &d) { return d.S % 8 == 0 && d.ang_off % 8 == 0 && d.dipp % 8 == 0; }
template <typename T> __device__ __forceinline__ void tanh8(const uint4 &u, float *out) {
  static_assert(sizeof(T) == 2, "16-bit activations");
  const T *v = (const T *)&u;
#pragma unroll
  for (int e = 0; e < 8; e++) out[e] = tanhf(to_f(v[e]));
}

/* The gate backward of the chunk's tokens (warp per token, as scan.cu): dz into dproj, dy (the bf16
 * rows dyt [CQ][Pp], zero past nb and P), dy.x (F_DYX), the mixer-norm weight terms per warp.
 * Each warp loads its next token's inputs while it finishes the current one; they stay in the
 * activation type until used (a conversion at the load would wait for it). */
template <typename T> struct gate_in {
  T x[4], z[4], dg[4], y[4];
  float rn;
};
template <typename T>
__device__ __forceinline__ void gate_load(const m3k_scan_args &a, int P, int64_t mi, int h, gate_in<T> &g) {
  const m3k_dims &d = a.d;
  const int lane = threadIdx.x & 31;
  const T *proj = (const T *)a.proj;
  g.rn = d.outproj_norm ? __ldg(a.y_rstd + mi * d.H + h) : 1.0f;
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const int p = lane + 32 * k;
    g.x[k] = g.z[k] = g.dg[k] = g.y[k] = from_f<T>(0.0f);
    if (p < P) {
      const T *pr = proj + mi * d.dipp + (int64_t)h * P + p;
      const int64_t o = mi * d.E + (int64_t)h * P + p;
      g.x[k] = __ldg(pr + d.x_off);
      g.z[k] = __ldg(pr + d.z_off);
      g.dg[k] = __ldg((const T *)a.dgated + o);
      g.y[k] = __ldg((const T *)a.y + o);
    }
  }
}
template <typename T>
__device__ __forceinline__ void c_gate_bwd(const m3k_scan_args &a, const csmem &s, const cdims &cd, int P, int64_t m0,
                                           int nb, int h, OT *dyt) {
  const m3k_dims &d = a.d;
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  T *dproj = (T *)a.dproj;
  float wn[4];
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const int p = lane + 32 * k;
    wn[k] = d.outproj_norm && p < P ? __ldg(a.out_norm + (int64_t)h * P + p) : 1.0f;
  }
  gate_in<T> g, nx;
  if (wid < nb) gate_load<T>(a, P, m0 + wid, h, g);
  for (int i = wid; i < CQ; i += CWARPS) {
    OT *dyr = dyt + (size_t)i * cd.Pp;
    if (i >= nb) {
      for (int p = lane; p < cd.Pp; p += 32) dyr[p] = __float2bfloat16_rn(0.0f);
      continue;
    }
    if (i + CWARPS < nb) gate_load<T>(a, P, m0 + i + CWARPS, h, nx);
    const int64_t mi = m0 + i;
    const float rn = g.rn;
    float dyn[4], yf[4], dot = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const int p = lane + 32 * k;
      dyn[k] = 0;
      yf[k] = to_f(g.y[k]);
      if (p < P) {
        const float z = to_f(g.z[k]), dg = to_f(g.dg[k]);
        float silu, dsilu;
        silu_and_grad(z, silu, dsilu);
        const float yn = d.outproj_norm ? yf[k] * rn * wn[k] : yf[k];
        dproj[mi * d.dipp + d.z_off + (int64_t)h * P + p] = from_f<T>(dg * yn * dsilu);
        dyn[k] = dg * silu;
        if (d.outproj_norm) dot += yf[k] * wn[k] * dyn[k];
      }
    }
    float cn = 0;
    if (d.outproj_norm) cn = warp_sum(dot) / (float)P * rn * rn * rn;
    float dyx = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const int p = lane + 32 * k;
      if (p < cd.Pp) {
        float dy = 0;
        if (p < P) {
          if (d.outproj_norm) {
            s.pOn[wid * cd.Pp + p] += yf[k] * rn * dyn[k];
            dy = rn * wn[k] * dyn[k] - yf[k] * cn;
          } else {
            dy = dyn[k];
          }
          dyx += dy * to_f(g.x[k]);
        }
        dyr[p] = __float2bfloat16_rn(dy);
      }
    }
    dyx = warp_sum(dyx);
    if (lane == 0) s.sc[i * FW + F_DYX] = dyx;
    g = nx;
  }
}

/* c_gate_bwd without the mixer norm, for 16-byte aligned rows (act_vec): a token's Pp columns on Pp / 8 lanes,
 * eight columns a lane (16-byte loads and stores), 32 / (Pp / 8) tokens a warp at once, the next round's
 * loads in flight during this one's arithmetic. The same dz and dy; dy.x summed per lane, then over the
 * token's lanes. */
template <typename T>
__device__ __forceinline__ void c_gate_bwd_vec(const m3k_scan_args &a, const csmem &s, const cdims &cd, int P,
                                               int64_t m0, int nb, int h, OT *dyt) {
  const m3k_dims &d = a.d;
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, LT = cd.Pp / 8, tpw = 32 / LT;
  const int l = lane % LT, c0 = 8 * l, per_round = CWARPS * tpw;
  const bool live = c0 < P;
  const T *proj = (const T *)a.proj;
  T *dproj = (T *)a.dproj;
  struct in8 {
    uint4 x, z, dg, y;
  };
  const auto load = [&](int i, in8 &v) {
    if (i >= nb || !live) return;
    const int64_t mi = m0 + i, col = (int64_t)h * P + c0;
    const T *pr = proj + mi * d.dipp + col;
    v.x = __ldg((const uint4 *)(pr + d.x_off));
    v.z = __ldg((const uint4 *)(pr + d.z_off));
    v.dg = __ldg((const uint4 *)((const T *)a.dgated + mi * d.E + col));
    v.y = __ldg((const uint4 *)((const T *)a.y + mi * d.E + col));
  };
  const int first = wid * tpw + lane / LT;
  in8 cur = {}, nxt = {};
  load(first, cur);
  for (int r = 0; r < (CQ + per_round - 1) / per_round; r++) { /* every lane the same rounds: the shuffles */
    const int i = r * per_round + first;
    load(i + per_round, nxt);
    float dyx = 0, dy[8] = {};
    if (i < nb && live) {
      const T *x = (const T *)&cur.x, *z = (const T *)&cur.z, *dg = (const T *)&cur.dg, *y = (const T *)&cur.y;
      float dz[8];
#pragma unroll
      for (int k = 0; k < 8; k++) {
        const float zf = to_f(z[k]), dgf = to_f(dg[k]);
        float silu, dsilu;
        silu_and_grad(zf, silu, dsilu);
        dz[k] = dgf * to_f(y[k]) * dsilu;
        dy[k] = dgf * silu;
        dyx += dy[k] * to_f(x[k]);
      }
      st8(dproj + (m0 + i) * d.dipp + d.z_off + (int64_t)h * P + c0, dz);
    }
    for (int o = 1; o < LT; o <<= 1) dyx += __shfl_xor_sync(0xffffffffu, dyx, o);
    if (i < CQ) {
      st8(dyt + (size_t)i * cd.Pp + c0, dy);
      if (i < nb && l == 0) s.sc[i * FW + F_DYX] = dyx;
    }
    cur = nxt;
  }
}

/* ---- loads into shared memory: cp16 (common.cuh), so that all of a chunk's loads are in flight at
 * once; callers end the phase with cp_wait_all() (or, loading one chunk ahead, cp_commit() after each
 * chunk's loads and cp_wait_prev() for all but the last group) and a barrier ---- */

/* rows (CQ unless given) rows of w bf16 (w a multiple of 8) from the scratch (row stride src_ld, w
 * unless given) into a padded shared tile (row stride ld). */
__device__ __forceinline__ void tile_load(OT *dst, int ld, const OT *src, int w, int rows = CQ, int src_ld = 0) {
  const int vpr = w / 8, sl = src_ld ? src_ld : w;
  for (int idx = threadIdx.x; idx < rows * vpr; idx += blockDim.x) {
    const int i = idx / vpr, v = idx - i * vpr;
    cp16(dst + i * ld + v * 8, src + (size_t)i * sl + v * 8);
  }
}
__device__ __forceinline__ void tile_store(OT *dst, const OT *src, int ld, int w) {
  const int vpr = w / 8;
  for (int idx = threadIdx.x; idx < CQ * vpr; idx += blockDim.x) {
    const int i = idx / vpr, v = idx - i * vpr;
    ((uint4 *)(dst + (size_t)i * w))[v] = *(const uint4 *)(src + i * ld + v * 8);
  }
}

/* The chunk's token scalars from the scratch table into sc (fields < nf, rounded up to 4); misc[0] =
 * dec. All asynchronous: a plain load here would hold its warp's later copies back by a round trip. */
__device__ __forceinline__ void tab_load(const float *tab, float *sc, int nf, float *misc) {
  const int pieces = (nf + 3) / 4;
  for (int idx = threadIdx.x; idx < CQ * pieces; idx += blockDim.x) {
    const int i = idx / pieces, f = (idx - i * pieces) * 4;
    cp16(sc + i * FW + f, tab + i * TW + f);
  }
  if (threadIdx.x == 0) cp4(misc, tab + T_DEC);
}

/* The act rows of the chunk's tokens are 16-byte aligned groups of 8 (P, the column offsets and the
 * row stride multiples of 8): the vector paths below apply. */
__device__ __forceinline__ bool act_vec(const m3k_dims &d) {
  return d.P % 8 == 0 && d.x_off % 8 == 0 && d.z_off % 8 == 0 && d.dipp % 8 == 0;
}

/* x of the chunk, its P columns from col0 (of x), into sx (bf16; rows >= nb and columns >= P zero):
 * async copies for bf16 activations (vec; col0 then a multiple of 8), element by element otherwise. */
template <typename T>
__device__ __forceinline__ void x_load(const m3k_scan_args &a, OT *sx, const cdims &cd, int64_t m0, int nb,
                                       int64_t col0, int P, bool vec) {
  const m3k_dims &d = a.d;
  const T *proj = (const T *)a.proj + d.x_off + col0;
  if (std::is_same<T, OT>::value && vec) {
    const int vpr = cd.Pp / 8;
    for (int idx = threadIdx.x; idx < CQ * vpr; idx += blockDim.x) {
      const int i = idx / vpr, v = idx - i * vpr;
      OT *dst = sx + i * cd.lqp + v * 8;
      if (i < nb && v * 8 < P) cp16(dst, proj + (m0 + i) * d.dipp + v * 8);
      else *(uint4 *)dst = make_uint4(0, 0, 0, 0);
    }
  } else {
#pragma unroll 4
    for (int idx = threadIdx.x; idx < CQ * cd.Pp; idx += blockDim.x) {
      const int i = idx / cd.Pp, p = idx - i * cd.Pp;
      const float xv = (i < nb && p < P) ? ldact(proj + (m0 + i) * d.dipp + p) : 0.0f;
      sx[i * cd.lqp + p] = __float2bfloat16_rn(xv);
    }
  }
}

/* ---- the parallel parts: angles, then per-chunk preparation ------------------------------------------- */

/* Tokens per pass of scan_post_seq_chunked, which walks a whole row along the sequence: several
 * chunks when the per-pair arrays stay small. */
__host__ __device__ inline int seq_block(int S) { return S <= 32 ? 4 * CQ : CQ; }
/* Angle-logit loads a thread of scan_post_seq_chunked has in flight at once (16 bytes each). */
enum { SEQ_LOADS = 4 };

/* Forward only: theta (a.theta) of every position and fin_angle, one CTA per (head, row, part): part z of
 * gridDim.z takes the pairs z S' .. z S' + S' - 1, S' = S / gridDim.z (the pairs walk independently;
 * angle_parts; S below is S'). The walk theta_t = wrap(theta_{t-1} + pi tanh(angle logit) dt), restarted at
 * resets, runs in two levels so that its dependent chain is short: the sequence goes in blocks of G =
 * walk_segs(S) segments of ANG_SEG tokens. Per block every thread first writes the increments of its (token,
 * pair) items into shared memory; thread (pair j, segment g) then walks its segment from 0 (as if the angle
 * entering it were 0, restarting at resets), in place; pair j's first thread carries the angle across the
 * segments' ends (wrapped sums, or a segment's own end after a reset in it); last, every thread adds the
 * angle entering its segment to its tokens before the segment's first reset. wrap(theta_in + local) equals
 * the sequential walk mod 2 pi; its float32 roundings differ (a chain of ANG_SEG + G wrapped sums per block
 * instead of one per token; within SPEC.md §8, like the tensor-core sums). H200 (kernels/NOTES.md run 58):
 * lm130 168 -> 108 us, mid 78 -> 34 us a launch. Shared memory: angles_smem_floats(S).
 * Where m3k_chunked_bc_rides, the launch's CTAs past the walks' (x >= H rows) normalise B and C meanwhile, a
 * warp per (position, B|C, group) row (bcnorm_row.cuh: bcnorm_fwd's bits): the walks leave most of the GPU
 * idle, and the B/C norm needs no launch of its own (48 -> 64 registers: ptxas -v). */
enum { ANG_SEG = 16 };
__host__ __device__ inline int angles_smem_floats(int S) {
  const int G = walk_segs(S), AB = G * ANG_SEG;
  return AB * S + 2 * AB + G * S + G;
}
static_assert(CTHREADS * ANG_SEG + 2 * 64 * ANG_SEG + CTHREADS + 64 <= 12288,
              "angles: within the default 48 KB of shared memory");

template <typename T>
__global__ void __launch_bounds__(CTHREADS) scan_angles_chunked(const m3k_scan_args a) {
  extern __shared__ __align__(128) unsigned char smraw[];
  const m3k_dims &d = a.d;
  const int64_t walks = (int64_t)d.H * a.rows;
  if (blockIdx.x >= walks) { /* B/C norm rows, CWARPS a CTA, the CTAs numbered across gridDim.z */
    const int64_t c = ((int64_t)blockIdx.x - walks) * gridDim.z + blockIdx.z;
    const int64_t item = c * CWARPS + (threadIdx.x >> 5);
    if (item < (int64_t)a.rows * a.len * 2 * d.G)
      bcnorm_fwd_row(d, (const T *)a.proj, a.B_norm, a.C_norm, a.bc_hat, a.bc_rstd, item);
    return;
  }
  const int h = grid_x(d.H), b = grid_row(d.H), SA = d.S, S = SA / gridDim.z, j0 = blockIdx.z * S, H = d.H;
  const int tid = threadIdx.x; /* 1 <= S <= 128 */
  const T *proj = (const T *)a.proj;
  const int G = walk_segs(S), AB = G * ANG_SEG, j = tid % S, g = tid / S;
  float *val = (float *)smraw;              /* [AB][S] increments, then each segment's local walk */
  float *dt = val + AB * S, *rst = dt + AB; /* [AB] dt and the reset flag of each token */
  float *tin = rst + AB;                    /* [G][S] the angle entering each segment */
  int *first = (int *)(tin + G * S);        /* [G] each segment's first reset (ANG_SEG: none) */
  const int64_t bh = (int64_t)b * H + h;
  float carry = tid < S && a.in_angle ? a.in_angle[bh * SA + j0 + tid] : 0.0f; /* thread j < S: pair j0 + j */
  for (int t0 = 0; t0 < a.len; t0 += AB) {
    const int nb = min(AB, a.len - t0), nseg = (nb + ANG_SEG - 1) / ANG_SEG;
    const int64_t m0 = (int64_t)b * a.len + t0;
    for (int i = tid; i < nb; i += CTHREADS) {
      const T *pr = proj + (m0 + i) * d.dipp;
      dt[i] = row_scalars(a, pr, h).dt;
      rst[i] = a.resets && a.resets[m0 + i] ? 1.0f : 0.0f;
    }
    __syncthreads();
    if (angles_vec8(d)) {
      const int S8 = S / 8;
      for (int idx = tid; idx < nb * S8; idx += CTHREADS) {
        const int i = idx / S8, jj = (idx - i * S8) * 8;
        float t8[8];
        tanh8<T>(__ldg((const uint4 *)(proj + (m0 + i) * d.dipp + d.ang_off + j0 + jj)), t8);
#pragma unroll
        for (int e = 0; e < 8; e++) val[i * S + jj + e] = PI_F * t8[e] * dt[i];
      }
    } else {
#pragma unroll 8
      for (int idx = tid; idx < nb * S; idx += CTHREADS) {
        const int i = idx / S, jj = idx - i * S;
        val[idx] = PI_F * angle_tanh(proj, d, m0 + i, j0 + jj) * dt[i];
      }
    }
    __syncthreads();
    const int i0 = g * ANG_SEG, i1 = min(i0 + ANG_SEG, nb); /* this thread's segment (g < nseg) */
    if (g < nseg) {
      float v = 0;
      int fr = ANG_SEG;
      for (int i = i0; i < i1; i++) {
        if (rst[i] != 0) {
          v = 0;
          if (fr == ANG_SEG) fr = i - i0;
        }
        v = wrap_sum(v, val[i * S + j]);
        val[i * S + j] = v;
      }
      if (j == 0) first[g] = fr;
    }
    __syncthreads();
    if (tid < S) {
      for (int q = 0; q < nseg; q++) {
        tin[q * S + j] = carry;
        const float end = val[(min(q * ANG_SEG + ANG_SEG, nb) - 1) * S + j];
        carry = first[q] < ANG_SEG ? end : wrap_sum(carry, end);
      }
    }
    __syncthreads();
    if (g < nseg) {
      const float in = tin[g * S + j];
      const int fr = first[g];
      float *out = a.theta + ((m0 + i0) * H + h) * SA + j0 + j;
      const int64_t step = (int64_t)H * SA;
      for (int i = i0; i < i1; i++, out += step) *out = i - i0 < fr ? wrap_sum(in, val[i * S + j]) : val[i * S + j];
    }
    __syncthreads();
  }
  if (tid < S && a.fin_angle) a.fin_angle[bh * SA + j0 + tid] = carry;
}

/* One CTA per (chunk, head, row): the chunk's token scalars, cumsums and masks, q and ktil (and the
 * window's last k into the scratch's kl); into the chunk scratch or, in training, what the forward
 * keeps (see chunk_views). At least four CTAs a multiprocessor with one group a lane (c_build: 48
 * registers at the compiled shapes), two with two. */
template <typename T, int GPL, int PK, int NK>
__global__ void __launch_bounds__(CTHREADS, GPL == 1 ? 4 : 2) scan_prep_chunked(const m3k_scan_args a) {
  extern __shared__ __align__(128) unsigned char smraw[];
  const m3k_dims &d = a.d;
  const int nch = (a.len + CQ - 1) / CQ, ch = grid_x(nch * d.H) % nch, h = grid_x(nch * d.H) / nch;
  const int b = grid_row(nch * d.H), g = h / d.hpg;
  const int P = PK ? PK : d.P, N = NK ? NK : d.N, H = d.H, tid = threadIdx.x, wid = tid >> 5;
  const cdims cd = make_cdims(P, N);
  csmem s;
  carve_p(smraw, P, N, &s);
  cviews cv;
  chunk_views(a.chunk_scratch, a.chunk_states, a.rows, a.len, H, P, N, false, &cv);
  const int t0 = ch * CQ, nb = min(CQ, a.len - t0);
  const int64_t m0 = (int64_t)b * a.len + t0, bh = (int64_t)b * H + h, u = bh * nch + ch;
  float *misc = s.misc;
  const bool want_kl = a.fin_k && t0 + nb == a.len;

  c_scalars<T>(a, s.sc, m0, t0, nb, h);
  __syncthreads();
  if (wid == 0) c_prep(s.sc, nb, misc);
  __syncthreads();
  c_build<GPL>(a, s, cd, N, m0, t0, nb, h, g, want_kl ? s.kl : NULL);
  __syncthreads();
  tile_store(cv.q + u * CQ * cd.Np, s.sq, cd.lqn, cd.Np);
  tile_store(cv.k + u * CQ * cd.Np, s.sk, cd.lqn, cd.Np);
  float *tab = cv.tab + u * CQ * TW;
  for (int idx = tid; idx < CQ * TW; idx += CTHREADS) {
    const int i = idx / TW, f = idx - i * TW;
    float v = 0;
    if (i < nb && f <= F_QK) v = s.sc[i * FW + f];
    if (idx == T_DEC) v = misc[0];
    tab[idx] = v;
  }
  if (want_kl)
    for (int n = tid; n < N; n += CTHREADS) cv.kl[bh * N + n] = s.kl[n];
}

/* The backward's first kernel, one CTA per (chunk, head, row): the gate backward of the chunk's
 * tokens (c_gate_bwd) into dproj's z columns and the scratch's dy tile, dy.x into the table
 * (F_DYX), the chunk's mixer-norm weight partials (pon). */
template <typename T, int PK, int NK>
__global__ void __launch_bounds__(CTHREADS) scan_gate_bwd_chunked(const m3k_scan_args a) {
  extern __shared__ __align__(128) unsigned char smraw[];
  const int nch = (a.len + CQ - 1) / CQ, ch = grid_x(nch * a.d.H) % nch, h = grid_x(nch * a.d.H) / nch;
  const int b = grid_row(nch * a.d.H);
  const int P = PK ? PK : a.d.P, N = NK ? NK : a.d.N, H = a.d.H, tid = threadIdx.x;
  const cdims cd = make_cdims(P, N);
  csmem s;
  carve_g(smraw, P, &s);
  cviews cv;
  chunk_views(a.chunk_scratch, a.chunk_states, a.rows, a.len, H, P, N, true, &cv);
  const int t0 = ch * CQ, nb = min(CQ, a.len - t0);
  const int64_t m0 = (int64_t)b * a.len + t0, u = ((int64_t)b * H + h) * nch + ch;
  for (int k = tid; k < CWARPS * cd.Pp; k += CTHREADS) s.pOn[k] = 0;
  __syncthreads();
  if (!a.d.outproj_norm && act_vec(a.d)) c_gate_bwd_vec<T>(a, s, cd, P, m0, nb, h, cv.dy + u * CQ * cd.Pp);
  else c_gate_bwd<T>(a, s, cd, P, m0, nb, h, cv.dy + u * CQ * cd.Pp);
  __syncthreads();
  for (int i = tid; i < nb; i += CTHREADS) cv.tab[(u * CQ + i) * TW + F_DYX] = s.sc[i * FW + F_DYX];
  if (a.d.outproj_norm)
    for (int p = tid; p < cd.Pp; p += CTHREADS) {
      float acc = 0;
      for (int w = 0; w < CWARPS; w++) acc += s.pOn[w * cd.Pp + p];
      cv.pon[u * cd.Pp + p] = acc;
    }
}

/* ---- forward ---------------------------------------------------------------------------------------- */

/* Forward with E in accumulator registers (see carve_r), one CTA per (head, row, part): the rows p0 ..
 * p0 + P / PARTS of the state, i.e. those columns of x and y (PARTS = 2 gives launches of few (head,
 * row) pairs twice the CTAs; each part forms the chunk's whole L o S). Per chunk: S tiles (lower
 * triangle only: the mask zeroes the rest) through a per-warp scratch straight into L o S (bf16); each
 * warp's Y tiles = EC-scaled q E^T plus (L o S) x without leaving the warp; W x in place in sx after
 * Y; E = dec E + (W x)^T ktil in registers, converted to bf16 through the per-warp scratch. */

template <typename T, int PK, int NK, int PARTS>
__global__ void __launch_bounds__(CTHREADS, PARTS == 1 ? 2 : 3) scan_fwd_chunked_r(const m3k_scan_args a) {
  static_assert(PARTS >= 1 && PARTS <= WALK_PARTS_MAX && PK % (16 * PARTS) == 0, "whole 16-row tiles a part");
  extern __shared__ __align__(128) unsigned char smraw[];
  const m3k_dims &d = a.d;
  const int h = grid_x(d.H), b = grid_row(d.H), part = blockIdx.z;
  const int Pf = PK ? PK : d.P, P = Pf / PARTS, N = NK ? NK : d.N, H = d.H, E = d.E, p0 = part * P;
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  const cdims cd = make_cdims(P, N), cf = make_cdims(Pf, N); /* the part's tiles; the kept states' layout */
  csmem s;
  carve_r(smraw, P, N, &s);
  const T *proj = (const T *)a.proj; // [M, dipp]
  T *gated = (T *)a.gated;           // [M, E]
  const int64_t bh = (int64_t)b * H + h, col0 = (int64_t)h * Pf + p0; /* the part's first column of x, y */
  const float Dh = a.D[h];
  float *misc = s.misc;
  float *sY = s.sR; /* [CQ][lfp] */
  acc16 eacc[FR_MAXT];
  const int nch = (a.len + CQ - 1) / CQ;
  const bool vec = act_vec(d);
  cviews cv;
  chunk_views(a.chunk_scratch, a.chunk_states, a.rows, a.len, H, Pf, N, false, &cv);

  /* E_0 = H_in + bp_0 v_in k_in^T (only read where no reset precedes: masks) */
  {
    const float bp0 = __ldg(cv.tab + bh * nch * CQ * TW + F_BP);
#pragma unroll
    for (int j = 0; j < FR_MAXT; j++) acc_zero(eacc[j]);
    for_state_elems(cd, [&](int j, int e, int p, int n) {
      float v = 0;
      if (p < P && n < N) {
        if (a.in_ssm) v = a.in_ssm[(bh * Pf + p0 + p) * N + n];
        if (a.in_v && a.in_k) v += bp0 * a.in_v[bh * Pf + p0 + p] * a.in_k[bh * N + n];
      }
      eacc[j].v[e] = v;
      s.sE[p * cd.lqn + n] = __float2bfloat16_rn(v);
    });
    if (cv.states) state_keep(cv.states + (bh * nch * cf.Pp + p0) * cd.Np, eacc, cd);
  }
  __syncthreads();

  for (int ch = 0; ch < nch; ch++) {
    const int t0 = ch * CQ, nb = min(CQ, a.len - t0);
    const int64_t m0 = (int64_t)b * a.len + t0, u = bh * nch + ch;
    /* 1. loads: the prepared scalars, q, ktil (scan_prep_chunked); x */
    tab_load(cv.tab + u * CQ * TW, s.sc, F_QK + 1, misc);
    tile_load(s.sq, cd.lqn, cv.q + u * CQ * cd.Np, cd.Np);
    tile_load(s.sk, cd.lqn, cv.k + u * CQ * cd.Np, cd.Np);
    x_load<T>(a, s.sx, cd, m0, nb, col0, P, vec);
    cp_wait_all();
    __syncthreads();
    /* 4. L o S, S = q ktil^T, tile by tile through the warp's scratch (tiles above the diagonal: 0) */
    for (int tile = wid; tile < (CQ / 16) * (CQ / 16); tile += CWARPS) {
      const int ti = tile / (CQ / 16), tj = tile % (CQ / 16);
      OT *l1 = s.sL1 + ti * 16 * cd.lqq + tj * 16;
      if (tj > ti) {
        for (int e = lane; e < 256; e += 32) l1[(e >> 4) * cd.lqq + (e & 15)] = __float2bfloat16_rn(0.0f);
        continue;
      }
      acc16 c;
      acc_zero(c);
      mma_tile<true, false>(c, s.sq + (size_t)ti * 16 * cd.lqn, cd.lqn, s.sk + (size_t)tj * 16 * cd.lqn, cd.lqn, cd.Np);
#pragma unroll
      for (int e = 0; e < 8; e++) {
        const int t = ti * 16 + acc_row(e), u = tj * 16 + acc_col(e);
        float v = 0;
        if (t < nb && u < t && u >= (int)s.sc[t * FW + F_SEG])
          v = expf(fminf(s.sc[t * FW + F_C] - s.sc[u * FW + F_C], 0.0f)) * c.v[e];
        l1[acc_row(e) * cd.lqq + acc_col(e)] = __float2bfloat16_rn(v);
      }
    }
    __syncthreads();
    /* 5-6. Y = diag(EC) q E^T + (L o S) x, each output tile within one warp */
    {
      const int tn = cd.Pp / 16, nt = (CQ / 16) * tn;
      for (int tile = wid; tile < nt; tile += CWARPS) {
        const int i0 = tile / tn * 16, j0 = tile % tn * 16;
        acc16 c;
        acc_zero(c);
        mma_tile<true, false>(c, s.sq + (size_t)i0 * cd.lqn, cd.lqn, s.sE + (size_t)j0 * cd.lqn, cd.lqn, cd.Np);
#pragma unroll
        for (int e = 0; e < 8; e++) {
          const int t = i0 + acc_row(e);
          c.v[e] *= t < nb ? s.sc[t * FW + F_EC] : 0.0f;
        }
        mma_tile<true, true>(c, s.sL1 + (size_t)i0 * cd.lqq, cd.lqq, s.sx + j0, cd.lqp, CQ);
        acc_store(sY + (size_t)i0 * cd.lfp + j0, cd.lfp, c);
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
    /* 6'. E <- dec E + (W x)^T ktil in the warps' registers; E -> bf16 (sE), kept for the next chunk */
    {
      state_update(eacc, cd, misc[0], s.sx, cd.lqp, s.sk, cd.lqn);
      for_state_elems(cd, [&](int j, int e, int p, int n) {
        s.sE[p * cd.lqn + n] = __float2bfloat16_rn(eacc[j].v[e]);
      });
      if (cv.states && ch + 1 < nch) state_keep(cv.states + ((u + 1) * cf.Pp + p0) * cd.Np, eacc, cd);
    }
    /* 7. epilogue (as scan.cu): y = Y + (gamma q.k + D) x; the per-head norm; the gate. vec: eight
     * columns per item, and without the norm the gate in the same pass */
    if (vec) {
      const int vpr = P / 8;
      for (int idx = tid; idx < nb * vpr; idx += CTHREADS) {
        const int i = idx / vpr, p = (idx - i * vpr) * 8;
        const int64_t mi = m0 + i;
        const T *pr = proj + mi * d.dipp + col0 + p;
        float xv[8], zv[8], y[8];
        ld8(pr + d.x_off, xv);
        if (!d.outproj_norm) ld8(pr + d.z_off, zv);
        const float dg = s.sc[i * FW + F_GAM] * s.sc[i * FW + F_QK] + Dh;
        float *yr = sY + i * cd.lfp + p;
#pragma unroll
        for (int k = 0; k < 8; k++) y[k] = yr[k] + dg * xv[k];
        st8((T *)a.y + mi * E + col0 + p, y);
        if (d.outproj_norm) {
#pragma unroll
          for (int k = 0; k < 8; k++) yr[k] = y[k];
        } else {
#pragma unroll
          for (int k = 0; k < 8; k++) y[k] *= zv[k] * sigmoidf_(zv[k]);
          st8(gated + mi * E + col0 + p, y);
        }
      }
    } else {
#pragma unroll 4
      for (int idx = tid; idx < nb * P; idx += CTHREADS) {
        const int i = idx / P, p = idx - i * P;
        const int64_t mi = m0 + i;
        const float xv = ldact(proj + mi * d.dipp + d.x_off + col0 + p);
        const float y = sY[i * cd.lfp + p] + (s.sc[i * FW + F_GAM] * s.sc[i * FW + F_QK] + Dh) * xv;
        sY[i * cd.lfp + p] = y;
        ((T *)a.y)[mi * E + col0 + p] = from_f<T>(y);
      }
    }
    if (d.outproj_norm) {
      __syncthreads();
      for (int i = wid; i < nb; i += CWARPS) {
        float ss = 0;
        for (int p = lane; p < P; p += 32) ss += sY[i * cd.lfp + p] * sY[i * cd.lfp + p];
        ss = warp_sum(ss);
        const float rn = rms_inv(ss, P);
        if (lane == 0) {
          s.sc[i * FW + F_R] = rn;
          a.y_rstd[(m0 + i) * H + h] = rn;
        }
      }
    }
    if (d.outproj_norm || !vec) {
      __syncthreads();
#pragma unroll 4
      for (int idx = tid; idx < nb * P; idx += CTHREADS) {
        const int i = idx / P, p = idx - i * P;
        const int64_t mi = m0 + i;
        const float z = ldact(proj + mi * d.dipp + d.z_off + col0 + p);
        const float y = sY[i * cd.lfp + p];
        gated[mi * E + col0 + p] = from_f<T>(gate_value(a, h, p0 + p, y, s.sc[i * FW + F_R], z));
      }
    }
    __syncthreads();
  }

  if (a.fin_ssm)
    for_state_elems(cd, [&](int j, int e, int p, int n) {
      if (p < P && n < N) a.fin_ssm[(bh * Pf + p0 + p) * N + n] = eacc[j].v[e];
    });
  if (a.fin_k && part == 0) /* after E_0 read in_k (a split launch never has fin_k at in_k: fwd_launch);
                               fin_angle: scan_angles_chunked */
    for (int n = tid; n < N; n += CTHREADS) a.fin_k[bh * N + n] = cv.kl[bh * N + n];
  if (a.fin_v)
    for (int p = tid; p < P; p += CTHREADS)
      a.fin_v[bh * Pf + p0 + p] = to_f(proj[((int64_t)b * a.len + a.len - 1) * d.dipp + d.x_off + col0 + p]);
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

/* The reverse walk of dE alone, one CTA per (head, row, part): the rows p0 .. p0 + P / PARTS of the
 * state (the rows are independent: PARTS = 2 gives launches of few (head, row) pairs twice the CTAs).
 * Per chunk (last first) dE leaving it goes to the scratch (bf16), then dE <- dec dE + (EC dY)^T q in
 * the warps' accumulator registers (the forward walk's tiles); q and dY of the next chunk load
 * meanwhile. At the end dbp_0 = v_in^T dE_0 k_in (T_DBP0 of row `part` of the row's first
 * unit; its beta term, dropped at a reset by the post kernel). */
template <typename T, int PK, int NK, int PARTS>
__global__ void __launch_bounds__(CTHREADS, PARTS == 1 ? 2 : 3) scan_dstate_chunked(const m3k_scan_args a) {
  static_assert(PARTS >= 1 && PARTS <= WALK_PARTS_MAX && PK % (16 * PARTS) == 0, "whole 16-row tiles a part");
  extern __shared__ __align__(128) unsigned char smraw[];
  const m3k_dims &d = a.d;
  const int h = grid_x(d.H), b = grid_row(d.H), part = blockIdx.z;
  const int Pf = PK ? PK : d.P, P = Pf / PARTS, N = NK ? NK : d.N, H = d.H, p0 = part * P;
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  const cdims cd = make_cdims(P, N), cf = make_cdims(Pf, N); /* the part's tiles; the scratch's layout */
  csmem s;
  carve_d(smraw, P, N, &s);
  const int64_t bh = (int64_t)b * H + h;
  const int nch = (a.len + CQ - 1) / CQ;
  cviews cv;
  chunk_views(a.chunk_scratch, a.chunk_states, a.rows, a.len, H, Pf, N, true, &cv);
  acc16 eacc[FR_MAXT];
#pragma unroll
  for (int j = 0; j < FR_MAXT; j++) acc_zero(eacc[j]); /* nothing flows from the final state */
  const auto load = [&](int ch, int buf) {
    const int64_t u = bh * nch + ch;
    tab_load(cv.tab + u * CQ * TW, s.sc + buf * (CQ + 1) * FW, F_EC + 1, s.misc + buf);
    tile_load(s.sq + buf * CQ * cd.lqn, cd.lqn, cv.q + u * CQ * cd.Np, cd.Np);
    tile_load(s.sxw + buf * CQ * cd.lqp, cd.lqp, cv.dy + u * CQ * cf.Pp + p0, cd.Pp, CQ, cf.Pp);
    cp_commit();
  };
  load(nch - 1, 0);
  for (int ch = nch - 1, buf = 0; ch >= 0; ch--, buf ^= 1) {
    const int nb = min(CQ, a.len - ch * CQ);
    const int64_t u = bh * nch + ch;
    const float *sc = s.sc + buf * (CQ + 1) * FW;
    OT *sq = s.sq + buf * CQ * cd.lqn, *sy = s.sxw + buf * CQ * cd.lqp;
    if (ch > 0) {
      load(ch - 1, buf ^ 1);
      cp_wait_prev();
    } else {
      cp_wait_all();
    }
    __syncthreads();
    /* dE leaving the chunk -> scratch (bf16) */
    state_keep(cv.de + (u * cf.Pp + p0) * cd.Np, eacc, cd);
    /* EC dY in place */
    for (int idx = tid; idx < CQ * cd.Pp; idx += CTHREADS) {
      const int i = idx / cd.Pp, p = idx - i * cd.Pp;
      const float ec = i < nb ? sc[i * FW + F_EC] : 0.0f;
      sy[i * cd.lqp + p] = __float2bfloat16_rn(ec * __bfloat162float(sy[i * cd.lqp + p]));
    }
    __syncthreads();
    /* dE <- dec dE + (EC dY)^T q */
    state_update(eacc, cd, s.misc[buf], sy, cd.lqp, sq, cd.lqn);
    __syncthreads();
  }

  /* the window's first token: v_in^T dE_0 k_in */
  float share = 0;
  if (a.in_v && a.in_k)
    for_state_elems(cd, [&](int j, int e, int p, int n) {
      if (p < P && n < N) share += a.in_v[bh * Pf + p0 + p] * eacc[j].v[e] * a.in_k[bh * N + n];
    });
  share = warp_sum(share);
  if (lane == 0) s.red[wid] = share;
  __syncthreads();
  if (tid == 0) {
    float dbp = 0;
    for (int w = 0; w < CWARPS; w++) dbp += s.red[w];
    cv.tab[(bh * nch * CQ + part) * TW + T_DBP0] = dbp;
  }
}

/* A dE walk result's parts in order (the table's rows 0 .. WALK_PARTS_MAX - 1 of field f; rows a walk of
 * fewer parts did not write hold the preparation's zero). */
__device__ __forceinline__ float walk_parts_sum(const float *tab, int f) {
  float v = tab[f];
#pragma unroll
  for (int r = 1; r < WALK_PARTS_MAX; r++) v += tab[r * TW + f];
  return v;
}

/* One [CQ][N] result of the per-chunk backward (raw dq or dktil), a [CQ][KB] column block at a time in
 * the warps' accumulator tiles: F = A1 B1 (A1 [CQ][Pp], row stride lqp; B1 [Pp][Np], lqn); per row i,
 * with c = sc[i][fc] (0 past nb), sc[i][fo] = c (F_i . X_i) over all columns (X [CQ][Np], lqn; the
 * tiles' partials through part, summed in column order) and F_i <- c F_i; then F += L2' B2 (L2
 * [CQ][CQ], lqq, transposed unless L2_ROW; B2 [CQ][Np], lqn); rows < nb straight to dst ([CQ][Np] bf16,
 * padding columns included). Every thread has read A1, B1, X, L2 and B2 when it returns. */
template <bool L2_ROW>
__device__ __forceinline__ void kgrad_regs(const cdims &cd, const OT *A1, const OT *B1, const OT *X, float *sc,
                                           int nb, int fc, int fo, const OT *L2, const OT *B2, OT *dst,
                                           float *part) {
  const int lane = threadIdx.x & 31;
  float dot = 0; /* thread i < CQ: row i's F . X so far */
  for (int c0 = 0; c0 < cd.Np; c0 += KB) {
    const int tn = min(KB, cd.Np - c0) / 16;
    acc16 c[BMM_ILP];
#pragma unroll
    for (int j = 0; j < BMM_ILP; j++) acc_zero(c[j]);
    bmm_regs<true, true>(c, A1, cd.lqp, B1 + c0, cd.lqn, tn, cd.Pp);
#pragma unroll
    for (int j = 0; j < BMM_ILP; j++) {
      int i0, j0;
      if (!reg_tile(j, tn, i0, j0)) break;
      const int r0 = i0 + lane / 4;
      float d[2] = {0.0f, 0.0f};
#pragma unroll
      for (int e = 0; e < 8; e++)
        d[(e >> 1) & 1] += c[j].v[e] * __bfloat162float(X[(i0 + acc_row(e)) * cd.lqn + c0 + j0 + acc_col(e)]);
#pragma unroll
      for (int hi = 0; hi < 2; hi++) {
        d[hi] += __shfl_xor_sync(0xffffffffu, d[hi], 1);
        d[hi] += __shfl_xor_sync(0xffffffffu, d[hi], 2);
      }
      if ((lane & 3) == 0) {
        part[r0 * (KB / 16) + j0 / 16] = d[0];
        part[(r0 + 8) * (KB / 16) + j0 / 16] = d[1];
      }
    }
    scale_reg_rows(c, tn, sc, fc, nb);
    bmm_regs<L2_ROW, true>(c, L2, cd.lqq, B2 + c0, cd.lqn, tn, CQ);
    for_reg_pairs(tn, c0, [&](int j, int e, int i, int n) {
      const float v[2] = {c[j].v[e], c[j].v[e + 1]};
      if (i < nb) st_v<2>(dst + i * cd.Np + n, v);
    });
    __syncthreads();
    if (threadIdx.x < CQ)
      for (int k = 0; k < tn; k++) dot += part[threadIdx.x * (KB / 16) + k];
    if (c0 + KB < cd.Np) __syncthreads(); /* the next block writes part */
  }
  if (threadIdx.x < nb) sc[threadIdx.x * FW + fo] = sc[threadIdx.x * FW + fc] * dot;
}

/* One CTA per (chunk, head, row), after scan_dstate_chunked: the chunk's products with dE leaving it
 * (the scratch) and the state entering it (a.chunk_states), both bf16, loaded with the other operands
 * (or, where shared memory is short, into one space: E until dq is done, then dE), and their dot <dE, E>
 * for the decay gradient (here rather than in the dE walk, which then loads no states: lm130 walk
 * 156 -> 126 us, this kernel 413 -> 427, NOTES.md run 246); the float32 products
 * in the warps' accumulator tiles, [CQ][KB] column blocks at a time, stored from there (kgrad_regs and
 * step 8). MINB = 2 (128 registers) for shapes whose shared memory lets two CTAs share an SM
 * (bwd_two_ctas). */
template <typename T, int MINB, int PK, int NK>
__global__ void __launch_bounds__(CTHREADS, MINB) scan_bwd_chunked(const m3k_scan_args a) {
  extern __shared__ __align__(128) unsigned char smraw[];
  const m3k_dims &d = a.d;
  const int nch = (a.len + CQ - 1) / CQ, ch = grid_x(nch * d.H) % nch, h = grid_x(nch * d.H) / nch;
  const int b = grid_row(nch * d.H);
  const int P = PK ? PK : d.P, N = NK ? NK : d.N, H = d.H;
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  const cdims cd = make_cdims(P, N);
  csmem s;
  carve_c(smraw, P, N, &s);
  T *dproj = (T *)a.dproj;           // [M, dipp]
  const int64_t bh = (int64_t)b * H + h;
  const float Dh = a.D[h];
  float *misc = s.misc;
  const bool vec = act_vec(d);
  cviews cv;
  chunk_views(a.chunk_scratch, a.chunk_states, a.rows, a.len, H, P, N, true, &cv);
  const int t0 = ch * CQ, nb = min(CQ, a.len - t0);
  const int64_t m0 = (int64_t)b * a.len + t0;
  const int64_t u = bh * nch + ch;
  /* 1. loads: the prepared scalars, q, ktil, dY (scan_prep_chunked); x; E (bf16, as the forward kept
   * it) */
  tab_load(cv.tab + u * CQ * TW, s.sc, TAB_FIELDS, misc);
  tile_load(s.sq, cd.lqn, cv.q + u * CQ * cd.Np, cd.Np);
  tile_load(s.sk, cd.lqn, cv.k + u * CQ * cd.Np, cd.Np);
  tile_load(s.sxw, cd.lqp, cv.dy + u * CQ * cd.Pp, cd.Pp);
  tile_load(s.sE, cd.lqn, cv.states + u * cd.Pp * cd.Np, cd.Np, cd.Pp);
  const bool own_de = s.sdE != s.sE;
  if (own_de) tile_load(s.sdE, cd.lqn, cv.de + u * cd.Pp * cd.Np, cd.Np, cd.Pp);
  x_load<T>(a, s.sx, cd, m0, nb, (int64_t)h * P, P, vec);
  cp_wait_all();
  __syncthreads();
  /* 4-5. S1 = q ktil^T, S2 = dY x^T tile by tile in the warp's registers (tiles above the diagonal: 0):
   * L1 = L o S1, L2 = L o S2 (bf16); M = L o S1 o S2 (u < t) summed per tile row and column */
  {
    float *rowp = s.sR, *colp = rowp + CQ * (CQ / 16); /* [CQ][CQ / 16] */
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
      acc16 c1, c2;
      acc_zero(c1);
      acc_zero(c2);
      mma_tile<true, false>(c1, s.sq + (size_t)ti * 16 * cd.lqn, cd.lqn, s.sk + (size_t)tj * 16 * cd.lqn, cd.lqn, cd.Np);
      mma_tile<true, false>(c2, s.sxw + (size_t)ti * 16 * cd.lqp, cd.lqp, s.sx + (size_t)tj * 16 * cd.lqp, cd.lqp, cd.Pp);
      float m[8];
#pragma unroll
      for (int e = 0; e < 8; e++) {
        const int t = ti * 16 + acc_row(e), u = tj * 16 + acc_col(e);
        float l = 0;
        if (t < nb && u < t && u >= (int)s.sc[t * FW + F_SEG])
          l = expf(fminf(s.sc[t * FW + F_C] - s.sc[u * FW + F_C], 0.0f));
        const float v1 = l * c1.v[e], v2 = l * c2.v[e];
        l1[acc_row(e) * cd.lqq + acc_col(e)] = __float2bfloat16_rn(v1);
        l2[acc_row(e) * cd.lqq + acc_col(e)] = __float2bfloat16_rn(v2);
        m[e] = u < t ? v1 * c2.v[e] : 0.0f;
      }
      /* the tile's row sums (rows lane / 4, + 8: over the 4 lanes of a row) and column sums
       * (columns 2 (lane % 4) + q, + 8: over the 8 lanes of a column), fixed shuffle trees */
      float r0 = m[0] + m[1] + m[4] + m[5], r1 = m[2] + m[3] + m[6] + m[7];
      float cs[4] = {m[0] + m[2], m[1] + m[3], m[4] + m[6], m[5] + m[7]};
#pragma unroll
      for (int o = 1; o < 4; o <<= 1) {
        r0 += __shfl_xor_sync(0xffffffffu, r0, o);
        r1 += __shfl_xor_sync(0xffffffffu, r1, o);
      }
#pragma unroll
      for (int o = 4; o < 32; o <<= 1)
#pragma unroll
        for (int k = 0; k < 4; k++) cs[k] += __shfl_xor_sync(0xffffffffu, cs[k], o);
      if ((lane & 3) == 0) {
        rowp[(ti * 16 + lane / 4) * (CQ / 16) + tj] = r0;
        rowp[(ti * 16 + lane / 4 + 8) * (CQ / 16) + tj] = r1;
      }
      if (lane < 4)
#pragma unroll
        for (int k = 0; k < 4; k++) colp[(tj * 16 + 8 * (k >> 1) + 2 * lane + (k & 1)) * (CQ / 16) + ti] = cs[k];
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
  /* 6. dq = EC (dY E) + L2 ktil (+ diagonal); r_t. The raw dq and dktil replace q and ktil in
   * a.chunk_states (read into shared memory above; nothing reads them after this kernel) */
  OT *dq = cv.q + u * CQ * cd.Np, *dk = cv.k + u * CQ * cd.Np;
  kgrad_regs<true>(cd, s.sxw, s.sE, s.sq, s.sc, nb, F_EC, F_R, s.sL2, s.sk, dq, s.sR); /* dq (raw) */
  /* dE (bf16) where E was, unless it loaded above (dq, E's last reader, ended with a barrier) */
  if (!own_de) {
    tile_load(s.sdE, cd.lqn, cv.de + u * cd.Pp * cd.Np, cd.Np, cd.Pp);
    cp_wait_all();
  }
  __syncthreads(); /* kgrad_regs' partials (sR) read */
  /* <dE, E> (both bf16; E from the kept states where dE took its space): each thread's groups of eight in
   * order, the warps' sums in red (added in order by step 9) */
  {
    const OT *E = own_de ? s.sE : cv.states + u * cd.Pp * cd.Np;
    const int ld = own_de ? cd.lqn : cd.Np, vpr = cd.Np / 8;
    float dot = 0;
    for (int idx = tid; idx < cd.Pp * vpr; idx += CTHREADS) {
      const int p = idx / vpr, n = 8 * (idx - p * vpr);
      const uint4 dv = *(const uint4 *)(s.sdE + p * cd.lqn + n), ev = *(const uint4 *)(E + p * ld + n);
      const __nv_bfloat162 *de = (const __nv_bfloat162 *)&dv, *e = (const __nv_bfloat162 *)&ev;
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const float2 a2 = __bfloat1622float2(de[k]), b2 = __bfloat1622float2(e[k]);
        dot = __fmaf_rn(a2.y, b2.y, __fmaf_rn(a2.x, b2.x, dot));
      }
    }
    dot = warp_sum(dot);
    if (lane == 0) s.red[wid] = dot;
  }
  /* 7. dktil = W (x dE) + L2^T q; v_s */
  kgrad_regs<false>(cd, s.sx, s.sdE, s.sk, s.sc, nb, F_W, F_V, s.sL2, s.sq, dk, s.sR); /* dktil (raw) */
  /* 8. dx = W (ktil dE^T) + L1^T dY (+ diagonal, D), [CQ][KB] column blocks in the warps' accumulator
   * tiles, straight to dproj (two columns an access where every offset is even) */
  {
    const bool pairs = ((P | d.dipp | d.x_off) & 1) == 0;
    for (int c0 = 0; c0 < cd.Pp; c0 += KB) {
      const int tn = min(KB, cd.Pp - c0) / 16;
      acc16 c[BMM_ILP];
#pragma unroll
      for (int j = 0; j < BMM_ILP; j++) acc_zero(c[j]);
      bmm_regs<true, false>(c, s.sk, cd.lqn, s.sdE + (size_t)c0 * cd.lqn, cd.lqn, tn, cd.Np);
      scale_reg_rows(c, tn, s.sc, F_W, nb);
      bmm_regs<false, true>(c, s.sL1, cd.lqq, s.sxw + c0, cd.lqp, tn, CQ);
      for_reg_pairs(tn, c0, [&](int j, int e, int i, int p) {
        if (i >= nb || p >= P) return;
        const int64_t mi = m0 + i;
        const float dg = s.sc[i * FW + F_GAM] * s.sc[i * FW + F_QK] + Dh;
        const float2 dy = __bfloat1622float2(*(const __nv_bfloat162 *)(s.sxw + i * cd.lqp + p));
        const float dx[2] = {c[j].v[e] + dg * dy.x, c[j].v[e + 1] + dg * dy.y};
        T *dxp = dproj + mi * d.dipp + d.x_off + (int64_t)h * P + p;
        if (pairs) {
          st_v<2>(dxp, dx);
        } else {
          dxp[0] = from_f<T>(dx[0]);
          if (p + 1 < P) dxp[1] = from_f<T>(dx[1]);
        }
      });
    }
  }
  __syncthreads(); /* the rows' v_s (F_V) are read by warp 0 below */
  /* 9. decay gradient (warp 0): da into the table (scan_post_seq_chunked finishes the scalars) */
  if (wid == 0) { /* two tokens per lane; sums and the suffix scan by shuffles (fixed order) */
    float dEE = 0;
#pragma unroll
    for (int w = 0; w < CWARPS; w++) dEE += s.red[w];
    const int j0 = 2 * lane, j1 = j0 + 1;
    const float v0 = j0 < nb ? s.sc[j0 * FW + F_V] : 0.0f, v1 = j1 < nb ? s.sc[j1 * FW + F_V] : 0.0f;
    const float sumv = warp_sum(v0 + v1);
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
    float *tab = cv.tab + u * CQ * TW;
    if (j1 < nb) tab[j1 * TW + T_DA] = s.sc[j1 * FW + F_RST] != 0 ? 0.0f : ex + dc[1];
    if (j0 < nb) tab[j0 * TW + T_DA] = s.sc[j0 * FW + F_RST] != 0 ? 0.0f : ex + dc[1] + dc[0];
  }
}

/* ---- after the backward walk: the per-token finish, in parallel, then along the sequence ------------------ */


/* Four values to columns c0 .. c0 + 3 of a float row (p: the row at c0), those below N only: with ADD added
 * to what is there (the group's running sums), else written; one 16-byte access where N % 4 == 0. */
template <bool ADD> __device__ __forceinline__ void put_group(float *p, const float (&v)[4], int c0, int N) {
  if (N % 4 == 0) {
    if (c0 >= N) return;
    float4 o = make_float4(v[0], v[1], v[2], v[3]);
    if (ADD) {
      const float4 w = *(const float4 *)p;
      o = make_float4(w.x + v[0], w.y + v[1], w.z + v[2], w.w + v[3]);
    }
    *(float4 *)p = o;
    return;
  }
#pragma unroll
  for (int e = 0; e < 4; e++)
    if (c0 + e < N) p[e] = ADD ? p[e] + v[e] : v[e];
}

/* One CTA per (chunk, head, row), the tokens in c_build's layout (groups of four columns on LPT lanes):
 * from the per-chunk kernel's raw dq and dktil (bf16, in a.chunk_states where q and ktil were): the
 * diagonal term, dscale = dktil.k, dk = scale dktil + gamma (dY.x) q, the rotation backward of both, the
 * angle gradient shares (a.dthq), dscale and dgamma (table), and the chunk's B_bias / C_bias partials
 * (pbc). dk, dq go to dbc_head, or with SUM one CTA per (chunk, group, row) walks the group's heads in
 * order and writes only their sums (a.dbc_group, in the order and rounding of bcnorm_bwd's sum over
 * dbc_head), which saves writing and reading back the per-head values. */
template <typename T, int GPL, int PK, int NK, bool SUM>
__global__ void __launch_bounds__(CTHREADS, SUM || GPL == 2 ? 2 : 3) scan_post_chunked(const m3k_scan_args a) {
  extern __shared__ __align__(128) unsigned char smraw[];
  const m3k_dims &d = a.d;
  const int nch = (a.len + CQ - 1) / CQ, Y = SUM ? d.G : d.H, ch = grid_x(nch * Y) % nch, y = grid_x(nch * Y) / nch;
  const int b = grid_row(nch * Y), g = SUM ? y : y / d.hpg;
  const int h0 = SUM ? g * d.hpg : y, nh = SUM ? d.hpg : 1;
  const int P = PK ? PK : d.P, N = NK ? NK : d.N, S = d.S, H = d.H, GN = d.G * N, Np = make_cdims(P, N).Np;
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  const int LPT = group_lanes(Np), TPW = 32 / LPT, slot = lane / LPT, per_round = CWARPS * TPW;
  csmem s;
  carve_q(smraw, N, SUM, &s);
  cviews cv;
  chunk_views(a.chunk_scratch, a.chunk_states, a.rows, a.len, H, P, N, true, &cv);
  const int t0 = ch * CQ, nb = min(CQ, a.len - t0);
  const int64_t m0 = (int64_t)b * a.len + t0;
  const auto tab_of = [&](int h) { return cv.tab + (((int64_t)b * H + h) * nch + ch) * CQ * TW; };
  const auto sc_of = [&](int k) { return s.sc + (k & 1) * (CQ + 1) * FW; };
  if (SUM)
    for (int c = tid; c < CQ * 2 * N; c += CTHREADS) s.gsum[c] = 0;
  tab_load(tab_of(h0), sc_of(0), TAB_FIELDS, s.misc);
  cp_commit();
  int c0[GPL];
  group_cols(LPT, c0);
  float *pw = s.pbw + wid * 2 * N; /* the warp's B_bias | C_bias partials */
  for (int k = 0; k < nh; k++) {
    const int h = h0 + k;
    const int64_t u = ((int64_t)b * H + h) * nch + ch;
    float *tab = tab_of(h);
    const float *sc = sc_of(k);
    if (k + 1 < nh) { /* the next head's table into the other buffer (its last reader passed the barrier) */
      tab_load(tab_of(h + 1), sc_of(k + 1), TAB_FIELDS, s.misc);
      cp_commit();
      cp_wait_prev();
    } else {
      cp_wait_all();
    }
    float4 bk[GPL], bq[GPL];
    group_biases(a, h, c0, bk, bq);
    /* the lane's column partials of dk and dq, its slot's tokens in order */
    float pk[GPL][4] = {}, pq[GPL][4] = {};
    __syncthreads();
    /* token i's inputs: B_hat / C_hat and angles (r), the raw dq, dktil (four bf16 a group) */
    struct tok_in {
      group_raw<GPL> r;
      uint2 q[GPL], k[GPL];
    };
    const auto load = [&](int i, tok_in &in) {
      if (i >= nb) return;
      group_load(a.bc_hat + ((m0 + i) * 2 * d.G + g) * N, GN, a.theta + ((m0 + i) * H + h) * S, S, c0, N, in.r);
      const OT *fq = cv.q + (u * CQ + i) * Np, *fk = cv.k + (u * CQ + i) * Np;
#pragma unroll
      for (int r = 0; r < GPL; r++)
        if (c0[r] < N) {
          in.q[r] = *(const uint2 *)(fq + c0[r]);
          in.k[r] = *(const uint2 *)(fk + c0[r]);
        }
    };
    tok_in cur = {}, nxt = {};
    load(wid * TPW + slot, cur);
    const int rounds_end = (nb + per_round - 1) / per_round * per_round; /* the rounds with live tokens */
    for (int i = wid * TPW + slot; i < rounds_end; i += per_round) { /* every lane the same rounds: the shuffles */
      nxt = tok_in{};
      load(i + per_round, nxt);
      const bool live = i < nb;
      float ds = 0;
      if (live) {
        const int64_t mi = m0 + i;
        float *ok = SUM ? s.gsum + i * 2 * N : a.dbc_head + (mi * H + h) * 2 * N, *oq = ok + N;
        const float scale = sc[i * FW + F_SCALE], gd = sc[i * FW + F_GAM] * sc[i * FW + F_DYX];
#pragma unroll
        for (int r = 0; r < GPL; r++) {
          if (c0[r] >= N) continue;
          float kr[4], qr[4], cs[2], sn[2], fq[4], fk[4], oqv[4], okv[4];
          group_rotated(cur.r, bk[r], bq[r], r, c0[r], S, kr, qr, cs, sn);
          const __nv_bfloat162 *rq = (const __nv_bfloat162 *)&cur.q[r], *rk = (const __nv_bfloat162 *)&cur.k[r];
#pragma unroll
          for (int e = 0; e < 2; e++) {
            const float2 vq = __bfloat1622float2(rq[e]), vk = __bfloat1622float2(rk[e]);
            fq[2 * e] = vq.x, fq[2 * e + 1] = vq.y, fk[2 * e] = vk.x, fk[2 * e + 1] = vk.y;
          }
#pragma unroll
          for (int e = 0; e < 2; e++) {
            const int j = 2 * e, p = c0[r] / 2 + e;
            if (p < S) { /* fused multiply-adds spelled out (dot2): both variants round alike */
              const float q0 = __fmaf_rn(gd, kr[j], fq[j]), q1 = __fmaf_rn(gd, kr[j + 1], fq[j + 1]);
              const float e0 = fk[j], e1 = fk[j + 1];
              ds += dot2(e0, kr[j], e1, kr[j + 1]);
              const float k0 = dot2(scale, e0, gd, qr[j]), k1 = dot2(scale, e1, gd, qr[j + 1]);
              oqv[j] = dot2(cs[e], q0, sn[e], q1);
              oqv[j + 1] = dot2(-sn[e], q0, cs[e], q1);
              okv[j] = dot2(cs[e], k0, sn[e], k1);
              okv[j + 1] = dot2(-sn[e], k0, cs[e], k1);
              a.dthq[(mi * H + h) * S + p] = dot2(-q0, qr[j + 1], q1, qr[j]) + dot2(-k0, kr[j + 1], k1, kr[j]);
            } else {
#pragma unroll
              for (int c = j; c < j + 2; c++) {
                oqv[c] = __fmaf_rn(gd, kr[c], fq[c]);
                ds = __fmaf_rn(fk[c], kr[c], ds);
                okv[c] = dot2(scale, fk[c], gd, qr[c]);
              }
            }
          }
          put_group<SUM>(ok + c0[r], okv, c0[r], N);
          put_group<SUM>(oq + c0[r], oqv, c0[r], N);
#pragma unroll
          for (int e = 0; e < 4; e++) {
            pk[r][e] += okv[e];
            pq[r][e] += oqv[e];
          }
        }
      }
      for (int o = LPT / 2; o > 0; o >>= 1) ds += __shfl_xor_sync(0xffffffffu, ds, o);
      if (live && lane % LPT == 0) {
        tab[i * TW + T_DSCALE] = ds;
        tab[i * TW + T_DGAM] = __fmaf_rn(sc[i * FW + F_DYX], sc[i * FW + F_QK], ds);
      }
      cur = nxt;
    }
    /* the slots' partials summed (the same butterfly on every lane of a column), into the warp's row */
#pragma unroll
    for (int r = 0; r < GPL; r++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        for (int o = LPT; o < 32; o <<= 1) {
          pk[r][e] += __shfl_xor_sync(0xffffffffu, pk[r][e], o);
          pq[r][e] += __shfl_xor_sync(0xffffffffu, pq[r][e], o);
        }
        if (slot == 0 && c0[r] + e < N) {
          pw[c0[r] + e] = pk[r][e];
          pw[N + c0[r] + e] = pq[r][e];
        }
      }
    __syncthreads();
    for (int c = tid; c < 2 * N; c += CTHREADS) { /* c < N: B_bias, else C_bias; the warps in order */
      float acc = 0;
      for (int w = 0; w < CWARPS; w++) acc += s.pbw[w * 2 * N + c];
      cv.pbc[u * 2 * N + c] = acc;
    }
  }
  if (SUM && m3k_chunked_norms_bc(&a)) { /* the sums through the B/C norm backward: a warp per (token, B|C) */
    for (int it = wid; it < 2 * nb; it += CWARPS) {
      const int i = it >> 1, which = it & 1;
      const int64_t m = m0 + i, col = m * d.dipp + (which ? d.C_off : d.B_off);
      float ds[BC_MAX_PER_LANE], wc[BC_MAX_PER_LANE];
#pragma unroll
      for (int k = 0; k < BC_MAX_PER_LANE; k++) {
        const int n = lane + 32 * k;
        ds[k] = n < N ? s.gsum[i * 2 * N + which * N + n] : 0.0f;
        wc[k] = 0;
      }
      bcnorm_bwd_row((const T *)a.proj + col, which ? a.C_norm : a.B_norm, a.bc_rstd[m * 2 + which], ds, N,
                     (T *)a.dproj + col, wc);
      bcnorm_store_wc(a.wcontrib + (m * 2 + which) * N, wc, N);
    }
  } else if (SUM) { /* the group's sums (the last head's barrier published them) */
    float *out = a.dbc_group + (m0 * d.G + g) * 2 * N;
    for (int i = wid; i < nb; i += CWARPS)
      for (int c = lane; c < 2 * N; c += 32) out[(int64_t)i * d.G * 2 * N + c] = s.gsum[i * 2 * N + c];
  }
}

/* One CTA per (head, row), the chunks in reverse: the angle gradient (reverse cumulative sum per pair,
 * stopped at resets: dang_head, dtang; a two-level walk as scan_angles_chunked's: the block's segments
 * summed from their ends in place, the carries across the segments, then every token's sum), then per
 * token the scalar chain to dd_dt, dd_A, trap (dbp of a token = dscale of the token before it,
 * v_in^T dE_0 k_in for the first, 0 at a reset), and the per-(row, head) partials: dt_bias, D, B_bias,
 * C_bias (part), the mixer norm weight (part_norm). */
template <typename T>
__global__ void __launch_bounds__(CTHREADS) scan_post_seq_chunked(const m3k_scan_args a) {
  extern __shared__ __align__(128) unsigned char smraw[];
  const m3k_dims &d = a.d;
  const int h = grid_x(d.H), b = grid_row(d.H);
  const int P = d.P, N = d.N, S = d.S, H = d.H, tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  const cdims cd = make_cdims(P, N);
  const T *proj = (const T *)a.proj;
  csmem s;
  const int TB = seq_block(S);
  carve_post(smraw, S, TB, &s);
  const int G = walk_segs(S), seg_len = (TB + G - 1) / G, wj = S > 0 ? tid % S : 0, wg = S > 0 ? tid / S : G;
  cviews cv;
  chunk_views(a.chunk_scratch, a.chunk_states, a.rows, a.len, H, P, N, true, &cv);
  const int nch = (a.len + CQ - 1) / CQ;
  const int64_t bh = (int64_t)b * H + h;
  const float *tab_row = cv.tab + bh * nch * CQ * TW; /* token t of the row: tab_row + t TW (full chunks) */
  float *st = s.sc; /* [TB][TW] */
  float D = 0, pd = 0, sdyx = 0;
  for (int t0 = (a.len - 1) / TB * TB; t0 >= 0; t0 -= TB) {
    const int nb = min(TB, a.len - t0);
    const int64_t m0 = (int64_t)b * a.len + t0;
    const float *tab = tab_row + (int64_t)t0 * TW;
    for (int idx = tid; idx < nb * (TW / 4); idx += CTHREADS) cp16(st + idx * 4, tab + idx * 4);
    if (angles_vec8(d)) { /* the block's angle shares by cp.async; the logits SEQ_LOADS items a thread at once */
      const int S8 = S / 8;
      for (int idx = tid; idx < nb * S8; idx += CTHREADS) {
        const int i = idx / S8, j0 = (idx - i * S8) * 8;
        const float *dq = a.dthq + ((m0 + i) * H + h) * S + j0;
        cp16(s.dth + i * S + j0, dq);
        cp16(s.dth + i * S + j0 + 4, dq + 4);
      }
      for (int idx0 = tid; idx0 < nb * S8; idx0 += SEQ_LOADS * CTHREADS) {
        uint4 raw[SEQ_LOADS];
#pragma unroll
        for (int k = 0; k < SEQ_LOADS; k++) {
          const int idx = idx0 + k * CTHREADS, i = idx / S8, j0 = (idx - i * S8) * 8;
          if (idx < nb * S8) raw[k] = __ldg((const uint4 *)(proj + (m0 + i) * d.dipp + d.ang_off + j0));
        }
#pragma unroll
        for (int k = 0; k < SEQ_LOADS; k++) {
          const int idx = idx0 + k * CTHREADS, i = idx / S8, j0 = (idx - i * S8) * 8;
          if (idx >= nb * S8) break;
          tanh8<T>(raw[k], s.th + i * S + j0);
        }
      }
    } else {
#pragma unroll 8
      for (int idx = tid; idx < nb * S; idx += CTHREADS) {
        const int i = idx / S, jj = idx - i * S;
        s.th[idx] = angle_tanh(proj, d, m0 + i, jj);
        s.dth[idx] = __ldg(a.dthq + ((m0 + i) * H + h) * S + jj);
      }
    }
    cp_wait_all();
    __syncthreads();
    /* D_i = dth_i + (no reset at i + 1 ? D_{i + 1} : 0): thread (pair wj, segment wg) sums its segment from
     * its end (as if nothing came from later tokens), in place */
    const int nseg = (nb + seg_len - 1) / seg_len, i0 = wg * seg_len, i1 = min(i0 + seg_len, nb);
    if (wg < nseg) {
      float v = 0;
      int cut = -1;
      for (int i = i1 - 1; i >= i0; i--) {
        v += s.dth[i * S + wj];
        s.dth[i * S + wj] = v;
        if (st[i * TW + F_RST] != 0) {
          v = 0;
          if (cut < 0) cut = i;
        }
      }
      if (wj == 0) s.seg_cut[wg] = cut;
    }
    __syncthreads();
    /* pair wj's carry across the segments, from the last (a segment's tokens from its last reset on
     * receive it) */
    if (tid < S)
      for (int q = nseg - 1; q >= 0; q--) {
        s.seg_in[q * S + wj] = D;
        const int e = q * seg_len;
        D = st[e * TW + F_RST] != 0 ? 0.0f : s.dth[e * S + wj] + (s.seg_cut[q] < 0 ? D : 0.0f);
      }
    __syncthreads();
    if (wg < nseg) {
      const float in = s.seg_in[wg * S + wj];
      const int cut = s.seg_cut[wg];
      const int64_t step = (int64_t)H * S;
      T *out = (T *)a.dang_head + ((m0 + i0) * H + h) * S + wj;
      for (int i = i0; i < i1; i++, out += step) {
        const float Di = s.dth[i * S + wj] + (i >= cut ? in : 0.0f), ta = s.th[i * S + wj];
        s.dth[i * S + wj] = PI_F * Di * ta;
        *out = from_f<T>(PI_F * Di * st[i * TW + F_DT] * (1 - ta * ta));
      }
    }
    __syncthreads();
    for (int i = tid; i < nb; i += CTHREADS) {
      /* the token's angle term: its pairs' shares summed by one thread, from pair i mod S round (the
       * threads of a warp on distinct banks) */
      float dtang = 0;
      for (int j = 0, jj = S > 0 ? i % S : 0; j < S; j++, jj = jj + 1 == S ? 0 : jj + 1) dtang += s.dth[i * S + jj];
      const float *t = st + i * TW;
      float dbp = 0;
      if (t[F_RST] == 0) {
        if (i > 0) dbp = st[(i - 1) * TW + T_DSCALE];
        else if (t0 > 0) dbp = tab[-TW + T_DSCALE]; /* the token before the block */
        else dbp = walk_parts_sum(tab, T_DBP0);
      }
      st[i * TW + T_DV] = c_finish<T>(a, m0 + i, h, t[T_DA], t[T_DGAM], dbp, t[F_DT], t[F_LAM], t[F_AA], t[F_DSP],
                                      t[F_DAD], dtang);
    }
    __syncthreads();
    if (wid == 0) { /* the block's sums (lanes over the tokens, then the butterfly), added in block order */
      float v = 0, x = 0;
      for (int i = lane; i < nb; i += 32) {
        v += st[i * TW + T_DV];
        x += st[i * TW + F_DYX];
      }
      pd += warp_sum(v);
      sdyx += warp_sum(x);
    }
    __syncthreads();
  }
  float *part = a.part + bh * (2 + 2 * (int64_t)N); // [2 + 2N]
  if (tid == 0) {
    part[0] = pd;
    part[1] = sdyx;
  }
  for (int c = tid; c < 2 * N; c += CTHREADS) {
    float acc = 0;
#pragma unroll 8
    for (int ch = 0; ch < nch; ch++) acc += __ldg(cv.pbc + (bh * nch + ch) * 2 * N + c);
    part[2 + c] = acc;
  }
  if (d.outproj_norm)
    for (int p = tid; p < P; p += CTHREADS) {
      float acc = 0;
#pragma unroll 8
      for (int ch = 0; ch < nch; ch++) acc += __ldg(cv.pon + (bh * nch + ch) * cd.Pp + p);
      a.part_norm[bh * P + p] = acc;
    }
}

/* ---- host side ------------------------------------------------------------------------------------------ */

/* Whether two CTAs of the per-chunk backward share an SM (SMEM_TWO_CTAS). */
static bool bwd_two_ctas(int32_t smem) { return smem <= SMEM_TWO_CTAS; }

/* The walks can split a state's rows in two parts of whole 16-row tiles; it gains only with parts of 32
 * rows or more (lm130's 64 rows: 182 -> 158 us a dE walk; mid's 32: 45 -> 47 us, NOTES.md run 154). */
static bool walk_split_shape(int32_t P) { return P % 64 == 0; }
/* Whether a launch of a.rows x H walks splits them: fewer CTAs than the plan's walk_split_max_ctas. */
static bool walks_split(const m3k_scan_plan *plan, const m3k_scan_args &a) {
  return walk_split_shape(a.d.P) && (int64_t)a.d.H * a.rows < plan->walk_split_max_ctas;
}

/* The angle walk's pairs in parts (scan_angles_chunked) while the launch stays below the walks' split
 * threshold (walk_split_max_ctas) and each part keeps a multiple of 8 pairs (the vector loads of
 * angles_vec8 stay aligned): lm130 two parts of 16 pairs, 101 -> 65 us a launch (NOTES.md run 156). */
static int angle_parts(const m3k_scan_plan *plan, const m3k_scan_args &a) {
  int parts = 1;
  while (parts < 4 && a.d.S % (16 * parts) == 0 && (int64_t)a.d.H * a.rows * parts < plan->walk_split_max_ctas)
    parts *= 2;
  return parts;
}

/* The forward walk, its state rows in two parts as the dE walk's (dstate_launch), unless the mixer norm
 * needs whole rows of y or the carried k is read and written in place (fin_k at in_k: the parts would
 * race on it); only for the compiled shapes (at run-time sizes the split kernel spills at three CTAs
 * per multiprocessor). */
template <typename T, int PK, int NK>
static void fwd_launch(cudaStream_t s, const m3k_scan_plan *plan, const m3k_scan_args &a) {
  if constexpr (PK > 0 && PK % 64 == 0)
    if (walks_split(plan, a) && !a.d.outproj_norm && !(a.in_k && a.in_k == a.fin_k)) {
      scan_fwd_chunked_r<T, PK, NK, 2>
          <<<rows_grid(a.d.H, a.rows, 2), CTHREADS, carve_r(NULL, a.d.P / 2, a.d.N, NULL), s>>>(a);
      return;
    }
  scan_fwd_chunked_r<T, PK, NK, 1><<<rows_grid(a.d.H, a.rows), CTHREADS, plan->smem_cfwd, s>>>(a);
}

/* The dE walk, its state rows in two parts where that fits and the launch has fewer (head, row) CTAs
 * than the plan's walk_split_max_ctas (NOTES.md run 154). */
template <typename T, int PK, int NK>
static void dstate_launch(cudaStream_t s, const m3k_scan_plan *plan, const m3k_scan_args &a) {
  const int P = a.d.P, N = a.d.N;
  if constexpr (PK % 64 == 0)
    if (walks_split(plan, a)) {
      scan_dstate_chunked<T, PK, NK, 2><<<rows_grid(a.d.H, a.rows, 2), CTHREADS, carve_d(NULL, P / 2, N, NULL), s>>>(a);
      return;
    }
  scan_dstate_chunked<T, PK, NK, 1><<<rows_grid(a.d.H, a.rows), CTHREADS, carve_d(NULL, P, N, NULL), s>>>(a);
}

int64_t m3k_chunked_smem(int which, int32_t P, int32_t N, int32_t S) {
  switch (which) {
  case M3K_CHUNKED_FWD: return fwd_in_regs(P, N) ? (int64_t)carve_r(NULL, P, N, NULL) : INT64_MAX;
  case M3K_CHUNKED_BWD: { /* the larger of the dE walk and the per-chunk kernel */
    if (!fwd_in_regs(P, N)) return INT64_MAX;
    const size_t c = carve_c(NULL, P, N, NULL), w = carve_d(NULL, P, N, NULL);
    return (int64_t)(c > w ? c : w);
  }
  case M3K_CHUNKED_PREP: return (int64_t)carve_p(NULL, P, N, NULL);
  case M3K_CHUNKED_POST_SUM: return (int64_t)carve_q(NULL, N, true, NULL);
  default: {
    const size_t one = carve_q(NULL, N, false, NULL), seq = carve_post(NULL, S, seq_block(S), NULL);
    return (int64_t)(one > seq ? one : seq);
  }
  }
}

int64_t m3k_chunked_scratch(int32_t rows, int32_t len, int32_t H, int32_t P, int32_t N, int bwd) {
  return chunk_views(NULL, NULL, rows, len, H, P, N, bwd != 0, NULL);
}

int64_t m3k_chunked_kept(int32_t rows, int32_t len, int32_t H, int32_t P, int32_t N) {
  return kept_views(NULL, rows, len, H, P, N, NULL);
}

/* The kernels of c_build's layout: the preparation and the post kernel (both variants). */
template <typename T, int GPL, int PK, int NK> static cudaError_t group_kernels_prepare(const m3k_scan_plan *plan) {
  cudaError_t e = cudaFuncSetAttribute(scan_prep_chunked<T, GPL, PK, NK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       plan->smem_cprep);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(scan_post_chunked<T, GPL, PK, NK, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             plan->smem_cpost);
  if (e == cudaSuccess && plan->smem_cpost_sum)
    e = cudaFuncSetAttribute(scan_post_chunked<T, GPL, PK, NK, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             plan->smem_cpost_sum);
  return e;
}

template <typename T, int PK, int NK> static cudaError_t shape_kernels_prepare(const m3k_scan_plan *plan) {
  cudaError_t e = cudaFuncSetAttribute(scan_fwd_chunked_r<T, PK, NK, 1>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, plan->smem_cfwd);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(scan_fwd_chunked_r<T, PK, NK, 1>, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
  if constexpr (PK > 0 && PK % 64 == 0)
    if (e == cudaSuccess && walk_split_shape(plan->P))
      e = cudaFuncSetAttribute(scan_fwd_chunked_r<T, PK, NK, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               plan->smem_cfwd);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(scan_dstate_chunked<T, PK, NK, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             plan->smem_cbwd);
  if constexpr (PK % 64 == 0)
    if (e == cudaSuccess && walk_split_shape(plan->P))
      e = cudaFuncSetAttribute(scan_dstate_chunked<T, PK, NK, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               plan->smem_cbwd);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(scan_bwd_chunked<T, 1, PK, NK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             plan->smem_cbwd);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(scan_bwd_chunked<T, 2, PK, NK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             plan->smem_cbwd);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(scan_bwd_chunked<T, 2, PK, NK>, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
  return e;
}

template <typename T> static cudaError_t chunked_prepare(const m3k_scan_plan *plan) {
  /* the instantiations the plan's shape launches (chunked_fwd, chunked_bwd dispatch the same way) */
  cudaError_t e = cudaSuccess;
  SHAPE_DISPATCH(plan->P, plan->N, (e = shape_kernels_prepare<T, PK, NK>(plan)));
  if (e == cudaSuccess)
    SHAPE_DISPATCH(plan->P, plan->N, GROUPS_DISPATCH(plan->N, (e = group_kernels_prepare<T, GPL, PK, NK>(plan))));
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(scan_post_seq_chunked<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             plan->smem_cpost);
  return e;
}

cudaError_t m3k_chunked_prepare(int prec, const m3k_scan_plan *plan) {
  if (prec == M3K_F32 || !plan->chunked) return cudaSuccess;
  return prec == M3K_BF16 ? chunked_prepare<bf16>(plan) : chunked_prepare<f16>(plan);
}

/* The CTAs of the B/C norm's rows in the angle walk's launch (a warp a row). */
static int64_t bc_rider_ctas(const m3k_scan_args &a) {
  return ((int64_t)a.rows * a.len * 2 * a.d.G + CWARPS - 1) / CWARPS;
}

/* With rope, where the B/C norm's CTAs are at most 8 a multiprocessor (rl-batch's 1024: 4.6 us launches saved at
 * +0.3 us a walk, though at the kernel's 64 registers four CTAs share a multiprocessor and the launch takes ~2.4
 * waves; lm130's 4096 made its walks 66 -> 86 us against a 13.6 us launch: kernels/NOTES.md run 296). */
bool m3k_chunked_bc_rides(const m3k_scan_plan *plan, const m3k_scan_args *a) {
  return a->d.S > 0 && bc_rider_ctas(*a) <= (int64_t)plan->sms * (2048 / CTHREADS);
}

/* Forward: the angles (with rope; with the B/C norm where m3k_chunked_bc_rides, else m3k_scan_fwd ran it), the
 * per-chunk preparation, then the walk. */
template <typename T> static void chunked_fwd(cudaStream_t s, const m3k_scan_plan *plan, const m3k_scan_args &a) {
  const int nch = (a.len + CQ - 1) / CQ;
  if (a.d.S > 0) {
    const int parts = angle_parts(plan, a);
    dim3 grid = rows_grid(a.d.H, a.rows, parts);
    if (m3k_chunked_bc_rides(plan, &a)) grid.x += (unsigned)((bc_rider_ctas(a) + parts - 1) / parts);
    scan_angles_chunked<T><<<grid, CTHREADS, (size_t)angles_smem_floats(a.d.S / parts) * sizeof(float), s>>>(a);
  }
  const dim3 chunks = rows_grid((int64_t)nch * a.d.H, a.rows);
  SHAPE_DISPATCH(a.d.P, a.d.N,
                 GROUPS_DISPATCH(a.d.N,
                                 (scan_prep_chunked<T, GPL, PK, NK><<<chunks, CTHREADS, plan->smem_cprep, s>>>(a))));
  SHAPE_DISPATCH(a.d.P, a.d.N, (fwd_launch<T, PK, NK>(s, plan, a)));
}

cudaError_t m3k_chunked_fwd(cudaStream_t s, int prec, const m3k_scan_plan *plan, const m3k_scan_args *a) {
  if (prec == M3K_BF16) chunked_fwd<bf16>(s, plan, *a);
  else chunked_fwd<f16>(s, plan, *a);
  return cudaGetLastError();
}

/* The post kernel sums each group's heads (into a.dbc_group) when its shared memory fits (the plan's
 * smem_cpost_sum), a group has more than one head, and a CTA per (chunk, group, row) still gives the
 * launch the plan's post_sum_min_ctas CTAs (128 by default, about one per multiprocessor: NOTES.md). */
bool m3k_chunked_sums_heads(const m3k_scan_plan *plan, const m3k_scan_args *a) {
  const int64_t ctas = (int64_t)((a->len + CQ - 1) / CQ) * a->d.G * a->rows;
  return plan->smem_cpost_sum > 0 && a->dbc_group && a->d.hpg > 1 && ctas >= plan->post_sum_min_ctas;
}

/* Backward (after a training forward: a.chunk_states): the gate backward, the reverse walk of dE,
 * the per-chunk products, the per-token finish, then the scalars along the sequence. */
template <typename T> static void chunked_bwd(cudaStream_t s, const m3k_scan_plan *plan, const m3k_scan_args &a) {
  const int64_t nch = (a.len + CQ - 1) / CQ;
  const dim3 chunks = rows_grid(nch * a.d.H, a.rows), walks = rows_grid(a.d.H, a.rows);
  const int P = a.d.P, N = a.d.N;
  SHAPE_DISPATCH(P, N, (scan_gate_bwd_chunked<T, PK, NK><<<chunks, CTHREADS, carve_g(NULL, P, NULL), s>>>(a)));
  /* each takes its own shared memory size, within the limits m3k_chunked_prepare set */
  SHAPE_DISPATCH(P, N, (dstate_launch<T, PK, NK>(s, plan, a)));
  const int32_t per_chunk = (int32_t)carve_c(NULL, P, N, NULL);
  const bool two = bwd_two_ctas(per_chunk);
  SHAPE_DISPATCH(P, N,
                 (two ? scan_bwd_chunked<T, 2, PK, NK><<<chunks, CTHREADS, per_chunk, s>>>(a)
                      : scan_bwd_chunked<T, 1, PK, NK><<<chunks, CTHREADS, per_chunk, s>>>(a)));
  if (m3k_chunked_sums_heads(plan, &a)) {
    const dim3 groups = rows_grid(nch * a.d.G, a.rows);
    SHAPE_DISPATCH(P, N,
                   GROUPS_DISPATCH(N, (scan_post_chunked<T, GPL, PK, NK, true>
                                       <<<groups, CTHREADS, plan->smem_cpost_sum, s>>>(a))));
  } else {
    SHAPE_DISPATCH(P, N,
                   GROUPS_DISPATCH(N, (scan_post_chunked<T, GPL, PK, NK, false>
                                       <<<chunks, CTHREADS, carve_q(NULL, N, false, NULL), s>>>(a))));
  }
  scan_post_seq_chunked<T><<<walks, CTHREADS, carve_post(NULL, a.d.S, seq_block(a.d.S), NULL), s>>>(a);
}

cudaError_t m3k_chunked_bwd(cudaStream_t s, int prec, const m3k_scan_plan *plan, const m3k_scan_args *a) {
  if (prec == M3K_BF16) chunked_bwd<bf16>(s, plan, *a);
  else chunked_bwd<f16>(s, plan, *a);
  return cudaGetLastError();
}

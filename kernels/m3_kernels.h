/*
 * m3_kernels.h — the C interface of the CUDA kernels (the .cu files beside it) used by the host code
 * of the CUDA backend (engine/src/cuda). Plain C: structs of sizes and device pointers,
 * and launchers that enqueue work on a stream and return cudaGetLastError().
 *
 * Precision codes (`prec`): 0 f32, 1 bf16, 2 f16. "act" buffers (GEMM operands: normed
 * activations, in_proj output, gate output, gradients fed to GEMMs) hold that type; every
 * statistic, state, reduction and master weight is float32 (SPEC.md §8).
 *
 * Layouts are row-major. M = rows * len positions of the current window, packed [rows, len];
 * per-layer saved buffers are strided by the trainer's capacity (batch * seq_len).
 */
#ifndef M3_KERNELS_H
#define M3_KERNELS_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { M3K_F32 = 0, M3K_BF16 = 1, M3K_F16 = 2 };

/* Model sizes the kernels need (mirrors m3_dims; dipp = in_proj row stride, dip rounded up to 8). */
typedef struct m3k_dims {
  int32_t dm, E, P, H, G, N, S, dip, dipp, hpg;
  int32_t z_off, x_off, B_off, C_off, dt_off, A_off, trap_off, ang_off;
  int32_t outproj_norm;
  float a_floor;
} m3k_dims;

/* Per-step values in device memory, written (async, from pinned memory) before every eager
 * launch or graph replay, so that a captured graph always reads the current ones. */
typedef struct m3k_step {
  float weight;       /* backward seed scale (f16 loss scale, micro-batch scale) */
  float grad_unscale; /* 1 / loss scale */
  float lr, weight_decay, beta1, beta2, eps;
  float one_minus_beta1, one_minus_beta2; /* from the double betas: 1 - a float beta near 1 loses its digits */
  float step_size;    /* lr / (1 - beta1^t) */
  float bc2_sqrt;     /* sqrt(1 - beta2^t) */
  int32_t no_decay;   /* the reference no-decay group is on */
  double clip;        /* max global norm; 0 = off */
} m3k_step;

/* Per-batch values computed on the host while staging the batch. */
typedef struct m3k_batch_info {
  int64_t count;      /* "lm": targets != -1; "mse": counted elements */
  int32_t nseg;       /* embedding backward: distinct token ids in the window */
  int32_t pad_;
} m3k_batch_info;

/* Results read back after a step. */
typedef struct m3k_metrics {
  double loss_sum;    /* sum of per-position losses (lm) or squared errors (mse) */
  int64_t correct;    /* lm: argmax hits */
  double norm_sq;     /* global gradient norm squared (after unscaling) */
  double grad_norm;
  float clip_scale;
  int32_t finite;     /* 1: the update was applied */
} m3k_metrics;

/* ---- elementwise, reductions --------------------------------------------------------------- */

/* dst[i] (act) = src[i] (f32) for n elements. */
cudaError_t m3k_to_act(cudaStream_t s, int prec, const float *src, void *dst, int64_t n);
/* dst[r, j] = src[j] for rows r (bias broadcast). */
cudaError_t m3k_fill_rows(cudaStream_t s, const float *src, float *dst, int64_t rows, int32_t cols);
/* A deterministic column sum: for j < cols, the sum over rows r (in a fixed order) of src[r * ld + j] is
 * added (+=) to dst[j] for j < split, to dst_hi[j - split] from split on (two parameter tensors in one
 * pass, B_norm | C_norm; split = cols for one). Rows are summed in chunks (m3k_colsum_chunks); beyond one
 * chunk, each chunk's sums go to partials [chunks, cols] and a final pass adds them in chunk order. */
typedef struct m3k_colsum_job {
  const float *src;
  int64_t ld;
  int32_t cols, split;
  float *dst, *dst_hi;
  float *partials; /* m3k_colsum_partials(rows, cols) floats (NULL where the rows fit one chunk) */
} m3k_colsum_job;
int64_t m3k_colsum_partials(int64_t rows, int32_t cols);
int64_t m3k_colsum_chunks(int64_t rows);
/* Both passes: the chunks' sums, then (beyond one chunk) the final one. */
cudaError_t m3k_colsum(cudaStream_t s, const m3k_colsum_job *job, int64_t rows);
/* The final pass of n jobs whose chunk sums are in their partials (src unused): one launch for up to
 * M3K_FINISH_JOBS of them. */
enum { M3K_FINISH_JOBS = 64 };
cudaError_t m3k_colsum_finish(cudaStream_t s, const m3k_colsum_job *jobs, int32_t n, int64_t rows);

/* A weight gradient over few tokens: G[M, N] += A[K, M]^T B[K, N] with K <= M3K_RIDER_K (the window's
 * positions), A and B of the activation type, G float32 (the arena); float32 products summed over k in
 * order. */
enum { M3K_RIDER_K = 64 };
typedef struct m3k_wgrad {
  const void *A, *B;
  float *G;
  int64_t lda, ldb, ldg;
  int32_t M, N, K;
} m3k_wgrad;

/* Work that rides along in more CTAs of another kernel's launch, where it is independent of that
 * kernel's own work: a column sum over that kernel's rows (colsum.cols = 0: none; beyond one chunk of
 * rows only its chunk sums, into colsum.partials, for m3k_colsum_finish) and a weight gradient
 * (wgrad.K = 0: none). A launch fewer for each. */
typedef struct m3k_riders {
  m3k_colsum_job colsum;
  m3k_wgrad wgrad;
} m3k_riders;

/* ---- RMSNorm (eps 1e-5) over rows of n values ---------------------------------------------------- */

/* y = x * rstd * w. y_act (prec) and/or y_f32 may be NULL; rstd [rows] is written. */
cudaError_t m3k_rmsnorm_fwd(cudaStream_t s, int prec, const float *x, const float *w, void *y_act, float *y_f32,
                            float *rstd, int64_t rows, int32_t n);
/* dx = (accumulate ? dx : 0) + r (w dy) - x r^3 mean(x w dy); dx_act (may be NULL) = act(dx);
 * the weight gradient dw: a column-sum job of n columns whose terms x r dy the launch takes from x, r and
 * dy (src unused), in m3k_colsum's order: beyond one chunk of rows only its chunk sums, into its partials,
 * for m3k_colsum_finish. With dy_scale (may be NULL), dy is read as step->weight * dy (the seed of head
 * "none"). riders (may be NULL) ride in the same launch. */
cudaError_t m3k_rmsnorm_bwd(cudaStream_t s, int prec, const float *x, const float *w, const float *rstd,
                            const float *dy, const m3k_step *dy_scale, float *dx, void *dx_act,
                            const m3k_colsum_job *dw, const m3k_riders *riders, int64_t rows, int32_t n,
                            int accumulate);

/* ---- B/C RMSNorm per (position, B|C, group) ------------------------------------------------------ */

/* bc_hat [M, 2, G, N] = RMSNorm_N(B or C of group g; B_norm | C_norm), bc_rstd [M, 2, G] (m3k_scan_fwd runs it
 * for the scan kernels that read bc_hat and do not normalise B and C in a launch of their own). */
cudaError_t m3k_bcnorm_fwd(cudaStream_t s, int prec, const m3k_dims *d, const void *proj, const float *wB,
                           const float *wC, float *bc_hat, float *bc_rstd, int64_t M);
/* A layer's small-parameter gradients from the scan's per-(row, head) partials, added (+=) with row sums
 * in row order: part [rows, H, 2 + 2N] -> g_dt_bias [H], g_D [H], g_B_bias [H, N], g_C_bias [H, N];
 * part_norm [rows, H * P] -> g_norm [H * P] (with outproj_norm only). */
typedef struct m3k_scan_partials {
  const float *part, *part_norm;
  int32_t rows;
  float *g_dt_bias, *g_D, *g_B_bias, *g_C_bias, *g_norm;
} m3k_scan_partials;

/* Per position: sums the per-head dL/d(B_hat + bias), dL/d(C_hat + bias) over each group's heads
 * (dbc [M, G, slots, 2, N]: slots = hpg for m3k_scan_args.dbc_head, 1 for dbc_group, already summed),
 * RMSNorm backward into dproj's B and C columns (=), angle shares summed over heads into dproj's
 * angle columns (=); wcontrib [M, 2N] = the B_norm | C_norm weight-gradient terms (summed over groups,
 * column sums left to the caller). dbc NULL: the scan did the B/C part (M3K_BC_NORMED), only the angle
 * columns here. In the same launch, sp's gradients and the riders (may be NULL; a column sum rides only
 * over rows that fit one chunk). */
cudaError_t m3k_bcnorm_bwd(cudaStream_t s, int prec, const m3k_dims *d, const void *proj, const float *wB,
                           const float *wC, const float *bc_rstd, const float *dbc, int32_t slots,
                           const void *dang_head, void *dproj, float *wcontrib, const m3k_scan_partials *sp,
                           const m3k_riders *riders, int64_t M);

/* ---- the scan (SPEC.md §3 steps 2-10) --------------------------------------------------------------- */

typedef struct m3k_scan_plan {
  int32_t P, N, S;    /* the shape it was made for: headdim, d_state, rotated pairs */
  int32_t rp, rn;     /* state elements per thread: rp rows (p) x rn columns (n) */
  int32_t pth, nth;   /* threads along p and n (powers of two, pth * nth >= 32) */
  int32_t threads;    /* pth * nth */
  int32_t tb_fwd, tb_bwd; /* tokens per shared-memory block */
  int32_t sb;         /* backward: tokens per sub-block of the over-p reductions */
  int32_t smem_fwd, smem_bwd; /* dynamic shared memory bytes */
  int32_t smem_step;          /* the one-token forward's (scan_step.cu): one (row, head) state */
  /* The chunked tensor-core scan (scan_chunked.cu) of the 16-bit precisions: 1 when its shared
   * memory fits (P, N) (M3_SCAN_SIMT=1 turns it off); f32, and plans where it is 0, use the SIMT
   * kernels. A window takes it when it spans more than one 64-token chunk, or when P x N >=
   * chunk_min_state (1024; environment M3_SCAN_CHUNK_MIN_STATE overrides it). */
  int32_t chunked, chunk_min_state;
  int32_t smem_cfwd, smem_cbwd, smem_cprep, smem_cpost; /* the walks, the per-chunk and post kernels */
  /* The post kernel that sums each group's heads (0: it does not fit); launches whose grid of one CTA per
   * (chunk, group, row) reaches post_sum_min_ctas (128; environment M3_SCAN_POST_SUM_MIN_CTAS) take it. */
  int32_t smem_cpost_sum, post_sum_min_ctas;
  /* The walks along the chunks (the forward's, the backward's dE walk) split each state's rows over two
   * CTAs (headdim a multiple of 64), and the angle walk its pairs over up to four, when they have fewer
   * than walk_split_max_ctas (head, row) CTAs (two per multiprocessor: 264 on an H200; environment
   * M3_SCAN_WALK_SPLIT_MAX_CTAS). */
  int32_t walk_split_max_ctas;
  int32_t sms;             /* the device's multiprocessors */
  int32_t simt_bwd_slots;  /* CTAs of the SIMT backward the device holds at once (m3k_scan_prepare's precision) */
  /* The chunked backward of small states (scan_small.cu, every precision) for its shapes, windows of more than
   * one chunk: 1 for those shapes unless the environment sets M3_SCAN_SMALL_BWD=0; small_bwd_slots: its CTAs
   * the device holds at once. */
  int32_t small_bwd, small_bwd_slots;
} m3k_scan_plan;

/* Rows of a window the scan kernels take at most for H heads and windows up to len tokens: a launch grid holds at
 * most 2^31 - 1 CTAs in grid.x, where their largest launch has one per (64-token chunk, head, row). */
int64_t m3k_scan_max_rows(int32_t H, int32_t len);
/* Chooses the thread tile and token block for (P, N, S) on a device of max_smem bytes of shared memory a
 * block and sms multiprocessors; returns 0 when the sizes are beyond the kernels (P > 128, N > 256, or
 * shared memory), with a message in why[256]. */
int m3k_scan_make_plan(int32_t P, int32_t N, int32_t S, int32_t max_smem, int32_t sms, m3k_scan_plan *out,
                       char *why);
/* Floats of the chunked scan's scratch m3k_scan_args.chunk_scratch for windows up to rows x len, for
 * the forward alone (backward = 0: inference) or forward and backward (0 when the plan's scan of
 * this precision is not chunked). */
int64_t m3k_scan_chunk_scratch(const m3k_scan_plan *plan, int prec, int32_t rows, int32_t len, int32_t H, int32_t P,
                               int32_t N, int backward);
/* Floats of m3k_scan_args.chunk_states of one layer for windows up to rows x len (the chunked scan's, or the
 * small states' backward's; 0 when neither applies to the plan and precision). */
int64_t m3k_scan_chunk_states(const m3k_scan_plan *plan, int prec, int32_t rows, int32_t len, int32_t H, int32_t P,
                              int32_t N);
/* Floats of m3k_scan_args.dy for windows up to rows x len: the SIMT backward keeps dL/dy there for the
 * token blocks before a window's last; 0 when every window of this precision that takes it fits one
 * block (a 16-bit plan whose longer windows take the chunked kernels, or short windows). */
int64_t m3k_scan_dy_floats(const m3k_scan_plan *plan, int prec, int32_t rows, int32_t len, int32_t E);
/* Raises the kernels' dynamic shared-memory limits for a plan and sets its simt_bwd_slots and small_bwd_slots
 * for the precision (call once, outside capture). */
cudaError_t m3k_scan_prepare(int prec, m3k_scan_plan *plan);

typedef struct m3k_scan_args {
  m3k_dims d;
  int32_t rows, len;
  const void *proj;            /* [M, dipp] act: in_proj output */
  float *bc_hat;               /* [M, 2, G, N] B_hat, C_hat (m3k_bcnorm_fwd's), bc_rstd [M, 2, G] their 1 / RMS:
                                  m3k_scan_fwd writes them from proj with B_norm, C_norm (in the scan kernel
                                  itself, or by m3k_bcnorm_fwd first for the kernels that read bc_hat); the
                                  backward reads them. NULL only for a one-token window not trained */
  float *bc_rstd;
  const float *B_norm, *C_norm; /* [N] the B/C RMSNorm weights */
  const float *dt_bias, *D, *B_bias, *C_bias, *out_norm; /* parameters of the layer (f32) */
  const uint8_t *resets;       /* [rows, len] */
  const float *in_angle, *in_ssm, *in_k, *in_v; /* incoming state [B, H, ...] of the layer; NULL: zeros */
  float *fin_angle, *fin_ssm, *fin_k, *fin_v;   /* final state [B, H, ...]; NULL: not written */
  float *theta;                /* [M, H, S] angles after each token (forward writes, backward reads) */
  void *y;                     /* [M, E] act: scan output (with D x), before the gate */
  float *y_rstd;               /* [M, H] per-head RMS of y (outproj_norm) */
  void *gated;                 /* [M, E] act: gate output (forward) */
  /* backward */
  const void *dgated;          /* [M, E] act: dL/d gated */
  void *dproj;                 /* [M, dipp] act: writes the z, x, dd_dt, dd_A, trap columns (=) */
  float *dy;                   /* [M, E] scratch: dL/d y (the SIMT backward's; m3k_scan_dy_floats) */
  float *dthq;                 /* [M, H, S] scratch: angle gradient from q */
  float *psi;                  /* [M, H] scratch: dq . q */
  float *dbc_head;             /* [M, H, 2, N] per-head dL/d (B_hat + bias), dL/d (C_hat + bias) (=) */
  float *dbc_group;            /* [M, G, 2, N] the same summed over each group's heads (=), written instead of
                                  the final dbc_head where m3k_scan_bwd_bc_stage says so; may be NULL */
  float *wcontrib;             /* [M, 2N] as m3k_bcnorm_bwd's, where the scan does the B/C norm backward itself
                                  (M3K_BC_NORMED); may be NULL */
  void *dang_head;             /* [M, H, S] act: per-head share of dL/d ang (=) */
  float *part;                 /* [rows, H, 2 + 2N]: dt_bias, D, B_bias[N], C_bias[N] partials (=) */
  float *part_norm;            /* [rows, H, P]: mixer norm weight partials (=), outproj_norm only */
  float *chunk_scratch;        /* the chunked scan's per-chunk scratch (m3k_scan_chunk_scratch floats, sized for
                                  the backward when it runs); NULL: the SIMT kernels */
  float *chunk_states;         /* one layer's m3k_scan_chunk_states floats: what the chunked forward keeps for its
                                  backward (the state entering each chunk, the chunks' q, ktil and token
                                  scalars), or the small-state forward (scan_warp.cu) for the small states'
                                  backward (the state entering each 64-token chunk); the forward writes it when
                                  not NULL, the backward reads it (required by those backwards) */
} m3k_scan_args;

cudaError_t m3k_scan_fwd(cudaStream_t s, int prec, const m3k_scan_plan *plan, const m3k_scan_args *a);
cudaError_t m3k_scan_bwd(cudaStream_t s, int prec, const m3k_scan_plan *plan, const m3k_scan_args *a);
/* Where m3k_scan_bwd leaves the B/C gradients: per head in a->dbc_head (M3K_BC_PER_HEAD), summed over each
 * group's heads in a->dbc_group (M3K_BC_SUMMED: the chunked backward of large windows), or already through the
 * B/C RMSNorm backward (M3K_BC_NORMED: the same with one group and a->wcontrib: dproj's B and C columns and
 * wcontrib written, the rest of m3k_bcnorm_bwd's work left to it, called with dbc NULL). */
enum { M3K_BC_PER_HEAD = 0, M3K_BC_SUMMED = 1, M3K_BC_NORMED = 2 };
int m3k_scan_bwd_bc_stage(int prec, const m3k_scan_plan *plan, const m3k_scan_args *a);
/* 1 when m3k_scan_bwd is one launch of a CTA per (row, head) (the SIMT kernel, or the small states' chunked one)
 * and its CTAs take at least 90 % of what the device holds at once (plan->simt_bwd_slots, small_bwd_slots): a
 * kernel launched beside it then delays some of them by its whole length. */
int m3k_scan_bwd_fills_device(int prec, const m3k_scan_plan *plan, const m3k_scan_args *a);

/* ---- the fused one-token inference step (decode_fused.cu) ----------------------------------------------- */

typedef struct m3k_decode_layer {
  const float *norm, *B_norm, *C_norm, *dt_bias, *D, *B_bias, *C_bias, *out_norm; /* f32 parameters */
  const void *in_proj, *out_proj; /* act weights [dip, dm], [dm, E] */
  float *angle, *ssm, *k, *v;     /* the layer's carried state [B, H, ...], advanced in place */
} m3k_decode_layer;

typedef struct m3k_decode_args {
  m3k_dims d;
  int32_t L, rows;
  int32_t cluster;                /* CTAs per row (a thread-block cluster): 1 .. m3k_decode_prepare's maximum */
  const m3k_decode_layer *layers; /* [L] in device memory */
  const float *h0;                /* [rows, dm] the input rows (after the input layer); may be pinned host memory */
  const uint8_t *resets;          /* [rows]; NULL: none; may be pinned host memory */
  const float *norm_f;            /* [dm] */
  float *out, *out_rstd;          /* [rows, dm], [rows]: norm_f's output and 1 / RMS */
  void *out_act;                  /* [rows, dm] act copy of out */
} m3k_decode_args;

/* Dynamic shared memory of the fused step (bf16, f16) for a model of L layers without its weight
 * copies, or 0 where it does not apply (f32, a layer's in_proj + out_proj weights above 512 KiB,
 * P > 128, N > 256, d_model or E not a multiple of 32, or more than max_smem bytes). */
size_t m3k_decode_smem(int prec, const m3k_dims *d, int32_t L, int32_t max_smem);
/* Raises the step kernels' dynamic shared-memory limit to max_smem (call once, outside capture) and
 * sets *max_cluster to the largest cluster size (a power of two, at most cap and 16) the device can
 * run with it. */
cudaError_t m3k_decode_prepare(int prec, size_t max_smem, int32_t cap, int32_t *max_cluster);
/* One token of rows a->rows through every layer and norm_f (a cluster of a->cluster CTAs per row),
 * with the weights staged in shared memory where they fit in max_smem. */
cudaError_t m3k_decode_step(cudaStream_t s, int prec, const m3k_decode_args *a, size_t max_smem);

/* ---- heads and inputs --------------------------------------------------------------------------------- */

/* h0[m] = emb[tokens[m]] (f32). */
cudaError_t m3k_embed_fwd(cudaStream_t s, const int32_t *tokens, const float *emb, float *h0, int64_t M, int32_t dm);
/* Deterministic embedding backward: for each distinct token (segments of a host-side counting
 * sort: seg_tok [nseg], seg_start [nseg + 1], perm [M]), gemb[tok] += sum of dh0[perm[i]] in order. */
cudaError_t m3k_embed_bwd(cudaStream_t s, const m3k_batch_info *info, const int32_t *seg_tok,
                          const int32_t *seg_start, const int32_t *perm, const float *dh0, float *gemb, int64_t M,
                          int32_t dm);
/* Raises ce's dynamic shared-memory limit for rows of V logits (call once, outside capture). */
cudaError_t m3k_ce_prepare(int prec, int32_t V);
/* "lm": per position of a block of nb rows: logits [nb, V] (act) -> row_loss [nb] (double),
 * row_hit [nb]; with want_grad, dlogits [nb, V] (act) = weight (softmax - onehot) / count (0 for
 * ignored rows). */
cudaError_t m3k_ce(cudaStream_t s, int prec, const m3k_step *step, const m3k_batch_info *info,
                   const void *logits, const int32_t *targets, void *dlogits, double *row_loss, int32_t *row_hit,
                   int64_t nb, int32_t V, int want_grad);
/* "mse": pred [M, od] (f32, without bias) -> per-row squared errors row_loss [M] (double);
 * dpred [M, od] (f32) and dpred_act = weight 2 (pred + bias - target) / count (0 where masked). */
cudaError_t m3k_mse(cudaStream_t s, int prec, const m3k_step *step, const m3k_batch_info *info, const float *pred,
                    const float *bias, const float *target, const uint8_t *mask, float *dpred, void *dpred_act,
                    double *row_loss, int64_t M, int32_t od, int want_grad);
/* metrics->loss_sum = sum of row_loss[0..n) in order; correct = sum of row_hit (NULL: 0). */
cudaError_t m3k_loss_sum(cudaStream_t s, const double *row_loss, const int32_t *row_hit, int64_t n,
                         m3k_metrics *metrics);

/* ---- optimizer tail --------------------------------------------------------------------------------------- */

int64_t m3k_norm_blocks(int64_t n);
/* g *= grad_unscale (when != 1); partial[b] = sum of g^2 over block b (double). g 16-byte aligned (else
 * cudaErrorMisalignedAddress). */
cudaError_t m3k_grad_sumsq(cudaStream_t s, const m3k_step *step, float *g, int64_t n, double *partial);
/* The fixed-order sum of the partials (m3k_norm_blocks(n) = nblocks of them): norm, finite flag and clip
 * scale into metrics; then, when finite, AdamW over the flat arena (SPEC.md §7, as the CPU backend) and the
 * 16-bit shadow (may be NULL) refreshed; decay_flags[i / 64] = 1 where weight decay applies even with the
 * reference no-decay group on, 0 for no-decay tensors. */
cudaError_t m3k_adamw(cudaStream_t s, int prec, const m3k_step *step, const double *partial, int64_t nblocks,
                      m3k_metrics *metrics, float *w, const float *g, float *m, float *v, void *shadow,
                      const uint8_t *decay_flags, int64_t n);

#ifdef __cplusplus
}
#endif

#endif

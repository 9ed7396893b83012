/*
 * cuda_backend.c — the CUDA backend of the trainer (backend.h): one device arena per trainer,
 * the step sequence (batch upload, forward, head, backward, optimizer tail, metrics download)
 * enqueued on one stream (the backward's weight-gradient GEMMs beside it on a second, below), and
 * CUDA graphs of that sequence per (rows, len) window shape.
 *
 * Memory: everything is carved once, at creation, out of one cudaMalloc (named views below,
 * 256-byte aligned; per-layer slices of saved activations are padded to 128 elements so every
 * slice stays aligned); pinned host buffers of the same capacity stage the batch. Nothing is
 * allocated inside a step.
 *
 * Per-step values (lr, Adam bias corrections, loss scale / backward weight, clip) live in a
 * small device struct copied from pinned memory at the start of every enqueued sequence, so a
 * captured graph reads the current ones at each replay. The step's metrics (loss sums, norm,
 * finite flag) come back through one small copy into pinned memory; the call waits for it
 * because the trainer needs the finite flag before it counts the step.
 *
 * Large float32 uploads (an "identity" / "features" input, a head "none" step's d_out, each at least
 * OVERLAP_BYTES) go through a copy stream outside the graph, in pieces, so the host's copy into the
 * pinned staging overlaps the copy engine (upload_overlapped; arrays already in page-locked memory,
 * m3_host_pinned_alloc's, are copied straight from there); and such a step runs as two parts (two
 * graphs): the forward is enqueued before the host stages d_out, so the staging and upload of d_out
 * overlap the forward, and the backward waits for it (step_splits).
 *
 * Weight gradients beside the chain: in the backward, a layer's out_proj and in_proj weight-gradient
 * GEMMs (over windows too long for riders) run on a second stream, forked from the main one once their
 * operands are final and joined before anything overwrites those operands (side_wgrad, enq_backward),
 * so they fill the multiprocessors the scan, the norms and narrow GEMMs leave idle (where each forks:
 * m3k_scan_bwd_fills_device, fits_beside). The side stream has its own GEMM context and workspace
 * (split-K GEMMs run on both streams at once); a graph captures the fork and join.
 *
 * Determinism: the kernels reduce in fixed orders and every GEMM shape runs one cached
 * cuBLASLt algorithm with one workspace size, so eager steps, graph replays and split calls give
 * the same bits, run after run.
 *
 * Errors: every CUDA and cuBLAS call is checked; a sticky error (the context is broken, e.g.
 * an illegal address) returns M3_ERR_POISONED and the backend refuses every later call.
 *
 * Inference (args infer = 1, op_infer): the arena holds no gradients, moments or incoming
 * state, one layer slot of activations (two for the residual stream) and [B, vocab] logits
 * of the last position; the scan reads and writes the carried state in place (each block
 * loads its (row, head) state before it stores it). One-token steps replay a CUDA graph
 * per row count (upload, forward, head GEMM); the logits stay on the device until read.
 * Where the model is small enough (m3k_decode_smem; bf16 and f16), a one-token step's layers and
 * norm_f run as one launch (decode_fused.cu) instead of five launches per layer; M3_DECODE_FUSED=0 in the
 * environment at creation keeps the per-layer launches (tests compare the two). That launch runs a
 * cluster of CTAs per row, as many as the device holds for all rows at once (decode_cluster_for);
 * M3_DECODE_CLUSTER=n at creation caps the cluster size (tests and benchmarks compare sizes).
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../../kernels/m3_kernels.h"
#include "../backend.h"
#include "../errors.h"
#include "gemm.h"

enum { MAX_GRAPHS = 16, LM_BLOCK_ROWS = 4096, SLICE_ALIGN = 128, PROF_MARKS = 2048 };

/* Opt-in phase timing (m3_trainer_set_profiling; eager calls only): an event at every phase
 * boundary, the time to the next event charged to the phase, totals read with
 * m3_trainer_profile. A development aid, off by default. The main stream's phases only: the side
 * stream's weight-gradient GEMMs show where the main stream waits for them. */
typedef enum prof_phase {
  PH_UPLOAD, PH_INPUT, PH_NORM_F, PH_INPROJ_F, PH_SCAN_F, PH_OUTPROJ_F, PH_HEAD, PH_NORM_B,
  PH_OUTPROJ_B, PH_SCAN_B, PH_BCNORM_B, PH_INPROJ_B, PH_INPUT_B, PH_UPDATE, PH_END, PH_COUNT
} prof_phase;
static const char *const PHASE_NAME[PH_COUNT] = {
    "upload", "input", "norm fwd", "in_proj fwd", "scan fwd", "out_proj fwd", "head (+grad)",
    "norm bwd", "out_proj bwd", "scan bwd", "bcnorm bwd + small grads", "in_proj bwd", "input bwd", "update", "end"};

typedef struct prof {
  int on, n, capturing, events; /* events: ev[] created (on the first switch-on) */
  cudaEvent_t ev[PROF_MARKS];
  int phase[PROF_MARKS];
  double ms[PH_COUNT];
  int64_t steps;
} prof;
static const size_t WORKSPACE_BYTES = (size_t)32 << 20;

typedef struct graph_entry {
  int32_t rows, len, carry;
  cudaGraphExec_t exec[2]; /* the sequence, or (step_splits) the step's front and back */
  uint64_t used;
} graph_entry;

/* A GEMM on the side stream: done is recorded after it, pending until the main stream waits for it. */
typedef struct side_gemm {
  cudaEvent_t done;
  int pending;
} side_gemm;

struct backend {
  const m3_dims *d;
  const m3_layout *lay;
  m3k_dims kd;
  int prec;         /* M3K_F32, M3K_BF16, M3K_F16 */
  size_t act_bytes; /* 4 or 2 */
  int dev;
  int32_t B, T;
  int64_t Mc; /* capacity positions B * T */
  int poisoned;
  cudaStream_t st;
  cudaStream_t copy_st; /* large uploads (upload_overlapped) */
  cudaEvent_t uploaded; /* the last upload_overlapped's copies are done */
  gemm_ctx gm;
  int gm_ready;
  cudaStream_t side;       /* the backward's weight-gradient GEMMs (side_wgrad) */
  cudaEvent_t fork;        /* the main stream where a side GEMM may start */
  side_gemm wout, win;     /* the side stream's last out_proj / in_proj weight gradient */
  gemm_ctx gm_side;        /* the side stream's GEMMs (its own workspace) */
  int gm_side_ready;
  m3k_scan_plan scan;
  int64_t lm_rows;   /* positions per block of the "lm" head */
  int64_t in_w;      /* width of the input rows */
  int64_t od;        /* "mse" out_dim */

  /* ---- device arena ---- */
  char *arena;
  size_t arena_bytes;
  float *params, *grads, *adam_m, *adam_v; /* [total] */
  void *shadow;                            /* [total] 16-bit weights (NULL for f32) */
  uint8_t *decay_flags;                    /* [total / 64]: 1 = decayed even in the reference group */
  float *s_angle, *s_ssm, *s_k, *s_v;      /* carried state [L, B, H, S | P N | N | P] */
  float *i_angle, *i_ssm, *i_k, *i_v;      /* incoming state of the last training forward (same shapes) */
  float *resid;                            /* [L + 1] x [Mc, dm] residual stream */
  void *xn;                                /* [L] x [Mc, dm] act: RMSNorm(resid) */
  float *rstd;                             /* [L] x [Mc] */
  void *proj;                              /* [L] x [Mc, dipp] act: in_proj output */
  float *bc_hat;                           /* [L] x [Mc, 2, G, N] */
  float *bc_rstd;                          /* [L] x [Mc, 2, G] */
  float *theta;                            /* [L] x [Mc, H, S] */
  void *y;                                 /* [L] x [Mc, E] act: scan output */
  float *y_rstd;                           /* [L] x [Mc, H] */
  void *gated;                             /* [L] x [Mc, E] act: gate output */
  float *out;                              /* [Mc, dm] the output */
  void *out_act;                           /* [Mc, dm] act (= out for f32) */
  float *out_rstd;                         /* [Mc] */
  float *dout, *dresid, *dxn;              /* [Mc, dm] (dout: heads "lm", "mse") */
  void *dresid_act;                        /* [Mc, dm] act (= dresid for f32) */
  void *dproj;                             /* [Mc, dipp] act */
  void *dgated;                            /* [Mc, E] act */
  float *dy;                               /* [Mc, E] (m3k_scan_dy_floats; or NULL) */
  float *dthq;                             /* [Mc, H, S] */
  float *psi;                              /* [Mc, H] */
  float *dbc_head;                         /* [Mc, H, 2, N] */
  float *dbc_group;                        /* [Mc, G, 2, N] */
  void *dang_head;                         /* [Mc, H, S] act */
  float *part;                             /* [B, H, 2 + 2N] */
  float *part_norm;                        /* [B, H, P] */
  float *chunk_scratch;                    /* the chunked scan's scratch (m3k_scan_chunk_scratch; or NULL) */
  float *chunk_states;                     /* per layer: what the chunked forward keeps for its backward (training; or NULL) */
  float *wcontrib;                         /* [Mc, 2N] the B_norm | C_norm weight-gradient terms */
  float *norm_partials;                    /* [L + 1] x [chunks, dm + 2N]: norm weight column-sum chunks (norm_job) */
  float *colsum_scratch;                   /* the head's and the input's bias column sums */
  float *logits;                           /* lm: the head's [lm_rows, V] in training (act), the last positions'
                                              [B, V] for read_logits (float32); mse: [Mc, od] predictions */
  void *dlogits;                           /* lm: [lm_rows, V] act */
  float *dpred;                            /* mse: [Mc, od] */
  void *dpred_act;                         /* mse: [Mc, od] act (= dpred for f32) */
  double *row_loss;                        /* [Mc] */
  int32_t *row_hit;                        /* [Mc] */
  float *in_f32;                           /* [Mc, in_w] "features" input */
  void *in_act;                            /* [Mc, in_w] act (= in_f32 for f32) */
  int32_t *tokens, *targets, *perm, *seg_tok; /* [Mc] */
  int32_t *seg_start;                      /* [Mc + 1] */
  float *tvals;                            /* [Mc, od] */
  uint8_t *mask, *resets;                  /* [Mc] */
  float *d_out;                            /* [Mc, dm] */
  double *norm_part;                       /* [norm_blocks] */
  int64_t norm_blocks;
  m3k_step *d_step;
  m3k_batch_info *d_info;
  m3k_metrics *d_metrics;
  void *workspace, *workspace_side;
  m3k_decode_layer *decode_layers;         /* [L] the fused one-token step's per-layer pointers (or NULL) */

  /* ---- pinned host staging (same capacities) ---- */
  char *pin;
  size_t pin_bytes;
  m3k_step *h_step;
  m3k_batch_info *h_info;
  m3k_metrics *h_metrics;
  float *h_in, *h_tvals, *h_dout;
  int32_t *h_tokens, *h_targets, *h_perm, *h_seg_start, *h_seg_tok;
  uint8_t *h_mask, *h_resets;
  float *h_logits; /* inference, "lm": [B, V] staging of read_logits (a pageable copy is ~5x slower) */
  int32_t *hist; /* [vocab] host scratch of the counting sort */

  /* ---- graphs ---- */
  int graph_mode;
  graph_entry graphs[MAX_GRAPHS];
  int n_graphs;
  uint64_t tick;
  int32_t last_rows, last_len;
  prof pf;
  int infer;       /* forward only (inference): see the header */
  int infer_graph; /* inference: one-token steps replay graphs */
  size_t decode_smem; /* inference: the most shared memory the fused one-token step takes; 0: per-layer launches */
  int32_t decode_cluster; /* the fused step's CTAs per row at most (m3k_decode_prepare) */
  int32_t sms;            /* the device's multiprocessors */
  int fwd_carry;  /* the last training forward started from the carried state */
  int last_carry; /* carry of the last forward or step (the default shape of capture_graph) */
};

/* ---- errors ------------------------------------------------------------------------------------ */

static int sticky(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
    case cudaErrorContextIsDestroyed:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorUnknown:
      return 1;
    default:
      return 0;
  }
}

static m3_status cuda_fail(backend *be, cudaError_t e, const char *call, const char *file, int line) {
  if (sticky(e)) {
    be->poisoned = 1;
    return m3_fail_at(M3_ERR_POISONED, file, line,
                      "%s: %s (%s); the CUDA context is broken and this trainer is poisoned (create a new one)",
                      call, cudaGetErrorName(e), cudaGetErrorString(e));
  }
  cudaGetLastError(); /* clear a non-sticky error so the next call starts clean */
  if (e == cudaErrorMemoryAllocation)
    return m3_fail_at(M3_ERR_MEMORY, file, line, "%s: out of device memory (%s)", call, cudaGetErrorString(e));
  return m3_fail_at(M3_ERR_CUDA, file, line, "%s failed: %s (%s)", call, cudaGetErrorName(e), cudaGetErrorString(e));
}

/* Checks a CUDA runtime call or a kernel launcher's cudaError_t. */
#define CK(call)                                                                   \
  do {                                                                             \
    cudaError_t ck_e_ = (call);                                                    \
    if (ck_e_ != cudaSuccess) return cuda_fail(be, ck_e_, #call, __FILE__, __LINE__); \
  } while (0)

/* A GEMM of context g on stream st; a failed cuBLASLt call may hide a sticky error: look before reporting. */
static m3_status gemm_on(backend *be, gemm_ctx *g, cudaStream_t st, const gemm_op *op) {
  m3_status s = m3_gemm(g, st, op);
  if (s != M3_OK) {
    cudaError_t e = cudaPeekAtLastError();
    if (sticky(e)) return cuda_fail(be, e, "cublasLtMatmul", __FILE__, __LINE__);
  }
  return s;
}
static m3_status gemm_checked(backend *be, const gemm_op *op) { return gemm_on(be, &be->gm, be->st, op); }

#define ENTER(be)                                                                                     \
  do {                                                                                                \
    if ((be)->poisoned)                                                                               \
      return m3_fail(M3_ERR_POISONED, "this CUDA trainer hit a sticky CUDA error earlier and cannot be used"); \
    CK(cudaSetDevice((be)->dev));                                                                     \
  } while (0)

/* ---- arena views ------------------------------------------------------------------------------------ */

static int64_t rup(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
static int64_t slice(int64_t elems) { return rup(elems, SLICE_ALIGN); }

typedef struct carver {
  char *base;
  size_t off;
} carver;

static void *take(carver *c, size_t bytes) {
  const size_t o = (c->off + 255) & ~(size_t)255;
  c->off = o + (bytes ? bytes : 1);
  return c->base ? c->base + o : NULL;
}

#define TAKE_F(c, n) ((float *)take((c), (size_t)(n) * sizeof(float)))

static void carve_device(backend *be, carver *c) {
  const m3_dims *d = be->d;
  const int64_t L = d->L, Mc = be->Mc, total = be->lay->total, B = be->B, H = d->H, P = d->P, N = d->N, S = d->S;
  const int64_t dm = d->dm, E = d->E, dipp = be->kd.dipp, G = d->G;
  const size_t ab = be->act_bytes;
  /* inference: one activation slot (two residual slots), no backward buffers */
  const int64_t Ls = be->infer ? 1 : L, Lr = be->infer ? 2 : L + 1, Mg = be->infer ? 0 : Mc;
  const int64_t tg = be->infer ? 0 : total, ti = be->infer ? 0 : 1;
  be->params = TAKE_F(c, total);
  be->grads = TAKE_F(c, tg);
  be->adam_m = TAKE_F(c, tg);
  be->adam_v = TAKE_F(c, tg);
  be->shadow = be->prec != M3K_F32 ? take(c, (size_t)total * ab) : NULL;
  be->decay_flags = take(c, (size_t)(total / M3_ALIGN + 1));
  const int64_t n_angle = L * B * H * S, n_ssm = L * B * H * P * N, n_k = L * B * H * N, n_v = L * B * H * P;
  be->s_angle = TAKE_F(c, n_angle);
  be->s_ssm = TAKE_F(c, n_ssm);
  be->s_k = TAKE_F(c, n_k);
  be->s_v = TAKE_F(c, n_v);
  be->i_angle = TAKE_F(c, ti * n_angle);
  be->i_ssm = TAKE_F(c, ti * n_ssm);
  be->i_k = TAKE_F(c, ti * n_k);
  be->i_v = TAKE_F(c, ti * n_v);
  be->resid = TAKE_F(c, Lr * slice(Mc * dm));
  be->xn = take(c, (size_t)(Ls * slice(Mc * dm)) * ab);
  be->rstd = TAKE_F(c, Ls * slice(Mc));
  be->proj = take(c, (size_t)(Ls * slice(Mc * dipp)) * ab);
  be->bc_hat = TAKE_F(c, Ls * slice(Mc * 2 * G * N));
  be->bc_rstd = TAKE_F(c, Ls * slice(Mc * 2 * G));
  be->theta = TAKE_F(c, Ls * slice(Mc * H * S));
  be->y = take(c, (size_t)(Ls * slice(Mc * E)) * ab);
  be->y_rstd = TAKE_F(c, d->outproj_norm ? Ls * slice(Mc * H) : 1);
  be->gated = take(c, (size_t)(Ls * slice(Mc * E)) * ab);
  be->out = TAKE_F(c, Mc * dm);
  be->out_act = be->prec != M3K_F32 ? take(c, (size_t)(Mc * dm) * ab) : (void *)be->out;
  be->out_rstd = TAKE_F(c, Mc);
  be->dout = TAKE_F(c, Mg * dm);
  be->dresid = TAKE_F(c, Mg * dm);
  be->dxn = TAKE_F(c, Mg * dm);
  be->dresid_act = be->prec != M3K_F32 ? take(c, (size_t)(Mg * dm) * ab) : (void *)be->dresid;
  be->dproj = take(c, (size_t)(Mg * dipp) * ab);
  be->dgated = take(c, (size_t)(Mg * E) * ab);
  const int64_t n_dy = ti * m3k_scan_dy_floats(&be->scan, be->prec, (int32_t)B, be->T, (int32_t)E);
  be->dy = n_dy > 0 ? TAKE_F(c, n_dy) : NULL;
  be->dthq = TAKE_F(c, Mg * H * S);
  be->psi = TAKE_F(c, Mg * H);
  be->dbc_head = TAKE_F(c, Mg * H * 2 * N);
  be->dbc_group = TAKE_F(c, Mg * G * 2 * N);
  be->dang_head = take(c, (size_t)(Mg * H * S) * ab);
  be->part = TAKE_F(c, ti * B * H * (2 + 2 * N));
  be->part_norm = TAKE_F(c, ti * B * H * P);
  const int64_t n_cs = m3k_scan_chunk_scratch(&be->scan, be->prec, (int32_t)B, be->T, (int32_t)H, (int32_t)P,
                                              (int32_t)N, !be->infer);
  be->chunk_scratch = n_cs > 0 ? TAKE_F(c, n_cs) : NULL;
  const int64_t n_st = ti * m3k_scan_chunk_states(&be->scan, be->prec, (int32_t)B, be->T, (int32_t)H, (int32_t)P,
                                                 (int32_t)N);
  be->chunk_states = n_st > 0 ? TAKE_F(c, L * slice(n_st)) : NULL;
  be->wcontrib = TAKE_F(c, Mg * 2 * N);
  be->norm_partials = TAKE_F(c, (L + 1) * m3k_colsum_partials(Mg, (int32_t)(dm + 2 * N)));
  be->colsum_scratch = TAKE_F(c, m3k_colsum_partials(Mg, (int32_t)(be->od > dm ? be->od : dm)));
  be->logits = be->dlogits = NULL;
  be->dpred = NULL;
  be->dpred_act = NULL;
  if (d->head == M3_HEAD_LM) {
    const size_t head = (size_t)(be->infer ? 0 : be->lm_rows * d->vocab) * ab, last = (size_t)(B * d->vocab) * 4;
    be->logits = take(c, head > last ? head : last);
    be->dlogits = take(c, (size_t)((be->infer ? 0 : be->lm_rows) * d->vocab) * ab);
  } else if (d->head == M3_HEAD_MSE) {
    be->logits = TAKE_F(c, Mc * be->od);
    be->dpred = TAKE_F(c, Mc * be->od);
    be->dpred_act = be->prec != M3K_F32 ? take(c, (size_t)(Mc * be->od) * ab) : (void *)be->dpred;
  }
  be->row_loss = take(c, (size_t)Mc * sizeof(double));
  be->row_hit = take(c, (size_t)Mc * sizeof(int32_t));
  be->in_f32 = NULL;
  be->in_act = NULL;
  if (d->input == M3_INPUT_FEATURES) { /* ("identity" inputs go straight into resid[0]) */
    be->in_f32 = TAKE_F(c, Mc * be->in_w);
    be->in_act = be->prec != M3K_F32 ? take(c, (size_t)(Mc * be->in_w) * ab) : (void *)be->in_f32;
  } else if (d->input == M3_INPUT_TOKENS) {
    be->tokens = take(c, (size_t)Mc * sizeof(int32_t));
    be->perm = take(c, (size_t)Mc * sizeof(int32_t));
    be->seg_tok = take(c, (size_t)Mc * sizeof(int32_t));
    be->seg_start = take(c, (size_t)(Mc + 1) * sizeof(int32_t));
  }
  be->targets = d->head == M3_HEAD_LM ? take(c, (size_t)Mc * sizeof(int32_t)) : NULL;
  be->tvals = d->head == M3_HEAD_MSE ? TAKE_F(c, Mc * be->od) : NULL;
  be->mask = d->head == M3_HEAD_MSE ? take(c, (size_t)Mc) : NULL;
  be->d_out = d->head == M3_HEAD_NONE ? TAKE_F(c, Mc * dm) : NULL;
  be->resets = take(c, (size_t)Mc);
  be->norm_blocks = m3k_norm_blocks(total);
  be->norm_part = take(c, (size_t)be->norm_blocks * sizeof(double));
  be->d_step = take(c, sizeof(m3k_step));
  be->d_info = take(c, sizeof(m3k_batch_info));
  be->d_metrics = take(c, sizeof(m3k_metrics));
  be->workspace = take(c, WORKSPACE_BYTES);
  be->workspace_side = take(c, be->infer ? 0 : WORKSPACE_BYTES);
  be->decode_layers = be->decode_smem ? take(c, (size_t)L * sizeof(m3k_decode_layer)) : NULL;
}

static void carve_pinned(backend *be, carver *c) {
  const m3_dims *d = be->d;
  const int64_t Mc = be->Mc;
  be->h_step = take(c, sizeof(m3k_step));
  be->h_info = take(c, sizeof(m3k_batch_info));
  be->h_metrics = take(c, sizeof(m3k_metrics));
  be->h_in = d->input != M3_INPUT_TOKENS ? TAKE_F(c, Mc * be->in_w) : NULL;
  be->h_tokens = d->input == M3_INPUT_TOKENS ? take(c, (size_t)Mc * sizeof(int32_t)) : NULL;
  be->h_perm = d->input == M3_INPUT_TOKENS ? take(c, (size_t)Mc * sizeof(int32_t)) : NULL;
  be->h_seg_tok = d->input == M3_INPUT_TOKENS ? take(c, (size_t)Mc * sizeof(int32_t)) : NULL;
  be->h_seg_start = d->input == M3_INPUT_TOKENS ? take(c, (size_t)(Mc + 1) * sizeof(int32_t)) : NULL;
  be->h_targets = d->head == M3_HEAD_LM ? take(c, (size_t)Mc * sizeof(int32_t)) : NULL;
  be->h_tvals = d->head == M3_HEAD_MSE ? TAKE_F(c, Mc * be->od) : NULL;
  be->h_mask = d->head == M3_HEAD_MSE ? take(c, (size_t)Mc) : NULL;
  be->h_dout = d->head == M3_HEAD_NONE ? TAKE_F(c, Mc * d->dm) : NULL;
  be->h_resets = take(c, (size_t)Mc);
  be->h_logits = be->infer && d->head == M3_HEAD_LM ? TAKE_F(c, (int64_t)be->B * d->vocab) : NULL;
}

/* per-layer slices (inference: every layer uses slot 0, the residual stream slots 0 and 1) */
static int64_t lslot(const backend *be, int l) { return be->infer ? 0 : l; }
static float *resid_l(const backend *be, int l) {
  return be->resid + (be->infer ? l & 1 : l) * slice(be->Mc * be->d->dm);
}
static void *xn_l(const backend *be, int l) {
  return (char *)be->xn + (size_t)(lslot(be, l) * slice(be->Mc * be->d->dm)) * be->act_bytes;
}
static float *rstd_l(const backend *be, int l) { return be->rstd + lslot(be, l) * slice(be->Mc); }
static void *proj_l(const backend *be, int l) {
  return (char *)be->proj + (size_t)(lslot(be, l) * slice(be->Mc * be->kd.dipp)) * be->act_bytes;
}
static float *bc_hat_l(const backend *be, int l) { return be->bc_hat + lslot(be, l) * slice(be->Mc * 2 * be->d->G * be->d->N); }
static float *bc_rstd_l(const backend *be, int l) { return be->bc_rstd + lslot(be, l) * slice(be->Mc * 2 * be->d->G); }
static float *theta_l(const backend *be, int l) { return be->theta + lslot(be, l) * slice(be->Mc * be->d->H * be->d->S); }
static float *chunk_states_l(const backend *be, int l) {
  if (!be->chunk_states) return NULL;
  const m3_dims *d = be->d;
  return be->chunk_states + l * slice(m3k_scan_chunk_states(&be->scan, be->prec, (int32_t)be->B, be->T, (int32_t)d->H,
                                                             (int32_t)d->P, (int32_t)d->N));
}
static float *y_rstd_l(const backend *be, int l) {
  return be->d->outproj_norm ? be->y_rstd + lslot(be, l) * slice(be->Mc * be->d->H) : be->y_rstd;
}
static void *y_l(const backend *be, int l) {
  return (char *)be->y + (size_t)(lslot(be, l) * slice(be->Mc * be->d->E)) * be->act_bytes;
}
static void *gated_l(const backend *be, int l) {
  return (char *)be->gated + (size_t)(lslot(be, l) * slice(be->Mc * be->d->E)) * be->act_bytes;
}
/* GEMM operand of a weight: the 16-bit shadow, or the master for f32 */
static const void *wgt(const backend *be, int64_t off) {
  return be->prec != M3K_F32 ? (const void *)((const char *)be->shadow + (size_t)off * be->act_bytes)
                             : (const void *)(be->params + off);
}

/* ---- GEMM helpers (row-major, gemm.h) ------------------------------------------------------------------ */

/* D[M, N] (+)= A[M, K] B[N, K]^T */
static m3_status mm_nt(backend *be, int64_t M, int64_t N, int64_t K, const void *A, int64_t lda, const void *B,
                       int64_t ldb, const float *C, void *D, int64_t ldd, int d_kind, float beta) {
  gemm_op o = {0, 1, M, N, K, A, lda, G_ACT, B, ldb, G_ACT, C, D, ldd, d_kind, beta};
  return gemm_checked(be, &o);
}

/* D[M, N] = A[M, K] B[K, N] (D float32 or, d_kind G_ACT, the activation type) */
static gemm_op nn_op(int64_t M, int64_t N, int64_t K, const void *A, int64_t lda, const void *B, int64_t ldb, void *D,
                     int64_t ldd, int d_kind) {
  const gemm_op o = {0, 0, M, N, K, A, lda, G_ACT, B, ldb, G_ACT, NULL, D, ldd, d_kind, 0.0f};
  return o;
}
static m3_status mm_nn(backend *be, int64_t M, int64_t N, int64_t K, const void *A, int64_t lda, const void *B,
                       int64_t ldb, void *D, int64_t ldd, int d_kind) {
  const gemm_op o = nn_op(M, N, K, A, lda, B, ldb, D, ldd, d_kind);
  return gemm_checked(be, &o);
}

/* G[M, N] += A[K, M]^T B[K, N] (weight gradients, float32 accumulation into the arena) */
static gemm_op tn_acc_op(int64_t M, int64_t N, int64_t K, const void *A, int64_t lda, const void *B, int64_t ldb,
                         float *G, int64_t ldg) {
  const gemm_op o = {1, 0, M, N, K, A, lda, G_ACT, B, ldb, G_ACT, G, G, ldg, G_F32, 1.0f};
  return o;
}
static m3_status mm_tn_acc(backend *be, int64_t M, int64_t N, int64_t K, const void *A, int64_t lda, const void *B,
                           int64_t ldb, float *G, int64_t ldg) {
  const gemm_op o = tn_acc_op(M, N, K, A, lda, B, ldb, G, ldg);
  return gemm_checked(be, &o);
}

/* Layer l's out_proj (dW_out += dresid^T gated) and in_proj (dW_in += dproj^T xn) weight gradients over a
 * window of M positions (tn_acc_op). */
static gemm_op wout_op(const backend *be, int l, int64_t M) {
  const int64_t dm = be->d->dm, E = be->d->E;
  return tn_acc_op(dm, E, M, be->dresid_act, dm, gated_l(be, l), E, be->grads + be->lay->layer[l].out_proj, E);
}
static gemm_op win_op(const backend *be, int l, int64_t M) {
  const int64_t dm = be->d->dm;
  return tn_acc_op(be->d->dip, dm, M, be->dproj, be->kd.dipp, xn_l(be, l), dm, be->grads + be->lay->layer[l].in_proj,
                   dm);
}

/* A weight gradient of the backward (wout_op, win_op): a rider of the next launch that takes riders when its window
 * is a few positions (K <= M3K_RIDER_K, riders.cuh), else a GEMM on the side stream, forked here: the caller waits
 * for it (wait_side) before anything overwrites its operands. */
static m3_status side_wgrad(backend *be, m3k_riders *ride, const gemm_op *o, side_gemm *sg) {
  if (o->K <= M3K_RIDER_K) {
    const m3k_wgrad w = {o->A, o->B, (float *)o->D, o->lda, o->ldb, o->ldd, (int32_t)o->M, (int32_t)o->N,
                         (int32_t)o->K};
    ride->wgrad = w;
    return M3_OK;
  }
  CK(cudaEventRecord(be->fork, be->st));
  CK(cudaStreamWaitEvent(be->side, be->fork, 0));
  TRY(gemm_on(be, &be->gm_side, be->side, o));
  CK(cudaEventRecord(sg->done, be->side));
  sg->pending = 1;
  return M3_OK;
}

/* *beside = 1 when the weight gradient dw is a GEMM (not a rider) that fits on the device beside the data
 * gradient dx (their waves add up to at most one), so that it runs there instead of after it. */
static m3_status fits_beside(backend *be, const gemm_op *dw, const gemm_op *dx, int *beside) {
  float w_dx = 0, w_dw = 0;
  *beside = 0;
  if (dw->K <= M3K_RIDER_K) return M3_OK;
  TRY(m3_gemm_waves(&be->gm, dx, &w_dx));
  TRY(m3_gemm_waves(&be->gm_side, dw, &w_dw));
  *beside = w_dx + w_dw <= 1.0f;
  return M3_OK;
}

/* The main stream waits for a side GEMM of side_wgrad (if one is pending) */
static m3_status wait_side(backend *be, side_gemm *sg) {
  if (sg->pending) CK(cudaStreamWaitEvent(be->st, sg->done, 0));
  sg->pending = 0;
  return M3_OK;
}

/* ---- the step sequence ----------------------------------------------------------------------------------- */

static void mark(backend *be, prof_phase ph) {
  prof *p = &be->pf;
  if (!p->on || p->capturing || p->n >= PROF_MARKS) return;
  if (cudaEventRecord(p->ev[p->n], be->st) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  p->phase[p->n++] = ph;
}

/* After a synchronised call: charges the time between marks to their phases. */
static void prof_collect(backend *be) {
  prof *p = &be->pf;
  if (!p->on || p->n == 0) return;
  for (int i = 0; p->steps > 0 && i + 1 < p->n; i++) { /* the first call (module loading) is not counted */
    float ms = 0;
    if (cudaEventElapsedTime(&ms, p->ev[i], p->ev[i + 1]) == cudaSuccess) p->ms[p->phase[i]] += ms;
  }
  cudaGetLastError();
  p->n = 0;
  p->steps++;
}

static m3k_scan_args scan_args(const backend *be, int l, int32_t rows, int32_t len, int carry_in, int write_final,
                               int train_in) {
  const m3_dims *d = be->d;
  const layer_offsets *lo = &be->lay->layer[l];
  const int64_t BH = (int64_t)be->B * d->H;
  m3k_scan_args a;
  memset(&a, 0, sizeof a);
  a.d = be->kd;
  a.rows = rows;
  a.len = len;
  a.proj = proj_l(be, l);
  a.bc_hat = bc_hat_l(be, l);
  a.bc_rstd = bc_rstd_l(be, l);
  a.B_norm = be->params + lo->B_norm;
  a.C_norm = be->params + lo->C_norm;
  a.dt_bias = be->params + lo->dt_bias;
  a.D = be->params + lo->D;
  a.B_bias = be->params + lo->B_bias;
  a.C_bias = be->params + lo->C_bias;
  a.out_norm = d->outproj_norm ? be->params + lo->out_norm : NULL;
  a.resets = be->resets;
  if (carry_in) { /* training reads the saved copy, evaluation the carried state itself */
    const float *ang = train_in ? be->i_angle : be->s_angle, *ssm = train_in ? be->i_ssm : be->s_ssm;
    const float *k = train_in ? be->i_k : be->s_k, *v = train_in ? be->i_v : be->s_v;
    a.in_angle = ang + l * BH * d->S;
    a.in_ssm = ssm + l * BH * d->P * d->N;
    a.in_k = k + l * BH * d->N;
    a.in_v = v + l * BH * d->P;
  }
  if (write_final) {
    a.fin_angle = be->s_angle + l * BH * d->S;
    a.fin_ssm = be->s_ssm + l * BH * d->P * d->N;
    a.fin_k = be->s_k + l * BH * d->N;
    a.fin_v = be->s_v + l * BH * d->P;
  }
  a.theta = theta_l(be, l);
  a.y = y_l(be, l);
  a.y_rstd = y_rstd_l(be, l);
  a.gated = gated_l(be, l);
  a.dgated = be->dgated;
  a.dproj = be->dproj;
  a.dy = be->dy;
  a.dthq = be->dthq;
  a.psi = be->psi;
  a.dbc_head = be->dbc_head;
  a.dbc_group = be->dbc_group;
  a.wcontrib = be->wcontrib;
  a.dang_head = be->dang_head;
  a.part = be->part;
  a.part_norm = be->part_norm;
  a.chunk_scratch = be->chunk_scratch;
  a.chunk_states = chunk_states_l(be, l);
  return a;
}

/* Rows [0, rows) of every layer: the saved incoming state := the carried state (back = 0: a training forward
 * with carry keeps where it started, for the backward), or back (back = 1: rewind_state). */
static m3_status copy_incoming(backend *be, int32_t rows, int back) {
  const m3_dims *d = be->d;
  float *saved[4] = {be->i_angle, be->i_ssm, be->i_k, be->i_v};
  float *live[4] = {be->s_angle, be->s_ssm, be->s_k, be->s_v};
  const int64_t per_row[4] = {(int64_t)d->H * d->S, (int64_t)d->H * d->P * d->N, (int64_t)d->H * d->N,
                              (int64_t)d->H * d->P};
  for (int i = 0; i < 4; i++) {
    if (per_row[i] == 0) continue;
    const size_t pitch = (size_t)(be->B * per_row[i]) * sizeof(float), width = (size_t)(rows * per_row[i]) * sizeof(float);
    CK(cudaMemcpy2DAsync(back ? live[i] : saved[i], pitch, back ? saved[i] : live[i], pitch, width, (size_t)d->L,
                         cudaMemcpyDeviceToDevice, be->st));
  }
  return M3_OK;
}

/* The input layer of M positions into resid[0] from tokens (int32 [M]) or features (float32 [M, in_w]), either the
 * device copies upload_inputs makes or the pinned staging itself (read by the kernels through the
 * unified address space); identity input is uploaded straight into resid[0] (nothing to do). */
static m3_status enq_input(backend *be, int64_t M, const int32_t *tokens, const float *in_f32) {
  const m3_dims *d = be->d;
  const m3_layout *lay = be->lay;
  const int64_t dm = d->dm;
  float *h0 = resid_l(be, 0);
  switch (d->input) {
    case M3_INPUT_FEATURES: {
      const void *in = in_f32;
      if (be->prec != M3K_F32) {
        CK(m3k_to_act(be->st, be->prec, in_f32, be->in_act, M * be->in_w));
        in = be->in_act;
      }
      CK(m3k_fill_rows(be->st, be->params + lay->input_b, h0, M, d->dm));
      TRY(mm_nt(be, M, dm, be->in_w, in, be->in_w, wgt(be, lay->input_w), be->in_w, h0, h0, dm, G_F32, 1.0f));
      break;
    }
    case M3_INPUT_IDENTITY:
      break;
    default:
      CK(m3k_embed_fwd(be->st, tokens, be->params + lay->embedding, h0, M, d->dm));
      break;
  }
  return M3_OK;
}

static m3_status enq_forward(backend *be, int32_t rows, int32_t len, int carry, int train) {
  const m3_dims *d = be->d;
  const m3_layout *lay = be->lay;
  const int64_t M = (int64_t)rows * len, dm = d->dm;
  mark(be, PH_INPUT);
  if (carry && train && !be->infer) TRY(copy_incoming(be, rows, 0));
  if (train) be->fwd_carry = carry;
  TRY(enq_input(be, M, be->tokens, be->in_f32));
  for (int l = 0; l < d->L; l++) {
    const layer_offsets *lo = &lay->layer[l];
    mark(be, PH_NORM_F);
    CK(m3k_rmsnorm_fwd(be->st, be->prec, resid_l(be, l), be->params + lo->norm, xn_l(be, l), NULL, rstd_l(be, l), M,
                       d->dm));
    mark(be, PH_INPROJ_F);
    TRY(mm_nt(be, M, d->dip, dm, xn_l(be, l), dm, wgt(be, lo->in_proj), dm, NULL, proj_l(be, l), be->kd.dipp, G_ACT,
              0.0f));
    m3k_scan_args a = scan_args(be, l, rows, len, carry, train || be->infer, train);
    if (be->infer && len == 1) a.bc_hat = NULL; /* one-token inference: B_hat, C_hat not kept (no backward) */
    mark(be, PH_SCAN_F);
    CK(m3k_scan_fwd(be->st, be->prec, &be->scan, &a));
    mark(be, PH_OUTPROJ_F);
    TRY(mm_nt(be, M, dm, d->E, gated_l(be, l), d->E, wgt(be, lo->out_proj), d->E, resid_l(be, l), resid_l(be, l + 1),
              dm, G_F32, 1.0f));
  }
  mark(be, PH_NORM_F);
  CK(m3k_rmsnorm_fwd(be->st, be->prec, resid_l(be, d->L), be->params + lay->norm_f,
                     be->prec != M3K_F32 ? be->out_act : NULL, be->out, be->out_rstd, M, d->dm));
  return M3_OK;
}

/* The head's loss (row losses -> metrics) and, with want_grad, dout = weight dL/d out and the
 * head's parameter gradients (+=). */
static m3_status enq_head(backend *be, int32_t rows, int32_t len, int want_grad) {
  const m3_dims *d = be->d;
  const int64_t M = (int64_t)rows * len, dm = d->dm;
  mark(be, PH_HEAD);
  switch (d->head) {
    case M3_HEAD_NONE: /* the final norm's backward reads d_out scaled by the step's weight */
      return M3_OK;
    case M3_HEAD_LM: {
      const int64_t w_off = m3_layout_lm_weight(be->lay, d), V = d->vocab;
      for (int64_t i0 = 0; i0 < M; i0 += be->lm_rows) {
        const int64_t nb = M - i0 < be->lm_rows ? M - i0 : be->lm_rows;
        const void *outb = (const char *)be->out_act + (size_t)(i0 * dm) * be->act_bytes;
        TRY(mm_nt(be, nb, V, dm, outb, dm, wgt(be, w_off), dm, NULL, be->logits, V, G_ACT, 0.0f));
        CK(m3k_ce(be->st, be->prec, be->d_step, be->d_info, be->logits, be->targets + i0,
                  want_grad ? be->dlogits : NULL, be->row_loss + i0, be->row_hit + i0, nb, (int32_t)V, want_grad));
        if (want_grad) {
          TRY(mm_nn(be, nb, dm, V, be->dlogits, V, wgt(be, w_off), dm, be->dout + i0 * dm, dm, G_F32));
          TRY(mm_tn_acc(be, V, dm, nb, be->dlogits, V, outb, dm, be->grads + w_off, dm));
        }
      }
      CK(m3k_loss_sum(be->st, be->row_loss, be->row_hit, M, be->d_metrics));
      return M3_OK;
    }
    default: {
      const int64_t od = be->od;
      TRY(mm_nt(be, M, od, dm, be->out_act, dm, wgt(be, be->lay->readout_w), dm, NULL, be->logits, od, G_F32, 0.0f));
      CK(m3k_mse(be->st, be->prec, be->d_step, be->d_info, be->logits, be->params + be->lay->readout_b, be->tvals,
                 be->mask, be->dpred, be->prec != M3K_F32 ? be->dpred_act : NULL, be->row_loss, M, (int32_t)od,
                 want_grad));
      if (want_grad) {
        const m3k_colsum_job bias = {be->dpred, od, (int32_t)od, (int32_t)od, be->grads + be->lay->readout_b, NULL,
                                     be->colsum_scratch};
        CK(m3k_colsum(be->st, &bias, M));
        TRY(mm_nn(be, M, dm, od, be->dpred_act, od, wgt(be, be->lay->readout_w), dm, be->dout, dm, G_F32));
        TRY(mm_tn_acc(be, od, dm, M, be->dpred_act, od, be->out_act, dm, be->grads + be->lay->readout_w, dm));
      }
      CK(m3k_loss_sum(be->st, be->row_loss, NULL, M, be->d_metrics));
      return M3_OK;
    }
  }
}

/* The column sums of the norm weights' gradients over M positions: layer l's norm (l = L: norm_f; taken from
 * x, r and dy: src unused) and B_norm | C_norm (from wcontrib). Beyond one chunk of positions their chunk
 * sums go to layer l's slice of norm_partials (the norm's, then B/C's), and norm_sums_finish adds them. */
static float *norm_partials_l(const backend *be, int l, int64_t M) {
  if (m3k_colsum_chunks(M) <= 1) return NULL;
  return be->norm_partials + l * m3k_colsum_partials(be->Mc, be->d->dm + 2 * be->d->N);
}

static m3k_colsum_job norm_job(const backend *be, int l, int64_t M) {
  const int32_t dm = be->d->dm;
  const int64_t off = l == be->d->L ? be->lay->norm_f : be->lay->layer[l].norm;
  const m3k_colsum_job job = {NULL, dm, dm, dm, be->grads + off, NULL, norm_partials_l(be, l, M)};
  return job;
}

static m3k_colsum_job bc_norm_job(const backend *be, int l, int64_t M) {
  const int32_t N = be->d->N;
  const layer_offsets *lo = &be->lay->layer[l];
  float *part = norm_partials_l(be, l, M);
  const m3k_colsum_job job = {be->wcontrib, 2 * N, 2 * N, N, be->grads + lo->B_norm, be->grads + lo->C_norm,
                              part ? part + m3k_colsum_chunks(M) * be->d->dm : NULL};
  return job;
}

/* The final pass of the norm weights' column sums (one launch for up to M3K_FINISH_JOBS of them): a batch
 * that enq_backward fills and runs when full or done. */
typedef struct norm_sums {
  m3k_colsum_job job[M3K_FINISH_JOBS];
  int32_t n;
} norm_sums;

static m3_status norm_sums_finish(backend *be, norm_sums *ns, int64_t M) {
  if (ns->n) CK(m3k_colsum_finish(be->st, ns->job, ns->n, M));
  ns->n = 0;
  return M3_OK;
}

static m3_status norm_sums_add(backend *be, norm_sums *ns, const m3k_colsum_job *job, int64_t M) {
  if (!job->partials) return M3_OK; /* one chunk: added in its launch */
  if (ns->n == M3K_FINISH_JOBS) TRY(norm_sums_finish(be, ns, M));
  ns->job[ns->n++] = *job;
  return M3_OK;
}

static m3_status enq_backward(backend *be, int32_t rows, int32_t len, int zero_grads) {
  const m3_dims *d = be->d;
  const m3_layout *lay = be->lay;
  const int64_t M = (int64_t)rows * len, dm = d->dm, E = d->E;
  float *g = be->grads;
  if (zero_grads) CK(cudaMemsetAsync(g, 0, (size_t)lay->total * sizeof(float), be->st));
  TRY(enq_head(be, rows, len, 1));
  mark(be, PH_NORM_B);
  void *dr_act = be->prec != M3K_F32 ? be->dresid_act : NULL;
  const int none = d->head == M3_HEAD_NONE;
  norm_sums ns;
  ns.n = 0;
  const m3k_colsum_job norm_f = norm_job(be, d->L, M);
  CK(m3k_rmsnorm_bwd(be->st, be->prec, resid_l(be, d->L), be->params + lay->norm_f, be->out_rstd,
                     none ? be->d_out : be->dout, none ? be->d_step : NULL, be->dresid, dr_act, &norm_f, NULL, M,
                     d->dm, 0));
  TRY(norm_sums_add(be, &ns, &norm_f, M));
  for (int l = d->L - 1; l >= 0; l--) {
    const layer_offsets *lo = &lay->layer[l];
    /* out_proj: dgated = dresid W_out, dW_out += dresid^T gated (riding with the B/C norm backward, or beside) */
    mark(be, PH_OUTPROJ_B);
    m3k_riders with_bcnorm, with_norm;
    memset(&with_bcnorm, 0, sizeof with_bcnorm);
    memset(&with_norm, 0, sizeof with_norm);
    const m3k_scan_args a = scan_args(be, l, rows, len, be->fwd_carry, 0, 1);
    /* Where the weight gradients fork (kernels/NOTES.md runs 223-226): dW_out after dX, beside the scan, but
     * after a scan that fills the device, which a GEMM beside it would delay; dW_in after dX, or beside it
     * where both fit the device at once (fits_beside). */
    const int scan_fills = m3k_scan_bwd_fills_device(be->prec, &be->scan, &a);
    const gemm_op dw_out = wout_op(be, l, M);
    TRY(mm_nn(be, M, E, dm, be->dresid_act, dm, wgt(be, lo->out_proj), E, be->dgated, E, G_ACT));
    if (!scan_fills) TRY(side_wgrad(be, &with_bcnorm, &dw_out, &be->wout));
    /* gate, scan, B/C norm, the small-parameter gradients (they overwrite dproj: the layer above's in_proj
     * weight gradient is done first) */
    TRY(wait_side(be, &be->win));
    mark(be, PH_SCAN_B);
    CK(m3k_scan_bwd(be->st, be->prec, &be->scan, &a));
    if (scan_fills) TRY(side_wgrad(be, &with_bcnorm, &dw_out, &be->wout));
    mark(be, PH_BCNORM_B);
    const m3k_scan_partials sp = {be->part, be->part_norm, rows, g + lo->dt_bias, g + lo->D, g + lo->B_bias,
                                  g + lo->C_bias, d->outproj_norm ? g + lo->out_norm : NULL};
    const int bc = m3k_scan_bwd_bc_stage(be->prec, &be->scan, &a);
    const float *dbc = bc == M3K_BC_NORMED ? NULL : bc == M3K_BC_SUMMED ? be->dbc_group : be->dbc_head;
    CK(m3k_bcnorm_bwd(be->st, be->prec, &be->kd, proj_l(be, l), be->params + lo->B_norm, be->params + lo->C_norm,
                      bc_rstd_l(be, l), dbc, bc == M3K_BC_SUMMED ? 1 : be->kd.hpg, be->dang_head, be->dproj,
                      be->wcontrib, &sp, &with_bcnorm, M));
    /* the B_norm | C_norm weight gradients (wcontrib's column sums) ride with the layer norm's backward */
    with_norm.colsum = bc_norm_job(be, l, M);
    /* in_proj: dxn = dproj W_in, dW_in += dproj^T xn (riding with the layer norm's backward, or beside) */
    mark(be, PH_INPROJ_B);
    const gemm_op dx = nn_op(M, dm, d->dip, be->dproj, be->kd.dipp, wgt(be, lo->in_proj), dm, be->dxn, dm, G_F32);
    const gemm_op dw_in = win_op(be, l, M);
    int win_beside_dx;
    TRY(fits_beside(be, &dw_in, &dx, &win_beside_dx));
    if (win_beside_dx) TRY(side_wgrad(be, &with_norm, &dw_in, &be->win));
    TRY(gemm_checked(be, &dx));
    if (!win_beside_dx) TRY(side_wgrad(be, &with_norm, &dw_in, &be->win));
    /* layer norm: dresid (the identity path) += norm path; it overwrites dresid_act: the out_proj weight
     * gradient is done first */
    TRY(wait_side(be, &be->wout));
    mark(be, PH_NORM_B);
    const m3k_colsum_job norm = norm_job(be, l, M);
    CK(m3k_rmsnorm_bwd(be->st, be->prec, resid_l(be, l), be->params + lo->norm, rstd_l(be, l), be->dxn, NULL,
                       be->dresid, dr_act, &norm, &with_norm, M, d->dm, 1));
    TRY(norm_sums_add(be, &ns, &norm, M));
    TRY(norm_sums_add(be, &ns, &with_norm.colsum, M));
  }
  TRY(norm_sums_finish(be, &ns, M));
  TRY(wait_side(be, &be->win));
  mark(be, PH_INPUT_B);
  switch (d->input) {
    case M3_INPUT_FEATURES: {
      TRY(mm_tn_acc(be, dm, be->in_w, M, be->dresid_act, dm, be->in_act, be->in_w, g + lay->input_w, be->in_w));
      const m3k_colsum_job bias = {be->dresid, dm, d->dm, d->dm, g + lay->input_b, NULL, be->colsum_scratch};
      CK(m3k_colsum(be->st, &bias, M));
      break;
    }
    case M3_INPUT_TOKENS:
      CK(m3k_embed_bwd(be->st, be->d_info, be->seg_tok, be->seg_start, be->perm, be->dresid, g + lay->embedding, M,
                       d->dm));
      break;
    default:
      break;
  }
  return M3_OK;
}

static m3_status enq_update(backend *be) {
  const int64_t n = be->lay->total;
  mark(be, PH_UPDATE);
  CK(m3k_grad_sumsq(be->st, be->d_step, be->grads, n, be->norm_part));
  CK(m3k_adamw(be->st, be->prec, be->d_step, be->norm_part, be->norm_blocks, be->d_metrics, be->params, be->grads,
               be->adam_m, be->adam_v, be->shadow, be->decay_flags, n));
  return M3_OK;
}

/* ---- host staging and uploads ------------------------------------------------------------------------------- */

static void stage_step(backend *be, const step_params *p, double weight) {
  m3k_step *h = be->h_step;
  h->weight = (float)weight;
  if (!p) return;
  h->grad_unscale = (float)p->grad_unscale;
  h->lr = (float)p->lr;
  h->weight_decay = (float)p->weight_decay;
  h->beta1 = (float)p->beta1;
  h->beta2 = (float)p->beta2;
  h->one_minus_beta1 = (float)(1 - p->beta1);
  h->one_minus_beta2 = (float)(1 - p->beta2);
  h->eps = (float)p->eps;
  h->step_size = (float)(p->lr / p->bias_correction1);
  h->bc2_sqrt = (float)sqrt(p->bias_correction2);
  h->no_decay = p->no_decay;
  h->clip = p->clip;
}

/* Host copy into pinned staging; large copies are spread over a few threads (a single core
 * copies ~10 GB/s, which shows at the small models' step times). */
static void stage_copy(void *dst, const void *src, size_t bytes) {
  enum { PIECE = 1 << 18 };
  if (bytes < 4 * (size_t)PIECE) {
    memcpy(dst, src, bytes);
    return;
  }
  const int64_t pieces = (int64_t)((bytes + PIECE - 1) / PIECE);
#pragma omp parallel for schedule(static) num_threads(8)
  for (int64_t i = 0; i < pieces; i++) {
    const size_t o = (size_t)i * PIECE, n = bytes - o < (size_t)PIECE ? bytes - o : (size_t)PIECE;
    memcpy((char *)dst + o, (const char *)src + o, n);
  }
}

/* Segments of a stable counting sort of the window's tokens (embedding backward). */
static void sort_tokens(backend *be, const int32_t *tok, int64_t M) {
  int32_t *cnt = be->hist, nseg = 0;
  for (int64_t i = 0; i < M; i++)
    if (cnt[tok[i]]++ == 0) be->h_seg_tok[nseg++] = tok[i];
  int32_t start = 0;
  for (int32_t s = 0; s < nseg; s++) {
    const int32_t t = be->h_seg_tok[s], c = cnt[t];
    be->h_seg_start[s] = start;
    cnt[t] = start; /* now the next free slot of token t */
    start += c;
  }
  be->h_seg_start[nseg] = start;
  for (int64_t i = 0; i < M; i++) be->h_perm[cnt[tok[i]]++] = (int32_t)i;
  for (int32_t s = 0; s < nseg; s++) cnt[be->h_seg_tok[s]] = 0;
  be->h_info->nseg = nseg;
}

/* Large float32 uploads (see the header): at least OVERLAP_BYTES, in pieces of OVERLAP_PIECE (1 MiB:
 * mid bf16 12.55-12.68 ms per step against 12.81-12.92 with 2 MiB, H200, kernels/NOTES.md). Their
 * sizes for a window of M positions, 0 where the upload is small (a copy inside the sequence). */
enum { OVERLAP_BYTES = 1 << 20, OVERLAP_PIECE = 1 << 20 };
static size_t overlapped_input(const backend *be, int64_t M) {
  const size_t bytes = (size_t)(M * be->in_w) * sizeof(float);
  return be->d->input != M3_INPUT_TOKENS && bytes >= OVERLAP_BYTES ? bytes : 0;
}
static size_t overlapped_dout(const backend *be, int64_t M) {
  const size_t bytes = (size_t)(M * be->d->dm) * sizeof(float);
  return be->d->head == M3_HEAD_NONE && bytes >= OVERLAP_BYTES ? bytes : 0;
}
/* A training step in two parts: its d_out is staged and uploaded while its forward runs. */
static int step_splits(const backend *be, int64_t M) { return overlapped_dout(be, M) > 0; }

/* Whether p is page-locked host memory (m3_host_pinned_alloc's, or the caller's own) */
static int pinned(const void *p) {
  struct cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return a.type == cudaMemoryTypeHost;
}

/* bytes from the host's src to the device's dst on the copy stream, the compute stream waiting for the
 * last of them before its next work: straight from page-locked memory, else through the pinned staging
 * at stage piece by piece (the host copies piece i + 1 while the copy engine moves piece i) */
static m3_status upload_overlapped(backend *be, void *dst, void *stage, const void *src, size_t bytes) {
  if (pinned(src)) {
    CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, be->copy_st));
  } else {
    for (size_t o = 0; o < bytes; o += OVERLAP_PIECE) {
      const size_t n = bytes - o < (size_t)OVERLAP_PIECE ? bytes - o : (size_t)OVERLAP_PIECE;
      stage_copy((char *)stage + o, (const char *)src + o, n);
      CK(cudaMemcpyAsync((char *)dst + o, (char *)stage + o, n, cudaMemcpyHostToDevice, be->copy_st));
    }
  }
  CK(cudaEventRecord(be->uploaded, be->copy_st));
  CK(cudaStreamWaitEvent(be->st, be->uploaded, 0));
  return M3_OK;
}

static float *input_dst(const backend *be) {
  return be->d->input == M3_INPUT_IDENTITY ? resid_l(be, 0) : be->in_f32;
}

/* The window's inputs (kept on the device for the backward, which reads the forward's inputs); a
 * large float32 input is uploaded here (upload_inputs then leaves it out). */
static m3_status stage_inputs(backend *be, const m3_batch *b, int train) {
  const int64_t M = (int64_t)b->rows * b->len;
  if (b->resets) memcpy(be->h_resets, b->resets, (size_t)M);
  else memset(be->h_resets, 0, (size_t)M);
  if (be->d->input == M3_INPUT_TOKENS) {
    memcpy(be->h_tokens, b->tokens, (size_t)M * sizeof(int32_t));
    if (train) sort_tokens(be, b->tokens, M);
    return M3_OK;
  }
  const size_t big = overlapped_input(be, M);
  if (big) return upload_overlapped(be, input_dst(be), be->h_in, b->input, big);
  stage_copy(be->h_in, b->input, (size_t)(M * be->in_w) * sizeof(float));
  return M3_OK;
}

static void stage_targets(backend *be, const m3_batch *b, int want_grad) {
  const m3_dims *d = be->d;
  const int64_t M = (int64_t)b->rows * b->len;
  be->h_info->count = 0;
  switch (d->head) {
    case M3_HEAD_LM: {
      int64_t count = 0;
      for (int64_t i = 0; i < M; i++) count += b->targets[i] >= 0;
      memcpy(be->h_targets, b->targets, (size_t)M * sizeof(int32_t));
      be->h_info->count = count;
      break;
    }
    case M3_HEAD_MSE: {
      int64_t count = 0;
      for (int64_t i = 0; i < M; i++) {
        be->h_mask[i] = b->mask ? b->mask[i] != 0 : 1;
        count += be->h_mask[i];
      }
      stage_copy(be->h_tvals, b->target_values, (size_t)(M * be->od) * sizeof(float));
      be->h_info->count = count * be->od;
      break;
    }
    default:
      if (want_grad) stage_copy(be->h_dout, b->d_out, (size_t)(M * d->dm) * sizeof(float));
      break;
  }
}

#define H2D(dst, src, bytes) CK(cudaMemcpyAsync((dst), (src), (bytes), cudaMemcpyHostToDevice, be->st))

static m3_status upload_step(backend *be) {
  H2D(be->d_step, be->h_step, sizeof(m3k_step));
  return M3_OK;
}

static m3_status upload_inputs(backend *be, int64_t M, int train) {
  if (be->d->input == M3_INPUT_TOKENS) {
    H2D(be->tokens, be->h_tokens, (size_t)M * sizeof(int32_t));
    if (train) {
      H2D(be->perm, be->h_perm, (size_t)M * sizeof(int32_t));
      H2D(be->seg_tok, be->h_seg_tok, (size_t)M * sizeof(int32_t));
      H2D(be->seg_start, be->h_seg_start, (size_t)(M + 1) * sizeof(int32_t));
    }
  } else if (!overlapped_input(be, M)) {
    H2D(input_dst(be), be->h_in, (size_t)(M * be->in_w) * sizeof(float));
  }
  H2D(be->resets, be->h_resets, (size_t)M);
  return M3_OK;
}

static m3_status upload_targets(backend *be, int64_t M, int want_grad) {
  const m3_dims *d = be->d;
  H2D(be->d_info, be->h_info, sizeof(m3k_batch_info));
  switch (d->head) {
    case M3_HEAD_LM:
      H2D(be->targets, be->h_targets, (size_t)M * sizeof(int32_t));
      break;
    case M3_HEAD_MSE:
      H2D(be->tvals, be->h_tvals, (size_t)(M * be->od) * sizeof(float));
      H2D(be->mask, be->h_mask, (size_t)M);
      break;
    default:
      if (want_grad) H2D(be->d_out, be->h_dout, (size_t)(M * d->dm) * sizeof(float));
      break;
  }
  return M3_OK;
}

static m3_status download_metrics(backend *be) {
  CK(cudaMemcpyAsync(be->h_metrics, be->d_metrics, sizeof(m3k_metrics), cudaMemcpyDeviceToHost, be->st));
  return M3_OK;
}

static m3_status sync(backend *be) {
  mark(be, PH_END);
  CK(cudaStreamSynchronize(be->st));
  prof_collect(be);
  return M3_OK;
}

static void read_head(const backend *be, head_result *r) {
  memset(r, 0, sizeof *r);
  if (be->d->head == M3_HEAD_NONE) return;
  const int64_t count = be->h_info->count;
  r->has_loss = 1;
  r->counted = count;
  r->loss = count ? be->h_metrics->loss_sum / (double)count : 0;
  r->correct = be->d->head == M3_HEAD_LM ? be->h_metrics->correct : 0;
}

static void read_update(const backend *be, update_result *r) {
  r->grad_norm = be->h_metrics->grad_norm;
  r->finite = be->h_metrics->finite;
}

/* The fused step on the stream (eager, or captured into graphs): the whole, or (step_splits) its
 * front (uploads, forward) or back (backward, update, metrics). */
enum { STEP_WHOLE, STEP_FRONT, STEP_BACK };
static m3_status enq_step(backend *be, int part, int32_t rows, int32_t len, int carry) {
  const int64_t M = (int64_t)rows * len;
  if (part != STEP_BACK) {
    mark(be, PH_UPLOAD);
    TRY(upload_step(be));
    TRY(upload_inputs(be, M, 1));
    TRY(upload_targets(be, M, !step_splits(be, M)));
    TRY(enq_forward(be, rows, len, carry, 1));
  }
  if (part == STEP_FRONT) return M3_OK;
  TRY(enq_backward(be, rows, len, 1));
  TRY(enq_update(be));
  return download_metrics(be);
}

/* CTAs per row of the fused one-token step: the largest power of two up to the cap that still runs
 * every row's cluster at once (one CTA per multiprocessor). The default cap: rl at B 1 measured 48.1 µs
 * per step with 8, 52.0 with 16, 65.4 with 1 (H200, kernels/NOTES.md). */
enum { DECODE_CLUSTER_CAP = 8 };
static int32_t decode_cluster_for(const backend *be, int32_t rows) {
  int32_t c = be->decode_cluster;
  while (c > 1 && (int64_t)rows * c > be->sms) c /= 2;
  return c;
}

/* An inference step: upload, forward from the carried state (advancing it in place) and, for
 * "lm", logits [rows, V] of each row's last position (rows of out strided by len). */
static m3_status enq_infer(backend *be, int32_t rows, int32_t len) {
  const m3_dims *d = be->d;
  if (len == 1 && be->decode_smem) {
    /* the fused step and its input layer read the input and resets from the pinned staging: no copy
     * nodes ahead of them (rl bf16 at B 1: 48.1 -> 46.4 µs per step without its two copies) */
    mark(be, PH_INPUT);
    TRY(enq_input(be, rows, be->h_tokens, be->h_in));
    mark(be, PH_SCAN_F);
    const float *h0 = d->input == M3_INPUT_IDENTITY ? be->h_in : resid_l(be, 0);
    const m3k_decode_args a = {be->kd,       d->L,           rows,          decode_cluster_for(be, rows),
                               be->decode_layers, h0,        be->h_resets,  be->params + be->lay->norm_f,
                               be->out,      be->out_rstd,   be->out_act};
    CK(m3k_decode_step(be->st, be->prec, &a, be->decode_smem));
  } else {
    TRY(upload_inputs(be, (int64_t)rows * len, 0));
    TRY(enq_forward(be, rows, len, 1, 0));
  }
  if (d->head != M3_HEAD_LM) return M3_OK;
  const int64_t dm = d->dm;
  const void *last = (const char *)be->out_act + (size_t)((len - 1) * dm) * be->act_bytes;
  return mm_nt(be, rows, d->vocab, dm, last, len * dm, wgt(be, m3_layout_lm_weight(be->lay, d)), dm, NULL, be->logits,
               d->vocab, G_F32, 0.0f);
}

/* ---- graphs ---------------------------------------------------------------------------------------------------- */

static m3_status capture(backend *be, int part, int32_t rows, int32_t len, int carry, cudaGraphExec_t *out) {
  cudaGraph_t graph = NULL;
  CK(cudaStreamBeginCapture(be->st, cudaStreamCaptureModeRelaxed));
  be->pf.capturing = 1;
  const m3_status s = be->infer ? enq_infer(be, rows, len) : enq_step(be, part, rows, len, carry);
  be->pf.capturing = 0;
  const cudaError_t e = cudaStreamEndCapture(be->st, &graph);
  if (s != M3_OK) {
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    return s;
  }
  CK(e);
  const cudaError_t ei = cudaGraphInstantiate(out, graph, 0);
  cudaGraphDestroy(graph);
  CK(ei);
  return M3_OK;
}

static void destroy_entry(graph_entry *g) {
  for (int k = 0; k < 2; k++)
    if (g->exec[k]) cudaGraphExecDestroy(g->exec[k]);
  memset(g, 0, sizeof *g);
}

/* The graphs of a shape: out[0] the sequence (or a split step's front), out[1] a split step's back
 * (else NULL). */
static m3_status graph_for(backend *be, int32_t rows, int32_t len, int carry, cudaGraphExec_t out[2]) {
  be->tick++;
  for (int i = 0; i < be->n_graphs; i++) {
    graph_entry *g = &be->graphs[i];
    if (g->rows == rows && g->len == len && g->carry == carry) {
      g->used = be->tick;
      out[0] = g->exec[0];
      out[1] = g->exec[1];
      return M3_OK;
    }
  }
  int slot = be->n_graphs;
  if (slot == MAX_GRAPHS) { /* evict the least recently used shape */
    slot = 0;
    for (int i = 1; i < MAX_GRAPHS; i++)
      if (be->graphs[i].used < be->graphs[slot].used) slot = i;
    destroy_entry(&be->graphs[slot]);
  } else {
    be->n_graphs++;
  }
  graph_entry *g = &be->graphs[slot];
  memset(g, 0, sizeof *g);
  const int split = !be->infer && step_splits(be, (int64_t)rows * len);
  m3_status s = capture(be, split ? STEP_FRONT : STEP_WHOLE, rows, len, carry, &g->exec[0]);
  if (s == M3_OK && split) s = capture(be, STEP_BACK, rows, len, carry, &g->exec[1]);
  if (s != M3_OK) {
    destroy_entry(g);
    be->graphs[slot] = be->graphs[be->n_graphs - 1];
    be->n_graphs--;
    return s;
  }
  g->rows = rows;
  g->len = len;
  g->carry = carry;
  g->used = be->tick;
  out[0] = g->exec[0];
  out[1] = g->exec[1];
  return M3_OK;
}

static void free_graphs(backend *be) {
  for (int i = 0; i < be->n_graphs; i++) destroy_entry(&be->graphs[i]);
  be->n_graphs = 0;
}

/* ---- backend ops ------------------------------------------------------------------------------------------------ */

static void destroy(backend *be) {
  if (!be) return;
  if (be->arena || be->pin || be->st || be->copy_st || be->side) cudaSetDevice(be->dev);
  if (be->pf.events)
    for (int i = 0; i < PROF_MARKS; i++)
      if (be->pf.ev[i]) cudaEventDestroy(be->pf.ev[i]);
  free_graphs(be);
  if (be->side) cudaStreamSynchronize(be->side);
  if (be->st) cudaStreamSynchronize(be->st);
  if (be->gm_ready) m3_gemm_free(&be->gm);
  if (be->gm_side_ready) m3_gemm_free(&be->gm_side);
  if (be->arena) cudaFree(be->arena);
  if (be->pin) cudaFreeHost(be->pin);
  if (be->st) cudaStreamDestroy(be->st);
  if (be->copy_st) cudaStreamDestroy(be->copy_st);
  if (be->uploaded) cudaEventDestroy(be->uploaded);
  if (be->side) cudaStreamDestroy(be->side);
  if (be->fork) cudaEventDestroy(be->fork);
  if (be->wout.done) cudaEventDestroy(be->wout.done);
  if (be->win.done) cudaEventDestroy(be->win.done);
  cudaGetLastError();
  free(be->hist);
  free(be);
}

static m3_status op_forward(backend *be, const m3_batch *b, int carry, int train, float *out) {
  ENTER(be);
  TRY(stage_inputs(be, b, train));
  TRY(upload_inputs(be, (int64_t)b->rows * b->len, train));
  TRY(enq_forward(be, b->rows, b->len, carry, train));
  if (out)
    CK(cudaMemcpyAsync(out, be->out, (size_t)((int64_t)b->rows * b->len * be->d->dm) * sizeof(float),
                       cudaMemcpyDeviceToHost, be->st));
  TRY(sync(be));
  be->last_rows = b->rows;
  be->last_len = b->len;
  be->last_carry = carry;
  return M3_OK;
}

static m3_status op_backward(backend *be, const m3_batch *b, double weight, int zero_grads, head_result *res) {
  ENTER(be);
  stage_step(be, NULL, weight);
  stage_targets(be, b, 1);
  TRY(upload_step(be));
  TRY(upload_targets(be, (int64_t)b->rows * b->len, 1));
  TRY(enq_backward(be, b->rows, b->len, zero_grads));
  TRY(download_metrics(be));
  TRY(sync(be));
  read_head(be, res);
  return M3_OK;
}

static m3_status op_update(backend *be, const step_params *p, update_result *res) {
  ENTER(be);
  stage_step(be, p, be->h_step->weight);
  TRY(upload_step(be));
  TRY(enq_update(be));
  TRY(download_metrics(be));
  TRY(sync(be));
  read_update(be, res);
  return M3_OK;
}

static m3_status op_step(backend *be, const m3_batch *b, int carry, double weight, const step_params *p,
                         head_result *head, update_result *upd, int32_t *graph_replayed) {
  ENTER(be);
  const size_t dout_bytes = overlapped_dout(be, (int64_t)b->rows * b->len); /* > 0: the step splits */
  const int split = dout_bytes > 0;
  stage_step(be, p, weight);
  TRY(stage_inputs(be, b, 1));
  stage_targets(be, b, !split);
  cudaGraphExec_t ex[2] = {NULL, NULL};
  if (be->graph_mode) TRY(graph_for(be, b->rows, b->len, carry, ex));
  if (ex[0]) CK(cudaGraphLaunch(ex[0], be->st));
  else TRY(enq_step(be, split ? STEP_FRONT : STEP_WHOLE, b->rows, b->len, carry));
  if (split) { /* while the forward runs */
    TRY(upload_overlapped(be, be->d_out, be->h_dout, b->d_out, dout_bytes));
    if (ex[1]) CK(cudaGraphLaunch(ex[1], be->st));
    else TRY(enq_step(be, STEP_BACK, b->rows, b->len, carry));
  }
  *graph_replayed = be->graph_mode;
  TRY(sync(be));
  be->last_rows = b->rows;
  be->last_len = b->len;
  be->last_carry = carry;
  read_head(be, head);
  read_update(be, upd);
  return M3_OK;
}

static m3_status op_evaluate(backend *be, const m3_batch *b, int carry, head_result *res, float *out) {
  ENTER(be);
  const int64_t M = (int64_t)b->rows * b->len;
  TRY(stage_inputs(be, b, 0));
  stage_targets(be, b, 0);
  TRY(upload_inputs(be, M, 0));
  TRY(upload_targets(be, M, 0));
  TRY(enq_forward(be, b->rows, b->len, carry, 0));
  TRY(enq_head(be, b->rows, b->len, 0));
  TRY(download_metrics(be));
  if (out)
    CK(cudaMemcpyAsync(out, be->out, (size_t)(M * be->d->dm) * sizeof(float), cudaMemcpyDeviceToHost, be->st));
  TRY(sync(be));
  read_head(be, res);
  return M3_OK;
}

static m3_status op_capture_graph(backend *be) {
  ENTER(be);
  const int32_t rows = be->last_rows ? be->last_rows : be->B, len = be->last_len ? be->last_len : be->T;
  cudaGraphExec_t ex[2];
  be->graph_mode = 1;
  const m3_status s = graph_for(be, rows, len, be->last_carry, ex);
  if (s != M3_OK) be->graph_mode = 0;
  return s;
}

static m3_status op_drop_graph(backend *be) {
  ENTER(be);
  free_graphs(be);
  be->graph_mode = 0;
  return M3_OK;
}

static int32_t op_has_graph(const backend *be) { return be->graph_mode; }

typedef struct state_view {
  float *ptr[4];
  int64_t per_row[4]; /* floats per batch row of one layer */
} state_view;

static state_view state_of(const backend *be, int32_t layer) {
  const m3_dims *d = be->d;
  state_view v;
  v.per_row[0] = (int64_t)d->H * d->S;
  v.per_row[1] = (int64_t)d->H * d->P * d->N;
  v.per_row[2] = (int64_t)d->H * d->N;
  v.per_row[3] = (int64_t)d->H * d->P;
  float *base[4] = {be->s_angle, be->s_ssm, be->s_k, be->s_v};
  for (int i = 0; i < 4; i++) v.ptr[i] = base[i] + (int64_t)layer * be->B * v.per_row[i];
  return v;
}

static m3_status op_get_state(const backend *cbe, int32_t layer, float *angle, float *ssm, float *k, float *v) {
  backend *be = (backend *)cbe;
  ENTER(be);
  const state_view s = state_of(be, layer);
  float *dst[4] = {angle, ssm, k, v};
  for (int i = 0; i < 4; i++)
    if (dst[i] && s.per_row[i])
      CK(cudaMemcpyAsync(dst[i], s.ptr[i], (size_t)(be->B * s.per_row[i]) * sizeof(float), cudaMemcpyDeviceToHost,
                         be->st));
  return sync(be);
}

static m3_status op_set_state(backend *be, int32_t layer, const float *angle, const float *ssm, const float *k,
                              const float *v) {
  ENTER(be);
  const state_view s = state_of(be, layer);
  const float *src[4] = {angle, ssm, k, v};
  for (int i = 0; i < 4; i++)
    if (src[i] && s.per_row[i])
      CK(cudaMemcpyAsync(s.ptr[i], src[i], (size_t)(be->B * s.per_row[i]) * sizeof(float), cudaMemcpyHostToDevice,
                         be->st));
  return sync(be);
}

static m3_status op_reset_rows(backend *be, const int32_t *rows, int32_t n_rows) {
  ENTER(be);
  for (int32_t l = 0; l < be->d->L; l++) {
    const state_view s = state_of(be, l);
    for (int i = 0; i < 4; i++) {
      if (!s.per_row[i]) continue;
      if (!rows) {
        CK(cudaMemsetAsync(s.ptr[i], 0, (size_t)(be->B * s.per_row[i]) * sizeof(float), be->st));
        continue;
      }
      for (int32_t r = 0; r < n_rows; r++)
        CK(cudaMemsetAsync(s.ptr[i] + (int64_t)rows[r] * s.per_row[i], 0, (size_t)s.per_row[i] * sizeof(float),
                           be->st));
    }
  }
  return sync(be);
}

static m3_status op_rewind_state(backend *be, int32_t rows) {
  ENTER(be);
  TRY(copy_incoming(be, rows, 1));
  return sync(be);
}

static float *arena_of(const backend *be, arena_kind kind) {
  switch (kind) {
    case ARENA_PARAMS: return be->params;
    case ARENA_GRADS: return be->grads;
    case ARENA_ADAM_M: return be->adam_m;
    case ARENA_ADAM_V: return be->adam_v;
  }
  return NULL;
}

static m3_status op_read_arena(const backend *cbe, arena_kind kind, float *dst) {
  backend *be = (backend *)cbe;
  ENTER(be);
  CK(cudaMemcpyAsync(dst, arena_of(be, kind), (size_t)be->lay->total * sizeof(float), cudaMemcpyDeviceToHost, be->st));
  return sync(be);
}

static m3_status op_write_arena(backend *be, arena_kind kind, const float *src) {
  ENTER(be);
  CK(cudaMemcpyAsync(arena_of(be, kind), src, (size_t)be->lay->total * sizeof(float), cudaMemcpyHostToDevice, be->st));
  if (kind == ARENA_PARAMS && be->shadow) CK(m3k_to_act(be->st, be->prec, be->params, be->shadow, be->lay->total));
  return sync(be);
}

static int64_t op_device_bytes(const backend *be) { return (int64_t)be->arena_bytes; }
static int32_t op_fused_decode(const backend *be) { return be->decode_smem > 0; }

static m3_status op_infer(backend *be, const m3_batch *b, float *out) {
  ENTER(be);
  TRY(stage_inputs(be, b, 0));
  if (be->infer_graph && b->len == 1) {
    cudaGraphExec_t ex[2];
    TRY(graph_for(be, b->rows, 1, 1, ex));
    CK(cudaGraphLaunch(ex[0], be->st));
  } else {
    TRY(enq_infer(be, b->rows, b->len));
  }
  if (out)
    CK(cudaMemcpyAsync(out, be->out, (size_t)((int64_t)b->rows * b->len * be->d->dm) * sizeof(float),
                       cudaMemcpyDeviceToHost, be->st));
  return sync(be);
}

static m3_status op_read_logits(const backend *cbe, int32_t rows, float *dst) {
  backend *be = (backend *)cbe;
  ENTER(be);
  const size_t bytes = (size_t)((int64_t)rows * be->d->vocab) * sizeof(float);
  float *stage = be->h_logits ? be->h_logits : dst;
  CK(cudaMemcpyAsync(stage, be->logits, bytes, cudaMemcpyDeviceToHost, be->st));
  TRY(sync(be));
  if (stage != dst) memcpy(dst, stage, bytes);
  return M3_OK;
}

/* Switching on or off clears the totals; the first call after switching on is not counted. */
static m3_status op_set_profiling(backend *be, int32_t on) {
  ENTER(be);
  prof *p = &be->pf;
  if (on && !p->events) {
    for (int i = 0; i < PROF_MARKS; i++) CK(cudaEventCreate(&p->ev[i]));
    p->events = 1;
  }
  p->on = on != 0;
  p->n = 0;
  p->steps = 0;
  memset(p->ms, 0, sizeof p->ms);
  return M3_OK;
}

static m3_status op_profile(const backend *be, m3_phase_time *out, int32_t cap, int32_t *n, int64_t *calls) {
  const prof *p = &be->pf;
  const int64_t counted = p->steps > 0 ? p->steps - 1 : 0;
  *n = 0;
  *calls = counted;
  for (int i = 0; i < PH_END && counted > 0; i++) {
    if (p->ms[i] <= 0) continue;
    if (*n >= cap) return m3_fail(M3_ERR_ARGUMENT, "profile: cap = %d entries are too few (up to %d phases)", cap,
                                  (int)PH_END);
    out[*n].name = PHASE_NAME[i];
    out[*n].ms_per_call = p->ms[i] / (double)counted;
    (*n)++;
  }
  return M3_OK;
}

static const backend_ops cuda_ops = {
    .name = "cuda",
    .destroy = destroy,
    .forward = op_forward,
    .backward = op_backward,
    .update = op_update,
    .step = op_step,
    .evaluate = op_evaluate,
    .capture_graph = op_capture_graph,
    .drop_graph = op_drop_graph,
    .has_graph = op_has_graph,
    .get_state = op_get_state,
    .set_state = op_set_state,
    .reset_rows = op_reset_rows,
    .rewind_state = op_rewind_state,
    .read_arena = op_read_arena,
    .write_arena = op_write_arena,
    .device_bytes = op_device_bytes,
    .fused_decode = op_fused_decode,
    .infer = op_infer,
    .read_logits = op_read_logits,
    .set_profiling = op_set_profiling,
    .profile = op_profile,
};

/* ---- creation ---------------------------------------------------------------------------------------------------- */

static void kernel_dims(const m3_dims *d, m3k_dims *k) {
  memset(k, 0, sizeof *k);
  k->dm = d->dm;
  k->E = d->E;
  k->P = d->P;
  k->H = d->H;
  k->G = d->G;
  k->N = d->N;
  k->S = d->S;
  k->dip = d->dip;
  k->dipp = (int32_t)rup(d->dip, 8);
  k->hpg = d->heads_per_group;
  k->z_off = d->z_off;
  k->x_off = d->x_off;
  k->B_off = d->B_off;
  k->C_off = d->C_off;
  k->dt_off = d->dt_off;
  k->A_off = d->A_off;
  k->trap_off = d->trap_off;
  k->ang_off = d->ang_off;
  k->outproj_norm = d->outproj_norm;
  k->a_floor = (float)d->a_floor;
}

/* The fused one-token step's per-layer pointers (parameters, act weights, carried state) -> device. */
static m3_status upload_decode_layers(backend *be) {
  const m3_dims *d = be->d;
  const int64_t BH = (int64_t)be->B * d->H;
  m3k_decode_layer *h = calloc((size_t)d->L, sizeof *h);
  if (!h) return m3_fail(M3_ERR_MEMORY, "out of host memory");
  for (int l = 0; l < d->L; l++) {
    const layer_offsets *lo = &be->lay->layer[l];
    const float *p = be->params;
    const m3k_decode_layer x = {p + lo->norm,
                                p + lo->B_norm,
                                p + lo->C_norm,
                                p + lo->dt_bias,
                                p + lo->D,
                                p + lo->B_bias,
                                p + lo->C_bias,
                                d->outproj_norm ? p + lo->out_norm : NULL,
                                wgt(be, lo->in_proj),
                                wgt(be, lo->out_proj),
                                be->s_angle + l * BH * d->S,
                                be->s_ssm + l * BH * d->P * d->N,
                                be->s_k + l * BH * d->N,
                                be->s_v + l * BH * d->P};
    h[l] = x;
  }
  cudaError_t e = cudaMemcpyAsync(be->decode_layers, h, (size_t)d->L * sizeof *h, cudaMemcpyHostToDevice, be->st);
  if (e == cudaSuccess) e = cudaStreamSynchronize(be->st);
  free(h);
  CK(e);
  return M3_OK;
}

static m3_status init_device(backend *be, const backend_args *a) {
  const m3_layout *lay = be->lay;
  CK(cudaSetDevice(be->dev));
  int max_smem = 0;
  CK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, be->dev));
  CK(cudaDeviceGetAttribute(&be->sms, cudaDevAttrMultiProcessorCount, be->dev));
  const int64_t max_rows = m3k_scan_max_rows(be->d->H, be->T);
  if (be->B > max_rows)
    return m3_fail(M3_ERR_UNSUPPORTED,
                   "batch %d: with %d heads and %d-token windows the CUDA backend runs at most %lld rows at once "
                   "(its scan kernels' launch grid)",
                   be->B, be->d->H, be->T, (long long)max_rows);
  char why[256];
  if (!m3k_scan_make_plan(be->d->P, be->d->N, be->d->S, max_smem, be->sms, &be->scan, why))
    return m3_fail(M3_ERR_UNSUPPORTED, "%s", why);
  CK(m3k_scan_prepare(be->prec, &be->scan));
  if (be->d->head == M3_HEAD_LM) CK(m3k_ce_prepare(be->prec, be->d->vocab));
  if (be->infer) {
    const char *fused = getenv("M3_DECODE_FUSED");
    if ((!fused || strcmp(fused, "0") != 0) && m3k_decode_smem(be->prec, &be->kd, be->d->L, max_smem))
      be->decode_smem = (size_t)max_smem;
    const char *cap = getenv("M3_DECODE_CLUSTER");
    if (be->decode_smem)
      CK(m3k_decode_prepare(be->prec, be->decode_smem, cap ? atoi(cap) : DECODE_CLUSTER_CAP, &be->decode_cluster));
  }
  CK(cudaStreamCreateWithFlags(&be->st, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&be->copy_st, cudaStreamNonBlocking));
  CK(cudaEventCreateWithFlags(&be->uploaded, cudaEventDisableTiming));
  CK(cudaStreamCreateWithFlags(&be->side, cudaStreamNonBlocking));
  CK(cudaEventCreateWithFlags(&be->fork, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&be->wout.done, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&be->win.done, cudaEventDisableTiming));

  carver c = {NULL, 0};
  carve_device(be, &c);
  be->arena_bytes = c.off;
  const cudaError_t em = cudaMalloc((void **)&be->arena, be->arena_bytes);
  if (em != cudaSuccess) {
    cudaGetLastError();
    return m3_fail(M3_ERR_MEMORY, "cudaMalloc of the trainer's %.3f GiB arena failed: %s (batch %d x seq_len %d)",
                   (double)be->arena_bytes / (1 << 30), cudaGetErrorString(em), be->B, be->T);
  }
  c.base = be->arena;
  c.off = 0;
  carve_device(be, &c);
  CK(cudaMemsetAsync(be->arena, 0, be->arena_bytes, be->st));

  carver ch = {NULL, 0};
  carve_pinned(be, &ch);
  be->pin_bytes = ch.off;
  CK(cudaMallocHost((void **)&be->pin, be->pin_bytes));
  memset(be->pin, 0, be->pin_bytes);
  ch.base = be->pin;
  ch.off = 0;
  carve_pinned(be, &ch);

  CK(cudaMemcpyAsync(be->params, a->params, (size_t)lay->total * sizeof(float), cudaMemcpyHostToDevice, be->st));
  if (be->shadow) CK(m3k_to_act(be->st, be->prec, be->params, be->shadow, lay->total));
  const int64_t nflags = lay->total / M3_ALIGN + 1;
  uint8_t *flags = calloc((size_t)nflags, 1);
  if (!flags) return m3_fail(M3_ERR_MEMORY, "out of host memory");
  for (int32_t t = 0; t < lay->n; t++) {
    const param_desc *pd = &lay->t[t];
    for (int64_t ch0 = pd->offset / M3_ALIGN; ch0 * M3_ALIGN < pd->offset + pd->numel; ch0++) flags[ch0] = !pd->no_decay;
  }
  cudaError_t ef = cudaMemcpyAsync(be->decay_flags, flags, (size_t)nflags, cudaMemcpyHostToDevice, be->st);
  if (ef == cudaSuccess) ef = cudaStreamSynchronize(be->st);
  free(flags);
  CK(ef);
  if (be->decode_layers) TRY(upload_decode_layers(be));
  if (be->d->input == M3_INPUT_TOKENS) {
    be->hist = calloc((size_t)be->d->vocab, sizeof(int32_t));
    if (!be->hist) return m3_fail(M3_ERR_MEMORY, "out of host memory");
  }
  const cudaDataType_t act = be->prec == M3K_BF16 ? CUDA_R_16BF : be->prec == M3K_F16 ? CUDA_R_16F : CUDA_R_32F;
  TRY(m3_gemm_init(&be->gm, act, be->prec == M3K_F32 && a->allow_tf32, be->workspace, WORKSPACE_BYTES));
  be->gm_ready = 1;
  if (!be->infer) {
    TRY(m3_gemm_init(&be->gm_side, act, be->prec == M3K_F32 && a->allow_tf32, be->workspace_side, WORKSPACE_BYTES));
    be->gm_side_ready = 1;
  }
  return M3_OK;
}

m3_status m3_cuda_backend_create(const backend_args *a, backend **out, const backend_ops **ops) {
  backend *be = calloc(1, sizeof *be);
  if (!be) return m3_fail(M3_ERR_MEMORY, "out of memory");
  be->d = a->dims;
  be->lay = a->layout;
  be->prec = a->precision == M3_PRECISION_BF16 ? M3K_BF16 : a->precision == M3_PRECISION_F16 ? M3K_F16 : M3K_F32;
  be->act_bytes = be->prec == M3K_F32 ? 4 : 2;
  be->dev = a->device_index;
  be->B = a->batch;
  be->T = a->seq_len;
  be->Mc = (int64_t)a->batch * a->seq_len;
  be->in_w = a->dims->input_dim;
  be->od = a->dims->out_dim;
  be->infer = a->infer;
  be->infer_graph = a->infer && a->graph;
  be->lm_rows = be->Mc < LM_BLOCK_ROWS ? be->Mc : LM_BLOCK_ROWS;
  kernel_dims(a->dims, &be->kd);
  const m3_status s = init_device(be, a);
  if (s != M3_OK) {
    destroy(be);
    return s;
  }
  *out = be;
  *ops = &cuda_ops;
  return M3_OK;
}

/*
 * model_t.h — declarations of the CPU model for one precision. model.h includes it twice
 * with T_ = float / double and S_ = f32 / f64; the definitions come from the files of this
 * folder compiled once per precision (real.h).
 *
 * Conventions (llm.c style): activations use M = rows * len positions, row-major
 * [rows, len, ...] packed for the current window; backward writes "=" into activation
 * gradients and "+=" into parameter gradients, so accumulation windows just work.
 *
 * A forward-only model (train = 0, the inference backend) keeps one slot of every per-layer
 * activation, reused layer after layer (the residual stream alternates between two slots),
 * reads the carried state directly and allocates no backward buffers. Its products run in
 * rowdot.c, where a row's values do not depend on how many rows a call holds, so a prompt
 * stepped token by token equals the prompt run as one window, bit for bit.
 */
#define N_(x) M3_CAT(x, S_)

typedef struct N_(cpu_batch) {
  int32_t rows, len;
  const T_ *input;          /* [rows, len, input_dim] ("features", "identity") */
  const int32_t *tokens;    /* [rows, len] */
  const int32_t *targets;   /* [rows, len] ("lm"), -1 ignored */
  const T_ *target_values;  /* [rows, len, out_dim] ("mse") */
  const uint8_t *mask;      /* [rows, len] optional ("mse") */
  const T_ *d_out;          /* [rows, len, dm] ("none") */
  const uint8_t *resets;    /* [rows, len] optional */
} N_(cpu_batch);

/* Recurrent state of all layers, batch-first per layer (SPEC.md §4). */
typedef struct N_(cpu_state) {
  T_ *angle; /* [L, B, H, S] */
  T_ *ssm;   /* [L, B, H, P, N] */
  T_ *k;     /* [L, B, H, N] */
  T_ *v;     /* [L, B, H, P] */
} N_(cpu_state);

typedef struct N_(cpu_model) {
  const m3_dims *d;
  const m3_layout *lay;
  int32_t B, T;             /* capacity */
  int32_t rows, len;        /* window of the last forward */
  int32_t chunk;            /* tokens between saved scan states */
  int32_t train;            /* 0: forward only (see above) */
  int64_t cap;              /* positions per activation slot: B * T */
  T_ *params, *grads;       /* [lay->total] each, owned by the caller */
  T_ *params_t;             /* forward only, [lay->total]: every 2-D weight transposed in panels of
                               outputs at its own offset (rowdot.c); cpu_model_transpose_weights */
  T_ *dinput;               /* optional [B, T, input_dim]: receives dL/d input when set */

  N_(cpu_state) state;      /* carried state: read at a window start, written at its end */
  N_(cpu_state) incoming;   /* the incoming state of the last forward (read by backward) */
  N_(cpu_state) staged;     /* final states of a running forward, committed at its end */

  /* saved activations of the last forward (its inputs too: backward reads nothing else) */
  T_ *input_copy;           /* [B, T, input_dim] "features" input */
  int32_t *tokens_copy;     /* [B, T] "tokens" input */
  uint8_t *resets_copy;     /* [B, T] */
  int32_t has_resets;
  T_ *resid;                /* [L+1, M, dm] residual stream entering each layer, then out of the last */
  T_ *xn;                   /* [L, M, dm] RMSNorm(resid) */
  T_ *rstd;                 /* [L, M] its reciprocal RMS */
  T_ *proj;                 /* [L, M, dip] in_proj output: z | x | B | C | dd_dt | dd_A | trap | ang */
  T_ *bc_hat;               /* [L, M, 2, G, N] normalised B then C (before bias) */
  T_ *bc_rstd;              /* [L, M, 2, G] */
  T_ *ang_tanh;             /* [L, M, S] tanh of the angle logits */
  T_ *theta;                /* [L, M, H, S] angles after each token */
  T_ *y;                    /* [L, M, E] scan output (with D x), before the gate */
  T_ *y_rstd;               /* [L, M, H] per-head RMS of y (outproj_norm) */
  T_ *gated;                /* [L, M, E] gate output, input of out_proj */
  T_ *chunk_ssm;            /* [L, B, H, nchunk, P, N] ssm state before each chunk's first token (train) */
  T_ *out;                  /* [M, dm] RMSNorm(resid[L]; norm_f): the output */
  T_ *out_rstd;             /* [M] */

  /* backward scratch */
  T_ *dout;                 /* [M, dm] dL/d out (the head writes it) */
  T_ *dresid;               /* [M, dm] */
  T_ *dxn;                  /* [M, dm] */
  T_ *dproj;                /* [M, dip] */
  T_ *dgated;               /* [M, E] */
  T_ *dy;                   /* [M, E] */
  T_ *dbc_head;             /* [M, H, 2, N] per-head dL/d (B_hat + bias), dL/d (C_hat + bias) */
  T_ *dang_head;            /* [M, H, S] per-head share of dL/d ang */
  T_ *part;                 /* [B, part_width] per-row partial parameter gradients */
  T_ *row_scratch;          /* [B, N] */
  int64_t part_width;
  T_ *logits;               /* [head_block, max(vocab, out_dim)] head scratch (forward only: the last
                               positions' logits, [B rounded up to a row group, vocab]) */
  T_ *scratch;              /* per-thread scan scratch [threads, scratch_per_thread] */
  int64_t scratch_per_thread;
  int32_t threads;
  double gemm_seconds;      /* time spent in matrix products since creation */
} N_(cpu_model);

typedef struct N_(cpu_head_result) {
  double loss;              /* the mean the head reports */
  int64_t counted;          /* positions (lm) or elements (mse) in the mean */
  int64_t correct;          /* lm: argmax == target among counted */
  int32_t has_loss;
} N_(cpu_head_result);

m3_status N_(cpu_model_create)(const m3_dims *d, const m3_layout *lay, int32_t B, int32_t T,
                               N_(cpu_model) **out);
/* A forward-only model (train = 0) of the same capacity. */
m3_status N_(cpu_model_create_forward)(const m3_dims *d, const m3_layout *lay, int32_t B, int32_t T,
                                       N_(cpu_model) **out);
void N_(cpu_model_destroy)(N_(cpu_model) *m);
/* carry = 0: the window starts from zero state. write_state = 0: the carried state is left
 * as it was (evaluate). Fills out and every saved activation. A forward-only model always
 * starts from the carried state. */
m3_status N_(cpu_model_forward)(N_(cpu_model) *m, const N_(cpu_batch) *b, int carry, int write_state);
/* Rows [0, rows) of the carried state back to where the last training forward (with carry) started. */
void N_(cpu_model_rewind_state)(N_(cpu_model) *m, int32_t rows);
/* Head loss of the last forward. When want_grad, writes dout = weight * dL/d out and adds
 * the head's parameter gradients (weight scales them too). */
m3_status N_(cpu_model_head)(N_(cpu_model) *m, const N_(cpu_batch) *b, T_ weight, int want_grad,
                             N_(cpu_head_result) *res);
/* Backward of the last forward, from dout through every layer into grads (+=) and dinput
 * (=) when set. */
m3_status N_(cpu_model_backward)(N_(cpu_model) *m);

/* ---- pieces shared by the files of this folder --------------------------------------- */

/* Slot of layer l in the per-layer activation buffers, and of resid[l]. */
static inline int64_t N_(cpu_slot)(const N_(cpu_model) *m, int32_t l) { return m->train ? l : 0; }
static inline int64_t N_(cpu_resid_slot)(const N_(cpu_model) *m, int32_t l) { return m->train ? l : l & 1; }

/* C = alpha op(A) op(B) + beta C, row-major, over the model's threads (gemm.c). */
void N_(cpu_gemm)(N_(cpu_model) *m, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, T_ alpha,
                  const T_ *A, int lda, const T_ *B, int ldb, T_ beta, T_ *C, int ldc);
/* C = A Bᵀ + beta C from BT = the weight B [N, K] in params_t's panel layout, each row
 * independent of M (rowdot.c; the forward-only model's products). */
void N_(cpu_rowdot)(N_(cpu_model) *m, int M, int N, int K, const T_ *A, int lda, const T_ *BT, T_ beta, T_ *C,
                    int ldc);
/* Forward-only model: params_t := the 2-D weights of params, transposed; call after params
 * is set or changed. */
void N_(cpu_model_transpose_weights)(N_(cpu_model) *m);

/* y = x / sqrt(mean(x^2) + 1e-5) * w over rows of n values; rstd[r] saved. w may be NULL (1). */
void N_(rmsnorm_row)(const T_ *x, const T_ *w, T_ *y, T_ *rstd, int32_t n);
void N_(rmsnorm_forward)(const T_ *x, const T_ *w, T_ *y, T_ *rstd, int64_t rows, int32_t n);
/* dx (=, or += when accumulate) and dw partial (+=, may be NULL) of one row; dx may be dy. */
void N_(rmsnorm_backward_row)(const T_ *x, const T_ *w, T_ rstd, const T_ *dy, T_ *dx, T_ *dw,
                              int32_t n, int accumulate);

/* One layer's mixer forward (norm, in_proj, scan, gate, out_proj + residual). */
m3_status N_(cpu_layer_forward)(N_(cpu_model) *m, int32_t layer, const uint8_t *resets,
                                const N_(cpu_state) *in, const N_(cpu_state) *final_state);
/* One layer's backward: reads dresid (dL/d resid[layer+1]), leaves dL/d resid[layer] there. */
m3_status N_(cpu_layer_backward)(N_(cpu_model) *m, int32_t layer, const uint8_t *resets);

/* The scan over one layer for all (row, head) pairs; see scan.c. */
void N_(cpu_scan_forward)(N_(cpu_model) *m, int32_t layer, const uint8_t *resets,
                          const N_(cpu_state) *in, const N_(cpu_state) *final_state);
void N_(cpu_scan_backward)(N_(cpu_model) *m, int32_t layer, const uint8_t *resets);
int64_t N_(cpu_scan_scratch)(const m3_dims *d, int32_t T, int32_t chunk);

#undef N_

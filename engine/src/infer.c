/*
 * infer.c — the inference object (m3.h "inference"): a forward-only backend (backend.h,
 * infer = 1) over a copy of the weights, stepping rows from their carried state.
 *
 * A step of any length runs as windows of at most max_len positions: the rows' pieces
 * [t0, t0 + n) are gathered into staging buffers, run, and their outputs scattered back
 * into out [rows, len, d_model]. Because every window starts where the previous one ended,
 * the pieces compute the same recurrence as one long window. Inputs are checked before
 * anything runs, so a bad prompt leaves the state as it was; that includes a NaN or an infinite
 * input feature, which would otherwise run into the row's carried state for good (the state that
 * m3_infer_set_state refuses).
 */
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "errors.h"
#include "weights.h"

struct m3_infer {
  m3_infer_cfg cfg;     /* as created (cfg.weights is NULL) */
  m3_config model;
  m3_dims dims;
  m3_layout layout;
  backend *be;
  const backend_ops *ops;
  int32_t device;       /* M3_DEVICE_CPU or M3_DEVICE_CUDA */
  int32_t logit_rows;   /* rows of the last step, 0 before the first */
  int32_t poisoned;
  /* staging of one window when a step is longer than max_len */
  int32_t *tokens;      /* [batch, max_len] */
  float *input;         /* [batch, max_len, input width] */
  uint8_t *resets;      /* [batch, max_len] */
  float *out;           /* [batch, max_len, d_model] */
};

void m3_infer_cfg_defaults(m3_infer_cfg *c) {
  if (!c) return;
  memset(c, 0, sizeof *c);
  c->device = M3_DEVICE_AUTO;
  c->precision = M3_PRECISION_F32;
  c->batch = 1;
  c->max_len = 256;
  c->graph = 1;
}

static m3_status check_cfg(const m3_infer_cfg *c) {
  if (!c->weights) return m3_fail(M3_ERR_ARGUMENT, "m3_infer_create: cfg->weights is NULL");
  if (c->batch < 1) return m3_fail(M3_ERR_CONFIG, "batch = %d: must be an integer >= 1", c->batch);
  if (c->max_len < 1) return m3_fail(M3_ERR_CONFIG, "max_len = %d: must be an integer >= 1", c->max_len);
  if ((int64_t)c->batch * c->max_len > INT32_MAX) /* positions are counted in int (BLAS) */
    return m3_fail(M3_ERR_CONFIG, "batch * max_len = %lld: must be < 2^31", (long long)c->batch * c->max_len);
  TRY(m3_check_flag("graph", c->graph));
  TRY(m3_check_flag("allow_tf32", c->allow_tf32));
  return m3_check_placement(c->precision, c->device, c->device_index);
}

static m3_status alloc_staging(m3_infer *inf) {
  const int64_t n = (int64_t)inf->cfg.batch * inf->cfg.max_len;
  const m3_dims *d = &inf->dims;
  if (d->input == M3_INPUT_TOKENS) inf->tokens = malloc((size_t)n * sizeof(int32_t));
  else inf->input = malloc((size_t)(n * d->input_dim) * sizeof(float));
  inf->resets = malloc((size_t)n);
  inf->out = malloc((size_t)(n * d->dm) * sizeof(float));
  if ((!inf->tokens && !inf->input) || !inf->resets || !inf->out)
    return m3_fail(M3_ERR_MEMORY, "out of host memory for the staging of %lld positions", (long long)n);
  return M3_OK;
}

m3_status m3_infer_create(const m3_infer_cfg *cfg, m3_infer **out) {
  if (!cfg || !out) return m3_fail(M3_ERR_ARGUMENT, "m3_infer_create: NULL argument");
  *out = NULL;
  TRY(check_cfg(cfg));
  TRY(m3_weights_check_finite(cfg->weights, M3_ERR_ARGUMENT));
  m3_infer *inf = calloc(1, sizeof *inf);
  if (!inf) return m3_fail(M3_ERR_MEMORY, "out of memory");
  inf->cfg = *cfg;
  inf->cfg.weights = NULL;
  inf->model = cfg->weights->cfg;
  m3_dims_from_config(&inf->model, &inf->dims);
  m3_status st = m3_layout_build(&inf->model, &inf->layout);
  if (st == M3_OK) st = alloc_staging(inf);
  if (st == M3_OK) {
    backend_args a = {&inf->model, &inf->dims,      &inf->layout,    cfg->weights->arena, cfg->batch, cfg->max_len,
                      cfg->precision, cfg->device_index, cfg->allow_tf32, 1,                  cfg->graph != 0};
    st = m3_backend_open(&a, cfg->device, &inf->device, &inf->be, &inf->ops);
  }
  if (st != M3_OK) {
    m3_infer_destroy(inf);
    return st;
  }
  if (inf->device == M3_DEVICE_CPU) inf->cfg.device_index = 0;
  *out = inf;
  return M3_OK;
}

void m3_infer_destroy(m3_infer *inf) {
  if (!inf) return;
  if (inf->be) inf->ops->destroy(inf->be);
  m3_layout_free(&inf->layout);
  free(inf->tokens);
  free(inf->input);
  free(inf->resets);
  free(inf->out);
  free(inf);
}

const m3_config *m3_infer_config(const m3_infer *inf) { return inf ? &inf->model : NULL; }

void m3_infer_get_info(const m3_infer *inf, m3_infer_info *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  if (!inf) return;
  o->device = inf->device;
  o->device_index = inf->cfg.device_index;
  o->precision = inf->cfg.precision;
  o->batch = inf->cfg.batch;
  o->max_len = inf->cfg.max_len;
  o->graph = inf->device == M3_DEVICE_CUDA && inf->cfg.graph;
  o->poisoned = inf->poisoned;
  o->logit_rows = inf->logit_rows;
  o->device_bytes = inf->ops->device_bytes(inf->be);
  o->fused_decode = inf->ops->fused_decode ? inf->ops->fused_decode(inf->be) : 0;
}

/* ---- guards ---------------------------------------------------------------------------------- */

/* call: the failing call's name, which starts the message. */
static m3_status usable(const m3_infer *inf, const char *call) {
  if (!inf) return m3_fail(M3_ERR_ARGUMENT, "%s: the inference object is NULL", call);
  if (inf->poisoned)
    return m3_fail(M3_ERR_POISONED, "%s: this inference object hit a sticky CUDA error earlier and cannot be used; "
                                    "create a new one (other objects keep working)", call);
  return M3_OK;
}

static m3_status track(m3_infer *inf, m3_status st) {
  if (st == M3_ERR_POISONED) inf->poisoned = 1;
  return st;
}

/* ---- steps ----------------------------------------------------------------------------------- */

/* Positions [t0, t0 + n) of every row of b, gathered into the staging window. */
static m3_batch gather(m3_infer *inf, const m3_batch *b, int32_t t0, int32_t n) {
  const int64_t w = inf->dims.input == M3_INPUT_TOKENS ? 1 : inf->dims.input_dim;
  m3_batch p;
  memset(&p, 0, sizeof p);
  p.rows = b->rows;
  p.len = n;
  for (int32_t r = 0; r < b->rows; r++) {
    const int64_t src = (int64_t)r * b->len + t0, dst = (int64_t)r * n;
    if (b->tokens) memcpy(inf->tokens + dst, b->tokens + src, (size_t)n * sizeof(int32_t));
    else memcpy(inf->input + dst * w, b->input + src * w, (size_t)(n * w) * sizeof(float));
    if (b->resets) memcpy(inf->resets + dst, b->resets + src, (size_t)n);
  }
  if (b->tokens) p.tokens = inf->tokens;
  else p.input = inf->input;
  if (b->resets) p.resets = inf->resets;
  return p;
}

static void scatter(const m3_infer *inf, const m3_batch *b, int32_t t0, int32_t n, float *out) {
  const int64_t dm = inf->dims.dm;
  for (int32_t r = 0; r < b->rows; r++)
    memcpy(out + ((int64_t)r * b->len + t0) * dm, inf->out + (int64_t)r * n * dm, (size_t)(n * dm) * sizeof(float));
}

/* Every input feature of b is finite ("features" and "identity" models; b->input is there). */
static m3_status check_input_finite(const m3_infer *inf, const m3_batch *b) {
  if (inf->dims.input == M3_INPUT_TOKENS) return M3_OK;
  const int64_t w = inf->dims.input_dim;
  for (int64_t i = 0; i < (int64_t)b->rows * b->len; i++)
    TRY(m3_check_finite(M3_ERR_ARGUMENT, b->input + i * w, w, 0,
                        "step: batch.input (row %lld, position %lld) feature", (long long)(i / b->len),
                        (long long)(i % b->len)));
  return M3_OK;
}

static m3_status has_logits(const m3_infer *inf) {
  if (inf->dims.head != M3_HEAD_LM)
    return m3_fail(M3_ERR_UNSUPPORTED, "logits: the model's head is not \"lm\" (it has no logits)");
  return M3_OK;
}

m3_status m3_infer_step(m3_infer *inf, const m3_batch *b, float *out, float *logits) {
  TRY(usable(inf, "step"));
  TRY(m3_check_batch_inputs(&inf->dims, b, inf->cfg.batch, 0, "step"));
  TRY(check_input_finite(inf, b));
  if (logits) TRY(has_logits(inf)); /* refused before the state moves */
  m3_batch in;
  memset(&in, 0, sizeof in);
  in.rows = b->rows;
  in.len = b->len;
  in.tokens = inf->dims.input == M3_INPUT_TOKENS ? b->tokens : NULL;
  in.input = inf->dims.input == M3_INPUT_TOKENS ? NULL : b->input;
  in.resets = b->resets;
  const int32_t T = inf->cfg.max_len;
  for (int32_t t0 = 0; t0 < b->len; t0 += T) {
    if (m3_interrupted())
      return m3_fail(M3_ERR_INTERRUPTED, "interrupted at position %d of %d (the state has seen the positions before it)",
                     t0, b->len);
    const int32_t n = b->len - t0 < T ? b->len - t0 : T;
    if (n == b->len) {
      TRY(track(inf, inf->ops->infer(inf->be, &in, out)));
    } else {
      const m3_batch piece = gather(inf, &in, t0, n);
      TRY(track(inf, inf->ops->infer(inf->be, &piece, out ? inf->out : NULL)));
      if (out) scatter(inf, &in, t0, n, out);
    }
    inf->logit_rows = b->rows;
  }
  return logits ? m3_infer_logits(inf, logits) : M3_OK;
}

m3_status m3_infer_logits(const m3_infer *inf, float *logits) {
  TRY(usable(inf, "logits"));
  TRY(has_logits(inf));
  if (!logits) return m3_fail(M3_ERR_ARGUMENT, "logits: the destination is NULL");
  if (!inf->logit_rows) return m3_fail(M3_ERR_ORDER, "logits: no step has run yet");
  return track((m3_infer *)inf, inf->ops->read_logits(inf->be, inf->logit_rows, logits));
}

/* ---- state ----------------------------------------------------------------------------------- */

m3_status m3_infer_reset(m3_infer *inf, const int32_t *rows, int32_t n_rows) {
  TRY(usable(inf, "reset"));
  TRY(m3_check_rows(rows, n_rows, inf->cfg.batch, "reset"));
  return track(inf, inf->ops->reset_rows(inf->be, rows, n_rows));
}

m3_status m3_infer_get_state(const m3_infer *inf, int32_t layer, float *angle, float *ssm, float *k, float *v) {
  TRY(usable(inf, "get_state"));
  TRY(m3_check_layer(&inf->dims, layer, "get_state"));
  return track((m3_infer *)inf, inf->ops->get_state(inf->be, layer, angle, ssm, k, v));
}

m3_status m3_infer_set_state(m3_infer *inf, int32_t layer, const float *angle, const float *ssm, const float *k,
                             const float *v) {
  TRY(usable(inf, "set_state"));
  TRY(m3_check_layer(&inf->dims, layer, "set_state"));
  TRY(m3_check_state_values(&inf->dims, inf->cfg.batch, angle, ssm, k, v));
  return track(inf, inf->ops->set_state(inf->be, layer, angle, ssm, k, v));
}

/*
 * trainer.c — the trainer's policy (API.md): argument and batch validation, device
 * choice, the forward / backward_step / accumulation interlocks, clipping and AdamW
 * parameters, the step counter and the f16 dynamic loss scaler (SPEC.md §7). The math is
 * behind the backend ops (backend.h); a failing call changes nothing it has not reported.
 */
#include "trainer.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "config.h"
#include "errors.h"
#include "weights.h"

enum { SCALER_GROWTH_INTERVAL = 2000 };
static const double SCALER_INIT = 65536.0, SCALER_MAX = 16777216.0;

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

void m3_trainer_cfg_defaults(m3_trainer_cfg *c) {
  if (!c) return;
  memset(c, 0, sizeof *c);
  c->device = M3_DEVICE_AUTO;
  c->precision = M3_PRECISION_F32;
  c->batch = 8;
  c->seq_len = 256;
  c->lr = 1e-3;
  c->weight_decay = 1e-2;
  c->beta1 = 0.9;
  c->beta2 = 0.999;
  c->eps = 1e-8;
  c->no_decay = 1;
}

/* ---- creation ----------------------------------------------------------------------------- */

/* The update computes in float32: its largest step size lr / (1 - beta1) (Adam's bias correction at step 1),
 * weight_decay, lr * weight_decay and eps must stay finite there (an eps that rounds to infinity would divide every
 * step to 0: only the decay would move a weight), and neither lr (no step would move a weight) nor eps
 * (0 / (0 + 0) where a gradient is 0) may round to 0. code: the status of a failure; call: its message prefix. */
static m3_status check_float_range(double lr, double wd, double beta1, double eps, m3_status code, const char *call) {
  if (lr / (1 - beta1) > FLT_MAX)
    return m3_fail(code, "%slr = %g: lr / (1 - beta1) = %g must be at most %g (float32)", call, lr, lr / (1 - beta1),
                   FLT_MAX);
  if (wd > FLT_MAX || lr * wd > FLT_MAX)
    return m3_fail(code, "%sweight_decay = %g with lr = %g: their product must be at most %g (float32)", call, wd, lr,
                   FLT_MAX);
  if (!((float)lr > 0)) return m3_fail(code, "%slr = %g: must be at least %g (float32)", call, lr, FLT_TRUE_MIN);
  if (!((float)eps > 0)) return m3_fail(code, "%seps = %g: must be at least %g (float32)", call, eps, FLT_TRUE_MIN);
  if (eps > FLT_MAX) return m3_fail(code, "%seps = %g: must be at most %g (float32)", call, eps, FLT_MAX);
  return M3_OK;
}

static m3_status check_cfg(const m3_trainer_cfg *c) {
  if (c->batch < 1) return m3_fail(M3_ERR_CONFIG, "batch = %d: must be an integer >= 1", c->batch);
  if (c->seq_len < 1) return m3_fail(M3_ERR_CONFIG, "seq_len = %d: must be an integer >= 1", c->seq_len);
  if ((int64_t)c->batch * c->seq_len > INT32_MAX) /* positions are counted in int (BLAS) */
    return m3_fail(M3_ERR_CONFIG, "batch * seq_len = %lld: must be < 2^31", (long long)c->batch * c->seq_len);
  if (!(isfinite(c->lr) && c->lr > 0))
    return m3_fail(M3_ERR_CONFIG, "lr = %g: must be a finite number > 0", m3_shown(c->lr));
  if (!(isfinite(c->weight_decay) && c->weight_decay >= 0))
    return m3_fail(M3_ERR_CONFIG, "weight_decay = %g: must be a finite number >= 0", m3_shown(c->weight_decay));
  if (!(c->beta1 >= 0 && c->beta1 < 1))
    return m3_fail(M3_ERR_CONFIG, "betas[1] = %g: must be in [0, 1)", m3_shown(c->beta1));
  if (!(c->beta2 >= 0 && c->beta2 < 1))
    return m3_fail(M3_ERR_CONFIG, "betas[2] = %g: must be in [0, 1)", m3_shown(c->beta2));
  if (!(isfinite(c->eps) && c->eps > 0))
    return m3_fail(M3_ERR_CONFIG, "eps = %g: must be a finite number > 0", m3_shown(c->eps));
  if (!(isfinite(c->clip) && c->clip >= 0))
    return m3_fail(M3_ERR_CONFIG, "clip = %g: must be a finite number >= 0 (0 = off)", m3_shown(c->clip));
  TRY(m3_check_flag("no_decay", c->no_decay));
  TRY(m3_check_flag("carry_state", c->carry_state));
  TRY(m3_check_flag("allow_tf32", c->allow_tf32));
  TRY(check_float_range(c->lr, c->weight_decay, c->beta1, c->eps, M3_ERR_CONFIG, ""));
  return m3_check_placement(c->precision, c->device, c->device_index);
}

static m3_status make_backend(m3_trainer *tr, const float *params) {
  backend_args a = {&tr->model, &tr->dims, &tr->layout, params, tr->cfg.batch, tr->cfg.seq_len,
                    tr->cfg.precision, tr->cfg.device_index, tr->cfg.allow_tf32, 0, 0};
  tr->device_index = tr->cfg.device_index;
  m3_status st = m3_backend_open(&a, tr->cfg.device, &tr->device, &tr->be, &tr->ops);
  if (tr->device == M3_DEVICE_CPU) tr->device_index = 0;
  return st;
}

m3_status m3_trainer_create_from(const m3_trainer_cfg *cfg, const m3_config *model, const float *params,
                                 m3_trainer **out) {
  TRY(check_cfg(cfg));
  TRY(m3_config_validate(model));
  m3_trainer *tr = calloc(1, sizeof *tr);
  if (!tr) return m3_fail(M3_ERR_MEMORY, "out of memory");
  tr->cfg = *cfg;
  tr->cfg.weights = NULL;
  tr->model = *model;
  m3_dims_from_config(model, &tr->dims);
  m3_status st = m3_layout_build(model, &tr->layout);
  if (st != M3_OK) {
    free(tr);
    return st;
  }
  tr->lr = cfg->lr;
  tr->clip = cfg->clip;
  tr->no_decay = cfg->no_decay != 0;
  tr->loss_scale = cfg->precision == M3_PRECISION_F16 ? SCALER_INIT : 1.0;
  m3_rng_seed(&tr->rng, cfg->seed);
  tr->reset_after_forward = calloc((size_t)cfg->batch, 1);
  st = tr->reset_after_forward ? make_backend(tr, params) : m3_fail(M3_ERR_MEMORY, "out of memory");
  if (st != M3_OK) {
    m3_trainer_destroy(tr);
    return st;
  }
  *out = tr;
  return M3_OK;
}

m3_status m3_trainer_create(const m3_trainer_cfg *cfg, m3_trainer **out) {
  if (!cfg || !out) return m3_fail(M3_ERR_ARGUMENT, "m3_trainer_create: NULL argument");
  *out = NULL;
  if (!cfg->weights) return m3_fail(M3_ERR_ARGUMENT, "m3_trainer_create: cfg->weights is NULL");
  TRY(m3_weights_check_finite(cfg->weights, M3_ERR_ARGUMENT));
  return m3_trainer_create_from(cfg, &cfg->weights->cfg, cfg->weights->arena, out);
}

void m3_trainer_destroy(m3_trainer *tr) {
  if (!tr) return;
  if (tr->be) tr->ops->destroy(tr->be);
  m3_layout_free(&tr->layout);
  free(tr->reset_after_forward);
  free(tr->extra);
  free(tr);
}

const m3_config *m3_trainer_config(const m3_trainer *tr) { return tr ? &tr->model : NULL; }

void m3_trainer_get_info(const m3_trainer *tr, m3_trainer_info *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  if (!tr) return;
  o->device = tr->device;
  o->device_index = tr->device_index;
  o->precision = tr->cfg.precision;
  o->batch = tr->cfg.batch;
  o->seq_len = tr->cfg.seq_len;
  o->carry_state = tr->cfg.carry_state;
  o->no_decay = tr->no_decay;
  o->clip = tr->clip;
  o->step = tr->step;
  o->pending_forward = tr->pending_forward;
  o->window_open = tr->window_open;
  o->has_graph = tr->ops->has_graph(tr->be);
  o->poisoned = tr->poisoned;
  o->device_bytes = tr->ops->device_bytes(tr->be);
  o->gemm_seconds = tr->ops->gemm_seconds ? tr->ops->gemm_seconds(tr->be) : -1;
}

/* ---- guards -------------------------------------------------------------------------------- */

/* call: the failing call's name, which starts every message of the checks below. */
static m3_status usable(const m3_trainer *tr, const char *call) {
  if (!tr) return m3_fail(M3_ERR_ARGUMENT, "%s: the trainer is NULL", call);
  if (tr->poisoned)
    return m3_fail(M3_ERR_POISONED, "%s: this trainer hit a sticky CUDA error earlier and cannot be used; "
                                    "save nothing from it, create a new one (other objects keep working)", call);
  return M3_OK;
}

/* Marks the trainer poisoned when its backend reports a sticky device error. */
static m3_status track(m3_trainer *tr, m3_status st) {
  if (st == M3_ERR_POISONED) tr->poisoned = 1;
  return st;
}

static m3_status check_batch_inputs(const m3_trainer *tr, const m3_batch *b, const char *call) {
  return m3_check_batch_inputs(&tr->dims, b, tr->cfg.batch, tr->cfg.seq_len, call);
}

/* Checks the head's fields of b; *counted (may be NULL) receives the positions its loss counts, found in the same
 * pass: "lm" targets other than -1, "mse" positions whose mask is set (all without a mask), every position for
 * "none". */
static m3_status check_batch_targets(const m3_trainer *tr, const m3_batch *b, int64_t *counted, const char *call) {
  const m3_dims *d = &tr->dims;
  const int64_t n = (int64_t)b->rows * b->len;
  int64_t c = n;
  switch (d->head) {
    case M3_HEAD_NONE:
      if (!b->d_out) return m3_fail(M3_ERR_ARGUMENT, "%s: batch.d_out is missing: the model's head is \"none\"", call);
      break;
    case M3_HEAD_LM:
      if (!b->targets)
        return m3_fail(M3_ERR_ARGUMENT, "%s: batch.targets is missing: the model's head is \"lm\"", call);
      c = 0;
      for (int64_t i = 0; i < n; i++) {
        if (b->targets[i] < -1 || b->targets[i] >= d->vocab)
          return m3_fail(M3_ERR_ARGUMENT,
                         "%s: batch.targets[%lld] (row %lld, position %lld) = %d: must be in [0, %d) or -1 (ignored)",
                         call, (long long)i, (long long)(i / b->len), (long long)(i % b->len), b->targets[i], d->vocab);
        c += b->targets[i] != -1;
      }
      break;
    case M3_HEAD_MSE:
      if (!b->target_values)
        return m3_fail(M3_ERR_ARGUMENT, "%s: batch.target_values is missing: the model's head is \"mse\"", call);
      if (b->mask) {
        c = 0;
        for (int64_t i = 0; i < n; i++) c += b->mask[i] != 0;
      }
      break;
  }
  if (counted) *counted = c;
  return M3_OK;
}

/* A loss is a mean over the counted positions: with none it does not exist, and an update from it would
 * only apply the weight decay and the moments' decay to data that taught nothing. counted: what the call's
 * batch counts; split: the call is backward_step (its forward stays pending), window: one whose open window
 * counted nothing before it either. */
static m3_status check_counts_some(const m3_trainer *tr, int64_t counted, int split, int window) {
  if (tr->dims.head == M3_HEAD_NONE || counted > 0) return M3_OK;
  return m3_fail(M3_ERR_ARGUMENT,
                 "%s: the %s counts no position (%s%s), so there is no loss to take the gradient of and no update "
                 "to apply; nothing was run%s",
                 split ? "backward_step" : "step", window ? "accumulation window" : "batch",
                 tr->dims.head == M3_HEAD_LM ? "every target is -1" : "every mask entry is 0",
                 window ? " in each of its micro-batches" : "",
                 !split ? "" : window ? " (the forward is still pending and the window open)"
                                      : " (the forward is still pending)");
}

m3_status m3_trainer_check_batch(const m3_trainer *tr, const m3_batch *b, int64_t *counted) {
  TRY(usable(tr, "check_batch"));
  TRY(check_batch_inputs(tr, b, "check_batch"));
  TRY(check_batch_targets(tr, b, counted, "check_batch"));
  return M3_OK;
}

static step_params make_params(const m3_trainer *tr, double clip) {
  const double t = (double)(tr->step + 1);
  step_params p = {tr->lr, tr->cfg.weight_decay, tr->cfg.beta1, tr->cfg.beta2, tr->cfg.eps,
                   1 - pow(tr->cfg.beta1, t), 1 - pow(tr->cfg.beta2, t), clip, 1.0 / tr->loss_scale, tr->no_decay};
  return p;
}

static void fill_head(const m3_trainer *tr, m3_metrics *m, const head_result *h) {
  m->has_loss = h->has_loss && h->counted > 0; /* a mean over no positions is no loss */
  m->loss = m->has_loss ? h->loss : 0;
  m->counted = h->counted;
  if (tr->dims.head == M3_HEAD_LM && h->counted > 0) {
    m->has_accuracy = 1;
    m->accuracy = (double)h->correct / (double)h->counted;
  }
}

/* What a refused update did to the carried state (rewind_refused). */
typedef enum { STATE_MOVED, STATE_REWOUND, STATE_SET_KEPT } refused_state;

/* Applies the outcome of an update to the counters (SPEC.md §7); state: what a refused update did to the carried
 * state (m3_trainer_step, m3_trainer_backward_step). */
static m3_status finish_update(m3_trainer *tr, const update_result *u, double clip, refused_state state,
                               m3_metrics *m) {
  m->has_grad_norm = clip > 0;
  m->grad_norm = u->grad_norm;
  if (tr->cfg.precision == M3_PRECISION_F16) m->loss_scale = tr->loss_scale;
  if (!u->finite) {
    if (tr->cfg.precision == M3_PRECISION_F16) {
      tr->loss_scale = tr->loss_scale / 2 < 1 ? 1 : tr->loss_scale / 2;
      tr->tracker = 0;
      m->overflow_skipped = 1;
      m->step = tr->step;
      return M3_OK;
    }
    m->step = tr->step;
    return m3_fail(M3_ERR_NONFINITE,
                   "non-finite gradient (global norm %g): the update was skipped; weights, Adam moments%s and the "
                   "step count are unchanged%s",
                   m3_shown(u->grad_norm), state == STATE_REWOUND ? ", the carried state" : "",
                   state == STATE_SET_KEPT ? "; the carried state stays where set_state put it after the forward" : "");
  }
  tr->step++;
  m->optimizer_stepped = 1;
  m->step = tr->step;
  if (tr->cfg.precision == M3_PRECISION_F16 && ++tr->tracker >= SCALER_GROWTH_INTERVAL) {
    tr->loss_scale = tr->loss_scale * 2 > SCALER_MAX ? SCALER_MAX : tr->loss_scale * 2;
    tr->tracker = 0;
  }
  return M3_OK;
}

/* An f32 / bf16 update that is refused leaves everything as it was, the carried state too: the state of rows [0,
 * rows) goes back to where the last training forward began (SPEC.md §7; an f16 overflow skips only the update, as a
 * skipped optimizer step does elsewhere). split: the split API's backward_step, where what the caller did to the
 * state after the forward stays done: rows it reset are reset again, and after a set_state the state is kept as
 * it is (a fused step leaves the caller no moment to do either). */
static m3_status rewind_refused(m3_trainer *tr, const update_result *u, int32_t rows, int split,
                                refused_state *state) {
  *state = STATE_MOVED;
  if (u->finite || tr->cfg.precision == M3_PRECISION_F16 || !tr->cfg.carry_state || !tr->ops->rewind_state)
    return M3_OK;
  if (split && tr->state_set_after_forward) {
    *state = STATE_SET_KEPT;
    return M3_OK;
  }
  *state = STATE_REWOUND;
  TRY(track(tr, tr->ops->rewind_state(tr->be, rows)));
  for (int32_t r = 0; split && r < rows; r++)
    if (tr->reset_after_forward[r]) TRY(track(tr, tr->ops->reset_rows(tr->be, &r, 1)));
  return M3_OK;
}

/* A split forward begins: nothing has been done to the state it leaves yet. */
static void forget_state_changes(m3_trainer *tr) {
  memset(tr->reset_after_forward, 0, (size_t)tr->cfg.batch);
  tr->state_set_after_forward = 0;
}

static void begin_metrics(const m3_batch *b, m3_metrics *m) {
  memset(m, 0, sizeof *m);
  m->tokens = (int64_t)b->rows * b->len;
}

/* ---- training calls --------------------------------------------------------------------------- */

m3_status m3_trainer_step(m3_trainer *tr, const m3_batch *b, m3_metrics *out) {
  TRY(usable(tr, "step"));
  const double t0 = now_ms();
  if (tr->window_open)
    return m3_fail(M3_ERR_ORDER, "step: an accumulation window is open; close it with backward_step without "
                                 "accumulate first");
  if (tr->pending_forward)
    return m3_fail(M3_ERR_ORDER, "step: a forward is pending; finish it with backward_step first");
  TRY(check_batch_inputs(tr, b, "step"));
  int64_t counted;
  TRY(check_batch_targets(tr, b, &counted, "step"));
  TRY(check_counts_some(tr, counted, 0, 0));
  if (m3_interrupted()) return m3_fail(M3_ERR_INTERRUPTED, "interrupted before the step");
  m3_metrics m;
  begin_metrics(b, &m);
  const step_params p = make_params(tr, tr->clip);
  head_result h = {0};
  update_result u = {0};
  if (tr->ops->step) {
    TRY(track(tr, tr->ops->step(tr->be, b, tr->cfg.carry_state, tr->loss_scale, &p, &h, &u, &m.graph_replayed)));
  } else {
    TRY(track(tr, tr->ops->forward(tr->be, b, tr->cfg.carry_state, 1, NULL)));
    TRY(track(tr, tr->ops->backward(tr->be, b, tr->loss_scale, 1, &h)));
    TRY(track(tr, tr->ops->update(tr->be, &p, &u)));
  }
  fill_head(tr, &m, &h);
  refused_state state;
  TRY(rewind_refused(tr, &u, b->rows, 0, &state));
  m3_status st = finish_update(tr, &u, p.clip, state, &m);
  m.ms = now_ms() - t0;
  if (out) *out = m;
  return st;
}

m3_status m3_trainer_forward(m3_trainer *tr, const m3_batch *b, float *out) {
  TRY(usable(tr, "forward"));
  TRY(check_batch_inputs(tr, b, "forward"));
  if (m3_interrupted()) return m3_fail(M3_ERR_INTERRUPTED, "interrupted before the forward");
  tr->pending_forward = 0;
  forget_state_changes(tr);
  TRY(track(tr, tr->ops->forward(tr->be, b, tr->cfg.carry_state, 1, out)));
  tr->pending_forward = 1;
  tr->pending_rows = b->rows;
  tr->pending_len = b->len;
  return M3_OK;
}

m3_status m3_trainer_backward_step(m3_trainer *tr, const m3_batch *b, const m3_backward_opts *opts,
                                   m3_metrics *out) {
  TRY(usable(tr, "backward_step"));
  const double t0 = now_ms();
  m3_backward_opts o = {-1, 0, 1};
  if (opts) o = *opts;
  if (!tr->pending_forward)
    return m3_fail(M3_ERR_ORDER, "backward_step: no pending forward; call forward(batch) first (each forward "
                                 "allows one backward_step)");
  if (!(o.scale >= FLT_MIN && o.scale <= FLT_MAX)) /* the backends weight the loss in float32 */
    return m3_fail(M3_ERR_ARGUMENT,
                   "backward_step: scale = %g: expected a finite number > 0 that float32 holds as a normal number "
                   "(%g to %g; a smaller one would make this micro-batch's gradient 0, a larger one infinite)",
                   m3_shown(o.scale), FLT_MIN, FLT_MAX);
  if (o.accumulate != 0 && o.accumulate != 1)
    return m3_fail(M3_ERR_ARGUMENT, "backward_step: accumulate = %d: must be 0 or 1", o.accumulate);
  if (isnan(o.clip) || isinf(o.clip))
    return m3_fail(M3_ERR_ARGUMENT, "backward_step: clip = %g must be finite (0 = off)", m3_shown(o.clip));
  if (o.accumulate && o.clip > 0)
    return m3_fail(M3_ERR_ARGUMENT, "backward_step: clip with accumulate; clipping applies when the window "
                                    "closes, so pass clip to the closing backward_step");
  if (o.accumulate && tr->cfg.precision == M3_PRECISION_F16)
    return m3_fail(M3_ERR_UNSUPPORTED, "backward_step: accumulate is not supported with f16 (an overflow skips "
                                       "the whole update); use bf16 or f32 for accumulation windows");
  if (!b) return m3_fail(M3_ERR_ARGUMENT, "backward_step: batch is NULL");
  if (b->rows != tr->pending_rows || b->len != tr->pending_len)
    return m3_fail(M3_ERR_ARGUMENT, "backward_step: batch is %d x %d but the pending forward was %d x %d", b->rows,
                   b->len, tr->pending_rows, tr->pending_len);
  int64_t counted;
  TRY(check_batch_targets(tr, b, &counted, "backward_step"));
  const int64_t window_counted = tr->window_open ? tr->window_counted : 0;
  if (!o.accumulate) TRY(check_counts_some(tr, window_counted + counted, 1, tr->window_open));
  const double clip = o.clip < 0 ? tr->clip : o.clip;
  m3_metrics m;
  begin_metrics(b, &m);
  head_result h = {0};
  const int one_forward = !tr->window_open; /* the window this call closes holds only the pending forward */
  TRY(track(tr, tr->ops->backward(tr->be, b, o.scale * tr->loss_scale, one_forward, &h)));
  tr->pending_forward = 0;
  fill_head(tr, &m, &h);
  m3_status st = M3_OK;
  if (o.accumulate) {
    tr->window_counted = window_counted + counted;
    tr->window_open = 1;
    m.step = tr->step;
  } else {
    tr->window_open = 0;
    const step_params p = make_params(tr, clip);
    update_result u = {0};
    TRY(track(tr, tr->ops->update(tr->be, &p, &u)));
    /* the carried state goes back where the window was that forward alone (the forwards of a longer window
     * moved it one after another; it keeps them) */
    refused_state state = STATE_MOVED;
    if (one_forward) TRY(rewind_refused(tr, &u, b->rows, 1, &state));
    st = finish_update(tr, &u, clip, state, &m);
  }
  m.ms = now_ms() - t0;
  if (out) *out = m;
  return st;
}

m3_status m3_trainer_evaluate(m3_trainer *tr, const m3_batch *b, m3_metrics *metrics, float *out) {
  TRY(usable(tr, "evaluate"));
  const double t0 = now_ms();
  if (tr->pending_forward)
    return m3_fail(M3_ERR_ORDER, "evaluate: a forward is pending and evaluate would overwrite its activations; "
                                 "call backward_step first");
  TRY(check_batch_inputs(tr, b, "evaluate"));
  if (tr->dims.head != M3_HEAD_NONE) TRY(check_batch_targets(tr, b, NULL, "evaluate"));
  m3_metrics m;
  begin_metrics(b, &m);
  head_result h = {0};
  TRY(track(tr, tr->ops->evaluate(tr->be, b, tr->cfg.carry_state, &h, out)));
  fill_head(tr, &m, &h);
  m.step = tr->step;
  m.ms = now_ms() - t0;
  if (metrics) *metrics = m;
  return M3_OK;
}

/* ---- graphs, hyper-parameters -------------------------------------------------------------------- */

m3_status m3_trainer_capture_graph(m3_trainer *tr) {
  TRY(usable(tr, "capture_graph"));
  if (tr->window_open || tr->pending_forward)
    return m3_fail(M3_ERR_ORDER, "capture_graph: finish the pending forward / accumulation window first");
  return track(tr, tr->ops->capture_graph(tr->be));
}

m3_status m3_trainer_drop_graph(m3_trainer *tr) {
  TRY(usable(tr, "drop_graph"));
  return track(tr, tr->ops->drop_graph(tr->be));
}

int32_t m3_trainer_has_graph(const m3_trainer *tr) { return tr && !tr->poisoned ? tr->ops->has_graph(tr->be) : 0; }

/* Called after the call's own arguments are checked, so that those are judged on every backend. */
static m3_status profiling_available(const m3_trainer *tr, const char *call) {
  if (!tr->ops->set_profiling)
    return m3_fail(M3_ERR_UNSUPPORTED, "%s: phase timing needs the CUDA backend (this trainer runs on %s)", call,
                   tr->ops->name);
  return M3_OK;
}

m3_status m3_trainer_set_profiling(m3_trainer *tr, int32_t on) {
  TRY(usable(tr, "set_profiling"));
  if (on != 0 && on != 1) return m3_fail(M3_ERR_ARGUMENT, "set_profiling: on = %d: must be 0 or 1", on);
  TRY(profiling_available(tr, "set_profiling"));
  return track(tr, tr->ops->set_profiling(tr->be, on));
}

m3_status m3_trainer_profile(const m3_trainer *tr, m3_phase_time *out, int32_t cap, int32_t *n, int64_t *calls) {
  TRY(usable(tr, "profile"));
  if (!out || !n || !calls)
    return m3_fail(M3_ERR_ARGUMENT, "profile: out, n and calls are required (out %s, n %s, calls %s)",
                   out ? "given" : "NULL", n ? "given" : "NULL", calls ? "given" : "NULL");
  if (cap < 0) return m3_fail(M3_ERR_ARGUMENT, "profile: cap = %d: must be >= 0", cap);
  TRY(profiling_available(tr, "profile"));
  return tr->ops->profile(tr->be, out, cap, n, calls);
}

m3_status m3_trainer_set_lr(m3_trainer *tr, double lr) {
  TRY(usable(tr, "set_lr"));
  if (!(isfinite(lr) && lr > 0))
    return m3_fail(M3_ERR_ARGUMENT, "set_lr: lr = %g must be a finite number > 0", m3_shown(lr));
  TRY(check_float_range(lr, tr->cfg.weight_decay, tr->cfg.beta1, tr->cfg.eps, M3_ERR_ARGUMENT, "set_lr: "));
  tr->lr = lr;
  return M3_OK;
}

double m3_trainer_lr(const m3_trainer *tr) { return tr ? tr->lr : 0; }

m3_status m3_trainer_set_no_decay(m3_trainer *tr, int32_t reference) {
  TRY(usable(tr, "set_no_decay"));
  TRY(m3_check_flag("reference", reference)); /* as the trainer option it sets */
  tr->no_decay = reference;
  return M3_OK;
}

m3_status m3_trainer_set_clip(m3_trainer *tr, double max_norm) {
  TRY(usable(tr, "set_clip"));
  if (!(isfinite(max_norm) && max_norm >= 0))
    return m3_fail(M3_ERR_ARGUMENT, "set_clip: max_norm = %g must be a finite number >= 0 (0 = off)",
                   m3_shown(max_norm));
  tr->clip = max_norm;
  return M3_OK;
}

/* ---- state, weights, counters --------------------------------------------------------------------- */

m3_status m3_trainer_reset_state(m3_trainer *tr, const int32_t *rows, int32_t n_rows) {
  TRY(usable(tr, "reset_state"));
  TRY(m3_check_rows(rows, n_rows, tr->cfg.batch, "reset_state"));
  TRY(track(tr, tr->ops->reset_rows(tr->be, rows, n_rows)));
  if (!rows) memset(tr->reset_after_forward, 1, (size_t)tr->cfg.batch);
  for (int32_t i = 0; rows && i < n_rows; i++) tr->reset_after_forward[rows[i]] = 1;
  return M3_OK;
}

m3_status m3_trainer_get_state(const m3_trainer *tr, int32_t layer, float *angle, float *ssm, float *k, float *v) {
  TRY(usable(tr, "get_state"));
  TRY(m3_check_layer(&tr->dims, layer, "get_state"));
  return tr->ops->get_state(tr->be, layer, angle, ssm, k, v);
}

m3_status m3_trainer_set_state(m3_trainer *tr, int32_t layer, const float *angle, const float *ssm, const float *k,
                               const float *v) {
  TRY(usable(tr, "set_state"));
  if (!tr->cfg.carry_state) /* it would be taken and never read */
    return m3_fail(M3_ERR_UNSUPPORTED, "set_state: this trainer does not carry its state (carry_state = false): every "
                                       "window starts from zero state, so a state set here would never be used; "
                                       "create the trainer with carry_state = true");
  TRY(m3_check_layer(&tr->dims, layer, "set_state"));
  TRY(m3_check_state_values(&tr->dims, tr->cfg.batch, angle, ssm, k, v));
  TRY(track(tr, tr->ops->set_state(tr->be, layer, angle, ssm, k, v)));
  tr->state_set_after_forward = 1;
  return M3_OK;
}

/* M3_OK when the weights' config w is the trainer's model; else an error naming the first field that differs. */
static m3_status check_same_model(const m3_trainer *tr, const m3_config *w, const char *call) {
  char why[256];
  if (m3_config_same(w, &tr->model, why, sizeof why)) return M3_OK;
  return m3_fail(M3_ERR_ARGUMENT, "%s: the weights' config differs from the trainer's (%s)", call, why);
}

static m3_status read_into(const m3_trainer *tr, arena_kind kind, m3_weights *out, const char *call) {
  TRY(usable(tr, call));
  if (!out) return m3_fail(M3_ERR_ARGUMENT, "%s: the weights to copy into are NULL", call);
  TRY(check_same_model(tr, &out->cfg, call));
  return tr->ops->read_arena(tr->be, kind, out->arena);
}

m3_status m3_trainer_snapshot(const m3_trainer *tr, m3_weights *out) {
  return read_into(tr, ARENA_PARAMS, out, "snapshot");
}

m3_status m3_trainer_grads(const m3_trainer *tr, m3_weights *out) {
  return read_into(tr, ARENA_GRADS, out, "grads");
}

m3_status m3_trainer_load_weights(m3_trainer *tr, const m3_weights *w) {
  TRY(usable(tr, "load_weights"));
  if (!w) return m3_fail(M3_ERR_ARGUMENT, "load_weights: the weights are NULL");
  TRY(check_same_model(tr, &w->cfg, "load_weights"));
  if (tr->window_open || tr->pending_forward)
    return m3_fail(M3_ERR_ORDER, "load_weights: finish the pending forward / accumulation window first");
  TRY(m3_weights_check_finite(w, M3_ERR_ARGUMENT));
  return track(tr, tr->ops->write_arena(tr->be, ARENA_PARAMS, w->arena));
}

int64_t m3_trainer_step_count(const m3_trainer *tr) { return tr ? tr->step : 0; }

m3_status m3_trainer_scaler_state(const m3_trainer *tr, double *scale, int64_t *tracker) {
  TRY(usable(tr, "scaler_state"));
  if (tr->cfg.precision != M3_PRECISION_F16)
    return m3_fail(M3_ERR_UNSUPPORTED, "scaler_state: only f16 trainers have a loss scaler");
  if (scale) *scale = tr->loss_scale;
  if (tracker) *tracker = tr->tracker;
  return M3_OK;
}

m3_status m3_trainer_load_scaler_state(m3_trainer *tr, double scale, int64_t tracker) {
  TRY(usable(tr, "load_scaler_state"));
  if (tr->cfg.precision != M3_PRECISION_F16)
    return m3_fail(M3_ERR_UNSUPPORTED, "load_scaler_state: only f16 trainers have a loss scaler");
  if (!(isfinite(scale) && scale >= 1 && scale <= SCALER_MAX))
    return m3_fail(M3_ERR_ARGUMENT, "load_scaler_state: scale = %g must be in [1, 2^24]", m3_shown(scale));
  if (tracker < 0 || tracker >= SCALER_GROWTH_INTERVAL)
    return m3_fail(M3_ERR_ARGUMENT, "load_scaler_state: tracker = %lld must be in [0, %d)", (long long)tracker,
                   SCALER_GROWTH_INTERVAL);
  tr->loss_scale = scale;
  tr->tracker = tracker;
  return M3_OK;
}

const char *m3_trainer_extra(const m3_trainer *tr) { return tr && tr->extra ? tr->extra : ""; }

uint64_t m3_trainer_rng_next(m3_trainer *tr) { return tr ? m3_rng_next(&tr->rng) : 0; }

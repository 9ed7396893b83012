/*
 * cpu_backend.c — the CPU backend of the trainer (backend.h): the float32 model of this
 * folder plus the optimizer tail (gradient unscale, global norm, clipping, AdamW).
 *
 * Memory: parameters, gradients and both Adam moments are flat float32 arenas in the
 * layout of layout.h; activations live in the model (model.c), sized once for batch x
 * seq_len. The global norm is summed in double over fixed blocks, then the blocks in
 * order, so it is the same for any thread count.
 *
 * Created for inference (args infer = 1) it holds only the parameters and a forward-only
 * model; the "lm" head's logits of a step's last position wait in the model's logits
 * buffer [batch, vocab] until read_logits.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "../backend.h"
#include "../weights.h"
#include "model.h"
#include "../threads.h"

enum { NORM_BLOCK = 1 << 14 };

struct backend {
  const m3_dims *d;
  const m3_layout *lay;
  cpu_model_f32 *m;
  float *params, *grads, *adam_m, *adam_v; /* [lay->total] each (params only for inference) */
};

static cpu_batch_f32 view(const m3_batch *b) {
  cpu_batch_f32 v = {b->rows, b->len, b->input, b->tokens, b->targets, b->target_values, b->mask, b->d_out,
                     b->resets};
  return v;
}

static void copy_out(const backend *be, const m3_batch *b, float *out) {
  if (out) memcpy(out, be->m->out, (size_t)((int64_t)b->rows * b->len * be->d->dm) * sizeof(float));
}

static head_result to_head(const cpu_head_result_f32 *r) {
  head_result h = {r->has_loss, r->loss, r->counted, r->correct};
  return h;
}

static void destroy(backend *be) {
  if (!be) return;
  cpu_model_destroy_f32(be->m);
  free(be->params);
  free(be->grads);
  free(be->adam_m);
  free(be->adam_v);
  free(be);
}

static m3_status forward(backend *be, const m3_batch *b, int carry, int train, float *out) {
  cpu_batch_f32 v = view(b);
  TRY(cpu_model_forward_f32(be->m, &v, carry, train));
  copy_out(be, b, out);
  return M3_OK;
}

static m3_status backward(backend *be, const m3_batch *b, double weight, int zero_grads, head_result *res) {
  cpu_batch_f32 v = view(b);
  cpu_head_result_f32 r;
  if (zero_grads) memset(be->grads, 0, (size_t)be->lay->total * sizeof(float));
  TRY(cpu_model_head_f32(be->m, &v, (float)weight, 1, &r));
  TRY(cpu_model_backward_f32(be->m));
  *res = to_head(&r);
  return M3_OK;
}

static double global_norm_sq(const float *g, int64_t n) {
  const int64_t blocks = (n + NORM_BLOCK - 1) / NORM_BLOCK;
  double *part = malloc((size_t)(blocks > 0 ? blocks : 1) * sizeof(double));
  if (!part) { /* fall back to one serial pass: same math, no allocation */
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += (double)g[i] * g[i];
    return s;
  }
#pragma omp parallel for schedule(static) num_threads(loop_threads(blocks, 2 * n, omp_get_max_threads()))
  for (int64_t bl = 0; bl < blocks; bl++) {
    const int64_t e = (bl + 1) * NORM_BLOCK < n ? (bl + 1) * NORM_BLOCK : n;
    double s = 0;
    for (int64_t i = bl * NORM_BLOCK; i < e; i++) s += (double)g[i] * g[i];
    part[bl] = s;
  }
  double total = 0;
  for (int64_t bl = 0; bl < blocks; bl++) total += part[bl];
  free(part);
  return total;
}

static m3_status update(backend *be, const step_params *p, update_result *res) {
  const int64_t n = be->lay->total;
  float *g = be->grads;
  if (p->grad_unscale != 1.0) {
    const float u = (float)p->grad_unscale;
#pragma omp parallel for schedule(static) num_threads(loop_threads(n, n, omp_get_max_threads()))
    for (int64_t i = 0; i < n; i++) g[i] *= u;
  }
  const double norm = sqrt(global_norm_sq(g, n));
  res->grad_norm = norm;
  res->finite = isfinite(norm);
  if (!res->finite) return M3_OK;
  float clip_scale = 1;
  if (p->clip > 0 && p->clip / (norm + 1e-6) < 1) clip_scale = (float)(p->clip / (norm + 1e-6));
  const float lr = (float)p->lr, b1 = (float)p->beta1, b2 = (float)p->beta2, eps = (float)p->eps;
  /* 1 - beta from the double: in float32 a beta within 6e-8 of 1 rounds to 1 and 1 - b would be 0 */
  const float c1 = (float)(1 - p->beta1), c2 = (float)(1 - p->beta2);
  const float step_size = (float)(p->lr / p->bias_correction1), bc2_sqrt = (float)sqrt(p->bias_correction2);
  for (int32_t t = 0; t < be->lay->n; t++) {
    const param_desc *pd = &be->lay->t[t];
    const float decay = 1 - lr * ((p->no_decay && pd->no_decay) ? 0.0f : (float)p->weight_decay);
    float *w = be->params + pd->offset, *gm = be->adam_m + pd->offset, *gv = be->adam_v + pd->offset;
    const float *gr = g + pd->offset;
#pragma omp parallel for schedule(static) num_threads(loop_threads(pd->numel, 16 * pd->numel, omp_get_max_threads()))
    for (int64_t i = 0; i < pd->numel; i++) {
      const float gi = gr[i] * clip_scale;
      gm[i] = b1 * gm[i] + c1 * gi;
      gv[i] = b2 * gv[i] + c2 * gi * gi;
      w[i] = w[i] * decay - step_size * gm[i] / (sqrtf(gv[i]) / bc2_sqrt + eps);
    }
  }
  return M3_OK;
}

static m3_status evaluate(backend *be, const m3_batch *b, int carry, head_result *res, float *out) {
  cpu_batch_f32 v = view(b);
  cpu_head_result_f32 r;
  TRY(cpu_model_forward_f32(be->m, &v, carry, 0));
  TRY(cpu_model_head_f32(be->m, &v, 1, 0, &r));
  copy_out(be, b, out);
  *res = to_head(&r);
  return M3_OK;
}

static m3_status infer(backend *be, const m3_batch *b, float *out) {
  cpu_batch_f32 v = view(b);
  TRY(cpu_model_forward_f32(be->m, &v, 1, 1));
  copy_out(be, b, out);
  if (be->d->head == M3_HEAD_LM) { /* the rows' last positions, gathered into scratch */
    cpu_model_f32 *m = be->m;
    const int32_t dm = be->d->dm;
    for (int32_t r = 0; r < b->rows; r++)
      memcpy(m->xn + (int64_t)r * dm, m->out + ((int64_t)r * b->len + b->len - 1) * dm, (size_t)dm * sizeof(float));
    cpu_gemm_f32(m, CblasNoTrans, CblasTrans, b->rows, be->d->vocab, dm, 1, m->xn, dm,
                 be->params + m3_layout_lm_weight(be->lay, be->d), dm, 0, m->logits, be->d->vocab);
  }
  return M3_OK;
}

static m3_status read_logits(const backend *be, int32_t rows, float *dst) {
  memcpy(dst, be->m->logits, (size_t)((int64_t)rows * be->d->vocab) * sizeof(float));
  return M3_OK;
}

static m3_status no_graphs(backend *be) {
  (void)be;
  return m3_fail(M3_ERR_UNSUPPORTED, "CUDA graphs need a CUDA device; this trainer runs on the CPU");
}

/* drop_graph: there is never a graph to drop (API.md: only capture is an error on the CPU) */
static m3_status no_graph_to_drop(backend *be) {
  (void)be;
  return M3_OK;
}

static int32_t has_graph(const backend *be) {
  (void)be;
  return 0;
}

/* Per-layer slices of the batch-first state tensors. */
typedef struct state_slice {
  float *angle, *ssm, *k, *v;
  int64_t n_angle, n_ssm, n_k, n_v; /* elements of one layer (all rows) */
} state_slice;

static state_slice slice(const backend *be, int32_t layer) {
  const m3_dims *d = be->d;
  const int64_t bh = (int64_t)be->m->B * d->H;
  state_slice s = {NULL, NULL, NULL, NULL, bh * d->S, bh * d->P * d->N, bh * d->N, bh * d->P};
  const cpu_state_f32 *st = &be->m->state;
  s.angle = st->angle + layer * s.n_angle;
  s.ssm = st->ssm + layer * s.n_ssm;
  s.k = st->k + layer * s.n_k;
  s.v = st->v + layer * s.n_v;
  return s;
}

static m3_status get_state(const backend *be, int32_t layer, float *angle, float *ssm, float *k, float *v) {
  state_slice s = slice(be, layer);
  if (angle) memcpy(angle, s.angle, (size_t)s.n_angle * sizeof(float));
  if (ssm) memcpy(ssm, s.ssm, (size_t)s.n_ssm * sizeof(float));
  if (k) memcpy(k, s.k, (size_t)s.n_k * sizeof(float));
  if (v) memcpy(v, s.v, (size_t)s.n_v * sizeof(float));
  return M3_OK;
}

static m3_status set_state(backend *be, int32_t layer, const float *angle, const float *ssm, const float *k,
                           const float *v) {
  state_slice s = slice(be, layer);
  if (angle) memcpy(s.angle, angle, (size_t)s.n_angle * sizeof(float));
  if (ssm) memcpy(s.ssm, ssm, (size_t)s.n_ssm * sizeof(float));
  if (k) memcpy(s.k, k, (size_t)s.n_k * sizeof(float));
  if (v) memcpy(s.v, v, (size_t)s.n_v * sizeof(float));
  return M3_OK;
}

static m3_status rewind_state(backend *be, int32_t rows) {
  cpu_model_rewind_state_f32(be->m, rows);
  return M3_OK;
}

static m3_status reset_rows(backend *be, const int32_t *rows, int32_t n_rows) {
  const int32_t B = be->m->B;
  const int32_t count = rows ? n_rows : B;
  for (int32_t l = 0; l < be->d->L; l++) {
    state_slice s = slice(be, l);
    for (int32_t i = 0; i < count; i++) {
      const int64_t r = rows ? rows[i] : i;
      memset(s.angle + r * (s.n_angle / B), 0, (size_t)(s.n_angle / B) * sizeof(float));
      memset(s.ssm + r * (s.n_ssm / B), 0, (size_t)(s.n_ssm / B) * sizeof(float));
      memset(s.k + r * (s.n_k / B), 0, (size_t)(s.n_k / B) * sizeof(float));
      memset(s.v + r * (s.n_v / B), 0, (size_t)(s.n_v / B) * sizeof(float));
    }
  }
  return M3_OK;
}

static float *arena(const backend *be, arena_kind kind) {
  switch (kind) {
    case ARENA_PARAMS: return be->params;
    case ARENA_GRADS: return be->grads;
    case ARENA_ADAM_M: return be->adam_m;
    case ARENA_ADAM_V: return be->adam_v;
  }
  return NULL;
}

static m3_status read_arena(const backend *be, arena_kind kind, float *dst) {
  memcpy(dst, arena(be, kind), (size_t)be->lay->total * sizeof(float));
  return M3_OK;
}

static m3_status write_arena(backend *be, arena_kind kind, const float *src) {
  memcpy(arena(be, kind), src, (size_t)be->lay->total * sizeof(float));
  if (kind == ARENA_PARAMS && be->m->params_t) cpu_model_transpose_weights_f32(be->m);
  return M3_OK;
}

static int64_t device_bytes(const backend *be) {
  (void)be;
  return 0;
}

static double gemm_seconds(const backend *be) { return be->m->gemm_seconds; }

static const backend_ops cpu_ops = {
    .name = "cpu",
    .destroy = destroy,
    .forward = forward,
    .backward = backward,
    .update = update,
    .step = NULL,
    .evaluate = evaluate,
    .capture_graph = no_graphs,
    .drop_graph = no_graph_to_drop,
    .has_graph = has_graph,
    .get_state = get_state,
    .set_state = set_state,
    .reset_rows = reset_rows,
    .rewind_state = rewind_state,
    .read_arena = read_arena,
    .write_arena = write_arena,
    .device_bytes = device_bytes,
    .gemm_seconds = gemm_seconds,
    .infer = infer,
    .read_logits = read_logits,
};

m3_status m3_cpu_backend_create(const backend_args *a, backend **out, const backend_ops **ops) {
  backend *be = calloc(1, sizeof *be);
  if (!be) return m3_fail(M3_ERR_MEMORY, "out of memory");
  be->d = a->dims;
  be->lay = a->layout;
  const int64_t n = a->layout->total;
  be->params = m3_alloc_floats(n);
  if (!a->infer) {
    be->grads = m3_alloc_floats(n);
    be->adam_m = m3_alloc_floats(n);
    be->adam_v = m3_alloc_floats(n);
  }
  if (!be->params || (!a->infer && (!be->grads || !be->adam_m || !be->adam_v))) {
    destroy(be);
    return m3_fail(M3_ERR_MEMORY, "out of host memory for %lld parameters", (long long)a->layout->n_params);
  }
  memcpy(be->params, a->params, (size_t)n * sizeof(float));
  m3_status st = a->infer ? cpu_model_create_forward_f32(a->dims, a->layout, a->batch, a->seq_len, &be->m)
                          : cpu_model_create_f32(a->dims, a->layout, a->batch, a->seq_len, &be->m);
  if (st != M3_OK) {
    destroy(be);
    return st;
  }
  be->m->params = be->params;
  be->m->grads = be->grads;
  if (a->infer) cpu_model_transpose_weights_f32(be->m);
  *out = be;
  *ops = &cpu_ops;
  return M3_OK;
}

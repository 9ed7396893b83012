/*
 * test_golden.c — the CPU model against ../shared/golden (float64 results of SPEC.md made
 * by an independent implementation). The double build must agree to 1e-9 relative; the
 * float build within SPEC.md §8 f32 tolerances (out, final states, loss 1e-5; every
 * gradient 1e-4). Skipped (exit 77) when ../shared/golden is absent.
 *
 * For "lm" cases the golden `logits` [B, T, vocab] too, at the precision's `out` tolerance
 * (1e-9, 1e-5), every position: the float build through the public inference API on the CPU
 * (golden.h's golden_check_infer_logits: the window stepped one token at a time, each step's
 * last-position logits being position t's, then stepped whole, its last position); the double
 * build, which m3_infer does not offer (the CPU backend computes in float), through the
 * forward-only model m3_infer runs on, in double, stepped the same ways, with the head's
 * logits out · W_lmᵀ taken here. Both start from the case's incoming states and honour its
 * resets.
 */
#include "cpu/model.h"
#include "golden.h"
#include "layout.h"

static const double TOL_F64 = 1e-9, TOL_F32_OUT = 1e-5, TOL_F32_GRAD = 1e-4;

/* One case prepared for both builds: layout, inputs and what a run gives back (as double). */
typedef struct problem {
  const golden_case *g;
  m3_dims d;
  m3_layout lay;
  long M, per[4];            /* positions; state elements per layer of each kind */
  double *params, *input, *d_out;
  const int32_t *tokens, *targets;
  const uint8_t *resets;
  double *out, *grads, *state; /* results: [M, dm], [lay.total], [L, 4 kinds] */
  double loss;
  int has_loss;
} problem;

static double *state_slot(problem *p, int32_t l, int k) {
  double *s = p->state;
  for (int j = 0; j < 4; j++) s += j < k ? p->d.L * p->per[j] : 0;
  return s + l * p->per[k];
}

/* The file's init.<l>.<kind> tensors, in the model's [L, B, ...] order, as doubles. */
static void incoming(problem *p, double *dst[4]) {
  char name[64];
  for (int32_t l = 0; p->g->stateful && l < p->d.L; l++)
    for (int k = 0; k < 4; k++) {
      snprintf(name, sizeof name, "init.%d.%s", l, GOLDEN_STATE_KINDS[k]);
      CHECK(golden_to_double(p->g, name, dst[k] + l * p->per[k]) == p->per[k], "%s: %s missing", p->g->file, name);
    }
}

static void run_f64(problem *p) {
  cpu_model_f64 *m = NULL;
  CHECK_OK(cpu_model_create_f64(&p->d, &p->lay, p->g->B, p->g->T, &m));
  m->params = p->params;
  m->grads = p->grads;
  double *st[4] = {m->state.angle, m->state.ssm, m->state.k, m->state.v};
  incoming(p, st);
  cpu_batch_f64 b = {p->g->B, p->g->T, p->input, p->tokens, p->targets, NULL, NULL, p->d_out, p->resets};
  cpu_head_result_f64 r;
  CHECK_OK(cpu_model_forward_f64(m, &b, p->g->stateful, 1));
  CHECK_OK(cpu_model_head_f64(m, &b, 1, 1, &r));
  CHECK_OK(cpu_model_backward_f64(m));
  memcpy(p->out, m->out, (size_t)(p->M * p->d.dm) * sizeof(double));
  for (int k = 0; k < 4; k++) memcpy(state_slot(p, 0, k), st[k], (size_t)(p->d.L * p->per[k]) * sizeof(double));
  p->loss = r.loss;
  p->has_loss = r.has_loss;
  cpu_model_destroy_f64(m);
}

static float *to_floats(const double *x, long n) {
  float *f = calloc((size_t)n + 1, sizeof(float));
  for (long i = 0; i < n; i++) f[i] = (float)x[i];
  return f;
}

static void run_f32(problem *p) {
  const long total = p->lay.total;
  float *params = to_floats(p->params, total), *grads = calloc((size_t)total, sizeof(float));
  float *input = to_floats(p->input, p->M * p->d.input_dim), *d_out = to_floats(p->d_out, p->M * p->d.dm);
  cpu_model_f32 *m = NULL;
  CHECK_OK(cpu_model_create_f32(&p->d, &p->lay, p->g->B, p->g->T, &m));
  m->params = params;
  m->grads = grads;
  float *st[4] = {m->state.angle, m->state.ssm, m->state.k, m->state.v};
  double *init[4];
  for (int k = 0; k < 4; k++) init[k] = calloc((size_t)(p->d.L * p->per[k]) + 1, sizeof(double));
  incoming(p, init);
  for (int k = 0; k < 4; k++) {
    for (long i = 0; i < p->d.L * p->per[k]; i++) st[k][i] = (float)init[k][i];
    free(init[k]);
  }
  cpu_batch_f32 b = {p->g->B, p->g->T, input, p->tokens, p->targets, NULL, NULL, d_out, p->resets};
  cpu_head_result_f32 r;
  CHECK_OK(cpu_model_forward_f32(m, &b, p->g->stateful, 1));
  CHECK_OK(cpu_model_head_f32(m, &b, 1, 1, &r));
  CHECK_OK(cpu_model_backward_f32(m));
  for (long i = 0; i < p->M * p->d.dm; i++) p->out[i] = m->out[i];
  for (long i = 0; i < total; i++) p->grads[i] = grads[i];
  for (int k = 0; k < 4; k++)
    for (long i = 0; i < p->d.L * p->per[k]; i++) state_slot(p, 0, k)[i] = st[k][i];
  p->loss = r.loss;
  p->has_loss = r.has_loss;
  cpu_model_destroy_f32(m);
  free(params);
  free(grads);
  free(input);
  free(d_out);
}

static void compare(problem *p, const char *tag, double tol_out, double tol_grad) {
  const char *file = p->g->file;
  char name[128];
  double *ref = calloc((size_t)(p->lay.total + p->M * p->d.dm + p->per[1] + 16), sizeof(double));
  CHECK(golden_to_double(p->g, "out", ref) == p->M * p->d.dm, "%s: out missing", file);
  double e = rel_l2(p->out, ref, p->M * p->d.dm);
  CHECK(e <= tol_out, "%s %s: out differs by %.3g", file, tag, e);
  printf("%s %s: out %.2e", file, tag, e);
  if (p->has_loss) {
    double gl = 0;
    CHECK(golden_to_double(p->g, "loss", &gl) == 1, "%s: loss missing", file);
    e = fabs(p->loss - gl) / fabs(gl);
    CHECK(e <= tol_out, "%s %s: loss %.17g vs %.17g (%.3g)", file, tag, p->loss, gl, e);
    printf(", loss %.2e", e);
  }
  double worst = 0;
  for (int32_t i = 0; i < p->lay.n; i++) {
    const param_desc *t = &p->lay.t[i];
    snprintf(name, sizeof name, "grad.%s", t->name);
    CHECK(golden_to_double(p->g, name, ref) == t->numel, "%s: %s missing", file, name);
    e = rel_l2(p->grads + t->offset, ref, t->numel);
    CHECK(e <= tol_grad, "%s %s: %s differs by %.3g", file, tag, name, e);
    worst = fmax(worst, e);
  }
  printf(", worst grad %.2e", worst);
  worst = 0;
  for (int32_t l = 0; l < p->d.L; l++)
    for (int k = 0; k < 4; k++) {
      snprintf(name, sizeof name, "final.%d.%s", l, GOLDEN_STATE_KINDS[k]);
      CHECK(golden_to_double(p->g, name, ref) == p->per[k], "%s: %s missing", file, name);
      e = rel_l2(state_slot(p, l, k), ref, p->per[k]);
      CHECK(e <= tol_out, "%s %s: %s differs by %.3g", file, tag, name, e);
      worst = fmax(worst, e);
    }
  printf(", worst final state %.2e", worst);
  free(ref);
}

/* Logits [rows, len, vocab] of the forward-only model's last window: out · W_lmᵀ. */
static void lm_logits_f64(const problem *p, const cpu_model_f64 *m, int32_t rows, int32_t len, double *dst) {
  const long dm = p->d.dm, V = p->g->cfg.vocab_size;
  const double *W = p->params + m3_layout_lm_weight(&p->lay, &p->d);
  for (long i = 0; i < (long)rows * len; i++)
    for (long v = 0; v < V; v++) {
      double acc = 0;
      for (long j = 0; j < dm; j++) acc += m->out[i * dm + j] * W[v * dm + j];
      dst[i * V + v] = acc;
    }
}

/* The forward-only model's carried state where the case's window starts. */
static void start_f64(problem *p, cpu_model_f64 *m) {
  double *st[4] = {m->state.angle, m->state.ssm, m->state.k, m->state.v};
  for (int k = 0; k < 4; k++) memset(st[k], 0, (size_t)(p->d.L * p->per[k]) * sizeof(double));
  incoming(p, st);
}

/* "lm" logits in the double build (see the header): stepped token by token, every position,
 * then the whole window in one forward, every position (its last one included). */
static void logits_f64(problem *p) {
  const golden_case *g = p->g;
  const int32_t B = g->B, T = g->T;
  const long V = g->cfg.vocab_size, w = p->d.input_dim;
  double *ref = golden_logits_ref(g);
  if (!ref) return;
  cpu_model_f64 *m = NULL;
  CHECK_OK(cpu_model_create_forward_f64(&p->d, &p->lay, B, T, &m));
  if (!m) {
    free(ref);
    return;
  }
  m->params = p->params;
  cpu_model_transpose_weights_f64(m);
  double *got = calloc((size_t)((long)B * T * V), sizeof(double)), *lg = calloc((size_t)(B * V), sizeof(double));
  double *in_col = calloc((size_t)(B * w) + 1, sizeof(double));
  int32_t *tok_col = calloc((size_t)B, sizeof(int32_t));
  uint8_t *res_col = calloc((size_t)B, 1);
  start_f64(p, m);
  for (int32_t s = 0; s < T; s++) {
    for (int32_t r = 0; r < B; r++) {
      const long src = (long)r * T + s;
      if (p->tokens) tok_col[r] = p->tokens[src];
      else memcpy(in_col + r * w, p->input + src * w, (size_t)w * sizeof(double));
      if (p->resets) res_col[r] = p->resets[src];
    }
    cpu_batch_f64 b = {B, 1, p->tokens ? NULL : in_col, p->tokens ? tok_col : NULL, NULL, NULL, NULL, NULL,
                       p->resets ? res_col : NULL};
    CHECK_OK(cpu_model_forward_f64(m, &b, 1, 1));
    lm_logits_f64(p, m, B, 1, lg);
    for (int32_t r = 0; r < B; r++) memcpy(got + ((long)r * T + s) * V, lg + r * V, (size_t)V * sizeof(double));
  }
  double worst_pos = 0;
  const double e = golden_logits_rel(g, ref, got, 0, T, &worst_pos);
  CHECK(e <= TOL_F64 && worst_pos <= TOL_F64, "%s f64: logits (stepped token by token) differ by %.3g (worst position %.3g)",
        g->file, e, worst_pos);
  start_f64(p, m);
  cpu_batch_f64 b = {B, T, p->tokens ? NULL : p->input, p->tokens, NULL, NULL, NULL, NULL, p->resets};
  CHECK_OK(cpu_model_forward_f64(m, &b, 1, 1));
  lm_logits_f64(p, m, B, T, got);
  double worst_whole = 0;
  const double e_whole = golden_logits_rel(g, ref, got, 0, T, &worst_whole);
  CHECK(e_whole <= TOL_F64 && worst_whole <= TOL_F64, "%s f64: logits (whole window) differ by %.3g (worst position %.3g)",
        g->file, e_whole, worst_whole);
  printf(", logits %.2e (worst position %.2e, whole window %.2e)", e, worst_pos, e_whole);
  cpu_model_destroy_f64(m);
  free(ref);
  free(got);
  free(lg);
  free(in_col);
  free(tok_col);
  free(res_col);
}

/* "lm" logits in the float build through m3_infer on the CPU (golden.h). */
static void logits_f32(problem *p) {
  const golden_case *g = p->g;
  m3_weights *w = NULL;
  CHECK_OK(m3_weights_create(&g->cfg, &w));
  if (!w) return;
  char name[128];
  for (int32_t i = 0; i < m3_weights_count(w); i++) {
    m3_tensor_info ti;
    m3_weights_tensor(w, i, &ti);
    snprintf(name, sizeof name, "param.%s", ti.name);
    CHECK(golden_to_float(g, name, ti.data) == ti.numel, "%s: %s missing", g->file, name);
  }
  m3_infer_cfg ic;
  m3_infer_cfg_defaults(&ic);
  ic.weights = w;
  ic.device = M3_DEVICE_CPU;
  ic.batch = g->B;
  m3_infer *inf = NULL;
  CHECK_OK(m3_infer_create(&ic, &inf));
  if (inf) golden_check_infer_logits(g, inf, "f32", TOL_F32_OUT);
  m3_infer_destroy(inf);
  m3_weights_destroy(w);
}

static void run_case(const golden_case *g) {
  problem p = {.g = g};
  m3_dims_from_config(&g->cfg, &p.d);
  CHECK_OK(m3_layout_build(&g->cfg, &p.lay));
  const m3_dims *d = &p.d;
  p.M = (long)g->B * g->T;
  const long bh = (long)g->B * d->H;
  const long per[4] = {bh * d->S, bh * d->P * d->N, bh * d->N, bh * d->P};
  memcpy(p.per, per, sizeof per);
  p.params = calloc((size_t)p.lay.total, sizeof(double));
  p.grads = calloc((size_t)p.lay.total, sizeof(double));
  char name[128];
  for (int32_t i = 0; i < p.lay.n; i++) {
    snprintf(name, sizeof name, "param.%s", p.lay.t[i].name);
    CHECK(golden_to_double(g, name, p.params + p.lay.t[i].offset) == p.lay.t[i].numel, "%s: %s missing", g->file,
          name);
  }
  p.input = calloc((size_t)(p.M * d->input_dim) + 1, sizeof(double));
  p.d_out = calloc((size_t)(p.M * d->dm) + 1, sizeof(double));
  golden_to_double(g, "input", p.input);
  golden_to_double(g, "d_out", p.d_out);
  m3_file_tensor t;
  p.tokens = golden_find(g, "tokens", &t) ? t.data : NULL;
  p.targets = golden_find(g, "targets", &t) ? t.data : NULL;
  p.resets = golden_find(g, "resets", &t) ? t.data : NULL;
  p.out = calloc((size_t)(p.M * d->dm), sizeof(double));
  p.state = calloc((size_t)(d->L * (per[0] + per[1] + per[2] + per[3])) + 1, sizeof(double));

  const int lm = g->cfg.head == M3_HEAD_LM;
  run_f64(&p);
  compare(&p, "f64", TOL_F64, TOL_F64);
  if (lm) logits_f64(&p);
  printf("\n");
  memset(p.grads, 0, (size_t)p.lay.total * sizeof(double));
  run_f32(&p);
  compare(&p, "f32", TOL_F32_OUT, TOL_F32_GRAD);
  if (lm) logits_f32(&p);
  printf("\n");

  m3_layout_free(&p.lay);
  free(p.params);
  free(p.grads);
  free(p.input);
  free(p.d_out);
  free(p.out);
  free(p.state);
}

int main(void) {
  const int files = golden_each(run_case);
  if (files < 0) return 77;
  CHECK(files >= 4, "expected the four golden cases, found %d", files);
  return harness_finish("golden");
}

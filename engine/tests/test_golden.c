/*
 * test_golden.c — the CPU model against ../shared/golden (float64 results of SPEC.md made
 * by an independent implementation). The double build must agree to 1e-9 relative; the
 * float build within SPEC.md §8 f32 tolerances (out, final states, loss 1e-5; every
 * gradient 1e-4). Skipped (exit 77) when ../shared/golden is absent.
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
  printf(", worst final state %.2e\n", worst);
  free(ref);
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

  run_f64(&p);
  compare(&p, "f64", TOL_F64, TOL_F64);
  memset(p.grads, 0, (size_t)p.lay.total * sizeof(double));
  run_f32(&p);
  compare(&p, "f32", TOL_F32_OUT, TOL_F32_GRAD);

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

/*
 * test_state.c — carry and reset semantics of SPEC.md §4 on the CPU reference (double):
 * two windows with carry equal one long window (outputs and final states); a reset at t
 * makes the rest of the row equal a fresh sequence started at t; a reset at t = 0
 * ignores the carried state; without carry a window ignores the stored state.
 */
#include "cpu/model.h"
#include "harness.h"
#include "layout.h"
#include "weights.h"

enum { B = 2, T = 40, T1 = 17 };

typedef struct fixture {
  m3_config cfg;
  m3_dims d;
  m3_layout lay;
  double *params, *grads;
  double *input; /* [B, T, dm] */
} fixture;

static void setup(fixture *f, m3_rng *r) {
  m3_config_defaults(&f->cfg);
  f->cfg.d_model = 8;
  f->cfg.n_layers = 2;
  f->cfg.d_state = 8;
  f->cfg.headdim = 4;
  f->cfg.input = M3_INPUT_IDENTITY;
  m3_dims_from_config(&f->cfg, &f->d);
  m3_layout_build(&f->cfg, &f->lay);
  m3_weights *w = NULL;
  m3_weights_create(&f->cfg, &w);
  m3_weights_init(w, 3);
  f->params = calloc((size_t)f->lay.total, sizeof(double));
  f->grads = calloc((size_t)f->lay.total, sizeof(double));
  for (int64_t i = 0; i < f->lay.total; i++) f->params[i] = w->arena[i];
  m3_weights_destroy(w);
  f->input = calloc((size_t)B * T * f->d.dm, sizeof(double));
  fill_normal(r, f->input, (long)B * T * f->d.dm, 1.0);
}

static cpu_model_f64 *model(fixture *f, int32_t len) {
  cpu_model_f64 *m = NULL;
  CHECK_OK(cpu_model_create_f64(&f->d, &f->lay, B, len, &m));
  m->params = f->params;
  m->grads = f->grads;
  return m;
}

static long state_len(const fixture *f, int kind) {
  const long lbh = (long)f->d.L * B * f->d.H;
  const long per[4] = {lbh * f->d.S, lbh * f->d.P * f->d.N, lbh * f->d.N, lbh * f->d.P};
  return per[kind];
}

static double *state_of(cpu_model_f64 *m, int kind) {
  double *s[4] = {m->state.angle, m->state.ssm, m->state.k, m->state.v};
  return s[kind];
}

static void random_state(fixture *f, cpu_model_f64 *m, m3_rng *r) {
  for (int k = 0; k < 4; k++) fill_normal(r, state_of(m, k), state_len(f, k), 0.7);
  for (long i = 0; i < state_len(f, 0); i++) m->state.angle[i] = 6.28 * m3_rng_uniform(r);
}

static void copy_state(fixture *f, cpu_model_f64 *dst, cpu_model_f64 *src) {
  for (int k = 0; k < 4; k++) memcpy(state_of(dst, k), state_of(src, k), (size_t)state_len(f, k) * sizeof(double));
}

/* Copies positions [t0, t0 + len) of every row of the fixture's input. */
static double *slice(const fixture *f, int32_t t0, int32_t len) {
  double *x = calloc((size_t)B * len * f->d.dm, sizeof(double));
  for (int b = 0; b < B; b++)
    memcpy(x + (long)b * len * f->d.dm, f->input + ((long)b * T + t0) * f->d.dm, (size_t)len * f->d.dm * sizeof(double));
  return x;
}

/* out rows of (row b, positions [t0, t0+n)) of a [B, len, dm] output vs a [B, T, dm] one */
static double compare_rows(const fixture *f, const double *a, int32_t a_len, int32_t a_t0, const double *ref,
                           int32_t ref_len, int32_t ref_t0, int32_t b, int32_t n) {
  const long dm = f->d.dm;
  return rel_l2(a + ((long)b * a_len + a_t0) * dm, ref + ((long)b * ref_len + ref_t0) * dm, n * dm);
}

static void check_split_window(fixture *f, m3_rng *r) {
  cpu_model_f64 *whole = model(f, T), *parts = model(f, T);
  random_state(f, whole, r);
  copy_state(f, parts, whole);
  cpu_batch_f64 bw = {B, T, f->input, NULL, NULL, NULL, NULL, NULL, NULL};
  CHECK_OK(cpu_model_forward_f64(whole, &bw, 1, 1));
  double *x1 = slice(f, 0, T1), *x2 = slice(f, T1, T - T1);
  cpu_batch_f64 b1 = {B, T1, x1, NULL, NULL, NULL, NULL, NULL, NULL};
  cpu_batch_f64 b2 = {B, T - T1, x2, NULL, NULL, NULL, NULL, NULL, NULL};
  CHECK_OK(cpu_model_forward_f64(parts, &b1, 1, 1));
  double *out1 = calloc((size_t)B * T1 * f->d.dm, sizeof(double));
  memcpy(out1, parts->out, (size_t)B * T1 * f->d.dm * sizeof(double));
  CHECK_OK(cpu_model_forward_f64(parts, &b2, 1, 1));
  for (int b = 0; b < B; b++) {
    double e1 = compare_rows(f, out1, T1, 0, whole->out, T, 0, b, T1);
    double e2 = compare_rows(f, parts->out, T - T1, 0, whole->out, T, T1, b, T - T1);
    CHECK(e1 <= 1e-12 && e2 <= 1e-12, "row %d: split windows differ from one window (%.3g, %.3g)", b, e1, e2);
  }
  for (int k = 0; k < 4; k++) {
    double e = rel_l2(state_of(parts, k), state_of(whole, k), state_len(f, k));
    CHECK(e <= 1e-12, "final state kind %d: split windows differ from one window by %.3g", k, e);
  }
  free(x1);
  free(x2);
  free(out1);
  cpu_model_destroy_f64(whole);
  cpu_model_destroy_f64(parts);
}

static void check_reset(fixture *f, m3_rng *r, int32_t at) {
  cpu_model_f64 *m = model(f, T), *plain = model(f, T), *fresh = model(f, T);
  random_state(f, m, r);
  copy_state(f, plain, m);
  uint8_t resets[B * T] = {0};
  resets[1 * T + at] = 1; /* row 1 restarts at `at`; row 0 carries on */
  cpu_batch_f64 b = {B, T, f->input, NULL, NULL, NULL, NULL, NULL, resets};
  cpu_batch_f64 bp = {B, T, f->input, NULL, NULL, NULL, NULL, NULL, NULL};
  CHECK_OK(cpu_model_forward_f64(m, &b, 1, 1));
  CHECK_OK(cpu_model_forward_f64(plain, &bp, 1, 1));
  double *x = slice(f, at, T - at);
  cpu_batch_f64 bf = {B, T - at, x, NULL, NULL, NULL, NULL, NULL, NULL};
  CHECK_OK(cpu_model_forward_f64(fresh, &bf, 0, 1));
  double e = compare_rows(f, m->out, T, at, fresh->out, T - at, 0, 1, T - at);
  CHECK(e <= 1e-12, "reset at %d: the rest of the row differs from a fresh start by %.3g", at, e);
  e = compare_rows(f, m->out, T, 0, plain->out, T, 0, 0, T);
  CHECK(e == 0, "reset at %d in row 1 changed row 0 (by %.3g)", at, e);
  if (at > 0) {
    e = compare_rows(f, m->out, T, 0, plain->out, T, 0, 1, at);
    CHECK(e == 0, "reset at %d changed the row before it (by %.3g)", at, e);
  }
  free(x);
  cpu_model_destroy_f64(m);
  cpu_model_destroy_f64(plain);
  cpu_model_destroy_f64(fresh);
}

static void check_no_carry(fixture *f, m3_rng *r) {
  cpu_model_f64 *m = model(f, T), *zero = model(f, T);
  random_state(f, m, r);
  cpu_batch_f64 b = {B, T, f->input, NULL, NULL, NULL, NULL, NULL, NULL};
  CHECK_OK(cpu_model_forward_f64(m, &b, 0, 1));
  CHECK_OK(cpu_model_forward_f64(zero, &b, 1, 1));
  double e = rel_l2(m->out, zero->out, (long)B * T * f->d.dm);
  CHECK(e == 0, "without carry a window must start from zero state (differs by %.3g)", e);
  cpu_model_destroy_f64(m);
  cpu_model_destroy_f64(zero);
}

int main(void) {
  m3_rng r;
  m3_rng_seed(&r, 11);
  fixture f;
  setup(&f, &r);
  check_split_window(&f, &r);
  check_reset(&f, &r, 0);
  check_reset(&f, &r, 16);
  check_reset(&f, &r, T - 1);
  check_no_carry(&f, &r);
  m3_layout_free(&f.lay);
  free(f.params);
  free(f.grads);
  free(f.input);
  return harness_finish("state");
}

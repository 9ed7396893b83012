/*
 * harness.h — tiny shared helpers for the C tests: checks that count failures, relative
 * errors (angles around the circle), seeded random fills, the small test models and their random
 * states, and where ../shared lives. Header-only; every test is one
 * program whose exit status is 0 (pass), 1 (fail) or 77 (skipped).
 */
#ifndef M3_TEST_HARNESS_H
#define M3_TEST_HARNESS_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "m3.h"
#include "rng.h"

static int harness_failures, harness_checks;

#define CHECK(cond, ...)                                     \
  do {                                                       \
    harness_checks++;                                        \
    if (!(cond)) {                                           \
      harness_failures++;                                    \
      printf("FAIL %s:%d: ", __FILE__, __LINE__);            \
      printf(__VA_ARGS__);                                   \
      printf("\n");                                          \
    }                                                        \
  } while (0)

/* Checks that a call succeeded, printing the engine's message otherwise. */
#define CHECK_OK(expr) CHECK((expr) == M3_OK, "%s -> %s", #expr, m3_last_error())

static inline int harness_finish(const char *name) {
  printf("%s: %d checks, %d failed\n", name, harness_checks, harness_failures);
  return harness_failures ? 1 : 0;
}

/* ||a - b|| / ||b|| over n doubles (0 when both are zero). */
static inline double rel_l2(const double *a, const double *b, long n) {
  double num = 0, den = 0;
  for (long i = 0; i < n; i++) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

static inline double rel_l2_f(const float *a, const double *b, long n) {
  double num = 0, den = 0;
  for (long i = 0; i < n; i++) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

#define PI2 6.283185307179586

/* ||a - b|| / ||b|| for angles, each difference taken around the circle (an angle just below
 * 2 pi and one just above 0 are close). */
static inline double rel_angle_f(const float *a, const double *b, long n) {
  double num = 0, den = 0;
  for (long i = 0; i < n; i++) {
    double d = fmod(fabs((double)a[i] - b[i]), PI2);
    d = fmin(d, PI2 - d);
    num += d * d;
    den += b[i] * b[i];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

static inline double rel_angle_ff(const float *a, const float *b, long n) {
  double num = 0, den = 0;
  for (long i = 0; i < n; i++) {
    double d = fmod(fabs((double)a[i] - b[i]), PI2);
    d = fmin(d, PI2 - d);
    num += d * d;
    den += (double)b[i] * b[i];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* ||a - b|| / ||b|| over n floats, summed in double (0 when both are zero). */
static inline double rel_l2_ff(const float *a, const float *b, long n) {
  double num = 0, den = 0;
  for (long i = 0; i < n; i++) {
    num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    den += (double)b[i] * b[i];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

static inline const char *precision_name(int p) {
  return p == M3_PRECISION_F32 ? "f32" : p == M3_PRECISION_BF16 ? "bf16" : "f16";
}

static inline void fill_normal(m3_rng *r, double *x, long n, double scale) {
  for (long i = 0; i < n; i++) x[i] = m3_rng_normal(r) * scale;
}

static inline void fill_normal_f(m3_rng *r, float *x, long n, double scale) {
  for (long i = 0; i < n; i++) x[i] = (float)(m3_rng_normal(r) * scale);
}

/* A trainer config for weights w on device (the defaults but for batch rows of seq_len positions). */
static inline m3_trainer_cfg test_trainer_cfg(const m3_weights *w, int device, int batch, int seq_len) {
  m3_trainer_cfg tc;
  m3_trainer_cfg_defaults(&tc);
  tc.weights = w;
  tc.device = device;
  tc.batch = batch;
  tc.seq_len = seq_len;
  return tc;
}

/* An inference config for weights w on device (the defaults but for batch rows). */
static inline m3_infer_cfg test_infer_cfg(const m3_weights *w, int device, int batch) {
  m3_infer_cfg ic;
  m3_infer_cfg_defaults(&ic);
  ic.weights = w;
  ic.device = device;
  ic.batch = batch;
  return ic;
}

/* A two-layer test model: d_model = P H / 2, expand 2, headdim P, d_state N, ngroups G; a
 * "features" input 12 wide, 50 tokens where there is a vocabulary, an "mse" head of 3 outputs. */
static inline m3_config test_config(int P, int N, int H, int G, double rope, int outnorm, int input, int head,
                                    int tied) {
  m3_config c;
  m3_config_defaults(&c);
  c.d_model = P * H / 2;
  c.n_layers = 2;
  c.d_state = N;
  c.expand = 2;
  c.headdim = P;
  c.ngroups = G;
  c.rope_fraction = rope;
  c.outproj_norm = outnorm;
  c.input = input;
  c.head = head;
  c.tie_embeddings = tied;
  if (input == M3_INPUT_FEATURES) c.input_dim = 12;
  if (input == M3_INPUT_TOKENS || head == M3_HEAD_LM) c.vocab_size = 50;
  if (head == M3_HEAD_MSE) c.out_dim = 3;
  return c;
}

/* Elements of one layer's state tensors for B rows: angle [B, H, S], ssm [B, H, P, N], k [B, H, N],
 * v [B, H, P]. */
static inline void state_sizes(const m3_config *c, int B, long n[4]) {
  m3_config_derived dv;
  m3_config_derive(c, &dv);
  n[0] = (long)B * dv.nheads * dv.num_rope_angles;
  n[1] = (long)B * dv.nheads * c->headdim * c->d_state;
  n[2] = (long)B * dv.nheads * c->d_state;
  n[3] = (long)B * dv.nheads * c->headdim;
}

/* One layer's random state in four new tensors of n (state_sizes) elements (free each): angles
 * uniform in [0, 2 pi), ssm normal with deviation 0.3, k and v standard normal. */
static inline void random_layer_state(m3_rng *r, const long n[4], float *s[4]) {
  for (int k = 0; k < 4; k++) s[k] = calloc((size_t)n[k] + 1, sizeof(float));
  for (long i = 0; i < n[0]; i++) s[0][i] = (float)(m3_rng_uniform(r) * PI2);
  fill_normal_f(r, s[1], n[1], 0.3);
  fill_normal_f(r, s[2], n[2], 1.0);
  fill_normal_f(r, s[3], n[3], 1.0);
}

/* The ../shared folder: $M3_SHARED, else $M3_SOURCE_ROOT/../shared. */
static inline const char *shared_dir(void) {
  static char buf[4096];
  const char *s = getenv("M3_SHARED");
  if (s && *s) return s;
  const char *root = getenv("M3_SOURCE_ROOT");
  snprintf(buf, sizeof buf, "%s/../shared", root && *root ? root : ".");
  return buf;
}

#endif

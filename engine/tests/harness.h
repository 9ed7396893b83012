/*
 * harness.h — tiny shared helpers for the C tests: checks that count failures, relative
 * errors, seeded random fills, and where ../shared lives. Header-only; every test is one
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

/*
 * rmsnorm.c — RMSNorm over rows (eps 1e-5, SPEC.md §3), forward for many rows and the
 * backward of one row.
 *
 *   r = 1 / sqrt(mean(x^2) + eps),  y = x * r * w
 *   dx = r * (w * dy) - x * r^3 * mean(x * w * dy),  dw += x * r * dy
 */
#include <omp.h>

#include "real.h"
#include "../threads.h"

#define EPS 1e-5

void NAME(rmsnorm_row)(const real *x, const real *w, real *y, real *rstd, int32_t n) {
  double ss = 0;
  for (int32_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
  real s = (real)(1.0 / sqrt(ss / n + EPS));
  *rstd = s;
  if (w)
    for (int32_t i = 0; i < n; i++) y[i] = x[i] * s * w[i];
  else
    for (int32_t i = 0; i < n; i++) y[i] = x[i] * s;
}

void NAME(rmsnorm_forward)(const real *x, const real *w, real *y, real *rstd, int64_t rows, int32_t n) {
#pragma omp parallel for schedule(static) num_threads(loop_threads(rows, rows * n * 4, omp_get_max_threads()))
  for (int64_t r = 0; r < rows; r++) NAME(rmsnorm_row)(x + r * n, w, y + r * n, rstd + r, n);
}

void NAME(rmsnorm_backward_row)(const real *x, const real *w, real rstd, const real *dy, real *dx, real *dw,
                                int32_t n, int accumulate) {
  double dot = 0;
  for (int32_t i = 0; i < n; i++) dot += (double)x[i] * (w ? w[i] : 1) * dy[i];
  real c = (real)(dot / n) * rstd * rstd * rstd;
  if (dw) /* before dx: dx may alias dy */
    for (int32_t i = 0; i < n; i++) dw[i] += x[i] * rstd * dy[i];
  for (int32_t i = 0; i < n; i++) {
    real g = rstd * (w ? w[i] : 1) * dy[i] - x[i] * c;
    dx[i] = accumulate ? dx[i] + g : g;
  }
}

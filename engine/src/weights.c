/*
 * weights.c — creating, initialising and inspecting host weights (SPEC.md §2).
 *
 * Init walks the layout in order and draws every element of every random tensor from one
 * generator seeded with the caller's seed (rng.h), so every backend starts from the same
 * bits. m3_weights_check_finite is the one check of finite values for weights entering the
 * engine. File I/O lives in weights_io.c.
 */
#include "weights.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "errors.h"
#include "rng.h"

float *m3_alloc_floats(int64_t n) {
  if (n < 0 || (uint64_t)n > SIZE_MAX / sizeof(float) - 64) return NULL;
  size_t bytes = ((size_t)n * sizeof(float) + 63) / 64 * 64;
  if (bytes == 0) bytes = 64;
  float *p = aligned_alloc(64, bytes);
  if (p) memset(p, 0, bytes);
  return p;
}

m3_status m3_weights_create(const m3_config *cfg, m3_weights **out) {
  if (!out) return m3_fail(M3_ERR_ARGUMENT, "m3_weights_create: out is NULL");
  *out = NULL;
  TRY(m3_config_validate(cfg));
  m3_weights *w = calloc(1, sizeof *w);
  if (!w) return m3_fail(M3_ERR_MEMORY, "out of memory");
  w->cfg = *cfg;
  m3_dims_from_config(cfg, &w->dims);
  m3_status st = m3_layout_build(cfg, &w->layout);
  if (st != M3_OK) {
    free(w);
    return st;
  }
  w->arena = m3_alloc_floats(w->layout.total);
  if (!w->arena) {
    const long long n_params = (long long)w->layout.n_params;
    m3_weights_destroy(w);
    return m3_fail(M3_ERR_MEMORY, "out of memory for %lld parameters", n_params);
  }
  *out = w;
  return M3_OK;
}

void m3_weights_destroy(m3_weights *w) {
  if (!w) return;
  m3_layout_free(&w->layout);
  free(w->arena);
  free(w);
}

m3_status m3_weights_clone(const m3_weights *w, m3_weights **out) {
  if (!out) return m3_fail(M3_ERR_ARGUMENT, "m3_weights_clone: out is NULL");
  *out = NULL;
  if (!w) return m3_fail(M3_ERR_ARGUMENT, "m3_weights_clone: weights are NULL");
  TRY(m3_weights_create(&w->cfg, out));
  memcpy((*out)->arena, w->arena, (size_t)w->layout.total * sizeof(float));
  return M3_OK;
}

static double dt_bias_value(m3_rng *r) {
  const double lo = log(1e-3), hi = log(1e-1);
  double dt = exp(m3_rng_uniform(r) * (hi - lo) + lo);
  if (dt < 1e-4) dt = 1e-4;
  return dt + log(-expm1(-dt));
}

m3_status m3_weights_init(m3_weights *w, uint64_t seed) {
  if (!w) return m3_fail(M3_ERR_ARGUMENT, "m3_weights_init: weights are NULL");
  m3_rng r;
  m3_rng_seed(&r, seed);
  for (int32_t i = 0; i < w->layout.n; i++) {
    const param_desc *p = &w->layout.t[i];
    float *x = w->arena + p->offset;
    for (int64_t j = 0; j < p->numel; j++) {
      double v = 0;
      switch (p->init) {
        case INIT_ONES: v = 1; break;
        case INIT_ZEROS: v = 0; break;
        case INIT_UNIFORM: v = (2 * m3_rng_uniform(&r) - 1) * p->init_scale; break;
        case INIT_NORMAL: v = m3_rng_normal(&r) * p->init_scale; break;
        case INIT_DT_BIAS: v = dt_bias_value(&r); break;
      }
      x[j] = (float)v;
    }
  }
  return M3_OK;
}

const m3_config *m3_weights_config(const m3_weights *w) { return w ? &w->cfg : NULL; }

int32_t m3_weights_count(const m3_weights *w) { return w ? w->layout.n : 0; }

m3_status m3_weights_tensor(const m3_weights *w, int32_t index, m3_tensor_info *out) {
  if (!w || !out) return m3_fail(M3_ERR_ARGUMENT, "m3_weights_tensor: NULL argument");
  if (index < 0 || index >= w->layout.n)
    return m3_fail(M3_ERR_ARGUMENT, "tensor index %d out of range [0, %d)", index, w->layout.n);
  const param_desc *p = &w->layout.t[index];
  memset(out, 0, sizeof *out);
  out->name = p->name;
  out->ndim = p->ndim;
  for (int i = 0; i < p->ndim; i++) out->shape[i] = p->shape[i];
  out->numel = p->numel;
  out->offset = p->offset;
  out->no_decay = p->no_decay;
  out->data = w->arena + p->offset;
  return M3_OK;
}

m3_status m3_weights_check_finite(const m3_weights *w, m3_status status) {
  for (int32_t i = 0; i < w->layout.n; i++) {
    const param_desc *p = &w->layout.t[i];
    TRY(m3_check_finite(status, w->arena + p->offset, p->numel, 0, "weights: %s", p->name));
  }
  return M3_OK;
}

int32_t m3_weights_find(const m3_weights *w, const char *name) {
  return w ? m3_layout_find(&w->layout, name) : -1;
}

float *m3_weights_data(m3_weights *w) { return w ? w->arena : NULL; }

int64_t m3_weights_arena_size(const m3_weights *w) { return w ? w->layout.total : 0; }

/*
 * layout.c — the parameter table of SPEC.md §2: names, shapes, init rules, no-decay
 * group and arena offsets, in the one fixed order every backend and the init use.
 */
#include "layout.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "errors.h"

typedef struct builder {
  m3_layout *l;
  int32_t cap;
  int too_big;   /* the arena passed M3_MAX_ARENA: later tensors are not added */
  double approx; /* parameters so far, in double (it cannot overflow), for the check and its message */
} builder;

static int64_t add(builder *b, const char *name, int32_t ndim, const int64_t *shape, int32_t no_decay,
                   param_init init, double scale) {
  m3_layout *l = b->l;
  param_desc *p = &l->t[l->n++];
  snprintf(p->name, sizeof p->name, "%s", name);
  p->ndim = ndim;
  p->numel = 1;
  double numel = 1;
  for (int i = 0; i < ndim; i++) {
    p->shape[i] = shape[i];
    numel *= (double)shape[i];
  }
  b->approx += numel;
  if (b->too_big || b->approx + (double)M3_ALIGN * l->n > (double)M3_MAX_ARENA) {
    b->too_big = 1;
    return -1;
  }
  /* near 2^53 at most, so the int64 products and sums below cannot overflow */
  for (int i = 0; i < ndim; i++) p->numel *= shape[i];
  p->offset = l->total;
  p->no_decay = no_decay;
  p->init = init;
  p->init_scale = scale;
  l->total += (p->numel + M3_ALIGN - 1) / M3_ALIGN * M3_ALIGN;
  l->n_params += p->numel;
  if (l->total > M3_MAX_ARENA) b->too_big = 1;
  return p->offset;
}

#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})

m3_status m3_layout_build(const m3_config *cfg, m3_layout *out) {
  memset(out, 0, sizeof *out);
  m3_dims d;
  m3_dims_from_config(cfg, &d);
  int32_t cap = 8 + 10 * d.L;
  out->t = calloc((size_t)cap, sizeof *out->t);
  out->layer = calloc((size_t)d.L, sizeof *out->layer);
  if (!out->t || !out->layer) {
    m3_layout_free(out);
    return m3_fail(M3_ERR_MEMORY, "out of memory building the parameter layout");
  }
  builder b = {out, cap, 0, 0};
  out->embedding = out->input_w = out->input_b = out->lm_head = out->readout_w = out->readout_b = -1;
  const double dm = d.dm;
  if (d.input == M3_INPUT_TOKENS)
    out->embedding = add(&b, "embedding.weight", 2, SHAPE(d.vocab, d.dm), 0, INIT_NORMAL, 0.02);
  if (d.input == M3_INPUT_FEATURES) {
    out->input_w = add(&b, "input_proj.weight", 2, SHAPE(d.dm, d.input_dim), 0, INIT_UNIFORM, 1 / sqrt(d.input_dim));
    out->input_b = add(&b, "input_proj.bias", 1, SHAPE(d.dm), 0, INIT_ZEROS, 0);
  }
  char name[M3_NAME_CAP];
  for (int32_t i = 0; i < d.L; i++) {
    layer_offsets *lo = &out->layer[i];
#define NAME(suffix) (snprintf(name, sizeof name, "layers.%d.%s", i, suffix), name)
    lo->norm = add(&b, NAME("norm.weight"), 1, SHAPE(d.dm), 1, INIT_ONES, 0);
    lo->in_proj = add(&b, NAME("mixer.in_proj.weight"), 2, SHAPE(d.dip, d.dm), 0, INIT_UNIFORM, 1 / sqrt(dm));
    lo->dt_bias = add(&b, NAME("mixer.dt_bias"), 1, SHAPE(d.H), 1, INIT_DT_BIAS, 0);
    lo->B_bias = add(&b, NAME("mixer.B_bias"), 3, SHAPE(d.H, 1, d.N), 0, INIT_ONES, 0);
    lo->C_bias = add(&b, NAME("mixer.C_bias"), 3, SHAPE(d.H, 1, d.N), 0, INIT_ONES, 0);
    lo->B_norm = add(&b, NAME("mixer.B_norm.weight"), 1, SHAPE(d.N), 1, INIT_ONES, 0);
    lo->C_norm = add(&b, NAME("mixer.C_norm.weight"), 1, SHAPE(d.N), 1, INIT_ONES, 0);
    lo->D = add(&b, NAME("mixer.D"), 1, SHAPE(d.H), 1, INIT_ONES, 0);
    lo->out_norm = d.outproj_norm ? add(&b, NAME("mixer.norm.weight"), 1, SHAPE(d.E), 1, INIT_ONES, 0) : -1;
    lo->out_proj = add(&b, NAME("mixer.out_proj.weight"), 2, SHAPE(d.dm, d.E), 0, INIT_UNIFORM,
                       1 / sqrt((double)d.E) / sqrt((double)d.L));
#undef NAME
  }
  out->norm_f = add(&b, "norm_f.weight", 1, SHAPE(d.dm), 1, INIT_ONES, 0);
  if (d.head == M3_HEAD_LM && !d.tied)
    out->lm_head = add(&b, "lm_head.weight", 2, SHAPE(d.vocab, d.dm), 0, INIT_NORMAL, 0.02);
  if (d.head == M3_HEAD_MSE) {
    out->readout_w = add(&b, "readout.weight", 2, SHAPE(d.out_dim, d.dm), 0, INIT_UNIFORM, 1 / sqrt(dm));
    out->readout_b = add(&b, "readout.bias", 1, SHAPE(d.out_dim), 0, INIT_ZEROS, 0);
  }
  if (out->n > b.cap) return m3_fail(M3_ERR_INTERNAL, "layout table overflow");
  if (b.too_big) {
    m3_layout_free(out);
    return m3_fail(M3_ERR_CONFIG,
                   "the model has about %.3g parameters (d_model = %d, n_layers = %d, in_proj_dim = %d): "
                   "a model may have at most 2^53 = %lld (its arena, padding included)",
                   b.approx, d.dm, d.L, d.dip, (long long)M3_MAX_ARENA);
  }
  return M3_OK;
}

void m3_layout_free(m3_layout *l) {
  free(l->t);
  free(l->layer);
  l->t = NULL;
  l->layer = NULL;
  l->n = 0;
}

int32_t m3_layout_find(const m3_layout *l, const char *name) {
  if (!name) return -1;
  static const char prefix[] = "backbone.";
  if (strncmp(name, prefix, sizeof prefix - 1) == 0) name += sizeof prefix - 1;
  for (int32_t i = 0; i < l->n; i++)
    if (strcmp(l->t[i].name, name) == 0) return i;
  return -1;
}

int64_t m3_layout_lm_weight(const m3_layout *l, const m3_dims *d) {
  if (d->head != M3_HEAD_LM) return -1;
  return d->tied ? l->embedding : l->lm_head;
}

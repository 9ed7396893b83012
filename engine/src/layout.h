/*
 * layout.h — derived sizes of a model and where every parameter lives.
 *
 * All parameters (and, with the same layout, gradients and Adam moments) sit in one flat
 * float arena; each tensor starts at a multiple of M3_ALIGN elements so device kernels can
 * use vector loads. The order is fixed: embedding | input_proj.{weight,bias}; per layer
 * norm, in_proj, dt_bias, B_bias, C_bias, B_norm, C_norm, D, [mixer norm], out_proj;
 * norm_f; lm_head | readout.{weight,bias}. Init draws follow this order (SPEC.md §2).
 */
#ifndef M3_LAYOUT_H
#define M3_LAYOUT_H

#include "m3.h"

enum { M3_ALIGN = 64, M3_NAME_CAP = 64 };

/* Most arena elements (padding included) a model may have: its size stays exact in a double
 * (Lua, JSON) and its bytes, in float or double, fit int64 and size_t. Host buffers sized from
 * a window (batch, seq_len) have the same bound (M3_SIZE). */
#define M3_MAX_ARENA ((int64_t)1 << 53)

/* The product of n sizes: 0 when one is 0, -1 when one is negative or the product would pass
 * M3_MAX_ARENA. No partial product can overflow int64 (each stays <= M3_MAX_ARENA). */
static inline int64_t m3_size_product(int n, const int64_t *f) {
  int zero = 0;
  for (int i = 0; i < n; i++) {
    if (f[i] < 0) return -1;
    zero |= f[i] == 0;
  }
  if (zero) return 0;
  int64_t p = 1;
  for (int i = 0; i < n; i++) {
    if (p > M3_MAX_ARENA / f[i]) return -1;
    p *= f[i];
  }
  return p;
}
#define M3_SIZE(...) \
  m3_size_product((int)(sizeof((const int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (const int64_t[]){__VA_ARGS__})

typedef enum param_init {
  INIT_ONES,
  INIT_ZEROS,
  INIT_UNIFORM, /* U(-scale, scale) */
  INIT_NORMAL,  /* N(0, scale) */
  INIT_DT_BIAS  /* inverse softplus of a log-uniform dt in [1e-3, 1e-1] */
} param_init;

typedef struct param_desc {
  char name[M3_NAME_CAP];
  int32_t ndim;
  int64_t shape[4];
  int64_t numel;
  int64_t offset;   /* elements from the arena start */
  int32_t no_decay; /* reference no-decay group */
  param_init init;
  double init_scale;
} param_desc;

/* Offsets (elements) of one layer's tensors; out_norm is -1 without outproj_norm. */
typedef struct layer_offsets {
  int64_t norm, in_proj, dt_bias, B_bias, C_bias, B_norm, C_norm, D, out_norm, out_proj;
} layer_offsets;

/* Every size a backend needs, derived once from a validated config. */
typedef struct m3_dims {
  int32_t dm, L, N, E, P, H, G, S, dip;
  int32_t heads_per_group;   /* H / G */
  int32_t input_dim;         /* width of the "features"/"identity" input */
  int32_t vocab, out_dim;
  int32_t input, head, tied, outproj_norm;
  double a_floor;
  /* column offsets inside one in_proj output row */
  int32_t z_off, x_off, B_off, C_off, dt_off, A_off, trap_off, ang_off;
} m3_dims;

typedef struct m3_layout {
  int32_t n;                 /* tensors */
  param_desc *t;             /* [n] */
  int64_t total;             /* arena elements (padding included) */
  int64_t n_params;          /* parameter elements */
  /* offsets of the non-layer tensors, -1 when absent */
  int64_t embedding, input_w, input_b, norm_f, lm_head, readout_w, readout_b;
  layer_offsets *layer;      /* [L] */
} m3_layout;

void m3_dims_from_config(const m3_config *cfg, m3_dims *d);
/* Builds the layout of a validated config (allocates; free with m3_layout_free); M3_ERR_CONFIG
 * when its arena would pass M3_MAX_ARENA. */
m3_status m3_layout_build(const m3_config *cfg, m3_layout *out);
void m3_layout_free(m3_layout *l);
/* Index by name, accepting an optional "backbone." prefix; -1 when absent. */
int32_t m3_layout_find(const m3_layout *l, const char *name);
/* Offset of the weight the "lm" head multiplies by (embedding when tied), -1 otherwise. */
int64_t m3_layout_lm_weight(const m3_layout *l, const m3_dims *d);

#endif

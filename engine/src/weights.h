/*
 * weights.h — the host weights object: a validated config, its layout and one float32
 * arena holding every parameter (SPEC.md §2 names) at its layout offset.
 */
#ifndef M3_WEIGHTS_H
#define M3_WEIGHTS_H

#include "layout.h"

struct m3_weights {
  m3_config cfg;
  m3_dims dims;
  m3_layout layout;
  float *arena; /* [layout.total], padding zero */
};

/* 64-byte aligned, zeroed host allocation of n floats (NULL on failure). */
float *m3_alloc_floats(int64_t n);

#endif

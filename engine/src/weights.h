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

/* The "format" metadata of the files m3_weights_save and m3_trainer_save write. */
#define M3_WEIGHTS_FORMAT "m3lua-weights-1"
#define M3_CHECKPOINT_FORMAT "m3lua-checkpoint-1"

/* 64-byte aligned, zeroed host allocation of n floats (NULL on failure). */
float *m3_alloc_floats(int64_t n);

/* One pass over every parameter: the first value that is NaN or infinite fails with status, naming it
 * ("weights: layers.0.mixer.D [3] = nan: expected a finite value"). Called where weights enter the engine:
 * trainer and inference creation, m3_trainer_load_weights, m3_weights_load. */
m3_status m3_weights_check_finite(const m3_weights *w, m3_status status);

#endif

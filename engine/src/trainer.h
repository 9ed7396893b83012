/*
 * trainer.h — the trainer object shared by trainer.c (the policy of every call) and
 * checkpoint.c (saving and restoring it). Compute lives behind `ops` (backend.h).
 */
#ifndef M3_TRAINER_H
#define M3_TRAINER_H

#include "backend.h"
#include "rng.h"

struct m3_trainer {
  m3_trainer_cfg cfg; /* as created (cfg.weights is NULL); lr etc. below are the live values */
  m3_config model;
  m3_dims dims;
  m3_layout layout;
  backend *be;
  const backend_ops *ops;
  int32_t device;       /* M3_DEVICE_CPU or M3_DEVICE_CUDA */
  int32_t device_index;
  double lr;
  double clip;
  int32_t no_decay;
  int64_t step;         /* optimizer steps taken */
  int32_t pending_forward, pending_rows, pending_len;
  /* what the caller did to the carried state after the pending forward, so that a refused update's rewind keeps
   * it: rows reset (cfg.batch flags) and whether set_state ran */
  uint8_t *reset_after_forward;
  int32_t state_set_after_forward;
  int32_t window_open;
  int64_t window_counted; /* positions the open window's micro-batches counted so far */
  double loss_scale;    /* f16 dynamic loss scale */
  int64_t tracker;      /* f16: consecutive clean steps */
  m3_rng rng;
  char *extra;          /* `extra` of the checkpoint it was loaded from */
  int32_t poisoned;
};

/* Creates a trainer over a backend from a validated config and weights arena. */
m3_status m3_trainer_create_from(const m3_trainer_cfg *cfg, const m3_config *model, const float *params,
                                 m3_trainer **out);

#endif

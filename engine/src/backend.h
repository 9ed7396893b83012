/*
 * backend.h — what a compute backend (cpu/, cuda/) implements for the trainer.
 *
 * The trainer (trainer.c) owns the policy: argument and batch validation, the
 * forward/backward/accumulation interlocks, the step counter, the f16 loss scaler and
 * checkpoints. A backend owns the memory and the math: parameters, gradients and Adam
 * moments in the layout of layout.h, saved activations, the recurrent state.
 *
 * Contracts every backend keeps:
 *   - forward with train = 1 saves what backward needs and commits the window's final
 *     state; train = 0 (evaluate) changes no state.
 *   - backward computes the head's loss and dL/d out scaled by `weight`, then adds (+=)
 *     every parameter gradient; zero_grads = 1 clears the gradients first (a new window).
 *   - update multiplies the gradients by grad_unscale (in place), measures the global norm
 *     in double in a fixed order, and only if it is finite applies clipping and AdamW; a
 *     non-finite norm leaves weights and moments untouched (result->finite = 0).
 *   - step, when not NULL, must give the same bits as forward + backward + update.
 *   - results are bitwise repeatable run to run.
 *
 * A backend created with infer = 1 (the inference object, infer.c) is forward only: it holds
 * the weights, the carried state and one layer's worth of activations (reused by every
 * layer), never gradients, Adam moments or saved activations. Only infer, read_logits, the
 * state calls, graph control, device_bytes and destroy are called on it.
 */
#ifndef M3_BACKEND_H
#define M3_BACKEND_H

#include "layout.h"

typedef struct backend backend;

/* Per-step values. A GPU backend keeps them in device memory so that a captured graph
 * reads the current ones at every replay. */
typedef struct step_params {
  double lr, weight_decay, beta1, beta2, eps;
  double bias_correction1, bias_correction2; /* 1 - beta^t for the step being taken */
  double clip;                               /* max global norm; 0 = off */
  double grad_unscale;                       /* 1 / f16 loss scale, else 1 */
  int32_t no_decay;                          /* the reference no-decay group is on */
} step_params;

typedef struct update_result {
  double grad_norm; /* after unscaling, before clipping */
  int32_t finite;   /* 0: nothing was applied */
} update_result;

typedef struct head_result {
  int32_t has_loss;
  double loss;
  int64_t counted;
  int64_t correct; /* "lm": argmax hits among counted positions */
} head_result;

typedef enum arena_kind { ARENA_PARAMS, ARENA_GRADS, ARENA_ADAM_M, ARENA_ADAM_V } arena_kind;

typedef struct backend_ops {
  const char *name;
  void (*destroy)(backend *be);
  m3_status (*forward)(backend *be, const m3_batch *b, int carry, int train, float *out);
  m3_status (*backward)(backend *be, const m3_batch *b, double weight, int zero_grads, head_result *res);
  m3_status (*update)(backend *be, const step_params *p, update_result *res);
  /* fused forward (train) + backward (zero_grads) + update; NULL: the trainer composes */
  m3_status (*step)(backend *be, const m3_batch *b, int carry, double weight, const step_params *p,
                    head_result *head, update_result *upd, int32_t *graph_replayed);
  /* loss without gradients or state changes */
  m3_status (*evaluate)(backend *be, const m3_batch *b, int carry, head_result *res, float *out);
  m3_status (*capture_graph)(backend *be);
  m3_status (*drop_graph)(backend *be);
  int32_t (*has_graph)(const backend *be);
  /* recurrent state of one layer, batch-first (m3.h); NULL pointers are skipped */
  m3_status (*get_state)(const backend *be, int32_t layer, float *angle, float *ssm, float *k, float *v);
  m3_status (*set_state)(backend *be, int32_t layer, const float *angle, const float *ssm, const float *k,
                         const float *v);
  m3_status (*reset_rows)(backend *be, const int32_t *rows, int32_t n_rows); /* rows NULL: all */
  /* rows [0, rows) of the carried state back to where the last training forward (with carry) started: a step
   * whose update was refused leaves the state as it found it; NULL: not available (the state stays advanced) */
  m3_status (*rewind_state)(backend *be, int32_t rows);
  /* whole arenas (layout.total floats) in and out */
  m3_status (*read_arena)(const backend *be, arena_kind kind, float *dst);
  m3_status (*write_arena)(backend *be, arena_kind kind, const float *src);
  int64_t (*device_bytes)(const backend *be);
  /* 1 when a one-token inference step runs as one fused launch; NULL: never */
  int32_t (*fused_decode)(const backend *be);
  /* wall time spent in matrix products since creation; NULL: not measured */
  double (*gemm_seconds)(const backend *be);
  /* forward only (infer = 1): rows x len from the carried state, which it then advances;
   * out [rows, len, dm] may be NULL; the "lm" head's logits of the last position stay in
   * the backend (on the device) until read_logits copies rows x vocab of them */
  m3_status (*infer)(backend *be, const m3_batch *b, float *out);
  m3_status (*read_logits)(const backend *be, int32_t rows, float *dst);
  /* phase timing of eager calls (m3_trainer_set_profiling, m3.h); NULL: not available */
  m3_status (*set_profiling)(backend *be, int32_t on);
  m3_status (*profile)(const backend *be, m3_phase_time *out, int32_t cap, int32_t *n, int64_t *calls);
} backend_ops;

/* What a backend is created from. */
typedef struct backend_args {
  const m3_config *cfg;
  const m3_dims *dims;
  const m3_layout *layout;
  const float *params; /* initial weights, layout.total floats */
  int32_t batch, seq_len;
  int32_t precision;
  int32_t device_index;
  int32_t allow_tf32;
  int32_t infer; /* 1: forward only (see above) */
  int32_t graph; /* infer: replay one-token steps from CUDA graphs (one per row count) */
} backend_args;

/* ---- shared by the trainer and the inference object (backend.c) ---- */

/* Creates the backend of `device` (m3_device_kind; AUTO: CUDA when there is a device);
 * *chosen receives M3_DEVICE_CPU or M3_DEVICE_CUDA. */
m3_status m3_backend_open(const backend_args *a, int32_t device, int32_t *chosen, backend **out,
                          const backend_ops **ops);
/* A creation config's precision (m3_precision), device (m3_device_kind) and device index (>= 0). */
m3_status m3_check_placement(int32_t precision, int32_t device, int32_t device_index);
/* A creation config's on / off field `name`: 0 or 1. */
m3_status m3_check_flag(const char *name, int32_t value);
/* The input fields of a window: rows in [1, max_rows], len in [1, max_len] (max_len <= 0:
 * any), tokens in [0, vocab) or the input present. Errors name the call, the field and the rule. */
m3_status m3_check_batch_inputs(const m3_dims *d, const m3_batch *b, int32_t max_rows, int32_t max_len,
                                const char *call);
/* A list of rows to reset: rows NULL (all) or n_rows >= 0 entries in [0, batch). `what` names
 * the call in the message. */
m3_status m3_check_rows(const int32_t *rows, int32_t n_rows, int32_t batch, const char *what);
/* A layer index in [0, L); `call` names the call in the message. */
m3_status m3_check_layer(const m3_dims *d, int32_t layer, const char *call);
/* Every value of a state given to set_state is finite (NULL tensors are skipped). */
m3_status m3_check_state_values(const m3_dims *d, int32_t batch, const float *angle, const float *ssm,
                                const float *k, const float *v);

m3_status m3_cpu_backend_create(const backend_args *a, backend **out, const backend_ops **ops);
#ifdef M3_HAVE_CUDA
m3_status m3_cuda_backend_create(const backend_args *a, backend **out, const backend_ops **ops);
/* usable CUDA devices; 0 when the driver or a device is missing (never an error) */
int32_t m3_cuda_count_devices(void);
/* device index's compute capability as 10 major + minor (90: Hopper); 0 when it cannot be read */
int32_t m3_cuda_device_capability(int32_t index);
/* page-locked host memory, zeroed (NULL on failure); free with m3_cuda_host_free (NULL: nothing) */
void *m3_cuda_host_alloc(size_t bytes);
void m3_cuda_host_free(void *p);
#endif

#endif

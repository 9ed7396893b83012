/*
 * test_api_args.c — bad arguments through the public C API (m3.h) on the CPU: every refusal is a status
 * (M3_ERR_ARGUMENT where the argument is at fault) whose message names the call, the argument and the
 * value, and the object stays usable and unchanged (weights, step count, carried state, a pending forward).
 *
 * 1. A NULL trainer or inference object: each call names itself; a clone of NULL weights leaves *out NULL.
 * 2. backward_step's scale outside float32's normal numbers (the micro-batch's gradient would become 0 or
 *    infinite), a NaN, 0 or a negative scale, and an accumulate other than 0 / 1 are refused with the
 *    forward still pending; eps that float32 rounds to infinity (no step would move a weight) is refused.
 * 3. Layers, row lists, flags, profile arguments and batches out of range name the call and the value
 *    (profile's before the CPU's M3_ERR_UNSUPPORTED); an "mse" batch without target_values names that field.
 */
#include <float.h>

#include "harness.h"

enum { B = 2, T = 4, VOCAB = 11 };

/* The last error names every one of the NULL-terminated fragments. */
static int says(const char *const *fragments) {
  for (int i = 0; fragments[i]; i++)
    if (!strstr(m3_last_error(), fragments[i])) return 0;
  return 1;
}

#define REFUSED(expr, status, ...)                                                                        \
  do {                                                                                                   \
    const char *const want_[] = {__VA_ARGS__, NULL};                                                      \
    m3_status st_ = (expr);                                                                               \
    CHECK(st_ == (status) && says(want_), "%s -> %s '%s' (expected %s naming the call and value)", #expr, \
          m3_status_name(st_), m3_last_error(), m3_status_name(status));                                  \
  } while (0)

/* harness.h's test model at d_model 8 (headdim 4, d_state 8, 4 heads, tied), tokens in, VOCAB ids. */
static m3_weights *tiny_lm(int head) {
  m3_config c = test_config(4, 8, 4, 1, 0.5, 0, M3_INPUT_TOKENS, head, 1);
  c.vocab_size = VOCAB;
  m3_weights *w = NULL;
  CHECK_OK(m3_weights_create(&c, &w));
  CHECK_OK(m3_weights_init(w, 7));
  return w;
}

/* What a refused call must leave alone: the weights, the step count and layer 0's ssm state. */
typedef struct picture {
  m3_weights *weights;
  int64_t step;
  float ssm[B * 4 * 4 * 8];
} picture;

static void take_picture(const m3_trainer *tr, picture *p) {
  CHECK_OK(m3_trainer_snapshot(tr, p->weights));
  p->step = m3_trainer_step_count(tr);
  CHECK_OK(m3_trainer_get_state(tr, 0, NULL, p->ssm, NULL, NULL));
}

static void check_unchanged(const m3_trainer *tr, const picture *before, picture *now, const char *after) {
  take_picture(tr, now);
  const size_t bytes = (size_t)m3_weights_arena_size(before->weights) * sizeof(float);
  CHECK(memcmp(m3_weights_data(before->weights), m3_weights_data(now->weights), bytes) == 0,
        "%s changed the weights", after);
  CHECK(now->step == before->step, "%s changed the step count", after);
  CHECK(memcmp(before->ssm, now->ssm, sizeof now->ssm) == 0, "%s changed the carried state", after);
}

/* ---- 1. NULL objects ---------------------------------------------------------------------------------- */

static void check_null_objects(m3_weights *w) {
  m3_batch b;
  memset(&b, 0, sizeof b);
  m3_metrics m;
  float x[4];
  int32_t n;
  int64_t calls;
  m3_phase_time pt[1];
  REFUSED(m3_trainer_step(NULL, &b, &m), M3_ERR_ARGUMENT, "step: the trainer is NULL");
  REFUSED(m3_trainer_forward(NULL, &b, NULL), M3_ERR_ARGUMENT, "forward: the trainer is NULL");
  REFUSED(m3_trainer_backward_step(NULL, &b, NULL, &m), M3_ERR_ARGUMENT, "backward_step: the trainer is NULL");
  REFUSED(m3_trainer_evaluate(NULL, &b, &m, NULL), M3_ERR_ARGUMENT, "evaluate: the trainer is NULL");
  REFUSED(m3_trainer_check_batch(NULL, &b, NULL), M3_ERR_ARGUMENT, "check_batch: the trainer is NULL");
  REFUSED(m3_trainer_capture_graph(NULL), M3_ERR_ARGUMENT, "capture_graph: the trainer is NULL");
  REFUSED(m3_trainer_drop_graph(NULL), M3_ERR_ARGUMENT, "drop_graph: the trainer is NULL");
  REFUSED(m3_trainer_set_profiling(NULL, 1), M3_ERR_ARGUMENT, "set_profiling: the trainer is NULL");
  REFUSED(m3_trainer_profile(NULL, pt, 1, &n, &calls), M3_ERR_ARGUMENT, "profile: the trainer is NULL");
  REFUSED(m3_trainer_set_lr(NULL, 1), M3_ERR_ARGUMENT, "set_lr: the trainer is NULL");
  REFUSED(m3_trainer_set_no_decay(NULL, 1), M3_ERR_ARGUMENT, "set_no_decay: the trainer is NULL");
  REFUSED(m3_trainer_set_clip(NULL, 1), M3_ERR_ARGUMENT, "set_clip: the trainer is NULL");
  REFUSED(m3_trainer_reset_state(NULL, NULL, 0), M3_ERR_ARGUMENT, "reset_state: the trainer is NULL");
  REFUSED(m3_trainer_get_state(NULL, 0, x, NULL, NULL, NULL), M3_ERR_ARGUMENT, "get_state: the trainer is NULL");
  REFUSED(m3_trainer_set_state(NULL, 0, x, NULL, NULL, NULL), M3_ERR_ARGUMENT, "set_state: the trainer is NULL");
  REFUSED(m3_trainer_snapshot(NULL, w), M3_ERR_ARGUMENT, "snapshot: the trainer is NULL");
  REFUSED(m3_trainer_grads(NULL, w), M3_ERR_ARGUMENT, "grads: the trainer is NULL");
  REFUSED(m3_trainer_load_weights(NULL, w), M3_ERR_ARGUMENT, "load_weights: the trainer is NULL");
  REFUSED(m3_trainer_scaler_state(NULL, NULL, NULL), M3_ERR_ARGUMENT, "scaler_state: the trainer is NULL");
  REFUSED(m3_trainer_load_scaler_state(NULL, 2, 0), M3_ERR_ARGUMENT, "load_scaler_state: the trainer is NULL");
  REFUSED(m3_infer_step(NULL, &b, NULL, NULL), M3_ERR_ARGUMENT, "step: the inference object is NULL");
  REFUSED(m3_infer_logits(NULL, x), M3_ERR_ARGUMENT, "logits: the inference object is NULL");
  REFUSED(m3_infer_reset(NULL, NULL, 0), M3_ERR_ARGUMENT, "reset: the inference object is NULL");
  REFUSED(m3_infer_get_state(NULL, 0, x, NULL, NULL, NULL), M3_ERR_ARGUMENT, "get_state: the inference object");
  REFUSED(m3_infer_set_state(NULL, 0, x, NULL, NULL, NULL), M3_ERR_ARGUMENT, "set_state: the inference object");
  m3_weights *copy = (m3_weights *)w; /* not NULL: a failed clone must set it to NULL */
  REFUSED(m3_weights_clone(NULL, &copy), M3_ERR_ARGUMENT, "m3_weights_clone: weights are NULL");
  CHECK(copy == NULL, "m3_weights_clone(NULL) left *out = %p", (void *)copy);
  REFUSED(m3_weights_clone(w, NULL), M3_ERR_ARGUMENT, "m3_weights_clone: out is NULL");
}

/* ---- 2. scale, accumulate, eps -------------------------------------------------------------------------- */

static void check_backward_opts(m3_trainer *tr, const m3_batch *b, picture *before, picture *now) {
  CHECK_OK(m3_trainer_forward(tr, b, NULL));
  take_picture(tr, before);
  static const double bad_scales[] = {1e-300, 1e-39, 1e39, 1e300, -1, 0, NAN, INFINITY};
  static const char *const shown[] = {"scale = 1e-300", "scale = 1e-39", "scale = 1e+39", "scale = 1e+300",
                                      "scale = -1",     "scale = 0",     "scale = nan",   "scale = inf"};
  m3_metrics m;
  for (int i = 0; i < (int)(sizeof bad_scales / sizeof bad_scales[0]); i++) {
    const m3_backward_opts o = {-1, 0, bad_scales[i]};
    REFUSED(m3_trainer_backward_step(tr, b, &o, &m), M3_ERR_ARGUMENT, "backward_step: ", shown[i], "float32");
  }
  const m3_backward_opts twice = {-1, 2, 1};
  REFUSED(m3_trainer_backward_step(tr, b, &twice, &m), M3_ERR_ARGUMENT, "backward_step: accumulate = 2");
  check_unchanged(tr, before, now, "a refused backward_step");
  m3_trainer_info info;
  m3_trainer_get_info(tr, &info);
  CHECK(info.pending_forward == 1 && info.window_open == 0, "refused backward_steps: pending %d, window %d",
        info.pending_forward, info.window_open);
  const m3_backward_opts smallest = {-1, 0, FLT_MIN};
  CHECK_OK(m3_trainer_backward_step(tr, b, &smallest, &m));
  CHECK(m.optimizer_stepped && m3_trainer_step_count(tr) == before->step + 1, "backward_step at scale FLT_MIN");
}

static void check_eps(m3_weights *w) {
  m3_trainer_cfg tc = test_trainer_cfg(w, M3_DEVICE_CPU, B, T);
  m3_trainer *tr = NULL;
  tc.eps = 1e300;
  REFUSED(m3_trainer_create(&tc, &tr), M3_ERR_CONFIG, "eps = 1e+300: must be at most");
  m3_trainer_destroy(tr); /* NULL unless it was wrongly created */
  tc.eps = FLT_MAX;
  CHECK_OK(m3_trainer_create(&tc, &tr));
  m3_trainer_destroy(tr);
}

/* ---- 3. indices, flags, fields -------------------------------------------------------------------------- */

static void check_indices(m3_trainer *tr, m3_infer *inf, const m3_batch *b, picture *before, picture *now) {
  take_picture(tr, before);
  float x[B * 4 * 4 * 8];
  const int32_t rows[2] = {1, 2};
  REFUSED(m3_trainer_reset_state(tr, rows, -1), M3_ERR_ARGUMENT, "reset_state: n_rows = -1: must be >= 0");
  REFUSED(m3_trainer_reset_state(tr, rows, 2), M3_ERR_ARGUMENT, "reset_state: row 2 out of range [0, 2)");
  REFUSED(m3_trainer_get_state(tr, 2, x, NULL, NULL, NULL), M3_ERR_ARGUMENT, "get_state: layer = 2",
          "[0, 2)");
  REFUSED(m3_trainer_set_state(tr, -1, x, NULL, NULL, NULL), M3_ERR_ARGUMENT, "set_state: layer = -1");
  REFUSED(m3_trainer_set_profiling(tr, -1), M3_ERR_ARGUMENT, "set_profiling: on = -1: must be 0 or 1");
  m3_phase_time pt[1];
  int32_t n;
  int64_t calls;
  REFUSED(m3_trainer_profile(tr, NULL, 1, &n, &calls), M3_ERR_ARGUMENT, "profile: ", "out NULL");
  REFUSED(m3_trainer_profile(tr, pt, -1, &n, &calls), M3_ERR_ARGUMENT, "profile: cap = -1: must be >= 0");
  REFUSED(m3_trainer_profile(tr, pt, 1, &n, &calls), M3_ERR_UNSUPPORTED, "profile: ", "CUDA");
  REFUSED(m3_trainer_snapshot(tr, NULL), M3_ERR_ARGUMENT, "snapshot: the weights to copy into are NULL");
  REFUSED(m3_trainer_load_weights(tr, NULL), M3_ERR_ARGUMENT, "load_weights: the weights are NULL");
  REFUSED(m3_trainer_step(tr, NULL, NULL), M3_ERR_ARGUMENT, "step: batch is NULL");
  m3_batch wide = *b;
  wide.rows = B + 1;
  REFUSED(m3_trainer_forward(tr, &wide, NULL), M3_ERR_ARGUMENT, "forward: batch has 3 rows");
  REFUSED(m3_trainer_evaluate(tr, &wide, NULL, NULL), M3_ERR_ARGUMENT, "evaluate: batch has 3 rows");
  check_unchanged(tr, before, now, "refused calls");
  REFUSED(m3_infer_reset(inf, rows, -3), M3_ERR_ARGUMENT, "reset: n_rows = -3");
  REFUSED(m3_infer_get_state(inf, 9, x, NULL, NULL, NULL), M3_ERR_ARGUMENT, "get_state: layer = 9");
  REFUSED(m3_infer_set_state(inf, 2, x, NULL, NULL, NULL), M3_ERR_ARGUMENT, "set_state: layer = 2");
  REFUSED(m3_infer_step(inf, NULL, NULL, NULL), M3_ERR_ARGUMENT, "step: batch is NULL");
}

static void check_mse_fields(const m3_batch *b) {
  m3_weights *w = tiny_lm(M3_HEAD_MSE);
  m3_trainer_cfg tc = test_trainer_cfg(w, M3_DEVICE_CPU, B, T);
  m3_trainer *tr = NULL;
  CHECK_OK(m3_trainer_create(&tc, &tr));
  REFUSED(m3_trainer_check_batch(tr, b, NULL), M3_ERR_ARGUMENT,
          "check_batch: batch.target_values is missing: the model's head is \"mse\"");
  m3_trainer_destroy(tr);
  m3_weights_destroy(w);
}

int main(void) {
  m3_weights *w = tiny_lm(M3_HEAD_LM);
  int32_t tokens[B * T], targets[B * T];
  for (int i = 0; i < B * T; i++) {
    tokens[i] = (3 * i + 1) % VOCAB;
    targets[i] = (5 * i + 2) % VOCAB;
  }
  m3_batch b;
  memset(&b, 0, sizeof b);
  b.rows = B;
  b.len = T;
  b.tokens = tokens;
  b.targets = targets;
  m3_trainer_cfg tc = test_trainer_cfg(w, M3_DEVICE_CPU, B, T);
  tc.carry_state = 1;
  m3_trainer *tr = NULL;
  CHECK_OK(m3_trainer_create(&tc, &tr));
  CHECK_OK(m3_trainer_step(tr, &b, NULL)); /* a state that is not zero */
  m3_infer_cfg ic = test_infer_cfg(w, M3_DEVICE_CPU, B);
  m3_infer *inf = NULL;
  CHECK_OK(m3_infer_create(&ic, &inf));
  picture before, now;
  CHECK_OK(m3_weights_clone(w, &before.weights));
  CHECK_OK(m3_weights_clone(w, &now.weights));

  check_null_objects(w);
  check_backward_opts(tr, &b, &before, &now);
  check_eps(w);
  check_indices(tr, inf, &b, &before, &now);
  check_mse_fields(&b);

  m3_weights_destroy(before.weights);
  m3_weights_destroy(now.weights);
  m3_infer_destroy(inf);
  m3_trainer_destroy(tr);
  m3_weights_destroy(w);
  return harness_finish("api_args");
}

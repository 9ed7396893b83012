/*
 * test_api_args.c — bad arguments through the public C API (m3.h) on the CPU: every refusal is a status
 * (M3_ERR_ARGUMENT where the argument is at fault) whose message names the call, the argument and the
 * value, and the object stays usable and unchanged (weights, step count, carried state, a pending forward).
 *
 * 1. A NULL trainer or inference object: each call names itself; a clone of NULL weights leaves *out NULL.
 * 2. backward_step's scale outside float32's normal numbers (the micro-batch's gradient would become 0 or
 *    infinite), a NaN, 0 or a negative scale, and an accumulate other than 0 / 1 are refused with the
 *    forward still pending; eps that float32 rounds to infinity (no step would move a weight) is refused. So are
 *    an infinite clip, a batch of another shape than the pending forward's, and step, capture_graph and
 *    load_weights while a forward is pending (M3_ERR_ORDER); opts NULL takes the trainer's clip. Creation
 *    fields out of range are refused by their own rule; the accepted ones (device_index on the CPU, no_decay,
 *    seed) show in info and the RNG.
 * 3. Layers, row lists, flags, profile arguments and batches out of range name the call and the value
 *    (profile's before the CPU's M3_ERR_UNSUPPORTED); an "mse" batch without target_values names that field;
 *    a target equal to the vocabulary size, a non-finite set_state value, weights of another config for
 *    snapshot / grads and scaler_state without f16 are refused.
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
  const m3_backward_opts infinite = {INFINITY, 0, 1};
  REFUSED(m3_trainer_backward_step(tr, b, &infinite, &m), M3_ERR_ARGUMENT, "backward_step: clip = inf must be finite");
  m3_batch other = *b; /* backward_step's batch must be the pending forward's rows x len */
  other.rows = 1;
  REFUSED(m3_trainer_backward_step(tr, &other, NULL, &m), M3_ERR_ARGUMENT,
          "backward_step: batch is 1 x 4 but the pending forward was 2 x 4");
  other = *b;
  other.len = 3;
  REFUSED(m3_trainer_backward_step(tr, &other, NULL, &m), M3_ERR_ARGUMENT,
          "backward_step: batch is 2 x 3 but the pending forward was 2 x 4");
  /* the interlocks of a pending forward come before anything the backend would say */
  REFUSED(m3_trainer_step(tr, b, &m), M3_ERR_ORDER, "step: a forward is pending");
  REFUSED(m3_trainer_capture_graph(tr), M3_ERR_ORDER, "capture_graph: finish the pending forward");
  REFUSED(m3_trainer_load_weights(tr, before->weights), M3_ERR_ORDER, "load_weights: finish the pending forward");
  check_unchanged(tr, before, now, "a refused backward_step");
  m3_trainer_info info;
  m3_trainer_get_info(tr, &info);
  CHECK(info.pending_forward == 1 && info.window_open == 0, "refused backward_steps: pending %d, window %d",
        info.pending_forward, info.window_open);
  const m3_backward_opts smallest = {-1, 0, FLT_MIN};
  CHECK_OK(m3_trainer_backward_step(tr, b, &smallest, &m));
  CHECK(m.optimizer_stepped && m3_trainer_step_count(tr) == before->step + 1, "backward_step at scale FLT_MIN");
  /* opts NULL: clip -1, the trainer's own (here on, so the norm is reported) */
  CHECK_OK(m3_trainer_set_clip(tr, 1e9));
  CHECK_OK(m3_trainer_forward(tr, b, NULL));
  CHECK_OK(m3_trainer_backward_step(tr, b, NULL, &m));
  CHECK(m.has_grad_norm == 1 && m.grad_norm > 0, "backward_step(opts NULL) clipped with the trainer's clip: "
        "has_grad_norm %d, grad_norm %g", m.has_grad_norm, m.grad_norm);
  CHECK_OK(m3_trainer_set_clip(tr, 0));
  /* clip 0 (off) may open a window: only a clip > 0 waits for the closing backward_step */
  const m3_backward_opts open_unclipped = {0, 1, 1};
  CHECK_OK(m3_trainer_forward(tr, b, NULL));
  CHECK(m3_trainer_backward_step(tr, b, &open_unclipped, &m) == M3_OK, "accumulate with clip 0: %s", m3_last_error());
  CHECK_OK(m3_trainer_forward(tr, b, NULL));
  CHECK_OK(m3_trainer_backward_step(tr, b, NULL, &m));
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

/* Every creation field is judged by its own rule (another check further on would refuse some of these values
 * too, under another message); values at the edge of a range are taken, and the taken ones show. */
static void check_create_fields(m3_weights *w) {
  m3_trainer_cfg tc;
  m3_trainer *tr = NULL;
#define BAD_CFG(assign, ...)                                                   \
  do {                                                                         \
    tc = test_trainer_cfg(w, M3_DEVICE_CPU, B, T);                             \
    assign;                                                                    \
    tr = NULL;                                                                 \
    REFUSED(m3_trainer_create(&tc, &tr), M3_ERR_CONFIG, __VA_ARGS__);          \
    m3_trainer_destroy(tr);                                                    \
  } while (0)
  BAD_CFG(tc.batch = 0, "batch = 0: must be an integer >= 1");
  BAD_CFG(tc.seq_len = 0, "seq_len = 0: must be an integer >= 1");
  BAD_CFG(tc.lr = 0, "lr = 0: must be a finite number > 0");
  BAD_CFG(tc.beta1 = 1, "betas[1] = 1: must be in [0, 1)");
  BAD_CFG(tc.eps = 0, "eps = 0: must be a finite number > 0");
#undef BAD_CFG
  tc = test_trainer_cfg(NULL, M3_DEVICE_CPU, B, T);
  tr = NULL;
  REFUSED(m3_trainer_create(&tc, &tr), M3_ERR_ARGUMENT, "m3_trainer_create: cfg->weights is NULL");
  m3_trainer_destroy(tr);
  tc = test_trainer_cfg(w, M3_DEVICE_CPU, B, T);
  tc.beta1 = 0;
  tc.beta2 = 0;
  tr = NULL;
  CHECK(m3_trainer_create(&tc, &tr) == M3_OK, "betas {0, 0} taken: %s", m3_last_error());
  m3_trainer_destroy(tr);
  /* a CPU trainer reports device index 0 whatever was asked; no_decay 0 and the seed are the trainer's */
  tc = test_trainer_cfg(w, M3_DEVICE_CPU, B, T);
  tc.device_index = 3;
  tc.no_decay = 0;
  tc.seed = 12345;
  tr = NULL;
  CHECK_OK(m3_trainer_create(&tc, &tr));
  m3_trainer_info info;
  m3_trainer_get_info(tr, &info);
  CHECK(info.device == M3_DEVICE_CPU && info.device_index == 0 && info.no_decay == 0,
        "info: device %d, index %d (expected 0 on the CPU), no_decay %d (expected 0)", info.device,
        info.device_index, info.no_decay);
  m3_rng r;
  m3_rng_seed(&r, 12345);
  const uint64_t want = m3_rng_next(&r), got = m3_trainer_rng_next(tr);
  CHECK(got == want, "the trainer's RNG is seeded with cfg.seed: first draw %llu, expected %llu",
        (unsigned long long)got, (unsigned long long)want);
  m3_trainer_destroy(tr);
  /* the generator itself (rng.h): splitmix64's reference words for seed 0, then xoshiro256**'s first draw, so
   * that a seed gives the same weights and draws in every version */
  static const uint64_t splitmix0[4] = {0xe220a8397b1dcdafull, 0x6e789e6aa1b965f4ull, 0x06c45d188009454full,
                                        0xf88bb8a8724c81ecull};
  m3_rng_seed(&r, 0);
  CHECK(memcmp(r.s, splitmix0, sizeof splitmix0) == 0 && m3_rng_next(&r) == 0x99ec5f36cb75f2b4ull,
        "m3_rng_seed(0) is splitmix64's reference sequence and the next draw xoshiro256**'s");
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
  m3_batch wrong = *b; /* a target equal to the vocabulary size is one past the last id */
  int32_t targets[B * T];
  memcpy(targets, b->targets, sizeof targets);
  targets[5] = VOCAB;
  wrong.targets = targets;
  REFUSED(m3_trainer_check_batch(tr, &wrong, NULL), M3_ERR_ARGUMENT,
          "check_batch: batch.targets[5] (row 1, position 1) = 11: must be in [0, 11)");
  float ssm[B * 4 * 4 * 8] = {0};
  ssm[3] = NAN;
  REFUSED(m3_trainer_set_state(tr, 0, NULL, ssm, NULL, NULL), M3_ERR_ARGUMENT, "set_states: ssm [3] = nan");
  m3_weights *mse = tiny_lm(M3_HEAD_MSE); /* another head: another config */
  REFUSED(m3_trainer_snapshot(tr, mse), M3_ERR_ARGUMENT, "snapshot: the weights' config differs");
  REFUSED(m3_trainer_grads(tr, mse), M3_ERR_ARGUMENT, "grads: the weights' config differs");
  m3_weights_destroy(mse);
  double scale;
  int64_t tracker;
  REFUSED(m3_trainer_scaler_state(tr, &scale, &tracker), M3_ERR_UNSUPPORTED, "scaler_state: only f16");
  check_unchanged(tr, before, now, "refused calls");
  m3_trainer_info info;
  m3_trainer_get_info(tr, &info);
  CHECK(info.step == before->step && info.step > 0, "info.step %lld, step count %lld", (long long)info.step,
        (long long)before->step);
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
  check_create_fields(w);
  check_indices(tr, inf, &b, &before, &now);
  check_mse_fields(&b);

  m3_weights_destroy(before.weights);
  m3_weights_destroy(now.weights);
  m3_infer_destroy(inf);
  m3_trainer_destroy(tr);
  m3_weights_destroy(w);
  return harness_finish("api_args");
}

/*
 * test_trainer_policy.c — trainer.c's policy where a CPU trainer does not reach it through the public API alone
 * (white-box: the trainer's fields of trainer.h, on the CPU, so that machines without a GPU check it too).
 *
 * 1. The f16 dynamic loss scaler (SPEC.md §7): an f32 CPU trainer marked f16 after creation runs trainer.c's f16
 *    branches over the CPU math. A power-of-two scale is exact in float32, so the scaled gradient, unscaled,
 *    updates as an f32 trainer does, bit for bit. A non-finite gradient (a NaN in d_out) is an overflow: the
 *    step succeeds with overflow_skipped, halves the scale (floor 1), zeroes the tracker, leaves weights and step
 *    count alone and the carried state where the forward left it; the 2000th clean step in a row doubles the
 *    scale (cap 2^24); load_scaler_state takes [1, 2^24] x [0, 2000); accumulate is refused.
 * 2. An f32 step refused as non-finite still reports the step count and the norm in its metrics.
 * 3. Backend calls that fail (a wrapped ops table): a failed forward leaves no forward pending; a sticky error
 *    (M3_ERR_POISONED) poisons the trainer: info and has_graph say so and every later call is refused; a backend
 *    that does not time its products reports gemm_seconds -1.
 */
#include <float.h>

#include "errors.h"
#include "harness.h"
#include "trainer.h"

enum { B = 2, T = 4, DM = 8, IN = 12 };

static m3_weights *features_none(void) {
  m3_config c = test_config(4, 8, 4, 1, 0.5, 0, M3_INPUT_FEATURES, M3_HEAD_NONE, 0);
  m3_weights *w = NULL;
  CHECK_OK(m3_weights_create(&c, &w));
  CHECK_OK(m3_weights_init(w, 5));
  return w;
}

static m3_trainer *make(const m3_weights *w, int carry, double clip) {
  m3_trainer_cfg tc = test_trainer_cfg(w, M3_DEVICE_CPU, B, T);
  tc.carry_state = carry;
  tc.clip = clip;
  m3_trainer *tr = NULL;
  CHECK_OK(m3_trainer_create(&tc, &tr));
  return tr;
}

/* An f32 CPU trainer that trainer.c treats as f16 from here on, with the scaler where creation would put it. */
static m3_trainer *make_f16(const m3_weights *w, int carry, double clip) {
  m3_trainer *tr = make(w, carry, clip);
  tr->cfg.precision = M3_PRECISION_F16;
  tr->loss_scale = 65536;
  tr->tracker = 0;
  return tr;
}

static void scaler_is(const m3_trainer *tr, double scale, int64_t tracker, const char *after) {
  double s = 0;
  int64_t k = -1;
  CHECK_OK(m3_trainer_scaler_state(tr, &s, &k));
  CHECK(s == scale && k == tracker, "%s: scaler %g, tracker %lld (expected %g, %lld)", after, s, (long long)k, scale,
        (long long)tracker);
}

static int same_floats(const float *a, const float *b, int64_t n) { return memcmp(a, b, (size_t)n * sizeof *a) == 0; }

static int same_weights(const m3_trainer *a, const m3_trainer *b, m3_weights *wa, m3_weights *wb) {
  CHECK_OK(m3_trainer_snapshot(a, wa));
  CHECK_OK(m3_trainer_snapshot(b, wb));
  return same_floats(m3_weights_data(wa), m3_weights_data(wb), m3_weights_arena_size(wa));
}

/* ---- 1. the f16 loss scaler ------------------------------------------------------------------------------ */

static void check_scaler(const m3_weights *w, const m3_batch *good, const m3_batch *bad) {
  m3_weights *wa = NULL, *wb = NULL;
  CHECK_OK(m3_weights_clone(w, &wa));
  CHECK_OK(m3_weights_clone(w, &wb));
  m3_trainer *f16 = make_f16(w, 1, 1e9), *f32 = make(w, 1, 1e9);
  m3_metrics m, r;

  /* clean steps: the gradient scaled by 2^16 and unscaled updates as f32 does; the tracker counts them */
  for (int i = 0; i < 2; i++) {
    CHECK_OK(m3_trainer_step(f16, good, &m));
    CHECK_OK(m3_trainer_step(f32, good, &r));
    CHECK(m.loss_scale == 65536 && !m.overflow_skipped && m.optimizer_stepped && m.step == i + 1,
          "clean f16 step %d: loss_scale %g, overflow_skipped %d, stepped %d, step %lld", i + 1, m.loss_scale,
          m.overflow_skipped, m.optimizer_stepped, (long long)m.step);
    CHECK(m.grad_norm == r.grad_norm, "f16 step %d: unscaled grad norm %.17g, f32 %.17g", i + 1, m.grad_norm,
          r.grad_norm);
  }
  CHECK(same_weights(f16, f32, wa, wb), "two clean f16 steps at scale 2^16 update as f32 does, bit for bit");
  scaler_is(f16, 65536, 2, "two clean steps");

  /* an overflow: no error, the update skipped, the scale halved and the tracker zeroed; the carried state stays
   * where the forward left it (only the update is skipped), as the f32 trainer's clean step left it */
  CHECK_OK(m3_trainer_step(f16, bad, &m));
  CHECK_OK(m3_trainer_step(f32, good, &r)); /* moves f32's state as f16's forward did (d_out moves no state) */
  CHECK(m.overflow_skipped && !m.optimizer_stepped && m.loss_scale == 65536 && m.step == 2,
        "overflow: overflow_skipped %d, stepped %d, loss_scale %g (the step's own), step %lld", m.overflow_skipped,
        m.optimizer_stepped, m.loss_scale, (long long)m.step);
  CHECK(m3_trainer_step_count(f16) == 2, "an overflow counts no step: %lld", (long long)m3_trainer_step_count(f16));
  scaler_is(f16, 32768, 0, "an overflow");
  const long ssm_n = (long)B * 4 * 4 * 8;
  float s16[B * 4 * 4 * 8], s32[B * 4 * 4 * 8];
  for (int layer = 0; layer < 2; layer++) {
    CHECK_OK(m3_trainer_get_state(f16, layer, NULL, s16, NULL, NULL));
    CHECK_OK(m3_trainer_get_state(f32, layer, NULL, s32, NULL, NULL));
    CHECK(same_floats(s16, s32, ssm_n), "layer %d: an f16 overflow leaves the state where the forward left it",
          layer);
  }
  m3_trainer_destroy(f32);
  f32 = make(w, 1, 1e9); /* f16's weights: two clean steps */
  CHECK_OK(m3_trainer_step(f32, good, &r));
  CHECK_OK(m3_trainer_step(f32, good, &r));
  CHECK(same_weights(f16, f32, wa, wb), "an overflow leaves the weights alone");

  /* the floor: 1.5 halves to 1, and 1 stays 1 */
  CHECK_OK(m3_trainer_load_scaler_state(f16, 1.5, 7));
  CHECK_OK(m3_trainer_step(f16, bad, &m));
  scaler_is(f16, 1, 0, "an overflow at scale 1.5");
  CHECK_OK(m3_trainer_step(f16, bad, &m));
  scaler_is(f16, 1, 0, "an overflow at scale 1");

  /* growth: the 2000th clean step in a row runs at the old scale, then doubles it; the cap 2^24 */
  CHECK_OK(m3_trainer_load_scaler_state(f16, 1024, 1998));
  CHECK_OK(m3_trainer_step(f16, good, &m));
  scaler_is(f16, 1024, 1999, "the 1999th clean step");
  CHECK_OK(m3_trainer_step(f16, good, &m));
  CHECK(m.loss_scale == 1024, "the 2000th clean step runs at %g (expected 1024)", m.loss_scale);
  scaler_is(f16, 2048, 0, "the 2000th clean step");
  CHECK_OK(m3_trainer_load_scaler_state(f16, 16777216, 1999));
  CHECK_OK(m3_trainer_step(f16, good, &m));
  scaler_is(f16, 16777216, 0, "growth at the cap");

  /* load_scaler_state's ranges, edges included */
  CHECK_OK(m3_trainer_load_scaler_state(f16, 1, 0));
  scaler_is(f16, 1, 0, "load_scaler_state(1, 0)");
  static const struct {
    double scale;
    int64_t tracker;
    const char *says;
  } bad_loads[] = {{0.5, 0, "scale = 0.5 must be in [1, 2^24]"},
                   {33554432, 0, "scale = 3.35544e+07 must be in [1, 2^24]"},
                   {NAN, 0, "scale = nan"},
                   {4, 2000, "tracker = 2000 must be in [0, 2000)"},
                   {4, -1, "tracker = -1 must be in [0, 2000)"}};
  for (size_t i = 0; i < sizeof bad_loads / sizeof *bad_loads; i++) {
    m3_status st = m3_trainer_load_scaler_state(f16, bad_loads[i].scale, bad_loads[i].tracker);
    CHECK(st == M3_ERR_ARGUMENT && strstr(m3_last_error(), bad_loads[i].says), "load_scaler_state(%g, %lld): %s '%s'",
          bad_loads[i].scale, (long long)bad_loads[i].tracker, m3_status_name(st), m3_last_error());
  }
  scaler_is(f16, 1, 0, "refused loads");

  /* accumulation windows: an overflow would skip the whole window */
  CHECK_OK(m3_trainer_forward(f16, good, NULL));
  const m3_backward_opts acc = {-1, 1, 1};
  m3_status st = m3_trainer_backward_step(f16, good, &acc, &m);
  CHECK(st == M3_ERR_UNSUPPORTED && strstr(m3_last_error(), "accumulate is not supported with f16"),
        "accumulate on f16: %s '%s'", m3_status_name(st), m3_last_error());
  CHECK_OK(m3_trainer_backward_step(f16, good, NULL, &m));

  m3_trainer_destroy(f16);
  m3_trainer_destroy(f32);
  m3_weights_destroy(wa);
  m3_weights_destroy(wb);
}

/* ---- 2. metrics of a refused f32 step ----------------------------------------------------------------------- */

static void check_refused_metrics(const m3_weights *w, const m3_batch *good, const m3_batch *bad) {
  m3_trainer *tr = make(w, 0, 1e9);
  m3_metrics m;
  CHECK_OK(m3_trainer_step(tr, good, &m));
  memset(&m, 0x55, sizeof m);
  m3_status st = m3_trainer_step(tr, bad, &m);
  CHECK(st == M3_ERR_NONFINITE && m.step == 1 && !m.optimizer_stepped && m.has_grad_norm && isnan(m.grad_norm),
        "a refused step's metrics: %s, step %lld (expected 1), stepped %d, has_grad_norm %d, grad_norm %g",
        m3_status_name(st), (long long)m.step, m.optimizer_stepped, m.has_grad_norm, m.grad_norm);
  m3_trainer_destroy(tr);
}

/* ---- 3. backend calls that fail ----------------------------------------------------------------------------- */

static m3_status failing_status; /* what the wrapped forward answers */

static m3_status failing_forward(backend *be, const m3_batch *b, int carry, int train, float *out) {
  (void)be, (void)b, (void)carry, (void)train, (void)out;
  return m3_fail(failing_status, "the test's backend failed");
}

static int32_t graph_held(const backend *be) {
  (void)be;
  return 1;
}

static void check_failing_backend(const m3_weights *w, const m3_batch *good) {
  m3_trainer *tr = make(w, 1, 0);
  backend_ops ops = *tr->ops;
  ops.gemm_seconds = NULL;
  ops.has_graph = graph_held;
  tr->ops = &ops;
  m3_trainer_info info;
  m3_trainer_get_info(tr, &info);
  CHECK(info.gemm_seconds == -1 && info.has_graph == 1 && m3_trainer_has_graph(tr) == 1,
        "a backend without gemm timing: gemm_seconds %g (expected -1), has_graph %d", info.gemm_seconds,
        info.has_graph);

  /* a forward that fails replaces the pending one with none */
  CHECK_OK(m3_trainer_forward(tr, good, NULL));
  ops.forward = failing_forward;
  failing_status = M3_ERR_CUDA;
  CHECK(m3_trainer_forward(tr, good, NULL) == M3_ERR_CUDA, "the wrapped forward fails");
  m3_trainer_get_info(tr, &info);
  m3_metrics m;
  m3_status st = m3_trainer_backward_step(tr, good, NULL, &m);
  CHECK(!info.pending_forward && st == M3_ERR_ORDER && !info.poisoned,
        "after a failed forward: pending %d (expected 0), backward_step %s, poisoned %d", info.pending_forward,
        m3_status_name(st), info.poisoned);

  /* a sticky error poisons it: every call is refused, info and has_graph say so */
  failing_status = M3_ERR_POISONED;
  CHECK(m3_trainer_forward(tr, good, NULL) == M3_ERR_POISONED, "the wrapped forward fails for good");
  m3_trainer_get_info(tr, &info);
  CHECK(info.poisoned == 1 && m3_trainer_has_graph(tr) == 0, "poisoned: info.poisoned %d, has_graph %d",
        info.poisoned, m3_trainer_has_graph(tr));
  st = m3_trainer_step(tr, good, &m);
  CHECK(st == M3_ERR_POISONED && strstr(m3_last_error(), "step: this trainer hit a sticky CUDA error"),
        "a poisoned trainer refuses step: %s '%s'", m3_status_name(st), m3_last_error());
  st = m3_trainer_set_lr(tr, 1e-3);
  CHECK(st == M3_ERR_POISONED, "a poisoned trainer refuses set_lr: %s", m3_status_name(st));
  m3_trainer_destroy(tr);
}

int main(void) {
  m3_weights *w = features_none();
  float input[B * T * IN], d_out[B * T * DM], nan_out[B * T * DM];
  m3_rng r;
  m3_rng_seed(&r, 17);
  fill_normal_f(&r, input, B * T * IN, 1.0);
  fill_normal_f(&r, d_out, B * T * DM, 0.1);
  memcpy(nan_out, d_out, sizeof d_out);
  nan_out[3] = NAN; /* the forward's state stays finite, the gradient does not */
  m3_batch good, bad;
  memset(&good, 0, sizeof good);
  good.rows = B;
  good.len = T;
  good.input = input;
  good.d_out = d_out;
  bad = good;
  bad.d_out = nan_out;

  check_scaler(w, &good, &bad);
  check_refused_metrics(w, &good, &bad);
  check_failing_backend(w, &good);

  m3_weights_destroy(w);
  return harness_finish("trainer_policy");
}

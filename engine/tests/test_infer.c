/*
 * test_infer.c — the inference object on the CPU.
 *
 * 1. The forward-only model (one activation slot, state advanced in place, rowdot.c products)
 *    computes what the training model computes: windows of several lengths with carried state
 *    and resets, in double, outputs and final states within 1e-13.
 * 2. The C API contract (m3.h "inference", float32): a prompt stepped token by token equals it
 *    run whole, bit for bit (outputs, logits, states); m3_infer_logits reads the last step's
 *    logits; bad input (token out of range, no rows, empty) fails with M3_ERR_ARGUMENT and
 *    leaves the state as it was; logits before any step is M3_ERR_ORDER; config errors.
 * 3. A step asking a model without an "lm" head for logits is refused and leaves the state as it was; so is
 *    a step of a "features" or "identity" model whose input holds a NaN or an infinity (named by row,
 *    position and feature), in one window and in pieces of max_len: the next steps equal those of an
 *    object that never saw it.
 * 4. Weights holding a NaN or an infinity are refused where they enter the engine (trainer and inference
 *    creation, m3_trainer_load_weights, which leaves the trainer's weights as they were), naming the
 *    tensor, the element and the value; finite weights still go in.
 */
#include "cpu/model.h"
#include "harness.h"
#include "layout.h"
#include "weights.h"

enum { B = 3, T = 24 };

/* ---- 1. forward-only model = training model (double) ---------------------------------------- */

static void check_forward_only(m3_rng *r) {
  m3_config cfg;
  m3_config_defaults(&cfg);
  cfg.d_model = 8;
  cfg.n_layers = 3;
  cfg.d_state = 8;
  cfg.headdim = 4;
  cfg.outproj_norm = 1;
  cfg.input = M3_INPUT_IDENTITY;
  m3_dims d;
  m3_layout lay;
  m3_dims_from_config(&cfg, &d);
  CHECK_OK(m3_layout_build(&cfg, &lay));
  m3_weights *w = NULL;
  CHECK_OK(m3_weights_create(&cfg, &w));
  CHECK_OK(m3_weights_init(w, 5));
  double *params = calloc((size_t)lay.total, sizeof(double)), *grads = calloc((size_t)lay.total, sizeof(double));
  for (int64_t i = 0; i < lay.total; i++) params[i] = w->arena[i];
  m3_weights_destroy(w);
  cpu_model_f64 *tr = NULL, *fw = NULL;
  CHECK_OK(cpu_model_create_f64(&d, &lay, B, T, &tr));
  CHECK_OK(cpu_model_create_forward_f64(&d, &lay, B, T, &fw));
  tr->params = fw->params = params;
  cpu_model_transpose_weights_f64(fw);
  tr->grads = grads;
  double *in = calloc((size_t)B * T * d.dm, sizeof(double));
  uint8_t resets[B * T];
  const int32_t lens[] = {5, 1, 1, 9, T};
  for (int w_ = 0; w_ < 5; w_++) {
    const int32_t len = lens[w_];
    fill_normal(r, in, (long)B * len * d.dm, 1.0);
    memset(resets, 0, sizeof resets);
    if (w_ == 3) resets[1 * len + 4] = 1; /* row 1, position 4 */
    cpu_batch_f64 b = {B, len, in, NULL, NULL, NULL, NULL, NULL, resets};
    CHECK_OK(cpu_model_forward_f64(tr, &b, 1, 1));
    CHECK_OK(cpu_model_forward_f64(fw, &b, 1, 1));
    const double e = rel_l2(fw->out, tr->out, (long)B * len * d.dm);
    CHECK(e <= 1e-13, "window %d (len %d): forward-only out differs from the training model by %.3g", w_, len, e);
  }
  const long lbh = (long)d.L * B * d.H;
  const double es = rel_l2(fw->state.ssm, tr->state.ssm, lbh * d.P * d.N);
  const double ea = rel_l2(fw->state.angle, tr->state.angle, lbh * d.S);
  const double ek = rel_l2(fw->state.k, tr->state.k, lbh * d.N);
  const double ev = rel_l2(fw->state.v, tr->state.v, lbh * d.P);
  CHECK(es <= 1e-13 && ea <= 1e-13 && ek <= 1e-13 && ev <= 1e-13,
        "final states differ: ssm %.3g angle %.3g k %.3g v %.3g", es, ea, ek, ev);
  cpu_model_destroy_f64(tr);
  cpu_model_destroy_f64(fw);
  m3_layout_free(&lay);
  free(params);
  free(grads);
  free(in);
}

/* ---- 2. the C API --------------------------------------------------------------------------- */

static int same_f(const float *a, const float *b, long n) { return memcmp(a, b, (size_t)n * sizeof(float)) == 0; }

/* Every layer's ssm state, concatenated. */
static void ssm_of(m3_infer *inf, const m3_dims *d, float *dst) {
  const long per = (long)B * d->H * d->P * d->N;
  for (int32_t l = 0; l < d->L; l++) CHECK_OK(m3_infer_get_state(inf, l, NULL, dst + l * per, NULL, NULL));
}

/* The API checks' model: d_model 16, d_state 16, headdim 8, initialised from seed. */
static m3_weights *small_weights(int32_t n_layers, int32_t input, int32_t head, int32_t vocab, uint64_t seed,
                                 m3_dims *d) {
  m3_config cfg;
  m3_config_defaults(&cfg);
  cfg.d_model = 16;
  cfg.n_layers = n_layers;
  cfg.d_state = 16;
  cfg.headdim = 8;
  cfg.input = input;
  cfg.head = head;
  cfg.vocab_size = vocab;
  m3_dims_from_config(&cfg, d);
  m3_weights *w = NULL;
  CHECK_OK(m3_weights_create(&cfg, &w));
  CHECK_OK(m3_weights_init(w, seed));
  return w;
}

static void check_api(m3_rng *r) {
  m3_dims d;
  m3_weights *w = small_weights(2, M3_INPUT_TOKENS, M3_HEAD_LM, 29, 7, &d);
  m3_infer_cfg ic = test_infer_cfg(w, M3_DEVICE_CPU, B);
  ic.max_len = 7;
  m3_infer *whole = NULL, *stepped = NULL;
  CHECK_OK(m3_infer_create(&ic, &whole));
  CHECK_OK(m3_infer_create(&ic, &stepped));

  int32_t tokens[B * T], one[B];
  for (int i = 0; i < B * T; i++) tokens[i] = (int32_t)(m3_rng_next(r) % 29);
  float *out = calloc((size_t)B * T * d.dm, sizeof(float)), *o1 = calloc((size_t)B * d.dm, sizeof(float));
  float logits[B * 29], l1[B * 29], later[B * 29];
  CHECK(m3_infer_logits(whole, later) == M3_ERR_ORDER, "logits before any step must be M3_ERR_ORDER");
  m3_batch b = {0};
  b.rows = B;
  b.len = T;
  b.tokens = tokens;
  CHECK_OK(m3_infer_step(whole, &b, out, logits));
  int same_out = 1;
  for (int t = 0; t < T; t++) {
    for (int row = 0; row < B; row++) one[row] = tokens[row * T + t];
    m3_batch s = {0};
    s.rows = B;
    s.len = 1;
    s.tokens = one;
    CHECK_OK(m3_infer_step(stepped, &s, o1, t == T - 1 ? l1 : NULL));
    for (int row = 0; row < B; row++) same_out &= same_f(o1 + row * d.dm, out + ((long)row * T + t) * d.dm, d.dm);
  }
  CHECK(same_out, "token by token differs from the whole prompt (in pieces of max_len)");
  CHECK(same_f(l1, logits, B * 29), "the last token's logits differ");
  CHECK_OK(m3_infer_logits(stepped, later));
  CHECK(same_f(later, logits, B * 29), "m3_infer_logits differs from the step's logits");

  const long n_ssm = (long)d.L * B * d.H * d.P * d.N;
  float *before = calloc((size_t)n_ssm, sizeof(float)), *after = calloc((size_t)n_ssm, sizeof(float));
  ssm_of(stepped, &d, before);
  ssm_of(whole, &d, after);
  CHECK(memcmp(before, after, (size_t)n_ssm * sizeof(float)) == 0,
        "final states differ between the whole prompt and token by token");
  tokens[B * T - 1] = 29;
  CHECK(m3_infer_step(stepped, &b, out, NULL) == M3_ERR_ARGUMENT, "token 29 of 29 must be refused");
  tokens[B * T - 1] = 0;
  b.rows = B + 1;
  CHECK(m3_infer_step(stepped, &b, out, NULL) == M3_ERR_ARGUMENT, "more rows than the batch must be refused");
  b.rows = B;
  b.len = 0;
  CHECK(m3_infer_step(stepped, &b, out, NULL) == M3_ERR_ARGUMENT, "an empty step must be refused");
  ssm_of(stepped, &d, after);
  CHECK(memcmp(before, after, (size_t)n_ssm * sizeof(float)) == 0, "a refused step changed the state");
  const int32_t rows[1] = {B};
  CHECK(m3_infer_reset(stepped, rows, 1) == M3_ERR_ARGUMENT, "reset of row %d must be refused", B);

  m3_infer *bad = NULL;
  ic.batch = 0;
  CHECK(m3_infer_create(&ic, &bad) == M3_ERR_CONFIG && !bad, "batch 0 must be a config error");
  ic.batch = 1;
  if (m3_cuda_device_count() == 0) {
    ic.device = M3_DEVICE_CUDA;
    CHECK(m3_infer_create(&ic, &bad) == M3_ERR_UNSUPPORTED && !bad, "cuda without a device must be unsupported");
  }
  m3_infer_info info;
  m3_infer_get_info(whole, &info);
  CHECK(info.device == M3_DEVICE_CPU && info.batch == B && info.max_len == 7 && info.logit_rows == B,
        "info: device %d batch %d max_len %d logit_rows %d", info.device, info.batch, info.max_len, info.logit_rows);
  m3_infer_destroy(whole);
  m3_infer_destroy(stepped);
  m3_infer_destroy(NULL);
  m3_weights_destroy(w);
  free(out);
  free(o1);
  free(before);
  free(after);
}

/* A step that asks a model without an "lm" head for logits is refused before it runs: the state stays. */
static void check_logits_refused(m3_rng *r) {
  m3_dims d;
  m3_weights *w = small_weights(1, M3_INPUT_IDENTITY, M3_HEAD_NONE, 0, 3, &d);
  const m3_infer_cfg ic = test_infer_cfg(w, M3_DEVICE_CPU, 1);
  m3_infer *inf = NULL;
  CHECK_OK(m3_infer_create(&ic, &inf));
  float input[16], out[16], logits[16];
  for (int i = 0; i < 16; i++) input[i] = (float)m3_rng_uniform(r) - 0.5f;
  m3_batch b = {0};
  b.rows = 1;
  b.len = 1;
  b.input = input;
  const long n_ssm = (long)d.L * d.H * d.P * d.N;
  float *before = calloc((size_t)n_ssm, sizeof(float)), *after = calloc((size_t)n_ssm, sizeof(float));
  CHECK_OK(m3_infer_step(inf, &b, out, NULL));
  ssm_of(inf, &d, before);
  CHECK(m3_infer_step(inf, &b, out, logits) == M3_ERR_UNSUPPORTED, "logits of a head \"none\" must be unsupported");
  ssm_of(inf, &d, after);
  CHECK(memcmp(before, after, (size_t)n_ssm * sizeof(float)) == 0, "a step refused for its logits changed the state");
  m3_infer_destroy(inf);
  m3_weights_destroy(w);
  free(before);
  free(after);
}

/* A NaN or an infinite input feature is refused before anything runs, for either input kind that takes
 * features: the state and the later steps are those of an object that never saw the bad step. */
static void check_nonfinite_input(m3_rng *r) {
  for (int kind = 0; kind < 2; kind++) {
    m3_config cfg;
    m3_config_defaults(&cfg);
    cfg.d_model = 16;
    cfg.n_layers = 2;
    cfg.d_state = 16;
    cfg.headdim = 8;
    cfg.input = kind ? M3_INPUT_IDENTITY : M3_INPUT_FEATURES;
    cfg.input_dim = 5;
    m3_dims d;
    m3_dims_from_config(&cfg, &d);
    m3_weights *w = NULL;
    CHECK_OK(m3_weights_create(&cfg, &w));
    CHECK_OK(m3_weights_init(w, 4));
    m3_infer_cfg ic = test_infer_cfg(w, M3_DEVICE_CPU, B);
    ic.max_len = 3; /* a step of 4 runs in two pieces */
    m3_infer *seen = NULL, *fresh = NULL;
    CHECK_OK(m3_infer_create(&ic, &seen));
    CHECK_OK(m3_infer_create(&ic, &fresh));
    enum { LEN = 4 };
    const long n_in = (long)B * LEN * d.input_dim, n_out = (long)B * LEN * d.dm;
    const long n_ssm = (long)d.L * B * d.H * d.P * d.N;
    float *in = calloc((size_t)n_in, sizeof(float)), *out = calloc((size_t)n_out, sizeof(float));
    float *out2 = calloc((size_t)n_out, sizeof(float));
    float *before = calloc((size_t)n_ssm, sizeof(float)), *after = calloc((size_t)n_ssm, sizeof(float));
    for (long i = 0; i < n_in; i++) in[i] = (float)m3_rng_uniform(r) - 0.5f;
    m3_batch b = {0};
    b.rows = B;
    b.input = in;
    for (int len = 1; len <= LEN; len += LEN - 1) { /* one window, then two pieces */
      b.len = len;
      CHECK_OK(m3_infer_step(seen, &b, out, NULL));
      CHECK_OK(m3_infer_step(fresh, &b, out2, NULL));
      ssm_of(seen, &d, before);
      const long at = ((long)(B - 1) * len + len - 1) * d.input_dim + 3; /* last row, last position, feature 3 */
      const float good = in[at];
      const float bad[] = {NAN, INFINITY, -INFINITY};
      for (int c = 0; c < 3; c++) {
        in[at] = bad[c];
        char want[96];
        snprintf(want, sizeof want, "batch.input (row %d, position %d) feature [3] = %g: expected a finite value",
                 B - 1, len - 1, (double)bad[c]);
        m3_status st = m3_infer_step(seen, &b, out, NULL);
        CHECK(st == M3_ERR_ARGUMENT && strstr(m3_last_error(), want), "%s input, len %d, feature %g: %s: %s",
              kind ? "identity" : "features", len, (double)bad[c], m3_status_name(st), m3_last_error());
      }
      in[at] = good;
      ssm_of(seen, &d, after);
      CHECK(memcmp(before, after, (size_t)n_ssm * sizeof(float)) == 0,
            "%s input, len %d: a refused step changed the state", kind ? "identity" : "features", len);
      CHECK_OK(m3_infer_step(seen, &b, out, NULL));
      CHECK_OK(m3_infer_step(fresh, &b, out2, NULL));
      CHECK(same_f(out, out2, (long)B * len * d.dm), "%s input, len %d: the step after a refused one differs",
            kind ? "identity" : "features", len);
    }
    m3_infer_destroy(seen);
    m3_infer_destroy(fresh);
    m3_weights_destroy(w);
    free(in);
    free(out);
    free(out2);
    free(before);
    free(after);
  }
}

/* ---- 4. non-finite weights ------------------------------------------------------------------ */

/* The trainer's weights equal w, bit for bit. */
static int holds(const m3_trainer *tr, const m3_weights *w) {
  m3_weights *snap = NULL;
  CHECK_OK(m3_weights_clone(w, &snap));
  CHECK_OK(m3_trainer_snapshot(tr, snap));
  const int same = same_f(m3_weights_data(snap), w->arena, (long)m3_weights_arena_size(w));
  m3_weights_destroy(snap);
  return same;
}

static void check_nonfinite_weights(void) {
  m3_dims d;
  m3_weights *good = small_weights(2, M3_INPUT_TOKENS, M3_HEAD_LM, 29, 5, &d), *bad = NULL;
  CHECK_OK(m3_weights_clone(good, &bad));
  m3_tensor_info D;
  CHECK_OK(m3_weights_tensor(bad, m3_weights_find(bad, "layers.1.mixer.D"), &D));
  m3_trainer *tr = NULL;
  const m3_trainer_cfg good_tc = test_trainer_cfg(good, M3_DEVICE_CPU, 1, 4);
  CHECK_OK(m3_trainer_create(&good_tc, &tr));
  /* a NaN with its sign bit set (what 0.0 / 0.0 gives on x86) still reads "nan" */
  const struct {
    float value;
    const char *text;
  } cases[] = {{copysignf(NAN, -1.0f), "nan"}, {INFINITY, "inf"}, {-INFINITY, "-inf"}};
  for (int c = 0; c < 3; c++) {
    D.data[3] = cases[c].value;
    char want[128];
    snprintf(want, sizeof want, "weights: layers.1.mixer.D [3] = %s: expected a finite value", cases[c].text);
    const m3_trainer_cfg tc = test_trainer_cfg(bad, M3_DEVICE_CPU, 1, 4);
    m3_trainer *t = NULL;
    m3_status st = m3_trainer_create(&tc, &t);
    CHECK(st == M3_ERR_ARGUMENT && !t && strstr(m3_last_error(), want), "trainer from weights with %s: %s: %s",
          cases[c].text, m3_status_name(st), m3_last_error());
    m3_trainer_destroy(t);
    const m3_infer_cfg ic = test_infer_cfg(bad, M3_DEVICE_CPU, 1);
    m3_infer *inf = NULL;
    st = m3_infer_create(&ic, &inf);
    CHECK(st == M3_ERR_ARGUMENT && !inf && strstr(m3_last_error(), want), "infer from weights with %s: %s: %s",
          cases[c].text, m3_status_name(st), m3_last_error());
    m3_infer_destroy(inf);
    st = m3_trainer_load_weights(tr, bad);
    CHECK(st == M3_ERR_ARGUMENT && strstr(m3_last_error(), want), "load_weights with %s: %s: %s", cases[c].text,
          m3_status_name(st), m3_last_error());
    CHECK(holds(tr, good), "a refused load_weights (%s) changed the trainer's weights", cases[c].text);
  }
  /* finite again (and different from the trainer's): every entry takes them */
  D.data[3] = 0.25f;
  const m3_trainer_cfg tc = test_trainer_cfg(bad, M3_DEVICE_CPU, 1, 4);
  const m3_infer_cfg ic = test_infer_cfg(bad, M3_DEVICE_CPU, 1);
  m3_trainer *t = NULL;
  m3_infer *inf = NULL;
  CHECK_OK(m3_trainer_create(&tc, &t));
  CHECK_OK(m3_infer_create(&ic, &inf));
  CHECK_OK(m3_trainer_load_weights(tr, bad));
  CHECK(holds(tr, bad), "load_weights of finite weights did not replace the trainer's");
  m3_trainer_destroy(t);
  m3_infer_destroy(inf);
  m3_trainer_destroy(tr);
  m3_weights_destroy(good);
  m3_weights_destroy(bad);
}

int main(void) {
  m3_rng r;
  m3_rng_seed(&r, 13);
  check_forward_only(&r);
  check_api(&r);
  check_logits_refused(&r);
  check_nonfinite_input(&r);
  check_nonfinite_weights();
  return harness_finish("infer");
}

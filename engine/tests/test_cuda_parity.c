/*
 * test_cuda_parity.c — the CUDA backend through the public trainer API (m3.h):
 *
 *   1. against the CPU backend on configs covering P in {8..128}, N in {8..256}, G in {1, 2},
 *      rope_fraction 0 / 0.5 / 1, outproj_norm, every input and head, window lengths
 *      1, 63, 64, 65, 300, nonzero incoming states, random resets and carry across windows:
 *      out, final states, accumulated gradients, weights after the optimizer, losses.
 *      f32: rel L2 <= 1e-5 (out, states, loss), 1e-4 (each gradient tensor, weights);
 *      bf16: rel L2 <= 2e-2 (out, states, loss, weights), cosine >= 0.99 (each gradient tensor).
 *   2. against itself, bitwise, for f32, bf16 and f16: graph replay = eager steps, split calls
 *      = fused steps, two runs equal, the B/C gradients summed over heads by either kernel (the
 *      chunked post kernel or the B/C norm backward), set_lr under a captured graph applies at the
 *      next replay (and drop_graph -> set_lr -> capture_graph), window shapes changing under graph
 *      mode; one case large enough that its uploads overlap the step (a fused step in two parts).
 *   3. f16: an overflowing step skips the update (weights bitwise unchanged), halves the loss
 *      scale and does not count; sizes beyond the kernels (headdim 256, more rows than a launch grid
 *      holds) fail at creation with a clear error; windows of more than 65535 rows match the CPU.
 *
 * Exit 77 (skipped) without a CUDA device.
 */
#include "harness.h"

/* ---- configs, batches, trainers ------------------------------------------------------------- */

typedef struct spec {
  int P, N, H, G;
  double rope;
  int outnorm, input, head, tied, B, T;
} spec;

static m3_config config_of(const spec *s) {
  return test_config(s->P, s->N, s->H, s->G, s->rope, s->outnorm, s->input, s->head, s->tied);
}

typedef struct batch {
  m3_batch b;
  float *input, *tvals, *d_out;
  int32_t *tokens, *targets;
  uint8_t *mask, *resets;
} batch;

/* A window of rows x len with fresh random contents; resets with probability 1/16 (row 0
 * also at its first position when with_resets > 1); d_out scaled by dscale. */
static void batch_make(batch *bt, const m3_config *c, int rows, int len, m3_rng *r, int with_resets,
                       double dscale) {
  memset(bt, 0, sizeof *bt);
  const long M = (long)rows * len;
  bt->b.rows = rows;
  bt->b.len = len;
  if (c->input == M3_INPUT_TOKENS) {
    bt->tokens = malloc((size_t)M * sizeof(int32_t));
    for (long i = 0; i < M; i++) bt->tokens[i] = (int32_t)(m3_rng_next(r) % (uint64_t)c->vocab_size);
    bt->b.tokens = bt->tokens;
  } else {
    const long w = c->input == M3_INPUT_FEATURES ? c->input_dim : c->d_model;
    bt->input = malloc((size_t)(M * w) * sizeof(float));
    fill_normal_f(r, bt->input, M * w, 1.0);
    bt->b.input = bt->input;
  }
  if (c->head == M3_HEAD_LM) {
    bt->targets = malloc((size_t)M * sizeof(int32_t));
    for (long i = 0; i < M; i++)
      bt->targets[i] = m3_rng_uniform(r) < 0.15 ? -1 : (int32_t)(m3_rng_next(r) % (uint64_t)c->vocab_size);
    bt->b.targets = bt->targets;
  } else if (c->head == M3_HEAD_MSE) {
    bt->tvals = malloc((size_t)(M * c->out_dim) * sizeof(float));
    fill_normal_f(r, bt->tvals, M * c->out_dim, 1.0);
    bt->mask = malloc((size_t)M);
    for (long i = 0; i < M; i++) bt->mask[i] = m3_rng_uniform(r) < 0.8;
    bt->b.target_values = bt->tvals;
    bt->b.mask = bt->mask;
  } else {
    bt->d_out = malloc((size_t)(M * c->d_model) * sizeof(float));
    fill_normal_f(r, bt->d_out, M * c->d_model, dscale);
    bt->b.d_out = bt->d_out;
  }
  if (with_resets) {
    bt->resets = calloc((size_t)M, 1);
    for (long i = 0; i < M; i++) bt->resets[i] = m3_rng_uniform(r) < 1.0 / 16;
    if (with_resets > 1) bt->resets[0] = 1;
    bt->b.resets = bt->resets;
  }
}

static void batch_free(batch *bt) {
  free(bt->input);
  free(bt->tvals);
  free(bt->d_out);
  free(bt->tokens);
  free(bt->targets);
  free(bt->mask);
  free(bt->resets);
}

static m3_trainer *trainer(const m3_weights *w, int device, int prec, int B, int T, int carry) {
  m3_trainer_cfg tc = test_trainer_cfg(w, device, B, T);
  tc.precision = prec;
  tc.carry_state = carry;
  m3_trainer *t = NULL;
  CHECK_OK(m3_trainer_create(&tc, &t));
  return t;
}

static double cos_ff(const float *a, const float *b, long n) {
  double ab = 0, aa = 0, bb = 0;
  for (long i = 0; i < n; i++) {
    ab += (double)a[i] * b[i];
    aa += (double)a[i] * a[i];
    bb += (double)b[i] * b[i];
  }
  if (aa == 0 && bb == 0) return 1;
  return ab / sqrt(aa * bb + 1e-300);
}

/* ---- 1. CUDA vs CPU -------------------------------------------------------------------------------- */

typedef struct worst {
  double out, state, grad_rel, grad_cos, weights, loss;
} worst;

static void compare_out(const char *tag, const float *g, const float *c, long n, int prec, worst *w) {
  const double e = rel_l2_ff(g, c, n);
  w->out = fmax(w->out, e);
  CHECK(e <= (prec == M3_PRECISION_F32 ? 1e-5 : 2e-2), "%s: out rel %.3g", tag, e);
}

static void compare_states(const char *tag, m3_trainer *tg, m3_trainer *tc, const m3_config *c, int B, int prec,
                           worst *w) {
  long n[4];
  state_sizes(c, B, n);
  static const char *const kinds[4] = {"angle", "ssm", "k", "v"};
  for (int l = 0; l < c->n_layers; l++) {
    float *g[4], *h[4];
    for (int k = 0; k < 4; k++) {
      g[k] = calloc((size_t)n[k] + 1, sizeof(float));
      h[k] = calloc((size_t)n[k] + 1, sizeof(float));
    }
    CHECK_OK(m3_trainer_get_state(tg, l, g[0], g[1], g[2], g[3]));
    CHECK_OK(m3_trainer_get_state(tc, l, h[0], h[1], h[2], h[3]));
    for (int k = 0; k < 4; k++) {
      if (!n[k]) continue;
      const double e = k == 0 ? rel_angle_ff(g[k], h[k], n[k]) : rel_l2_ff(g[k], h[k], n[k]);
      w->state = fmax(w->state, e);
      /* k and v are one position's in_proj outputs, rounded to the 16-bit type on top of the layer input's
       * error, and few values (rows x heads x N or P): a relative error over them does not average the way
       * out's over every position does. Token input + lm head at P = N = 16 measured 1.7e-2 and 2.5e-2 on
       * layer 1's v (cases 5 and 16, run 255); a wrong token, head or layout is off by O(1). */
      const double tol = prec == M3_PRECISION_F32 ? 1e-5 : k >= 2 ? 5e-2 : 2e-2;
      CHECK(e <= tol, "%s: layer %d state %s rel %.3g", tag, l, kinds[k], e);
      free(g[k]);
      free(h[k]);
    }
  }
}

static void compare_grads(const char *tag, m3_trainer *tg, m3_trainer *tc, const m3_config *c, int prec, worst *w) {
  m3_weights *gg = NULL, *gc = NULL;
  CHECK_OK(m3_weights_create(c, &gg));
  CHECK_OK(m3_weights_create(c, &gc));
  CHECK_OK(m3_trainer_grads(tg, gg));
  CHECK_OK(m3_trainer_grads(tc, gc));
  for (int32_t i = 0; i < m3_weights_count(gg); i++) {
    m3_tensor_info a, b;
    m3_weights_tensor(gg, i, &a);
    m3_weights_tensor(gc, i, &b);
    if (prec == M3_PRECISION_F32) {
      const double e = rel_l2_ff(a.data, b.data, (long)a.numel);
      w->grad_rel = fmax(w->grad_rel, e);
      CHECK(e <= 1e-4, "%s: grad %s rel %.3g", tag, a.name, e);
    } else {
      const double cs = cos_ff(a.data, b.data, (long)a.numel);
      w->grad_cos = fmin(w->grad_cos, cs);
      CHECK(cs >= 0.99, "%s: grad %s cosine %.5f", tag, a.name, cs);
    }
  }
  m3_weights_destroy(gg);
  m3_weights_destroy(gc);
}

static void compare_weights(const char *tag, m3_trainer *tg, m3_trainer *tc, const m3_config *c, int prec, worst *w) {
  m3_weights *a = NULL, *b = NULL;
  CHECK_OK(m3_weights_create(c, &a));
  CHECK_OK(m3_weights_create(c, &b));
  CHECK_OK(m3_trainer_snapshot(tg, a));
  CHECK_OK(m3_trainer_snapshot(tc, b));
  const double e = rel_l2_ff(m3_weights_data(a), m3_weights_data(b), (long)m3_weights_arena_size(a));
  w->weights = fmax(w->weights, e);
  CHECK(e <= (prec == M3_PRECISION_F32 ? 1e-4 : 2e-2), "%s: weights after the update rel %.3g", tag, e);
  m3_weights_destroy(a);
  m3_weights_destroy(b);
}

static void compare_loss(const char *tag, const m3_metrics *g, const m3_metrics *c, int prec, worst *w) {
  CHECK(g->has_loss == c->has_loss, "%s: has_loss %d vs %d", tag, g->has_loss, c->has_loss);
  if (!c->has_loss) return;
  const double e = fabs(g->loss - c->loss) / fmax(fabs(c->loss), 1e-30);
  w->loss = fmax(w->loss, e);
  CHECK(e <= (prec == M3_PRECISION_F32 ? 1e-5 : 2e-2), "%s: loss %.9g vs %.9g", tag, g->loss, c->loss);
  CHECK(g->counted == c->counted, "%s: counted %lld vs %lld", tag, (long long)g->counted, (long long)c->counted);
}

static void set_random_states(m3_trainer *a, m3_trainer *b, const m3_config *c, int B, m3_rng *r) {
  long n[4];
  state_sizes(c, B, n);
  for (int l = 0; l < c->n_layers; l++) {
    float *s[4];
    random_layer_state(r, n, s);
    CHECK_OK(m3_trainer_set_state(a, l, s[0], s[1], s[2], s[3]));
    CHECK_OK(m3_trainer_set_state(b, l, s[0], s[1], s[2], s[3]));
    for (int k = 0; k < 4; k++) free(s[k]);
  }
}

/* Case idx of spec s with config c (config_of(s), or deeper) */
static void parity_config(int idx, const spec *s, const m3_config c, int prec) {
  char tag[160];
  snprintf(tag, sizeof tag, "case %d %s (P %d N %d H %d G %d rope %.1f norm %d in %d head %d T %d L %d)", idx,
           precision_name(prec), s->P, s->N, s->H, s->G, s->rope, s->outnorm, s->input, s->head, s->T, c.n_layers);
  m3_weights *w = NULL;
  CHECK_OK(m3_weights_create(&c, &w));
  if (!w) return;
  CHECK_OK(m3_weights_init(w, 1000 + (uint64_t)idx));
  m3_trainer *tg = trainer(w, M3_DEVICE_CUDA, prec, s->B, s->T, 1), *tc = trainer(w, M3_DEVICE_CPU, M3_PRECISION_F32,
                                                                                   s->B, s->T, 1);
  if (!tg || !tc) {
    m3_trainer_destroy(tg);
    m3_trainer_destroy(tc);
    m3_weights_destroy(w);
    return;
  }
  m3_rng r;
  m3_rng_seed(&r, 77 + (uint64_t)idx);
  worst wv = {0, 0, 0, 1, 0, 0};
  set_random_states(tg, tc, &c, s->B, &r);
  const long dm = c.d_model;
  /* window 1: forward, accumulate */
  batch b1;
  batch_make(&b1, &c, s->B, s->T, &r, 2, 1.0);
  float *og = malloc((size_t)(s->B * s->T * dm) * sizeof(float)), *oc = malloc((size_t)(s->B * s->T * dm) * sizeof(float));
  CHECK_OK(m3_trainer_forward(tg, &b1.b, og));
  CHECK_OK(m3_trainer_forward(tc, &b1.b, oc));
  compare_out(tag, og, oc, (long)s->B * s->T * dm, prec, &wv);
  compare_states(tag, tg, tc, &c, s->B, prec, &wv);
  m3_backward_opts acc = {0, 1, 1};
  m3_metrics mg, mc;
  CHECK_OK(m3_trainer_backward_step(tg, &b1.b, &acc, &mg));
  CHECK_OK(m3_trainer_backward_step(tc, &b1.b, &acc, &mc));
  compare_loss(tag, &mg, &mc, prec, &wv);
  compare_grads(tag, tg, tc, &c, prec, &wv);
  /* window 2: a shorter window carrying the state on, closing the accumulation */
  const int len2 = s->T > 2 ? s->T / 2 + 1 : s->T;
  batch b2;
  batch_make(&b2, &c, s->B, len2, &r, 1, 1.0);
  CHECK_OK(m3_trainer_forward(tg, &b2.b, og));
  CHECK_OK(m3_trainer_forward(tc, &b2.b, oc));
  compare_out(tag, og, oc, (long)s->B * len2 * dm, prec, &wv);
  compare_states(tag, tg, tc, &c, s->B, prec, &wv);
  m3_backward_opts close = {0, 0, 1};
  CHECK_OK(m3_trainer_backward_step(tg, &b2.b, &close, &mg));
  CHECK_OK(m3_trainer_backward_step(tc, &b2.b, &close, &mc));
  compare_loss(tag, &mg, &mc, prec, &wv);
  compare_grads(tag, tg, tc, &c, prec, &wv);
  compare_weights(tag, tg, tc, &c, prec, &wv);
  /* two fused steps, one with fewer rows */
  for (int k = 0; k < 2; k++) {
    batch b3;
    const int rows = k == 1 && s->B > 1 ? s->B - 1 : s->B;
    batch_make(&b3, &c, rows, s->T, &r, 1, 1.0);
    CHECK_OK(m3_trainer_step(tg, &b3.b, &mg));
    CHECK_OK(m3_trainer_step(tc, &b3.b, &mc));
    compare_loss(tag, &mg, &mc, prec, &wv);
    batch_free(&b3);
  }
  compare_weights(tag, tg, tc, &c, prec, &wv);
  compare_states(tag, tg, tc, &c, s->B, prec, &wv);
  printf("%s: out %.2e state %.2e loss %.2e grad %s %.2e weights %.2e\n", tag, wv.out, wv.state, wv.loss,
         prec == M3_PRECISION_F32 ? "rel" : "min cos", prec == M3_PRECISION_F32 ? wv.grad_rel : wv.grad_cos,
         wv.weights);
  fflush(stdout);
  batch_free(&b1);
  batch_free(&b2);
  free(og);
  free(oc);
  m3_trainer_destroy(tg);
  m3_trainer_destroy(tc);
  m3_weights_destroy(w);
}

static void parity_case(int idx, const spec *s, int prec) { parity_config(idx, s, config_of(s), prec); }

/* ---- 2. CUDA against itself, bitwise ------------------------------------------------------------------- */

typedef struct result {
  m3_weights *w, *g;
  float *state;
  long nstate;
  double loss[8];
} result;

static void result_take(result *res, m3_trainer *t, const m3_config *c, int B) {
  CHECK_OK(m3_weights_create(c, &res->w));
  CHECK_OK(m3_weights_create(c, &res->g));
  CHECK_OK(m3_trainer_snapshot(t, res->w));
  CHECK_OK(m3_trainer_grads(t, res->g));
  long n[4];
  state_sizes(c, B, n);
  const long per = n[0] + n[1] + n[2] + n[3];
  res->nstate = per * c->n_layers;
  res->state = calloc((size_t)res->nstate + 1, sizeof(float));
  for (int l = 0; l < c->n_layers; l++) {
    float *p = res->state + l * per;
    CHECK_OK(m3_trainer_get_state(t, l, p, p + n[0], p + n[0] + n[1], p + n[0] + n[1] + n[2]));
  }
}

static void result_free(result *r) {
  m3_weights_destroy(r->w);
  m3_weights_destroy(r->g);
  free(r->state);
}

static void same_bits(const char *tag, const result *a, const result *b, int nsteps) {
  const long n = (long)m3_weights_arena_size(a->w);
  CHECK(!memcmp(m3_weights_data(a->w), m3_weights_data(b->w), (size_t)n * sizeof(float)), "%s: weights differ", tag);
  CHECK(!memcmp(m3_weights_data(a->g), m3_weights_data(b->g), (size_t)n * sizeof(float)), "%s: grads differ", tag);
  CHECK(!memcmp(a->state, b->state, (size_t)a->nstate * sizeof(float)), "%s: states differ", tag);
  for (int i = 0; i < nsteps; i++)
    CHECK(!memcmp(&a->loss[i], &b->loss[i], sizeof(double)), "%s: loss of step %d %.17g vs %.17g", tag, i, a->loss[i],
          b->loss[i]);
}

enum { MODE_EAGER, MODE_GRAPH, MODE_SPLIT, MODE_LR_GRAPH, MODE_LR_EAGER, MODE_LR_RECAPTURE, MODE_SHAPES_GRAPH,
       MODE_SHAPES_EAGER };

/* Four windows through one trainer in the given mode. */
static void run_mode(const m3_config *c, const m3_weights *w, int prec, int B, int T, batch *bs, int mode,
                     result *res) {
  memset(res, 0, sizeof *res);
  m3_trainer *t = trainer(w, M3_DEVICE_CUDA, prec, B, T, 1);
  if (!t) return;
  for (int i = 0; i < 4; i++) {
    m3_metrics m;
    memset(&m, 0, sizeof m);
    if (i == 1 && (mode == MODE_GRAPH || mode == MODE_LR_GRAPH || mode == MODE_LR_RECAPTURE))
      CHECK_OK(m3_trainer_capture_graph(t));
    if (i == 0 && mode == MODE_SHAPES_GRAPH) CHECK_OK(m3_trainer_capture_graph(t));
    if (i == 2 && (mode == MODE_LR_GRAPH || mode == MODE_LR_EAGER)) CHECK_OK(m3_trainer_set_lr(t, 5e-3));
    if (i == 2 && mode == MODE_LR_RECAPTURE) {
      CHECK_OK(m3_trainer_drop_graph(t));
      CHECK_OK(m3_trainer_set_lr(t, 5e-3));
      CHECK_OK(m3_trainer_capture_graph(t));
    }
    if (mode == MODE_SPLIT) { /* the backward's batch carries only the head's fields */
      m3_batch hb = bs[i].b;
      hb.input = NULL;
      hb.tokens = NULL;
      hb.resets = NULL;
      CHECK_OK(m3_trainer_forward(t, &bs[i].b, NULL));
      CHECK_OK(m3_trainer_backward_step(t, &hb, NULL, &m));
    } else {
      const m3_status st = m3_trainer_step(t, &bs[i].b, &m);
      CHECK(st == M3_OK, "step %d (mode %d): %s", i, mode, m3_last_error());
      const int graph = mode == MODE_SHAPES_GRAPH || (i >= 1 && (mode == MODE_GRAPH || mode == MODE_LR_GRAPH ||
                                                                 mode == MODE_LR_RECAPTURE));
      CHECK(m.graph_replayed == graph, "mode %d step %d: graph_replayed %d", mode, i, m.graph_replayed);
    }
    res->loss[i] = m.has_loss ? m.loss : m.grad_norm;
  }
  result_take(res, t, c, B);
  m3_trainer_destroy(t);
}

static void self_checks(const spec *s, int prec) {
  char tag[128];
  const m3_config c = config_of(s);
  m3_weights *w = NULL;
  CHECK_OK(m3_weights_create(&c, &w));
  if (!w) return;
  CHECK_OK(m3_weights_init(w, 5));
  m3_rng r;
  m3_rng_seed(&r, 9);
  const double dscale = prec == M3_PRECISION_F16 ? 1e-3 : 1.0; /* f16: keep the scaled gradients finite */
  batch bs[4], shp[4];
  for (int i = 0; i < 4; i++) batch_make(&bs[i], &c, s->B, s->T, &r, 1, dscale);
  for (int i = 0; i < 4; i++) batch_make(&shp[i], &c, i == 2 ? 1 : s->B, i == 1 || i == 3 ? s->T / 2 + 1 : s->T, &r, 1,
                                         dscale);
  result eager, again, per_head, graph, split, lr_graph, lr_eager, lr_re, sh_graph, sh_eager;
  run_mode(&c, w, prec, s->B, s->T, bs, MODE_EAGER, &eager);
  run_mode(&c, w, prec, s->B, s->T, bs, MODE_EAGER, &again);
  /* the chunked backward's B/C gradients summed per head by the B/C norm backward instead of the post kernel */
  setenv("M3_SCAN_POST_SUM_MIN_CTAS", "2000000000", 1);
  run_mode(&c, w, prec, s->B, s->T, bs, MODE_EAGER, &per_head);
  setenv("M3_SCAN_POST_SUM_MIN_CTAS", "0", 1);
  run_mode(&c, w, prec, s->B, s->T, bs, MODE_GRAPH, &graph);
  run_mode(&c, w, prec, s->B, s->T, bs, MODE_SPLIT, &split);
  run_mode(&c, w, prec, s->B, s->T, bs, MODE_LR_GRAPH, &lr_graph);
  run_mode(&c, w, prec, s->B, s->T, bs, MODE_LR_EAGER, &lr_eager);
  run_mode(&c, w, prec, s->B, s->T, bs, MODE_LR_RECAPTURE, &lr_re);
  run_mode(&c, w, prec, s->B, s->T, shp, MODE_SHAPES_GRAPH, &sh_graph);
  run_mode(&c, w, prec, s->B, s->T, shp, MODE_SHAPES_EAGER, &sh_eager);
  if (eager.w && again.w && per_head.w && graph.w && split.w && lr_graph.w && lr_eager.w && lr_re.w && sh_graph.w &&
      sh_eager.w) {
    snprintf(tag, sizeof tag, "%s head %d: run to run", precision_name(prec), s->head);
    same_bits(tag, &eager, &again, 4);
    snprintf(tag, sizeof tag, "%s head %d: heads summed by the post kernel vs per head", precision_name(prec), s->head);
    same_bits(tag, &eager, &per_head, 4);
    snprintf(tag, sizeof tag, "%s head %d: graph replay vs eager", precision_name(prec), s->head);
    same_bits(tag, &graph, &eager, 4);
    snprintf(tag, sizeof tag, "%s head %d: split vs fused", precision_name(prec), s->head);
    same_bits(tag, &split, &eager, s->head == M3_HEAD_NONE ? 0 : 4);
    snprintf(tag, sizeof tag, "%s head %d: set_lr under a graph vs eager", precision_name(prec), s->head);
    same_bits(tag, &lr_graph, &lr_eager, 4);
    snprintf(tag, sizeof tag, "%s head %d: drop, set_lr, capture vs eager", precision_name(prec), s->head);
    same_bits(tag, &lr_re, &lr_eager, 4);
    snprintf(tag, sizeof tag, "%s head %d: changing shapes under graph mode vs eager", precision_name(prec), s->head);
    same_bits(tag, &sh_graph, &sh_eager, 4);
    const long n = (long)m3_weights_arena_size(eager.w);
    CHECK(memcmp(m3_weights_data(lr_graph.w), m3_weights_data(eager.w), (size_t)n * sizeof(float)) != 0,
          "%s head %d: set_lr under a graph changed nothing", precision_name(prec), s->head);
  }
  printf("self checks %s head %d input %d: done\n", precision_name(prec), s->head, s->input);
  fflush(stdout);
  result *all[] = {&eager, &again, &per_head, &graph, &split, &lr_graph, &lr_eager, &lr_re, &sh_graph, &sh_eager};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) result_free(all[i]);
  for (int i = 0; i < 4; i++) {
    batch_free(&bs[i]);
    batch_free(&shp[i]);
  }
  m3_weights_destroy(w);
}

/* ---- 3. f16 overflow, limits ------------------------------------------------------------------------------ */

static void f16_overflow(void) {
  const spec s = {16, 16, 4, 1, 0.5, 0, M3_INPUT_FEATURES, M3_HEAD_NONE, 1, 2, 32};
  const m3_config c = config_of(&s);
  m3_weights *w = NULL, *before = NULL, *after = NULL;
  CHECK_OK(m3_weights_create(&c, &w));
  CHECK_OK(m3_weights_init(w, 3));
  CHECK_OK(m3_weights_create(&c, &before));
  CHECK_OK(m3_weights_create(&c, &after));
  m3_trainer *t = trainer(w, M3_DEVICE_CUDA, M3_PRECISION_F16, s.B, s.T, 0);
  if (!t || !before || !after) return;
  m3_rng r;
  m3_rng_seed(&r, 4);
  batch ok, huge;
  batch_make(&ok, &c, s.B, s.T, &r, 0, 1e-3);
  batch_make(&huge, &c, s.B, s.T, &r, 0, 1e6);
  m3_metrics m;
  CHECK_OK(m3_trainer_step(t, &ok.b, &m));
  CHECK(m.optimizer_stepped == 1 && m.overflow_skipped == 0, "f16: a normal step was not applied");
  double scale0 = 0, scale1 = 0;
  int64_t tracker = 0;
  CHECK_OK(m3_trainer_scaler_state(t, &scale0, &tracker));
  CHECK_OK(m3_trainer_snapshot(t, before));
  const int64_t steps = m3_trainer_step_count(t);
  CHECK_OK(m3_trainer_step(t, &huge.b, &m));
  CHECK(m.overflow_skipped == 1 && m.optimizer_stepped == 0, "f16: overflow not reported (skipped %d, stepped %d)",
        m.overflow_skipped, m.optimizer_stepped);
  CHECK_OK(m3_trainer_scaler_state(t, &scale1, &tracker));
  CHECK(scale1 == scale0 / 2, "f16: loss scale %g after overflow (was %g)", scale1, scale0);
  CHECK(m3_trainer_step_count(t) == steps, "f16: the skipped step was counted");
  CHECK_OK(m3_trainer_snapshot(t, after));
  CHECK(!memcmp(m3_weights_data(before), m3_weights_data(after), (size_t)m3_weights_arena_size(w) * sizeof(float)),
        "f16: the overflowing step changed the weights");
  CHECK_OK(m3_trainer_step(t, &ok.b, &m));
  CHECK(m.optimizer_stepped == 1, "f16: no recovery after the overflow");
  printf("f16 overflow: scale %g -> %g, weights unchanged\n", scale0, scale1);
  batch_free(&ok);
  batch_free(&huge);
  m3_trainer_destroy(t);
  m3_weights_destroy(w);
  m3_weights_destroy(before);
  m3_weights_destroy(after);
}

/* Inference of s.B rows against the CPU's: a 3-token window, then two one-token steps (the decode path) */
static void infer_rows_past_grid(const spec *s) {
  const m3_config c = config_of(s);
  m3_weights *w = NULL;
  CHECK_OK(m3_weights_create(&c, &w));
  CHECK_OK(m3_weights_init(w, 31));
  m3_infer *inf[2] = {NULL, NULL};
  for (int k = 0; k < 2; k++) {
    m3_infer_cfg ic = test_infer_cfg(w, k == 0 ? M3_DEVICE_CUDA : M3_DEVICE_CPU, s->B);
    ic.max_len = s->T;
    CHECK_OK(m3_infer_create(&ic, &inf[k]));
  }
  m3_rng r;
  m3_rng_seed(&r, 32);
  const long n = (long)s->B * s->T * c.d_model;
  float *out[2] = {malloc((size_t)n * sizeof(float)), malloc((size_t)n * sizeof(float))};
  for (int len = s->T, k = 0; inf[0] && inf[1] && k < 3; k++, len = 1) {
    batch bt;
    batch_make(&bt, &c, s->B, len, &r, 1, 1.0);
    CHECK_OK(m3_infer_step(inf[0], &bt.b, out[0], NULL));
    CHECK_OK(m3_infer_step(inf[1], &bt.b, out[1], NULL));
    const double e = rel_l2_ff(out[0], out[1], (long)s->B * len * c.d_model);
    CHECK(e <= 1e-5, "infer %d rows, window %d of %d tokens: out rel %.3g", s->B, k, len, e);
    batch_free(&bt);
  }
  printf("infer %d rows: windows of %d, 1, 1 tokens checked\n", s->B, s->T);
  for (int k = 0; k < 2; k++) {
    m3_infer_destroy(inf[k]);
    free(out[k]);
  }
  m3_weights_destroy(w);
}

/* Rows past the 65535 of a launch grid's y and z (the scan kernels take them in grid.x, rows_grid): windows of more
 * rows match the CPU (f32: the SIMT kernels; bf16: the chunked kernels; 16 x 16 f32: the small-state forward and
 * backward; inference: a window, then the one-token decode steps); more rows than grid.x holds are refused at
 * creation. */
static void rows_past_grid(int idx) {
  const spec wide = {2, 4, 2, 1, 0.5, 0, M3_INPUT_IDENTITY, M3_HEAD_NONE, 1, 66000, 3};
  parity_case(idx, &wide, M3_PRECISION_F32);
  /* bf16 on a wider model: at d_model 2 the 16-bit rounding alone moves some of layer 0's gradients by tens of
   * percent (NOTES.md run 283), at P = N = 8 every tensor's by ~0.5 % */
  const spec wide8 = {8, 8, 2, 1, 0.5, 0, M3_INPUT_IDENTITY, M3_HEAD_NONE, 1, 66000, 3};
  parity_case(idx, &wide8, M3_PRECISION_BF16);
  const spec wide16 = {16, 16, 1, 1, 0.5, 0, M3_INPUT_IDENTITY, M3_HEAD_NONE, 1, 65600, 66};
  parity_case(idx + 1, &wide16, M3_PRECISION_F32);
  infer_rows_past_grid(&wide);
  /* 32 heads on d_model 2 (expand 32): 2^26 rows pass the positions' limit with 1 GiB of host staging */
  const spec heads = {2, 4, 32, 1, 0.5, 0, M3_INPUT_IDENTITY, M3_HEAD_NONE, 1, 1 << 26, 1};
  m3_config c = config_of(&heads);
  c.d_model = 2;
  c.expand = 32;
  m3_weights *w = NULL;
  CHECK_OK(m3_weights_create(&c, &w));
  m3_infer_cfg ic = test_infer_cfg(w, M3_DEVICE_CUDA, heads.B);
  ic.max_len = heads.T;
  m3_infer *inf = NULL;
  const m3_status st = m3_infer_create(&ic, &inf);
  CHECK(st == M3_ERR_UNSUPPORTED && strstr(m3_last_error(), "67108863 rows"), "batch 2^26 x 32 heads: status %d, '%s'",
        st, m3_last_error());
  printf("limits: batch 2^26 x 32 heads -> %s\n", m3_last_error());
  m3_infer_destroy(inf);
  m3_weights_destroy(w);
}

static void limits(void) {
  const spec s = {256, 16, 2, 1, 0.5, 0, M3_INPUT_IDENTITY, M3_HEAD_NONE, 1, 1, 4};
  const m3_config c = config_of(&s);
  m3_weights *w = NULL;
  CHECK_OK(m3_weights_create(&c, &w));
  const m3_trainer_cfg tc = test_trainer_cfg(w, M3_DEVICE_CUDA, 1, 4);
  m3_trainer *t = NULL;
  const m3_status st = m3_trainer_create(&tc, &t);
  CHECK(st == M3_ERR_UNSUPPORTED && strstr(m3_last_error(), "headdim"), "headdim 256: status %d, message '%s'", st,
        m3_last_error());
  printf("limits: headdim 256 -> %s\n", m3_last_error());
  m3_trainer_destroy(t);
  m3_weights_destroy(w);
}

int main(void) {
  if (m3_cuda_device_count() == 0) {
    printf("skipped: no CUDA device\n");
    return 77;
  }
  /* every 16-bit case runs the chunked tensor-core scan (by default it starts at P x N = 1024), whose
   * post kernel sums a group's heads wherever a group has several (self_checks compares the other way) */
  setenv("M3_SCAN_CHUNK_MIN_STATE", "0", 1);
  setenv("M3_SCAN_POST_SUM_MIN_CTAS", "0", 1);
  const spec cases[] = {
      /* P,  N,  H, G, rope, norm, input, head, tied, B, T */
      {8, 16, 8, 1, 0.5, 0, M3_INPUT_FEATURES, M3_HEAD_NONE, 1, 2, 63},
      {16, 8, 4, 2, 1.0, 1, M3_INPUT_IDENTITY, M3_HEAD_MSE, 1, 3, 64},
      {32, 64, 4, 1, 0.0, 0, M3_INPUT_TOKENS, M3_HEAD_LM, 1, 2, 65},
      {64, 128, 4, 2, 0.5, 1, M3_INPUT_FEATURES, M3_HEAD_NONE, 1, 1, 300},
      {128, 256, 2, 1, 1.0, 0, M3_INPUT_IDENTITY, M3_HEAD_NONE, 1, 2, 1},
      {16, 16, 4, 1, 0.5, 0, M3_INPUT_TOKENS, M3_HEAD_LM, 0, 2, 300},
      {128, 64, 2, 2, 0.5, 1, M3_INPUT_IDENTITY, M3_HEAD_MSE, 1, 1, 65},
      {8, 256, 4, 2, 0.5, 0, M3_INPUT_FEATURES, M3_HEAD_LM, 0, 1, 64},
      {32, 16, 8, 2, 0.0, 1, M3_INPUT_TOKENS, M3_HEAD_MSE, 1, 2, 1},
      /* the chunked 16-bit scan: two full 64-token chunks + a partial one, resets inside chunks */
      {64, 128, 2, 1, 0.5, 0, M3_INPUT_IDENTITY, M3_HEAD_NONE, 1, 2, 130},
      {32, 64, 4, 2, 1.0, 1, M3_INPUT_FEATURES, M3_HEAD_MSE, 1, 2, 129},
      /* a padded state above 8192 elements: 16-bit takes the SIMT kernels (the chunked forward holds
       * at most 8192 state elements in registers) */
      {96, 96, 2, 1, 0.5, 1, M3_INPUT_IDENTITY, M3_HEAD_NONE, 1, 1, 70},
      /* a 32-thread SIMT plan (P x N <= 32): its token blocks hold 32 tokens, one per thread */
      {2, 4, 4, 1, 0.5, 0, M3_INPUT_FEATURES, M3_HEAD_MSE, 1, 2, 100},
  };
  const int ncases = (int)(sizeof cases / sizeof cases[0]);
  for (int i = 0; i < ncases; i++) {
    parity_case(i, &cases[i], M3_PRECISION_F32);
    parity_case(i, &cases[i], M3_PRECISION_BF16);
  }
  /* at these few (head, row) pairs the chunked scan's walks split every state whose headdim is a multiple
   * of 64 over two CTAs (and the angle walk its pairs); the two such cases above once more unsplit */
  setenv("M3_SCAN_WALK_SPLIT_MAX_CTAS", "0", 1);
  parity_case(3, &cases[3], M3_PRECISION_BF16);
  parity_case(9, &cases[9], M3_PRECISION_BF16);
  unsetenv("M3_SCAN_WALK_SPLIT_MAX_CTAS");
  /* at the default threshold a 16-bit window of one chunk at P x N = 256 takes the SIMT backward and
   * the small-state forward (scan_warp.cu, 16-token chunks up to 64 tokens): windows of 45 and 23 tokens
   * (the last chunk partial), G 2, every column rotated, the mixer norm; then windows of 64 (whole chunks
   * only) and 33 (two chunks and a token) */
  setenv("M3_SCAN_CHUNK_MIN_STATE", "1024", 1);
  const spec small[] = {
      {16, 16, 4, 2, 1.0, 1, M3_INPUT_FEATURES, M3_HEAD_MSE, 1, 2, 45},
      {16, 16, 2, 1, 0.5, 1, M3_INPUT_IDENTITY, M3_HEAD_NONE, 1, 3, 64},
  };
  for (int i = 0; i < (int)(sizeof small / sizeof small[0]); i++) {
    parity_case(ncases + i, &small[i], M3_PRECISION_F32);
    parity_case(ncases + i, &small[i], M3_PRECISION_BF16);
  }
  /* the small states' chunked backward (kernels/scan_small.cu) in 16-bit: with the chunked kernels off (M3_SCAN_SIMT)
   * a 16-bit window of more than one chunk at 16 x 16 takes it (f32 takes it in cases 5 and 16 too); G 2, every
   * column rotated, the mixer norm, a partial last chunk; then a window of ten chunks (600 tokens) */
  setenv("M3_SCAN_SIMT", "1", 1);
  const spec small_bwd[] = {
      {16, 16, 4, 2, 1.0, 1, M3_INPUT_FEATURES, M3_HEAD_MSE, 1, 2, 300},
      {16, 16, 2, 1, 0.5, 0, M3_INPUT_IDENTITY, M3_HEAD_NONE, 1, 1, 600},
  };
  const int nsmall = (int)(sizeof small / sizeof small[0]), nsmall_bwd = (int)(sizeof small_bwd / sizeof small_bwd[0]);
  for (int i = 0; i < nsmall_bwd; i++) {
    parity_case(ncases + nsmall + i, &small_bwd[i], M3_PRECISION_F32);
    parity_case(ncases + nsmall + i, &small_bwd[i], M3_PRECISION_BF16);
  }
  unsetenv("M3_SCAN_SIMT");
  setenv("M3_SCAN_CHUNK_MIN_STATE", "0", 1);
  /* 33 layers over two colsum chunks of positions: 67 norm weight column sums to finish, more than one
   * launch of m3k_colsum_finish takes (M3K_FINISH_JOBS) */
  const spec deep = {8, 16, 4, 1, 0.5, 0, M3_INPUT_IDENTITY, M3_HEAD_NONE, 1, 1, 300};
  m3_config deep_cfg = config_of(&deep);
  deep_cfg.n_layers = 33;
  const int deep_idx = ncases + nsmall + nsmall_bwd;
  parity_config(deep_idx, &deep, deep_cfg, M3_PRECISION_F32);
  parity_config(deep_idx, &deep, deep_cfg, M3_PRECISION_BF16);
  /* a vocabulary of 64: its rows move in whole 16-byte pieces, so the cross entropy stages each row in shared
   * memory (heads.cu, ce_launch); the vocabulary of 50 above reads it from global memory */
  const spec staged = {16, 16, 4, 1, 0.5, 0, M3_INPUT_TOKENS, M3_HEAD_LM, 1, 2, 100};
  m3_config staged_cfg = config_of(&staged);
  staged_cfg.vocab_size = 64;
  parity_config(deep_idx + 1, &staged, staged_cfg, M3_PRECISION_F32);
  parity_config(deep_idx + 1, &staged, staged_cfg, M3_PRECISION_BF16);
  const spec self[] = {
      {16, 16, 4, 1, 0.5, 1, M3_INPUT_FEATURES, M3_HEAD_NONE, 1, 2, 40},
      {16, 32, 4, 2, 1.0, 0, M3_INPUT_TOKENS, M3_HEAD_LM, 1, 2, 40},
      {8, 16, 4, 1, 0.5, 0, M3_INPUT_IDENTITY, M3_HEAD_MSE, 1, 3, 33},
      /* input and d_out of 1 MiB: both go through the copy stream and the step runs in two parts
       * (cuda_backend.c, step_splits); its smaller windows (changing shapes) do not */
      {16, 16, 16, 1, 0.5, 0, M3_INPUT_IDENTITY, M3_HEAD_NONE, 1, 4, 512},
  };
  for (int p = M3_PRECISION_F32; p <= M3_PRECISION_F16; p++)
    for (size_t i = 0; i < sizeof self / sizeof self[0]; i++) self_checks(&self[i], p);
  f16_overflow();
  limits();
  rows_past_grid(deep_idx + 2);
  return harness_finish("cuda_parity");
}

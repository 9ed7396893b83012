/*
 * test_stress_long.c — the float CPU model against the double one (same weights, same inputs,
 * same incoming state) on the stressed problem of stress.h (KERNELS.md §5.3 item 4): dd_dt over
 * [-10, 10], A at the floor, across it and large, lambda ~ 0 and ~ 1, angle steps up to ~33 rad a
 * token (the angle sum of a pair reaches ~1.4e5 rad), rope_fraction 1.0, P != N, G = 2, a random
 * incoming state carried in, row 1 restarting a third of the way in.
 *
 * How precise float can be here depends on the problem: a head at the floor (A = -1e-4) remembers
 * ~1e4 / dt tokens, so with dt ~ 1..10 its output mixes rotations ~1e4 rad apart, and one rounding
 * of dt (2^-24) already moves them by ~1e-3 rad. Every window is therefore also run through the
 * double model on inputs moved by one float rounding (x (1 + 2^-24 N(0, 1))): that run's distance
 * from the double one (the "baseline") is what the problem itself amplifies, and the float model
 * must stay within K_BASE = 3 times it or within a fixed tolerance, whichever is larger.
 *
 *   1. Forward of 2 rows x T = 16384, twice: "full" (every head's dd_dt over [-10, 10]) and "calm
 *      floor" (the two heads at the floor take dd_dt in [-10, -4], so they turn ~1e2 rad over the
 *      window; the others as before). Per variant, against the double model:
 *        out over the window: rel L2 <= max(1e-5 (SPEC.md §8), K_BASE x baseline);
 *        out in each block of 1024 positions: <= max(2e-5, K_BASE x the block's baseline);
 *        the error may not grow along the window: last block <= max(4 x first block, 2e-5,
 *        K_BASE x the last block's baseline);
 *        theta after every token (the saved angles), largest distance around the circle in each
 *        block: <= 4 x the block's baseline + 5e-5 rad, and last block <= 3 sqrt(16) x first (a
 *        random walk of roundings is allowed; a drift linear in t, the failure the f64 angle
 *        accumulation of mamba-rs was added for, is not: a step with pi one float step low is
 *        6e-4 rad off after 2048 tokens, an unwrapped float sum 1e-2 within the first 1024);
 *        final state (angle around the circle, ssm, k, v): <= max(1e-4, K_BASE x baseline).
 *   2. Forward + backward (d_out random) of 2 rows x 2048 for both variants, and of 2 rows x 16384
 *      for "full": every gradient tensor and dL/d input <= max(2e-4, K_BASE x baseline) (rel L2).
 *   3. The float and double builds share their source, so 1 and 2 cannot see a mistake in the math:
 *      the double backward against central differences at the stressed values (2 rows x 160, both
 *      variants; check_fd), per in_proj row of dd_dt, dd_A, trap and the angles, and per tensor.
 *
 * Why the fixed tolerances are above SPEC.md §8's on some quantities (measured here, seed below,
 * OpenBLAS, 2 threads; 4 more seeds in parentheses): with the floor heads calm the baseline is
 * ~2e-7 on out, but float's own roundings grow along the window (the floor heads' ssm state sums
 * all 16k tokens, and theta is a float of absolute precision ~2.4e-7 rad, whose rounding walks):
 * out 6e-7 in the first 1024 positions, 9.5e-6 (7e-6 .. 1e-5) in the last, 6e-6 over the window;
 * final ssm 2.8e-5 (up to 3.7e-5). Gradients of the 2048 window: up to 4.1e-5 (up to 9.6e-5:
 * in_proj's angle and dd_dt columns, dt_bias, the layer norm weight: the angle gradient sums over
 * the whole rest of the window). With the floor heads turning fast the baseline itself is ~3e-5
 * on out (4e-5 .. 5e-5 in the last blocks) and up to 3e-4 on gradients, and float stays within
 * ~1.8 times it (out, theta, states; up to 2.6 on a gradient tensor below the 2e-4 floor).
 *
 * Everything measured is printed (the per-block profiles too), so a change in precision shows.
 */
#include "cpu/model.h"
#include "stress.h"

enum { ROWS = 2, T_LONG = 16384, T_GRAD = 2048, T_FD = 160, BLOCK = 1024, NB = T_LONG / BLOCK };
static const double K_BASE = 3, TOL_OUT = 1e-5, TOL_OUT_BLOCK = 2e-5, GROWTH = 4, TOL_STATE = 1e-4, TOL_GRAD = 2e-4,
                    K_THETA = 4, THETA_ABS = 5e-5, FD_EPS = 1e-6, FD_TOL = 2e-5, FD_FLOOR = 0.1;

typedef struct fixture {
  m3_weights *w;
  const m3_dims *d;
  const m3_layout *lay;
  double *params_d, *grads_d;
  float *params_f, *grads_f;
} fixture;

static void fixture_make(fixture *f, int calm) {
  memset(f, 0, sizeof *f);
  const m3_config c = stress_config();
  CHECK_OK(m3_config_validate(&c));
  CHECK_OK(m3_weights_create(&c, &f->w));
  if (!f->w) return;
  CHECK_OK(stress_weights(f->w, 21, calm));
  f->d = &f->w->dims;
  f->lay = &f->w->layout;
  const long n = (long)f->lay->total;
  f->params_d = calloc((size_t)n, sizeof(double));
  f->grads_d = calloc((size_t)n, sizeof(double));
  f->params_f = calloc((size_t)n, sizeof(float));
  f->grads_f = calloc((size_t)n, sizeof(float));
  for (long i = 0; i < n; i++) {
    f->params_f[i] = f->w->arena[i];
    f->params_d[i] = f->w->arena[i];
  }
}

static void fixture_free(fixture *f) {
  m3_weights_destroy(f->w);
  free(f->params_d);
  free(f->grads_d);
  free(f->params_f);
  free(f->grads_f);
}

/* Elements of the state tensors of kind k (angle, ssm, k, v) for the model's one layer. */
static long state_n(const m3_dims *d, int k) {
  const long bh = (long)d->L * ROWS * d->H;
  const long per[4] = {bh * d->S, bh * d->P * d->N, bh * d->N, bh * d->P};
  return per[k];
}

/* A random incoming state (angles in [0, 2 pi)) as floats, for both models. */
static void random_state(const m3_dims *d, m3_rng *r, float *s[4]) {
  for (int k = 0; k < 4; k++) s[k] = calloc((size_t)state_n(d, k) + 1, sizeof(float));
  for (long i = 0; i < state_n(d, 0); i++) s[0][i] = (float)(m3_rng_uniform(r) * PI2);
  fill_normal_f(r, s[1], state_n(d, 1), 0.3);
  fill_normal_f(r, s[2], state_n(d, 2), 1.0);
  fill_normal_f(r, s[3], state_n(d, 3), 1.0);
}

/* The float and double models on one window (inputs made as floats, widened for the double one), and the double
 * model on the inputs moved by one float rounding: the baseline. */
typedef struct pair {
  cpu_model_f32 *mf;
  cpu_model_f64 *md, *mp; /* mp: the double model on inputs moved by ~one float rounding (the baseline) */
  float *in_f, *dout_f;
  double *in_d, *in_p, *dout_d;
  double *grads_p;
  uint8_t *resets;
  int32_t len;
} pair;

static void pair_make(pair *p, fixture *f, int32_t len, m3_rng *r, int want_dout) {
  memset(p, 0, sizeof *p);
  const m3_dims *d = f->d;
  const long M = (long)ROWS * len;
  p->len = len;
  CHECK_OK(cpu_model_create_f32(d, f->lay, ROWS, len, &p->mf));
  CHECK_OK(cpu_model_create_f64(d, f->lay, ROWS, len, &p->md));
  CHECK_OK(cpu_model_create_f64(d, f->lay, ROWS, len, &p->mp));
  p->grads_p = calloc((size_t)f->lay->total, sizeof(double));
  p->mp->params = f->params_d;
  p->mp->grads = p->grads_p;
  p->mf->params = f->params_f;
  p->mf->grads = f->grads_f;
  p->md->params = f->params_d;
  p->md->grads = f->grads_d;
  p->in_f = malloc((size_t)M * d->dm * sizeof(float));
  p->in_d = malloc((size_t)M * d->dm * sizeof(double));
  stress_input(r, p->in_f, M);
  p->in_p = malloc((size_t)M * d->dm * sizeof(double));
  for (long i = 0; i < M * d->dm; i++) {
    p->in_d[i] = p->in_f[i];
    p->in_p[i] = p->in_f[i] * (1 + ldexp(m3_rng_normal(r), -24));
  }
  if (want_dout) {
    p->dout_f = malloc((size_t)M * d->dm * sizeof(float));
    p->dout_d = malloc((size_t)M * d->dm * sizeof(double));
    fill_normal_f(r, p->dout_f, M * d->dm, 1.0);
    for (long i = 0; i < M * d->dm; i++) p->dout_d[i] = p->dout_f[i];
    p->mf->dinput = calloc((size_t)M * d->dm, sizeof(float));
    p->md->dinput = calloc((size_t)M * d->dm, sizeof(double));
    p->mp->dinput = calloc((size_t)M * d->dm, sizeof(double));
  }
  p->resets = calloc((size_t)M, 1);
  p->resets[(long)1 * len + len / 3] = 1; /* row 1 restarts a third of the way in */
  float *s[4];
  random_state(d, r, s);
  float *sf[4] = {p->mf->state.angle, p->mf->state.ssm, p->mf->state.k, p->mf->state.v};
  double *sd[4] = {p->md->state.angle, p->md->state.ssm, p->md->state.k, p->md->state.v};
  double *sp[4] = {p->mp->state.angle, p->mp->state.ssm, p->mp->state.k, p->mp->state.v};
  for (int k = 0; k < 4; k++) {
    for (long i = 0; i < state_n(d, k); i++) {
      sf[k][i] = s[k][i];
      sd[k][i] = s[k][i];
      sp[k][i] = s[k][i];
    }
    free(s[k]);
  }
}

static void pair_free(pair *p) {
  if (p->mf) free(p->mf->dinput);
  if (p->md) free(p->md->dinput);
  if (p->mp) free(p->mp->dinput);
  cpu_model_destroy_f32(p->mf);
  cpu_model_destroy_f64(p->md);
  cpu_model_destroy_f64(p->mp);
  free(p->grads_p);
  free(p->in_f);
  free(p->in_d);
  free(p->in_p);
  free(p->dout_f);
  free(p->dout_d);
  free(p->resets);
}

/* Forward (carried state, written back) of the three models; with backward, the head's d_out and the backward. */
static void pair_run(pair *p, int backward) {
  cpu_batch_f32 bf = {ROWS, p->len, p->in_f, NULL, NULL, NULL, NULL, p->dout_f, p->resets};
  cpu_batch_f64 bd = {ROWS, p->len, p->in_d, NULL, NULL, NULL, NULL, p->dout_d, p->resets};
  cpu_batch_f64 bp = {ROWS, p->len, p->in_p, NULL, NULL, NULL, NULL, p->dout_d, p->resets};
  CHECK_OK(cpu_model_forward_f32(p->mf, &bf, 1, 1));
  CHECK_OK(cpu_model_forward_f64(p->md, &bd, 1, 1));
  CHECK_OK(cpu_model_forward_f64(p->mp, &bp, 1, 1));
  if (!backward) return;
  cpu_head_result_f32 rf;
  cpu_head_result_f64 rd;
  CHECK_OK(cpu_model_head_f32(p->mf, &bf, 1, 1, &rf));
  CHECK_OK(cpu_model_head_f64(p->md, &bd, 1, 1, &rd));
  CHECK_OK(cpu_model_head_f64(p->mp, &bp, 1, 1, &rd));
  CHECK_OK(cpu_model_backward_f32(p->mf));
  CHECK_OK(cpu_model_backward_f64(p->md));
  CHECK_OK(cpu_model_backward_f64(p->mp));
}

/* rel L2 of positions [t0, t0 + n) of both rows of [ROWS, len, w] buffers; a is float (fa) or double (da). */
static double rel_rows(const float *fa, const double *da, const double *b, int32_t len, long w, int32_t t0, int32_t n) {
  double num = 0, den = 0;
  for (int r = 0; r < ROWS; r++)
    for (long i = ((long)r * len + t0) * w; i < ((long)r * len + t0 + n) * w; i++) {
      const double a = fa ? (double)fa[i] : da[i];
      num += (a - b[i]) * (a - b[i]);
      den += b[i] * b[i];
    }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Largest distance around the circle between the saved angles of positions [t0, t0 + n), both rows. */
static double angle_err(const float *fa, const double *da, const double *b, int32_t len, long w, int32_t t0,
                        int32_t n) {
  double worst = 0;
  for (int r = 0; r < ROWS; r++)
    for (long i = ((long)r * len + t0) * w; i < ((long)r * len + t0 + n) * w; i++) {
      double e = fmod(fabs((fa ? (double)fa[i] : da[i]) - b[i]), PI2);
      worst = fmax(worst, fmin(e, PI2 - e));
    }
  return worst;
}

/* rel L2 over n values (angle: each difference around the circle); a is float (fa) or double (da). */
static double rel_l2_any(const float *fa, const double *da, const double *b, long n, int angle) {
  double num = 0, den = 0;
  for (long i = 0; i < n; i++) {
    double e = (fa ? (double)fa[i] : da[i]) - b[i];
    if (angle) {
      e = fmod(fabs(e), PI2);
      e = fmin(e, PI2 - e);
    }
    num += e * e;
    den += b[i] * b[i];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* What the stressed window holds, from the double model's saved in_proj outputs: per head the ranges of dd_dt, dt, A
 * (and how many tokens sit at the floor), lambda; the largest angle step, how far one pair turns. */
static void print_ranges(const pair *p, const m3_dims *d) {
  const long M = (long)ROWS * p->len;
  const double *proj = p->md->proj;
  for (int h = 0; h < d->H; h++) {
    double dmin = 1e300, dmax = -1e300, tmin = 1e300, tmax = -1e300, amin = 1e300, amax = -1e300, lmin = 1, lmax = 0;
    long floor_n = 0;
    for (long i = 0; i < M; i++) {
      const double *row = proj + i * d->dip;
      const double v = row[d->dt_off + h] + p->md->params[p->md->lay->layer[0].dt_bias + h];
      const double dt = fmax(v, 0) + log1p(exp(-fabs(v)));
      const double a = row[d->A_off + h], fa = a >= 0 ? 1 + a : 1 / (1 - a);
      const double A = fmin(-fa, -d->a_floor), lam = 1 / (1 + exp(-row[d->trap_off + h]));
      floor_n += -fa > -d->a_floor;
      dmin = fmin(dmin, row[d->dt_off + h]);
      dmax = fmax(dmax, row[d->dt_off + h]);
      tmin = fmin(tmin, dt);
      tmax = fmax(tmax, dt);
      amin = fmin(amin, A);
      amax = fmax(amax, A);
      lmin = fmin(lmin, lam);
      lmax = fmax(lmax, lam);
    }
    printf("head %d: dd_dt [%.2f, %.2f] dt [%.2e, %.2f] A [%.3g, %.3g] (floor at %.1f%%) lambda [%.2e, %s%.2e]\n", h,
           dmin, dmax, tmin, tmax, amin, amax, 100.0 * floor_n / M, lmin, lmax > 0.5 ? "1 - " : "",
           lmax > 0.5 ? 1 - lmax : lmax);
  }
  double step = 0, total = 0;
  const double *th = p->md->ang_tanh;
  for (long i = 0; i < (long)p->len; i++) { /* row 0, head 3's dt (widest), pair 2 (always forward) */
    const double *row = proj + i * d->dip;
    const double v = row[d->dt_off + 3] + p->md->params[p->md->lay->layer[0].dt_bias + 3];
    const double dt = fmax(v, 0) + log1p(exp(-fabs(v)));
    for (int a = 0; a < d->S; a++) step = fmax(step, fabs(3.141592653589793 * th[i * d->S + a] * dt));
    total += 3.141592653589793 * th[i * d->S + 2] * dt;
  }
  printf("largest angle step %.1f rad; angle pair 2 of head 3, row 0 turns %.4g rad over the window\n", step, total);
}

/* Errors of one long window, per block of BLOCK positions and of the final state, for the float model or the
 * baseline (base: the double model on the moved inputs), both against the double model. */
typedef struct long_errs {
  double out, out_b[NB], y_b[NB], th_b[NB], state[4];
} long_errs;

static void long_errors(const pair *p, const m3_dims *d, int base, long_errs *e) {
  const cpu_model_f64 *ref = p->md;
  const float *F = NULL;
  const double *D = NULL;
  const long HS = (long)d->H * d->S;
  e->out = rel_rows(base ? NULL : p->mf->out, base ? p->mp->out : NULL, ref->out, T_LONG, d->dm, 0, T_LONG);
  for (int k = 0; k < NB; k++) {
    e->out_b[k] =
        rel_rows(base ? NULL : p->mf->out, base ? p->mp->out : NULL, ref->out, T_LONG, d->dm, k * BLOCK, BLOCK);
    e->y_b[k] = rel_rows(base ? NULL : p->mf->y, base ? p->mp->y : NULL, ref->y, T_LONG, d->E, k * BLOCK, BLOCK);
    e->th_b[k] =
        angle_err(base ? NULL : p->mf->theta, base ? p->mp->theta : NULL, ref->theta, T_LONG, HS, k * BLOCK, BLOCK);
  }
  const float *sf[4] = {p->mf->state.angle, p->mf->state.ssm, p->mf->state.k, p->mf->state.v};
  const double *sp[4] = {p->mp->state.angle, p->mp->state.ssm, p->mp->state.k, p->mp->state.v};
  const double *sd[4] = {ref->state.angle, ref->state.ssm, ref->state.k, ref->state.v};
  for (int k = 0; k < 4; k++) {
    F = base ? NULL : sf[k];
    D = base ? sp[k] : NULL;
    e->state[k] = rel_l2_any(F, D, sd[k], state_n(d, k), k == 0);
  }
}

static double worst_of(const double *x, int n) {
  double w = 0;
  for (int i = 0; i < n; i++) w = fmax(w, x[i]);
  return w;
}

static void print_errs(const char *tag, const long_errs *e) {
  printf(
      "  %s: out %.2e (first %d %.2e, last %d %.2e, worst block %.2e); scan y first %.2e last %.2e; theta max "
      "abs first %.2e last %.2e rad; final state angle %.2e ssm %.2e k %.2e v %.2e\n",
      tag, e->out, BLOCK, e->out_b[0], BLOCK, e->out_b[NB - 1], worst_of(e->out_b, NB), e->y_b[0], e->y_b[NB - 1],
      e->th_b[0], e->th_b[NB - 1], e->state[0], e->state[1], e->state[2], e->state[3]);
  printf("    out by block:");
  for (int k = 0; k < NB; k++) printf(" %.1e", e->out_b[k]);
  printf("\n    theta by block:");
  for (int k = 0; k < NB; k++) printf(" %.1e", e->th_b[k]);
  printf("\n");
}

static void check_long(const char *name, int calm, m3_rng *r) {
  fixture f;
  fixture_make(&f, calm);
  if (!f.w) return;
  const m3_dims *d = f.d;
  pair p;
  pair_make(&p, &f, T_LONG, r, 0);
  pair_run(&p, 0);
  printf("%s, %d rows x %d:\n", name, ROWS, T_LONG);
  print_ranges(&p, d);
  long_errs ef, ep;
  long_errors(&p, d, 0, &ef);
  long_errors(&p, d, 1, &ep);
  print_errs("f32 vs f64", &ef);
  print_errs("baseline (f64 on inputs moved by 2^-24) vs f64", &ep);
  CHECK(ef.out <= fmax(TOL_OUT, K_BASE * ep.out), "%s: out rel %.3g (baseline %.3g)", name, ef.out, ep.out);
  for (int k = 0; k < NB; k++) {
    CHECK(ef.out_b[k] <= fmax(TOL_OUT_BLOCK, K_BASE * ep.out_b[k]), "%s: out rel %.3g in [%d, %d) (baseline %.3g)",
          name, ef.out_b[k], k * BLOCK, (k + 1) * BLOCK, ep.out_b[k]);
    CHECK(ef.th_b[k] <= K_THETA * ep.th_b[k] + THETA_ABS, "%s: theta off by %.3g rad in [%d, %d) (baseline %.3g)", name,
          ef.th_b[k], k * BLOCK, (k + 1) * BLOCK, ep.th_b[k]);
  }
  CHECK(ef.out_b[NB - 1] <= fmax(fmax(GROWTH * ef.out_b[0], TOL_OUT_BLOCK), K_BASE * ep.out_b[NB - 1]),
        "%s: out error grows along the window: %.3g in the first %d positions, %.3g in the last", name, ef.out_b[0],
        BLOCK, ef.out_b[NB - 1]);
  CHECK(ef.th_b[NB - 1] <= 3 * sqrt((double)NB) * ef.th_b[0],
        "%s: theta error grows faster than a random walk: %.3g rad in the first %d positions, %.3g in the last", name,
        ef.th_b[0], BLOCK, ef.th_b[NB - 1]);
  static const char *const kinds[4] = {"angle", "ssm", "k", "v"};
  for (int k = 0; k < 4; k++)
    CHECK(ef.state[k] <= fmax(TOL_STATE, K_BASE * ep.state[k]), "%s: final state %s rel %.3g (baseline %.3g)", name,
          kinds[k], ef.state[k], ep.state[k]);
  pair_free(&p);
  fixture_free(&f);
}

static void check_grads(const char *name, int calm, m3_rng *r, int32_t len) {
  fixture f;
  fixture_make(&f, calm);
  if (!f.w) return;
  const m3_dims *d = f.d;
  pair p;
  pair_make(&p, &f, len, r, 1);
  pair_run(&p, 1);
  const double e_out = rel_rows(p.mf->out, NULL, p.md->out, len, d->dm, 0, len);
  const double b_out = rel_rows(NULL, p.mp->out, p.md->out, len, d->dm, 0, len);
  CHECK(e_out <= fmax(TOL_OUT, K_BASE * b_out), "%s T %d: out rel %.3g (baseline %.3g)", name, len, e_out, b_out);
  double worst = 0, worst_b = 0;
  const char *worst_name = "";
  for (int32_t i = 0; i < f.lay->n; i++) {
    const param_desc *t = &f.lay->t[i];
    const double e = rel_l2_f(f.grads_f + t->offset, f.grads_d + t->offset, t->numel);
    const double b = rel_l2(p.grads_p + t->offset, f.grads_d + t->offset, t->numel);
    CHECK(e <= fmax(TOL_GRAD, K_BASE * b), "%s T %d: grad %s rel %.3g (baseline %.3g)", name, len, t->name, e, b);
    if (e > worst) {
      worst = e;
      worst_b = b;
      worst_name = t->name;
    }
  }
  const long n = (long)ROWS * len * d->dm;
  const double e_in = rel_l2_f(p.mf->dinput, p.md->dinput, n), b_in = rel_l2(p.mp->dinput, p.md->dinput, n);
  CHECK(e_in <= fmax(TOL_GRAD, K_BASE * b_in), "%s T %d: dL/d input rel %.3g (baseline %.3g)", name, len, e_in, b_in);
  printf(
      "%s, %d rows x %d, f32 vs f64: out %.2e (baseline %.2e); worst gradient %s %.2e (baseline %.2e); dL/d input "
      "%.2e (baseline %.2e)\n",
      name, ROWS, len, e_out, b_out, worst_name, worst, worst_b, e_in, b_in);
  pair_free(&p);
  fixture_free(&f);
}

/* sum(out * d_out) of the double model's forward from the carried state, which stays as it was. */
static double fd_loss(pair *p) {
  cpu_batch_f64 bd = {ROWS, p->len, p->in_d, NULL, NULL, NULL, NULL, p->dout_d, p->resets};
  CHECK_OK(cpu_model_forward_f64(p->md, &bd, 1, 0));
  const long n = (long)ROWS * p->len * p->md->d->dm;
  double l = 0;
  for (long i = 0; i < n; i++) l += p->md->out[i] * p->dout_d[i];
  return l;
}

/* Central differences of the double model against its backward at the stressed values (the float vs double checks
 * cannot see a mistake the two builds share): the in_proj weights of each dd_dt, dd_A, trap and angle row on the five
 * channels that drive them (a group per row), FD_RANDOM random entries of every tensor and every dt_bias. Error of a
 * group: ||fd - backward|| / max(||backward||, FD_FLOOR) <= FD_TOL. The loss is ~1e2 and its differences carry a few
 * 1e-8 of noise (eps 1e-6, relative to the weight where it is above 1), so rows whose gradient is small (lambda ~ 0
 * or ~ 1: ~1e-6; dd_A across the floor; some ~1e-2) are held to 2e-6 absolute. */
static void check_fd(const char *name, int calm, m3_rng *r) {
  enum { FD_RANDOM = 6 };
  fixture f;
  fixture_make(&f, calm);
  if (!f.w) return;
  const m3_dims *d = f.d;
  /* hundreds of small forwards: one thread each (OpenMP teams of a busy machine's cores wait on one another) */
  const int32_t threads = m3_cpu_threads();
  CHECK_OK(m3_cpu_set_threads(1));
  pair p;
  pair_make(&p, &f, T_FD, r, 1);
  memset(f.grads_d, 0, (size_t)f.lay->total * sizeof(double));
  cpu_batch_f64 bd = {ROWS, T_FD, p.in_d, NULL, NULL, NULL, NULL, p.dout_d, p.resets};
  cpu_head_result_f64 res;
  CHECK_OK(cpu_model_forward_f64(p.md, &bd, 1, 0));
  CHECK_OK(cpu_model_head_f64(p.md, &bd, 1, 1, &res));
  CHECK_OK(cpu_model_backward_f64(p.md));
  const int64_t ip = f.lay->layer[0].in_proj;
  const int32_t ndriven = d->ang_off + d->S - d->dt_off; /* in_proj rows dd_dt .. angle, one group each */
  double worst = 0;
  int32_t nfd = 0;
  for (int32_t gi = 0; gi < ndriven + f.lay->n; gi++) {
    const param_desc *t = gi < ndriven ? NULL : &f.lay->t[gi - ndriven];
    int64_t idx[FD_RANDOM + 8];
    int n = 0;
    char what[96];
    if (!t) {
      const int32_t col = d->dt_off + gi;
      for (int ch = 0; ch <= 4; ch++) idx[n++] = ip + (int64_t)col * d->dm + ch;
      snprintf(what, sizeof what, "in_proj row %d (%s %d)", col,
               col < d->A_off      ? "dd_dt"
               : col < d->trap_off ? "dd_A"
               : col < d->ang_off  ? "trap"
                                   : "angle",
               col < d->ang_off ? (col - d->dt_off) % d->H : col - d->ang_off);
    } else {
      for (int k = 0; k < FD_RANDOM; k++) idx[n++] = t->offset + (int64_t)(m3_rng_next(r) % (uint64_t)t->numel);
      if (t->offset == f.lay->layer[0].dt_bias)
        for (int h = 0; h < d->H && n < FD_RANDOM + 8; h++) idx[n++] = t->offset + h;
      snprintf(what, sizeof what, "%s", t->name);
    }
    double num = 0, den = 0;
    for (int k = 0; k < n; k++) {
      double *x = f.params_d + idx[k];
      const double keep = *x, eps = FD_EPS * fmax(1, fabs(keep));
      *x = keep + eps;
      const double lp = fd_loss(&p);
      *x = keep - eps;
      const double lm = fd_loss(&p);
      *x = keep;
      const double fdv = (lp - lm) / (2 * eps), an = f.grads_d[idx[k]];
      num += (fdv - an) * (fdv - an);
      den += an * an;
      nfd++;
    }
    const double e = sqrt(num) / fmax(sqrt(den), FD_FLOOR);
    worst = fmax(worst, e);
    CHECK(e <= FD_TOL, "%s: %s: finite differences differ from the backward by %.3g", name, what, e);
  }
  printf("%s, %d rows x %d, f64 backward vs central differences: %d entries, worst group %.2e\n", name, ROWS, T_FD, nfd,
         worst);
  pair_free(&p);
  fixture_free(&f);
  CHECK_OK(m3_cpu_set_threads(threads));
}

int main(void) {
  m3_rng r;
  m3_rng_seed(&r, 16384);
  check_long("full", 0, &r);
  check_long("calm floor", 1, &r);
  check_grads("full", 0, &r, T_GRAD);
  check_grads("calm floor", 1, &r, T_GRAD);
  check_grads("full", 0, &r, T_LONG);
  check_fd("full", 0, &r);
  check_fd("calm floor", 1, &r);
  return harness_finish("stress_long");
}

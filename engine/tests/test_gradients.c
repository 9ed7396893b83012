/*
 * test_gradients.c — the CPU reference's backward against central finite differences in
 * double precision, for every parameter tensor and the input, over configs that cover
 * every input kind and head, outproj_norm, ngroups > 1, rope_fraction 0 / 0.5 / 1, odd
 * d_state, an active A floor, carried incoming state and resets; then the float build
 * against the double build on the same numbers.
 *
 * Loss: the head's loss ("lm", "mse") or sum(out * d_out) ("none"), as in ../shared/golden.
 */
#include "cpu/model.h"
#include "harness.h"
#include "layout.h"
#include "weights.h"

enum { FD_SAMPLES = 8 };
/* Relative error against the analytic gradient; below GRAD_FLOOR in norm the comparison is
 * absolute (central differences of an O(1) loss carry ~1e-11 of rounding). */
static const double FD_EPS = 1e-5, FD_TOL = 1e-6, GRAD_FLOOR = 1e-4;

typedef struct fd_case {
  const char *name;
  m3_config cfg;
  int32_t B, T;
  int carry;   /* random incoming state */
  int resets;  /* random resets (and one at t = 0 of row 0) */
} fd_case;

typedef struct problem {
  m3_dims d;
  m3_layout lay;
  cpu_model_f64 *m;
  double *params, *grads;
  double *input, *target_values, *d_out;
  int32_t *tokens, *targets;
  uint8_t *resets, *mask;
  cpu_batch_f64 batch;
} problem;

static m3_config base_config(void) {
  m3_config c;
  m3_config_defaults(&c);
  c.d_model = 8;
  c.n_layers = 2;
  c.d_state = 8;
  c.headdim = 4;
  return c;
}

/* Random but well-conditioned weights: the init, then every tensor nudged away from its
 * special values (ones, zeros) so no gradient vanishes by symmetry. */
static void random_params(problem *p, const m3_config *cfg, m3_rng *r) {
  m3_weights *w = NULL;
  m3_weights_create(cfg, &w);
  m3_weights_init(w, 7);
  for (int32_t i = 0; i < p->lay.n; i++) {
    const param_desc *t = &p->lay.t[i];
    for (int64_t j = 0; j < t->numel; j++) {
      double v = w->arena[t->offset + j];
      double jitter = t->init == INIT_UNIFORM || t->init == INIT_NORMAL ? 0.5 * v : 0.3 * m3_rng_normal(r);
      p->params[t->offset + j] = v + jitter;
    }
  }
  m3_weights_destroy(w);
}

static void setup(problem *p, const fd_case *c, m3_rng *r) {
  memset(p, 0, sizeof *p);
  m3_dims_from_config(&c->cfg, &p->d);
  m3_layout_build(&c->cfg, &p->lay);
  const m3_dims *d = &p->d;
  p->params = calloc((size_t)p->lay.total, sizeof(double));
  p->grads = calloc((size_t)p->lay.total, sizeof(double));
  random_params(p, &c->cfg, r);
  cpu_model_create_f64(d, &p->lay, c->B, c->T, &p->m);
  p->m->params = p->params;
  p->m->grads = p->grads;
  const long M = (long)c->B * c->T;
  p->m->dinput = calloc((size_t)(M * d->input_dim), sizeof(double));
  p->input = calloc((size_t)(M * d->input_dim), sizeof(double));
  fill_normal(r, p->input, M * d->input_dim, 1.0);
  p->tokens = calloc((size_t)M, sizeof(int32_t));
  p->targets = calloc((size_t)M, sizeof(int32_t));
  for (long i = 0; i < M; i++) {
    p->tokens[i] = d->vocab ? (int32_t)(m3_rng_next(r) % (uint64_t)d->vocab) : 0;
    p->targets[i] = d->vocab ? (m3_rng_uniform(r) < 0.2 ? -1 : (int32_t)(m3_rng_next(r) % (uint64_t)d->vocab)) : 0;
  }
  p->target_values = calloc((size_t)(M * (d->out_dim ? d->out_dim : 1)), sizeof(double));
  fill_normal(r, p->target_values, M * d->out_dim, 1.0);
  p->mask = calloc((size_t)M, 1);
  for (long i = 0; i < M; i++) p->mask[i] = m3_rng_uniform(r) < 0.7;
  p->d_out = calloc((size_t)(M * d->dm), sizeof(double));
  fill_normal(r, p->d_out, M * d->dm, 1.0);
  p->resets = calloc((size_t)M, 1);
  if (c->resets) {
    for (long i = 0; i < M; i++) p->resets[i] = m3_rng_uniform(r) < 0.1;
    p->resets[0] = 1;
  }
  if (c->carry) {
    const long lb = (long)d->L * c->B * d->H;
    for (long i = 0; i < lb * d->S; i++) p->m->state.angle[i] = 6.283 * m3_rng_uniform(r);
    fill_normal(r, p->m->state.ssm, lb * d->P * d->N, 0.5);
    fill_normal(r, p->m->state.k, lb * d->N, 1.0);
    fill_normal(r, p->m->state.v, lb * d->P, 1.0);
  }
  cpu_batch_f64 b = {c->B, c->T, p->input, p->tokens, p->targets, p->target_values,
                     d->head == M3_HEAD_MSE ? p->mask : NULL, p->d_out, c->resets ? p->resets : NULL};
  p->batch = b;
}

static void teardown(problem *p) {
  free(p->m->dinput); /* setup's, which the model does not own */
  cpu_model_destroy_f64(p->m);
  m3_layout_free(&p->lay);
  free(p->params);
  free(p->grads);
  free(p->input);
  free(p->tokens);
  free(p->targets);
  free(p->target_values);
  free(p->mask);
  free(p->d_out);
  free(p->resets);
}

static double loss_of(problem *p, int carry) {
  cpu_model_forward_f64(p->m, &p->batch, carry, 0);
  if (p->d.head == M3_HEAD_NONE) {
    double s = 0;
    const long n = (long)p->batch.rows * p->batch.len * p->d.dm;
    for (long i = 0; i < n; i++) s += p->m->out[i] * p->d_out[i];
    return s;
  }
  cpu_head_result_f64 res;
  cpu_model_head_f64(p->m, &p->batch, 1, 0, &res);
  return res.loss;
}

static void analytic(problem *p, int carry) {
  cpu_head_result_f64 res;
  memset(p->grads, 0, (size_t)p->lay.total * sizeof(double));
  CHECK_OK(cpu_model_forward_f64(p->m, &p->batch, carry, 0));
  CHECK_OK(cpu_model_head_f64(p->m, &p->batch, 1, 1, &res));
  CHECK_OK(cpu_model_backward_f64(p->m));
}

/* Central differences of FD_SAMPLES entries of x[0..n) against the analytic g. */
static double fd_error(problem *p, int carry, double *x, const double *g, long n, m3_rng *r, double *worst_fd,
                       double *worst_an) {
  double fd[FD_SAMPLES] = {0}, an[FD_SAMPLES] = {0};
  const int k = n < FD_SAMPLES ? (int)n : FD_SAMPLES;
  for (int s = 0; s < k; s++) {
    const long i = n <= FD_SAMPLES ? s : (long)(m3_rng_next(r) % (uint64_t)n);
    const double keep = x[i];
    x[i] = keep + FD_EPS;
    const double lp = loss_of(p, carry);
    x[i] = keep - FD_EPS;
    const double lm = loss_of(p, carry);
    x[i] = keep;
    fd[s] = (lp - lm) / (2 * FD_EPS);
    an[s] = g[i];
  }
  double num = 0, den = 0;
  for (int s = 0; s < k; s++) {
    num += (fd[s] - an[s]) * (fd[s] - an[s]);
    den += an[s] * an[s];
  }
  *worst_fd = fd[0];
  *worst_an = an[0];
  return sqrt(num) / fmax(sqrt(den), GRAD_FLOOR);
}

static void check_case(const fd_case *c, m3_rng *r) {
  problem p;
  setup(&p, c, r);
  analytic(&p, c->carry);
  double *g = malloc((size_t)p.lay.total * sizeof(double));
  memcpy(g, p.grads, (size_t)p.lay.total * sizeof(double));
  for (int32_t i = 0; i < p.lay.n; i++) {
    const param_desc *t = &p.lay.t[i];
    double fd0, an0;
    double e = fd_error(&p, c->carry, p.params + t->offset, g + t->offset, t->numel, r, &fd0, &an0);
    CHECK(e <= FD_TOL, "%s: %s: finite differences differ by %.3g (fd %.9g vs analytic %.9g)", c->name, t->name, e,
          fd0, an0);
  }
  if (p.d.input != M3_INPUT_TOKENS) {
    const long n = (long)c->B * c->T * p.d.input_dim;
    double *gin = malloc((size_t)n * sizeof(double));
    memcpy(gin, p.m->dinput, (size_t)n * sizeof(double));
    double fd0, an0;
    double e = fd_error(&p, c->carry, p.input, gin, n, r, &fd0, &an0);
    CHECK(e <= FD_TOL, "%s: input: finite differences differ by %.3g (fd %.9g vs analytic %.9g)", c->name, e, fd0,
          an0);
    free(gin);
  }
  free(g);
  teardown(&p);
}

/* The float build on the same numbers agrees with the double build (SPEC.md §8 f32). */
static void check_float_vs_double(const fd_case *c, m3_rng *r) {
  problem p;
  setup(&p, c, r);
  analytic(&p, c->carry);
  const m3_dims *d = &p.d;
  const long M = (long)c->B * c->T, total = p.lay.total;
  float *params = calloc((size_t)total, sizeof(float)), *grads = calloc((size_t)total, sizeof(float));
  for (long i = 0; i < total; i++) params[i] = (float)p.params[i];
  float *input = malloc((size_t)(M * d->input_dim) * sizeof(float));
  float *tv = malloc((size_t)(M * (d->out_dim ? d->out_dim : 1)) * sizeof(float));
  float *dout = malloc((size_t)(M * d->dm) * sizeof(float));
  for (long i = 0; i < M * d->input_dim; i++) input[i] = (float)p.input[i];
  for (long i = 0; i < M * d->out_dim; i++) tv[i] = (float)p.target_values[i];
  for (long i = 0; i < M * d->dm; i++) dout[i] = (float)p.d_out[i];
  cpu_model_f32 *mf = NULL;
  CHECK_OK(cpu_model_create_f32(d, &p.lay, c->B, c->T, &mf));
  mf->params = params;
  mf->grads = grads;
  const long lb = (long)d->L * c->B * d->H;
  for (long i = 0; i < lb * d->S; i++) mf->state.angle[i] = (float)p.m->state.angle[i];
  for (long i = 0; i < lb * d->P * d->N; i++) mf->state.ssm[i] = (float)p.m->state.ssm[i];
  for (long i = 0; i < lb * d->N; i++) mf->state.k[i] = (float)p.m->state.k[i];
  for (long i = 0; i < lb * d->P; i++) mf->state.v[i] = (float)p.m->state.v[i];
  cpu_batch_f32 b = {c->B, c->T, input, p.tokens, p.targets, tv, p.batch.mask, dout, p.batch.resets};
  cpu_head_result_f32 res;
  CHECK_OK(cpu_model_forward_f32(mf, &b, c->carry, 0));
  CHECK_OK(cpu_model_head_f32(mf, &b, 1, 1, &res));
  CHECK_OK(cpu_model_backward_f32(mf));
  const double e_out = rel_l2_f(mf->out, p.m->out, M * d->dm);
  CHECK(e_out <= 1e-5, "%s: float vs double out differ by %.3g", c->name, e_out);
  for (int32_t i = 0; i < p.lay.n; i++) {
    const param_desc *t = &p.lay.t[i];
    const double e = rel_l2_f(grads + t->offset, p.grads + t->offset, t->numel);
    CHECK(e <= 1e-4, "%s: float vs double grad %s differ by %.3g", c->name, t->name, e);
  }
  cpu_model_destroy_f32(mf);
  free(params);
  free(grads);
  free(input);
  free(tv);
  free(dout);
  teardown(&p);
}

int main(void) {
  m3_rng r;
  m3_rng_seed(&r, 2026);
  fd_case cases[6];
  int n = 0;

  fd_case c0 = {"features/none/carry/resets", base_config(), 2, 37, 1, 1};
  c0.cfg.input_dim = 5;
  cases[n++] = c0;

  fd_case c1 = {"identity/mse/outproj_norm/G2/rope1", base_config(), 2, 20, 0, 1};
  c1.cfg.input = M3_INPUT_IDENTITY;
  c1.cfg.head = M3_HEAD_MSE;
  c1.cfg.out_dim = 3;
  c1.cfg.outproj_norm = 1;
  c1.cfg.ngroups = 2;
  c1.cfg.d_state = 6;
  c1.cfg.rope_fraction = 1.0;
  cases[n++] = c1;

  fd_case c2 = {"tokens/lm-tied/rope0/a_floor/carry", base_config(), 3, 18, 1, 0};
  c2.cfg.input = M3_INPUT_TOKENS;
  c2.cfg.head = M3_HEAD_LM;
  c2.cfg.vocab_size = 11;
  c2.cfg.rope_fraction = 0;
  c2.cfg.a_floor = 0.5;
  cases[n++] = c2;

  fd_case c3 = {"tokens/lm-untied/odd-N/G2", base_config(), 2, 17, 1, 1};
  c3.cfg.d_model = 6;
  c3.cfg.headdim = 3;
  c3.cfg.ngroups = 2;
  c3.cfg.d_state = 5;
  c3.cfg.input = M3_INPUT_TOKENS;
  c3.cfg.head = M3_HEAD_LM;
  c3.cfg.tie_embeddings = 0;
  c3.cfg.vocab_size = 7;
  cases[n++] = c3;

  fd_case c4 = {"features/mse-nomask/expand1/1layer", base_config(), 1, 33, 0, 0};
  c4.cfg.expand = 1;
  c4.cfg.n_layers = 1;
  c4.cfg.input_dim = 3;
  c4.cfg.head = M3_HEAD_MSE;
  c4.cfg.out_dim = 2;
  cases[n++] = c4;

  fd_case c5 = {"features/lm-untied/outproj_norm/T1", base_config(), 3, 1, 1, 0};
  c5.cfg.input_dim = 4;
  c5.cfg.head = M3_HEAD_LM;
  c5.cfg.tie_embeddings = 0;
  c5.cfg.vocab_size = 5;
  c5.cfg.outproj_norm = 1;
  cases[n++] = c5;

  for (int i = 0; i < n; i++) {
    CHECK(m3_config_validate(&cases[i].cfg) == M3_OK, "%s: config invalid: %s", cases[i].name, m3_last_error());
    check_case(&cases[i], &r);
    check_float_vs_double(&cases[i], &r);
  }
  return harness_finish("gradients");
}

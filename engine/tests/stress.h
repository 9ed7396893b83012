/*
 * stress.h — the stressed long-window problem of KERNELS.md §5.3 item 4 (test_stress_long.c: the CPU's
 * float model against its double one; a CUDA counterpart is to use it too, kernels/NOTES.md run 319).
 *
 * Model: d_model 16, 1 layer, expand 2, headdim P 8, d_state N 16 (P != N), ngroups 2 (4 heads,
 * two a group), rope_fraction 1.0 (S = 8: every state column rotated), a_floor 1e-4, "identity"
 * input, "none" head.
 *
 * Input: position t of a row is g u, u = (3, c1, c2, c3, c4, w) with c_i uniform in [-1.5, 1.5] and
 * w a random direction of 11 values scaled so that sum(u^2) = 24 exactly, g = e^U(-1, 1) (RMSNorm
 * does not see it, but its roundings do: with one scale for all tokens they repeat, and float's
 * angles drift linearly). The layer's RMSNorm then gives xn = u / sqrt(1.5) (norm weight 1, up to
 * its 1e-5): a constant channel (2.449) and four uniform control channels in [-1.2247, 1.2247]. The
 * in_proj rows of the scalar columns read only those five channels, which puts each column exactly
 * on a chosen range (stress_col), uniformly:
 *
 *   head | dd_dt      | dd_A                         | trap
 *   0    | [-10, 10]  | [-2e5, -2e4]: A at the floor | [-20, 20]: lambda from ~0 to 1
 *   1    | [-10, 10]  | [-1.2e4, -8e3]: across the floor's edge (f = a_floor at dd_A = -9999)
 *        |            |                              | [-5, 5]
 *   2    | [-10, 10]  | [0, 50]: |A| up to 51        | [-25, -15]: lambda ~ 0
 *   3    | [-10, 10]  | [-10, 10]                    | [15, 25]: lambda ~ 1
 *
 * with dt_bias (-0.5, 0, 0.5, 0.25): dt = softplus(dd_dt + dt_bias) from ~3e-5 to ~10.5. Angle
 * logits of pairs 0..7 (shared by the heads): [-6, 6], [-6, 6], [2, 6] (every token turns it
 * forward: its angle sum reaches ~1.4e5 rad), [-0.5, 0.5], [-3, 3], [-6, -2], [-1, 1], [-6, 6];
 * so a token turns a pair by up to pi dt ~ 33 rad. Heads 0 and 1 (A = -1e-4 at the floor) remember
 * ~4000 tokens: their outputs mix rotations thousands of tokens apart. The other in_proj rows (z, x,
 * B, C) keep the init; B_bias, C_bias, B_norm, C_norm, D and norm_f are nudged off their init
 * (ones) by N(0, 0.3).
 */
#ifndef M3_TEST_STRESS_H
#define M3_TEST_STRESS_H

#include "harness.h"
#include "weights.h"

enum { STRESS_DM = 16 };

static inline m3_config stress_config(void) {
  m3_config c;
  m3_config_defaults(&c);
  c.d_model = STRESS_DM;
  c.n_layers = 1;
  c.d_state = 16;
  c.expand = 2;
  c.headdim = 8;
  c.ngroups = 2;
  c.rope_fraction = 1.0;
  c.a_floor = 1e-4;
  c.input = M3_INPUT_IDENTITY;
  c.head = M3_HEAD_NONE;
  return c;
}

/* xn's constant channel and the largest value of a control channel (see above). */
#define STRESS_XN0 (3.0 / 1.224744871391589)
#define STRESS_XNC 1.224744871391589

/* in_proj row `col` := a uniform spread over [lo, hi] driven by control channel ch (1..4), sign +-1. */
static inline void stress_col(m3_weights *w, int col, double lo, double hi, int ch, int sign) {
  float *row = w->arena + w->layout.layer[0].in_proj + (int64_t)col * w->dims.dm;
  for (int i = 0; i < w->dims.dm; i++) row[i] = 0;
  row[0] = (float)((lo + hi) / 2 / STRESS_XN0);
  row[ch] = (float)(sign * (hi - lo) / 2 / STRESS_XNC);
}

/* The init of `seed`, then the stress described above; with calm_floor, heads 0 and 1 (A at the floor)
 * take dd_dt in [-10, -4] instead (dt <= 0.02: their memory spans the whole window but turns through
 * ~1e2 rad, not ~1e5). */
static inline m3_status stress_weights(m3_weights *w, uint64_t seed, int calm_floor) {
  m3_status st = m3_weights_init(w, seed);
  if (st != M3_OK) return st;
  const m3_dims *d = &w->dims;
  const layer_offsets *lo = &w->layout.layer[0];
  m3_rng r;
  m3_rng_seed(&r, seed ^ 0x5eedULL);
  const int64_t nudge[] = {lo->B_bias, lo->C_bias, lo->B_norm, lo->C_norm, lo->D, w->layout.norm_f};
  const int64_t nudge_n[] = {(int64_t)d->H * d->N, (int64_t)d->H * d->N, d->N, d->N, d->H, d->dm};
  for (int k = 0; k < 6; k++)
    for (int64_t i = 0; i < nudge_n[k]; i++) w->arena[nudge[k] + i] += (float)(0.3 * m3_rng_normal(&r));
  static const double dt_bias[4] = {-0.5, 0, 0.5, 0.25};
  static const double dtr[4][2] = {{-10, 10}, {-10, 10}, {-10, 10}, {-10, 10}};
  static const double dtr_calm[4][2] = {{-10, -4}, {-10, -4}, {-10, 10}, {-10, 10}};
  static const int dtch[4][2] = {{1, 1}, {2, 1}, {1, -1}, {2, -1}};
  static const double Ar[4][2] = {{-2e5, -2e4}, {-1.2e4, -8e3}, {0, 50}, {-10, 10}};
  static const int Ach[4][2] = {{3, 1}, {3, -1}, {2, 1}, {4, 1}};
  static const double trr[4][2] = {{-20, 20}, {-5, 5}, {-25, -15}, {15, 25}};
  static const int trch[4][2] = {{4, 1}, {4, -1}, {3, 1}, {1, 1}};
  for (int h = 0; h < d->H && h < 4; h++) {
    w->arena[lo->dt_bias + h] = (float)dt_bias[h];
    const double *dr = calm_floor ? dtr_calm[h] : dtr[h];
    stress_col(w, d->dt_off + h, dr[0], dr[1], dtch[h][0], dtch[h][1]);
    stress_col(w, d->A_off + h, Ar[h][0], Ar[h][1], Ach[h][0], Ach[h][1]);
    stress_col(w, d->trap_off + h, trr[h][0], trr[h][1], trch[h][0], trch[h][1]);
  }
  static const double angr[8][2] = {{-6, 6}, {-6, 6}, {2, 6}, {-0.5, 0.5}, {-3, 3}, {-6, -2}, {-1, 1}, {-6, 6}};
  static const int angch[8][2] = {{1, 1}, {2, 1}, {3, 1}, {4, 1}, {3, -1}, {4, 1}, {1, -1}, {4, -1}};
  for (int a = 0; a < d->S && a < 8; a++)
    stress_col(w, d->ang_off + a, angr[a][0], angr[a][1], angch[a][0], angch[a][1]);
  return M3_OK;
}

/* n positions of the input described above, [n, 16]. */
static inline void stress_input(m3_rng *r, float *u, long n) {
  for (long t = 0; t < n; t++) {
    float *x = u + t * STRESS_DM;
    double used = 9;
    x[0] = 3;
    for (int i = 1; i <= 4; i++) {
      x[i] = (float)(3 * m3_rng_uniform(r) - 1.5);
      used += (double)x[i] * x[i];
    }
    double w[STRESS_DM], ww = 0;
    for (int i = 5; i < STRESS_DM; i++) {
      w[i] = m3_rng_normal(r);
      ww += w[i] * w[i];
    }
    const double s = sqrt((24 - used) / ww);
    for (int i = 5; i < STRESS_DM; i++) x[i] = (float)(w[i] * s);
    /* RMSNorm is blind to a token's scale (but for its 1e-5): a random one varies the roundings of rstd */
    const double g = exp(2 * m3_rng_uniform(r) - 1);
    for (int i = 0; i < STRESS_DM; i++) x[i] = (float)(x[i] * g);
  }
}

#endif

/*
 * scan.c — the Mamba-3 SISO recurrence of SPEC.md §3 steps 2-9 on the CPU, sequential in
 * time, one (row, head) pair per loop iteration (parallel and order-independent).
 *
 * Forward, per token t of head h (group g):
 *   dt = softplus(dd_dt + dt_bias), A = min(-f(dd_A), -a_floor), lam = sigmoid(trap)
 *   alpha = exp(A dt), beta = (1 - lam) dt alpha, gamma = lam dt
 *   theta_t = (theta_{t-1} + pi tanh(ang_t) dt) mod 2 pi
 *   k = rot(B_hat + B_bias[h], theta_t), q = rot(C_hat + C_bias[h], theta_t)
 *   H_t = alpha H_{t-1} + beta x_{t-1} k_{t-1}^T + gamma x_t k_t^T,  y = H_t q + D x_t
 * A reset at t zeroes H, k_prev, x_prev and theta before the token (SPEC.md §4).
 *
 * The forward saves the ssm state before every chunk of `chunk` tokens; the backward walks
 * chunks in reverse, recomputes the chunk's states from the saved one, and runs the exact
 * reverse recurrence (dH_{t-1} = alpha_t dH_t unless t is a reset; nothing flows into the
 * incoming state, but its terms still give alpha_0, beta_0 their gradients). Per-token
 * results go to dproj (x, dd_dt, dd_A, trap columns of head h: "="), dbc_head and
 * dang_head (per-head shares summed over heads later, in a fixed order); per-(row, head)
 * partials of dt_bias, D, B_bias, C_bias go to m->part.
 */
#include <omp.h>
#include <string.h>

#include "real.h"
#include "../threads.h"
#include "parts.h"

#define PI_R ((real)3.14159265358979323846)
#define TWO_PI_R ((real)6.28318530717958647692)

typedef struct tok {
  real dt, A, lam, alpha, beta, gamma;
  real dsoftplus; /* d dt / d dd_dt = sigmoid(dd_dt + dt_bias) */
  real dA_ddA;    /* d A / d dd_A: -f'(dd_A), or 0 where the floor clamps */
} tok;

static void token_scalars(const m3_dims *d, const real *prow, int32_t h, real dt_bias, tok *s) {
  real v = prow[d->dt_off + h] + dt_bias;
  real av = v < 0 ? -v : v;
  s->dt = (v > 0 ? v : 0) + R_LOG1P(R_EXP(-av));
  s->dsoftplus = 1 / (1 + R_EXP(-v));
  real a = prow[d->A_off + h];
  real f = a >= 0 ? 1 + a : 1 / (1 - a);
  real fp = a >= 0 ? 1 : 1 / ((1 - a) * (1 - a));
  real floor_ = (real)d->a_floor;
  if (-f <= -floor_) {
    s->A = -f;
    s->dA_ddA = -fp;
  } else {
    s->A = -floor_;
    s->dA_ddA = 0;
  }
  s->lam = 1 / (1 + R_EXP(-prow[d->trap_off + h]));
  s->alpha = R_EXP(s->A * s->dt);
  s->beta = (1 - s->lam) * s->dt * s->alpha;
  s->gamma = s->lam * s->dt;
}

static real wrap_angle(real v) {
  v = R_FMOD(v, TWO_PI_R);
  if (v < 0) v += TWO_PI_R;
  if (v >= TWO_PI_R) v -= TWO_PI_R;
  return v;
}

/* cs[2a], cs[2a+1] = cos, sin of theta[a] for a < S. */
static void sincos_of(const real *theta, int32_t S, real *cs) {
  for (int32_t a = 0; a < S; a++) {
    cs[2 * a] = R_COS(theta[a]);
    cs[2 * a + 1] = R_SIN(theta[a]);
  }
}

/* out = rot(base + bias): pairs (2a, 2a+1) for a < S rotate by cs[a], the rest pass. */
static void rotate(const real *base, const real *bias, const real *cs, int32_t N, int32_t S, real *out) {
  for (int32_t a = 0; a < S; a++) {
    const real u0 = base[2 * a] + bias[2 * a], u1 = base[2 * a + 1] + bias[2 * a + 1];
    const real c = cs[2 * a], s = cs[2 * a + 1];
    out[2 * a] = u0 * c - u1 * s;
    out[2 * a + 1] = u0 * s + u1 * c;
  }
  for (int32_t i = 2 * S; i < N; i++) out[i] = base[i] + bias[i];
}

/* Strides of the per-layer saved buffers (capacity based, so layer offsets are fixed). */
static int64_t cap_m(const cpu_model *m) { return m->cap; }
static int32_t n_chunks(const cpu_model *m) { return (m->T + m->chunk - 1) / m->chunk; }
/* Threads of the (row, head) walks: each token updates the P x N state a few times over. */
static int scan_threads(const cpu_model *m) {
  const int64_t walks = (int64_t)m->rows * m->d->H;
  return loop_threads(walks, walks * m->len * m->d->P * m->d->N * 8, m->threads);
}

/* Per-thread scratch of the backward (the forward needs less): chunk states, dH, and per
 * token k, q, cos/sin and scalars for the whole window, plus a few vectors. */
int64_t NAME(cpu_scan_scratch)(const m3_dims *d, int32_t T, int32_t chunk) {
  const int64_t PN = (int64_t)d->P * d->N, tok_reals = sizeof(tok) / sizeof(real);
  return PN * (chunk + 2) + (int64_t)T * (2 * d->N + 2 * d->S + tok_reals) + 8 * (int64_t)(d->P + d->N) +
         2 * d->S + 64;
}

/* Offsets of one (layer, row, head) inside the batch-first state tensors. */
static void state_ptrs(const cpu_model *m, const cpu_state *s, int32_t layer, int32_t b, int32_t h, real **angle,
                       real **ssm, real **k, real **v) {
  const m3_dims *d = m->d;
  int64_t lb = (int64_t)layer * m->B + b;
  *angle = s->angle + (lb * d->H + h) * d->S;
  *ssm = s->ssm + (lb * d->H + h) * (int64_t)d->P * d->N;
  *k = s->k + (lb * d->H + h) * d->N;
  *v = s->v + (lb * d->H + h) * d->P;
}

void NAME(cpu_scan_forward)(cpu_model *m, int32_t layer, const uint8_t *resets, const cpu_state *in,
                            const cpu_state *fin) {
  const m3_dims *d = m->d;
  const int32_t rows = m->rows, len = m->len, P = d->P, N = d->N, S = d->S, H = d->H;
  const int64_t PN = (int64_t)P * N, M0 = cap_m(m);
  const layer_offsets *lo = &m->lay->layer[layer];
  const int64_t sl = NAME(cpu_slot)(m, layer);
  const real *proj = m->proj + sl * M0 * d->dip;
  const real *bc_hat = m->bc_hat + sl * M0 * 2 * d->G * N;
  const real *ang_tanh = m->ang_tanh + sl * M0 * S;
  real *theta_out = m->theta + sl * M0 * H * S;
  real *y_out = m->y + sl * M0 * d->E;
  const real *dt_bias = m->params + lo->dt_bias, *Dp = m->params + lo->D;
  const real *Bb = m->params + lo->B_bias, *Cb = m->params + lo->C_bias;
  const int32_t nch = n_chunks(m);

#pragma omp parallel for schedule(static) num_threads(scan_threads(m))
  for (int32_t bh = 0; bh < rows * H; bh++) {
    const int32_t b = bh / H, h = bh % H, g = h / d->heads_per_group;
    real *sc = m->scratch + (int64_t)omp_get_thread_num() * m->scratch_per_thread;
    real *Hs = sc, *kprev = Hs + PN, *xprev = kprev + N, *kcur = xprev + P, *qcur = kcur + N, *th = qcur + N,
         *cs = th + S;
    real *in_angle, *in_ssm, *in_k, *in_v;
    state_ptrs(m, in, layer, b, h, &in_angle, &in_ssm, &in_k, &in_v);
    memcpy(Hs, in_ssm, (size_t)PN * sizeof(real));
    memcpy(kprev, in_k, (size_t)N * sizeof(real));
    memcpy(xprev, in_v, (size_t)P * sizeof(real));
    memcpy(th, in_angle, (size_t)S * sizeof(real));
    real *chunk_ssm = m->chunk_ssm ? m->chunk_ssm + ((layer * (int64_t)m->B + b) * H + h) * nch * PN : NULL;
    const real *x = NULL;
    for (int32_t t = 0; t < len; t++) {
      const int64_t mi = (int64_t)b * len + t;
      const real *prow = proj + mi * d->dip;
      if (resets && resets[mi]) {
        memset(Hs, 0, (size_t)PN * sizeof(real));
        memset(kprev, 0, (size_t)N * sizeof(real));
        memset(xprev, 0, (size_t)P * sizeof(real));
        memset(th, 0, (size_t)S * sizeof(real));
      }
      if (chunk_ssm && t % m->chunk == 0) memcpy(chunk_ssm + (int64_t)(t / m->chunk) * PN, Hs, (size_t)PN * sizeof(real));
      tok s;
      token_scalars(d, prow, h, dt_bias[h], &s);
      real *th_out = theta_out + (mi * H + h) * S;
      for (int32_t a = 0; a < S; a++) {
        th[a] = wrap_angle(th[a] + PI_R * ang_tanh[mi * S + a] * s.dt);
        th_out[a] = th[a];
      }
      sincos_of(th, S, cs);
      rotate(bc_hat + (mi * 2 + 0) * d->G * N + (int64_t)g * N, Bb + (int64_t)h * N, cs, N, S, kcur);
      rotate(bc_hat + (mi * 2 + 1) * d->G * N + (int64_t)g * N, Cb + (int64_t)h * N, cs, N, S, qcur);
      x = prow + d->x_off + (int64_t)h * P;
      real *y = y_out + mi * d->E + (int64_t)h * P;
      for (int32_t p = 0; p < P; p++) {
        real *row = Hs + (int64_t)p * N;
        const real bx = s.beta * xprev[p], gx = s.gamma * x[p];
        real acc = 0;
#pragma omp simd reduction(+ : acc)
        for (int32_t n = 0; n < N; n++) {
          row[n] = s.alpha * row[n] + bx * kprev[n] + gx * kcur[n];
          acc += row[n] * qcur[n];
        }
        y[p] = acc + Dp[h] * x[p];
      }
      memcpy(kprev, kcur, (size_t)N * sizeof(real));
      memcpy(xprev, x, (size_t)P * sizeof(real));
    }
    if (fin) {
      real *f_angle, *f_ssm, *f_k, *f_v;
      state_ptrs(m, fin, layer, b, h, &f_angle, &f_ssm, &f_k, &f_v);
      memcpy(f_ssm, Hs, (size_t)PN * sizeof(real));
      memcpy(f_k, kprev, (size_t)N * sizeof(real));
      memcpy(f_v, xprev, (size_t)P * sizeof(real));
      memcpy(f_angle, th, (size_t)S * sizeof(real));
    }
  }
}

void NAME(cpu_scan_backward)(cpu_model *m, int32_t layer, const uint8_t *resets) {
  const m3_dims *d = m->d;
  const int32_t rows = m->rows, len = m->len, P = d->P, N = d->N, S = d->S, H = d->H;
  const int64_t PN = (int64_t)P * N, M0 = cap_m(m);
  const layer_offsets *lo = &m->lay->layer[layer];
  const real *proj = m->proj + layer * M0 * d->dip;
  const real *bc_hat = m->bc_hat + layer * M0 * 2 * d->G * N;
  const real *ang_tanh = m->ang_tanh + layer * M0 * S;
  const real *theta = m->theta + layer * M0 * H * S;
  const real *dt_bias = m->params + lo->dt_bias, *Dp = m->params + lo->D;
  const real *Bb = m->params + lo->B_bias, *Cb = m->params + lo->C_bias;
  const int32_t nch = n_chunks(m);

#pragma omp parallel for schedule(static) num_threads(scan_threads(m))
  for (int32_t bh = 0; bh < rows * H; bh++) {
    const int32_t b = bh / H, h = bh % H, g = h / d->heads_per_group;
    real *sc = m->scratch + (int64_t)omp_get_thread_num() * m->scratch_per_thread;
    real *Hc = sc;                            /* [chunk, P, N] states of the current chunk */
    real *dH = Hc + (int64_t)m->chunk * PN;   /* [P, N] */
    real *k_all = dH + PN;                    /* [len, N] */
    real *q_all = k_all + (int64_t)len * N;   /* [len, N] */
    real *cs_all = q_all + (int64_t)len * N;  /* [len, 2S] */
    tok *toks = (tok *)(cs_all + (int64_t)len * 2 * S); /* [len] */
    real *zero = (real *)(toks + len);        /* [P + N] zeros */
    real *dxc = zero + P + N, *dkc = dxc + P, *dHk = dkc + N, *dHkp = dHk + P, *dHtx = dHkp + P,
         *dHtxp = dHtx + N, *dq = dHtxp + N, *dk = dq + N, *Dth = dk + N;
    memset(zero, 0, (size_t)(P + N) * sizeof(real));
    memset(dH, 0, (size_t)PN * sizeof(real));
    memset(dxc, 0, (size_t)P * sizeof(real));
    memset(dkc, 0, (size_t)N * sizeof(real));
    memset(Dth, 0, (size_t)S * sizeof(real));

    for (int32_t t = 0; t < len; t++) {
      const int64_t mi = (int64_t)b * len + t;
      real *cs = cs_all + (int64_t)t * 2 * S;
      token_scalars(d, proj + mi * d->dip, h, dt_bias[h], &toks[t]);
      sincos_of(theta + (mi * H + h) * S, S, cs);
      rotate(bc_hat + (mi * 2 + 0) * d->G * N + (int64_t)g * N, Bb + (int64_t)h * N, cs, N, S, k_all + (int64_t)t * N);
      rotate(bc_hat + (mi * 2 + 1) * d->G * N + (int64_t)g * N, Cb + (int64_t)h * N, cs, N, S, q_all + (int64_t)t * N);
    }
    real *in_angle, *in_ssm, *in_k, *in_v;
    state_ptrs(m, &m->incoming, layer, b, h, &in_angle, &in_ssm, &in_k, &in_v);
    const real *chunk_ssm = m->chunk_ssm + ((layer * (int64_t)m->B + b) * H + h) * nch * PN;
    real *part = m->part + (int64_t)b * m->part_width + (int64_t)h * scan_part_stride(d);
    real *p_dtb = part + SCAN_PART_DT_BIAS, *p_D = part + SCAN_PART_D, *p_Bb = part + SCAN_PART_BIAS,
         *p_Cb = p_Bb + N;
    real carry = 0; /* alpha of token t+1, or 0 at the window end and where t+1 is a reset */

    for (int32_t c = (len + m->chunk - 1) / m->chunk - 1; c >= 0; c--) {
      const int32_t t0 = c * m->chunk, t1 = t0 + m->chunk < len ? t0 + m->chunk : len;
      /* recompute the chunk's states */
      for (int32_t t = t0; t < t1; t++) {
        const int64_t mi = (int64_t)b * len + t;
        const tok *s = &toks[t];
        const int reset = resets && resets[mi];
        const real *Hp = t == t0 ? chunk_ssm + (int64_t)c * PN : Hc + (int64_t)(t - t0 - 1) * PN;
        const real *xp = reset ? zero : t == 0 ? in_v : proj + (mi - 1) * d->dip + d->x_off + (int64_t)h * P;
        const real *kp = reset ? zero : t == 0 ? in_k : k_all + (int64_t)(t - 1) * N;
        const real *x = proj + mi * d->dip + d->x_off + (int64_t)h * P, *k = k_all + (int64_t)t * N;
        real *Ht = Hc + (int64_t)(t - t0) * PN;
        const real a_ = (reset && t > t0) ? 0 : s->alpha; /* at t0 the saved state is already reset */
        for (int32_t p = 0; p < P; p++) {
          const real bx = s->beta * xp[p], gx = s->gamma * x[p];
          for (int32_t n = 0; n < N; n++)
            Ht[(int64_t)p * N + n] = a_ * Hp[(int64_t)p * N + n] + bx * kp[n] + gx * k[n];
        }
      }
      /* reverse through the chunk */
      for (int32_t t = t1 - 1; t >= t0; t--) {
        const int64_t mi = (int64_t)b * len + t;
        const real *prow = proj + mi * d->dip;
        real *drow = m->dproj + mi * d->dip;
        const int reset = resets && resets[mi];
        const tok *s = &toks[t];
        const real *Ht = Hc + (int64_t)(t - t0) * PN;
        const real *Hp = reset ? NULL : t == t0 ? chunk_ssm + (int64_t)c * PN : Hc + (int64_t)(t - t0 - 1) * PN;
        const real *xp = reset ? zero : t == 0 ? in_v : proj + (mi - 1) * d->dip + d->x_off + (int64_t)h * P;
        const real *kp = reset ? zero : t == 0 ? in_k : k_all + (int64_t)(t - 1) * N;
        const real *x = prow + d->x_off + (int64_t)h * P;
        const real *k = k_all + (int64_t)t * N, *q = q_all + (int64_t)t * N;
        const real *dy = m->dy + mi * d->E + (int64_t)h * P;

        /* dH_t = carry dH_{t+1} + dy q^T, and every contraction of it this token needs */
        memset(dq, 0, (size_t)N * sizeof(real));
        memset(dHtx, 0, (size_t)N * sizeof(real));
        memset(dHtxp, 0, (size_t)N * sizeof(real));
        real dalpha = 0;
        for (int32_t p = 0; p < P; p++) {
          real *dHr = dH + (int64_t)p * N;
          const real *Htr = Ht + (int64_t)p * N, *Hpr = Hp ? Hp + (int64_t)p * N : zero;
          const real dyp = dy[p], xpp = xp[p], xq = x[p];
          real hk = 0, hkp = 0, ha = 0;
#pragma omp simd reduction(+ : hk, hkp, ha)
          for (int32_t n = 0; n < N; n++) {
            const real g_ = carry * dHr[n] + dyp * q[n];
            dHr[n] = g_;
            dq[n] += Htr[n] * dyp;
            dHtx[n] += g_ * xq;
            dHtxp[n] += g_ * xpp;
            hk += g_ * k[n];
            hkp += g_ * kp[n];
            ha += g_ * Hpr[n];
          }
          dHk[p] = hk;
          dHkp[p] = hkp;
          dalpha += ha;
        }
        real dgamma = 0, dbeta = 0, dDh = 0;
        for (int32_t p = 0; p < P; p++) {
          dgamma += x[p] * dHk[p];
          dbeta += xp[p] * dHkp[p];
          dDh += dy[p] * x[p];
          drow[d->x_off + (int64_t)h * P + p] = dxc[p] + Dp[h] * dy[p] + s->gamma * dHk[p];
          dxc[p] = s->beta * dHkp[p];
        }
        for (int32_t n = 0; n < N; n++) {
          dk[n] = dkc[n] + s->gamma * dHtx[n];
          dkc[n] = s->beta * dHtxp[n];
        }
        *p_D += dDh;

        /* rotation backward: d theta from k and q, then un-rotate into the biased B/C */
        const real *cs = cs_all + (int64_t)t * 2 * S;
        real *dkb = m->dbc_head + (mi * H + h) * 2 * N, *dqb = dkb + N;
        real *dang = m->dang_head + (mi * H + h) * S;
        real ddt_angle = 0;
        for (int32_t a = 0; a < S; a++) {
          const real c_ = cs[2 * a], s_ = cs[2 * a + 1];
          const real dk0 = dk[2 * a], dk1 = dk[2 * a + 1], dq0 = dq[2 * a], dq1 = dq[2 * a + 1];
          const real dth = -dk0 * k[2 * a + 1] + dk1 * k[2 * a] - dq0 * q[2 * a + 1] + dq1 * q[2 * a];
          dkb[2 * a] = c_ * dk0 + s_ * dk1;
          dkb[2 * a + 1] = -s_ * dk0 + c_ * dk1;
          dqb[2 * a] = c_ * dq0 + s_ * dq1;
          dqb[2 * a + 1] = -s_ * dq0 + c_ * dq1;
          Dth[a] += dth;
          const real ta = ang_tanh[mi * S + a];
          ddt_angle += PI_R * Dth[a] * ta;
          dang[a] = PI_R * Dth[a] * s->dt * (1 - ta * ta);
        }
        for (int32_t i = 2 * S; i < N; i++) {
          dkb[i] = dk[i];
          dqb[i] = dq[i];
        }
        for (int32_t n = 0; n < N; n++) {
          p_Bb[n] += dkb[n];
          p_Cb[n] += dqb[n];
        }
        if (reset) memset(Dth, 0, (size_t)S * sizeof(real));

        /* scalar chain: alpha, beta, gamma -> dt, A, lam -> dd_dt, dd_A, trap */
        const real dalpha_all = dalpha + dbeta * (1 - s->lam) * s->dt;
        const real ddt = dalpha_all * s->alpha * s->A + dbeta * (1 - s->lam) * s->alpha + dgamma * s->lam + ddt_angle;
        const real dA = dalpha_all * s->alpha * s->dt;
        const real dlam = -dbeta * s->dt * s->alpha + dgamma * s->dt;
        const real dv = ddt * s->dsoftplus;
        drow[d->dt_off + h] = dv;
        drow[d->A_off + h] = dA * s->dA_ddA;
        drow[d->trap_off + h] = dlam * s->lam * (1 - s->lam);
        *p_dtb += dv;
        carry = reset ? 0 : s->alpha;
      }
    }
  }
}

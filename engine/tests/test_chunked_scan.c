/*
 * test_chunked_scan.c — the chunked form of the SSM core (kernels/scan_chunked.cu) in float64,
 * checked against the sequential recurrence of SPEC.md §3 step 9 / §4 before any GPU runs it.
 *
 * The core, per head, with per-token log decay a_t = A_t dt_t, gamma_t = lam_t dt_t,
 * bp_t = (1 - lam_t) dt_t (beta without alpha) and rotated q_t, k_t (N), x_t (P):
 *   sequential: H_t = e^{a_t} (H_{t-1} + bp_t x_{t-1} k_{t-1}^T) + gamma_t x_t k_t^T,  y_t = H_t q_t,
 *               a reset at t zeroes H_{t-1} and x_{t-1}, k_{t-1} first; (H_in, v_in, k_in) enter at t = 0.
 *   chunked (Q tokens per chunk, c_t = chunk-local inclusive cumsum of a, seg_t = local index of
 *   the last reset <= t or -1, scale_s = gamma_s + bp_{s+1} [s+1 < T, no reset at s+1]):
 *     E_0 = H_in + bp_0 v_in k_in^T (0 with a reset at 0)
 *     y_t = [seg_t < 0] e^{c_t} E q_t + sum_{seg_t <= s < t} e^{c_t - c_s} scale_s (q_t.k_s) x_s + gamma_t (q_t.k_t) x_t
 *     E'  = [seg_last < 0] e^{c_last} E + sum_{s >= seg_last} e^{c_last - c_s} scale_s x_s k_s^T
 *   backward (reverse chunk walk, dE = gradient of the state leaving the chunk), ktil = scale k,
 *   L_ts = e^{c_t - c_s} on valid pairs s < t, S1 = q ktil^T, S2 = dY x^T, W_s = e^{c_last - c_s}[s >= seg_last]:
 *     dq_t   = [seg_t<0] e^{c_t} E^T dY_t + sum_s L_ts S2_ts ktil_s + gamma_t S2_tt k_t
 *     dktil_s = sum_t L_ts S2_ts q_t + W_s dE^T x_s;   dk_s = scale_s dktil_s + gamma_s S2_ss q_s
 *     dx_s   = sum_t L_ts S1_ts dY_t + W_s dE ktil_s + gamma_s (q_s.k_s) dY_s
 *     dscale_s = dktil_s . k_s -> dgamma_s (+ S2_ss q_s.k_s), dbp_{s+1}
 *     dc_t = r_t + rowsum_t(M) - colsum_t(M) - v_t, + [t = last] ([seg_last<0] e^{c_last} <dE, E> + sum_s v_s),
 *       M_ts = L_ts S1_ts S2_ts, r_t = [seg_t<0] e^{c_t} q_t . (E^T dY_t), v_s = W_s ktil_s . (dE^T x_s)
 *     da_t = sum_{u >= t in chunk} dc_u (0 at a reset);   dE <- [seg_last<0] e^{c_last} dE + sum_t [seg_t<0] e^{c_t} dY_t q_t^T
 *     at the end dbp_0 += v_in^T dE k_in (no reset at 0).
 * The test compares the chunked outputs with the sequential ones and the chunked gradients with
 * central finite differences of the sequential loss sum_t dY_t.y_t + <dH, H_final>, for several
 * chunk sizes, window lengths (partial last chunk), resets (at 0, mid-chunk, at chunk starts) and
 * nonzero incoming state.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fails, checks;
#define CHK(c, ...)              \
  do {                           \
    checks++;                    \
    if (!(c)) {                  \
      fails++;                   \
      printf("FAIL: ");          \
      printf(__VA_ARGS__);       \
      printf("\n");              \
    }                            \
  } while (0)

static uint64_t rs = 88172645463325252ull;
static double urand(void) {
  rs ^= rs << 13;
  rs ^= rs >> 7;
  rs ^= rs << 17;
  return (double)(rs >> 11) / 9007199254740992.0;
}
static double nrand(void) { return sqrt(-2 * log(urand() + 1e-300)) * cos(6.283185307179586 * urand()); }

typedef struct prob {
  int T, P, N;
  double *q, *k, *x;      /* [T][N], [T][N], [T][P] */
  double *a, *gam, *bp;   /* [T] */
  int *rst;               /* [T] */
  double *Hin, *vin, *kin; /* [P][N], [P], [N] */
  double *dY, *dH;        /* [T][P], [P][N] */
} prob;

/* the loss of the sequential recurrence */
static double seq_loss(const prob *p, double *y_out, double *H_out) {
  const int P = p->P, N = p->N;
  double *H = malloc(sizeof(double) * P * N);
  memcpy(H, p->Hin, sizeof(double) * P * N);
  const double *xp = p->vin, *kp = p->kin;
  double loss = 0;
  for (int t = 0; t < p->T; t++) {
    const double *xt = p->x + t * P, *kt = p->k + t * N, *qt = p->q + t * N;
    const double al = exp(p->a[t]);
    for (int i = 0; i < P; i++)
      for (int n = 0; n < N; n++) {
        double h = p->rst[t] ? 0 : H[i * N + n] + p->bp[t] * xp[i] * kp[n];
        H[i * N + n] = al * h + p->gam[t] * xt[i] * kt[n];
      }
    for (int i = 0; i < P; i++) {
      double y = 0;
      for (int n = 0; n < N; n++) y += H[i * N + n] * qt[n];
      if (y_out) y_out[t * P + i] = y;
      loss += y * p->dY[t * P + i];
    }
    xp = xt;
    kp = kt;
  }
  for (int i = 0; i < P * N; i++) loss += H[i] * p->dH[i];
  if (H_out) memcpy(H_out, H, sizeof(double) * P * N);
  free(H);
  return loss;
}

static double dotn(const double *a, const double *b, int n) {
  double s = 0;
  for (int i = 0; i < n; i++) s += a[i] * b[i];
  return s;
}

typedef struct grads {
  double *q, *k, *x, *a, *gam, *bp;
} grads;

/* chunked forward (y, final state) and backward (gradients of the same loss) */
static void chunked(const prob *p, int Q, double *y, double *Hf, grads *g) {
  const int T = p->T, P = p->P, N = p->N, nch = (T + Q - 1) / Q;
  double *E = calloc((size_t)P * N, sizeof(double)), *Ein = calloc((size_t)nch * P * N, sizeof(double));
  double *c = calloc(Q, sizeof(double)), *scale = calloc(T, sizeof(double)), *W = calloc(Q, sizeof(double));
  int *seg = calloc(Q, sizeof(int));
  for (int s = 0; s < T; s++) scale[s] = p->gam[s] + ((s + 1 < T && !p->rst[s + 1]) ? p->bp[s + 1] : 0);
  if (!p->rst[0])
    for (int i = 0; i < P; i++)
      for (int n = 0; n < N; n++) E[i * N + n] = p->Hin[i * N + n] + p->bp[0] * p->vin[i] * p->kin[n];
#define CHUNK_PREP(t0, nb)                                                       \
  do {                                                                           \
    double cc = 0;                                                               \
    int sg = -1;                                                                 \
    for (int j = 0; j < nb; j++) {                                               \
      cc += p->a[t0 + j];                                                        \
      c[j] = cc;                                                                 \
      if (p->rst[t0 + j]) sg = j;                                                \
      seg[j] = sg;                                                               \
    }                                                                            \
    for (int j = 0; j < nb; j++) W[j] = j >= seg[nb - 1] ? exp(c[nb - 1] - c[j]) : 0; \
  } while (0)
  for (int ch = 0; ch < nch; ch++) {
    const int t0 = ch * Q, nb = T - t0 < Q ? T - t0 : Q;
    CHUNK_PREP(t0, nb);
    memcpy(Ein + (size_t)ch * P * N, E, sizeof(double) * P * N);
    for (int t = 0; t < nb; t++) {
      const double *qt = p->q + (t0 + t) * N;
      for (int i = 0; i < P; i++) {
        double v = 0;
        if (seg[t] < 0) {
          for (int n = 0; n < N; n++) v += E[i * N + n] * qt[n];
          v *= exp(c[t]);
        }
        for (int s = (seg[t] > 0 ? seg[t] : 0); s < t; s++) {
          double qk = 0;
          for (int n = 0; n < N; n++) qk += qt[n] * p->k[(t0 + s) * N + n];
          v += exp(c[t] - c[s]) * scale[t0 + s] * qk * p->x[(t0 + s) * P + i];
        }
        double qk = 0;
        for (int n = 0; n < N; n++) qk += qt[n] * p->k[(t0 + t) * N + n];
        v += p->gam[t0 + t] * qk * p->x[(t0 + t) * P + i];
        y[(t0 + t) * P + i] = v;
      }
    }
    const double dec = seg[nb - 1] < 0 ? exp(c[nb - 1]) : 0;
    for (int i = 0; i < P; i++)
      for (int n = 0; n < N; n++) {
        double v = dec * E[i * N + n];
        for (int s = 0; s < nb; s++) v += W[s] * scale[t0 + s] * p->x[(t0 + s) * P + i] * p->k[(t0 + s) * N + n];
        E[i * N + n] = v;
      }
  }
  memcpy(Hf, E, sizeof(double) * P * N);

  /* backward */
  double *dE = E; /* gradient of the state leaving the chunk */
  memcpy(dE, p->dH, sizeof(double) * P * N);
  double *dc = calloc(Q, sizeof(double)), *dscale = calloc(T, sizeof(double));
  double *kt = calloc((size_t)Q * N, sizeof(double)); /* ktil of the chunk */
  for (int t = 0; t < T; t++) g->bp[t] = 0;
  for (int ch = nch - 1; ch >= 0; ch--) {
    const int t0 = ch * Q, nb = T - t0 < Q ? T - t0 : Q;
    CHUNK_PREP(t0, nb);
    const double *Ec = Ein + (size_t)ch * P * N;
    for (int s = 0; s < nb; s++)
      for (int n = 0; n < N; n++) kt[s * N + n] = scale[t0 + s] * p->k[(t0 + s) * N + n];
    const double *Q_ = p->q + t0 * N, *X = p->x + t0 * P, *DY = p->dY + t0 * P, *K = p->k + t0 * N;
#define S1(t, s) dotn(Q_ + (t) * N, kt + (s) * N, N)
#define S2(t, s) dotn(DY + (t) * P, X + (s) * P, P)
#define VALID(t, s) ((s) < (t) && (s) >= seg[t])
    double sumv = 0;
    for (int t = 0; t < nb; t++) dc[t] = 0;
    for (int t = 0; t < nb; t++) {
      const double m0 = seg[t] < 0 ? exp(c[t]) : 0;
      /* dq */
      double r = 0;
      for (int n = 0; n < N; n++) {
        double e = 0;
        for (int i = 0; i < P; i++) e += Ec[i * N + n] * DY[t * P + i];
        r += e * Q_[t * N + n];
        double v = m0 * e;
        for (int s = 0; s < t; s++)
          if (VALID(t, s)) v += exp(c[t] - c[s]) * S2(t, s) * kt[s * N + n];
        v += p->gam[t0 + t] * S2(t, t) * K[t * N + n];
        g->q[(t0 + t) * N + n] = v;
      }
      dc[t] += m0 * r;
      for (int s = 0; s < t; s++)
        if (VALID(t, s)) {
          const double M = exp(c[t] - c[s]) * S1(t, s) * S2(t, s);
          dc[t] += M;
          dc[s] -= M;
        }
    }
    for (int s = 0; s < nb; s++) {
      /* dktil, dk, dscale, v_s */
      double ds = 0, vs = 0;
      for (int n = 0; n < N; n++) {
        double e = 0;
        for (int i = 0; i < P; i++) e += dE[i * N + n] * X[s * P + i];
        vs += W[s] * e * kt[s * N + n];
        double v = W[s] * e;
        for (int t = s + 1; t < nb; t++)
          if (VALID(t, s)) v += exp(c[t] - c[s]) * S2(t, s) * Q_[t * N + n];
        ds += v * K[s * N + n];
        g->k[(t0 + s) * N + n] = scale[t0 + s] * v + p->gam[t0 + s] * S2(s, s) * Q_[s * N + n];
      }
      dscale[t0 + s] = ds;
      dc[s] -= vs;
      sumv += vs;
      /* dx */
      for (int i = 0; i < P; i++) {
        double e = 0;
        for (int n = 0; n < N; n++) e += dE[i * N + n] * kt[s * N + n];
        double v = W[s] * e;
        for (int t = s + 1; t < nb; t++)
          if (VALID(t, s)) v += exp(c[t] - c[s]) * S1(t, s) * DY[t * P + i];
        v += p->gam[t0 + s] * dotn(Q_ + s * N, K + s * N, N) * DY[s * P + i];
        g->x[(t0 + s) * P + i] = v;
      }
      g->gam[t0 + s] = ds + S2(s, s) * dotn(Q_ + s * N, K + s * N, N);
      if (t0 + s + 1 < T && !p->rst[t0 + s + 1]) g->bp[t0 + s + 1] += ds;
    }
    const double dec = seg[nb - 1] < 0 ? exp(c[nb - 1]) : 0;
    double dEE = 0;
    for (int i = 0; i < P * N; i++) dEE += dE[i] * Ec[i];
    dc[nb - 1] += dec * dEE + sumv;
    double acc = 0;
    for (int t = nb - 1; t >= 0; t--) {
      acc += dc[t];
      g->a[t0 + t] = p->rst[t0 + t] ? 0 : acc;
    }
    for (int i = 0; i < P; i++)
      for (int n = 0; n < N; n++) {
        double v = dec * dE[i * N + n];
        for (int t = 0; t < nb; t++)
          if (seg[t] < 0) v += exp(c[t]) * DY[t * P + i] * Q_[t * N + n];
        dE[i * N + n] = v;
      }
  }
  if (!p->rst[0]) {
    double v = 0;
    for (int i = 0; i < P; i++)
      for (int n = 0; n < N; n++) v += p->vin[i] * dE[i * N + n] * p->kin[n];
    g->bp[0] += v;
  }
  free(Ein);
  free(E);
  free(c);
  free(scale);
  free(W);
  free(seg);
  free(dc);
  free(dscale);
  free(kt);
}

static double *rnd(int n, double sd) {
  double *v = malloc(sizeof(double) * (n ? n : 1));
  for (int i = 0; i < n; i++) v[i] = sd * nrand();
  return v;
}

static double relerr(const double *a, const double *b, int n) {
  double num = 0, den = 0;
  for (int i = 0; i < n; i++) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* central differences of the sequential loss in every element of v */
static void fd(prob *p, double *v, int n, double *out) {
  const double h = 1e-6;
  for (int i = 0; i < n; i++) {
    const double o = v[i];
    v[i] = o + h;
    const double lp = seq_loss(p, NULL, NULL);
    v[i] = o - h;
    const double lm = seq_loss(p, NULL, NULL);
    v[i] = o;
    out[i] = (lp - lm) / (2 * h);
  }
}

static void run_case(int T, int P, int N, int Q, const int *resets, int nres, int with_in) {
  prob p = {T, P, N, rnd(T * N, 1), rnd(T * N, 1), rnd(T * P, 1), NULL, NULL, NULL, calloc(T, sizeof(int)),
            rnd(P * N, with_in ? 0.5 : 0), rnd(P, with_in ? 1 : 0), rnd(N, with_in ? 1 : 0), rnd(T * P, 1),
            rnd(P * N, 0.5)};
  p.a = malloc(sizeof(double) * T);
  p.gam = malloc(sizeof(double) * T);
  p.bp = malloc(sizeof(double) * T);
  for (int t = 0; t < T; t++) {
    p.a[t] = -0.02 - 0.5 * urand();
    p.gam[t] = 0.05 + 0.5 * urand();
    p.bp[t] = 0.05 + 0.5 * urand();
  }
  for (int i = 0; i < nres; i++)
    if (resets[i] < T) p.rst[resets[i]] = 1;
  double *ys = malloc(sizeof(double) * T * P), *yc = malloc(sizeof(double) * T * P);
  double *Hs = malloc(sizeof(double) * P * N), *Hc = malloc(sizeof(double) * P * N);
  seq_loss(&p, ys, Hs);
  grads g = {malloc(sizeof(double) * T * N), malloc(sizeof(double) * T * N), malloc(sizeof(double) * T * P),
             malloc(sizeof(double) * T), malloc(sizeof(double) * T), malloc(sizeof(double) * T)};
  chunked(&p, Q, yc, Hc, &g);
  char tag[128];
  snprintf(tag, sizeof tag, "T %d P %d N %d Q %d resets %d in %d", T, P, N, Q, nres, with_in);
  const double ey = relerr(yc, ys, T * P), eh = relerr(Hc, Hs, P * N);
  CHK(ey < 1e-12, "%s: y rel %.3g", tag, ey);
  CHK(eh < 1e-12, "%s: final state rel %.3g", tag, eh);
  struct {
    const char *name;
    double *v, *g;
    int n;
  } ins[] = {{"q", p.q, g.q, T * N}, {"k", p.k, g.k, T * N}, {"x", p.x, g.x, T * P},
             {"a", p.a, g.a, T},     {"gamma", p.gam, g.gam, T}, {"bp", p.bp, g.bp, T}};
  double worst = 0;
  for (size_t i = 0; i < sizeof ins / sizeof ins[0]; i++) {
    double *f = malloc(sizeof(double) * ins[i].n);
    fd(&p, ins[i].v, ins[i].n, f);
    const double e = relerr(ins[i].g, f, ins[i].n);
    if (e > worst) worst = e;
    CHK(e < 1e-6, "%s: d%s rel %.3g", tag, ins[i].name, e);
    free(f);
  }
  printf("%s: y %.2g state %.2g grads (vs finite differences) %.2g\n", tag, ey, eh, worst);
  free(p.q), free(p.k), free(p.x), free(p.a), free(p.gam), free(p.bp), free(p.rst), free(p.Hin), free(p.vin);
  free(p.kin), free(p.dY), free(p.dH), free(ys), free(yc), free(Hs), free(Hc);
  free(g.q), free(g.k), free(g.x), free(g.a), free(g.gam), free(g.bp);
}

int main(void) {
  const int r1[] = {5}, r2[] = {0, 7, 8, 12, 13}, r3[] = {3, 4, 16, 22}, r4[] = {63, 64, 65, 90};
  run_case(1, 3, 4, 8, NULL, 0, 1);
  run_case(19, 3, 5, 8, NULL, 0, 1);
  run_case(19, 3, 5, 8, r1, 1, 1);
  run_case(23, 2, 3, 8, r2, 5, 1);
  run_case(23, 4, 2, 4, r3, 4, 0);
  run_case(24, 2, 3, 8, r3, 4, 1);
  run_case(17, 2, 4, 64, r1, 1, 1);
  run_case(100, 2, 3, 64, r4, 4, 1);
  printf("chunked_scan: %d checks, %d failed\n", checks, fails);
  return fails ? 1 : 0;
}

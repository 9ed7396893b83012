/*
 * mixer.c — one residual layer on the CPU: h_out = h + Mixer(RMSNorm(h)) (SPEC.md §3).
 *
 * Forward: RMSNorm -> in_proj GEMM (BLAS) -> B/C RMSNorm per group -> scan (scan.c) ->
 * gate (silu, or per-head RMSNorm then silu) -> out_proj GEMM added onto the residual.
 * Backward mirrors it. Parameter gradients are "+="; per-row partials (parts.h) are summed
 * over rows in a fixed order so results do not depend on the thread count.
 */
#include <string.h>

#include "parts.h"
#include "real.h"
#include "../threads.h"

static int64_t cap_m(const cpu_model *m) { return m->cap; }

static real sigmoid(real v) { return 1 / (1 + R_EXP(-v)); }

m3_status NAME(cpu_layer_forward)(cpu_model *m, int32_t l, const uint8_t *resets, const cpu_state *in,
                                  const cpu_state *fin) {
  const m3_dims *d = m->d;
  const layer_offsets *lo = &m->lay->layer[l];
  const int64_t M = (int64_t)m->rows * m->len, M0 = cap_m(m);
  const int32_t dm = d->dm, E = d->E, P = d->P, N = d->N, G = d->G, H = d->H;
  const real *W = m->params;
  const int64_t sl = NAME(cpu_slot)(m, l);
  real *resid_in = m->resid + NAME(cpu_resid_slot)(m, l) * M0 * dm;
  real *resid_out = m->resid + NAME(cpu_resid_slot)(m, l + 1) * M0 * dm;
  real *xn = m->xn + sl * M0 * dm, *rstd = m->rstd + sl * M0;
  real *proj = m->proj + sl * M0 * d->dip;
  real *bc_hat = m->bc_hat + sl * M0 * 2 * G * N, *bc_rstd = m->bc_rstd + sl * M0 * 2 * G;
  real *y = m->y + sl * M0 * E, *y_rstd = m->y_rstd + sl * M0 * H, *gated = m->gated + sl * M0 * E;

  NAME(rmsnorm_forward)(resid_in, W + lo->norm, xn, rstd, M, dm);
  NAME(cpu_gemm)(m, CblasNoTrans, CblasTrans, (int)M, d->dip, dm, 1, xn, dm, W + lo->in_proj, dm, 0, proj, d->dip);

  real *ang_tanh = m->ang_tanh + sl * M0 * d->S;
#pragma omp parallel for schedule(static) num_threads(loop_threads(M, M * (2 * G * N + d->S) * 8, m->threads))
  for (int64_t mi = 0; mi < M; mi++) {
    for (int32_t which = 0; which < 2; which++)
      for (int32_t g = 0; g < G; g++)
        NAME(rmsnorm_row)(proj + mi * d->dip + (which ? d->C_off : d->B_off) + (int64_t)g * N,
                          W + (which ? lo->C_norm : lo->B_norm), bc_hat + ((mi * 2 + which) * G + g) * N,
                          bc_rstd + (mi * 2 + which) * G + g, N);
    for (int32_t a = 0; a < d->S; a++) ang_tanh[mi * d->S + a] = R_TANH(proj[mi * d->dip + d->ang_off + a]);
  }

  NAME(cpu_scan_forward)(m, l, resets, in, fin);

#pragma omp parallel for schedule(static) num_threads(loop_threads(M, M * E * 8, m->threads))
  for (int64_t mi = 0; mi < M; mi++)
    for (int32_t h = 0; h < H; h++) {
      const real *yh = y + mi * E + (int64_t)h * P, *z = proj + mi * d->dip + d->z_off + (int64_t)h * P;
      real *g = gated + mi * E + (int64_t)h * P;
      if (d->outproj_norm) NAME(rmsnorm_row)(yh, W + lo->out_norm + (int64_t)h * P, g, y_rstd + mi * H + h, P);
      else memcpy(g, yh, (size_t)P * sizeof(real));
      for (int32_t p = 0; p < P; p++) g[p] *= z[p] * sigmoid(z[p]);
    }

  memcpy(resid_out, resid_in, (size_t)(M * dm) * sizeof(real));
  NAME(cpu_gemm)(m, CblasNoTrans, CblasTrans, (int)M, dm, E, 1, gated, E, W + lo->out_proj, E, 1, resid_out, dm);
  return M3_OK;
}

/* grads[dst + i] += sum over rows b of part[b][src + i], rows in order. */
static void reduce_parts(const cpu_model *m, int64_t src, int64_t stride_h, int32_t count_h, int32_t width,
                         real *dst, int64_t dst_stride_h) {
  for (int32_t h = 0; h < count_h; h++)
    for (int32_t i = 0; i < width; i++) {
      real acc = 0;
      for (int32_t b = 0; b < m->rows; b++) acc += m->part[(int64_t)b * m->part_width + src + h * stride_h + i];
      dst[h * dst_stride_h + i] += acc;
    }
}

m3_status NAME(cpu_layer_backward)(cpu_model *m, int32_t l, const uint8_t *resets) {
  const m3_dims *d = m->d;
  const layer_offsets *lo = &m->lay->layer[l];
  const int64_t M = (int64_t)m->rows * m->len, M0 = cap_m(m);
  const int32_t dm = d->dm, E = d->E, P = d->P, N = d->N, G = d->G, H = d->H, S = d->S, dip = d->dip;
  const real *W = m->params;
  real *gr = m->grads;
  const real *resid_in = m->resid + l * M0 * dm, *xn = m->xn + l * M0 * dm, *rstd = m->rstd + l * M0;
  const real *proj = m->proj + l * M0 * dip, *bc_rstd = m->bc_rstd + l * M0 * 2 * G;
  const real *y = m->y + l * M0 * E, *y_rstd = m->y_rstd + l * M0 * H, *gated = m->gated + l * M0 * E;

  /* out_proj */
  NAME(cpu_gemm)(m, CblasNoTrans, CblasNoTrans, (int)M, E, dm, 1, m->dresid, dm, W + lo->out_proj, E, 0,
             m->dgated, E);
  NAME(cpu_gemm)(m, CblasTrans, CblasNoTrans, dm, E, (int)M, 1, m->dresid, dm, gated, E, 1,
             gr + lo->out_proj, E);
  memset(m->part, 0, (size_t)(m->rows * m->part_width) * sizeof(real));

  /* gate: dy and dz */
#pragma omp parallel for schedule(static) num_threads(loop_threads(m->rows, M * E * 16, m->threads))
  for (int32_t b = 0; b < m->rows; b++) {
    real *part = m->part + (int64_t)b * m->part_width;
    for (int64_t mi = (int64_t)b * m->len; mi < (int64_t)(b + 1) * m->len; mi++)
      for (int32_t h = 0; h < H; h++) {
        const int64_t o = mi * E + (int64_t)h * P;
        const real *yh = y + o, *dg = m->dgated + o, *z = proj + mi * dip + d->z_off + (int64_t)h * P;
        real *dy = m->dy + o, *dz = m->dproj + mi * dip + d->z_off + (int64_t)h * P;
        const real r = d->outproj_norm ? y_rstd[mi * H + h] : 1;
        const real *wn = d->outproj_norm ? W + lo->out_norm + (int64_t)h * P : NULL;
        for (int32_t p = 0; p < P; p++) {
          const real s = sigmoid(z[p]), silu = z[p] * s, dsilu = s * (1 + z[p] * (1 - s));
          const real yn = wn ? yh[p] * r * wn[p] : yh[p];
          dz[p] = dg[p] * yn * dsilu;
          dy[p] = dg[p] * silu; /* dL/d yn; the norm backward below turns it into dL/d y */
        }
        if (wn) NAME(rmsnorm_backward_row)(yh, wn, r, dy, dy, part + part_outnorm(d) + (int64_t)h * P, P, 0);
      }
  }

  NAME(cpu_scan_backward)(m, l, resets);

  /* per token: heads -> groups, B/C RMSNorm backward, angle shares */
#pragma omp parallel for schedule(static) num_threads(loop_threads(m->rows, M * H * (2 * N + S) * 2, m->threads))
  for (int32_t b = 0; b < m->rows; b++) {
    real *part = m->part + (int64_t)b * m->part_width;
    real *sum = m->row_scratch + (int64_t)b * N;
    for (int64_t mi = (int64_t)b * m->len; mi < (int64_t)(b + 1) * m->len; mi++) {
      for (int32_t which = 0; which < 2; which++)
        for (int32_t g = 0; g < G; g++) {
          for (int32_t n = 0; n < N; n++) sum[n] = 0;
          for (int32_t h = g * d->heads_per_group; h < (g + 1) * d->heads_per_group; h++) {
            const real *src = m->dbc_head + ((mi * H + h) * 2 + which) * N;
            for (int32_t n = 0; n < N; n++) sum[n] += src[n];
          }
          const int64_t col = (which ? d->C_off : d->B_off) + (int64_t)g * N;
          NAME(rmsnorm_backward_row)(proj + mi * dip + col, W + (which ? lo->C_norm : lo->B_norm),
                                     bc_rstd[(mi * 2 + which) * G + g], sum, m->dproj + mi * dip + col,
                                     part + part_bcnorm(d) + (int64_t)which * N, N, 0);
        }
      for (int32_t a = 0; a < S; a++) {
        real acc = 0;
        for (int32_t h = 0; h < H; h++) acc += m->dang_head[(mi * H + h) * S + a];
        m->dproj[mi * dip + d->ang_off + a] = acc;
      }
    }
  }

  const int64_t sps = scan_part_stride(d);
  reduce_parts(m, SCAN_PART_DT_BIAS, sps, H, 1, gr + lo->dt_bias, 1);
  reduce_parts(m, SCAN_PART_D, sps, H, 1, gr + lo->D, 1);
  reduce_parts(m, SCAN_PART_BIAS, sps, H, N, gr + lo->B_bias, N);
  reduce_parts(m, SCAN_PART_BIAS + N, sps, H, N, gr + lo->C_bias, N);
  reduce_parts(m, part_bcnorm(d), 0, 1, N, gr + lo->B_norm, 0);
  reduce_parts(m, part_bcnorm(d) + N, 0, 1, N, gr + lo->C_norm, 0);
  if (d->outproj_norm) reduce_parts(m, part_outnorm(d), 0, 1, E, gr + lo->out_norm, 0);

  /* in_proj */
  NAME(cpu_gemm)(m, CblasNoTrans, CblasNoTrans, (int)M, dm, dip, 1, m->dproj, dip, W + lo->in_proj, dm, 0,
             m->dxn, dm);
  NAME(cpu_gemm)(m, CblasTrans, CblasNoTrans, dip, dm, (int)M, 1, m->dproj, dip, xn, dm, 1, gr + lo->in_proj,
             dm);

  /* RMSNorm: dresid (= dL/d resid_out, the identity path) += norm path */
#pragma omp parallel for schedule(static) num_threads(loop_threads(m->rows, M * dm * 8, m->threads))
  for (int32_t b = 0; b < m->rows; b++) {
    real *part = m->part + (int64_t)b * m->part_width + part_rowvec(d);
    for (int32_t i = 0; i < dm; i++) part[i] = 0;
    for (int64_t mi = (int64_t)b * m->len; mi < (int64_t)(b + 1) * m->len; mi++)
      NAME(rmsnorm_backward_row)(resid_in + mi * dm, W + lo->norm, rstd[mi], m->dxn + mi * dm, m->dresid + mi * dm,
                                 part, dm, 1);
  }
  reduce_parts(m, part_rowvec(d), 0, 1, dm, gr + lo->norm, 0);
  return M3_OK;
}

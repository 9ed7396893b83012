/*
 * heads.c — the losses of SPEC.md §6 on the CPU, from the output `out` [M, dm].
 *
 *   "none": dout = weight * d_out (the caller's dL/d out); no loss is reported.
 *   "lm":   logits = out W^T (W = embedding or lm_head), mean cross-entropy over targets
 *           != -1; logits are built HEAD_BLOCK positions at a time, never for the whole
 *           window. dlogits = weight * (softmax - onehot) / count.
 *   "mse":  pred = out R^T + b, mean of (pred - target)^2 over all elements or masked
 *           positions; dpred = weight * 2 (pred - target) / count.
 * Sums run in double, in position order, so the reported mean is deterministic.
 */
#include <float.h>
#include <string.h>

#include "real.h"
#include "../threads.h"

enum { HEAD_BLOCK = 64 };

static void head_none(cpu_model *m, const cpu_batch *b, real weight, int want_grad, cpu_head_result *res) {
  const int64_t n = (int64_t)b->rows * b->len * m->d->dm;
  res->has_loss = 0;
  if (want_grad)
    for (int64_t i = 0; i < n; i++) m->dout[i] = weight * b->d_out[i];
}

static void head_lm(cpu_model *m, const cpu_batch *b, real weight, int want_grad, cpu_head_result *res) {
  const m3_dims *d = m->d;
  const int64_t M = (int64_t)b->rows * b->len;
  const int32_t V = d->vocab, dm = d->dm;
  const int64_t w_off = m3_layout_lm_weight(m->lay, d);
  const real *W = m->params + w_off;
  real *gW = m->grads + w_off;
  int64_t count = 0;
  for (int64_t i = 0; i < M; i++) count += b->targets[i] >= 0;
  const real scale = count ? weight / (real)count : 0;
  double loss_sum = 0;
  int64_t correct = 0;
  double row_loss[HEAD_BLOCK];
  int32_t row_hit[HEAD_BLOCK];
  for (int64_t i0 = 0; i0 < M; i0 += HEAD_BLOCK) {
    const int32_t nb = (int32_t)(M - i0 < HEAD_BLOCK ? M - i0 : HEAD_BLOCK);
    const real *outb = m->out + i0 * dm;
    NAME(cpu_gemm)(m, CblasNoTrans, CblasTrans, nb, V, dm, 1, outb, dm, W, dm, 0, m->logits, V);
#pragma omp parallel for schedule(static) num_threads(loop_threads(nb, (int64_t)nb * V * 8, m->threads))
    for (int32_t r = 0; r < nb; r++) {
      real *lg = m->logits + (int64_t)r * V;
      const int32_t tgt = b->targets[i0 + r];
      row_loss[r] = 0;
      row_hit[r] = 0;
      if (tgt < 0) {
        memset(lg, 0, (size_t)V * sizeof(real));
        continue;
      }
      real mx = -FLT_MAX;
      int32_t arg = 0;
      for (int32_t v = 0; v < V; v++)
        if (lg[v] > mx) {
          mx = lg[v];
          arg = v;
        }
      double se = 0;
      for (int32_t v = 0; v < V; v++) se += exp((double)(lg[v] - mx));
      const double lse = (double)mx + log(se);
      row_loss[r] = lse - (double)lg[tgt];
      row_hit[r] = arg == tgt;
      for (int32_t v = 0; v < V; v++) lg[v] = (real)(exp((double)lg[v] - lse)) * scale;
      lg[tgt] -= scale;
    }
    for (int32_t r = 0; r < nb; r++) {
      loss_sum += row_loss[r];
      correct += row_hit[r];
    }
    if (want_grad) {
      NAME(cpu_gemm)(m, CblasNoTrans, CblasNoTrans, nb, dm, V, 1, m->logits, V, W, dm, 0, m->dout + i0 * dm,
                 dm);
      NAME(cpu_gemm)(m, CblasTrans, CblasNoTrans, V, dm, nb, 1, m->logits, V, outb, dm, 1, gW, dm);
    }
  }
  res->has_loss = 1;
  res->counted = count;
  res->correct = correct;
  res->loss = count ? loss_sum / (double)count : 0;
}

static void head_mse(cpu_model *m, const cpu_batch *b, real weight, int want_grad, cpu_head_result *res) {
  const m3_dims *d = m->d;
  const int64_t M = (int64_t)b->rows * b->len;
  const int32_t od = d->out_dim, dm = d->dm;
  const real *R = m->params + m->lay->readout_w, *rb = m->params + m->lay->readout_b;
  real *gR = m->grads + m->lay->readout_w, *grb = m->grads + m->lay->readout_b;
  int64_t count = 0;
  for (int64_t i = 0; i < M; i++) count += b->mask ? b->mask[i] != 0 : 1;
  count *= od;
  const real scale = count ? 2 * weight / (real)count : 0;
  double loss_sum = 0;
  for (int64_t i0 = 0; i0 < M; i0 += HEAD_BLOCK) {
    const int32_t nb = (int32_t)(M - i0 < HEAD_BLOCK ? M - i0 : HEAD_BLOCK);
    const real *outb = m->out + i0 * dm;
    NAME(cpu_gemm)(m, CblasNoTrans, CblasTrans, nb, od, dm, 1, outb, dm, R, dm, 0, m->logits, od);
    for (int32_t r = 0; r < nb; r++) {
      real *pr = m->logits + (int64_t)r * od;
      const real *tg = b->target_values + (i0 + r) * od;
      const int counted = b->mask ? b->mask[i0 + r] != 0 : 1;
      for (int32_t j = 0; j < od; j++) {
        const real diff = counted ? pr[j] + rb[j] - tg[j] : 0;
        loss_sum += (double)diff * diff;
        pr[j] = diff * scale;
        if (want_grad) grb[j] += pr[j];
      }
    }
    if (want_grad) {
      NAME(cpu_gemm)(m, CblasNoTrans, CblasNoTrans, nb, dm, od, 1, m->logits, od, R, dm, 0, m->dout + i0 * dm,
                 dm);
      NAME(cpu_gemm)(m, CblasTrans, CblasNoTrans, od, dm, nb, 1, m->logits, od, outb, dm, 1, gR, dm);
    }
  }
  res->has_loss = 1;
  res->counted = count;
  res->loss = count ? loss_sum / (double)count : 0;
}

m3_status NAME(cpu_model_head)(cpu_model *m, const cpu_batch *b, real weight, int want_grad, cpu_head_result *res) {
  memset(res, 0, sizeof *res);
  switch (m->d->head) {
    case M3_HEAD_NONE:
      if (want_grad && !b->d_out) return m3_fail(M3_ERR_ARGUMENT, "head \"none\" needs d_out");
      head_none(m, b, weight, want_grad, res);
      return M3_OK;
    case M3_HEAD_LM:
      if (!b->targets) return m3_fail(M3_ERR_ARGUMENT, "head \"lm\" needs targets");
      head_lm(m, b, weight, want_grad, res);
      return M3_OK;
    case M3_HEAD_MSE:
      if (!b->target_values) return m3_fail(M3_ERR_ARGUMENT, "head \"mse\" needs targets");
      head_mse(m, b, weight, want_grad, res);
      return M3_OK;
  }
  return m3_fail(M3_ERR_INTERNAL, "unknown head kind %d", m->d->head);
}

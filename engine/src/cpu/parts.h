/*
 * parts.h — layout of the per-row partial parameter gradients (cpu_model.part).
 *
 * Parallel loops never add into a shared gradient: each row b (and, in the scan, each
 * (row, head)) writes its own partial sums into part[b], and a serial pass adds the rows
 * in order 0..rows-1. The result is bitwise the same for any number of threads.
 *
 * Per row: [scan: H x (dt_bias, D, B_bias[N], C_bias[N])] [B_norm N] [C_norm N]
 *          [mixer norm E] [row vector: dm (layer norm, norm_f, input_proj.bias) or out_dim]
 */
#ifndef M3_CPU_PARTS_H
#define M3_CPU_PARTS_H

#include "../layout.h"

enum { SCAN_PART_DT_BIAS = 0, SCAN_PART_D = 1, SCAN_PART_BIAS = 2 };

static inline int64_t scan_part_stride(const m3_dims *d) { return 2 + 2 * (int64_t)d->N; }
static inline int64_t part_bcnorm(const m3_dims *d) { return d->H * scan_part_stride(d); }
static inline int64_t part_outnorm(const m3_dims *d) { return part_bcnorm(d) + 2 * (int64_t)d->N; }
static inline int64_t part_rowvec(const m3_dims *d) { return part_outnorm(d) + d->E; }
static inline int64_t part_width(const m3_dims *d) {
  int64_t tail = d->out_dim > d->dm ? d->out_dim : d->dm; /* dm-wide vectors, or readout.bias */
  return part_rowvec(d) + tail;
}

#endif

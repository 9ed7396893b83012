/*
 * threads.h — how many OpenMP threads a parallel loop on the host takes (the CPU backend, the
 * sampler). Starting and joining a parallel region costs microseconds on every thread of it,
 * and far more when other programs share the cores (their spinning threads wait for ours), so
 * a loop takes one thread per MIN_WORK_PER_THREAD of its work (scalar operations, roughly), at
 * most one per iteration and at most `most`. Small models then run on one or a few threads
 * instead of every core. Results never depend on the count (cpu/parts.h, cpu/gemm.c, sample.c).
 */
#ifndef M3_THREADS_H
#define M3_THREADS_H

#include <stdint.h>

enum { MIN_WORK_PER_THREAD = 1 << 16 };

/* Threads for a loop of `iters` iterations and `work` operations in all: 1 .. min(iters, most). */
static inline int loop_threads(int64_t iters, int64_t work, int most) {
  int64_t t = work / MIN_WORK_PER_THREAD;
  if (t > iters) t = iters;
  if (t > most) t = most;
  return t < 1 ? 1 : (int)t;
}

#endif

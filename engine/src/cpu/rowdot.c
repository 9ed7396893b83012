/*
 * rowdot.c — the matrix products of a forward-only CPU model (the inference backend):
 * C = A Bᵀ + beta C, A [M, K] rows of activations, B [N, K] a weight in the PyTorch layout
 * (every product of a forward has this form).
 *
 * The model keeps every 2-D weight transposed as well (cpu_model.params_t, at the same offsets,
 * so an inference model holds its matrices twice), in panels of COL_BLOCK outputs: panel p holds
 * Bᵀ[k, p COL_BLOCK + jj] at p K COL_BLOCK + k w + jj (w = COL_BLOCK, or N mod COL_BLOCK for the
 * last panel), so a tile reads contiguous memory. An element is one running sum over k in order,
 * c[r, j] += a[r, k] Bᵀ[k, j], vectorised across j and computed the same way whatever M, the
 * thread count or the other rows. A row's result therefore does not depend on how many rows a
 * call holds: a prompt stepped token by token equals the prompt run as one window, bit for bit,
 * and a one-token step costs one row of work (BLAS computes leftover rows with other kernels, so
 * it would need every call padded to a block of rows). Tiles of ROW_BLOCK rows x COL_BLOCK
 * outputs share each load; the threads split the output columns, never a sum. The kernel is
 * built for AVX-512, AVX2 and the baseline ISA and picked by the CPU's features at load time
 * (target_clones): the bits are fixed per machine, as with BLAS.
 */
#include <omp.h>

#include "real.h"
#include "../threads.h"

enum { ROW_BLOCK = 4, COL_BLOCK = 64 };

/* A 64-byte vector of reals (GCC vector extension: registers on every ISA the clones target). */
typedef real vec __attribute__((vector_size(64)));
typedef real vec_in __attribute__((vector_size(64), aligned(sizeof(real)), may_alias)); /* unaligned loads */
enum { VL = 64 / sizeof(real), VPB = COL_BLOCK / VL }; /* lanes per vector, vectors per tile row */

/* C[i, jj] for i < NR, jj < COL_BLOCK from a full-width panel; NR is a constant at every call,
 * so the sums stay in registers. */
static inline __attribute__((always_inline)) void tile_full(const int NR, int K, const real *A, int lda,
                                                            const real *panel, real beta, real *C, int ldc) {
  vec acc[ROW_BLOCK][VPB];
  for (int i = 0; i < NR; i++)
    for (int v = 0; v < VPB; v++) acc[i][v] = (vec){0};
  for (int k = 0; k < K; k++) {
    const vec_in *b = (const vec_in *)(panel + (int64_t)k * COL_BLOCK);
    for (int i = 0; i < NR; i++) {
      const real a = A[(int64_t)i * lda + k];
      for (int v = 0; v < VPB; v++) acc[i][v] += a * b[v];
    }
  }
  for (int i = 0; i < NR; i++) {
    real out[COL_BLOCK], *c = C + (int64_t)i * ldc;
    __builtin_memcpy(out, acc[i], sizeof out);
    for (int jj = 0; jj < COL_BLOCK; jj++) c[jj] = beta == 0 ? out[jj] : beta * c[jj] + out[jj];
  }
}

/* The same sums for one row over the last w < COL_BLOCK columns of a weight. */
static inline void tile_tail(int w, int K, const real *a, const real *panel, real beta, real *c) {
  real acc[COL_BLOCK] = {0};
  for (int k = 0; k < K; k++)
    for (int jj = 0; jj < w; jj++) acc[jj] += a[k] * panel[(int64_t)k * w + jj];
  for (int jj = 0; jj < w; jj++) c[jj] = beta == 0 ? acc[jj] : beta * c[jj] + acc[jj];
}

/* Output columns [j0, j1) of every row: whole tiles of ROW_BLOCK rows, the other rows one by
 * one (the same vector code per element either way); the last N mod COL_BLOCK columns of a
 * weight always take tile_tail. */
__attribute__((target_clones("avx512f", "avx2", "default"))) static void
columns(int M, int K, const real *A, int lda, const real *BT, int N, real beta, real *C, int ldc, int j0, int j1) {
  for (int r = 0; r < M;) {
    const int nr = M - r >= ROW_BLOCK ? ROW_BLOCK : 1;
    const real *a = A + (int64_t)r * lda;
    real *c = C + (int64_t)r * ldc;
    for (int j = j0; j < j1; j += COL_BLOCK) {
      const int w = N - j < COL_BLOCK ? N - j : COL_BLOCK;
      const real *panel = BT + (int64_t)j * K;
      if (w < COL_BLOCK)
        for (int i = 0; i < nr; i++) tile_tail(w, K, a + (int64_t)i * lda, panel, beta, c + (int64_t)i * ldc + j);
      else if (nr == ROW_BLOCK) tile_full(ROW_BLOCK, K, a, lda, panel, beta, c + j, ldc);
      else tile_full(1, K, a, lda, panel, beta, c + j, ldc);
    }
    r += nr;
  }
}

void NAME(cpu_rowdot)(cpu_model *m, int M, int N, int K, const real *A, int lda, const real *BT, real beta, real *C,
                      int ldc) {
  const double t0 = omp_get_wtime();
  const int blocks = (N + COL_BLOCK - 1) / COL_BLOCK;
  const int parts = loop_threads(blocks, (int64_t)M * N * K, m->threads);
#pragma omp parallel for schedule(static) num_threads(parts)
  for (int i = 0; i < parts; i++) {
    const int j0 = (int)((int64_t)blocks * i / parts) * COL_BLOCK;
    int j1 = (int)((int64_t)blocks * (i + 1) / parts) * COL_BLOCK;
    if (j1 > N) j1 = N;
    columns(M, K, A, lda, BT, N, beta, C, ldc, j0, j1);
  }
  m->gemm_seconds += omp_get_wtime() - t0;
}

void NAME(cpu_model_transpose_weights)(cpu_model *m) {
  const m3_layout *lay = m->lay;
  for (int32_t i = 0; i < lay->n; i++) {
    const param_desc *p = &lay->t[i];
    if (p->ndim != 2) continue;
    const int64_t rows = p->shape[0], cols = p->shape[1];
    const real *src = m->params + p->offset;
    real *dst = m->params_t + p->offset;
    const int64_t panels = (rows + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for schedule(static) num_threads(loop_threads(panels, rows * cols, m->threads))
    for (int64_t j0 = 0; j0 < rows; j0 += COL_BLOCK) { /* panel of outputs [j0, j0 + w) */
      const int64_t w = rows - j0 < COL_BLOCK ? rows - j0 : COL_BLOCK;
      real *panel = dst + j0 * cols;
      for (int64_t k = 0; k < cols; k++)
        for (int64_t jj = 0; jj < w; jj++) panel[k * w + jj] = src[(j0 + jj) * cols + k];
    }
  }
}

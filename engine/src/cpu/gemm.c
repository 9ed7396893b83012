/*
 * gemm.c — every matrix product of the CPU model goes through here: BLAS (row-major),
 * one call per tile of the output, the tiles spread over the model's OpenMP threads while
 * BLAS itself runs single-threaded. One thread pool for everything avoids the two runtimes
 * spinning against each other. The tiles depend on the shape alone, never on the thread
 * count: BLAS computes an element differently depending on the size of its call (OpenBLAS
 * takes other kernels for small ones), so each output element comes from the same call
 * whatever the threads and the timing. Tiles are blocks of ROWS_PER_CALL rows; when that
 * gives fewer than TILES_WANTED, the columns are cut too, into panels of at least
 * MIN_COLS_PER_CALL (the "lm" head's 64-row blocks over a vocabulary, a weight gradient's
 * d_model rows). Time spent here is counted for profiles. A forward-only model's products
 * (all of the form A Bᵀ) take rowdot.c instead, whose rows do not depend on how many rows
 * a call holds.
 */
#include <omp.h>

#include "real.h"
#include "../threads.h"

enum { ROWS_PER_CALL = 64, MIN_COLS_PER_CALL = 32, TILES_WANTED = 32 };

void NAME(cpu_gemm)(cpu_model *m, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, real alpha,
                    const real *A, int lda, const real *B, int ldb, real beta, real *C, int ldc) {
  if (m->params_t && ta == CblasNoTrans && tb == CblasTrans && alpha == 1 && ldb == K && B >= m->params &&
      B + (int64_t)N * K <= m->params + m->lay->total) { /* a weight of a forward-only model */
    NAME(cpu_rowdot)(m, M, N, K, A, lda, m->params_t + (B - m->params), beta, C, ldc);
    return;
  }
  if (M <= 0 || N <= 0) return;
  const double t0 = omp_get_wtime();
  const int row_blocks = (M + ROWS_PER_CALL - 1) / ROWS_PER_CALL;
  int panels = 1;
  if (row_blocks < TILES_WANTED) {
    const int most = (N + MIN_COLS_PER_CALL - 1) / MIN_COLS_PER_CALL;
    panels = (TILES_WANTED + row_blocks - 1) / row_blocks;
    if (panels > most) panels = most;
  }
  const int cols = (N + panels - 1) / panels, tiles = row_blocks * panels;
#pragma omp parallel for schedule(static) num_threads(loop_threads(tiles, (int64_t)M * N * K, m->threads))
  for (int i = 0; i < tiles; i++) {
    const int r0 = (i / panels) * ROWS_PER_CALL, c0 = (i % panels) * cols;
    const int rows = M - r0 < ROWS_PER_CALL ? M - r0 : ROWS_PER_CALL, n = N - c0 < cols ? N - c0 : cols;
    if (n <= 0) continue;
    const real *Ai = ta == CblasNoTrans ? A + (int64_t)r0 * lda : A + r0;
    const real *Bj = tb == CblasNoTrans ? B + c0 : B + (int64_t)c0 * ldb;
    cblas_gemm(CblasRowMajor, ta, tb, rows, n, K, alpha, Ai, lda, Bj, ldb, beta, C + (int64_t)r0 * ldc + c0, ldc);
  }
  m->gemm_seconds += omp_get_wtime() - t0;
}

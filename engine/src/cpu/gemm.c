/*
 * gemm.c — every matrix product of the CPU model goes through here: BLAS (row-major),
 * one call per block of ROWS_PER_CALL output rows (the last one shorter), the blocks spread
 * over the model's OpenMP threads while BLAS itself runs single-threaded. One thread pool
 * for everything avoids the two runtimes spinning against each other. The blocks depend on
 * M alone, never on the thread count: BLAS computes a row differently depending on how many
 * rows its call holds (OpenBLAS takes other kernels for small calls), so each output row
 * comes from the same call whatever the threads and the timing. Time spent here is counted
 * for profiles. A forward-only model's products (all of the form A Bᵀ) take rowdot.c instead,
 * whose rows do not depend on how many rows a call holds.
 */
#include <omp.h>

#include "real.h"

enum { ROWS_PER_CALL = 64 };

void NAME(cpu_gemm)(cpu_model *m, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, real alpha,
                    const real *A, int lda, const real *B, int ldb, real beta, real *C, int ldc) {
  if (m->params_t && ta == CblasNoTrans && tb == CblasTrans && alpha == 1 && ldb == K && B >= m->params &&
      B + (int64_t)N * K <= m->params + m->lay->total) { /* a weight of a forward-only model */
    NAME(cpu_rowdot)(m, M, N, K, A, lda, m->params_t + (B - m->params), beta, C, ldc);
    return;
  }
  if (M <= 0) return;
  const double t0 = omp_get_wtime();
  const int blocks = (M + ROWS_PER_CALL - 1) / ROWS_PER_CALL;
#pragma omp parallel for schedule(static) num_threads(blocks < m->threads ? blocks : m->threads)
  for (int i = 0; i < blocks; i++) {
    const int r0 = i * ROWS_PER_CALL, rows = M - r0 < ROWS_PER_CALL ? M - r0 : ROWS_PER_CALL;
    const real *Ai = ta == CblasNoTrans ? A + (int64_t)r0 * lda : A + r0;
    cblas_gemm(CblasRowMajor, ta, tb, rows, N, K, alpha, Ai, lda, B, ldb, beta, C + (int64_t)r0 * ldc, ldc);
  }
  m->gemm_seconds += omp_get_wtime() - t0;
}

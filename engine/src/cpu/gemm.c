/*
 * gemm.c — every matrix product of the CPU model goes through here: BLAS (row-major),
 * one call per block of output rows, the blocks spread over the model's OpenMP threads
 * while BLAS itself runs single-threaded. One thread pool for everything avoids the two
 * runtimes spinning against each other, and each output row is computed by exactly one
 * call, so results do not depend on timing. Time spent here is counted for profiles.
 * A forward-only model's products (all of the form A Bᵀ) take rowdot.c instead, whose
 * rows do not depend on how many rows a call holds.
 */
#include <omp.h>

#include "real.h"

enum { MIN_ROWS_PER_CALL = 32 };

void NAME(cpu_gemm)(cpu_model *m, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, real alpha,
                    const real *A, int lda, const real *B, int ldb, real beta, real *C, int ldc) {
  if (m->params_t && ta == CblasNoTrans && tb == CblasTrans && alpha == 1 && ldb == K && B >= m->params &&
      B + (int64_t)N * K <= m->params + m->lay->total) { /* a weight of a forward-only model */
    NAME(cpu_rowdot)(m, M, N, K, A, lda, m->params_t + (B - m->params), beta, C, ldc);
    return;
  }
  const double t0 = omp_get_wtime();
  int parts = M / MIN_ROWS_PER_CALL < m->threads ? M / MIN_ROWS_PER_CALL : m->threads;
  if (parts < 1) parts = 1;
#pragma omp parallel for schedule(static) num_threads(parts)
  for (int i = 0; i < parts; i++) {
    const int r0 = (int)((int64_t)M * i / parts);
    const int r1 = (int)((int64_t)M * (i + 1) / parts);
    if (r1 <= r0) continue;
    const real *Ai = ta == CblasNoTrans ? A + (int64_t)r0 * lda : A + r0;
    cblas_gemm(CblasRowMajor, ta, tb, r1 - r0, N, K, alpha, Ai, lda, B, ldb, beta, C + (int64_t)r0 * ldc, ldc);
  }
  m->gemm_seconds += omp_get_wtime() - t0;
}

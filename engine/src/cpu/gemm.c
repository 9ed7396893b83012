/*
 * gemm.c — every matrix product of the CPU model goes through here: BLAS (row-major),
 * one call per block of output rows, the blocks spread over the model's OpenMP threads
 * while BLAS itself runs single-threaded. One thread pool for everything avoids the two
 * runtimes spinning against each other, and each output row is computed by exactly one
 * call, so results do not depend on timing. Time spent here is counted for profiles.
 * In a forward-only model the blocks start at multiples of M3_CPU_ROW_GROUP rows (model_t.h),
 * so a row is computed by the same kernel path whatever the row count.
 */
#include <omp.h>

#include "real.h"

enum { MIN_ROWS_PER_CALL = 32 };

void NAME(cpu_gemm)(cpu_model *m, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, real alpha,
                    const real *A, int lda, const real *B, int ldb, real beta, real *C, int ldc) {
  const double t0 = omp_get_wtime();
  int parts = M / MIN_ROWS_PER_CALL < m->threads ? M / MIN_ROWS_PER_CALL : m->threads;
  if (parts < 1) parts = 1;
  const int group = m->train ? 1 : M3_CPU_ROW_GROUP, groups = M / group;
#pragma omp parallel for schedule(static) num_threads(parts)
  for (int i = 0; i < parts; i++) {
    const int r0 = (int)((int64_t)groups * i / parts) * group;
    const int r1 = i + 1 == parts ? M : (int)((int64_t)groups * (i + 1) / parts) * group;
    if (r1 <= r0) continue;
    const real *Ai = ta == CblasNoTrans ? A + (int64_t)r0 * lda : A + r0;
    cblas_gemm(CblasRowMajor, ta, tb, r1 - r0, N, K, alpha, Ai, lda, B, ldb, beta, C + (int64_t)r0 * ldc, ldc);
  }
  m->gemm_seconds += omp_get_wtime() - t0;
}

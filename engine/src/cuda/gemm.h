/*
 * gemm.h — row-major GEMMs through cuBLASLt with plans cached per shape.
 *
 *   D[M, N] = op(A) op(B) + beta C,   A row-major [M, K] (ta = 0) or [K, M] (ta = 1),
 *   B row-major [K, N] (tb = 0) or [N, K] (tb = 1), C and D row-major [M, N] with row stride ldd.
 *
 * A plan (matmul descriptor, layouts, the heuristic's algorithm for a fixed workspace) is made
 * the first time a shape is seen and reused after, so every call of a shape runs the same
 * algorithm: results are bitwise repeatable and a captured graph replays what eager ran.
 * Operands are float32 or the trainer's 16-bit type, accumulation float32 (CUBLAS_COMPUTE_32F,
 * or its TF32 mode for float32 operands when allowed).
 */
#ifndef M3_CUDA_GEMM_H
#define M3_CUDA_GEMM_H

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "../errors.h"

typedef struct gemm_plan gemm_plan;

typedef struct gemm_ctx {
  cublasLtHandle_t lt;
  void *workspace;     /* device, fixed for the trainer's life */
  size_t workspace_bytes;
  cudaDataType_t act;  /* the 16-bit type (or float32) of "act" operands */
  int tf32;            /* float32 operands may use TF32 */
  gemm_plan *plans;
  int n_plans, cap_plans;
} gemm_ctx;

/* Operand kinds: float32 or the context's activation type. */
enum { G_F32 = 0, G_ACT = 1 };

typedef struct gemm_op {
  int ta, tb;
  long long M, N, K;
  const void *A;
  long long lda;
  int a_kind;
  const void *B;
  long long ldb;
  int b_kind;
  const void *C; /* NULL: beta must be 0 */
  void *D;
  long long ldd;
  int d_kind; /* C has D's kind */
  float beta;
} gemm_op;

m3_status m3_gemm_init(gemm_ctx *g, cudaDataType_t act, int tf32, void *workspace, size_t workspace_bytes);
void m3_gemm_free(gemm_ctx *g);
/* The waves of the op's algorithm (cuBLASLt's estimate: its CTAs over those the device holds at once;
 * making its plan first when new). */
m3_status m3_gemm_waves(gemm_ctx *g, const gemm_op *op, float *waves);
/* Enqueues one GEMM on the stream (making its plan first when new). */
m3_status m3_gemm(gemm_ctx *g, cudaStream_t s, const gemm_op *op);

#endif

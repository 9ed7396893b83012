/*
 * gemm.c — cuBLASLt plans and calls for the row-major GEMMs of gemm.h.
 *
 * Row-major D = op(A) op(B) is the column-major D^T = op(B)^T op(A)^T, so cuBLASLt gets B's
 * memory as its first operand and A's as its second, with m = N, n = M. A plan is keyed by
 * everything that can change the algorithm (transposes, sizes, leading dimensions, types,
 * beta != 0, pointer alignments) and keeps the heuristic's first algorithm for the fixed
 * workspace (for large 16-bit products into a float32 C another of its list: pick); the same key
 * always runs the same algorithm, so results are repeatable. Reductions of at most SHORT_K are
 * not split (the heuristic splits even K = 32, the weight gradients of a 32-token window, and its
 * reduce kernel then costs more than the split saves: NOTES.md run 77).
 */
#include "gemm.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { SHORT_K = 256, CANDIDATES = 8 };
#define WIDE_PICK_MACS 8.0e9

struct gemm_plan {
  int ta, tb, a_kind, b_kind, d_kind, beta_nz;
  long long M, N, K, lda, ldb, ldd;
  int align[4];
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulAlgo_t algo;
  float waves; /* the heuristic's estimate for algo */
};

#define LT(call)                                                                                     \
  do {                                                                                               \
    cublasStatus_t st_ = (call);                                                                     \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                                \
      return m3_fail(M3_ERR_CUDA, "%s failed: %s (%s)", #call, cublasLtGetStatusName(st_),          \
                     cublasLtGetStatusString(st_));                                                  \
  } while (0)

m3_status m3_gemm_init(gemm_ctx *g, cudaDataType_t act, int tf32, void *workspace, size_t workspace_bytes) {
  memset(g, 0, sizeof *g);
  g->act = act;
  g->tf32 = tf32;
  g->workspace = workspace;
  g->workspace_bytes = workspace_bytes;
  LT(cublasLtCreate(&g->lt));
  return M3_OK;
}

void m3_gemm_free(gemm_ctx *g) {
  for (int i = 0; i < g->n_plans; i++) {
    gemm_plan *p = &g->plans[i];
    cublasLtMatrixLayoutDestroy(p->la);
    cublasLtMatrixLayoutDestroy(p->lb);
    cublasLtMatrixLayoutDestroy(p->lc);
    cublasLtMatmulDescDestroy(p->desc);
  }
  free(g->plans);
  if (g->lt) cublasLtDestroy(g->lt);
  memset(g, 0, sizeof *g);
}

static int alignment(const void *p) {
  const uintptr_t v = (uintptr_t)p;
  int a = 256;
  while (a > 1 && (v % (uintptr_t)a) != 0) a >>= 1;
  return a;
}

static cudaDataType_t kind_type(const gemm_ctx *g, int kind) { return kind == G_ACT ? g->act : CUDA_R_32F; }

static int same_key(const gemm_plan *p, const gemm_op *o, const int align[4]) {
  return p->ta == o->ta && p->tb == o->tb && p->M == o->M && p->N == o->N && p->K == o->K && p->lda == o->lda &&
         p->ldb == o->ldb && p->ldd == o->ldd && p->a_kind == o->a_kind && p->b_kind == o->b_kind &&
         p->d_kind == o->d_kind && p->beta_nz == (o->beta != 0) && !memcmp(p->align, align, sizeof p->align);
}

/* The heuristic's candidate a plan keeps: its first, except for a large product of 16-bit activations (at
 * least WIDE_PICK_MACS multiply-adds) that adds into a float32 C (the residual stream's out_proj): there,
 * of the candidates that do not split K, the one with the most waves. The first choice's wide tiles leave
 * multiprocessors idle while they read C: lm130's out_proj 102 -> 68 us alone, its step -0.5 to -0.9 ms
 * (NOTES.md runs 201-204); at rl-batch and mid the first choice stays the faster (the size bound). The
 * pick depends on the heuristic's list alone. */
static int pick(const gemm_ctx *g, const gemm_op *o, const cublasLtMatmulHeuristicResult_t *res, int found) {
  if (o->ta || o->beta == 0 || o->d_kind != G_F32 || o->a_kind != G_ACT || g->act == CUDA_R_32F ||
      (double)o->M * (double)o->N * (double)o->K < WIDE_PICK_MACS)
    return 0;
  int best = 0;
  float waves = -1;
  for (int i = 0; i < found; i++) {
    int32_t splits = 1;
    size_t sz = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof splits,
                                             &sz) != CUBLAS_STATUS_SUCCESS)
      continue;
    if (splits <= 1 && res[i].wavesCount > waves) {
      best = i;
      waves = res[i].wavesCount;
    }
  }
  return best;
}

static m3_status make_plan(gemm_ctx *g, const gemm_op *o, const int align[4], gemm_plan **out) {
  if (g->n_plans == g->cap_plans) {
    int cap = g->cap_plans ? 2 * g->cap_plans : 32;
    gemm_plan *np = realloc(g->plans, (size_t)cap * sizeof *np);
    if (!np) return m3_fail(M3_ERR_MEMORY, "out of host memory for GEMM plans");
    g->plans = np;
    g->cap_plans = cap;
  }
  gemm_plan *p = &g->plans[g->n_plans];
  memset(p, 0, sizeof *p);
  p->ta = o->ta;
  p->tb = o->tb;
  p->a_kind = o->a_kind;
  p->b_kind = o->b_kind;
  p->d_kind = o->d_kind;
  p->beta_nz = o->beta != 0;
  p->M = o->M;
  p->N = o->N;
  p->K = o->K;
  p->lda = o->lda;
  p->ldb = o->ldb;
  p->ldd = o->ldd;
  memcpy(p->align, align, sizeof p->align);
  const int f32_operands = kind_type(g, o->a_kind) == CUDA_R_32F && kind_type(g, o->b_kind) == CUDA_R_32F;
  const cublasComputeType_t ct = g->tf32 && f32_operands ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  LT(cublasLtMatmulDescCreate(&p->desc, ct, CUDA_R_32F));
  /* cuBLASLt's first operand is B's memory, its second A's (see the file comment) */
  const cublasOperation_t opa = o->tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = o->ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  LT(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
  LT(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
  const uint64_t la_rows = o->tb ? (uint64_t)o->K : (uint64_t)o->N, la_cols = o->tb ? (uint64_t)o->N : (uint64_t)o->K;
  const uint64_t lb_rows = o->ta ? (uint64_t)o->M : (uint64_t)o->K, lb_cols = o->ta ? (uint64_t)o->K : (uint64_t)o->M;
  LT(cublasLtMatrixLayoutCreate(&p->la, kind_type(g, o->b_kind), la_rows, la_cols, o->ldb));
  LT(cublasLtMatrixLayoutCreate(&p->lb, kind_type(g, o->a_kind), lb_rows, lb_cols, o->lda));
  LT(cublasLtMatrixLayoutCreate(&p->lc, kind_type(g, o->d_kind), (uint64_t)o->N, (uint64_t)o->M, o->ldd));
  cublasLtMatmulPreference_t pref;
  LT(cublasLtMatmulPreferenceCreate(&pref));
  const size_t ws = g->workspace_bytes;
  const uint32_t aa = (uint32_t)align[1], ab = (uint32_t)align[0], ac = (uint32_t)align[2], ad = (uint32_t)align[3];
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof aa);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof ab);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof ac);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ad, sizeof ad);
  const uint32_t unsplit = CUBLASLT_REDUCTION_SCHEME_NONE;
  if (st == CUBLAS_STATUS_SUCCESS && o->K <= SHORT_K)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &unsplit,
                                              sizeof unsplit);
  cublasLtMatmulHeuristicResult_t res[CANDIDATES];
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(g->lt, p->desc, p->la, p->lb, p->lc, p->lc, pref, CANDIDATES, res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found < 1) {
    cublasLtMatrixLayoutDestroy(p->la);
    cublasLtMatrixLayoutDestroy(p->lb);
    cublasLtMatrixLayoutDestroy(p->lc);
    cublasLtMatmulDescDestroy(p->desc);
    return m3_fail(M3_ERR_CUDA,
                   "cuBLASLt found no algorithm for a %lld x %lld x %lld GEMM (ta %d, tb %d, types %d/%d/%d): %s",
                   o->M, o->N, o->K, o->ta, o->tb, o->a_kind, o->b_kind, o->d_kind,
                   st != CUBLAS_STATUS_SUCCESS ? cublasLtGetStatusString(st) : "no result");
  }
  const int chosen = pick(g, o, res, found);
  p->algo = res[chosen].algo;
  p->waves = res[chosen].wavesCount;
  g->n_plans++;
  *out = p;
  return M3_OK;
}

/* The op's plan, made when new. */
static m3_status plan_of(gemm_ctx *g, const gemm_op *o, gemm_plan **out) {
  const int align[4] = {alignment(o->A), alignment(o->B), alignment(o->C ? o->C : o->D), alignment(o->D)};
  for (int i = 0; i < g->n_plans; i++)
    if (same_key(&g->plans[i], o, align)) {
      *out = &g->plans[i];
      return M3_OK;
    }
  return make_plan(g, o, align, out);
}

m3_status m3_gemm_waves(gemm_ctx *g, const gemm_op *o, float *waves) {
  gemm_plan *p = NULL;
  *waves = 0;
  if (o->M <= 0 || o->N <= 0 || o->K <= 0) return M3_OK;
  TRY(plan_of(g, o, &p));
  *waves = p->waves;
  return M3_OK;
}

m3_status m3_gemm(gemm_ctx *g, cudaStream_t s, const gemm_op *o) {
  if (o->M <= 0 || o->N <= 0 || o->K <= 0) return M3_OK;
  gemm_plan *p = NULL;
  TRY(plan_of(g, o, &p));
  const float alpha = 1.0f, beta = o->beta;
  LT(cublasLtMatmul(g->lt, p->desc, &alpha, o->B, p->la, o->A, p->lb, &beta, o->C ? o->C : o->D, p->lc, o->D, p->lc,
                    &p->algo, g->workspace, g->workspace_bytes, s));
  return M3_OK;
}

/*
 * mma_tile.cuh — 16 x 16 float32 tiles of bf16 tensor-core products for one warp, on mma.sync
 * (m16n8k16, float32 accumulation) with ldmatrix loads from shared memory: the warp-level primitive
 * of the chunked scan (scan_chunked.cu; decode_fused.cu uses the m16n8k16 step for its GEMVs). The accumulator layout is the mma's, so element-wise
 * work can address it: element e of acc16::v sits at row acc_row(e), column acc_col(e) of the tile.
 * Operands are bf16 tiles in shared memory, row-major (X[i ld + k]) or column-major (X[k ld + i]),
 * with 16-byte aligned rows (ld a multiple of 8). Each product runs its K loop in order.
 */
#pragma once

#include <cuda_bf16.h>

struct acc16 {
  float v[8]; /* v[4 b + 2 r + q]: row (lane / 4) + 8 r, column 8 b + 2 (lane % 4) + q */
};

__device__ __forceinline__ int acc_row(int e) { return (threadIdx.x & 31) / 4 + 8 * ((e >> 1) & 1); }
__device__ __forceinline__ int acc_col(int e) { return 8 * (e >> 2) + 2 * (threadIdx.x & 3) + (e & 1); }

__device__ __forceinline__ void acc_zero(acc16 &c) {
#pragma unroll
  for (int e = 0; e < 8; e++) c.v[e] = 0.0f;
}

/* The tile to float32 memory (shared or global; row stride ld, even). */
__device__ __forceinline__ void acc_store(float *C, int ld, const acc16 &c) {
#pragma unroll
  for (int e = 0; e < 8; e += 2) *(float2 *)(C + acc_row(e) * ld + acc_col(e)) = make_float2(c.v[e], c.v[e + 1]);
}

__device__ __forceinline__ void ldsm4(unsigned addr, unsigned (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm4_t(unsigned addr, unsigned (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void mma16816(float *c, const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* The same step with f16 operands. */
__device__ __forceinline__ void mma16816_f16(float *c, const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* This lane's ldmatrix row address for 8 x 8 matrix m = lane / 8 of a 16 x 16 block whose first
 * memory row is at X: m covers memory rows 8 (m & 1) + 0..7 and columns 8 (m >> 1) + 0..7 when
 * row_bit_first, else rows 8 (m >> 1) + 0..7 and columns 8 (m & 1) + 0..7. */
__device__ __forceinline__ unsigned lds_addr(const __nv_bfloat16 *X, int ld, bool row_bit_first) {
  const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
  const int rb = row_bit_first ? (m & 1) * 8 : (m >> 1) * 8, cb = row_bit_first ? (m >> 1) * 8 : (m & 1) * 8;
  return (unsigned)__cvta_generic_to_shared(X + (rb + r) * ld + cb);
}

/* Byte offsets in shared memory of k = 16 along an operand: along a row (row-major A, column-major
 * B) or down ld rows. */
__device__ __forceinline__ unsigned k16_step(bool along_row, int ld) { return along_row ? 32u : 32u * ld; }

/* One k16 step of c += A B with the lane's ldmatrix addresses aa, ba (lds_addr); see mma_tile.
 * ldsm_b loads the B fragment alone, and mma_k16_a takes it loaded (several tiles of one column). */
template <bool B_ROW> __device__ __forceinline__ void ldsm_b(unsigned ba, unsigned (&b)[4]) {
  if (B_ROW) ldsm4_t(ba, b);
  else ldsm4(ba, b);
}
template <bool A_ROW> __device__ __forceinline__ void mma_k16_a(acc16 &c, unsigned aa, const unsigned (&b)[4]) {
  unsigned a[4];
  if (A_ROW) ldsm4(aa, a);
  else ldsm4_t(aa, a);
  mma16816(c.v, a, b[0], b[1]);
  mma16816(c.v + 4, a, b[2], b[3]);
}
template <bool A_ROW, bool B_ROW>
__device__ __forceinline__ void mma_k16(acc16 &c, unsigned aa, unsigned ba) {
  unsigned b[4];
  ldsm_b<B_ROW>(ba, b);
  mma_k16_a<A_ROW>(c, aa, b);
}

/* c += A[16 x K] B[K x 16]: A's tile at A (row-major: A[i lda + k]; column-major: A[k lda + i]),
 * B's at B (row-major: B[k ldb + j]; column-major: B[j ldb + k]); K a multiple of 16.
 * A's fragment a0..a3 = (i 0-7, k 0-7), (i 8-15, k 0-7), (i 0-7, k 8-15), (i 8-15, k 8-15):
 * row-major, memory rows are i (plain ldmatrix); column-major, memory rows are k (transposed).
 * B's b0, b1 (k 0-7, k 8-15) of columns 0-7, then of columns 8-15, i.e. (k 0-7, j 0-7),
 * (k 8-15, j 0-7), (k 0-7, j 8-15), (k 8-15, j 8-15): row-major, memory rows are k (transposed);
 * column-major, memory rows are j (plain). */
template <bool A_ROW, bool B_ROW>
__device__ __forceinline__ void mma_tile(acc16 &c, const __nv_bfloat16 *A, int lda, const __nv_bfloat16 *B, int ldb,
                                         int K) {
  unsigned aa = lds_addr(A, lda, A_ROW), ba = lds_addr(B, ldb, B_ROW);
  const unsigned as = k16_step(A_ROW, lda), bs = k16_step(!B_ROW, ldb);
  for (int k = 0; k < K; k += 16, aa += as, ba += bs) mma_k16<A_ROW, B_ROW>(c, aa, ba);
}

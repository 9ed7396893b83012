/*
 * scan_math.cuh — the per-token math shared by the scan kernels (scan.cu: the float32 SIMT
 * scan; scan_chunked.cu: the tensor-core chunked scan for the 16-bit precisions), so that both
 * compute the token scalars and the angle walk with the same formulas as the CPU reference
 * (engine/src/cpu/scan.c), and the launchers of the chunked scan that scan.cu dispatches to.
 */
#ifndef M3_KERNELS_SCAN_MATH_CUH
#define M3_KERNELS_SCAN_MATH_CUH

#include "common.cuh"

#define PI_F 3.14159265358979323846f
#define TWO_PI_F 6.28318530717958647692f

struct tok_scalars {
  float dt, A, lam, alpha, beta, gamma, dsp, dAd;
};

__device__ __forceinline__ tok_scalars token_scalars(float dd_dt, float dt_bias, float dd_A, float trap,
                                                     float a_floor) {
  tok_scalars s;
  const float v = dd_dt + dt_bias, av = fabsf(v);
  s.dt = (v > 0 ? v : 0) + log1pf(expf(-av));
  s.dsp = 1 / (1 + expf(-v));
  const float f = dd_A >= 0 ? 1 + dd_A : 1 / (1 - dd_A);
  const float fp = dd_A >= 0 ? 1 : 1 / ((1 - dd_A) * (1 - dd_A));
  if (-f <= -a_floor) {
    s.A = -f;
    s.dAd = -fp;
  } else {
    s.A = -a_floor;
    s.dAd = 0;
  }
  s.lam = 1 / (1 + expf(-trap));
  s.alpha = expf(s.A * s.dt);
  s.beta = (1 - s.lam) * s.dt * s.alpha;
  s.gamma = s.lam * s.dt;
  return s;
}

__device__ __forceinline__ float wrap_angle(float v) {
  v = fmodf(v, TWO_PI_F);
  if (v < 0) v += TWO_PI_F;
  if (v >= TWO_PI_F) v -= TWO_PI_F;
  return v;
}

/* theta + inc wrapped into [0, 2 pi) exactly as wrap_angle(theta + inc), without fmodf in the
 * common case (|result before wrapping| < 4 pi: the subtraction is exact there, as fmod is). */
__device__ __forceinline__ float wrap_sum(float v, float inc) {
  float w = v + inc;
  if (w >= 0 && w < 2 * TWO_PI_F) {
    if (w >= TWO_PI_F) w -= TWO_PI_F;
  } else if (w < 0 && w > -TWO_PI_F) {
    w += TWO_PI_F;
    if (w >= TWO_PI_F) w -= TWO_PI_F;
  } else {
    w = wrap_angle(w);
  }
  return w;
}

/* ---- the chunked scan (scan_chunked.cu) ---------------------------------------------------------- */

/* Dynamic shared memory of the chunked kernels for (P, N, S); 0 when they do not apply. */
int64_t m3k_chunked_smem(int fwd, int32_t P, int32_t N, int32_t S);
cudaError_t m3k_chunked_prepare(int prec, const m3k_scan_plan *plan);
cudaError_t m3k_chunked_fwd(cudaStream_t s, int prec, const m3k_scan_plan *plan, const m3k_scan_args *a);
cudaError_t m3k_chunked_bwd(cudaStream_t s, int prec, const m3k_scan_plan *plan, const m3k_scan_args *a);

#endif

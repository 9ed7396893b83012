/*
 * decode_fused.cu — the one-token inference step of a small model in one launch (m3k_decode_step):
 * a cluster of C CTAs per row runs every layer and norm_f from the row's input h0 (SPEC.md §3),
 * with the residual stream, the layer's projections and its carried state in shared memory. Per
 * layer:
 *
 *   xn = RMSNorm(h) -> proj = in_proj xn (a GEMV over the act-type weights, float32 sums)
 *   -> B_hat, C_hat (RMSNorm per group) -> token scalars, angles, rotated k and q per head
 *   -> H = alpha H_in + beta x_in k_in^T + gamma x k^T, y = H q + D x -> [mixer norm] and gate
 *   -> h += out_proj gated (GEMV)
 *
 * Why: the unfused decode of a small model is four launches per layer (rmsnorm.cu, cuBLAS,
 * scan_step.cu with the B/C norm, cuBLAS), each a few microseconds of launch latency around well
 * under a microsecond of work. Here a step is one launch. Every cluster reads all the weights (from
 * L2 after the first row), so the step applies only where a layer's weights are small:
 * m3k_decode_smem decides, and returns 0 elsewhere (the caller keeps the unfused path).
 *
 * The cluster (distributed shared memory): every CTA keeps the whole residual stream, proj and
 * gated; the GEMVs' 16-row tiles are dealt over the CTAs (own_tiles) and their warps, and each
 * result is stored into every CTA's copy; the heads are split into C contiguous ranges (a CTA's
 * carried state, token math, state update and gate are its own heads'). Three cluster barriers a
 * layer: after in_proj, after the gate, after out_proj. A single CTA walked one chain of dependent
 * phases per layer (kernels/NOTES.md, runs 17-21); C CTAs walk it with 1 / C of the weight rows and
 * heads. Where a CTA's tiles of every layer fit in shared memory (rl: 28 KB a layer at C = 8), it
 * copies them all in at the start (bulk copies, a barrier per layer), so the GEMVs read shared
 * memory instead of waiting on L2 in the chain.
 *
 * The same formulas and roundings as the unfused path: xn, proj and gated are rounded to the
 * activation type where that path stores them; the norms sum in rmsnorm_fwd_kernel's and
 * bcnorm_fwd_kernel's lane order; the state update and y use scan_step's lane tile and butterfly
 * order (step_tile_for), the token math scan_math.cuh's. Only the GEMV sums differ in order from
 * cuBLAS (agreement within SPEC.md §8, not bitwise); they run on tensor cores (mma, float32
 * accumulation), which is why the step is for bf16 and f16 only: f32 models take no tensor cores
 * (SPEC.md §8), and a float32-FMA version measured slower than the per-layer launches at B 1
 * (rl: 90 vs 65 µs per step; kernels/NOTES.md). Every value is computed by one warp in one order
 * whatever C is, so the result does not depend on the cluster size (bitwise; the tests check it).
 *
 * Overlap: a layer's carried state (ssm, k, v, angles: the CTA's heads) and its small parameters
 * (norm weights, biases, D; two slots, by layer parity) are copied into shared memory by cp.async
 * (by the warps the gate leaves idle) while the previous layer's gate and out_proj run. h0 and the
 * resets may be pinned host memory (the caller's staging, read once).
 * In place: every carried value is in shared memory before its slot is written back, and each
 * slot is written once. A reset at the token counts the incoming state as zero. Every sum has a
 * fixed order: bitwise repeatable.
 */
#include <cooperative_groups.h>
#include <type_traits>

#include "mma_tile.cuh"
#include "scan_math.cuh"

namespace cg = cooperative_groups;

enum { DEC_THREADS = 256, DEC_WARPS = DEC_THREADS / 32, DEC_KCH = 8 /* GEMV: 32-column chunks in flight per lane */ };
enum { DEC_MAX_CLUSTER = 16 }; /* CTAs per row at most (16: a non-portable cluster size) */
static const int64_t DEC_MAX_LAYER_BYTES = (int64_t)512 << 10; /* in_proj + out_proj weights of a layer */

/* Byte offsets of the shared-memory arrays (each 16-byte aligned); total = the dynamic size. */
struct decode_smem {
  int res, xn, proj, bc, k, q, kin, ssm, vin, ang, bx, gx, y, gated, al, yr, lay, bars, wts;
  int par[2], norm, B_norm, C_norm, dt_bias, D, B_bias, C_bias, out_norm, par_bytes; /* a layer's parameters */
  int total;
};
__host__ __device__ inline decode_smem decode_layout(const m3k_dims &d, int L, int act_bytes) {
  decode_smem o;
  int off = 0;
  auto take = [&](int bytes) {
    const int at = off;
    off += (bytes + 15) / 16 * 16;
    return at;
  };
  const int F = (int)sizeof(float), HP = d.H * d.P;
  o.res = take(d.dm * F);             /* the residual stream h [dm] */
  o.xn = take(d.dm * act_bytes);      /* RMSNorm(h) [dm], act */
  o.proj = take(d.dipp * F);          /* in_proj's output [dip] (act values) */
  o.bc = take(2 * d.G * d.N * F);     /* B_hat, C_hat [2, G, N] */
  o.k = take(d.H * d.N * F);          /* rotated k [H, N] */
  o.q = take(d.H * d.N * F);          /* rotated q [H, N] */
  o.kin = take(d.H * d.N * F);        /* carried k [H, N] */
  o.ssm = take(HP * d.N * F);         /* carried state [H, P, N] */
  o.vin = take(HP * F);               /* carried x [H, P] */
  o.ang = take(d.H * d.S * F);        /* carried angles [H, S] */
  o.bx = take(HP * F);                /* beta x_in [H, P] */
  o.gx = take(HP * F);                /* gamma x [H, P] */
  o.y = take(HP * F);                 /* H q [H, P] */
  o.gated = take(d.E * act_bytes);    /* gate output [E], act */
  o.al = take(d.H * F);               /* alpha [H] */
  o.yr = take(d.H * F);               /* the mixer norm's y_rstd [H] (not kept) */
  o.lay = take(L * (int)sizeof(m3k_decode_layer));
  const int par0 = off; /* the small parameters, at offsets within a slot */
  o.norm = take(d.dm * F) - par0;
  o.B_norm = take(d.N * F) - par0;
  o.C_norm = take(d.N * F) - par0;
  o.dt_bias = take(d.H * F) - par0;
  o.D = take(d.H * F) - par0;
  o.B_bias = take(d.H * d.N * F) - par0;
  o.C_bias = take(d.H * d.N * F) - par0;
  o.out_norm = take(d.outproj_norm ? HP * F : 0) - par0;
  o.par_bytes = off - par0;
  o.par[0] = par0;
  o.par[1] = take(o.par_bytes);
  o.bars = take(L * 8); /* one mbarrier per layer: its weight tiles have landed */
  o.wts = off;          /* the CTA's weight tiles of every layer (decode_layer_weights), when they fit */
  o.total = off;
  return o;
}

/* The GEMV tiles (16 rows) of a CTA: of a GEMV with T tiles, tile t belongs to CTA t % C as its
 * (t / C)-th, taken by warp (t / C) % DEC_WARPS. A CTA's copy of a layer's weights (when they fit in
 * shared memory) is its in_proj tiles, then its out_proj tiles, each at most 16 rows, in that order,
 * every CTA sized as the one with the most. */
__host__ __device__ inline int own_tiles(int J, int C) { return ((J + 15) / 16 + C - 1) / C; }
/* elements of a CTA's in_proj tiles, and of its whole copy of a layer */
__host__ __device__ inline int64_t in_proj_weights(const m3k_dims &d, int C) { return (int64_t)own_tiles(d.dip, C) * 16 * d.dm; }
__host__ __device__ inline int64_t decode_layer_weights(const m3k_dims &d, int C) {
  return in_proj_weights(d, C) + (int64_t)own_tiles(d.dm, C) * 16 * d.E;
}

/* emit(j, sum_k x[k] W[j, k]) for j < J, by one lane per row: W row-major [J, K] (act type, K a
 * multiple of 32, rows 16-byte aligned), x [K] act in shared memory. On tensor cores (mma m16n8k16,
 * float32 accumulation, as cuBLAS runs the unfused path's), a warp 16 rows at a time: lane
 * (g, t) = (lane / 4, lane % 4) loads 16 bytes of rows g and g + 8 at columns 8 t .. 8 t + 7 of each
 * 32-column chunk, and the same columns of x; mma step s of the chunk takes words 2 s, 2 s + 1 of
 * them as its k pairs (2 t, 2 t + 1) and (2 t + 8, 2 t + 9). A and B use the same k order, so the
 * product is the row sums; every column of B is x, so every column of C holds them, and lanes t = 0
 * emit column 0 (rows g, g + 8). The row tiles are this CTA's of C (own_tiles); ws: its copy of them
 * in shared memory (NULL: read W). */
template <typename T, typename Emit>
__device__ __forceinline__ void gemv(const T *__restrict__ W, const T *ws, int J, int K, const T *x, int rank, int C,
                                     Emit emit) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint4 *xv = (const uint4 *)x + t;
  for (int i = threadIdx.x >> 5;; i += DEC_WARPS) {
    const int j0 = 16 * (rank + C * i);
    if (j0 >= J) break;
    const int r0 = j0 + g, r1 = r0 + 8;
    const T *base = ws ? ws + (int64_t)(16 * i - j0) * K : W;
    const uint4 *p0 = (const uint4 *)(base + (int64_t)r0 * K) + t, *p1 = (const uint4 *)(base + (int64_t)r1 * K) + t;
    float c[4] = {0, 0, 0, 0};
    for (int kc = 0; kc < K; kc += 32 * DEC_KCH) {
      uint4 u0[DEC_KCH], u1[DEC_KCH];
#pragma unroll
      for (int q = 0; q < DEC_KCH; q++) {
        const int k8 = (kc + 32 * q) / 8; /* 16-byte column of the chunk's start */
        const bool kv = kc + 32 * q < K;
        u0[q] = kv && r0 < J ? p0[k8] : make_uint4(0, 0, 0, 0);
        u1[q] = kv && r1 < J ? p1[k8] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int q = 0; q < DEC_KCH; q++) {
        if (kc + 32 * q >= K) break;
        const uint4 xq = xv[(kc + 32 * q) / 8];
        const unsigned a0[4] = {u0[q].x, u1[q].x, u0[q].y, u1[q].y}, a1[4] = {u0[q].z, u1[q].z, u0[q].w, u1[q].w};
        if constexpr (std::is_same<T, bf16>::value) {
          mma16816(c, a0, xq.x, xq.y);
          mma16816(c, a1, xq.z, xq.w);
        } else {
          mma16816_f16(c, a0, xq.x, xq.y);
          mma16816_f16(c, a1, xq.z, xq.w);
        }
      }
    }
    if (t == 0) {
      if (r0 < J) emit(r0, c[0]);
      if (r1 < J) emit(r1, c[2]);
    }
  }
}

/* n floats global -> shared, asynchronously (16-byte copies where both sides allow), by nt threads of
 * which this is thread t; not inlined: a layer's loads are a dozen calls, and the kernel's code must
 * stay small (instruction cache) */
__device__ __noinline__ void copy_async(float *dst, const float *src, int n, int t, int nt) {
  if (n % 4 == 0 && (uintptr_t)src % 16 == 0 && (uintptr_t)dst % 16 == 0) {
#pragma unroll 1
    for (int i = t; i < n / 4; i += nt) cp16(dst + 4 * i, src + 4 * i);
  } else {
#pragma unroll 1
    for (int i = t; i < n; i += nt) cp4(dst + i, src + i);
  }
}

/* v into element i of the array at local (this CTA's shared memory) in every CTA of the cluster */
template <typename V>
__device__ __forceinline__ void put_all(const cg::cluster_group &cl, V *local, int i, V v) {
  const int C = (int)cl.num_blocks();
#pragma unroll 1
  for (int r = 0; r < C; r++) cl.map_shared_rank(local, r)[i] = v;
}

template <typename T, int V, int NJ>
__global__ void __launch_bounds__(DEC_THREADS, 1) decode_kernel(const m3k_decode_args a, const int lw,
                                                                  const int weights_in_smem) {
  extern __shared__ __align__(16) unsigned char smem[];
  const cg::cluster_group cl = cg::this_cluster();
  const m3k_dims &d = a.d;
  const decode_smem o = decode_layout(d, a.L, (int)sizeof(T));
  float *s_res = (float *)(smem + o.res), *s_proj = (float *)(smem + o.proj), *s_bc = (float *)(smem + o.bc);
  float *s_k = (float *)(smem + o.k), *s_q = (float *)(smem + o.q), *s_kin = (float *)(smem + o.kin);
  float *s_ssm = (float *)(smem + o.ssm), *s_vin = (float *)(smem + o.vin), *s_ang = (float *)(smem + o.ang);
  float *s_bx = (float *)(smem + o.bx), *s_gx = (float *)(smem + o.gx), *s_y = (float *)(smem + o.y);
  float *s_al = (float *)(smem + o.al);
  T *s_xn = (T *)(smem + o.xn), *s_gated = (T *)(smem + o.gated);
  m3k_decode_layer *s_lay = (m3k_decode_layer *)(smem + o.lay);
  const int C = (int)cl.num_blocks(), rank = (int)cl.block_rank();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, b = blockIdx.x / C;
  const int P = d.P, N = d.N, S = d.S, H = d.H, dm = d.dm, U = N - S, HP = H * P;
  /* this CTA's heads [h0, h1) */
  const int hpc = (H + C - 1) / C, h0 = min(H, rank * hpc), h1 = min(H, h0 + hpc), nh = h1 - h0;
  uint64_t *s_bar = (uint64_t *)(smem + o.bars);
  const int64_t wl_elems = decode_layer_weights(d, C), in_elems = in_proj_weights(d, C);
  const bool rs = a.resets && a.resets[b];

  /* layer l's carried state (row b, this CTA's heads) and small parameters -> shared memory, by the
   * threads [t0, DEC_THREADS) (complete at cp_wait_all) */
  auto load_layer = [&](int l, int t0) {
    if (tid < t0) return;
    const int t = tid - t0, nt = DEC_THREADS - t0;
    const m3k_decode_layer &ly = s_lay[l];
    const int64_t bh = (int64_t)b * H + h0;
    copy_async(s_ssm + h0 * P * N, ly.ssm + bh * P * N, nh * P * N, t, nt);
    copy_async(s_kin + h0 * N, ly.k + bh * N, nh * N, t, nt);
    copy_async(s_vin + h0 * P, ly.v + bh * P, nh * P, t, nt);
    copy_async(s_ang + h0 * S, ly.angle + bh * S, nh * S, t, nt);
    unsigned char *par = smem + o.par[l & 1];
    copy_async((float *)(par + o.norm), ly.norm, dm, t, nt);
    copy_async((float *)(par + o.B_norm), ly.B_norm, N, t, nt);
    copy_async((float *)(par + o.C_norm), ly.C_norm, N, t, nt);
    copy_async((float *)(par + o.dt_bias), ly.dt_bias, H, t, nt);
    copy_async((float *)(par + o.D), ly.D, H, t, nt);
    copy_async((float *)(par + o.B_bias), ly.B_bias, H * N, t, nt);
    copy_async((float *)(par + o.C_bias), ly.C_bias, H * N, t, nt);
    if (d.outproj_norm) copy_async((float *)(par + o.out_norm), ly.out_norm, HP, t, nt);
    cp_commit();
  };
  /* the gate's warps (one per head of this CTA); the other threads load the next layer meanwhile */
  const int gate_warps = min(nh, DEC_WARPS), load_t0 = gate_warps < DEC_WARPS ? 32 * gate_warps : 0;

  for (int i = tid; i < a.L * (int)(sizeof(m3k_decode_layer) / 4); i += DEC_THREADS)
    ((int *)s_lay)[i] = ((const int *)a.layers)[i];
  copy_async(s_res, a.h0 + (int64_t)b * dm, dm, tid, DEC_THREADS);
  __syncthreads();
  load_layer(0, 0); /* ahead of the weight copies, which take the multiprocessor's load bandwidth for a while */
  if (weights_in_smem && warp == 0) {
    /* every layer's weight tiles of this CTA, one barrier per layer (armed by lane l for layer l), the
     * copies dealt over the lanes */
    const int Js[2] = {d.dip, dm}, Ks[2] = {dm, d.E}, nt[2] = {own_tiles(d.dip, C), own_tiles(dm, C)};
    auto tile_bytes = [&](int m, int i) { return max(0, min(16, Js[m] - 16 * (rank + C * i))) * Ks[m] * (int)sizeof(T); };
    for (int l = lane; l < a.L; l += 32) {
      unsigned bytes = 0;
      for (int m = 0; m < 2; m++)
        for (int i = 0; i < nt[m]; i++) bytes += tile_bytes(m, i);
      bar_init(&s_bar[l]);
      bar_expect_tx(&s_bar[l], bytes);
    }
    __syncwarp();
    for (int c = lane; c < a.L * (nt[0] + nt[1]); c += 32) {
      const int l = c / (nt[0] + nt[1]), m = c % (nt[0] + nt[1]) >= nt[0], i = c % (nt[0] + nt[1]) - (m ? nt[0] : 0);
      const T *W = (const T *)(m ? s_lay[l].out_proj : s_lay[l].in_proj);
      T *dst = (T *)(smem + o.wts) + l * wl_elems + (m ? in_elems : 0) + i * 16 * Ks[m];
      if (tile_bytes(m, i)) bulk_copy_in(dst, W + (int64_t)16 * (rank + C * i) * Ks[m], tile_bytes(m, i), &s_bar[l]);
    }
  }
  cp_wait_all();
  cl.sync(); /* every CTA of the cluster runs before any stores into its shared memory */

  for (int l = 0; l < a.L; l++) {
    const m3k_decode_layer &ly = s_lay[l];
    const unsigned char *par = smem + o.par[l & 1];
    const float *p_norm = (const float *)(par + o.norm), *p_dt_bias = (const float *)(par + o.dt_bias);
    const float *p_D = (const float *)(par + o.D);
    /* the fields of m3k_scan_args that rot_unit and warp_norm_gate read */
    m3k_scan_args sa;
    sa.d = d;
    sa.bc_hat = s_bc;
    sa.B_bias = (const float *)(par + o.B_bias);
    sa.C_bias = (const float *)(par + o.C_bias);
    sa.out_norm = (const float *)(par + o.out_norm);
    sa.y_rstd = (float *)(smem + o.yr);
    /* the layer norm (every warp sums the row itself), in_proj over the cluster */
    const float r = warp_rstd(s_res, dm);
    for (int j = tid; j < dm; j += DEC_THREADS) s_xn[j] = from_f<T>(s_res[j] * r * p_norm[j]);
    __syncthreads();
    const T *ws = weights_in_smem ? (const T *)(smem + o.wts) + l * wl_elems : NULL;
    if (ws) bar_wait(&s_bar[l], 0);
    gemv<T>((const T *)ly.in_proj, ws, d.dip, dm, s_xn, rank, C,
            [&](int j, float v) { put_all(cl, s_proj, j, to_f(from_f<T>(v))); });
    cl.sync();

    /* B_hat, C_hat: a warp per (B | C, group) */
    for (int it = warp; it < 2 * d.G; it += DEC_WARPS) {
      const int which = it / d.G, g = it % d.G;
      const float *x = s_proj + (which ? d.C_off : d.B_off) + g * N;
      const float *w = (const float *)(par + (which ? o.C_norm : o.B_norm));
      const float rr = warp_rstd(x, N);
      for (int n = lane; n < N; n += 32) s_bc[it * N + n] = x[n] * rr * w[n];
    }
    __syncthreads();

    /* per (head, rotation unit): the angle and the rotated k, q; per (head, row p): beta x_in, gamma x */
    for (int i = tid; i < nh * U; i += DEC_THREADS) {
      const int h = h0 + i / U, u = i % U;
      const tok_scalars ts = token_scalars(s_proj[d.dt_off + h], p_dt_bias[h], s_proj[d.A_off + h],
                                           s_proj[d.trap_off + h], d.a_floor);
      float th = 0;
      if (u < S) {
        th = wrap_sum(rs ? 0.0f : s_ang[h * S + u], PI_F * tanhf(s_proj[d.ang_off + u]) * ts.dt);
        ly.angle[((int64_t)b * H + h) * S + u] = th;
      }
      rot_unit<false>(sa, 0, h, h / d.hpg, u, th, s_k + h * N, s_q + h * N, NULL, NULL);
    }
    /* (the row items start on the first warp after the unit items': both chains run side by side) */
    const int row_t0 = min(DEC_THREADS, (nh * U + 31) / 32 * 32) % DEC_THREADS;
    for (int i = h0 * P + (tid + DEC_THREADS - row_t0) % DEC_THREADS; i < h1 * P; i += DEC_THREADS) {
      const int h = i / P;
      const tok_scalars ts = token_scalars(s_proj[d.dt_off + h], p_dt_bias[h], s_proj[d.A_off + h],
                                           s_proj[d.trap_off + h], d.a_floor);
      s_bx[i] = rs ? 0.0f : ts.beta * s_vin[i];
      s_gx[i] = ts.gamma * s_proj[d.x_off + i];
      if (i % P == 0) s_al[h] = rs ? 0.0f : ts.alpha;
    }
    __syncthreads();

    /* the final k and x; the state rows (h, p), lw lanes each: H = alpha H + bx k_in + gx k, y = H q */
    for (int i = h0 * N + tid; i < h1 * N; i += DEC_THREADS) ly.k[(int64_t)b * H * N + i] = s_k[i];
    for (int i = h0 * P + tid; i < h1 * P; i += DEC_THREADS) ly.v[(int64_t)b * HP + i] = s_proj[d.x_off + i];
    {
      const int nv = N / V, groups = DEC_THREADS / lw, gid = tid / lw, lj = tid & (lw - 1);
      float *hout = ly.ssm + (int64_t)b * HP * N;
      for (int r0 = h0 * P; r0 < h1 * P; r0 += groups) {
        const int row = r0 + gid;
        float acc = 0;
        if (row < h1 * P) {
          const int h = row / P;
          const float al = s_al[h], bx = s_bx[row], gx = s_gx[row];
#pragma unroll
          for (int j = 0; j < NJ; j++) {
            const int f = lj + lw * j;
            if (f >= nv) continue;
            const int n0 = f * V;
            float hv[V];
#pragma unroll
            for (int e = 0; e < V; e++) {
              const float kin = rs ? 0.0f : s_kin[h * N + n0 + e];
              hv[e] = al * (rs ? 0.0f : s_ssm[row * N + n0 + e]) + bx * kin + gx * s_k[h * N + n0 + e];
              acc += hv[e] * s_q[h * N + n0 + e];
            }
            state_vec<V>::store(hout + (int64_t)row * N + n0, hv);
          }
        }
        for (int w = 1; w < lw; w <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, w);
        if (row < h1 * P && lj == 0) s_y[row] = acc;
      }
    }
    __syncthreads();

    /* the next layer's state and parameters start coming; y + D x, the mixer norm and the gate (a warp
     * per head; the warp then stores the head's values into every other CTA); out_proj over the cluster */
    if (l + 1 < a.L) load_layer(l + 1, load_t0);
    for (int h = h0 + warp; h < h1; h += DEC_WARPS) {
      float yv[4];
      const float ss = warp_head_y(s_y + h * P, s_proj + d.x_off + h * P, p_D[h], P, (float *)NULL, yv);
      warp_norm_gate<T>(sa, 0, h, yv, ss, s_proj + d.z_off + h * P, s_gated + h * P);
      __syncwarp();
      for (int r = 0; r < C; r++)
        if (r != rank)
          for (int p = lane; p < P; p += 32) cl.map_shared_rank(s_gated, r)[h * P + p] = s_gated[h * P + p];
    }
    cl.sync();
    gemv<T>((const T *)ly.out_proj, ws ? ws + in_elems : NULL, dm, d.E, s_gated, rank, C,
            [&](int j, float v) { put_all(cl, s_res, j, s_res[j] + v); });
    cp_wait_all();
    cl.sync();
  }

  /* norm_f, its columns dealt over the cluster */
  const float r = warp_rstd(s_res, dm);
  if (rank == 0 && tid == 0) a.out_rstd[b] = r;
  for (int j = rank * DEC_THREADS + tid; j < dm; j += C * DEC_THREADS) {
    const float v = s_res[j] * r * a.norm_f[j];
    ((T *)a.out_act)[(int64_t)b * dm + j] = from_f<T>(v);
    a.out[(int64_t)b * dm + j] = v;
  }
}

extern "C" size_t m3k_decode_smem(int prec, const m3k_dims *d, int32_t L, int32_t max_smem) {
  const int64_t layer_bytes = ((int64_t)d->dip * d->dm + (int64_t)d->dm * d->E) * 2;
  if (prec == M3K_F32 || d->P > 128 || d->N > 256 || d->dm % 32 || d->E % 32 || layer_bytes > DEC_MAX_LAYER_BYTES)
    return 0;
  const decode_smem o = decode_layout(*d, L, 2);
  return o.total <= max_smem ? (size_t)o.total : 0;
}

/* The step kernel for each state tile (step_tile_for): V 1 (NJ 8), V 4 with NJ 1 or 2 */
enum { DEC_KERNELS = 3 };
template <typename T> static const void *decode_kernel_at(int i) {
  if (i == 0) return (const void *)decode_kernel<T, 1, 8>;
  return i == 1 ? (const void *)decode_kernel<T, 4, 1> : (const void *)decode_kernel<T, 4, 2>;
}

/* The launch of rows clusters of C CTAs with smem bytes each (*at: the cluster attribute it points to) */
static cudaLaunchConfig_t cluster_launch(cudaLaunchAttribute *at, int C, int rows, size_t smem, cudaStream_t s) {
  at->id = cudaLaunchAttributeClusterDimension;
  at->val.clusterDim.x = (unsigned)C;
  at->val.clusterDim.y = at->val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)(rows * C));
  cfg.blockDim = dim3(DEC_THREADS);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  return cfg;
}

/* Occupancy of a cluster of C CTAs per row with smem bytes each: can at least one run? */
static bool cluster_fits(const void *kernel, int C, size_t smem) {
  cudaLaunchAttribute at;
  const cudaLaunchConfig_t cfg = cluster_launch(&at, C, 1, smem, 0);
  int n = 0;
  return cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) == cudaSuccess && n > 0;
}

template <typename T> static cudaError_t decode_prepare(size_t max_smem, int32_t cap, int32_t *max_cluster) {
  int32_t best = DEC_MAX_CLUSTER;
  for (int i = 0; i < DEC_KERNELS; i++) {
    const void *k = decode_kernel_at<T>(i);
    cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)max_smem);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e != cudaSuccess) return e;
    int32_t c = best;
    while (c > 1 && !cluster_fits(k, c, max_smem)) c /= 2;
    best = c;
  }
  cudaGetLastError(); /* an occupancy query that said no leaves no error behind */
  *max_cluster = best < cap ? best : cap;
  return cudaSuccess;
}

extern "C" cudaError_t m3k_decode_prepare(int prec, size_t max_smem, int32_t cap, int32_t *max_cluster) {
  if (cap < 1) cap = 1;
  if (prec == M3K_BF16) return decode_prepare<bf16>(max_smem, cap, max_cluster);
  if (prec == M3K_F16) return decode_prepare<f16>(max_smem, cap, max_cluster);
  return cudaErrorInvalidValue;
}

template <typename T> static cudaError_t launch_decode(cudaStream_t s, const m3k_decode_args &a, size_t max_smem) {
  const step_tile t = step_tile_for(a.d.N, true); /* the state slices of a row are 16-byte aligned when N % 4 == 0 */
  const int ki = t.V == 1 ? 0 : t.NJ == 1 ? 1 : 2;
  /* the CTAs' weight tiles go to shared memory where they fit (small models, large clusters) */
  size_t smem = (size_t)decode_layout(a.d, a.L, (int)sizeof(T)).total;
  const size_t weights = (size_t)a.L * (size_t)decode_layer_weights(a.d, a.cluster) * sizeof(T);
  const int weights_in_smem = smem + weights <= max_smem;
  if (weights_in_smem) smem += weights;
  cudaLaunchAttribute at;
  const cudaLaunchConfig_t cfg = cluster_launch(&at, a.cluster, a.rows, smem, s);
  void *args[] = {(void *)&a, (void *)&t.lw, (void *)&weights_in_smem};
  return cudaLaunchKernelExC(&cfg, decode_kernel_at<T>(ki), args);
}

extern "C" cudaError_t m3k_decode_step(cudaStream_t s, int prec, const m3k_decode_args *a, size_t max_smem) {
  if (a->cluster < 1 || a->cluster > DEC_MAX_CLUSTER) return cudaErrorInvalidValue;
  if (prec == M3K_BF16) return launch_decode<bf16>(s, *a, max_smem);
  if (prec == M3K_F16) return launch_decode<f16>(s, *a, max_smem);
  return cudaErrorInvalidValue;
}

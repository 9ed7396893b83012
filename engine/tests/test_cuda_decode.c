/*
 * test_cuda_decode.c — one-token inference steps on CUDA (m3.h "inference") against the CPU.
 *
 * Each case runs the same random one-token steps (random incoming states, inputs and resets,
 * several rows) through a CPU inference object (float32, the reference), the CUDA fused step
 * (decode_fused.cu: one launch per step, small bf16 / f16 models), the CUDA per-layer launches
 * (M3_DECODE_FUSED=0 at creation), the fused step without a graph and the fused step with its
 * cluster capped (M3_DECODE_CLUSTER=1 or 3 at creation), for f32, bf16 and f16:
 *   - outputs (and "lm" logits) of every step and every layer's final state vs the CPU within
 *     SPEC.md §8 (f32 rel L2 <= 1e-5, 16-bit <= 2e-2; angles compared around the circle), for
 *     both CUDA paths;
 *   - info().fused_decode says which path ran: the small configs take the fused step, the
 *     per-layer object and a model beyond the fused step's limit do not;
 *   - graph replay = eager, bitwise;
 *   - the fused step's outputs and states do not depend on its cluster size, bitwise.
 * Configs cover P, N (the float4 and the scalar state tiles, N up to 256), G, rope_fraction
 * 0 / 0.5 / 1, outproj_norm, every input and head.
 * Exit 77 (skipped) without a CUDA device.
 */
#include "harness.h"

enum { STEPS = 5 };

typedef struct spec {
  int P, N, H, G;
  double rope;
  int outnorm, input, head, B, fused; /* fused: the fused step applies (in bf16 and f16) */
} spec;

static m3_config config_of(const spec *s) {
  return test_config(s->P, s->N, s->H, s->G, s->rope, s->outnorm, s->input, s->head, s->input == M3_INPUT_TOKENS);
}

static m3_infer *infer(const m3_weights *w, int device, int prec, int B, int graph) {
  m3_infer_cfg ic = test_infer_cfg(w, device, B);
  ic.precision = prec;
  ic.graph = graph;
  m3_infer *inf = NULL;
  CHECK_OK(m3_infer_create(&ic, &inf));
  return inf;
}

enum { N_OBJ = 5 }; /* CPU, fused (graph), per-layer, fused eager, fused with a capped cluster */

static void decode_case(int idx, const spec *s, int prec) {
  const m3_config c = config_of(s);
  m3_weights *w = NULL;
  CHECK_OK(m3_weights_create(&c, &w));
  CHECK_OK(m3_weights_init(w, 100 + (uint64_t)idx));
  m3_infer *o[N_OBJ];
  o[0] = infer(w, M3_DEVICE_CPU, M3_PRECISION_F32, s->B, 0);
  o[1] = infer(w, M3_DEVICE_CUDA, prec, s->B, 1);
  setenv("M3_DECODE_FUSED", "0", 1);
  o[2] = infer(w, M3_DEVICE_CUDA, prec, s->B, 1);
  unsetenv("M3_DECODE_FUSED");
  o[3] = infer(w, M3_DEVICE_CUDA, prec, s->B, 0);
  setenv("M3_DECODE_CLUSTER", idx % 2 ? "3" : "1", 1);
  o[4] = infer(w, M3_DEVICE_CUDA, prec, s->B, 1);
  unsetenv("M3_DECODE_CLUSTER");
  char tag[96];
  snprintf(tag, sizeof tag, "case %d %s (P %d N %d G %d rope %.1f norm %d B %d)", idx, precision_name(prec), s->P, s->N,
           s->G, s->rope, s->outnorm, s->B);
  for (int k = 0; k < N_OBJ; k++)
    if (!o[k]) {
      printf("FAIL %s: creation\n", tag);
      for (int j = 0; j < N_OBJ; j++) m3_infer_destroy(o[j]);
      m3_weights_destroy(w);
      return;
    }
  m3_infer_info info[N_OBJ];
  for (int k = 1; k < N_OBJ; k++) m3_infer_get_info(o[k], &info[k]);
  const int fused = s->fused && prec != M3_PRECISION_F32; /* the fused step is for bf16 and f16 */
  CHECK(info[1].fused_decode == fused && info[3].fused_decode == fused, "%s: fused_decode %d, expected %d", tag,
        info[1].fused_decode, fused);
  CHECK(info[2].fused_decode == 0, "%s: M3_DECODE_FUSED=0 still fused", tag);

  m3_rng r;
  m3_rng_seed(&r, 200 + (uint64_t)idx);
  long n[4];
  state_sizes(&c, s->B, n);
  for (int l = 0; l < c.n_layers; l++) {
    float *st[4];
    random_layer_state(&r, n, st);
    for (int k = 0; k < N_OBJ; k++) CHECK_OK(m3_infer_set_state(o[k], l, st[0], st[1], st[2], st[3]));
    for (int k = 0; k < 4; k++) free(st[k]);
  }

  const long dm = c.d_model, width = s->input == M3_INPUT_FEATURES ? c.input_dim : dm;
  const long nl = s->head == M3_HEAD_LM ? (long)s->B * c.vocab_size : 0;
  float *input = calloc((size_t)(s->B * width), sizeof(float));
  int32_t *tokens = calloc((size_t)s->B, sizeof(int32_t));
  uint8_t *resets = calloc((size_t)s->B, 1);
  float *out[N_OBJ], *logits[N_OBJ];
  for (int k = 0; k < N_OBJ; k++) {
    out[k] = calloc((size_t)(s->B * dm), sizeof(float));
    logits[k] = calloc((size_t)nl + 1, sizeof(float));
  }
  const double tol = prec == M3_PRECISION_F32 ? 1e-5 : 2e-2;
  double worst_out = 0, worst_state = 0;
  int eager_same = 1, cluster_same = 1;
  for (int t = 0; t < STEPS; t++) {
    for (int row = 0; row < s->B; row++) {
      tokens[row] = (int32_t)(m3_rng_next(&r) % 50);
      resets[row] = (uint8_t)(t == 2 && row == 0 ? 1 : m3_rng_next(&r) % 5 == 0);
    }
    fill_normal_f(&r, input, s->B * width, 1.0);
    m3_batch b = {0};
    b.rows = s->B;
    b.len = 1;
    if (s->input == M3_INPUT_TOKENS) b.tokens = tokens;
    else b.input = input;
    b.resets = resets;
    for (int k = 0; k < N_OBJ; k++) CHECK_OK(m3_infer_step(o[k], &b, out[k], nl ? logits[k] : NULL));
    for (int k = 1; k <= 2; k++) {
      const double e = rel_l2_ff(out[k], out[0], s->B * dm), el = nl ? rel_l2_ff(logits[k], logits[0], nl) : 0;
      worst_out = fmax(worst_out, fmax(e, el));
      CHECK(e <= tol && el <= tol, "%s step %d %s: out rel %.3g, logits rel %.3g", tag, t,
            k == 1 ? "fused" : "per-layer", e, el);
    }
    eager_same &= memcmp(out[1], out[3], (size_t)(s->B * dm) * sizeof(float)) == 0 &&
                  memcmp(logits[1], logits[3], (size_t)nl * sizeof(float)) == 0;
    cluster_same &= memcmp(out[1], out[4], (size_t)(s->B * dm) * sizeof(float)) == 0 &&
                    memcmp(logits[1], logits[4], (size_t)nl * sizeof(float)) == 0;
  }
  CHECK(eager_same, "%s: graph replay differs from eager steps", tag);
  CHECK(cluster_same, "%s: the fused step's output depends on its cluster size", tag);
  for (int l = 0; l < c.n_layers; l++) {
    float *st[N_OBJ][4];
    for (int k = 0; k < N_OBJ; k++) {
      for (int j = 0; j < 4; j++) st[k][j] = calloc((size_t)n[j] + 1, sizeof(float));
      CHECK_OK(m3_infer_get_state(o[k], l, st[k][0], st[k][1], st[k][2], st[k][3]));
    }
    for (int k = 1; k <= 2; k++)
      for (int j = 0; j < 4; j++) {
        const double e = j == 0 ? rel_angle_ff(st[k][j], st[0][j], n[j]) : rel_l2_ff(st[k][j], st[0][j], n[j]);
        worst_state = fmax(worst_state, e);
        CHECK(e <= tol, "%s layer %d %s: state %d rel %.3g", tag, l, k == 1 ? "fused" : "per-layer", j, e);
      }
    for (int j = 0; j < 4; j++)
      CHECK(memcmp(st[1][j], st[4][j], (size_t)n[j] * sizeof(float)) == 0,
            "%s layer %d: the fused step's state %d depends on its cluster size", tag, l, j);
    for (int k = 0; k < N_OBJ; k++)
      for (int j = 0; j < 4; j++) free(st[k][j]);
  }
  printf("%s: fused %d, worst out %.3g, state %.3g\n", tag, info[1].fused_decode, worst_out, worst_state);
  for (int k = 0; k < N_OBJ; k++) {
    free(out[k]);
    free(logits[k]);
    m3_infer_destroy(o[k]);
  }
  free(input);
  free(tokens);
  free(resets);
  m3_weights_destroy(w);
}

int main(void) {
  if (m3_cuda_device_count() == 0) {
    printf("skipped: no CUDA device\n");
    return 77;
  }
  const spec cases[] = {
      /* P,  N,  H, G, rope, norm, input, head, B, fused */
      {16, 16, 8, 1, 0.5, 0, M3_INPUT_IDENTITY, M3_HEAD_NONE, 1, 1},
      {8, 12, 8, 2, 0.5, 1, M3_INPUT_FEATURES, M3_HEAD_MSE, 3, 1}, /* N % 4 == 0, N / 4 not a power of two */
      {32, 64, 4, 1, 0.0, 0, M3_INPUT_TOKENS, M3_HEAD_LM, 2, 1},
      {64, 128, 2, 2, 1.0, 1, M3_INPUT_IDENTITY, M3_HEAD_NONE, 2, 1},
      {128, 256, 1, 1, 0.5, 0, M3_INPUT_FEATURES, M3_HEAD_LM, 1, 1}, /* N 256: two float4 per lane */
      {8, 256, 8, 2, 0.5, 0, M3_INPUT_TOKENS, M3_HEAD_MSE, 2, 1},
      {16, 8, 4, 2, 1.0, 1, M3_INPUT_IDENTITY, M3_HEAD_MSE, 4, 1},
      {32, 48, 4, 1, 0.0, 1, M3_INPUT_FEATURES, M3_HEAD_NONE, 2, 1}, /* scalar tile, no rotation */
      {16, 10, 4, 1, 0.5, 0, M3_INPUT_TOKENS, M3_HEAD_LM, 2, 1},      /* N % 4 != 0 */
      {64, 128, 16, 1, 0.5, 0, M3_INPUT_TOKENS, M3_HEAD_LM, 1, 0},    /* d_model 512: beyond the fused step */
  };
  const int ncases = (int)(sizeof cases / sizeof cases[0]);
  for (int p = M3_PRECISION_F32; p <= M3_PRECISION_F16; p++)
    for (int i = 0; i < ncases; i++) decode_case(i, &cases[i], p);
  return harness_finish("cuda_decode");
}

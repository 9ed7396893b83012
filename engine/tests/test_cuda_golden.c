/*
 * test_cuda_golden.c — every ../shared/golden case on the GPU through the public trainer API,
 * in f32 (SPEC.md §8 f32 tolerances: out, loss, final states rel L2 <= 1e-5, every gradient
 * <= 1e-4) and in bf16 and f16 (out, loss, final states <= 2e-2, every gradient cosine >= 0.99).
 *
 * A window is forward (carrying the file's incoming states when it has them), then one closing
 * backward_step (clip off); the gradients read back after it are the unscaled ones the update
 * saw. An f16 step that overflows at the current loss scale is repeated from the same state
 * with the halved scale, as training would.
 *
 * For "lm" cases the golden `logits` [B, T, vocab] too, every position, through the GPU
 * inference API (m3_infer, same device and precision: bf16 and f16 run on its 16-bit weight
 * shadows, one-token steps graph-replayed and, where the model is small enough, fused) at the
 * precision's `out` tolerance (1e-5 f32, 2e-2 bf16 and f16): the window stepped one token at a
 * time, each step's last-position logits being position t's, then stepped whole, its last
 * position (golden.h's golden_check_infer_logits, shared with test_golden.c), from the case's
 * incoming states and with its resets. Exit 77 without a CUDA device or without golden/.
 */
#include "golden.h"

static double cos_fd(const float *a, const double *b, long n) {
  double ab = 0, aa = 0, bb = 0;
  for (long i = 0; i < n; i++) {
    ab += a[i] * b[i];
    aa += (double)a[i] * a[i];
    bb += b[i] * b[i];
  }
  if (aa == 0 && bb == 0) return 1;
  return ab / sqrt(aa * bb + 1e-300);
}

static void run(const golden_case *g, int prec) {
  const char *file = g->file;
  const m3_config *c = &g->cfg;
  m3_config_derived dv;
  CHECK_OK(m3_config_derive(c, &dv));
  const int f32 = prec == M3_PRECISION_F32;
  const double tol_out = f32 ? 1e-5 : 2e-2;
  const char *tag = f32 ? "f32" : prec == M3_PRECISION_BF16 ? "bf16" : "f16";
  const long M = (long)g->B * g->T, dm = c->d_model, H = dv.nheads;
  char name[160];
  m3_weights *w = NULL, *grads = NULL;
  CHECK_OK(m3_weights_create(c, &w));
  CHECK_OK(m3_weights_create(c, &grads));
  if (!w || !grads) return;
  for (int32_t i = 0; i < m3_weights_count(w); i++) {
    m3_tensor_info ti;
    m3_weights_tensor(w, i, &ti);
    snprintf(name, sizeof name, "param.%s", ti.name);
    CHECK(golden_to_float(g, name, ti.data) == ti.numel, "%s: %s missing", file, name);
  }
  m3_trainer_cfg tc;
  m3_trainer_cfg_defaults(&tc);
  tc.weights = w;
  tc.device = M3_DEVICE_CUDA;
  tc.precision = prec;
  tc.batch = g->B;
  tc.seq_len = g->T;
  tc.carry_state = g->stateful;
  m3_trainer *tr = NULL;
  CHECK_OK(m3_trainer_create(&tc, &tr));
  if (!tr) {
    m3_weights_destroy(w);
    m3_weights_destroy(grads);
    return;
  }
  const long per[4] = {(long)g->B * H * dv.num_rope_angles, (long)g->B * H * c->headdim * c->d_state,
                       (long)g->B * H * c->d_state, (long)g->B * H * c->headdim};
  const long width = c->input == M3_INPUT_FEATURES ? c->input_dim : dm;
  float *input = calloc((size_t)(M * width) + 1, sizeof(float)), *d_out = calloc((size_t)(M * dm) + 1, sizeof(float));
  float *out = calloc((size_t)(M * dm), sizeof(float));
  double *ref = calloc((size_t)(per[1] + M * dm + m3_weights_arena_size(w) + 16), sizeof(double));
  float *st = calloc((size_t)(per[0] + per[1] + per[2] + per[3] + 4), sizeof(float));
  m3_file_tensor t;
  m3_batch b;
  memset(&b, 0, sizeof b);
  b.rows = g->B;
  b.len = g->T;
  if (c->input == M3_INPUT_TOKENS) b.tokens = golden_find(g, "tokens", &t) ? t.data : NULL;
  else b.input = golden_to_float(g, "input", input) ? input : NULL;
  if (c->head == M3_HEAD_LM) b.targets = golden_find(g, "targets", &t) ? t.data : NULL;
  if (c->head == M3_HEAD_NONE) b.d_out = golden_to_float(g, "d_out", d_out) ? d_out : NULL;
  b.resets = golden_find(g, "resets", &t) ? t.data : NULL;

  m3_metrics m;
  memset(&m, 0, sizeof m);
  for (int attempt = 0; attempt < 24; attempt++) {
    for (int32_t l = 0; g->stateful && l < c->n_layers; l++) {
      float *p[4] = {st, st + per[0], st + per[0] + per[1], st + per[0] + per[1] + per[2]};
      for (int k = 0; k < 4; k++) {
        snprintf(name, sizeof name, "init.%d.%s", l, GOLDEN_STATE_KINDS[k]);
        CHECK(golden_to_float(g, name, p[k]) == per[k], "%s: %s missing", file, name);
      }
      CHECK_OK(m3_trainer_set_state(tr, l, p[0], p[1], p[2], p[3]));
    }
    CHECK_OK(m3_trainer_forward(tr, &b, out));
    if (attempt == 0) {
      double e = 0, worst = 0;
      CHECK(golden_to_double(g, "out", ref) == M * dm, "%s: out missing", file);
      e = rel_l2_f(out, ref, M * dm);
      CHECK(e <= tol_out, "%s %s: out differs by %.3g", file, tag, e);
      printf("%s %s: out %.2e", file, tag, e);
      for (int32_t l = 0; l < c->n_layers; l++) {
        float *p[4] = {st, st + per[0], st + per[0] + per[1], st + per[0] + per[1] + per[2]};
        CHECK_OK(m3_trainer_get_state(tr, l, p[0], p[1], p[2], p[3]));
        for (int k = 0; k < 4; k++) {
          if (!per[k]) continue;
          snprintf(name, sizeof name, "final.%d.%s", l, GOLDEN_STATE_KINDS[k]);
          CHECK(golden_to_double(g, name, ref) == per[k], "%s: %s missing", file, name);
          e = k == 0 ? rel_angle_f(p[k], ref, per[k]) : rel_l2_f(p[k], ref, per[k]);
          CHECK(e <= tol_out, "%s %s: %s differs by %.3g", file, tag, name, e);
          worst = fmax(worst, e);
        }
      }
      printf(", final states %.2e", worst);
    }
    m3_backward_opts o = {0, 0, 1};
    CHECK_OK(m3_trainer_backward_step(tr, &b, &o, &m));
    if (!m.overflow_skipped) break;
  }
  CHECK(!m.overflow_skipped, "%s %s: every loss scale overflowed", file, tag);
  if (c->head == M3_HEAD_LM) {
    double gl = 0;
    CHECK(golden_to_double(g, "loss", &gl) == 1, "%s: loss missing", file);
    const double e = fabs(m.loss - gl) / fabs(gl);
    CHECK(e <= tol_out, "%s %s: loss %.9g vs %.9g", file, tag, m.loss, gl);
    printf(", loss %.2e", e);
    m3_infer_cfg ic;
    m3_infer_cfg_defaults(&ic);
    ic.weights = w;
    ic.device = M3_DEVICE_CUDA;
    ic.precision = prec;
    ic.batch = g->B;
    m3_infer *inf = NULL;
    CHECK_OK(m3_infer_create(&ic, &inf));
    if (inf) golden_check_infer_logits(g, inf, tag, tol_out);
    m3_infer_destroy(inf);
  }
  CHECK_OK(m3_trainer_grads(tr, grads));
  double worst = f32 ? 0 : 1;
  for (int32_t i = 0; i < m3_weights_count(grads); i++) {
    m3_tensor_info ti;
    m3_weights_tensor(grads, i, &ti);
    snprintf(name, sizeof name, "grad.%s", ti.name);
    CHECK(golden_to_double(g, name, ref) == ti.numel, "%s: %s missing", file, name);
    if (f32) {
      const double e = rel_l2_f(ti.data, ref, (long)ti.numel);
      CHECK(e <= 1e-4, "%s %s: %s differs by %.3g", file, tag, name, e);
      worst = fmax(worst, e);
    } else {
      const double cs = cos_fd(ti.data, ref, (long)ti.numel);
      CHECK(cs >= 0.99, "%s %s: %s cosine %.5f", file, tag, name, cs);
      worst = fmin(worst, cs);
    }
  }
  printf(", grads %s %.2e\n", f32 ? "worst rel" : "min cos", worst);
  fflush(stdout);
  m3_trainer_destroy(tr);
  m3_weights_destroy(w);
  m3_weights_destroy(grads);
  free(input);
  free(d_out);
  free(out);
  free(ref);
  free(st);
}

static void run_case(const golden_case *g) {
  for (int p = M3_PRECISION_F32; p <= M3_PRECISION_F16; p++) run(g, p);
}

int main(void) {
  if (m3_cuda_device_count() == 0) {
    printf("skipped: no CUDA device\n");
    return 77;
  }
  /* every 16-bit case runs the chunked tensor-core scan (by default it starts at P x N = 1024) */
  setenv("M3_SCAN_CHUNK_MIN_STATE", "0", 1);
  const int files = golden_each(run_case);
  if (files < 0) return 77;
  CHECK(files > 0, "no golden cases");
  return harness_finish("cuda_golden");
}

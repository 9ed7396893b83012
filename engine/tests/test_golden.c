/*
 * test_golden.c — the CPU model against ../shared/golden (float64 results of SPEC.md made
 * by an independent implementation). The double build must agree to 1e-9 relative; the
 * float build within SPEC.md §8 f32 tolerances (out, final states, loss 1e-5; every
 * gradient 1e-4). Skipped (exit 77) when ../shared/golden is absent.
 */
#include <cjson/cJSON.h>
#include <dirent.h>

#include "cpu/model.h"
#include "harness.h"
#include "layout.h"

static const double TOL_F64 = 1e-9, TOL_F32_OUT = 1e-5, TOL_F32_GRAD = 1e-4;
static const char *const KINDS[4] = {"angle", "ssm", "k", "v"};

typedef struct golden {
  m3_tensor_file *f;
  m3_config cfg;
  m3_dims d;
  m3_layout lay;
  int32_t B, T, stateful;
} golden;

static const m3_file_tensor *tensor(const golden *g, const char *name, m3_file_tensor *t) {
  int32_t i = m3_tensor_file_find(g->f, name);
  if (i < 0 || m3_tensor_file_get(g->f, i, t) != M3_OK) return NULL;
  return t;
}

/* Copies a tensor of any float dtype into doubles; returns its element count (0 if absent). */
static long to_double(const golden *g, const char *name, double *dst) {
  m3_file_tensor t;
  if (!tensor(g, name, &t)) return 0;
  for (long i = 0; i < t.numel; i++)
    dst[i] = t.dtype == M3_DTYPE_F64 ? ((const double *)t.data)[i] : ((const float *)t.data)[i];
  return (long)t.numel;
}

static int open_golden(const char *path, golden *g) {
  memset(g, 0, sizeof *g);
  if (m3_tensor_file_open(path, &g->f) != M3_OK) return 0;
  const char *json = m3_tensor_file_metadata(g->f, "config");
  cJSON *o = json ? cJSON_Parse(json) : NULL;
  if (!o || m3_config_from_json(json, &g->cfg) != M3_OK) return 0;
  g->B = cJSON_GetObjectItem(o, "batch")->valueint;
  g->T = cJSON_GetObjectItem(o, "seq_len")->valueint;
  g->stateful = cJSON_GetObjectItem(o, "stateful")->valueint;
  cJSON_Delete(o);
  m3_dims_from_config(&g->cfg, &g->d);
  return m3_layout_build(&g->cfg, &g->lay) == M3_OK;
}

/* Runs the double model, or the float model converted from it, and compares. */
static void run(const golden *g, const char *file, int use_float) {
  const m3_dims *d = &g->d;
  const long M = (long)g->B * g->T, total = g->lay.total;
  const double tol_out = use_float ? TOL_F32_OUT : TOL_F64, tol_grad = use_float ? TOL_F32_GRAD : TOL_F64;
  const char *tag = use_float ? "f32" : "f64";
  char name[128];
  double *params = calloc((size_t)total, sizeof(double));
  for (int32_t i = 0; i < g->lay.n; i++) {
    snprintf(name, sizeof name, "param.%s", g->lay.t[i].name);
    CHECK(to_double(g, name, params + g->lay.t[i].offset) == g->lay.t[i].numel, "%s: %s missing", file, name);
  }
  double *input = calloc((size_t)(M * d->input_dim), sizeof(double)), *d_out = calloc((size_t)(M * d->dm), sizeof(double));
  to_double(g, "input", input);
  to_double(g, "d_out", d_out);
  m3_file_tensor t;
  const int32_t *tokens = tensor(g, "tokens", &t) ? t.data : NULL;
  const int32_t *targets = tensor(g, "targets", &t) ? t.data : NULL;
  const uint8_t *resets = tensor(g, "resets", &t) ? t.data : NULL;

  /* everything below is done in double, then copied through float when use_float */
  cpu_model_f64 *m64 = NULL;
  cpu_model_f32 *m32 = NULL;
  double *grads64 = calloc((size_t)total, sizeof(double));
  float *p32 = calloc((size_t)total, sizeof(float)), *g32 = calloc((size_t)total, sizeof(float));
  float *in32 = calloc((size_t)(M * d->input_dim), sizeof(float)), *do32 = calloc((size_t)(M * d->dm), sizeof(float));
  for (long i = 0; i < total; i++) p32[i] = (float)params[i];
  for (long i = 0; i < M * d->input_dim; i++) in32[i] = (float)input[i];
  for (long i = 0; i < M * d->dm; i++) do32[i] = (float)d_out[i];
  if (use_float) {
    CHECK_OK(cpu_model_create_f32(d, &g->lay, g->B, g->T, &m32));
    m32->params = p32;
    m32->grads = g32;
  } else {
    CHECK_OK(cpu_model_create_f64(d, &g->lay, g->B, g->T, &m64));
    m64->params = params;
    m64->grads = grads64;
  }
  const long per[4] = {(long)g->B * d->H * d->S, (long)g->B * d->H * d->P * d->N, (long)g->B * d->H * d->N,
                       (long)g->B * d->H * d->P};
  double *buf = calloc((size_t)(per[1] + per[0] + per[2] + per[3] + M * d->dm + total + 16), sizeof(double));
  for (int32_t l = 0; g->stateful && l < d->L; l++)
    for (int k = 0; k < 4; k++) {
      snprintf(name, sizeof name, "init.%d.%s", l, KINDS[k]);
      CHECK(to_double(g, name, buf) == per[k], "%s: %s missing", file, name);
      for (long i = 0; i < per[k]; i++) {
        double *s64[4] = {m64 ? m64->state.angle : 0, m64 ? m64->state.ssm : 0, m64 ? m64->state.k : 0,
                          m64 ? m64->state.v : 0};
        float *s32[4] = {m32 ? m32->state.angle : 0, m32 ? m32->state.ssm : 0, m32 ? m32->state.k : 0,
                         m32 ? m32->state.v : 0};
        if (m64) s64[k][l * per[k] + i] = buf[i];
        else s32[k][l * per[k] + i] = (float)buf[i];
      }
    }
  const double *out_d;
  double loss = 0;
  int has_loss = 0;
  double *out_conv = calloc((size_t)(M * d->dm), sizeof(double));
  if (m64) {
    cpu_batch_f64 b = {g->B, g->T, input, tokens, targets, NULL, NULL, d_out, resets};
    cpu_head_result_f64 r;
    CHECK_OK(cpu_model_forward_f64(m64, &b, g->stateful, 1));
    CHECK_OK(cpu_model_head_f64(m64, &b, 1, 1, &r));
    CHECK_OK(cpu_model_backward_f64(m64));
    out_d = m64->out;
    loss = r.loss;
    has_loss = r.has_loss;
  } else {
    cpu_batch_f32 b = {g->B, g->T, in32, tokens, targets, NULL, NULL, do32, resets};
    cpu_head_result_f32 r;
    CHECK_OK(cpu_model_forward_f32(m32, &b, g->stateful, 1));
    CHECK_OK(cpu_model_head_f32(m32, &b, 1, 1, &r));
    CHECK_OK(cpu_model_backward_f32(m32));
    for (long i = 0; i < M * d->dm; i++) out_conv[i] = m32->out[i];
    for (long i = 0; i < total; i++) grads64[i] = g32[i];
    out_d = out_conv;
    loss = r.loss;
    has_loss = r.has_loss;
  }
  double *ref = buf;
  CHECK(to_double(g, "out", ref) == M * d->dm, "%s: out missing", file);
  double e = rel_l2(out_d, ref, M * d->dm);
  CHECK(e <= tol_out, "%s %s: out differs by %.3g", file, tag, e);
  printf("%s %s: out %.2e", file, tag, e);
  if (has_loss) {
    double gl;
    CHECK(to_double(g, "loss", &gl) == 1, "%s: loss missing", file);
    e = fabs(loss - gl) / fabs(gl);
    CHECK(e <= tol_out, "%s %s: loss %.17g vs %.17g (%.3g)", file, tag, loss, gl, e);
    printf(", loss %.2e", e);
  }
  double worst = 0;
  for (int32_t i = 0; i < g->lay.n; i++) {
    snprintf(name, sizeof name, "grad.%s", g->lay.t[i].name);
    CHECK(to_double(g, name, ref) == g->lay.t[i].numel, "%s: %s missing", file, name);
    e = rel_l2(grads64 + g->lay.t[i].offset, ref, g->lay.t[i].numel);
    CHECK(e <= tol_grad, "%s %s: %s differs by %.3g", file, tag, name, e);
    worst = fmax(worst, e);
  }
  printf(", worst grad %.2e", worst);
  worst = 0;
  for (int32_t l = 0; l < d->L; l++)
    for (int k = 0; k < 4; k++) {
      snprintf(name, sizeof name, "final.%d.%s", l, KINDS[k]);
      CHECK(to_double(g, name, ref) == per[k], "%s: %s missing", file, name);
      double *got = ref + per[k];
      for (long i = 0; i < per[k]; i++) {
        const double *s64[4] = {m64 ? m64->state.angle : 0, m64 ? m64->state.ssm : 0, m64 ? m64->state.k : 0,
                                m64 ? m64->state.v : 0};
        const float *s32[4] = {m32 ? m32->state.angle : 0, m32 ? m32->state.ssm : 0, m32 ? m32->state.k : 0,
                               m32 ? m32->state.v : 0};
        got[i] = m64 ? s64[k][l * per[k] + i] : s32[k][l * per[k] + i];
      }
      e = rel_l2(got, ref, per[k]);
      CHECK(e <= tol_out, "%s %s: %s differs by %.3g", file, tag, name, e);
      worst = fmax(worst, e);
    }
  printf(", worst final state %.2e\n", worst);
  cpu_model_destroy_f64(m64);
  cpu_model_destroy_f32(m32);
  free(params);
  free(grads64);
  free(p32);
  free(g32);
  free(in32);
  free(do32);
  free(input);
  free(d_out);
  free(out_conv);
  free(buf);
}

int main(void) {
  char dir[4200], path[4600];
  snprintf(dir, sizeof dir, "%s/golden", shared_dir());
  DIR *dp = opendir(dir);
  if (!dp) {
    printf("skipped: no ../shared/golden (looked in %s)\n", dir);
    return 77;
  }
  int files = 0;
  struct dirent *de;
  while ((de = readdir(dp))) {
    const char *dot = strrchr(de->d_name, '.');
    if (!dot || strcmp(dot, ".safetensors") != 0) continue;
    snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
    golden g;
    CHECK(open_golden(path, &g), "%s: cannot open: %s", de->d_name, m3_last_error());
    if (!g.f) continue;
    run(&g, de->d_name, 0);
    run(&g, de->d_name, 1);
    files++;
    m3_layout_free(&g.lay);
    m3_tensor_file_close(g.f);
  }
  closedir(dp);
  CHECK(files >= 4, "expected the four golden cases, found %d", files);
  return harness_finish("golden");
}

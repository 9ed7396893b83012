/*
 * golden.h — reading the ../shared/golden cases (golden/README.md) for the C tests: one case
 * per safetensors file, its model config and window from the metadata, tensors copied out
 * as double or float; and the check of an "lm" case's `logits` [B, T, vocab] through the
 * inference API (golden_check_infer_logits: the window stepped one token at a time, each
 * step's last-position logits being position t's, then stepped whole, from the case's
 * incoming states and with its resets), shared by test_golden.c and test_cuda_golden.c.
 * Header-only, next to harness.h.
 */
#ifndef M3_TEST_GOLDEN_H
#define M3_TEST_GOLDEN_H

#include <cjson/cJSON.h>
#include <dirent.h>

#include "harness.h"

static const char *const GOLDEN_STATE_KINDS[4] = {"angle", "ssm", "k", "v"};

typedef struct golden_case {
  const char *file; /* the file's name, for messages */
  m3_tensor_file *f;
  m3_config cfg;
  int32_t B, T, stateful;
} golden_case;

static inline int golden_find(const golden_case *g, const char *name, m3_file_tensor *t) {
  const int32_t i = m3_tensor_file_find(g->f, name);
  return i >= 0 && m3_tensor_file_get(g->f, i, t) == M3_OK;
}

/* Copies a float tensor (F32 or F64) into doubles; returns its element count (0: absent). */
static inline long golden_to_double(const golden_case *g, const char *name, double *dst) {
  m3_file_tensor t;
  if (!golden_find(g, name, &t)) return 0;
  for (long i = 0; i < (long)t.numel; i++)
    dst[i] = t.dtype == M3_DTYPE_F64 ? ((const double *)t.data)[i] : ((const float *)t.data)[i];
  return (long)t.numel;
}

/* The same into floats. */
static inline long golden_to_float(const golden_case *g, const char *name, float *dst) {
  m3_file_tensor t;
  if (!golden_find(g, name, &t)) return 0;
  for (long i = 0; i < (long)t.numel; i++)
    dst[i] = t.dtype == M3_DTYPE_F64 ? (float)((const double *)t.data)[i] : ((const float *)t.data)[i];
  return (long)t.numel;
}

static inline int golden_open(const char *path, const char *file, golden_case *g) {
  memset(g, 0, sizeof *g);
  g->file = file;
  if (m3_tensor_file_open(path, &g->f) != M3_OK) return 0;
  const char *json = m3_tensor_file_metadata(g->f, "config");
  cJSON *o = json ? cJSON_Parse(json) : NULL;
  const int ok = o && m3_config_from_json(json, &g->cfg) == M3_OK;
  if (ok) {
    g->B = cJSON_GetObjectItem(o, "batch")->valueint;
    g->T = cJSON_GetObjectItem(o, "seq_len")->valueint;
    g->stateful = cJSON_GetObjectItem(o, "stateful")->valueint;
  }
  cJSON_Delete(o);
  return ok;
}

/* Calls run(case) for every case; returns how many there were, or -1 when the folder is
 * absent (after printing the "skipped" line). */
static inline int golden_each(void (*run)(const golden_case *g)) {
  char dir[4200], path[4600];
  snprintf(dir, sizeof dir, "%s/golden", shared_dir());
  DIR *dp = opendir(dir);
  if (!dp) {
    printf("skipped: no ../shared/golden (looked in %s)\n", dir);
    return -1;
  }
  int files = 0;
  struct dirent *de;
  while ((de = readdir(dp))) {
    const char *dot = strrchr(de->d_name, '.');
    if (!dot || strcmp(dot, ".safetensors") != 0) continue;
    snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
    golden_case g;
    const int ok = golden_open(path, de->d_name, &g);
    CHECK(ok, "%s: cannot read it as a golden case: %s", de->d_name, m3_last_error());
    if (ok) {
      run(&g);
      files++;
    }
    m3_tensor_file_close(g.f);
  }
  closedir(dp);
  return files;
}

/* ---- "lm" logits ------------------------------------------------------------------------------- */

/* Relative L2 error ||got - ref|| / ||ref|| of the logits of positions [t0, t0 + n) of every row:
 * ref is the case's whole `logits` [B, T, vocab], got holds [B, n, vocab]. *worst_pos (may be
 * NULL) receives the largest of the same error taken per position (over [B, vocab]). */
static inline double golden_logits_rel(const golden_case *g, const double *ref, const double *got, int32_t t0,
                                       int32_t n, double *worst_pos) {
  const long V = g->cfg.vocab_size;
  double num = 0, den = 0, worst = 0;
  for (int32_t t = 0; t < n; t++) {
    double pn = 0, pd = 0;
    for (int32_t r = 0; r < g->B; r++) {
      const double *a = got + ((long)r * n + t) * V, *b = ref + ((long)r * g->T + t0 + t) * V;
      for (long v = 0; v < V; v++) {
        pn += (a[v] - b[v]) * (a[v] - b[v]);
        pd += b[v] * b[v];
      }
    }
    worst = fmax(worst, pd > 0 ? sqrt(pn / pd) : sqrt(pn));
    num += pn;
    den += pd;
  }
  if (worst_pos) *worst_pos = worst;
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The case's `logits` [B, T, vocab] as doubles (NULL, after a failed check, when absent). */
static inline double *golden_logits_ref(const golden_case *g) {
  const long n = (long)g->B * g->T * g->cfg.vocab_size;
  double *ref = calloc((size_t)n + 1, sizeof(double));
  const long got = golden_to_double(g, "logits", ref);
  CHECK(got == n, "%s: logits: %ld elements, expected B * T * vocab = %ld", g->file, got, n);
  if (got != n) {
    free(ref);
    return NULL;
  }
  return ref;
}

/* Puts an inference object's rows where the case's window starts: zero state, then the
 * file's init.<layer>.<kind> tensors when the case is stateful. */
static inline void golden_infer_incoming(const golden_case *g, m3_infer *inf) {
  CHECK_OK(m3_infer_reset(inf, NULL, 0));
  if (!g->stateful) return;
  const m3_config *c = &g->cfg;
  m3_config_derived dv;
  CHECK_OK(m3_config_derive(c, &dv));
  const long bh = (long)g->B * dv.nheads;
  const long per[4] = {bh * dv.num_rope_angles, bh * c->headdim * c->d_state, bh * c->d_state, bh * c->headdim};
  float *st = calloc((size_t)(per[0] + per[1] + per[2] + per[3] + 4), sizeof(float));
  float *p[4] = {st, st + per[0], st + per[0] + per[1], st + per[0] + per[1] + per[2]};
  char name[64];
  for (int32_t l = 0; l < c->n_layers; l++) {
    for (int k = 0; k < 4; k++) {
      snprintf(name, sizeof name, "init.%d.%s", l, GOLDEN_STATE_KINDS[k]);
      CHECK(golden_to_float(g, name, p[k]) == per[k], "%s: %s missing", g->file, name);
    }
    CHECK_OK(m3_infer_set_state(inf, l, p[0], p[1], p[2], p[3]));
  }
  free(st);
}

/* An "lm" case's logits through inf (created with batch = B from the case's parameters; any
 * device and precision) against the file's `logits`, within tol (relative L2):
 *  - stepped: the window one token at a time (the batch's resets column by column), each
 *    step run without a logits destination and its last-position logits read afterwards with
 *    m3_infer_logits; they are position t's, so the steps give all of [B, T, vocab]; checked
 *    as a whole and per position;
 *  - whole: the window in one step from the same incoming state, its logits (the last
 *    position's) taken from the step; m3_infer_logits must then read the same values.
 * Prints ", logits <stepped> (worst position <e>, whole window's last <e>)". */
static inline void golden_check_infer_logits(const golden_case *g, m3_infer *inf, const char *tag, double tol) {
  const m3_config *c = &g->cfg;
  const int32_t B = g->B, T = g->T;
  const long V = c->vocab_size;
  double *ref = golden_logits_ref(g);
  if (!ref) return;
  const long width = c->input == M3_INPUT_TOKENS ? 1 : c->input == M3_INPUT_FEATURES ? c->input_dim : c->d_model;
  m3_file_tensor t;
  const int32_t *tokens = c->input == M3_INPUT_TOKENS && golden_find(g, "tokens", &t) ? t.data : NULL;
  float *input = calloc((size_t)((long)B * T * width) + 1, sizeof(float));
  if (c->input != M3_INPUT_TOKENS)
    CHECK(golden_to_float(g, "input", input) == (long)B * T * width, "%s: input missing", g->file);
  CHECK(c->input != M3_INPUT_TOKENS || tokens, "%s: tokens missing", g->file);
  const uint8_t *resets = golden_find(g, "resets", &t) ? t.data : NULL;
  int32_t *tok_col = calloc((size_t)B, sizeof(int32_t));
  float *in_col = calloc((size_t)(B * width) + 1, sizeof(float));
  uint8_t *res_col = calloc((size_t)B, 1);
  float *lg = calloc((size_t)(B * V), sizeof(float)), *lg2 = calloc((size_t)(B * V), sizeof(float));
  double *got = calloc((size_t)((long)B * T * V), sizeof(double));

  golden_infer_incoming(g, inf);
  int ok = c->input != M3_INPUT_TOKENS || tokens != NULL;
  for (int32_t s = 0; ok && s < T; s++) {
    for (int32_t r = 0; r < B; r++) {
      const long src = (long)r * T + s;
      if (tokens) tok_col[r] = tokens[src];
      else memcpy(in_col + r * width, input + src * width, (size_t)width * sizeof(float));
      if (resets) res_col[r] = resets[src];
    }
    m3_batch b;
    memset(&b, 0, sizeof b);
    b.rows = B;
    b.len = 1;
    if (tokens) b.tokens = tok_col;
    else b.input = in_col;
    if (resets) b.resets = res_col;
    ok = m3_infer_step(inf, &b, NULL, NULL) == M3_OK && m3_infer_logits(inf, lg) == M3_OK;
    CHECK(ok, "%s %s: logits: step %d -> %s", g->file, tag, s, m3_last_error());
    for (int32_t r = 0; ok && r < B; r++)
      for (long v = 0; v < V; v++) got[((long)r * T + s) * V + v] = lg[r * V + v];
  }
  double worst_pos = 0, e = INFINITY, e_whole = INFINITY;
  if (ok) {
    e = golden_logits_rel(g, ref, got, 0, T, &worst_pos);
    CHECK(e <= tol, "%s %s: logits (stepped token by token) differ by %.3g", g->file, tag, e);
    CHECK(worst_pos <= tol, "%s %s: logits of one position (stepped) differ by %.3g", g->file, tag, worst_pos);

    golden_infer_incoming(g, inf);
    m3_batch b;
    memset(&b, 0, sizeof b);
    b.rows = B;
    b.len = T;
    if (tokens) b.tokens = tokens;
    else b.input = input;
    b.resets = resets;
    ok = m3_infer_step(inf, &b, NULL, lg) == M3_OK && m3_infer_logits(inf, lg2) == M3_OK;
    CHECK(ok, "%s %s: logits: the whole window's step -> %s", g->file, tag, m3_last_error());
    if (ok) {
      CHECK(memcmp(lg, lg2, (size_t)(B * V) * sizeof(float)) == 0,
            "%s %s: m3_infer_logits differs from the logits its step returned", g->file, tag);
      for (long i = 0; i < B * V; i++) got[i] = lg[i];
      e_whole = golden_logits_rel(g, ref, got, T - 1, 1, NULL);
      CHECK(e_whole <= tol, "%s %s: logits (whole window, last position) differ by %.3g", g->file, tag, e_whole);
    }
  }
  printf(", logits %.2e (worst position %.2e, whole window's last %.2e)", e, worst_pos, e_whole);
  free(ref);
  free(input);
  free(tok_col);
  free(in_col);
  free(res_col);
  free(lg);
  free(lg2);
  free(got);
}

#endif

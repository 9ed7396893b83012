/*
 * golden.h — reading the ../shared/golden cases (golden/README.md) for the C tests: one case
 * per safetensors file, its model config and window from the metadata, tensors copied out
 * as double or float. Header-only, next to harness.h.
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

#endif

/*
 * weights_io.c — m3_weights_save and m3_weights_load: host weights to and from safetensors.
 *
 * Save writes every parameter as F32 under its SPEC.md §2 name, with the config JSON and a
 * format tag as metadata, atomically (safetensors.c); weights holding a NaN or an infinity are
 * refused first (M3_ERR_ARGUMENT, in the words load refuses them in), so a file saved always
 * loads. Load takes the config from the caller or from the file's "config" metadata (which
 * states every member in a file of that format), then fills each layout tensor from the file
 * tensor of the same name, bare or under the "backbone." prefix, converting F64, F16 and BF16
 * to float32.
 * Missing, mis-shaped or doubly present tensors are refused before the weights are allocated,
 * extra ones after; the one tolerated extra is a lm_head.weight equal to the embedding it is
 * tied to. A NaN or an infinity among the loaded values is refused (M3_ERR_FORMAT), naming the
 * tensor, the element and the value.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "errors.h"
#include "weights.h"

static const char backbone_prefix[] = "backbone.";

m3_status m3_weights_save(const m3_weights *w, const char *path) {
  if (!w || !path) return m3_fail(M3_ERR_ARGUMENT, "m3_weights_save: NULL weights or path");
  if (m3_weights_check_finite(w, M3_ERR_ARGUMENT) != M3_OK) return m3_fail_context(M3_ERR_ARGUMENT, "saving %s", path);
  m3_tensor_writer *tw = NULL;
  TRY(m3_tensor_writer_create(&tw));
  m3_status rc = m3_tensor_writer_add_metadata(tw, "config", m3_config_to_json(&w->cfg));
  if (rc == M3_OK) rc = m3_tensor_writer_add_metadata(tw, "format", M3_WEIGHTS_FORMAT);
  for (int32_t i = 0; rc == M3_OK && i < w->layout.n; i++) {
    const param_desc *p = &w->layout.t[i];
    rc = m3_tensor_writer_add(tw, p->name, M3_DTYPE_F32, p->ndim, p->shape, w->arena + p->offset);
  }
  if (rc == M3_OK) rc = m3_tensor_writer_write(tw, path);
  m3_tensor_writer_destroy(tw);
  return rc;
}

/* ---- load ------------------------------------------------------------------------------ */

static const char *dtype_name(int32_t dtype) {
  static const char *const names[] = {"F32", "F64", "I32",  "U8",  "F16", "BF16", "I64",
                                      "I16", "I8",  "BOOL", "U16", "U32", "U64"};
  return dtype >= 0 && dtype < (int32_t)(sizeof names / sizeof names[0]) ? names[dtype] : "?";
}

/* "[a, b, c]" into buf. */
static const char *shape_text(char *buf, size_t cap, int32_t ndim, const int64_t *shape) {
  size_t n = (size_t)snprintf(buf, cap, "[");
  for (int32_t i = 0; i < ndim && n < cap; i++)
    n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)shape[i]);
  if (n < cap) snprintf(buf + n, cap - n, "]");
  return buf;
}

static float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0) return copysignf(ldexpf((float)man, -24), sign ? -1.0f : 1.0f);
  uint32_t bits = sign | (exp == 31 ? 0xffu : exp + 112) << 23 | man << 13;
  float v;
  memcpy(&v, &bits, sizeof v);
  return v;
}

static float bf16_to_float(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float v;
  memcpy(&v, &bits, sizeof v);
  return v;
}

/* Converts a file tensor (any float dtype) into numel float32 values at dst. The reader
 * hands out 64-byte aligned data, so it is read through typed pointers. */
static m3_status to_float(const char *path, const m3_file_tensor *t, float *dst) {
  switch (t->dtype) {
    case M3_DTYPE_F32:
      memcpy(dst, t->data, (size_t)t->numel * sizeof(float));
      return M3_OK;
    case M3_DTYPE_F16:
      for (int64_t j = 0; j < t->numel; j++) dst[j] = half_to_float(((const uint16_t *)t->data)[j]);
      return M3_OK;
    case M3_DTYPE_BF16:
      for (int64_t j = 0; j < t->numel; j++) dst[j] = bf16_to_float(((const uint16_t *)t->data)[j]);
      return M3_OK;
    case M3_DTYPE_F64:
      for (int64_t j = 0; j < t->numel; j++) {
        double v = ((const double *)t->data)[j];
        dst[j] = (float)v;
        if (isfinite(v) && !isfinite(dst[j])) /* NaN and inf: refused below for every dtype */
          return m3_fail(M3_ERR_FORMAT, "%s: tensor %s: element %lld is %g, outside float32's range", path, t->name,
                         (long long)j, v);
      }
      return M3_OK;
    default:
      return m3_fail(M3_ERR_FORMAT, "%s: tensor %s has dtype %s; weights must be F32, F64, F16 or BF16", path, t->name,
                     dtype_name(t->dtype));
  }
}

static m3_status check_shape(const char *path, const m3_file_tensor *t, const param_desc *p) {
  int same = t->ndim == p->ndim;
  for (int32_t i = 0; same && i < p->ndim; i++) same = t->shape[i] == p->shape[i];
  if (same) return M3_OK;
  char want[128], got[128];
  return m3_fail(M3_ERR_FORMAT, "%s: tensor %s: expected shape %s, got %s", path, t->name,
                 shape_text(want, sizeof want, p->ndim, p->shape), shape_text(got, sizeof got, t->ndim, t->shape));
}

/* The file index of a parameter, under its bare or its "backbone." name (not both). */
static m3_status find_param(const char *path, const m3_tensor_file *f, const param_desc *p, int32_t *index) {
  char prefixed[sizeof backbone_prefix + M3_NAME_CAP];
  snprintf(prefixed, sizeof prefixed, "%s%s", backbone_prefix, p->name);
  int32_t bare = m3_tensor_file_find(f, p->name), pre = m3_tensor_file_find(f, prefixed);
  if (bare >= 0 && pre >= 0)
    return m3_fail(M3_ERR_FORMAT, "%s: both %s and %s are present; keep one", path, p->name, prefixed);
  if (bare < 0 && pre < 0) {
    char want[128];
    return m3_fail(M3_ERR_FORMAT, "%s: missing tensor %s (shape %s): the file has neither %s nor %s", path, p->name,
                   shape_text(want, sizeof want, p->ndim, p->shape), p->name, prefixed);
  }
  *index = bare >= 0 ? bare : pre;
  return M3_OK;
}

/* Every parameter of a validated config's layout is in the file with its shape: checked before the weights are
 * allocated, so that a small file (or a caller's config) naming a huge model is refused without first zeroing
 * that model's memory (the arena is then in proportion to the tensor data the file holds). On success *index
 * (the caller frees it) holds each parameter's file index, in layout order. */
static m3_status check_params(const char *path, const m3_tensor_file *f, const m3_config *cfg, int32_t **index) {
  m3_layout l;
  TRY(m3_layout_build(cfg, &l));
  int32_t *at = malloc((size_t)l.n * sizeof *at);
  m3_status rc = at ? M3_OK : m3_fail(M3_ERR_MEMORY, "%s: out of memory", path);
  for (int32_t i = 0; rc == M3_OK && i < l.n; i++) {
    m3_file_tensor t;
    rc = find_param(path, f, &l.t[i], &at[i]);
    if (rc == M3_OK) rc = m3_tensor_file_get(f, at[i], &t);
    if (rc == M3_OK) rc = check_shape(path, &t, &l.t[i]);
  }
  m3_layout_free(&l);
  if (rc != M3_OK) free(at);
  else *index = at;
  return rc;
}

/* Fills the weights (whose layout is check_params' for the same config) from the file tensors at index. */
static m3_status fill_params(const char *path, const m3_tensor_file *f, m3_weights *w, const int32_t *index,
                             uint8_t *used) {
  for (int32_t i = 0; i < w->layout.n; i++) {
    m3_file_tensor t;
    TRY(m3_tensor_file_get(f, index[i], &t));
    TRY(to_float(path, &t, w->arena + w->layout.t[i].offset));
    used[index[i]] = 1;
  }
  return M3_OK;
}

/* A lm_head.weight beside a tied embedding is accepted only when it equals the embedding. */
static m3_status check_tied_head(const char *path, const m3_file_tensor *t, const m3_weights *w) {
  const param_desc *emb = &w->layout.t[m3_layout_find(&w->layout, "embedding.weight")];
  TRY(check_shape(path, t, emb));
  float *head = m3_alloc_floats(t->numel);
  if (!head) return m3_fail(M3_ERR_MEMORY, "%s: out of memory comparing %s", path, t->name);
  m3_status rc = to_float(path, t, head);
  if (rc == M3_OK && memcmp(head, w->arena + emb->offset, (size_t)t->numel * sizeof(float)) != 0)
    rc = m3_fail(M3_ERR_FORMAT,
                 "%s: %s differs from embedding.weight, but the config ties them (tie_embeddings = true); "
                 "load with tie_embeddings = false to keep a separate lm_head",
                 path, t->name);
  free(head);
  return rc;
}

static m3_status check_extras(const char *path, const m3_tensor_file *f, const m3_weights *w, const uint8_t *used) {
  for (int32_t i = 0; i < m3_tensor_file_count(f); i++) {
    if (used[i]) continue;
    m3_file_tensor t;
    TRY(m3_tensor_file_get(f, i, &t));
    const char *bare = t.name;
    if (strncmp(bare, backbone_prefix, sizeof backbone_prefix - 1) == 0) bare += sizeof backbone_prefix - 1;
    if (w->dims.tied && strcmp(bare, "lm_head.weight") == 0) {
      TRY(check_tied_head(path, &t, w));
      continue;
    }
    return m3_fail(M3_ERR_FORMAT, "%s: unexpected tensor %s: not a parameter of this config (%d tensors expected)",
                   path, t.name, w->layout.n);
  }
  return M3_OK;
}

/* A file m3_weights_save wrote states every member of its config: one missing (a damaged name) would have
 * taken its default, another model. */
static m3_status states_every_member(const char *path, const char *json, const m3_config *cfg) {
  cJSON *stated = cJSON_Parse(json), *full = cJSON_Parse(m3_config_to_json(cfg));
  m3_status rc = stated && full ? M3_OK : m3_fail(M3_ERR_MEMORY, "%s: out of memory", path);
  for (const cJSON *m = full ? full->child : NULL; m && rc == M3_OK; m = m->next)
    if (!cJSON_GetObjectItemCaseSensitive(stated, m->string))
      rc = m3_fail(M3_ERR_FORMAT, "%s: the \"config\" metadata lacks \"%s\" (a file of format %s states every member)",
                   path, m->string, M3_WEIGHTS_FORMAT);
  cJSON_Delete(stated);
  cJSON_Delete(full);
  return rc;
}

static m3_status load_config(const char *path, const m3_tensor_file *f, const char *format, const m3_config *cfg,
                             m3_config *out) {
  if (cfg) {
    *out = *cfg;
    return M3_OK;
  }
  const char *json = m3_tensor_file_metadata(f, "config");
  if (!json)
    return m3_fail(M3_ERR_ARGUMENT, "%s has no \"config\" metadata: pass the model config along with the path",
                   path);
  m3_status rc = m3_config_from_json(json, out);
  if (rc != M3_OK) return m3_fail_context(rc, "%s: \"config\" metadata", path);
  return format && strcmp(format, M3_WEIGHTS_FORMAT) == 0 ? states_every_member(path, json, out) : M3_OK;
}

static m3_status load_into(const char *path, const m3_tensor_file *f, const m3_config *cfg, m3_weights **w) {
  const char *format = m3_tensor_file_metadata(f, "format");
  if (format && strcmp(format, M3_CHECKPOINT_FORMAT) == 0)
    return m3_fail(M3_ERR_FORMAT,
                   "%s is a trainer checkpoint (format %s), not a weights file: load it as a trainer, whose "
                   "snapshot holds its weights",
                   path, M3_CHECKPOINT_FORMAT);
  m3_config c;
  TRY(load_config(path, f, format, cfg, &c));
  m3_status rc = m3_config_validate(&c);
  if (rc != M3_OK) return m3_fail_context(rc, "loading %s", path);
  int32_t *index = NULL;
  TRY(check_params(path, f, &c, &index));
  rc = m3_weights_create(&c, w);
  if (rc != M3_OK) rc = m3_fail_context(rc, "loading %s", path);
  uint8_t *used = rc == M3_OK ? calloc((size_t)m3_tensor_file_count(f) + 1, 1) : NULL;
  if (rc == M3_OK && !used) rc = m3_fail(M3_ERR_MEMORY, "%s: out of memory", path);
  if (rc == M3_OK) rc = fill_params(path, f, *w, index, used);
  if (rc == M3_OK) rc = check_extras(path, f, *w, used);
  free(used);
  free(index);
  if (rc != M3_OK) return rc;
  rc = m3_weights_check_finite(*w, M3_ERR_FORMAT);
  return rc == M3_OK ? M3_OK : m3_fail_context(rc, "%s", path);
}

m3_status m3_weights_load(const char *path, const m3_config *cfg, m3_weights **out) {
  if (!out) return m3_fail(M3_ERR_ARGUMENT, "m3_weights_load: out is NULL");
  *out = NULL;
  if (!path) return m3_fail(M3_ERR_ARGUMENT, "m3_weights_load: path is NULL");
  m3_tensor_file *f = NULL;
  TRY(m3_tensor_file_open(path, &f));
  m3_weights *w = NULL;
  m3_status rc = load_into(path, f, cfg, &w);
  m3_tensor_file_close(f);
  if (rc != M3_OK) {
    m3_weights_destroy(w);
    return rc;
  }
  *out = w;
  return M3_OK;
}

/*
 * checkpoint.c — a trainer's full state in one safetensors file, and back.
 *
 * Tensors (F32): param.<name>, adam_m.<name>, adam_v.<name> for every parameter (SPEC.md
 * §2 names), state.<layer>.<angle|ssm|k|v> (batch-first, all rows). Metadata (strings):
 * format = "m3lua-checkpoint-1", config (model JSON), trainer (trainer options JSON with
 * the live lr / clip / no-decay values), step, loss_scale, tracker, rng (four words of 16 hex digits),
 * extra (the caller's opaque string), checksum (checksum.h over every tensor and every other
 * metadata value, 16 hex digits). Numbers are written with 17 significant digits so a
 * resumed run continues bit-identically on the same device and precision. Loading takes
 * nothing it has not checked: the checksum (files written before it existed have none, and no
 * metadata keys but theirs), numbers written whole and in range, the rng words exactly as saved,
 * finite tensors, second moments >= 0. Options NULL are all -1 (as saved); the trainer's checks
 * judge the options before any buffer sized by them is allocated.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checksum.h"
#include "errors.h"
#include "trainer.h"
#include "weights.h"

static const char *const STATE_KINDS[4] = {"angle", "ssm", "k", "v"};

/* Elements per row and the shape of one layer's state tensor of a kind. */
static int32_t state_shape(const m3_trainer *tr, int kind, int64_t shape[4]) {
  const m3_dims *d = &tr->dims;
  shape[0] = tr->cfg.batch;
  shape[1] = d->H;
  switch (kind) {
    case 0: shape[2] = d->S; return 3;
    case 1: shape[2] = d->P; shape[3] = d->N; return 4;
    case 2: shape[2] = d->N; return 3;
    default: shape[2] = d->P; return 3;
  }
}

static int64_t numel_of(const int64_t *shape, int32_t ndim) {
  int64_t n = 1;
  for (int32_t i = 0; i < ndim; i++) n *= shape[i];
  return n;
}

static void trainer_json(const m3_trainer *tr, char *buf, size_t cap) {
  const m3_trainer_cfg *c = &tr->cfg;
  snprintf(buf, cap,
           "{\"device\": %d, \"device_index\": %d, \"precision\": %d, \"batch\": %d, \"seq_len\": %d, "
           "\"lr\": %.17g, \"weight_decay\": %.17g, \"beta1\": %.17g, \"beta2\": %.17g, \"eps\": %.17g, "
           "\"no_decay\": %d, \"carry_state\": %d, \"clip\": %.17g, \"allow_tf32\": %d, \"seed\": \"%" PRIu64 "\"}",
           tr->device, tr->device_index, c->precision, c->batch, c->seq_len, tr->lr, c->weight_decay, c->beta1,
           c->beta2, c->eps, tr->no_decay, c->carry_state, tr->clip, c->allow_tf32, c->seed);
}

/* A tensor / metadata value added to the file and to its checksum. */
static m3_status add_tensor(m3_tensor_writer *w, uint64_t *sum, const char *name, int32_t ndim, const int64_t *shape,
                            const float *data) {
  m3_checksum_add(sum, name, data, (size_t)numel_of(shape, ndim) * sizeof(float));
  return m3_tensor_writer_add(w, name, M3_DTYPE_F32, ndim, shape, data);
}

static m3_status add_meta(m3_tensor_writer *w, uint64_t *sum, const char *key, const char *value) {
  m3_checksum_add(sum, key, value, strlen(value));
  return m3_tensor_writer_add_metadata(w, key, value);
}

m3_status m3_trainer_save(const m3_trainer *tr, const char *path, const char *extra) {
  if (!tr || !path) return m3_fail(M3_ERR_ARGUMENT, "m3_trainer_save: NULL argument");
  if (tr->poisoned) return m3_fail(M3_ERR_POISONED, "this trainer hit a sticky CUDA error; nothing to save");
  if (tr->window_open)
    return m3_fail(M3_ERR_ORDER, "save: an accumulation window is open; close it (backward_step without "
                                 "accumulate) before saving");
  if (tr->pending_forward) /* its carried state is the window's end, and a loaded trainer has no forward pending */
    return m3_fail(M3_ERR_ORDER, "save: a forward is pending; finish it with backward_step before saving");
  const int64_t total = tr->layout.total;
  const int64_t state_per_layer = (int64_t)tr->cfg.batch * tr->dims.H *
                                  (tr->dims.S + (int64_t)tr->dims.P * tr->dims.N + tr->dims.N + tr->dims.P);
  float *buf = m3_alloc_floats(3 * total + state_per_layer * tr->dims.L);
  m3_tensor_writer *w = NULL;
  m3_status st = buf ? m3_tensor_writer_create(&w) : m3_fail(M3_ERR_MEMORY, "out of memory saving a checkpoint");
  float *arenas[3] = {buf, buf + total, buf + 2 * total};
  static const arena_kind kinds[3] = {ARENA_PARAMS, ARENA_ADAM_M, ARENA_ADAM_V};
  static const char *const prefixes[3] = {"param.", "adam_m.", "adam_v."};
  char name[M3_NAME_CAP + 32];
  uint64_t sum = 0;
  for (int a = 0; a < 3 && st == M3_OK; a++) {
    st = tr->ops->read_arena(tr->be, kinds[a], arenas[a]);
    for (int32_t i = 0; i < tr->layout.n && st == M3_OK; i++) {
      const param_desc *p = &tr->layout.t[i];
      snprintf(name, sizeof name, "%s%s", prefixes[a], p->name);
      st = add_tensor(w, &sum, name, p->ndim, p->shape, arenas[a] + p->offset);
    }
  }
  float *s = buf + 3 * total;
  for (int32_t l = 0; l < tr->dims.L && st == M3_OK; l++) {
    float *ptr[4];
    int64_t shapes[4][4];
    int32_t ndims[4];
    for (int k = 0; k < 4; k++) {
      ndims[k] = state_shape(tr, k, shapes[k]);
      ptr[k] = s;
      s += numel_of(shapes[k], ndims[k]);
    }
    st = tr->ops->get_state(tr->be, l, ptr[0], ptr[1], ptr[2], ptr[3]);
    for (int k = 0; k < 4 && st == M3_OK; k++) {
      snprintf(name, sizeof name, "state.%d.%s", l, STATE_KINDS[k]);
      st = add_tensor(w, &sum, name, ndims[k], shapes[k], ptr[k]);
    }
  }
  char text[1024];
  if (st == M3_OK) st = add_meta(w, &sum, "format", M3_CHECKPOINT_FORMAT);
  if (st == M3_OK) st = add_meta(w, &sum, "config", m3_config_to_json(&tr->model));
  trainer_json(tr, text, sizeof text);
  if (st == M3_OK) st = add_meta(w, &sum, "trainer", text);
  snprintf(text, sizeof text, "%" PRId64, tr->step);
  if (st == M3_OK) st = add_meta(w, &sum, "step", text);
  snprintf(text, sizeof text, "%.17g", tr->loss_scale);
  if (st == M3_OK) st = add_meta(w, &sum, "loss_scale", text);
  snprintf(text, sizeof text, "%" PRId64, tr->tracker);
  if (st == M3_OK) st = add_meta(w, &sum, "tracker", text);
  snprintf(text, sizeof text, "%016" PRIx64 " %016" PRIx64 " %016" PRIx64 " %016" PRIx64, tr->rng.s[0], tr->rng.s[1],
           tr->rng.s[2], tr->rng.s[3]);
  if (st == M3_OK) st = add_meta(w, &sum, "rng", text);
  if (st == M3_OK) st = add_meta(w, &sum, "extra", extra ? extra : "");
  snprintf(text, sizeof text, "%016" PRIx64, sum);
  if (st == M3_OK) st = m3_tensor_writer_add_metadata(w, "checksum", text);
  if (st == M3_OK) st = m3_tensor_writer_write(w, path);
  m3_tensor_writer_destroy(w);
  free(buf);
  return st;
}

/* ---- loading ------------------------------------------------------------------------------------ */

static m3_status meta(const m3_tensor_file *f, const char *key, const char **out) {
  *out = m3_tensor_file_metadata(f, key);
  if (!*out) return m3_fail(M3_ERR_FORMAT, "checkpoint metadata has no \"%s\"", key);
  return M3_OK;
}

static m3_status json_number(const cJSON *o, const char *key, double *out) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  if (!cJSON_IsNumber(v)) return m3_fail(M3_ERR_FORMAT, "checkpoint trainer options: \"%s\" is missing", key);
  *out = v->valuedouble;
  return M3_OK;
}

/* A 64-bit seed written in decimal digits only. */
static int parse_seed(const char *text, uint64_t *out) {
  if (!(text[0] >= '0' && text[0] <= '9')) return 0;
  char *end = NULL;
  errno = 0;
  const unsigned long long v = strtoull(text, &end, 10);
  if (*end || errno) return 0;
  *out = v;
  return 1;
}

static m3_status parse_trainer(const char *json, m3_trainer_cfg *c, double *lr, double *clip, int32_t *no_decay) {
  cJSON *o = cJSON_ParseWithOpts(json, NULL, 1); /* nothing may follow the object */
  if (!cJSON_IsObject(o)) {
    cJSON_Delete(o);
    return m3_fail(M3_ERR_FORMAT, "checkpoint trainer options are not a JSON object");
  }
  m3_trainer_cfg_defaults(c);
  double v[14];
  static const char *const keys[14] = {"device", "device_index", "precision", "batch", "seq_len", "lr", "weight_decay",
                                       "beta1", "beta2", "eps", "no_decay", "carry_state", "clip", "allow_tf32"};
  static const int whole[14] = {1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 2, 2, 0, 2}; /* int32 fields; 2: flags, 0 or 1 */
  m3_status st = M3_OK;
  for (int i = 0; i < 14 && st == M3_OK; i++) {
    st = json_number(o, keys[i], &v[i]);
    if (st == M3_OK && whole[i] && !(v[i] == floor(v[i]) && v[i] >= INT32_MIN && v[i] <= INT32_MAX))
      st = m3_fail(M3_ERR_FORMAT, "checkpoint trainer options: \"%s\" = %g: expected an integer", keys[i],
                   m3_shown(v[i]));
    else if (st == M3_OK && whole[i] == 2 && v[i] != 0 && v[i] != 1)
      st = m3_fail(M3_ERR_FORMAT, "checkpoint trainer options: \"%s\" = %g: expected 0 or 1", keys[i],
                   m3_shown(v[i]));
  }
  const cJSON *seed = cJSON_GetObjectItemCaseSensitive(o, "seed");
  if (st == M3_OK && !(cJSON_IsString(seed) && parse_seed(seed->valuestring, &c->seed)))
    st = m3_fail(M3_ERR_FORMAT, "checkpoint trainer options: \"seed\" must be a decimal string of a 64-bit seed");
  if (st == M3_OK) {
    c->device = (int32_t)v[0];
    c->device_index = (int32_t)v[1];
    c->precision = (int32_t)v[2];
    c->batch = (int32_t)v[3];
    c->seq_len = (int32_t)v[4];
    *lr = v[5];
    c->lr = v[5];
    c->weight_decay = v[6];
    c->beta1 = v[7];
    c->beta2 = v[8];
    c->eps = v[9];
    *no_decay = (int32_t)v[10];
    c->no_decay = *no_decay;
    c->carry_state = (int32_t)v[11];
    *clip = v[12];
    c->clip = v[12];
    c->allow_tf32 = (int32_t)v[13];
  }
  cJSON_Delete(o);
  return st;
}

/* Copies the F32 tensor `name` of exactly `ndim`/`shape` into dst; every value must be finite (and >= 0 with
 * nonneg: Adam's second moments). */
static m3_status take(const m3_tensor_file *f, const char *name, int32_t ndim, const int64_t *shape, int nonneg,
                      float *dst) {
  int32_t i = m3_tensor_file_find(f, name);
  if (i < 0) return m3_fail(M3_ERR_FORMAT, "checkpoint has no tensor \"%s\"", name);
  m3_file_tensor t;
  TRY(m3_tensor_file_get(f, i, &t));
  int ok = t.dtype == M3_DTYPE_F32 && t.ndim == ndim;
  for (int32_t k = 0; ok && k < ndim; k++) ok = t.shape[k] == shape[k];
  if (!ok) return m3_fail(M3_ERR_FORMAT, "checkpoint tensor \"%s\" has the wrong dtype or shape", name);
  memcpy(dst, t.data, t.nbytes);
  return m3_check_finite(M3_ERR_FORMAT, dst, t.numel, nonneg, "checkpoint tensor \"%s\"", name);
}

/* The integer metadata `key`, which must be written whole in [lo, hi]. */
static m3_status meta_int(const m3_tensor_file *f, const char *key, int64_t lo, int64_t hi, int64_t *out) {
  const char *text;
  TRY(meta(f, key, &text));
  char *end = NULL;
  errno = 0;
  const long long v = strtoll(text, &end, 10);
  if (end == text || *end || errno || v < lo || v > hi)
    return m3_fail(M3_ERR_FORMAT, "checkpoint %s \"%s\": expected an integer in [%lld, %lld]", key, text,
                   (long long)lo, (long long)hi);
  *out = v;
  return M3_OK;
}

/* The number metadata `key`, which must be written whole and finite. */
static m3_status meta_number(const m3_tensor_file *f, const char *key, double *out) {
  const char *text;
  TRY(meta(f, key, &text));
  char *end = NULL;
  const double v = strtod(text, &end);
  if (end == text || *end || !isfinite(v))
    return m3_fail(M3_ERR_FORMAT, "checkpoint %s \"%s\": expected a finite number", key, text);
  *out = v;
  return M3_OK;
}

/* The metadata keys of a checkpoint written before checksums: a file without a checksum holds these only,
 * so that damage to the key "checksum" itself cannot pass for an older file. */
static const char *const UNSUMMED_KEYS[] = {"format", "config", "trainer", "step", "loss_scale", "tracker", "rng",
                                            "extra"};

static m3_status check_unsummed_keys(const m3_tensor_file *f) {
  for (int32_t i = 0; i < m3_tensor_file_metadata_count(f); i++) {
    const char *key = m3_tensor_file_metadata_key(f, i);
    size_t k = 0;
    while (k < sizeof UNSUMMED_KEYS / sizeof *UNSUMMED_KEYS && strcmp(key, UNSUMMED_KEYS[k]) != 0) k++;
    if (k == sizeof UNSUMMED_KEYS / sizeof *UNSUMMED_KEYS)
      return m3_fail(M3_ERR_FORMAT,
                     "the file is damaged: it states no checksum and holds the unknown metadata key \"%.64s\"", key);
  }
  return M3_OK;
}

/* The file's checksum against the one it states; a file written before checksums has none (and only their
 * metadata keys). */
static m3_status verify_checksum(const m3_tensor_file *f) {
  const char *stated = m3_tensor_file_metadata(f, "checksum");
  if (!stated) return check_unsummed_keys(f);
  uint64_t sum = 0;
  for (int32_t i = 0; i < m3_tensor_file_count(f); i++) {
    m3_file_tensor t;
    TRY(m3_tensor_file_get(f, i, &t));
    m3_checksum_add(&sum, t.name, t.data, t.nbytes);
  }
  for (int32_t i = 0; i < m3_tensor_file_metadata_count(f); i++) {
    const char *key = m3_tensor_file_metadata_key(f, i);
    if (strcmp(key, "checksum") != 0) {
      const char *value = m3_tensor_file_metadata(f, key);
      m3_checksum_add(&sum, key, value, strlen(value));
    }
  }
  char text[24];
  snprintf(text, sizeof text, "%016" PRIx64, sum);
  if (strcmp(text, stated) != 0)
    return m3_fail(M3_ERR_FORMAT, "the file is damaged: its checksum is %s, it states %.24s", text, stated);
  return M3_OK;
}

/* The generator's four words, each written as the saver writes it: 16 lowercase hex digits (no sign, no prefix),
 * one space between words; not all 0. */
static m3_status parse_rng(const char *text, uint64_t s[4]) {
  static const char digits[] = "0123456789abcdef";
  const char *p = text;
  int ok = 1;
  for (int i = 0; i < 4 && ok; i++) {
    ok = strspn(p, digits) == 16 && p[16] == (i < 3 ? ' ' : '\0');
    if (ok) {
      s[i] = strtoull(p, NULL, 16); /* exactly 16 hex digits: no sign, no prefix, no overflow */
      p += 17;
    }
  }
  if (!ok || !(s[0] | s[1] | s[2] | s[3]))
    return m3_fail(M3_ERR_FORMAT, "checkpoint rng \"%.80s\": expected four hex words, not all 0, as saved: 16 "
                   "lowercase digits each (no sign, no prefix), one space apart", text);
  return M3_OK;
}

/* The saved recurrent state of every layer into the backend (the saved batch only): one layer's worth of buffer,
 * allocated here, after the trainer's checks accepted the batch and its backend holds every layer's state. */
static m3_status restore_state(m3_trainer *tr, const m3_tensor_file *f) {
  int64_t shapes[4][4], per_layer = 0;
  int32_t ndims[4];
  for (int k = 0; k < 4; k++) {
    ndims[k] = state_shape(tr, k, shapes[k]);
    per_layer += numel_of(shapes[k], ndims[k]);
  }
  float *buf = m3_alloc_floats(per_layer);
  if (!buf) return m3_fail(M3_ERR_MEMORY, "out of memory loading a checkpoint's recurrent state");
  char name[M3_NAME_CAP + 32];
  m3_status st = M3_OK;
  for (int32_t l = 0; l < tr->dims.L && st == M3_OK; l++) {
    float *ptr[4];
    float *s = buf;
    for (int k = 0; k < 4 && st == M3_OK; k++) {
      snprintf(name, sizeof name, "state.%d.%s", l, STATE_KINDS[k]);
      ptr[k] = s;
      st = take(f, name, ndims[k], shapes[k], 0, s);
      s += numel_of(shapes[k], ndims[k]);
    }
    if (st == M3_OK) st = tr->ops->set_state(tr->be, l, ptr[0], ptr[1], ptr[2], ptr[3]);
  }
  free(buf);
  return st;
}

/* Everything but the parameters into a created trainer; buf holds layout.total floats. */
static m3_status restore(m3_trainer *tr, const m3_tensor_file *f, int same_precision, int same_batch, float *buf) {
  const char *text;
  /* at most 2^53: the steps a double counts exactly (Adam's bias correction takes step + 1 as one), and far from
   * INT64_MAX, which the next step's count would overflow */
  TRY(meta_int(f, "step", 0, (int64_t)1 << 53, &tr->step));
  if (same_precision) { /* a changed precision starts its own scaler */
    double scale = 1;
    int64_t tracker = 0;
    TRY(meta_number(f, "loss_scale", &scale));
    TRY(meta_int(f, "tracker", 0, INT64_MAX, &tracker));
    if (tr->cfg.precision == M3_PRECISION_F16) TRY(m3_trainer_load_scaler_state(tr, scale, tracker));
    else if (scale != 1 || tracker != 0)
      return m3_fail(M3_ERR_FORMAT, "checkpoint loss_scale %g, tracker %lld: a trainer without f16 has 1 and 0",
                     scale, (long long)tracker);
  }
  TRY(meta(f, "rng", &text));
  TRY(parse_rng(text, tr->rng.s));
  TRY(meta(f, "extra", &text));
  tr->extra = strdup(text);
  if (!tr->extra) return m3_fail(M3_ERR_MEMORY, "out of memory");
  char name[M3_NAME_CAP + 32];
  static const arena_kind kinds[2] = {ARENA_ADAM_M, ARENA_ADAM_V};
  static const char *const prefixes[2] = {"adam_m.", "adam_v."};
  for (int a = 0; a < 2; a++) {
    memset(buf, 0, (size_t)tr->layout.total * sizeof(float));
    for (int32_t i = 0; i < tr->layout.n; i++) {
      const param_desc *p = &tr->layout.t[i];
      snprintf(name, sizeof name, "%s%s", prefixes[a], p->name);
      TRY(take(f, name, p->ndim, p->shape, kinds[a] == ARENA_ADAM_V, buf + p->offset));
    }
    TRY(tr->ops->write_arena(tr->be, kinds[a], buf));
  }
  /* another batch: zero state; a trainer that does not carry its state starts every window from zero, and its
   * saved state (the last forward's, a refused step's non-finite one too) is not read */
  return same_batch && tr->cfg.carry_state ? restore_state(tr, f) : M3_OK;
}

m3_status m3_trainer_load(const char *path, const m3_load_opts *opts, m3_trainer **out) {
  if (!path || !out) return m3_fail(M3_ERR_ARGUMENT, "m3_trainer_load: NULL argument");
  *out = NULL;
  m3_tensor_file *f = NULL;
  TRY(m3_tensor_file_open(path, &f));
  const char *text;
  m3_config model;
  m3_trainer_cfg cfg;
  double lr = 0, clip = 0;
  int32_t no_decay = 1;
  m3_status st = meta(f, "format", &text);
  if (st == M3_OK && strcmp(text, M3_CHECKPOINT_FORMAT) != 0)
    st = m3_fail(M3_ERR_FORMAT, "format \"%s\" is not a trainer checkpoint (%s)", text, M3_CHECKPOINT_FORMAT);
  if (st == M3_OK) st = verify_checksum(f);
  if (st == M3_OK) st = meta(f, "config", &text);
  if (st == M3_OK) st = m3_config_from_json(text, &model);
  if (st == M3_OK) st = meta(f, "trainer", &text);
  if (st == M3_OK) st = parse_trainer(text, &cfg, &lr, &clip, &no_decay);
  const int32_t saved_precision = cfg.precision, saved_batch = cfg.batch;
  static const m3_load_opts as_saved = {-1, -1, -1, -1, -1};
  if (!opts) opts = &as_saved;
  if (st == M3_OK) {
    /* -1 keeps the saved value; the trainer's checks judge any other */
    if (opts->device != -1) cfg.device = opts->device;
    else if (cfg.device == M3_DEVICE_CUDA && m3_cuda_device_count() == 0) cfg.device = M3_DEVICE_CPU;
    if (opts->device_index != -1) cfg.device_index = opts->device_index;
    if (opts->precision != -1) cfg.precision = opts->precision;
    if (opts->batch != -1) cfg.batch = opts->batch;
    if (opts->seq_len != -1) cfg.seq_len = opts->seq_len;
  }
  m3_layout layout = {0};
  float *buf = NULL;
  if (st == M3_OK) st = m3_layout_build(&model, &layout);
  if (st == M3_OK) { /* the parameters, sized by the model; the state, sized by the batch, waits for the trainer */
    buf = m3_alloc_floats(layout.total);
    if (!buf) st = m3_fail(M3_ERR_MEMORY, "out of memory loading a checkpoint");
  }
  char name[M3_NAME_CAP + 32];
  for (int32_t i = 0; st == M3_OK && i < layout.n; i++) {
    snprintf(name, sizeof name, "param.%s", layout.t[i].name);
    st = take(f, name, layout.t[i].ndim, layout.t[i].shape, 0, buf + layout.t[i].offset);
  }
  m3_trainer *tr = NULL;
  if (st == M3_OK) st = m3_trainer_create_from(&cfg, &model, buf, &tr);
  if (st == M3_OK) {
    tr->lr = lr;
    tr->clip = clip;
    tr->no_decay = no_decay;
    st = restore(tr, f, cfg.precision == saved_precision, cfg.batch == saved_batch, buf);
  }
  free(buf);
  m3_layout_free(&layout);
  m3_tensor_file_close(f);
  if (st != M3_OK) {
    m3_trainer_destroy(tr);
    return m3_fail_context(st, "loading checkpoint %s", path);
  }
  *out = tr;
  return M3_OK;
}

/*
 * config.c — the model configuration of SPEC.md §1: defaults, validation with messages
 * that name the field, the value and the rule, derived sizes, and JSON in and out.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "errors.h"
#include "layout.h"

static const char *const input_names[] = {"features", "identity", "tokens"};
static const char *const head_names[] = {"none", "lm", "mse"};

void m3_config_defaults(m3_config *c) {
  if (!c) return;
  memset(c, 0, sizeof *c);
  c->d_state = 128;
  c->expand = 2;
  c->headdim = 64;
  c->ngroups = 1;
  c->rope_fraction = 0.5;
  c->a_floor = 1e-4;
  c->input = M3_INPUT_FEATURES;
  c->head = M3_HEAD_NONE;
  c->tie_embeddings = 1;
}

static int32_t rope_angles(int32_t d_state, double fraction) {
  int64_t split = (int64_t)floor((double)d_state * fraction);
  if (split % 2) split -= 1;
  return (int32_t)(split / 2);
}

#define RULE(cond, ...) \
  do {                  \
    if (!(cond)) return m3_fail(M3_ERR_CONFIG, __VA_ARGS__); \
  } while (0)

/* Every rule on the fields; the sizes they give are judged by m3_layout_build. */
static m3_status check_fields(const m3_config *c) {
  if (!c) return m3_fail(M3_ERR_ARGUMENT, "config is NULL");
  const int32_t big = 1 << 24; /* per field; the model's whole size is m3_layout_build's rule */
  RULE(c->d_model >= 1 && c->d_model <= big, "d_model = %d: must be an integer in [1, %d] (required)", c->d_model, big);
  RULE(c->n_layers >= 1 && c->n_layers <= 4096, "n_layers = %d: must be an integer in [1, 4096] (required)", c->n_layers);
  RULE(c->d_state >= 1 && c->d_state <= big, "d_state = %d: must be an integer in [1, %d]", c->d_state, big);
  RULE(c->expand >= 1 && c->expand <= 64, "expand = %d: must be an integer in [1, 64]", c->expand);
  int64_t d_inner = (int64_t)c->expand * c->d_model;
  RULE(d_inner <= big, "expand * d_model = %lld: d_inner must be <= %d", (long long)d_inner, big);
  RULE(c->headdim >= 1, "headdim = %d: must be an integer >= 1", c->headdim);
  RULE(d_inner % c->headdim == 0, "headdim = %d: must divide d_inner = expand * d_model = %lld",
       c->headdim, (long long)d_inner);
  int64_t nheads = d_inner / c->headdim;
  RULE(c->ngroups >= 1, "ngroups = %d: must be an integer >= 1", c->ngroups);
  RULE(nheads % c->ngroups == 0, "ngroups = %d: must divide nheads = d_inner / headdim = %lld",
       c->ngroups, (long long)nheads);
  RULE(c->rope_fraction == 0.0 || c->rope_fraction == 0.5 || c->rope_fraction == 1.0,
       "rope_fraction = %g: must be one of 0, 0.5, 1.0", m3_shown(c->rope_fraction));
  RULE(isfinite(c->a_floor) && c->a_floor > 0, "a_floor = %g: must be a finite number > 0", m3_shown(c->a_floor));
  RULE(c->outproj_norm == 0 || c->outproj_norm == 1, "outproj_norm = %d: must be a boolean", c->outproj_norm);
  RULE(c->tie_embeddings == 0 || c->tie_embeddings == 1, "tie_embeddings = %d: must be a boolean", c->tie_embeddings);
  RULE(c->input >= M3_INPUT_FEATURES && c->input <= M3_INPUT_TOKENS,
       "input = %d: must be \"features\", \"identity\" or \"tokens\"", c->input);
  RULE(c->head >= M3_HEAD_NONE && c->head <= M3_HEAD_MSE, "head = %d: must be \"none\", \"lm\" or \"mse\"", c->head);
  if (c->input == M3_INPUT_FEATURES)
    RULE(c->input_dim >= 1 && c->input_dim <= big, "input_dim = %d: input \"features\" needs an integer input_dim in [1, %d]", c->input_dim, big);
  if (c->input == M3_INPUT_TOKENS || c->head == M3_HEAD_LM)
    RULE(c->vocab_size >= 2 && c->vocab_size <= big, "vocab_size = %d: input \"tokens\" and head \"lm\" need an integer vocab_size in [2, %d]",
         c->vocab_size, big);
  if (c->head == M3_HEAD_LM && c->tie_embeddings)
    RULE(c->input == M3_INPUT_TOKENS, "tie_embeddings = true: head \"lm\" can only tie its weight to an embedding, which needs input \"tokens\" (set tie_embeddings = false)");
  if (c->head == M3_HEAD_MSE)
    RULE(c->out_dim >= 1 && c->out_dim <= big, "out_dim = %d: head \"mse\" needs an integer out_dim in [1, %d]", c->out_dim, big);
  int64_t S = rope_angles(c->d_state, c->rope_fraction);
  int64_t dip = 2 * d_inner + 2 * (int64_t)c->ngroups * c->d_state + 3 * nheads + S;
  RULE(dip <= INT32_MAX / 2, "in_proj_dim = %lld is too large", (long long)dip);
  return M3_OK;
}

m3_status m3_config_validate(const m3_config *c) {
  TRY(check_fields(c));
  m3_layout l;
  TRY(m3_layout_build(c, &l));
  m3_layout_free(&l);
  return M3_OK;
}

m3_status m3_config_derive(const m3_config *c, m3_config_derived *out) {
  if (!out) return m3_fail(M3_ERR_ARGUMENT, "m3_config_derive: out is NULL");
  TRY(check_fields(c));
  m3_layout l;
  TRY(m3_layout_build(c, &l));
  m3_dims d;
  m3_dims_from_config(c, &d);
  out->d_inner = d.E;
  out->nheads = d.H;
  out->num_rope_angles = d.S;
  out->in_proj_dim = d.dip;
  out->n_tensors = l.n;
  out->n_params = l.n_params;
  m3_layout_free(&l);
  return M3_OK;
}

void m3_dims_from_config(const m3_config *c, m3_dims *d) {
  memset(d, 0, sizeof *d);
  d->dm = c->d_model;
  d->L = c->n_layers;
  d->N = c->d_state;
  d->E = c->expand * c->d_model;
  d->P = c->headdim;
  d->H = d->E / d->P;
  d->G = c->ngroups;
  d->heads_per_group = d->H / d->G;
  d->S = rope_angles(c->d_state, c->rope_fraction);
  d->dip = 2 * d->E + 2 * d->G * d->N + 3 * d->H + d->S;
  d->input = c->input;
  d->head = c->head;
  d->input_dim = c->input == M3_INPUT_FEATURES ? c->input_dim : c->d_model;
  d->vocab = (c->input == M3_INPUT_TOKENS || c->head == M3_HEAD_LM) ? c->vocab_size : 0;
  d->out_dim = c->head == M3_HEAD_MSE ? c->out_dim : 0;
  d->tied = c->head == M3_HEAD_LM && c->tie_embeddings && c->input == M3_INPUT_TOKENS;
  d->outproj_norm = c->outproj_norm;
  d->a_floor = c->a_floor;
  d->z_off = 0;
  d->x_off = d->E;
  d->B_off = 2 * d->E;
  d->C_off = d->B_off + d->G * d->N;
  d->dt_off = d->C_off + d->G * d->N;
  d->A_off = d->dt_off + d->H;
  d->trap_off = d->A_off + d->H;
  d->ang_off = d->trap_off + d->H;
}

/* ---- JSON ------------------------------------------------------------------------------- */

/* A number that is a whole int32 (booleans are not numbers here) */
static m3_status json_int(const cJSON *root, const char *key, int32_t *dst) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
  if (!v || cJSON_IsNull(v)) return M3_OK;
  if (!cJSON_IsNumber(v)) return m3_fail(M3_ERR_CONFIG, "config JSON: %s must be an integer", key);
  if (v->valuedouble != floor(v->valuedouble) || fabs(v->valuedouble) > 2147483647.0)
    return m3_fail(M3_ERR_CONFIG, "config JSON: %s = %.17g: must be an integer in [-2147483647, 2147483647] (int32)",
                   key, v->valuedouble);
  *dst = (int32_t)v->valuedouble;
  return M3_OK;
}

/* true / false (0 and 1 too, as older files wrote them) */
static m3_status json_bool(const cJSON *root, const char *key, int32_t *dst) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
  if (!v || cJSON_IsNull(v)) return M3_OK;
  if (cJSON_IsBool(v)) {
    *dst = cJSON_IsTrue(v);
    return M3_OK;
  }
  if (!cJSON_IsNumber(v) || (v->valuedouble != 0 && v->valuedouble != 1))
    return m3_fail(M3_ERR_CONFIG, "config JSON: %s must be true or false", key);
  *dst = v->valuedouble != 0;
  return M3_OK;
}

static m3_status json_num(const cJSON *root, const char *key, double *dst) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
  if (!v || cJSON_IsNull(v)) return M3_OK;
  if (!cJSON_IsNumber(v)) return m3_fail(M3_ERR_CONFIG, "config JSON: %s must be a number", key);
  *dst = v->valuedouble;
  return M3_OK;
}

static m3_status json_enum(const cJSON *root, const char *key, const char *const *names, int n, int32_t *dst) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
  if (!v || cJSON_IsNull(v)) return M3_OK;
  if (cJSON_IsString(v)) {
    for (int i = 0; i < n; i++)
      if (strcmp(v->valuestring, names[i]) == 0) {
        *dst = i;
        return M3_OK;
      }
    return m3_fail(M3_ERR_CONFIG, "config JSON: %s = \"%s\" is not a known kind", key, v->valuestring);
  }
  return m3_fail(M3_ERR_CONFIG, "config JSON: %s must be a string", key);
}

/* A derived size the JSON states must be the one the fields give. */
static m3_status json_derived_matches(const cJSON *root, const char *key, double derived) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
  if (!v || cJSON_IsNull(v)) return M3_OK;
  if (!cJSON_IsNumber(v)) return m3_fail(M3_ERR_CONFIG, "config JSON: %s must be a number", key);
  if (v->valuedouble != derived)
    return m3_fail(M3_ERR_CONFIG, "config JSON: %s = %.17g does not match the value the fields give (%.17g)", key,
                   v->valuedouble, derived);
  return M3_OK;
}

m3_status m3_config_from_json(const char *json, m3_config *out) {
  if (!json || !out) return m3_fail(M3_ERR_ARGUMENT, "m3_config_from_json: NULL argument");
  cJSON *root = cJSON_ParseWithOpts(json, NULL, 1); /* nothing may follow the object */
  if (!root || !cJSON_IsObject(root)) {
    cJSON_Delete(root);
    return m3_fail(M3_ERR_FORMAT, "config JSON does not parse as an object");
  }
  m3_config c;
  m3_config_defaults(&c);
  m3_status st = M3_OK;
#define INT(k) if (st == M3_OK) st = json_int(root, #k, &c.k)
  INT(d_model); INT(n_layers); INT(d_state); INT(expand); INT(headdim); INT(ngroups);
  INT(input_dim); INT(vocab_size); INT(out_dim);
#undef INT
  if (st == M3_OK) st = json_bool(root, "outproj_norm", &c.outproj_norm);
  if (st == M3_OK) st = json_bool(root, "tie_embeddings", &c.tie_embeddings);
  if (st == M3_OK) st = json_num(root, "rope_fraction", &c.rope_fraction);
  if (st == M3_OK) st = json_num(root, "a_floor", &c.a_floor);
  if (st == M3_OK) st = json_enum(root, "input", input_names, 3, &c.input);
  if (st == M3_OK) st = json_enum(root, "head", head_names, 3, &c.head);
  m3_config_derived d;
  if (st == M3_OK) st = m3_config_derive(&c, &d); /* validates */
  if (st == M3_OK) st = json_derived_matches(root, "d_inner", d.d_inner);
  if (st == M3_OK) st = json_derived_matches(root, "nheads", d.nheads);
  if (st == M3_OK) st = json_derived_matches(root, "num_rope_angles", d.num_rope_angles);
  if (st == M3_OK) st = json_derived_matches(root, "in_proj_dim", d.in_proj_dim);
  if (st == M3_OK) st = json_derived_matches(root, "n_params", (double)d.n_params);
  cJSON_Delete(root);
  if (st != M3_OK) return st;
  *out = c;
  return M3_OK;
}

const char *m3_config_to_json(const m3_config *c) {
  static _Thread_local char buf[1024];
  if (!c || m3_config_validate(c) != M3_OK) return ""; /* not JSON of another model */
  snprintf(buf, sizeof buf,
           "{\"d_model\": %d, \"n_layers\": %d, \"d_state\": %d, \"expand\": %d, \"headdim\": %d, "
           "\"ngroups\": %d, \"rope_fraction\": %.17g, \"a_floor\": %.17g, \"outproj_norm\": %s, "
           "\"input\": \"%s\", \"head\": \"%s\", \"tie_embeddings\": %s, \"input_dim\": %d, "
           "\"vocab_size\": %d, \"out_dim\": %d}",
           c->d_model, c->n_layers, c->d_state, c->expand, c->headdim, c->ngroups, c->rope_fraction,
           c->a_floor, c->outproj_norm ? "true" : "false",
           input_names[c->input], head_names[c->head], c->tie_embeddings ? "true" : "false",
           c->input_dim, c->vocab_size, c->out_dim);
  return buf;
}

/* The value of the item `"key": value` at p (len bytes), after its key. */
static const char *item_value(const char *p, size_t len, int *vlen) {
  const char *sep = strstr(p, "\": ");
  const size_t at = sep && (size_t)(sep - p) < len ? (size_t)(sep - p) + 3 : 0;
  *vlen = (int)(len - at);
  return p + at;
}

int m3_config_same(const m3_config *a, const m3_config *b, char *why, size_t n) {
  char ja[1024], jb[1024];
  snprintf(ja, sizeof ja, "%s", m3_config_to_json(a));
  snprintf(jb, sizeof jb, "%s", m3_config_to_json(b));
  if (strcmp(ja, jb) == 0) return 1;
  /* both {"key": value, ...} with the same keys in the same order: the first item that differs */
  const char *pa = ja + 1, *pb = jb + 1;
  for (;;) {
    const size_t la = strcspn(pa, ",}"), lb = strcspn(pb, ",}");
    if (la != lb || strncmp(pa, pb, la) != 0) {
      int va_len, vb_len;
      const char *va = item_value(pa, la, &va_len), *vb = item_value(pb, lb, &vb_len);
      const int key_len = (int)(va - pa) - 4; /* between the quotes of `"key": ` */
      snprintf(why, n, "%.*s: %.*s vs %.*s", key_len > 0 ? key_len : 0, pa + 1, va_len, va, vb_len, vb);
      return 0;
    }
    if (pa[la] != ',') break;
    pa += la + 2;
    pb += lb + 2;
  }
  snprintf(why, n, "%s vs %s", ja, jb); /* not reached for valid configs: some item differs */
  return 0;
}

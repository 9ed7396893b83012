/*
 * test_sizes.c — a window (batch x seq_len) whose CPU buffers would pass M3_MAX_ARENA elements is
 * refused as "too large" before any size is allocated or wraps: a tiny model with batch 2^31 - 1
 * through the public API (m3_trainer_create, and m3_trainer_load with a new batch), and the CPU
 * model itself with sizes whose int64 products would overflow (batch x d_inner x d_state = 2^79).
 * A window of 2^31 positions (one more than an int counts) is refused, by m3_trainer_load too: there
 * with the trainer's own error, before the recurrent state of the new batch is allocated (10 TB for
 * a checkpoint of seq_len 4 loaded with batch 2^31 - 1).
 */
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "cpu/model.h"
#include "harness.h"
#include "layout.h"

/* A model of 1.4 MB whose recurrent state is 5.2 M floats per row: 2^53.3 at batch 2^31 - 1. */
static void tiny_config(m3_config *c) {
  m3_config_defaults(c);
  c->d_model = 2;
  c->n_layers = 1;
  c->expand = 64;
  c->headdim = 128;
  c->d_state = 40000;
  c->input = M3_INPUT_IDENTITY;
}

static int too_large(m3_status st) { return st == M3_ERR_CONFIG && strstr(m3_last_error(), "too large") != NULL; }

static void trainer_create(void) {
  m3_config c;
  tiny_config(&c);
  m3_weights *w = NULL;
  CHECK_OK(m3_weights_create(&c, &w));
  const m3_trainer_cfg tc = test_trainer_cfg(w, M3_DEVICE_CPU, INT32_MAX, 1);
  m3_trainer *tr = NULL;
  m3_status st = m3_trainer_create(&tc, &tr);
  CHECK(too_large(st) && tr == NULL, "m3_trainer_create, batch 2^31 - 1: %s", m3_last_error());
  m3_weights_destroy(w);
}

/* Saves a checkpoint of tiny_config (with d_state) at batch 1 and seq_len into a new folder: its path in path. */
static void save_tiny(int32_t d_state, int32_t seq_len, char dir[static 26], char path[static 64]) {
  m3_config c;
  tiny_config(&c);
  c.d_state = d_state;
  m3_weights *w = NULL;
  CHECK_OK(m3_weights_create(&c, &w));
  const m3_trainer_cfg tc = test_trainer_cfg(w, M3_DEVICE_CPU, 1, seq_len);
  m3_trainer *tr = NULL;
  CHECK_OK(m3_trainer_create(&tc, &tr));
  strcpy(dir, "/tmp/m3_test_sizes_XXXXXX");
  CHECK(mkdtemp(dir) != NULL, "mkdtemp");
  snprintf(path, 64, "%s/tiny.safetensors", dir);
  CHECK_OK(m3_trainer_save(tr, path, ""));
  m3_trainer_destroy(tr);
  m3_weights_destroy(w);
}

static void trainer_load(void) {
  char dir[26], path[64];
  save_tiny(40000, 1, dir, path);
  m3_load_opts o = {M3_DEVICE_CPU, -1, -1, INT32_MAX, 1};
  m3_trainer *tr = NULL;
  m3_status st = m3_trainer_load(path, &o, &tr);
  CHECK(too_large(st) && tr == NULL, "m3_trainer_load, batch 2^31 - 1: %s", m3_last_error());
  unlink(path);
  rmdir(dir);
}

/* A new batch whose window passes 2^31 positions gets the trainer's error, not an out of memory allocating the
 * state of that batch first (1.2 K floats a row here). */
static void trainer_load_checks_first(void) {
  char dir[26], path[64];
  save_tiny(8, 4, dir, path);
  m3_load_opts o = {-1, -1, -1, INT32_MAX, -1};
  m3_trainer *tr = NULL;
  m3_status st = m3_trainer_load(path, &o, &tr);
  CHECK(st == M3_ERR_CONFIG && tr == NULL && strstr(m3_last_error(), "batch * seq_len = 8589934588: must be < 2^31"),
        "m3_trainer_load, batch 2^31 - 1 of seq_len 4: %s: %s", m3_status_name(st), m3_last_error());
  unlink(path);
  rmdir(dir);
}

/* d_inner = d_state = 2^24 (the largest each may be): the state of one row holds 2^48 floats. */
static void wrapping_sizes(void) {
  m3_config c;
  m3_config_defaults(&c);
  c.d_model = 1 << 18;
  c.n_layers = 1;
  c.expand = 64;
  c.headdim = 1 << 24;
  c.d_state = 1 << 24;
  c.input = M3_INPUT_IDENTITY;
  CHECK_OK(m3_config_validate(&c));
  m3_dims d;
  m3_dims_from_config(&c, &d);
  m3_layout lay;
  CHECK_OK(m3_layout_build(&c, &lay));
  for (int train = 0; train <= 1; train++) {
    cpu_model_f32 *m = NULL;
    m3_status st = train ? cpu_model_create_f32(&d, &lay, INT32_MAX, 1, &m)
                         : cpu_model_create_forward_f32(&d, &lay, INT32_MAX, 1, &m);
    CHECK(too_large(st) && m == NULL, "%s CPU model, batch 2^31 - 1: %s", train ? "a training" : "a forward-only",
          m3_last_error());
    cpu_model_destroy_f32(m);
  }
  m3_layout_free(&lay);
}

/* Positions are counted in int (the BLAS calls): a window of exactly 2^31 of them is refused at creation. */
static void positions_fit_int(void) {
  m3_config c;
  tiny_config(&c);
  c.d_state = 8;
  m3_weights *w = NULL;
  CHECK_OK(m3_weights_create(&c, &w));
  const m3_trainer_cfg tc = test_trainer_cfg(w, M3_DEVICE_CPU, 1 << 16, 1 << 15);
  m3_trainer *tr = NULL;
  CHECK(m3_trainer_create(&tc, &tr) == M3_ERR_CONFIG && tr == NULL &&
            strstr(m3_last_error(), "batch * seq_len = 2147483648: must be < 2^31"),
        "m3_trainer_create, 2^31 positions: %s", m3_last_error());
  m3_infer_cfg ic = test_infer_cfg(w, M3_DEVICE_CPU, 1 << 16);
  ic.max_len = 1 << 15;
  m3_infer *inf = NULL;
  CHECK(m3_infer_create(&ic, &inf) == M3_ERR_CONFIG && inf == NULL &&
            strstr(m3_last_error(), "batch * max_len = 2147483648: must be < 2^31"),
        "m3_infer_create, 2^31 positions: %s", m3_last_error());
  m3_weights_destroy(w);
}

int main(void) {
  positions_fit_int();
  trainer_create();
  trainer_load();
  trainer_load_checks_first();
  wrapping_sizes();
  return harness_finish("sizes");
}

/*
 * test_checkpoint.c — what a trainer checkpoint keeps that the specs do not look at (checkpoint.c's header: numbers
 * written with 17 significant digits, so a resumed run continues bit-identically):
 *
 * 1. The live lr, clip and no-decay choice set after creation come back exactly (1/3-like values that 7 or 9
 *    digits would round).
 * 2. A forged file written before checksums that gives a trainer without f16 a scaler state (loss_scale other than 1,
 *    or a tracker other than 0) is refused, naming both values.
 */
#include <unistd.h>

#include "harness.h"

static char dir[32];

static const char *in_dir(const char *name) {
  static char path[2][96];
  static int which;
  which ^= 1;
  snprintf(path[which], sizeof path[which], "%s/%s", dir, name);
  return path[which];
}

/* A copy of the checkpoint src at dst with the metadata key set to value, without its checksum: a file written
 * before checksums, whose values are each checked on their own. */
static void forge_checkpoint(const char *src, const char *dst, const char *key, const char *value) {
  m3_tensor_file *f = NULL;
  m3_tensor_writer *w = NULL;
  m3_status st = m3_tensor_file_open(src, &f);
  if (st == M3_OK) st = m3_tensor_writer_create(&w);
  for (int32_t i = 0; st == M3_OK && i < m3_tensor_file_count(f); i++) {
    m3_file_tensor t;
    st = m3_tensor_file_get(f, i, &t);
    if (st == M3_OK) st = m3_tensor_writer_add(w, t.name, t.dtype, t.ndim, t.shape, t.data);
  }
  for (int32_t i = 0; st == M3_OK && i < m3_tensor_file_metadata_count(f); i++) {
    const char *k = m3_tensor_file_metadata_key(f, i);
    if (strcmp(k, "checksum") != 0)
      st = m3_tensor_writer_add_metadata(w, k, strcmp(k, key) == 0 ? value : m3_tensor_file_metadata(f, k));
  }
  if (st == M3_OK) st = m3_tensor_writer_write(w, dst);
  CHECK(st == M3_OK, "forge a checkpoint with %s = %s: %s", key, value, m3_last_error());
  m3_tensor_writer_destroy(w);
  m3_tensor_file_close(f);
}

int main(void) {
  strcpy(dir, "/tmp/m3_test_checkpoint_XXXXXX");
  if (!mkdtemp(dir)) return 1;
  m3_config c = test_config(4, 8, 4, 1, 0.5, 0, M3_INPUT_IDENTITY, M3_HEAD_NONE, 0);
  m3_weights *w = NULL;
  CHECK_OK(m3_weights_create(&c, &w));
  CHECK_OK(m3_weights_init(w, 3));
  const m3_trainer_cfg tc = test_trainer_cfg(w, M3_DEVICE_CPU, 2, 4);
  m3_trainer *tr = NULL;
  CHECK_OK(m3_trainer_create(&tc, &tr));
  const double lr = 0.1 / 3, clip = 2.0 / 3;
  CHECK_OK(m3_trainer_set_lr(tr, lr));
  CHECK_OK(m3_trainer_set_clip(tr, clip));
  CHECK_OK(m3_trainer_set_no_decay(tr, 0));
  const char *path = in_dir("ck.safetensors"), *forged = in_dir("forged.safetensors");
  CHECK_OK(m3_trainer_save(tr, path, ""));
  m3_trainer_destroy(tr);

  /* 1. */
  tr = NULL;
  CHECK_OK(m3_trainer_load(path, NULL, &tr));
  m3_trainer_info info = {0};
  m3_trainer_get_info(tr, &info);
  CHECK(m3_trainer_lr(tr) == lr, "lr after load: %.17g, saved %.17g", m3_trainer_lr(tr), lr);
  CHECK(info.clip == clip, "clip after load: %.17g, saved %.17g", info.clip, clip);
  CHECK(info.no_decay == 0, "no_decay after load: %d, saved 0", info.no_decay);
  m3_trainer_destroy(tr);

  /* 2. */
  static const struct {
    const char *key, *value, *says;
  } bad[] = {{"tracker", "5", "loss_scale 1, tracker 5"}, {"loss_scale", "2", "loss_scale 2, tracker 0"}};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    forge_checkpoint(path, forged, bad[i].key, bad[i].value);
    tr = NULL;
    m3_status st = m3_trainer_load(forged, NULL, &tr);
    CHECK(st == M3_ERR_FORMAT && tr == NULL && strstr(m3_last_error(), bad[i].says),
          "%s = %s without f16 refused: %s '%s'", bad[i].key, bad[i].value, m3_status_name(st), m3_last_error());
    m3_trainer_destroy(tr);
  }
  forge_checkpoint(path, forged, "tracker", "0"); /* the forgery itself loads */
  tr = NULL;
  CHECK_OK(m3_trainer_load(forged, NULL, &tr));
  m3_trainer_destroy(tr);

  unlink(path);
  unlink(forged);
  rmdir(dir);
  m3_weights_destroy(w);
  return harness_finish("checkpoint");
}

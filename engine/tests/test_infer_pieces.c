/*
 * test_infer_pieces.c — m3.h "inference" on the CPU, two contracts no other test reaches:
 *
 * 1. A step longer than max_len runs in pieces and gives the bits of one whole window, resets inside it included
 *    (each row's reset at its own position, in a later piece than the first): max_len 2 against max_len 8 over 7
 *    positions; the same step without resets differs (the resets are seen).
 * 2. m3_infer_logits reads the last step's rows only ([logit_rows, vocab]): after a step of 1 row on an object of
 *    batch 3, the destination's rows 1 and 2 stay as they were.
 */
#include "harness.h"

enum { ROWS = 2, LEN = 7, VOCAB = 50, DM = 8 };

static m3_infer *make(const m3_weights *w, int batch, int max_len) {
  m3_infer_cfg ic = test_infer_cfg(w, M3_DEVICE_CPU, batch);
  ic.max_len = max_len;
  m3_infer *inf = NULL;
  CHECK_OK(m3_infer_create(&ic, &inf));
  return inf;
}

int main(void) {
  m3_config c = test_config(4, 8, 4, 1, 0.5, 0, M3_INPUT_TOKENS, M3_HEAD_LM, 1);
  m3_weights *w = NULL;
  CHECK_OK(m3_weights_create(&c, &w));
  CHECK_OK(m3_weights_init(w, 11));

  /* 1. */
  int32_t tokens[ROWS * LEN];
  uint8_t resets[ROWS * LEN] = {0};
  for (int i = 0; i < ROWS * LEN; i++) tokens[i] = (i * 17 + 3) % VOCAB;
  resets[0 * LEN + 3] = 1; /* row 0, position 3: the second piece of 2 */
  resets[1 * LEN + 5] = 1; /* row 1, position 5: the third */
  m3_batch b = {0};
  b.rows = ROWS;
  b.len = LEN;
  b.tokens = tokens;
  static float out[3][ROWS * LEN * DM], logits[3][ROWS * VOCAB];
  for (int k = 0; k < 3; k++) {
    m3_infer *inf = make(w, ROWS, k == 1 ? 2 : 8);
    b.resets = k == 2 ? NULL : resets;
    CHECK_OK(m3_infer_step(inf, &b, out[k], logits[k]));
    m3_infer_destroy(inf);
  }
  CHECK(memcmp(out[0], out[1], sizeof out[0]) == 0 && memcmp(logits[0], logits[1], sizeof logits[0]) == 0,
        "a step of 7 positions with resets in pieces of 2 gives the bits of one window of 8");
  CHECK(memcmp(out[0], out[2], sizeof out[0]) != 0, "the resets change the outputs (they are seen)");

  /* 2. */
  m3_infer *inf = make(w, 3, 8);
  b.rows = 1;
  b.resets = NULL;
  float from_step[VOCAB], read[3 * VOCAB];
  for (int i = 0; i < 3 * VOCAB; i++) read[i] = 12345.0f;
  CHECK_OK(m3_infer_step(inf, &b, NULL, from_step));
  CHECK_OK(m3_infer_logits(inf, read));
  int rest = 1;
  for (int i = VOCAB; i < 3 * VOCAB; i++) rest &= read[i] == 12345.0f;
  CHECK(memcmp(read, from_step, sizeof from_step) == 0 && rest,
        "m3_infer_logits after a step of 1 row of 3 writes that row (the step's logits) and nothing past it");
  m3_infer_destroy(inf);
  m3_weights_destroy(w);
  return harness_finish("infer_pieces");
}

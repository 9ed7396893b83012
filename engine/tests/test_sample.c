/*
 * test_sample.c — m3_sample's nucleus where the prefix's weight meets top_p exactly (m3.h: "the shortest
 * most-likely prefix reaching this mass"; reaching is >=), with and without top_k, and its refusal of top_p = 0.
 *
 * Four equal logits at temperature 1 weigh 1 each (total 4): top_p 0.5 reaches 2 = 0.5 * 4 with the first two in
 * sampling order (ties: lower id first), so ids 0 and 1 are drawn and 2 and 3 never; top_p 0.75 keeps 0, 1, 2.
 * 400 draws per case (rows with their own streams) see each kept id: the chance that one of two equally likely ids
 * is missed is 2^-399.
 */
#include "harness.h"

enum { ROWS = 400, V = 4 };

static void draws(double top_p, int32_t top_k, int kept) {
  static float logits[ROWS * V];
  static uint64_t rng[ROWS * 4];
  int32_t out[ROWS];
  for (int r = 0; r < ROWS; r++) m3_sampler_seed(17, r, rng + 4 * r);
  const m3_sample_opts o = {1.0, top_k, top_p};
  CHECK_OK(m3_sample(logits, ROWS, V, &o, rng, out));
  int seen[V] = {0};
  for (int r = 0; r < ROWS; r++)
    if (out[r] >= 0 && out[r] < V) seen[out[r]]++;
  for (int i = 0; i < V; i++)
    CHECK(i < kept ? seen[i] > 0 : seen[i] == 0, "top_p %g, top_k %d: id %d drawn %d times of %d (%s)", top_p, top_k,
          i, seen[i], ROWS, i < kept ? "kept" : "outside the nucleus");
}

int main(void) {
  draws(0.5, 0, 2);
  draws(0.5, 4, 2);
  draws(0.75, 0, 3);
  draws(0.75, 3, 3);
  float logits[V] = {0};
  uint64_t rng[4];
  int32_t out = -7;
  m3_sampler_seed(1, 0, rng);
  const m3_sample_opts zero = {1.0, 0, 0.0};
  m3_status st = m3_sample(logits, 1, V, &zero, rng, &out);
  CHECK(st == M3_ERR_ARGUMENT && out == -7 && strstr(m3_last_error(), "top_p = 0: must be in (0, 1]"),
        "top_p = 0 refused: %s '%s'", m3_status_name(st), m3_last_error());
  return harness_finish("sample");
}

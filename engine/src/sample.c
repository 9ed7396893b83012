/*
 * sample.c — one token per row from a step's logits, on the host (m3.h "sampling"): greedy,
 * temperature, top-k and top-p (nucleus), each row with its own xoshiro256** generator.
 *
 * Per row: temperature 0 is the argmax (the lowest id among ties) and draws nothing.
 * Otherwise the weights are expf((logit - max) / temperature), summed in double; top_k keeps
 * the k largest logits (ordered by logit, then lower id first), top_p then keeps the
 * shortest prefix of the candidates, most likely first, whose weight reaches top_p of the
 * total (the candidates' total after top_k, else the whole row's), and one uniform draw
 * walks the kept weights (in that order after top_k, else in id order). Without top_k the
 * end of the nucleus is found through a histogram of the logits, so only one bin is sorted.
 * Rows run in parallel and touch only their own generator: results do not depend on the
 * thread count or on the other rows.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "errors.h"
#include "m3.h"
#include "rng.h"
#include "threads.h"

typedef struct cand {
  float v;
  int32_t id;
} cand;

/* The sampling order: larger logit first, then lower id. */
static int before(const cand *a, const cand *b) { return a->v > b->v || (a->v == b->v && a->id < b->id); }

static int cmp_cand(const void *pa, const void *pb) {
  const cand *a = pa, *b = pb;
  return before(a, b) ? -1 : before(b, a) ? 1 : 0;
}

/* The k first candidates in sampling order: a heap whose root is the last kept one. */
static int32_t top_k(const float *lg, int32_t V, int32_t k, cand *h) {
  int32_t n = 0;
  for (int32_t i = 0; i < V; i++) {
    const cand c = {lg[i], i};
    int32_t at;
    if (n < k) {
      at = n++;
      while (at > 0 && before(&h[(at - 1) / 2], &c)) { /* sift up: the root is the worst */
        h[at] = h[(at - 1) / 2];
        at = (at - 1) / 2;
      }
      h[at] = c;
    } else if (before(&c, &h[0])) {
      at = 0;
      for (;;) { /* sift down from the root */
        int32_t w = 2 * at + 1;
        if (w >= n) break;
        if (w + 1 < n && before(&h[w], &h[w + 1])) w++;
        if (!before(&c, &h[w])) break;
        h[at] = h[w];
        at = w;
      }
      h[at] = c;
    }
  }
  qsort(h, (size_t)n, sizeof *h, cmp_cand);
  return n;
}

/* Per-thread scratch of a row. */
typedef struct scratch {
  float *w;      /* [V] weights expf((logit - max) / temperature) by id (by rank after top_k) */
  cand *c;       /* [V] candidates */
  double *bins;  /* [NBINS] weight per logit bin (top_p) */
  int32_t *fill; /* [NBINS] tokens per bin */
} scratch;

enum { NBINS = 2048 };

/* Whether id i (logit v) is kept: every id, or (end != NULL) those up to *end in sampling order. */
static int kept(float v, int32_t i, const cand *end) { return !end || before(&(cand){v, i}, end) || i == end->id; }

/* A draw among the ids that kept() keeps, walked in id order, weights w; total: their weights' sum in id order. */
static int32_t draw_in_id_order(const float *lg, const float *w, int32_t V, const cand *end, double total,
                                int32_t best, m3_rng *r) {
  const double u = m3_rng_uniform(r) * total;
  double acc = 0;
  int32_t last = best;
  for (int32_t i = 0; i < V; i++)
    if (kept(lg[i], i, end)) {
      acc += w[i];
      last = i;
      if (u < acc) return i;
    }
  return last;
}

/* The bin of logit v below the row's max m: the distance in double, which neither overflows (finite logits
 * spread wider than FLT_MAX) nor gives a NaN index. */
static int32_t bin_of(float v, float m, double width) {
  const double x = ((double)m - (double)v) / width;
  return x < NBINS ? (int32_t)x : NBINS - 1;
}

/* The last candidate (in sampling order) of the shortest prefix whose weight reaches goal:
 * logits are binned below the max, whole bins are taken from the top while they stay short of
 * goal, and only the bin that crosses it is sorted. */
static cand nucleus_end(const float *lg, const float *w, int32_t V, float m, double goal, scratch *sc) {
  float lo = m;
  for (int32_t i = 0; i < V; i++) lo = lg[i] < lo ? lg[i] : lo;
  const double width = m > lo ? ((double)m - (double)lo) / NBINS : 1;
  memset(sc->bins, 0, NBINS * sizeof(double));
  memset(sc->fill, 0, NBINS * sizeof(int32_t));
  int32_t last = 0; /* the last bin holding a token: the walk ends there at the latest */
  for (int32_t i = 0; i < V; i++) {
    const int32_t b = bin_of(lg[i], m, width);
    sc->bins[b] += w[i];
    sc->fill[b]++;
    last = b > last ? b : last;
  }
  double acc = 0;
  int32_t b = 0;
  while (b < last && (acc + sc->bins[b] < goal || !sc->fill[b])) acc += sc->bins[b++];
  int32_t n = 0;
  for (int32_t i = 0; i < V; i++)
    if (bin_of(lg[i], m, width) == b) sc->c[n++] = (cand){lg[i], i};
  qsort(sc->c, (size_t)n, sizeof *sc->c, cmp_cand);
  for (int32_t j = 0; j < n; j++) {
    acc += w[sc->c[j].id];
    if (acc >= goal) return sc->c[j];
  }
  return sc->c[n - 1];
}

/* The weight of logit v below the row's max m: expf((v - m) / temperature), never NaN. A temperature so small
 * that inv_t overflows to inf still gives the max's ties weight 1 (not 0 inf = NaN) and every other logit 0.
 * Logits spread wider than FLT_MAX make v - m overflow float to -inf; that difference is scaled in double
 * instead, so an inv_t that rounds to 0 (a temperature above about 1.4e45) gives it weight 1, as every closer
 * logit gets (not -inf 0 = NaN). */
static float weight_of(float v, float m, float inv_t) {
  if (v == m) return 1.0f;
  const float d = v - m;
  return expf(isinf(d) ? (float)(((double)v - m) * inv_t) : d * inv_t);
}

static int32_t sample_row(const float *lg, int32_t V, const m3_sample_opts *o, m3_rng *r, scratch *sc) {
  int32_t best = 0;
  for (int32_t i = 1; i < V; i++)
    if (lg[i] > lg[best]) best = i;
  if (o->temperature == 0) return best;
  const float inv_t = (float)(1.0 / o->temperature), m = lg[best];
  float *w = sc->w;
  if (o->top_k == 0) {
    double mass = 0; /* summed as the weights are made: the expf calls hide the chain of adds */
    for (int32_t i = 0; i < V; i++) mass += w[i] = weight_of(lg[i], m, inv_t);
    if (o->top_p >= 1) return draw_in_id_order(lg, w, V, NULL, mass, best, r);
    const cand end = nucleus_end(lg, w, V, m, o->top_p * mass, sc);
    double total = 0;
    for (int32_t i = 0; i < V; i++)
      if (kept(lg[i], i, &end)) total += w[i];
    return draw_in_id_order(lg, w, V, &end, total, best, r);
  }
  /* top_k candidates in sampling order (w[j]: the j-th one's weight), then the top_p prefix */
  cand *c = sc->c;
  int32_t n = top_k(lg, V, o->top_k < V ? o->top_k : V, c);
  double total = 0;
  for (int32_t j = 0; j < n; j++) total += w[j] = weight_of(c[j].v, m, inv_t);
  if (o->top_p < 1) {
    const double goal = o->top_p * total;
    double acc = 0;
    for (int32_t j = 0; j < n; j++) {
      acc += w[j];
      if (acc >= goal) {
        n = j + 1;
        break;
      }
    }
    total = 0;
    for (int32_t j = 0; j < n; j++) total += w[j];
  }
  const double u = m3_rng_uniform(r) * total;
  double acc = 0;
  for (int32_t j = 0; j < n; j++) {
    acc += w[j];
    if (u < acc) return c[j].id;
  }
  return c[n - 1].id;
}

void m3_sampler_seed(uint64_t seed, int32_t row, uint64_t *state) {
  if (!state) return;
  m3_rng r;
  m3_rng_seed(&r, (seed ^ 0x5eed5a3d1e5eedULL) + 0x9e3779b97f4a7c15ULL * (uint64_t)(uint32_t)row);
  memcpy(state, r.s, sizeof r.s);
}

m3_status m3_sample(const float *logits, int32_t rows, int32_t vocab, const m3_sample_opts *o, uint64_t *rng,
                    int32_t *out) {
  if (!logits || !o || !rng || !out) return m3_fail(M3_ERR_ARGUMENT, "m3_sample: NULL argument");
  if (rows < 1 || vocab < 1) return m3_fail(M3_ERR_ARGUMENT, "m3_sample: %d rows x %d logits", rows, vocab);
  if (!(o->temperature >= 0 && isfinite(o->temperature)))
    return m3_fail(M3_ERR_ARGUMENT, "temperature = %g: must be a finite number >= 0 (0 = greedy)",
                   m3_shown(o->temperature));
  if (o->top_k < 0) return m3_fail(M3_ERR_ARGUMENT, "top_k = %d: must be >= 0 (0 = off)", o->top_k);
  if (!(o->top_p > 0 && o->top_p <= 1))
    return m3_fail(M3_ERR_ARGUMENT, "top_p = %g: must be in (0, 1] (1 = off)", m3_shown(o->top_p));
  int32_t bad_row = rows; /* the first row holding a non-finite logit */
#pragma omp parallel for schedule(static) reduction(min : bad_row) \
    num_threads(loop_threads(rows, (int64_t)rows * vocab, omp_get_max_threads()))
  for (int32_t r = 0; r < rows; r++)
    for (int64_t i = (int64_t)r * vocab; i < (int64_t)(r + 1) * vocab; i++)
      if (!isfinite(logits[i])) {
        bad_row = r < bad_row ? r : bad_row;
        break;
      }
  if (bad_row < rows)
    return m3_fail(M3_ERR_NONFINITE, "m3_sample: row %d of the logits holds a non-finite value; nothing was drawn",
                   bad_row);
  int failed = 0;
#pragma omp parallel num_threads(loop_threads(rows, (int64_t)rows * vocab * 16, omp_get_max_threads()))
  {
    scratch sc = {NULL, NULL, NULL, NULL};
    if (o->temperature > 0) {
      sc.w = malloc((size_t)vocab * sizeof *sc.w);
      sc.c = malloc((size_t)vocab * sizeof *sc.c);
      sc.bins = malloc(NBINS * sizeof *sc.bins);
      sc.fill = malloc(NBINS * sizeof *sc.fill);
    }
    const int ok = o->temperature == 0 || (sc.w && sc.c && sc.bins && sc.fill);
    if (!ok) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static)
    for (int32_t r = 0; r < rows; r++) {
      if (!ok) continue;
      m3_rng g;
      memcpy(g.s, rng + 4 * (int64_t)r, sizeof g.s);
      out[r] = sample_row(logits + (int64_t)r * vocab, vocab, o, &g, &sc);
      memcpy(rng + 4 * (int64_t)r, g.s, sizeof g.s);
    }
    free(sc.w);
    free(sc.c);
    free(sc.bins);
    free(sc.fill);
  }
  if (failed) return m3_fail(M3_ERR_MEMORY, "m3_sample: out of host memory for %d candidates", vocab);
  return M3_OK;
}

/*
 * model.c — the whole backbone on the CPU (SPEC.md §3-4): input layer, the stack of
 * residual layers (mixer.c), the final RMSNorm, and their backward; buffers are allocated
 * once for the largest window (B x T) and reused by shorter or narrower windows.
 *
 * Forward state handling: the incoming state of every layer is copied into m->incoming
 * (zeros without carry) because the backward reads it; final states are written to a
 * staging copy and committed to m->state only when the whole forward succeeded, so an
 * interrupted forward leaves the carried state as it was. A forward-only model advances
 * m->state in place (each (row, head) of the scan reads its state before writing it) and
 * is not interrupted inside a window, so a failed call still changes no state.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "parts.h"
#include "real.h"
#include "../threads.h"

enum { SCAN_CHUNK = 16 };

/* How allocating a model's buffers went; a size past M3_MAX_ARENA outranks a failed allocation. */
enum { ALLOC_OK, ALLOC_NO_MEMORY, ALLOC_TOO_LARGE };

/* The buffers are taken twice: first only sized (nothing allocated: a model too large is refused
 * before any memory is taken, which a system that overcommits would grant), then allocated. */
typedef struct allocation {
  int sizing;
  int failed;
} allocation;

/* A zeroed buffer of n elements (n from M3_SIZE: -1 marks the model too large); none while
 * sizing, or once a buffer before it failed. */
static real *alloc_real(int64_t n, allocation *a) {
  if (n < 0) a->failed = ALLOC_TOO_LARGE;
  if (a->failed || a->sizing) return NULL;
  real *p = calloc((size_t)(n > 0 ? n : 1), sizeof(real));
  if (!p) a->failed = ALLOC_NO_MEMORY;
  return p;
}

typedef struct state_sizes {
  int64_t angle, ssm, k, v; /* elements per layer and row */
} state_sizes;

static state_sizes sizes_of(const m3_dims *d) {
  state_sizes s = {(int64_t)d->H * d->S, (int64_t)d->H * d->P * d->N, (int64_t)d->H * d->N, (int64_t)d->H * d->P};
  return s;
}

static void alloc_state(cpu_state *s, const m3_dims *d, int32_t B, allocation *a) {
  state_sizes z = sizes_of(d);
  s->angle = alloc_real(M3_SIZE(d->L, B, z.angle), a);
  s->ssm = alloc_real(M3_SIZE(d->L, B, z.ssm), a);
  s->k = alloc_real(M3_SIZE(d->L, B, z.k), a);
  s->v = alloc_real(M3_SIZE(d->L, B, z.v), a);
}

static void free_state(cpu_state *s) {
  free(s->angle);
  free(s->ssm);
  free(s->k);
  free(s->v);
}

/* Every buffer of the model (its dims, layout, B, T, cap and train set), sized or allocated (a). */
static void alloc_buffers(cpu_model *m, allocation *a) {
  const int train = m->train;
  const m3_dims *d = m->d;
  const m3_layout *lay = m->lay;
  const int32_t B = m->B, T = m->T;
  const int64_t M0 = m->cap, L = d->L, dm = d->dm, E = d->E, H = d->H, N = d->N, G = d->G;
  const int64_t nch = (T + SCAN_CHUNK - 1) / SCAN_CHUNK;
  /* forward only: one activation slot, two residual slots, no backward buffers */
  const int64_t Ls = train ? L : 1, Lr = train ? L + 1 : 2, Mg = train ? M0 : 0;
  alloc_state(&m->state, d, B, a);
  if (train) {
    alloc_state(&m->incoming, d, B, a);
    alloc_state(&m->staged, d, B, a);
  }
  m->resid = alloc_real(M3_SIZE(Lr, M0, dm), a);
  m->xn = alloc_real(M3_SIZE(Ls, M0, dm), a);
  m->rstd = alloc_real(M3_SIZE(Ls, M0), a);
  m->proj = alloc_real(M3_SIZE(Ls, M0, d->dip), a);
  m->bc_hat = alloc_real(M3_SIZE(Ls, M0, 2 * G * N), a);
  m->bc_rstd = alloc_real(M3_SIZE(Ls, M0, 2 * G), a);
  m->ang_tanh = alloc_real(M3_SIZE(Ls, M0, d->S), a);
  m->theta = alloc_real(M3_SIZE(Ls, M0, H, d->S), a);
  m->y = alloc_real(M3_SIZE(Ls, M0, E), a);
  m->y_rstd = alloc_real(M3_SIZE(Ls, M0, H), a);
  m->gated = alloc_real(M3_SIZE(Ls, M0, E), a);
  m->chunk_ssm = train ? alloc_real(M3_SIZE(L, B, H, nch, d->P, N), a) : NULL;
  m->out = alloc_real(M3_SIZE(M0, dm), a);
  m->out_rstd = alloc_real(M0, a);
  m->dout = alloc_real(M3_SIZE(Mg, dm), a);
  m->dresid = alloc_real(M3_SIZE(Mg, dm), a);
  m->dxn = alloc_real(M3_SIZE(Mg, dm), a);
  m->dproj = alloc_real(M3_SIZE(Mg, d->dip), a);
  m->dgated = alloc_real(M3_SIZE(Mg, E), a);
  m->dy = alloc_real(M3_SIZE(Mg, E), a);
  m->dbc_head = alloc_real(M3_SIZE(Mg, H, 2 * N), a);
  m->dang_head = alloc_real(M3_SIZE(Mg, H, d->S), a);
  m->input_copy = alloc_real(M3_SIZE(M0, d->input_dim), a);
  if (!a->failed && !a->sizing) {
    m->tokens_copy = calloc((size_t)M0, sizeof(int32_t));
    m->resets_copy = calloc((size_t)M0, 1);
    if (!m->tokens_copy || !m->resets_copy) a->failed = ALLOC_NO_MEMORY;
  }
  m->part_width = part_width(d);
  m->part = alloc_real(M3_SIZE(train ? B : 0, m->part_width), a);
  m->row_scratch = alloc_real(M3_SIZE(train ? B : 0, N), a);
  const int64_t head_w = d->vocab > d->out_dim ? d->vocab : d->out_dim;
  m->logits = alloc_real(M3_SIZE(train ? 64 : B, head_w > 0 ? head_w : 1), a);
  m->params_t = train ? NULL : alloc_real(lay->total, a);
  m->scratch_per_thread = NAME(cpu_scan_scratch)(d, T, SCAN_CHUNK);
  m->scratch = alloc_real(M3_SIZE(m->threads, m->scratch_per_thread), a);
}

static m3_status create(const m3_dims *d, const m3_layout *lay, int32_t B, int32_t T, int train, cpu_model **out) {
  cpu_model *m = calloc(1, sizeof *m);
  if (!m) return m3_fail(M3_ERR_MEMORY, "out of memory");
  m->d = d;
  m->lay = lay;
  m->B = B;
  m->T = T;
  m->chunk = SCAN_CHUNK;
  m->train = train;
  m->cap = (int64_t)B * T;
  m->threads = omp_get_max_threads();
  openblas_set_num_threads(1); /* the model parallelises around BLAS (gemm.c) */
  allocation a = {1, ALLOC_OK};
  alloc_buffers(m, &a);
  a.sizing = 0;
  if (!a.failed) alloc_buffers(m, &a);
  if (a.failed) {
    NAME(cpu_model_destroy)(m);
    if (a.failed == ALLOC_TOO_LARGE)
      return m3_fail(M3_ERR_CONFIG,
                     "a CPU model of batch %d x seq_len %d is too large: a buffer would hold more than 2^53 "
                     "elements (n_layers = %d, d_inner = %d, d_state = %d, in_proj_dim = %d)",
                     B, T, d->L, d->E, d->N, d->dip);
    return m3_fail(M3_ERR_MEMORY, "out of host memory for a CPU model of batch %d x seq_len %d", B, T);
  }
  *out = m;
  return M3_OK;
}

m3_status NAME(cpu_model_create)(const m3_dims *d, const m3_layout *lay, int32_t B, int32_t T, cpu_model **out) {
  return create(d, lay, B, T, 1, out);
}

m3_status NAME(cpu_model_create_forward)(const m3_dims *d, const m3_layout *lay, int32_t B, int32_t T,
                                         cpu_model **out) {
  return create(d, lay, B, T, 0, out);
}

void NAME(cpu_model_destroy)(cpu_model *m) {
  if (!m) return;
  free_state(&m->state);
  free_state(&m->incoming);
  free_state(&m->staged);
  real *bufs[] = {m->resid, m->xn,   m->rstd,     m->proj,     m->bc_hat,  m->bc_rstd, m->ang_tanh, m->theta,  m->y,
                  m->y_rstd, m->gated, m->chunk_ssm, m->out,    m->out_rstd, m->dout,   m->dresid, m->dxn,
                  m->dproj,  m->dgated, m->dy,       m->dbc_head, m->dang_head, m->part, m->row_scratch,
                  m->logits, m->scratch, m->params_t};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
  free(m->input_copy);
  free(m->tokens_copy);
  free(m->resets_copy);
  free(m);
}

/* dst rows [0, rows) of every layer := src rows (both batch-first with capacity B). */
static void copy_state_rows(const cpu_model *m, cpu_state *dst, const cpu_state *src, int32_t rows) {
  state_sizes z = sizes_of(m->d);
  for (int32_t l = 0; l < m->d->L; l++) {
    const int64_t base = (int64_t)l * m->B;
#define COPY(f) memcpy(dst->f + base * z.f, src->f + base * z.f, (size_t)(rows * z.f) * sizeof(real))
    COPY(angle);
    COPY(ssm);
    COPY(k);
    COPY(v);
#undef COPY
  }
}

static void zero_state(const cpu_model *m, cpu_state *s) {
  state_sizes z = sizes_of(m->d);
  const int64_t lb = (int64_t)m->d->L * m->B;
  memset(s->angle, 0, (size_t)(lb * z.angle) * sizeof(real));
  memset(s->ssm, 0, (size_t)(lb * z.ssm) * sizeof(real));
  memset(s->k, 0, (size_t)(lb * z.k) * sizeof(real));
  memset(s->v, 0, (size_t)(lb * z.v) * sizeof(real));
}

/* Keeps the window's inputs (the backward needs them) and builds resid[0] from them. */
static void input_forward(cpu_model *m, const cpu_batch *b) {
  const m3_dims *d = m->d;
  const int64_t M = (int64_t)b->rows * b->len;
  real *h0 = m->resid;
  m->has_resets = b->resets != NULL;
  if (b->resets) memcpy(m->resets_copy, b->resets, (size_t)M);
  switch (d->input) {
    case M3_INPUT_FEATURES: {
      const real *bias = m->params + m->lay->input_b;
      memcpy(m->input_copy, b->input, (size_t)(M * d->input_dim) * sizeof(real));
      for (int64_t i = 0; i < M; i++) memcpy(h0 + i * d->dm, bias, (size_t)d->dm * sizeof(real));
      NAME(cpu_gemm)(m, CblasNoTrans, CblasTrans, (int)M, d->dm, d->input_dim, 1,
                     m->input_copy, d->input_dim, m->params + m->lay->input_w, d->input_dim, 1, h0, d->dm);
      break;
    }
    case M3_INPUT_IDENTITY:
      memcpy(h0, b->input, (size_t)(M * d->dm) * sizeof(real));
      break;
    case M3_INPUT_TOKENS: {
      const real *emb = m->params + m->lay->embedding;
      memcpy(m->tokens_copy, b->tokens, (size_t)M * sizeof(int32_t));
      for (int64_t i = 0; i < M; i++)
        memcpy(h0 + i * d->dm, emb + (int64_t)b->tokens[i] * d->dm, (size_t)d->dm * sizeof(real));
      break;
    }
  }
}

m3_status NAME(cpu_model_forward)(cpu_model *m, const cpu_batch *b, int carry, int write_state) {
  const m3_dims *d = m->d;
  if (b->rows < 1 || b->rows > m->B || b->len < 1 || b->len > m->T)
    return m3_fail(M3_ERR_INTERNAL, "window %d x %d outside the model's %d x %d", b->rows, b->len, m->B, m->T);
  m->rows = b->rows;
  m->len = b->len;
  if (m->train) {
    if (carry) copy_state_rows(m, &m->incoming, &m->state, b->rows);
    else zero_state(m, &m->incoming);
  }
  input_forward(m, b);
  for (int32_t l = 0; l < d->L; l++) {
    if (m->train && m3_interrupted()) return m3_fail(M3_ERR_INTERRUPTED, "interrupted during the forward (layer %d)", l);
    if (m->train) TRY(NAME(cpu_layer_forward)(m, l, b->resets, &m->incoming, &m->staged));
    else TRY(NAME(cpu_layer_forward)(m, l, b->resets, &m->state, write_state ? &m->state : NULL));
  }
  const int64_t M = (int64_t)b->rows * b->len;
  NAME(rmsnorm_forward)(m->resid + NAME(cpu_resid_slot)(m, d->L) * m->cap * d->dm, m->params + m->lay->norm_f,
                        m->out, m->out_rstd, M, d->dm);
  if (m->train && write_state) copy_state_rows(m, &m->state, &m->staged, b->rows);
  return M3_OK;
}

void NAME(cpu_model_rewind_state)(cpu_model *m, int32_t rows) { copy_state_rows(m, &m->state, &m->incoming, rows); }

static void input_backward(cpu_model *m) {
  const m3_dims *d = m->d;
  const int64_t M = (int64_t)m->rows * m->len;
  const real *dh0 = m->dresid;
  switch (d->input) {
    case M3_INPUT_FEATURES: {
      NAME(cpu_gemm)(m, CblasTrans, CblasNoTrans, d->dm, d->input_dim, (int)M, 1, dh0, d->dm, m->input_copy,
                 d->input_dim, 1, m->grads + m->lay->input_w, d->input_dim);
      real *gb = m->grads + m->lay->input_b;
      for (int32_t j = 0; j < d->dm; j++) {
        real acc = 0;
        for (int64_t i = 0; i < M; i++) acc += dh0[i * d->dm + j];
        gb[j] += acc;
      }
      if (m->dinput)
        NAME(cpu_gemm)(m, CblasNoTrans, CblasNoTrans, (int)M, d->input_dim, d->dm, 1, dh0, d->dm,
                   m->params + m->lay->input_w, d->input_dim, 0, m->dinput, d->input_dim);
      break;
    }
    case M3_INPUT_IDENTITY:
      if (m->dinput) memcpy(m->dinput, dh0, (size_t)(M * d->dm) * sizeof(real));
      break;
    case M3_INPUT_TOKENS: {
      real *gemb = m->grads + m->lay->embedding;
      for (int64_t i = 0; i < M; i++) {
        real *row = gemb + (int64_t)m->tokens_copy[i] * d->dm;
        for (int32_t j = 0; j < d->dm; j++) row[j] += dh0[i * d->dm + j];
      }
      break;
    }
  }
}

m3_status NAME(cpu_model_backward)(cpu_model *m) {
  const m3_dims *d = m->d;
  const int32_t rows = m->rows, len = m->len;
  /* final RMSNorm */
  const real *hL = m->resid + (int64_t)d->L * m->cap * d->dm;
  real *gnf = m->grads + m->lay->norm_f;
  real *part = m->part;
  memset(part, 0, (size_t)d->dm * sizeof(real) * (size_t)rows);
#pragma omp parallel for schedule(static) num_threads(loop_threads(rows, (int64_t)rows * len * d->dm * 8, m->threads))
  for (int32_t r = 0; r < rows; r++)
    for (int64_t i = (int64_t)r * len; i < (int64_t)(r + 1) * len; i++)
      NAME(rmsnorm_backward_row)(hL + i * d->dm, m->params + m->lay->norm_f, m->out_rstd[i], m->dout + i * d->dm,
                                 m->dresid + i * d->dm, part + (int64_t)r * d->dm, d->dm, 0);
  for (int32_t j = 0; j < d->dm; j++) {
    real acc = 0;
    for (int32_t r = 0; r < rows; r++) acc += part[(int64_t)r * d->dm + j];
    gnf[j] += acc;
  }
  const uint8_t *resets = m->has_resets ? m->resets_copy : NULL;
  for (int32_t l = d->L - 1; l >= 0; l--) TRY(NAME(cpu_layer_backward)(m, l, resets));
  input_backward(m);
  return M3_OK;
}

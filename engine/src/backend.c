/*
 * backend.c — what the trainer (trainer.c) and the inference object (infer.c) share in
 * front of a backend: the placement and on / off fields of a creation config, the device
 * choice, the checks of a window's inputs, of row lists, layer indices and of a state handed to
 * set_state. Both callers validate here, so a bad call changes nothing.
 */
#include "backend.h"

#include "errors.h"

m3_status m3_check_placement(int32_t precision, int32_t device, int32_t device_index) {
  if (precision < M3_PRECISION_F32 || precision > M3_PRECISION_F16)
    return m3_fail(M3_ERR_CONFIG, "precision = %d: must be f32, bf16 or f16", precision);
  if (device < M3_DEVICE_AUTO || device > M3_DEVICE_CUDA)
    return m3_fail(M3_ERR_CONFIG, "device = %d: must be auto, cpu or cuda", device);
  if (device_index < 0) return m3_fail(M3_ERR_CONFIG, "device index = %d: must be >= 0", device_index);
  return M3_OK;
}

m3_status m3_check_flag(const char *name, int32_t value) {
  if (value != 0 && value != 1) return m3_fail(M3_ERR_CONFIG, "%s = %d: must be 0 or 1", name, value);
  return M3_OK;
}

/* The compute capability the kernels are built for (kernels/meson.build: sm_90, and PTX that newer GPUs compile). */
enum { MIN_CAPABILITY = 90 };

/* Device index's compute capability (10 major + minor), 0 without a CUDA build or such a device. */
static int32_t capability(int32_t index) {
#ifdef M3_HAVE_CUDA
  return index < m3_cuda_device_count() ? m3_cuda_device_capability(index) : 0;
#else
  (void)index;
  return 0;
#endif
}

m3_status m3_backend_open(const backend_args *a, int32_t device, int32_t *chosen, backend **out,
                          const backend_ops **ops) {
  /* auto takes the device only where the kernels can run on it */
  const int32_t want = device == M3_DEVICE_AUTO
                           ? (capability(a->device_index) >= MIN_CAPABILITY ? M3_DEVICE_CUDA : M3_DEVICE_CPU)
                           : device;
  *chosen = want;
  if (want == M3_DEVICE_CPU) {
    if (a->precision != M3_PRECISION_F32)
      return m3_fail(M3_ERR_UNSUPPORTED,
                     "dtype %s: the CPU backend computes in f32 only; bf16 and f16 need a CUDA device",
                     a->precision == M3_PRECISION_BF16 ? "bf16" : "f16");
    return m3_cpu_backend_create(a, out, ops);
  }
#ifdef M3_HAVE_CUDA
  const int32_t devices = m3_cuda_device_count();
  if (a->device_index >= devices)
    return m3_fail(M3_ERR_UNSUPPORTED, "device cuda:%d: this machine has %d usable CUDA device(s)", a->device_index,
                   devices);
  const int32_t cc = capability(a->device_index);
  if (cc < MIN_CAPABILITY)
    return m3_fail(M3_ERR_UNSUPPORTED,
                   "device cuda:%d has compute capability %d.%d: the CUDA kernels are built for %d.%d (Hopper) and "
                   "newer; use device cpu",
                   a->device_index, cc / 10, cc % 10, MIN_CAPABILITY / 10, MIN_CAPABILITY % 10);
  return m3_cuda_backend_create(a, out, ops);
#else
  return m3_fail(M3_ERR_UNSUPPORTED, "device cuda: this libm3 was built without the CUDA backend");
#endif
}

m3_status m3_check_batch_inputs(const m3_dims *d, const m3_batch *b, int32_t max_rows, int32_t max_len,
                                const char *call) {
  if (!b) return m3_fail(M3_ERR_ARGUMENT, "%s: batch is NULL", call);
  if (b->rows < 1 || b->rows > max_rows)
    return m3_fail(M3_ERR_ARGUMENT, "%s: batch has %d rows: must be in [1, %d] (the %s's batch)", call, b->rows,
                   max_rows, max_len > 0 ? "trainer" : "inference object");
  if (max_len > 0 && (b->len < 1 || b->len > max_len))
    return m3_fail(M3_ERR_ARGUMENT, "%s: batch has length %d: must be in [1, %d] (the trainer's seq_len)", call,
                   b->len, max_len);
  if (b->len < 1)
    return m3_fail(M3_ERR_ARGUMENT, "%s: batch has length %d: must be >= 1 (an empty prompt)", call, b->len);
  const int64_t n = (int64_t)b->rows * b->len;
  if (n > INT32_MAX)
    return m3_fail(M3_ERR_ARGUMENT, "%s: batch has %lld positions: must be < 2^31", call, (long long)n);
  if (d->input == M3_INPUT_TOKENS) {
    if (!b->tokens)
      return m3_fail(M3_ERR_ARGUMENT, "%s: batch.tokens is missing: the model's input is \"tokens\"", call);
    for (int64_t i = 0; i < n; i++)
      if (b->tokens[i] < 0 || b->tokens[i] >= d->vocab)
        return m3_fail(M3_ERR_ARGUMENT, "%s: batch.tokens[%lld] (row %lld, position %lld) = %d: must be in [0, %d)",
                       call, (long long)i, (long long)(i / b->len), (long long)(i % b->len), b->tokens[i], d->vocab);
  } else if (!b->input) {
    return m3_fail(M3_ERR_ARGUMENT, "%s: batch.input is missing: the model's input is \"%s\"", call,
                   d->input == M3_INPUT_FEATURES ? "features" : "identity");
  }
  return M3_OK;
}

m3_status m3_check_rows(const int32_t *rows, int32_t n_rows, int32_t batch, const char *what) {
  if (!rows) return M3_OK;
  if (n_rows < 0) return m3_fail(M3_ERR_ARGUMENT, "%s: n_rows = %d: must be >= 0", what, n_rows);
  for (int32_t i = 0; i < n_rows; i++)
    if (rows[i] < 0 || rows[i] >= batch)
      return m3_fail(M3_ERR_ARGUMENT, "%s: row %d out of range [0, %d)", what, rows[i], batch);
  return M3_OK;
}

m3_status m3_check_layer(const m3_dims *d, int32_t layer, const char *call) {
  if (layer < 0 || layer >= d->L)
    return m3_fail(M3_ERR_ARGUMENT, "%s: layer = %d: must be in [0, %d) (n_layers)", call, layer, d->L);
  return M3_OK;
}

static m3_status check_finite(const float *x, int64_t n, const char *what) {
  return x ? m3_check_finite(M3_ERR_ARGUMENT, x, n, 0, "set_states: %s", what) : M3_OK;
}

m3_status m3_check_state_values(const m3_dims *d, int32_t batch, const float *angle, const float *ssm,
                                const float *k, const float *v) {
  const int64_t bh = (int64_t)batch * d->H;
  TRY(check_finite(angle, bh * d->S, "angle"));
  TRY(check_finite(ssm, bh * d->P * d->N, "ssm"));
  TRY(check_finite(k, bh * d->N, "k"));
  return check_finite(v, bh * d->P, "v");
}

/*
 * errors.c — status names, the per-thread last-error message and the non-finite value check.
 *
 * One X-macro table lists every status with its name; m3_status_name reads it. The
 * message buffer is thread-local so concurrent trainers on different threads never see
 * each other's errors. m3_check_finite_at words every refusal of a non-finite value alike.
 */
#include "errors.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define M3_STATUS_TABLE(X) \
  X(M3_OK)                 \
  X(M3_ERR_ARGUMENT)       \
  X(M3_ERR_CONFIG)         \
  X(M3_ERR_IO)             \
  X(M3_ERR_FORMAT)         \
  X(M3_ERR_MEMORY)         \
  X(M3_ERR_ORDER)          \
  X(M3_ERR_NONFINITE)      \
  X(M3_ERR_UNSUPPORTED)    \
  X(M3_ERR_CUDA)           \
  X(M3_ERR_POISONED)       \
  X(M3_ERR_INTERRUPTED)    \
  X(M3_ERR_CLOSED)         \
  X(M3_ERR_INTERNAL)

#define AS_NAME(s) [s] = #s,
static const char *const status_names[] = {M3_STATUS_TABLE(AS_NAME)};
#undef AS_NAME

enum { MESSAGE_CAP = 2048 };
static _Thread_local char message[MESSAGE_CAP];

const char *m3_status_name(int32_t status) {
  if (status < 0 || status >= (int32_t)(sizeof status_names / sizeof status_names[0]))
    return "M3_ERR_UNKNOWN";
  return status_names[status];
}

const char *m3_last_error(void) { return message; }

void m3_clear_error(void) { message[0] = 0; }

m3_status m3_fail_at(m3_status status, const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(message, MESSAGE_CAP, fmt, ap);
  va_end(ap);
  if (n < 0) n = 0;
  if (n < MESSAGE_CAP) {
    const char *base = strrchr(file, '/');
    snprintf(message + n, (size_t)(MESSAGE_CAP - n), " (%s:%d)", base ? base + 1 : file, line);
  }
  return status;
}

m3_status m3_fail_context(m3_status status, const char *fmt, ...) {
  char prefix[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  size_t plen = strlen(prefix) + 2, olen = strnlen(message, MESSAGE_CAP - 1);
  if (plen + olen >= MESSAGE_CAP) olen = MESSAGE_CAP - 1 - plen;
  memmove(message + plen, message, olen);
  message[plen + olen] = 0;
  memcpy(message, prefix, plen - 2);
  message[plen - 2] = ':';
  message[plen - 1] = ' ';
  return status;
}

m3_status m3_check_finite_at(m3_status status, const char *file, int line, const float *x, int64_t n, int nonneg,
                             const char *fmt, ...) {
  int64_t i = 0;
  while (i < n && isfinite(x[i]) && !(nonneg && x[i] < 0)) i++;
  if (i == n) return M3_OK;
  char subject[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(subject, sizeof subject, fmt, ap);
  va_end(ap);
  return m3_fail_at(status, file, line, "%s [%lld] = %g: expected a finite%s value", subject, (long long)i,
                    m3_shown(x[i]), nonneg ? ", nonnegative" : "");
}

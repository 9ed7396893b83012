/*
 * errors.h — how engine code reports failures.
 *
 * A failing call sets a per-thread message with m3_fail() (status, then printf-style text;
 * file:line is added by the macro) and returns the status. TRY() propagates a status.
 * m3_check_finite() fails in one wording at the first non-finite value of an array; m3_shown() gives a number
 * to print in a message.
 * Nothing here prints or aborts; M3_ASSERT is for internal invariants only and also
 * returns M3_ERR_INTERNAL instead of aborting.
 */
#ifndef M3_ERRORS_H
#define M3_ERRORS_H

#include <math.h>

#include "m3.h"

m3_status m3_fail_at(m3_status status, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Prefixes the current message with more context ("loading x.safetensors: ..."). */
m3_status m3_fail_context(m3_status status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void m3_clear_error(void);
/* Fails with status at the first value of x [n] that is not finite (or, with nonneg, is negative):
 * "<subject> [index] = value: expected a finite value", the subject formatted from fmt only then, a NaN
 * printed as "nan" whatever its sign bit. */
m3_status m3_check_finite_at(m3_status status, const char *file, int line, const float *x, int64_t n, int nonneg,
                             const char *fmt, ...) __attribute__((format(printf, 7, 8)));

/* v as a message prints it: a NaN without its sign bit (glibc prints a NaN whose sign bit is set, what 0.0 / 0.0
 * gives on x86, as "-nan"). */
static inline double m3_shown(double v) { return isnan(v) ? NAN : v; }

#define m3_fail(status, ...) m3_fail_at((status), __FILE__, __LINE__, __VA_ARGS__)
#define m3_check_finite(status, x, n, nonneg, ...) \
  m3_check_finite_at((status), __FILE__, __LINE__, (x), (n), (nonneg), __VA_ARGS__)

#define TRY(expr)                     \
  do {                                \
    m3_status try_st_ = (expr);       \
    if (try_st_ != M3_OK) return try_st_; \
  } while (0)

#define M3_ASSERT(cond)                                                          \
  do {                                                                           \
    if (!(cond)) return m3_fail(M3_ERR_INTERNAL, "internal invariant failed: %s", #cond); \
  } while (0)

#endif

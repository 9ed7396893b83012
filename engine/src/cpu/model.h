/*
 * model.h — the CPU model in both precisions (model_t.h included for float and double).
 */
#ifndef M3_CPU_MODEL_H
#define M3_CPU_MODEL_H

#include <cblas.h>
#include <stdint.h>

#include "../errors.h"
#include "../layout.h"

/* Forward-only models run every GEMM over whole groups of this many rows (gemm.c). */
enum { M3_CPU_ROW_GROUP = 16 };

#define M3_CAT_(a, b) a##_##b
#define M3_CAT(a, b) M3_CAT_(a, b)

#define T_ float
#define S_ f32
#include "model_t.h"
#undef T_
#undef S_

#define T_ double
#define S_ f64
#include "model_t.h"
#undef T_
#undef S_

#endif

/*
 * model.h — the CPU model in both precisions (model_t.h included for float and double).
 */
#ifndef M3_CPU_MODEL_H
#define M3_CPU_MODEL_H

#include <cblas.h>
#include <stdint.h>

#include "../errors.h"
#include "../layout.h"

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

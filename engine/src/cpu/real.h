/*
 * real.h — one source, two precisions. Every file of the CPU model is compiled twice:
 * once as is (real = float, names suffixed _f32: the CPU backend) and once with
 * -DM3_REAL_DOUBLE (real = double, suffix _f64: the finite-difference reference).
 * NAME(x) gives the suffixed name; the math and BLAS macros pick the matching routine.
 */
#ifndef M3_CPU_REAL_H
#define M3_CPU_REAL_H

#include <cblas.h>
#include <math.h>

#include "model.h"

#ifdef M3_REAL_DOUBLE
typedef double real;
#define NAME(x) M3_CAT(x, f64)
#define R_EXP exp
#define R_LOG log
#define R_LOG1P log1p
#define R_TANH tanh
#define R_SQRT sqrt
#define R_FMOD fmod
#define R_SIN sin
#define R_COS cos
#define cblas_gemm cblas_dgemm
#else
typedef float real;
#define NAME(x) M3_CAT(x, f32)
#define R_EXP expf
#define R_LOG logf
#define R_LOG1P log1pf
#define R_TANH tanhf
#define R_SQRT sqrtf
#define R_FMOD fmodf
#define R_SIN sinf
#define R_COS cosf
#define cblas_gemm cblas_sgemm
#endif

typedef NAME(cpu_model) cpu_model;
typedef NAME(cpu_batch) cpu_batch;
typedef NAME(cpu_state) cpu_state;
typedef NAME(cpu_head_result) cpu_head_result;

#endif

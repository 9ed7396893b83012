/*
 * config.h — what the library needs of a model configuration beyond m3.h's public calls.
 */
#ifndef M3_CONFIG_H
#define M3_CONFIG_H

#include <stddef.h>

#include "m3.h"

/* 1 when the validated configs a and b describe the same model; else 0 and, in why (n bytes), the first
 * field that differs with both values as m3_config_to_json writes them: "d_state: 16 vs 8". */
int m3_config_same(const m3_config *a, const m3_config *b, char *why, size_t n);

#endif

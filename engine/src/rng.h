/*
 * rng.h — the engine's one random generator: xoshiro256** seeded through splitmix64.
 *
 * Documented so other implementations can reproduce init bits: state = four successive
 * splitmix64 outputs of the seed; uniform = (next >> 11) * 2^-53 in [0, 1); normal = Box-
 * Muller on two uniforms, sqrt(-2 ln(1 - u1)) * cos(2 pi u2), one value per pair.
 */
#ifndef M3_RNG_H
#define M3_RNG_H

#include <stdint.h>

typedef struct m3_rng {
  uint64_t s[4];
} m3_rng;

void m3_rng_seed(m3_rng *r, uint64_t seed);
uint64_t m3_rng_next(m3_rng *r);
double m3_rng_uniform(m3_rng *r);
double m3_rng_normal(m3_rng *r);

#endif

/*
 * checksum.c — see checksum.h. Each item is hashed on its own (its name, its length, its bytes
 * eight at a time, a multiply-xorshift mix per word) and the items' hashes are summed.
 */
#include "checksum.h"

#include <string.h>

static uint64_t mix(uint64_t h, uint64_t w) {
  h ^= w;
  h *= 0x9E3779B97F4A7C15ull;
  return h ^ (h >> 29);
}

static uint64_t hash_bytes(uint64_t h, const unsigned char *p, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    memcpy(&w, p + i, 8);
    h = mix(h, w);
  }
  uint64_t tail = 0;
  if (n > i) memcpy(&tail, p + i, n - i); /* p may be NULL when n is 0 */
  return mix(h, tail ^ ((uint64_t)(n - i) << 56));
}

void m3_checksum_add(uint64_t *sum, const char *name, const void *data, size_t n) {
  uint64_t h = hash_bytes(0x243F6A8885A308D3ull, (const unsigned char *)name, strlen(name));
  h = mix(h, (uint64_t)n);
  h = hash_bytes(h, (const unsigned char *)data, n);
  *sum += mix(h, 0xB7E151628AED2A6Bull);
}

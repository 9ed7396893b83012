/*
 * checksum.h — a 64-bit checksum of named byte strings (a checkpoint's tensors and metadata),
 * for telling a damaged file from a good one. Not cryptographic: it catches flipped bytes and
 * truncation, not a forgery. The items' order does not matter (their hashes are added), so a
 * writer and a reader may visit them in different orders.
 */
#ifndef M3_CHECKSUM_H
#define M3_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

/* Adds the item (name, n bytes at data) to *sum. */
void m3_checksum_add(uint64_t *sum, const char *name, const void *data, size_t n);

#endif

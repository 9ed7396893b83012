/*
 * test_safetensors.c — checks the safetensors reader and writer and the weights file I/O.
 *
 * Round trips of every dtype (0-d and 0-sized shapes included) and of metadata; a catalogue
 * of malformed files, each of which must be rejected with M3_ERR_FORMAT, plus byte-level
 * mutations of a valid file that must never crash; atomic writes that fail and must leave
 * the old file and no temporary behind; targets that are not regular files (a FIFO, a folder, a
 * symbolic link to one or to nothing: refused, left as they are; a link to a regular file: written
 * through, the link kept; a FIFO read: refused, not waited on); weights save/load (bit-exact, "backbone." prefix,
 * F64/F16/BF16 sources, tied lm_head, missing/extra/mis-shaped tensors, NaN and infinite values
 * refused with the tensor's name, element and value); the writer refusing a shape dim or data offset past 2^53,
 * which the reader would refuse, names and metadata that are not UTF-8, which other readers refuse, and an empty
 * path; trainer checkpoints: the live lr, clip and no-decay choice back exactly; forged without their checksum (a
 * file written before checksums): the rng words taken only as saved (16 lowercase hex digits each), a scaler state
 * refused on a trainer without f16, a checkpoint saved on CUDA
 * loading on the CPU without a GPU when opts are NULL, as with every opt -1; and every golden
 * file of ../shared. Prints one line per check; exits nonzero when any check fails.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "m3.h"

static int n_pass, n_fail;
static char tmpdir[] = "/tmp/m3_test_safetensors_XXXXXX";

static void check(int ok, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("%s: ", ok ? "ok" : "FAIL");
  vprintf(fmt, ap);
  va_end(ap);
  if (!ok) printf("  [last error: %s]", m3_last_error());
  printf("\n");
  if (ok)
    n_pass++;
  else
    n_fail++;
}

static const char *tmp_path(const char *name) {
  static char buf[8][512];
  static int next;
  char *p = buf[next++ % 8];
  snprintf(p, 512, "%s/%s", tmpdir, name);
  return p;
}

static void write_bytes(const char *path, const void *data, size_t n) {
  FILE *fp = fopen(path, "wb");
  if (!fp || fwrite(data, 1, n, fp) != n) {
    fprintf(stderr, "cannot write %s: %s\n", path, strerror(errno));
    exit(2);
  }
  fclose(fp);
}

static char *read_all(const char *path, size_t *n) {
  FILE *fp = fopen(path, "rb");
  if (!fp) return NULL;
  fseek(fp, 0, SEEK_END);
  long size = ftell(fp);
  fseek(fp, 0, SEEK_SET);
  char *buf = malloc((size_t)size + 1);
  *n = fread(buf, 1, (size_t)size, fp);
  fclose(fp);
  return buf;
}

/* A raw safetensors file: declared header length, header text, then data_len bytes. */
static void write_raw(const char *path, uint64_t declared, const char *header, size_t hlen, size_t data_len) {
  size_t n = 8 + hlen + data_len;
  unsigned char *buf = calloc(n, 1);
  for (int i = 0; i < 8; i++) buf[i] = (unsigned char)(declared >> (8 * i));
  memcpy(buf + 8, header, hlen);
  for (size_t i = 0; i < data_len; i++) buf[8 + hlen + i] = (unsigned char)i;
  write_bytes(path, buf, n);
  free(buf);
}

static void expect_format(const char *label, const char *path) {
  m3_tensor_file *f = (m3_tensor_file *)&n_pass; /* poison: open must reset it */
  m3_status st = m3_tensor_file_open(path, &f);
  int names_file = strstr(m3_last_error(), path) != NULL;
  check(st == M3_ERR_FORMAT && f == NULL && names_file, "malformed (%s) -> %s: %s", label, m3_status_name(st),
        m3_last_error());
  if (st == M3_OK) m3_tensor_file_close(f);
}

static void bad_header(const char *label, const char *header, size_t data_len) {
  const char *path = tmp_path("bad.safetensors");
  write_raw(path, strlen(header), header, strlen(header), data_len);
  expect_format(label, path);
}

/* ---- round trips -------------------------------------------------------------------- */

typedef struct spec {
  const char *name;
  int32_t dtype, ndim;
  int64_t shape[8];
  size_t elem;
} spec;

static const spec specs[] = {
    {"f32", M3_DTYPE_F32, 2, {2, 3}, 4},
    {"u8.odd", M3_DTYPE_U8, 1, {3}, 1}, /* makes every later file offset unaligned */
    {"f64", M3_DTYPE_F64, 1, {5}, 8},
    {"scalar.i32", M3_DTYPE_I32, 0, {0}, 4},
    {"empty.u8", M3_DTYPE_U8, 3, {3, 0, 2}, 1},
    {"f16", M3_DTYPE_F16, 1, {7}, 2},
    {"bf16.8d", M3_DTYPE_BF16, 8, {1, 2, 1, 1, 1, 1, 1, 3}, 2},
    {"i64", M3_DTYPE_I64, 1, {2}, 8},
    {"i16", M3_DTYPE_I16, 2, {1, 3}, 2},
    {"i8", M3_DTYPE_I8, 1, {5}, 1},
    {"bool", M3_DTYPE_BOOL, 1, {4}, 1},
    {"u16", M3_DTYPE_U16, 1, {3}, 2},
    {"u32", M3_DTYPE_U32, 1, {3}, 4},
    {"u64", M3_DTYPE_U64, 1, {1}, 8},
    {"weird \"name\"\\\t\xc3\xa9", M3_DTYPE_F32, 1, {1}, 4},
};
enum { N_SPECS = sizeof specs / sizeof specs[0] };

static int64_t spec_numel(const spec *s) {
  int64_t n = 1;
  for (int i = 0; i < s->ndim; i++) n *= s->shape[i];
  return n;
}

static const char *meta_keys[] = {"config", "quote\"back\\slash", "empty", "unicode \xe2\x82\xac"};
static const char *meta_values[] = {"{\"d_model\": 4}", "line\nbreak\ttab\x01", "", "\xf0\x9f\x99\x82"};

static void test_round_trip(void) {
  unsigned char *data[N_SPECS];
  m3_tensor_writer *w = NULL;
  check(m3_tensor_writer_create(&w) == M3_OK, "writer create");
  for (int i = 0; i < N_SPECS; i++) {
    size_t n = (size_t)spec_numel(&specs[i]) * specs[i].elem;
    data[i] = malloc(n + 1);
    for (size_t j = 0; j < n; j++) data[i][j] = (unsigned char)(i * 31 + j * 7 + 1);
    m3_status st = m3_tensor_writer_add(w, specs[i].name, specs[i].dtype, specs[i].ndim, specs[i].shape, data[i]);
    check(st == M3_OK, "writer add %s", specs[i].name);
  }
  for (int i = 0; i < 4; i++)
    check(m3_tensor_writer_add_metadata(w, meta_keys[i], meta_values[i]) == M3_OK, "add metadata %d", i);
  const char *path = tmp_path("round.safetensors");
  check(m3_tensor_writer_write(w, path) == M3_OK, "write %s", path);
  m3_tensor_writer_destroy(w);

  size_t raw_n = 0;
  char *raw = read_all(path, &raw_n);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = hlen << 8 | (unsigned char)raw[i];
  check(hlen % 8 == 0 && hlen + 8 <= raw_n && raw[8] == '{', "header length %llu is a multiple of 8",
        (unsigned long long)hlen);
  int pad_ok = 1, k = (int)hlen + 7;
  while (raw[k] == ' ') k--;
  pad_ok = raw[k] == '}' && (int)hlen + 7 - k < 8;
  check(pad_ok, "header padded with fewer than 8 spaces after the JSON");
  free(raw);

  m3_tensor_file *f = NULL;
  check(m3_tensor_file_open(path, &f) == M3_OK, "reopen round-trip file");
  if (!f) return;
  check(m3_tensor_file_count(f) == N_SPECS, "tensor count %d", m3_tensor_file_count(f));
  for (int i = 0; i < N_SPECS; i++) {
    m3_file_tensor t;
    int ok = m3_tensor_file_get(f, i, &t) == M3_OK && strcmp(t.name, specs[i].name) == 0 && t.dtype == specs[i].dtype &&
             t.ndim == specs[i].ndim && t.numel == spec_numel(&specs[i]) &&
             t.nbytes == (size_t)t.numel * specs[i].elem && ((uintptr_t)t.data % 64) == 0 &&
             memcmp(t.data, data[i], t.nbytes) == 0 && m3_tensor_file_find(f, specs[i].name) == i;
    for (int d = 0; ok && d < t.ndim; d++) ok = t.shape[d] == specs[i].shape[d];
    check(ok, "round trip %s (dtype %d, ndim %d, insertion order, 64-byte aligned data)", specs[i].name, specs[i].dtype,
          specs[i].ndim);
    free(data[i]);
  }
  check(m3_tensor_file_find(f, "nope") == -1 && m3_tensor_file_find(f, "f3") == -1 && m3_tensor_file_find(f, "") == -1,
        "find of absent names is -1");
  m3_file_tensor t;
  check(m3_tensor_file_get(f, N_SPECS, &t) == M3_ERR_ARGUMENT && m3_tensor_file_get(f, -1, &t) == M3_ERR_ARGUMENT,
        "get out of range is M3_ERR_ARGUMENT");
  check(m3_tensor_file_metadata_count(f) == 4, "metadata count");
  for (int i = 0; i < 4; i++) {
    const char *v = m3_tensor_file_metadata(f, meta_keys[i]);
    check(v && strcmp(v, meta_values[i]) == 0 && strcmp(m3_tensor_file_metadata_key(f, i), meta_keys[i]) == 0,
          "metadata round trip of key %d (escaping)", i);
  }
  check(m3_tensor_file_metadata(f, "absent") == NULL && m3_tensor_file_metadata_key(f, 4) == NULL,
        "absent metadata is NULL");
  m3_tensor_file_close(f);

  /* an empty file: no tensors, no metadata */
  check(m3_tensor_writer_create(&w) == M3_OK && m3_tensor_writer_write(w, tmp_path("empty.safetensors")) == M3_OK,
        "write a file without tensors");
  m3_tensor_writer_destroy(w);
  f = NULL;
  check(m3_tensor_file_open(tmp_path("empty.safetensors"), &f) == M3_OK && m3_tensor_file_count(f) == 0 &&
            m3_tensor_file_metadata_count(f) == 0,
        "open a file without tensors");
  m3_tensor_file_close(f);
}

static void test_writer_arguments(void) {
  m3_tensor_writer *w = NULL;
  m3_tensor_writer_create(&w);
  float x[4] = {0};
  int64_t shape[9] = {2, 2, 1, 1, 1, 1, 1, 1, 1}, neg[1] = {-1}, huge[2] = {INT64_MAX / 2, 4};
  check(m3_tensor_writer_add(w, "a", M3_DTYPE_F32, 2, shape, x) == M3_OK, "writer add a");
  check(m3_tensor_writer_add(w, "a", M3_DTYPE_F32, 2, shape, x) == M3_ERR_ARGUMENT, "duplicate tensor name rejected");
  check(m3_tensor_writer_add(w, "b", 13, 2, shape, x) == M3_ERR_ARGUMENT, "bad dtype rejected");
  check(m3_tensor_writer_add(w, "b", M3_DTYPE_F32, 9, shape, x) == M3_ERR_ARGUMENT, "ndim 9 rejected");
  check(m3_tensor_writer_add(w, "b", M3_DTYPE_F32, 1, neg, x) == M3_ERR_ARGUMENT, "negative dim rejected");
  check(m3_tensor_writer_add(w, "b", M3_DTYPE_F32, 2, huge, x) == M3_ERR_ARGUMENT, "overflowing shape rejected");
  check(m3_tensor_writer_add(w, "b", M3_DTYPE_F32, 2, shape, NULL) == M3_ERR_ARGUMENT, "NULL data rejected");
  const int64_t one_byte[1] = {1};
  check(m3_tensor_writer_add(w, "b", M3_DTYPE_U8, 1, one_byte, NULL) == M3_ERR_ARGUMENT &&
            strstr(m3_last_error(), "tensor \"b\": data is NULL"),
        "NULL data of a one-byte tensor rejected: %s", m3_last_error());
  check(m3_tensor_writer_add(w, "__metadata__", M3_DTYPE_F32, 2, shape, x) == M3_ERR_ARGUMENT,
        "reserved name rejected");
  check(m3_tensor_writer_add(w, "", M3_DTYPE_F32, 2, shape, x) == M3_ERR_ARGUMENT, "empty name rejected");
  check(m3_tensor_writer_add_metadata(w, "k", "v") == M3_OK, "metadata k");
  check(m3_tensor_writer_add_metadata(w, "k", "w") == M3_ERR_ARGUMENT, "duplicate metadata key rejected");
  check(m3_tensor_writer_add_metadata(w, "k2", NULL) == M3_ERR_ARGUMENT, "NULL metadata value rejected");
  check(m3_tensor_writer_write(w, NULL) == M3_ERR_ARGUMENT, "NULL path rejected");
  check(m3_tensor_writer_write(w, "") == M3_ERR_ARGUMENT && strstr(m3_last_error(), "the path is empty"),
        "empty path rejected (not a temporary file in the working folder renamed onto nothing): %s", m3_last_error());
  /* a header is JSON text, which is UTF-8: other readers (Python's safetensors) refuse a file whose header is not */
  static const char *const not_utf8[] = {"a\xff", "\xc0\x80", "\xe0\x9f\xbf", "\xed\xa0\x80", "\xf4\x90\x80\x80",
                                         "caf\xe9", "cut\xe2\x82", "\x80"};
  for (size_t i = 0; i < sizeof not_utf8 / sizeof not_utf8[0]; i++) {
    m3_status name_st = m3_tensor_writer_add(w, not_utf8[i], M3_DTYPE_F32, 2, shape, x);
    const char *bad = " is not UTF-8 (byte ";
    int name_said = strstr(m3_last_error(), "tensor name \"") && strstr(m3_last_error(), bad);
    m3_status key_st = m3_tensor_writer_add_metadata(w, not_utf8[i], "v");
    int key_said = strstr(m3_last_error(), "metadata key \"") && strstr(m3_last_error(), bad);
    m3_status value_st = m3_tensor_writer_add_metadata(w, "key", not_utf8[i]);
    int value_said = strstr(m3_last_error(), "metadata \"key\": the value \"") && strstr(m3_last_error(), bad);
    check(name_st == M3_ERR_ARGUMENT && key_st == M3_ERR_ARGUMENT && value_st == M3_ERR_ARGUMENT && name_said &&
              key_said && value_said,
          "not UTF-8 (case %zu) rejected as a tensor name, a metadata key and a metadata value: %s", i,
          m3_last_error());
  }
  check(strstr(m3_last_error(), "the value \"\\x80\" is not UTF-8 (byte 0 is 0x80)") != NULL,
        "the message shows the bytes past ASCII as \\xNN and names the first bad one: %s", m3_last_error());
  const char *utf8 = "h\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80 \xf4\x8f\xbf\xbd"; /* é € 😀 U+10FFFD */
  check(m3_tensor_writer_add(w, utf8, M3_DTYPE_F32, 2, shape, x) == M3_OK &&
            m3_tensor_writer_add_metadata(w, "\xed\x9f\xbf", "\xee\x80\x80\xef\xbf\xbf") == M3_OK,
        "UTF-8 names and metadata up to U+10FFFF (around the surrogates) accepted");
  m3_tensor_writer_destroy(w);
  m3_tensor_writer_destroy(NULL);

  /* the reader takes shape dims and data offsets up to 2^53 (the integers a JSON number holds exactly) */
  const int64_t e53 = (int64_t)1 << 53;
  int64_t wide[2] = {0, INT64_MAX}, over[2] = {0, e53 + 1}, edge[2] = {0, e53}, half[1] = {e53 / 2}, one[1] = {1};
  w = NULL;
  m3_tensor_writer_create(&w);
  m3_status st = m3_tensor_writer_add(w, "wide", M3_DTYPE_F32, 2, wide, NULL);
  check(st == M3_ERR_ARGUMENT && strstr(m3_last_error(), "dim 1 is 9223372036854775807: must be in [0, 2^53]"),
        "an empty tensor of dim INT64_MAX rejected (the reader would refuse the file)");
  st = m3_tensor_writer_add(w, "over", M3_DTYPE_F32, 2, over, NULL);
  check(st == M3_ERR_ARGUMENT && strstr(m3_last_error(), "dim 1 is 9007199254740993: must be in [0, 2^53]"),
        "an empty tensor of dim 2^53 + 1 rejected");
  check(m3_tensor_writer_add(w, "edge", M3_DTYPE_F32, 2, edge, NULL) == M3_OK, "an empty tensor of dim 2^53 added");
  check(m3_tensor_writer_write(w, tmp_path("edge.safetensors")) == M3_OK, "... and written");
  m3_tensor_writer_destroy(w);
  m3_tensor_file *f = NULL;
  m3_file_tensor t = {0};
  check(m3_tensor_file_open(tmp_path("edge.safetensors"), &f) == M3_OK && m3_tensor_file_count(f) == 1 &&
            m3_tensor_file_get(f, 0, &t) == M3_OK && t.ndim == 2 && t.shape[1] == e53 && t.numel == 0,
        "... and read back");
  m3_tensor_file_close(f);
  /* data offsets: added only, never written (x is not that long) */
  w = NULL;
  m3_tensor_writer_create(&w);
  check(m3_tensor_writer_add(w, "h1", M3_DTYPE_U8, 1, half, x) == M3_OK &&
            m3_tensor_writer_add(w, "h2", M3_DTYPE_U8, 1, half, x) == M3_OK,
        "tensors of 2^52 bytes each, ending the data section at byte 2^53, added");
  st = m3_tensor_writer_add(w, "h3", M3_DTYPE_U8, 1, one, x);
  check(st == M3_ERR_ARGUMENT && strstr(m3_last_error(), "tensor \"h3\": 1 bytes after the 9007199254740992 before it "
                                                         "would end the data section past byte 2^53"),
        "a tensor ending past data byte 2^53 rejected");
  half[0] = e53 / 4;
  st = m3_tensor_writer_add(w, "h4", M3_DTYPE_F64, 1, half, x);
  check(st == M3_ERR_ARGUMENT, "a tensor of 2^54 bytes (each dim within 2^53) rejected");
  m3_tensor_writer_destroy(w);
  m3_tensor_file_close(NULL);
  check(m3_tensor_file_count(NULL) == 0 && m3_tensor_file_find(NULL, "a") == -1, "NULL file accessors are safe");
}

/* ---- malformed files ---------------------------------------------------------------- */

static void test_malformed(void) {
  const char *path = tmp_path("bad.safetensors");
  write_bytes(path, "", 0);
  expect_format("empty file", path);
  write_bytes(path, "\x02\0\0\0\0", 5);
  expect_format("5-byte file", path);
  write_raw(path, 100, "{}", 2, 0);
  expect_format("header length beyond the file", path);
  write_raw(path, UINT64_MAX, "{}", 2, 0);
  expect_format("header length 2^64-1", path);
  {
    /* a sparse file larger than 100 MB whose header claims more than 100 MB */
    uint64_t big = 100000001;
    write_raw(path, big, "{}", 2, 0);
    check(truncate(path, (off_t)(big + 8)) == 0, "make a sparse %llu-byte file", (unsigned long long)big + 8);
    expect_format("header length over 100 MB", path);
  }
  bad_header("not JSON", "{abc", 0);
  bad_header("empty header", "", 0);
  bad_header("JSON array", "[1, 2]", 0);
  bad_header("JSON string", "\"x\"", 0);
  bad_header("trailing garbage", "{} x", 0);
  write_raw(path, 4, "{}\0 ", 4, 0);
  expect_format("NUL byte in header", path);
  bad_header("entry not an object", "{\"a\": 5}", 0);
  bad_header("missing dtype", "{\"a\": {\"shape\": [1], \"data_offsets\": [0, 4]}}", 4);
  bad_header("missing shape", "{\"a\": {\"dtype\": \"F32\", \"data_offsets\": [0, 4]}}", 4);
  bad_header("missing data_offsets", "{\"a\": {\"dtype\": \"F32\", \"shape\": [1]}}", 4);
  bad_header("unknown dtype", "{\"a\": {\"dtype\": \"F8\", \"shape\": [1], \"data_offsets\": [0, 1]}}", 1);
  bad_header("lower-case dtype", "{\"a\": {\"dtype\": \"f32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4);
  bad_header("dtype not a string", "{\"a\": {\"dtype\": 0, \"shape\": [1], \"data_offsets\": [0, 4]}}", 4);
  bad_header("negative dim", "{\"a\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}", 4);
  bad_header("fractional dim", "{\"a\": {\"dtype\": \"F32\", \"shape\": [1.5], \"data_offsets\": [0, 4]}}", 4);
  bad_header("string dim", "{\"a\": {\"dtype\": \"F32\", \"shape\": [\"1\"], \"data_offsets\": [0, 4]}}", 4);
  bad_header("shape not an array", "{\"a\": {\"dtype\": \"F32\", \"shape\": 1, \"data_offsets\": [0, 4]}}", 4);
  bad_header("empty tensor with a dim past 2^53",
             "{\"a\": {\"dtype\": \"F32\", \"shape\": [0, 9007199254740994], \"data_offsets\": [0, 0]}}", 0);
  bad_header("huge dim", "{\"a\": {\"dtype\": \"F32\", \"shape\": [1e300], \"data_offsets\": [0, 4]}}", 4);
  bad_header("ndim 9", "{\"a\": {\"dtype\": \"U8\", \"shape\": [1,1,1,1,1,1,1,1,1], \"data_offsets\": [0, 1]}}", 1);
  bad_header("numel overflow",
             "{\"a\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296], \"data_offsets\": [0, 4]}}", 4);
  bad_header("byte size overflow",
             "{\"a\": {\"dtype\": \"F64\", \"shape\": [4503599627370496, 4096], \"data_offsets\": [0, 8]}}", 8);
  bad_header("one data offset", "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4]}}", 4);
  bad_header("three data offsets", "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4, 8]}}", 8);
  bad_header("string offsets", "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [\"0\", 4]}}", 4);
  bad_header("negative offset", "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [-4, 0]}}", 4);
  bad_header("begin after end", "{\"a\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [4, 0]}}", 4);
  bad_header("begin one after end", "{\"a\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [5, 4]}}", 8);
  check(strstr(m3_last_error(), "data_offsets [5, 4] begin after end") != NULL, "begin one after end is named: %s",
        m3_last_error());
  bad_header("end beyond data", "{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}", 4);
  check(strstr(m3_last_error(), "data_offsets end 8 is beyond the data section (4 bytes)") != NULL,
        "an end past the data section is named: %s", m3_last_error());
  bad_header("length != numel * size", "{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 4]}}", 4);
  bad_header("overlapping tensors",
             "{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
             " \"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}",
             12);
  bad_header("same range twice",
             "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
             " \"b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}",
             4);
  bad_header("gap between tensors",
             "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
             " \"b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 12]}}",
             12);
  bad_header("trailing data bytes", "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 8);
  bad_header("duplicate tensor name",
             "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
             " \"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
             8);
  bad_header("__metadata__ not an object", "{\"__metadata__\": \"x\"}", 0);
  bad_header("__metadata__ null", "{\"__metadata__\": null}", 0);
  bad_header("__metadata__ value not a string", "{\"__metadata__\": {\"a\": 1}}", 0);
  bad_header("__metadata__ twice", "{\"__metadata__\": {}, \"__metadata__\": {}}", 0);
  bad_header("__metadata__ duplicate key", "{\"__metadata__\": {\"a\": \"1\", \"a\": \"2\"}}", 0);
  /* an escaped NUL would cut a name, key or value short as a C string */
  bad_header("escaped NUL in a tensor name",
             "{\"a\\u0000b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4);
  check(strstr(m3_last_error(), "header string \"a\\u0000b\" (at header byte 1) holds an escaped NUL") != NULL,
        "the escaped NUL's error names the string: %s", m3_last_error());
  bad_header("escaped NUL in a metadata key", "{\"__metadata__\": {\"k\\u0000\": \"v\"}}", 0);
  bad_header("escaped NUL in a metadata value", "{\"__metadata__\": {\"k\": \"\\u0000v\"}}", 0);
  bad_header("escaped NUL in a dtype",
             "{\"a\": {\"dtype\": \"F32\\u0000\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4);
  {
    char deep[4200];
    memset(deep, '[', 2000);
    memset(deep + 2000, ']', 2000);
    deep[4000] = 0;
    bad_header("2000 nested arrays", deep, 0);
  }
  /* the accepted cases next to these: zero-sized tensors sharing an offset, any key order */
  const char *ok_header =
      "{\"z\": {\"data_offsets\": [4, 4], \"shape\": [0, 3], \"dtype\": \"F64\"},"
      " \"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
      " \"y\": {\"dtype\": \"I8\", \"shape\": [0], \"data_offsets\": [4, 4]}, \"__metadata__\": {}}  ";
  write_raw(path, strlen(ok_header), ok_header, strlen(ok_header), 4);
  m3_tensor_file *f = NULL;
  check(m3_tensor_file_open(path, &f) == M3_OK && m3_tensor_file_count(f) == 3 && m3_tensor_file_find(f, "a") == 1,
        "zero-sized tensors at a shared offset are accepted");
  m3_tensor_file_close(f);
  /* a zero-sized tensor at the begin of a non-empty one, listed after it: it sorts first (an empty range ends first) */
  const char *empty_after =
      "{\"b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
      " \"e\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [0, 0]}}";
  write_raw(path, strlen(empty_after), empty_after, strlen(empty_after), 4);
  f = NULL;
  check(m3_tensor_file_open(path, &f) == M3_OK && m3_tensor_file_count(f) == 2 && m3_tensor_file_find(f, "e") == 1,
        "a zero-sized tensor sharing the begin of a non-empty one listed before it is accepted");
  m3_tensor_file_close(f);
  const char *backslash_header = "{\"a\\\\u0000\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}";
  write_raw(path, strlen(backslash_header), backslash_header, strlen(backslash_header), 4);
  f = NULL;
  check(m3_tensor_file_open(path, &f) == M3_OK && m3_tensor_file_find(f, "a\\u0000") == 0,
        "an escaped backslash before u0000 is no NUL: the name \"a\\u0000\" is read as it is");
  m3_tensor_file_close(f);

  f = (m3_tensor_file *)&n_pass;
  check(m3_tensor_file_open(tmp_path("does-not-exist"), &f) == M3_ERR_IO && f == NULL, "missing file is M3_ERR_IO");
  check(m3_tensor_file_open(tmpdir, &f) == M3_ERR_IO && f == NULL, "a directory is M3_ERR_IO");
  check(m3_tensor_file_open(NULL, &f) == M3_ERR_ARGUMENT && m3_tensor_file_open(path, NULL) == M3_ERR_ARGUMENT,
        "NULL arguments are M3_ERR_ARGUMENT");
}

/* Every truncation and many single-byte changes of a valid file: any status, never a crash. */
static void test_mutations(void) {
  const char *src = tmp_path("round.safetensors"), *path = tmp_path("mutant.safetensors");
  size_t n = 0;
  unsigned char *orig = (unsigned char *)read_all(src, &n);
  int opened = 0, rejected = 0, wrong_status = 0;
  static const unsigned char values[] = {0, '"', '}', ']', '[', '-', '9', ' ', 0xff, '.'};
  for (size_t len = 0; len < n; len++) {
    write_bytes(path, orig, len);
    m3_tensor_file *f = NULL;
    m3_status st = m3_tensor_file_open(path, &f);
    wrong_status += st != M3_ERR_FORMAT;
    m3_tensor_file_close(f);
  }
  check(wrong_status == 0, "all %zu truncations rejected with M3_ERR_FORMAT", n);
  for (size_t pos = 0; pos < n && pos < 8 + 4096; pos++) {
    for (size_t v = 0; v < sizeof values; v++) {
      unsigned char keep = orig[pos];
      if (keep == values[v]) continue;
      orig[pos] = values[v];
      write_bytes(path, orig, n);
      orig[pos] = keep;
      m3_tensor_file *f = NULL;
      m3_status st = m3_tensor_file_open(path, &f);
      if (st == M3_OK) {
        opened++;
        for (int32_t i = 0; i < m3_tensor_file_count(f); i++) {
          m3_file_tensor t;
          m3_tensor_file_get(f, i, &t);
          volatile unsigned char sink = t.nbytes ? ((const unsigned char *)t.data)[t.nbytes - 1] : 0;
          (void)sink;
        }
      } else {
        rejected++;
        wrong_status += st != M3_ERR_FORMAT;
      }
      m3_tensor_file_close(f);
    }
  }
  check(wrong_status == 0, "byte mutations: %d opened, %d rejected, all with M3_ERR_FORMAT, no crash", opened,
        rejected);
  free(orig);
}

/* ---- atomic writes ------------------------------------------------------------------ */

static int count_entries(const char *dir) {
  DIR *d = opendir(dir);
  int n = 0;
  for (struct dirent *e; d && (e = readdir(d));) n += e->d_name[0] != '.';
  if (d) closedir(d);
  return n;
}

static int same_file(const char *path, const char *content) {
  size_t n = 0;
  char *buf = read_all(path, &n);
  int same = buf && n == strlen(content) && memcmp(buf, content, n) == 0;
  free(buf);
  return same;
}

static m3_tensor_writer *big_writer(const float *data, int64_t n) {
  m3_tensor_writer *w = NULL;
  m3_tensor_writer_create(&w);
  m3_tensor_writer_add(w, "x", M3_DTYPE_F32, 1, &n, data);
  return w;
}

static void test_atomic(void) {
  char dir[600];
  snprintf(dir, sizeof dir, "%s/atomic", tmpdir);
  mkdir(dir, 0777);
  char target[700];
  snprintf(target, sizeof target, "%s/old.safetensors", dir);
  const char *old = "old contents";
  write_bytes(target, old, strlen(old));
  enum { N = 1 << 16 };
  float *data = calloc(N, sizeof *data);
  m3_tensor_writer *w = big_writer(data, N);

  /* a write that fails midway: a file size limit makes write() fail with EFBIG */
  struct rlimit saved, small = {4096, 0};
  getrlimit(RLIMIT_FSIZE, &saved);
  small.rlim_max = saved.rlim_max;
  signal(SIGXFSZ, SIG_IGN);
  setrlimit(RLIMIT_FSIZE, &small);
  m3_status st = m3_tensor_writer_write(w, target);
  setrlimit(RLIMIT_FSIZE, &saved);
  check(st == M3_ERR_IO && strstr(m3_last_error(), strerror(EFBIG)), "failing write is M3_ERR_IO with strerror: %s",
        m3_last_error());
  check(same_file(target, old) && count_entries(dir) == 1, "failed write left the old file and no temporary behind");

  /* the temporary cannot be created: the directory is read-only (not for root) */
  if (geteuid() != 0) {
    chmod(dir, 0555);
    st = m3_tensor_writer_write(w, target);
    chmod(dir, 0777);
    check(st == M3_ERR_IO && same_file(target, old) && count_entries(dir) == 1,
          "read-only directory: M3_ERR_IO, old file intact: %s", m3_last_error());
  } else {
    printf("skipped: read-only directory check (running as root)\n");
  }

  /* the target is a non-empty directory: refused */
  char sub[800], inner[900];
  snprintf(sub, sizeof sub, "%s/adir", dir);
  snprintf(inner, sizeof inner, "%s/keep", sub);
  mkdir(sub, 0777);
  write_bytes(inner, "k", 1);
  st = m3_tensor_writer_write(w, sub);
  check(st == M3_ERR_IO && same_file(inner, "k") && count_entries(dir) == 2,
        "rename over a directory fails cleanly: %s", m3_last_error());

  char missing[800];
  snprintf(missing, sizeof missing, "%s/no/such/dir/x.safetensors", dir);
  st = m3_tensor_writer_write(w, missing);
  check(st == M3_ERR_IO && strstr(m3_last_error(), strerror(ENOENT)), "missing directory: %s", m3_last_error());

  /* a header over the reader's 100 MB limit is refused before anything is written */
  char *value = malloc(100000001);
  memset(value, 'v', 100000000);
  value[100000000] = 0;
  m3_tensor_writer *long_meta = big_writer(data, 1);
  m3_tensor_writer_add_metadata(long_meta, "k", value);
  free(value);
  st = m3_tensor_writer_write(long_meta, target);
  check(st == M3_ERR_ARGUMENT && strstr(m3_last_error(), "must be at most 100000000"),
        "header over 100 MB refused: %s", m3_last_error());
  check(same_file(target, old) && count_entries(dir) == 2, "refused header left the old file and no temporary behind");
  m3_tensor_writer_destroy(long_meta);

  st = m3_tensor_writer_write(w, target);
  m3_tensor_file *f = NULL;
  check(st == M3_OK && m3_tensor_file_open(target, &f) == M3_OK && m3_tensor_file_count(f) == 1 &&
            count_entries(dir) == 2,
        "successful write replaces the old file");
  m3_tensor_file_close(f);
  m3_tensor_writer_destroy(w);
  free(data);
}

static int is_type(const char *path, mode_t type) {
  struct stat st;
  return lstat(path, &st) == 0 && (st.st_mode & S_IFMT) == type;
}

/* Only a regular file, or a symbolic link to one, is replaced; anything else is refused before a byte is
 * written (no device nodes here: a test must not make them). */
static void test_special_targets(void) {
  char dir[600];
  snprintf(dir, sizeof dir, "%s/special", tmpdir);
  mkdir(dir, 0777);
  char fifo[700], folder[700], dangling[700], to_fifo[700], file[700], link[700], chain[700];
  snprintf(fifo, sizeof fifo, "%s/fifo", dir);
  snprintf(folder, sizeof folder, "%s/folder", dir);
  snprintf(dangling, sizeof dangling, "%s/dangling", dir);
  snprintf(to_fifo, sizeof to_fifo, "%s/to_fifo", dir);
  snprintf(file, sizeof file, "%s/file", dir);
  snprintf(link, sizeof link, "%s/link", dir);
  snprintf(chain, sizeof chain, "%s/chain", dir);
  mkfifo(fifo, 0666);
  mkdir(folder, 0777);
  write_bytes(file, "old", 3);
  if (symlink("missing", dangling) || symlink("fifo", to_fifo) || symlink("file", link) || symlink("link", chain)) {
    fprintf(stderr, "cannot make the symbolic links in %s: %s\n", dir, strerror(errno));
    exit(2);
  }
  float x = 1;
  m3_tensor_writer *w = big_writer(&x, 1);
  const struct {
    const char *path, *says;
  } refused[] = {
      {fifo, "it exists and is a FIFO (named pipe); only a regular file, or a symbolic link to one, is replaced"},
      {folder, "it exists and is a folder; only a regular file"},
      {dangling, "it is a symbolic link to missing, which does not resolve (No such file or directory); only"},
      {to_fifo, "/special/fifo, which is a FIFO (named pipe); only a regular file"},
  };
  for (size_t i = 0; i < sizeof refused / sizeof *refused; i++) {
    m3_status st = m3_tensor_writer_write(w, refused[i].path);
    check(st == M3_ERR_IO && strstr(m3_last_error(), refused[i].says), "writing onto %s refused: %s",
          refused[i].path + strlen(dir) + 1, m3_last_error());
  }
  check(is_type(fifo, S_IFIFO) && is_type(folder, S_IFDIR) && is_type(dangling, S_IFLNK) && is_type(to_fifo, S_IFLNK) &&
            access(dangling, F_OK) != 0 && count_entries(dir) == 7,
        "the refused targets are left as they were, and no temporary file is left");
  m3_tensor_file *f = (m3_tensor_file *)&n_pass;
  check(m3_tensor_file_open(to_fifo, &f) == M3_ERR_IO && f == NULL && strstr(m3_last_error(), "not a regular file"),
        "reading a FIFO (through a link) is refused without waiting for a writer: %s", m3_last_error());
  m3_status st = m3_tensor_writer_write(w, chain);
  check(st == M3_OK && is_type(chain, S_IFLNK) && is_type(link, S_IFLNK) && is_type(file, S_IFREG) &&
            m3_tensor_file_open(file, &f) == M3_OK && m3_tensor_file_count(f) == 1 && count_entries(dir) == 7,
        "a write through links (chain -> link -> file) replaces the file and keeps the links: %s",
        st == M3_OK ? "ok" : m3_last_error());
  m3_tensor_file_close(f);
  m3_tensor_writer_destroy(w);
}

/* ---- weights ------------------------------------------------------------------------ */

static m3_config small_config(void) {
  m3_config c;
  m3_config_defaults(&c);
  c.d_model = 16;
  c.n_layers = 2;
  c.d_state = 8;
  c.headdim = 8;
  c.input_dim = 5;
  return c;
}

static m3_config lm_config(int tied) {
  m3_config c = small_config();
  c.input = M3_INPUT_TOKENS;
  c.head = M3_HEAD_LM;
  c.vocab_size = 11;
  c.tie_embeddings = tied;
  return c;
}

static int same_weights(const m3_weights *a, const m3_weights *b) {
  if (!a || !b || m3_weights_count(a) != m3_weights_count(b)) return 0;
  for (int32_t i = 0; i < m3_weights_count(a); i++) {
    m3_tensor_info x, y;
    m3_weights_tensor(a, i, &x);
    m3_weights_tensor(b, i, &y);
    if (strcmp(x.name, y.name) || x.numel != y.numel || memcmp(x.data, y.data, (size_t)x.numel * 4)) return 0;
  }
  return 1;
}

/* How write_variant changes a weights file. */
typedef struct variant {
  const char *prefix;    /* prepended to every name */
  int32_t dtype;         /* F32, F64, F16 or BF16 (converted from the floats) */
  const char *skip;      /* this tensor is left out */
  const char *reshape;   /* this tensor is written flat */
  const char *duplicate; /* also written under "backbone." + name */
  const char *extra;     /* an extra F32 [1] tensor */
  int lm_head;           /* 1: add lm_head.weight = embedding; 2: differing; 3: wrong shape */
  int no_config;         /* no "config" metadata */
  const char *config;    /* this "config" metadata instead */
} variant;

static void *convert(const float *x, int64_t n, int32_t dtype) {
  size_t elem = dtype == M3_DTYPE_F64 ? 8 : dtype == M3_DTYPE_F32 ? 4 : 2;
  unsigned char *out = malloc((size_t)n * elem + 1);
  for (int64_t i = 0; i < n; i++) {
    uint32_t bits;
    memcpy(&bits, &x[i], 4);
    if (dtype == M3_DTYPE_F64)
      ((double *)out)[i] = x[i];
    else if (dtype == M3_DTYPE_F32)
      ((float *)out)[i] = x[i];
    else if (dtype == M3_DTYPE_BF16)
      ((uint16_t *)out)[i] = (uint16_t)(bits >> 16);
    else
      ((uint16_t *)out)[i] =
          (uint16_t)((bits >> 31) << 15 | (x[i] == 0 ? 0 : ((bits >> 23 & 0xff) - 112) << 10 | (bits >> 13 & 0x3ff)));
  }
  return out;
}

static m3_status write_variant(const m3_weights *wt, const char *path, const variant *v) {
  m3_tensor_writer *w = NULL;
  m3_tensor_writer_create(&w);
  void *bufs[64];
  int nb = 0;
  char name[128];
  int32_t dtype = v->dtype;
  for (int32_t i = 0; i < m3_weights_count(wt); i++) {
    m3_tensor_info t;
    m3_weights_tensor(wt, i, &t);
    if (v->skip && strcmp(v->skip, t.name) == 0) continue;
    snprintf(name, sizeof name, "%s%s", v->prefix ? v->prefix : "", t.name);
    int flat = v->reshape && strcmp(v->reshape, t.name) == 0;
    void *data = bufs[nb++] = convert(t.data, t.numel, dtype);
    m3_tensor_writer_add(w, name, dtype, flat ? 1 : t.ndim, flat ? &t.numel : t.shape, data);
    if (v->duplicate && strcmp(v->duplicate, t.name) == 0) {
      snprintf(name, sizeof name, "backbone.%s", t.name);
      m3_tensor_writer_add(w, name, dtype, t.ndim, t.shape, data);
    }
    if (v->lm_head && strcmp(t.name, "embedding.weight") == 0) {
      float *head = bufs[nb++] = malloc((size_t)t.numel * 4);
      memcpy(head, t.data, (size_t)t.numel * 4);
      if (v->lm_head == 2) head[t.numel - 1] += 1;
      int64_t shape[2] = {t.shape[0] - (v->lm_head == 3), t.shape[1]};
      m3_tensor_writer_add(w, "lm_head.weight", M3_DTYPE_F32, 2, shape, head);
    }
  }
  float one = 1;
  int64_t shape1 = 1;
  if (v->extra) m3_tensor_writer_add(w, v->extra, M3_DTYPE_F32, 1, &shape1, &one);
  if (!v->no_config)
    m3_tensor_writer_add_metadata(w, "config", v->config ? v->config : m3_config_to_json(m3_weights_config(wt)));
  m3_status st = m3_tensor_writer_write(w, path);
  m3_tensor_writer_destroy(w);
  while (nb) free(bufs[--nb]);
  return st;
}

static void expect_load(const char *label, const m3_weights *ref, const variant *v, const m3_config *cfg,
                        m3_status want, const char *needle) {
  const char *path = tmp_path("variant.safetensors");
  write_variant(ref, path, v);
  m3_weights *got = (m3_weights *)&n_pass;
  m3_status st = m3_weights_load(path, cfg, &got);
  int ok = st == want && (want == M3_OK ? same_weights(ref, got) : got == NULL) &&
           (!needle || strstr(m3_last_error(), needle));
  check(ok, "weights %s -> %s%s%s", label, m3_status_name(st), st == M3_OK ? "" : ": ",
        st == M3_OK ? "" : m3_last_error());
  if (st == M3_OK) m3_weights_destroy(got);
}

/* Rounds weights so that they survive F16 (small magnitudes, 10-bit mantissas). */
static void round_for_f16(m3_weights *w) {
  float *x = m3_weights_data(w);
  for (int64_t i = 0; i < m3_weights_arena_size(w); i++) x[i] = roundf(x[i] * 256) / 256;
}

static void test_weights(void) {
  m3_config c = small_config();
  m3_weights *w = NULL, *got = NULL;
  check(m3_weights_create(&c, &w) == M3_OK && m3_weights_init(w, 1234) == M3_OK, "create + init weights");
  const char *path = tmp_path("weights.safetensors");
  check(m3_weights_save(w, path) == M3_OK, "weights save");
  check(m3_weights_load(path, NULL, &got) == M3_OK && same_weights(w, got),
        "weights load (config from file) is bit-exact");
  check(got && strcmp(m3_config_to_json(m3_weights_config(got)), m3_config_to_json(&c)) == 0, "config round trip");
  m3_weights_destroy(got);
  got = NULL;
  check(m3_weights_load(path, &c, &got) == M3_OK && same_weights(w, got), "weights load with an explicit config");
  m3_weights_destroy(got);
  m3_tensor_file *f = NULL;
  check(m3_tensor_file_open(path, &f) == M3_OK && m3_tensor_file_count(f) == m3_weights_count(w) &&
            strcmp(m3_tensor_file_metadata(f, "format"), "m3lua-weights-1") == 0,
        "saved file: every tensor, format tag");
  int all_f32 = 1;
  for (int32_t i = 0; f && i < m3_tensor_file_count(f); i++) {
    m3_file_tensor t;
    m3_tensor_file_get(f, i, &t);
    all_f32 &= t.dtype == M3_DTYPE_F32;
  }
  check(all_f32, "saved tensors are F32");
  m3_tensor_file_close(f);

  variant v = {0};
  expect_load("plain", w, &v, NULL, M3_OK, NULL);
  v.prefix = "backbone.";
  expect_load("backbone. prefix", w, &v, NULL, M3_OK, NULL);
  v = (variant){.dtype = M3_DTYPE_F64};
  expect_load("from F64", w, &v, NULL, M3_OK, NULL);
  v = (variant){.skip = "layers.1.mixer.D"};
  expect_load("missing tensor", w, &v, NULL, M3_ERR_FORMAT, "missing tensor layers.1.mixer.D");
  v = (variant){.extra = "layers.2.mixer.D"};
  expect_load("extra tensor", w, &v, NULL, M3_ERR_FORMAT, "layers.2.mixer.D");
  v = (variant){.extra = "param.norm_f.weight"};
  expect_load("param. prefix is not special", w, &v, NULL, M3_ERR_FORMAT, "param.norm_f.weight");
  v = (variant){.reshape = "layers.0.mixer.B_bias"};
  expect_load("mis-shaped tensor", w, &v, NULL, M3_ERR_FORMAT, "expected shape [4, 1, 8], got [32]");
  v = (variant){.duplicate = "norm_f.weight"};
  expect_load("bare and backbone. names both present", w, &v, NULL, M3_ERR_FORMAT,
              "both norm_f.weight and backbone.norm_f.weight are present; keep one");
  v = (variant){.extra = "lm_head.weight"};
  expect_load("lm_head.weight beside a model without an lm head", w, &v, NULL, M3_ERR_FORMAT,
              "unexpected tensor lm_head.weight: not a parameter of this config");
  v = (variant){.no_config = 1};
  expect_load("no config metadata, no cfg", w, &v, NULL, M3_ERR_ARGUMENT, "pass the model config");
  expect_load("no config metadata, cfg given", w, &v, &c, M3_OK, NULL);
  v = (variant){.config = "{\"d_model\": 16"};
  expect_load("broken config metadata", w, &v, NULL, M3_ERR_FORMAT, "config");
  v = (variant){.config = "{\"d_model\": 0, \"n_layers\": 2}"};
  expect_load("invalid config metadata", w, &v, NULL, M3_ERR_CONFIG, "d_model");
  {
    m3_config floor3 = c;
    floor3.a_floor = 1e-3;
    got = NULL;
    check(m3_weights_load(path, &floor3, &got) == M3_OK && m3_weights_config(got)->a_floor == 1e-3,
          "weights loaded with a caller's config keep its a_floor (1e-3)");
    m3_weights_destroy(got);
  }
  {
    /* F16 by IEEE 754's binary16: subnormals m 2^-24, the least normal 2^-14, infinities and NaN refused */
    static const uint16_t halves[6] = {0x0001, 0x8001, 0x03ff, 0x0400, 0x3c00, 0xc000};
    static const float want[6] = {0x1p-24f, -0x1p-24f, 0x3ffp-24f, 0x1p-14f, 1.0f, -2.0f};
    static const uint16_t not_finite[3] = {0x7c00, 0xfc00, 0x7e00};
    for (int k = -1; k < 3; k++) {
      uint16_t h[16];
      for (int i = 0; i < 16; i++) h[i] = i < 6 ? halves[i] : 0x3c00;
      if (k >= 0) h[5] = not_finite[k];
      m3_tensor_writer *tw = NULL;
      m3_tensor_writer_create(&tw);
      m3_tensor_info t;
      for (int32_t i = 0; i < m3_weights_count(w); i++) {
        m3_weights_tensor(w, i, &t);
        if (strcmp(t.name, "norm_f.weight") == 0)
          m3_tensor_writer_add(tw, t.name, M3_DTYPE_F16, t.ndim, t.shape, h);
        else
          m3_tensor_writer_add(tw, t.name, M3_DTYPE_F32, t.ndim, t.shape, t.data);
      }
      const char *p = tmp_path("f16.safetensors");
      m3_tensor_writer_write(tw, p);
      m3_tensor_writer_destroy(tw);
      got = (m3_weights *)&n_pass;
      m3_status st = m3_weights_load(p, &c, &got);
      if (k < 0) {
        int same = st == M3_OK;
        if (same) m3_weights_tensor(got, m3_weights_find(got, "norm_f.weight"), &t);
        for (int i = 0; same && i < 16; i++) same = t.data[i] == (i < 6 ? want[i] : 1.0f);
        check(same, "F16 subnormals, the least normal and signs convert exactly: %s", m3_status_name(st));
        if (st == M3_OK) m3_weights_destroy(got);
      } else {
        check(st == M3_ERR_FORMAT && got == NULL && strstr(m3_last_error(), "norm_f.weight [5] = ") &&
                  strstr(m3_last_error(), "expected a finite value"),
              "F16 0x%04x (not finite) refused: %s", not_finite[k], m3_last_error());
        if (st == M3_OK) m3_weights_destroy(got);
      }
    }
  }
  m3_config other = c;
  other.d_state = 4;
  v = (variant){0};
  expect_load("cfg that does not match the file", w, &v, &other, M3_ERR_FORMAT, "expected shape");
  {
    m3_tensor_writer *tw = NULL;
    m3_tensor_writer_create(&tw);
    m3_tensor_info t;
    for (int32_t i = 0; i < m3_weights_count(w); i++) {
      m3_weights_tensor(w, i, &t);
      int32_t dtype = i == 3 ? M3_DTYPE_I32 : M3_DTYPE_F32;
      m3_tensor_writer_add(tw, t.name, dtype, t.ndim, t.shape, t.data);
    }
    m3_tensor_writer_write(tw, tmp_path("i32.safetensors"));
    m3_tensor_writer_destroy(tw);
    got = (m3_weights *)&n_pass;
    check(m3_weights_load(tmp_path("i32.safetensors"), &c, &got) == M3_ERR_FORMAT && got == NULL &&
              strstr(m3_last_error(), "I32"),
          "integer dtype rejected: %s", m3_last_error());
  }
  {
    m3_weights *big = NULL;
    m3_weights_clone(w, &big);
    m3_weights_data(big)[0] = 1e30f;
    v = (variant){.dtype = M3_DTYPE_F64};
    const char *p = tmp_path("f64big.safetensors");
    write_variant(big, p, &v);
    /* patch the first value to 1e300 (the first tensor's data starts the data section) */
    size_t n = 0;
    char *raw = read_all(p, &n);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | (unsigned char)raw[i];
    double huge = 1e300;
    memcpy(raw + 8 + hlen, &huge, 8);
    write_bytes(p, raw, n);
    free(raw);
    got = (m3_weights *)&n_pass;
    check(m3_weights_load(p, NULL, &got) == M3_ERR_FORMAT && got == NULL && strstr(m3_last_error(), "float32"),
          "F64 value beyond float32 rejected: %s", m3_last_error());
    m3_weights_destroy(big);
  }
  {
    /* a NaN (sign bit set, as 0.0 / 0.0 on x86): save refuses it in the words load does, which refuses it in a
     * file written here, and infinities from F64 and BF16 */
    m3_weights *bad = NULL;
    m3_weights_clone(w, &bad);
    m3_tensor_info D;
    m3_weights_tensor(bad, m3_weights_find(bad, "layers.1.mixer.D"), &D);
    D.data[3] = copysignf(NAN, -1.0f);
    const char *p = tmp_path("nan.safetensors");
    check(m3_weights_save(bad, p) == M3_ERR_ARGUMENT && access(p, F_OK) != 0 &&
              strstr(m3_last_error(), "saving ") &&
              strstr(m3_last_error(), "nan.safetensors: weights: layers.1.mixer.D [3] = nan: expected a finite value"),
          "weights holding a NaN: save refuses them, writing nothing: %s", m3_last_error());
    v = (variant){0};
    expect_load("F32 nan", bad, &v, NULL, M3_ERR_FORMAT, "weights: layers.1.mixer.D [3] = nan: expected a finite");
    D.data[3] = -INFINITY;
    v = (variant){.dtype = M3_DTYPE_F64};
    expect_load("F64 -inf", bad, &v, NULL, M3_ERR_FORMAT, "weights: layers.1.mixer.D [3] = -inf: expected a finite");
    D.data[3] = INFINITY;
    v = (variant){.dtype = M3_DTYPE_BF16, .prefix = "backbone."};
    expect_load("BF16 inf", bad, &v, NULL, M3_ERR_FORMAT, "weights: layers.1.mixer.D [3] = inf: expected a finite");
    D.data[3] = 0.5f;
    v = (variant){0};
    expect_load("finite again", bad, &v, NULL, M3_OK, NULL);
    m3_weights_destroy(bad);
  }
  {
    m3_weights *r = NULL;
    m3_weights_clone(w, &r);
    round_for_f16(r);
    v = (variant){.dtype = M3_DTYPE_F16};
    expect_load("from F16", r, &v, NULL, M3_OK, NULL);
    float *x = m3_weights_data(r);
    for (int64_t i = 0; i < m3_weights_arena_size(r); i++) {
      uint32_t bits;
      memcpy(&bits, &x[i], 4);
      bits &= 0xffff0000u;
      memcpy(&x[i], &bits, 4);
    }
    v = (variant){.dtype = M3_DTYPE_BF16};
    expect_load("from BF16", r, &v, NULL, M3_OK, NULL);
    m3_weights_destroy(r);
  }
  got = (m3_weights *)&n_pass;
  check(m3_weights_load(tmp_path("bad.safetensors"), NULL, &got) != M3_OK && got == NULL,
        "malformed file: out is NULL");
  check(m3_weights_load(tmp_path("absent.safetensors"), NULL, &got) == M3_ERR_IO && got == NULL,
        "absent file: M3_ERR_IO");
  check(m3_weights_load(NULL, NULL, &got) == M3_ERR_ARGUMENT && m3_weights_load(path, NULL, NULL) == M3_ERR_ARGUMENT,
        "NULL arguments");
  m3_weights_destroy(w);

  /* tied and untied "lm" heads */
  m3_config tied = lm_config(1), untied = lm_config(0);
  w = NULL;
  m3_weights_create(&tied, &w);
  m3_weights_init(w, 99);
  v = (variant){0};
  expect_load("tied lm, no lm_head", w, &v, NULL, M3_OK, NULL);
  v.lm_head = 1;
  expect_load("tied lm, lm_head equal to embedding", w, &v, NULL, M3_OK, NULL);
  v.prefix = "backbone.";
  expect_load("tied lm, backbone. prefix, lm_head equal", w, &v, NULL, M3_OK, NULL);
  v = (variant){.lm_head = 2};
  expect_load("tied lm, lm_head differs", w, &v, NULL, M3_ERR_FORMAT, "differs");
  v = (variant){.lm_head = 3};
  expect_load("tied lm, lm_head mis-shaped", w, &v, NULL, M3_ERR_FORMAT, "expected shape [11, 16], got [10, 16]");
  m3_weights_destroy(w);
  w = NULL;
  m3_weights_create(&untied, &w);
  m3_weights_init(w, 99);
  check(m3_weights_find(w, "lm_head.weight") >= 0, "untied lm has lm_head.weight");
  v = (variant){0};
  expect_load("untied lm round trip", w, &v, NULL, M3_OK, NULL);
  v = (variant){.skip = "lm_head.weight"};
  expect_load("untied lm without lm_head", w, &v, NULL, M3_ERR_FORMAT, "missing tensor lm_head.weight");
  m3_weights_destroy(w);
}

/* ---- forged checkpoints ------------------------------------------------------------- */

/* A copy of the checkpoint src at dst with the metadata key set to value, without its checksum: a file written
 * before checksums, whose values are each checked on their own. */
static void forge_checkpoint(const char *src, const char *dst, const char *key, const char *value) {
  m3_tensor_file *f = NULL;
  m3_tensor_writer *w = NULL;
  m3_status st = m3_tensor_file_open(src, &f);
  if (st == M3_OK) st = m3_tensor_writer_create(&w);
  for (int32_t i = 0; st == M3_OK && i < m3_tensor_file_count(f); i++) {
    m3_file_tensor t;
    st = m3_tensor_file_get(f, i, &t);
    if (st == M3_OK) st = m3_tensor_writer_add(w, t.name, t.dtype, t.ndim, t.shape, t.data);
  }
  for (int32_t i = 0; st == M3_OK && i < m3_tensor_file_metadata_count(f); i++) {
    const char *k = m3_tensor_file_metadata_key(f, i);
    if (strcmp(k, "checksum") != 0)
      st = m3_tensor_writer_add_metadata(w, k, strcmp(k, key) == 0 ? value : m3_tensor_file_metadata(f, k));
  }
  if (st == M3_OK) st = m3_tensor_writer_write(w, dst);
  check(st == M3_OK, "forge a checkpoint with %s = %s", key, value);
  m3_tensor_writer_destroy(w);
  m3_tensor_file_close(f);
}

static void test_checkpoints(void) {
  m3_config c = small_config();
  m3_weights *w = NULL;
  check(m3_weights_create(&c, &w) == M3_OK && m3_weights_init(w, 9) == M3_OK, "create + init weights");
  m3_trainer_cfg tc;
  m3_trainer_cfg_defaults(&tc);
  tc.weights = w;
  tc.device = M3_DEVICE_CPU;
  tc.batch = 2;
  tc.seq_len = 4;
  m3_trainer *tr = NULL;
  const char *path = tmp_path("ck.safetensors"), *forged = tmp_path("forged.safetensors");
  check(m3_trainer_create(&tc, &tr) == M3_OK, "create a trainer");
  /* the live lr, clip and no-decay choice come back exactly (17 digits: values that 7 or 9 would round) */
  const double lr = 0.1 / 3, clip = 2.0 / 3;
  check(m3_trainer_set_lr(tr, lr) == M3_OK && m3_trainer_set_clip(tr, clip) == M3_OK &&
            m3_trainer_set_no_decay(tr, 0) == M3_OK && m3_trainer_save(tr, path, "x") == M3_OK,
        "save a checkpoint");
  m3_trainer_destroy(tr);
  m3_weights_destroy(w);
  tr = NULL;
  m3_trainer_info info = {0};
  check(m3_trainer_load(path, NULL, &tr) == M3_OK, "load the checkpoint");
  m3_trainer_get_info(tr, &info);
  check(m3_trainer_lr(tr) == lr && info.clip == clip && info.no_decay == 0,
        "lr %.17g, clip %.17g, no_decay %d after load (saved %.17g, %.17g, 0)", m3_trainer_lr(tr), info.clip,
        info.no_decay, lr, clip);
  m3_trainer_destroy(tr);

  /* a trainer without f16 has no scaler state: a loss_scale other than 1 or a tracker other than 0 is refused */
  static const struct {
    const char *key, *value, *says;
  } scaler[] = {{"tracker", "5", "loss_scale 1, tracker 5"}, {"loss_scale", "2", "loss_scale 2, tracker 0"}};
  for (size_t i = 0; i < sizeof scaler / sizeof *scaler; i++) {
    forge_checkpoint(path, forged, scaler[i].key, scaler[i].value);
    tr = NULL;
    m3_status st = m3_trainer_load(forged, NULL, &tr);
    check(st == M3_ERR_FORMAT && !tr && strstr(m3_last_error(), scaler[i].says),
          "%s = %s without f16 refused: %s '%s'", scaler[i].key, scaler[i].value, m3_status_name(st), m3_last_error());
    m3_trainer_destroy(tr);
  }

  /* the rng: four words exactly as the saver writes them */
  forge_checkpoint(path, forged, "rng", "0000000000000001 0000000000000002 0000000000000003 0000000000000004");
  tr = NULL;
  check(m3_trainer_load(forged, NULL, &tr) == M3_OK && m3_trainer_rng_next(tr) == 11520,
        "rng words as saved load (the next draw of {1, 2, 3, 4} is 11520)");
  m3_trainer_destroy(tr);
  static const char *const bad_rng[] = {
      "ffffffffffffffffff 0000000000000001 0000000000000001 0000000000000001", /* 18 digits: past 64 bits */
      "-000000000000001 0000000000000001 0000000000000001 0000000000000001",   /* a sign */
      "+000000000000001 0000000000000001 0000000000000001 0000000000000001",
      " 000000000000001 0000000000000001 0000000000000001 0000000000000001",   /* leading space */
      "0x00000000000001 0000000000000001 0000000000000001 0000000000000001",   /* a prefix */
      "000000000000000A 0000000000000001 0000000000000001 0000000000000001",   /* not as saved: upper case */
      "1 2 3 4",                                                               /* not as saved: short words */
      "0000000000000001  0000000000000002 0000000000000003 0000000000000004",  /* two spaces */
      "0000000000000001 0000000000000002 0000000000000003 0000000000000004 ",  /* trailing space */
      "0000000000000001 0000000000000002 0000000000000003",                    /* three words */
      "0000000000000001 0000000000000002 0000000000000003 0000000000000004 0000000000000005",
      "0000000000000000 0000000000000000 0000000000000000 0000000000000000",   /* all 0 */
      "",
  };
  for (size_t i = 0; i < sizeof bad_rng / sizeof *bad_rng; i++) {
    forge_checkpoint(path, forged, "rng", bad_rng[i]);
    tr = NULL;
    m3_status st = m3_trainer_load(forged, NULL, &tr);
    check(st == M3_ERR_FORMAT && !tr && strstr(m3_last_error(), "expected four hex words, not all 0, as saved"),
          "checkpoint rng \"%s\" refused: %s", bad_rng[i], m3_status_name(st));
    m3_trainer_destroy(tr);
  }

  /* saved on CUDA: NULL opts load it as every opt -1 does, on the CPU without a GPU */
  m3_tensor_file *f = NULL;
  check(m3_tensor_file_open(path, &f) == M3_OK, "open the checkpoint");
  const char *json = f ? m3_tensor_file_metadata(f, "trainer") : NULL;
  char from[32], to[32], cuda[2048] = "";
  snprintf(from, sizeof from, "\"device\": %d,", M3_DEVICE_CPU);
  snprintf(to, sizeof to, "\"device\": %d,", M3_DEVICE_CUDA);
  const char *at = json ? strstr(json, from) : NULL;
  check(at != NULL, "the trainer options name the device: %s", json ? json : "(none)");
  if (at) snprintf(cuda, sizeof cuda, "%.*s%s%s", (int)(at - json), json, to, at + strlen(from));
  m3_tensor_file_close(f);
  forge_checkpoint(path, forged, "trainer", cuda);
  const int32_t want = m3_cuda_device_count() > 0 ? M3_DEVICE_CUDA : M3_DEVICE_CPU;
  const m3_load_opts as_saved = {-1, -1, -1, -1, -1};
  for (int null_opts = 1; null_opts >= 0; null_opts--) {
    tr = NULL;
    m3_status st = m3_trainer_load(forged, null_opts ? NULL : &as_saved, &tr);
    m3_trainer_info info = {0};
    m3_trainer_get_info(tr, &info);
    check(st == M3_OK && info.device == want, "a checkpoint saved on CUDA loads on device %d with %s: %s", want,
          null_opts ? "opts NULL" : "every opt -1", m3_status_name(st));
    m3_trainer_destroy(tr);
  }
}

/* ---- golden files ------------------------------------------------------------------- */

static void test_golden(void) {
  char dir[1024];
  const char *shared = getenv("M3_SHARED"), *root = getenv("M3_SOURCE_ROOT");
  if (shared)
    snprintf(dir, sizeof dir, "%s/golden", shared);
  else
    snprintf(dir, sizeof dir, "%s/../shared/golden", root ? root : ".");
  DIR *d = opendir(dir);
  if (!d) {
    printf("skipped: no ../shared/golden (%s)\n", dir);
    return;
  }
  int files = 0;
  for (struct dirent *e; (e = readdir(d));) {
    size_t len = strlen(e->d_name);
    if (len < 12 || strcmp(e->d_name + len - 12, ".safetensors") != 0) continue;
    char path[1400];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    m3_tensor_file *f = NULL;
    m3_status st = m3_tensor_file_open(path, &f);
    const char *cfg_json = f ? m3_tensor_file_metadata(f, "config") : NULL;
    check(st == M3_OK && m3_tensor_file_count(f) > 0 && cfg_json, "golden %s: %d tensors, config metadata", e->d_name,
          m3_tensor_file_count(f));
    m3_config c;
    m3_weights *w = NULL;
    int params_ok = cfg_json && m3_config_from_json(cfg_json, &c) == M3_OK && m3_weights_create(&c, &w) == M3_OK;
    for (int32_t i = 0; params_ok && i < m3_weights_count(w); i++) {
      m3_tensor_info info;
      m3_file_tensor t;
      char name[128];
      m3_weights_tensor(w, i, &info);
      snprintf(name, sizeof name, "param.%s", info.name);
      int32_t k = m3_tensor_file_find(f, name);
      params_ok = k >= 0 && m3_tensor_file_get(f, k, &t) == M3_OK && t.dtype == M3_DTYPE_F32 && t.numel == info.numel &&
                  t.ndim == info.ndim;
    }
    check(params_ok, "golden %s: config parses and every param.<name> has the layout's size", e->d_name);
    m3_weights_destroy(w);
    m3_tensor_file_close(f);
    files++;
  }
  closedir(d);
  check(files > 0, "golden: %d files", files);
}

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st, (void)flag, (void)ftw;
  return remove(path);
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (!mkdtemp(tmpdir)) {
    fprintf(stderr, "mkdtemp: %s\n", strerror(errno));
    return 2;
  }
  test_round_trip();
  test_writer_arguments();
  test_malformed();
  test_mutations();
  test_atomic();
  test_special_targets();
  test_weights();
  test_checkpoints();
  test_golden();
  nftw(tmpdir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  printf("%d passed, %d failed\n", n_pass, n_fail);
  return n_fail ? 1 : 0;
}

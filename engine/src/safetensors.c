/*
 * safetensors.c — reading and writing safetensors files (m3_tensor_file_*, m3_tensor_writer_*).
 *
 * Layout: an 8-byte little-endian header length, a JSON header mapping tensor names to
 * {dtype, shape, data_offsets} (plus an optional "__metadata__" object of strings), then the
 * data section. The reader takes regular files only (a FIFO is refused, not waited on) and
 * validates everything before handing anything out: header size, JSON (no string holding an
 * escaped NUL), dtypes, shapes (overflow-checked), offsets, and that the tensors tile the data
 * section exactly (no overlap, gap or trailing bytes). Each tensor is then read into its own
 * 64-byte aligned slot of one buffer, so `data` can be cast to the element type. The writer
 * builds the header with cJSON (integers as raw text so offsets stay exact), refuses what the reader
 * would (a shape dim or data offset over 2^53 as the tensor is added, a header over the reader's
 * size limit), a tensor name, metadata key or value that is not UTF-8 (JSON text is UTF-8, and the
 * Python safetensors package refuses a file that is not; this reader still takes one, so older files
 * load) and an empty path, pads the header with spaces to a multiple of 8, and writes a temporary
 * file beside the target that it fsyncs and renames. The target is the path when nothing or a regular file is
 * there, and the regular file it resolves to when it is a symbolic link (the link stays a link,
 * as when a program opens it for writing); anything else (a folder, a FIFO, a device node, a
 * socket, a link to one of those or to nothing) is refused before a byte is written: the rename
 * would put a regular file in its place, and the reader takes regular files only. m3.fs.write
 * (Lua) does the same.
 * Values are stored as the host's bytes: libm3 supports little-endian hosts only.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "errors.h"

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors I/O assumes a little-endian host");

enum { MAX_DIMS = 8, SLOT_ALIGN = 64 };
#define MAX_HEADER_BYTES ((uint64_t)100 * 1000 * 1000) /* the reader's limit, which the writer keeps */
#define MAX_EXACT_INT ((int64_t)1 << 53) /* larger JSON numbers are not exact: the reader's limit, the writer's */

static const struct {
  const char *name;
  int32_t size;
} dtypes[] = {
    [M3_DTYPE_F32] = {"F32", 4},   [M3_DTYPE_F64] = {"F64", 8}, [M3_DTYPE_I32] = {"I32", 4},
    [M3_DTYPE_U8] = {"U8", 1},     [M3_DTYPE_F16] = {"F16", 2}, [M3_DTYPE_BF16] = {"BF16", 2},
    [M3_DTYPE_I64] = {"I64", 8},   [M3_DTYPE_I16] = {"I16", 2}, [M3_DTYPE_I8] = {"I8", 1},
    [M3_DTYPE_BOOL] = {"BOOL", 1}, [M3_DTYPE_U16] = {"U16", 2}, [M3_DTYPE_U32] = {"U32", 4},
    [M3_DTYPE_U64] = {"U64", 8},
};
enum { N_DTYPES = (int)(sizeof dtypes / sizeof dtypes[0]) };

static int32_t dtype_from_name(const char *s) {
  for (int32_t i = 0; i < N_DTYPES; i++)
    if (strcmp(dtypes[i].name, s) == 0) return i;
  return -1;
}

/* numel and byte size of a shape; 0 on overflow of int64 (a 0-sized dim makes both 0). */
static int shape_size(int32_t ndim, const int64_t *shape, int32_t dtype, int64_t *numel, int64_t *nbytes) {
  int64_t n = 1;
  for (int32_t i = 0; i < ndim; i++)
    if (shape[i] == 0) n = 0;
  for (int32_t i = 0; i < ndim && n != 0; i++)
    if (__builtin_mul_overflow(n, shape[i], &n)) return 0;
  if (__builtin_mul_overflow(n, (int64_t)dtypes[dtype].size, nbytes)) return 0;
  *numel = n;
  return 1;
}

static int64_t round_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

/* ---- reader ---------------------------------------------------------------------------- */

typedef struct entry {
  char *name;
  int32_t dtype, ndim;
  int64_t shape[MAX_DIMS];
  int64_t numel, nbytes;
  int64_t begin, end; /* data_offsets, relative to the data section */
  int64_t slot;       /* byte offset of this tensor's copy in f->data */
} entry;

struct m3_tensor_file {
  int32_t n;
  entry *t;         /* [n], in header order */
  int32_t *by_name; /* [n], indices sorted by name (for find) */
  int32_t n_meta;
  char **meta_keys, **meta_values; /* [n_meta] */
  unsigned char *data;             /* every tensor, each at a 64-byte aligned slot */
};

void m3_tensor_file_close(m3_tensor_file *f) {
  if (!f) return;
  for (int32_t i = 0; i < f->n; i++) free(f->t[i].name);
  for (int32_t i = 0; i < f->n_meta; i++) {
    free(f->meta_keys[i]);
    free(f->meta_values[i]);
  }
  free(f->t);
  free(f->by_name);
  free(f->meta_keys);
  free(f->meta_values);
  free(f->data);
  free(f);
}

/* A JSON number that is an exact non-negative integer. */
static int json_uint(const cJSON *j, int64_t *out) {
  if (!cJSON_IsNumber(j)) return 0;
  double v = j->valuedouble;
  if (!(v >= 0 && v <= MAX_EXACT_INT) || v != (double)(int64_t)v) return 0;
  *out = (int64_t)v;
  return 1;
}

static m3_status parse_metadata(const char *path, const cJSON *j, m3_tensor_file *f) {
  if (!cJSON_IsObject(j)) return m3_fail(M3_ERR_FORMAT, "%s: __metadata__ is not a JSON object", path);
  int32_t n = cJSON_GetArraySize(j);
  f->meta_keys = calloc((size_t)n + 1, sizeof *f->meta_keys);
  f->meta_values = calloc((size_t)n + 1, sizeof *f->meta_values);
  if (!f->meta_keys || !f->meta_values) return m3_fail(M3_ERR_MEMORY, "%s: out of memory for metadata", path);
  for (const cJSON *e = j->child; e; e = e->next) {
    if (!cJSON_IsString(e))
      return m3_fail(M3_ERR_FORMAT, "%s: __metadata__ value of \"%s\" is not a string", path, e->string);
    for (int32_t i = 0; i < f->n_meta; i++)
      if (strcmp(f->meta_keys[i], e->string) == 0)
        return m3_fail(M3_ERR_FORMAT, "%s: __metadata__ key \"%s\" appears twice", path, e->string);
    char *k = strdup(e->string), *v = strdup(e->valuestring);
    f->meta_keys[f->n_meta] = k;
    f->meta_values[f->n_meta++] = v;
    if (!k || !v) return m3_fail(M3_ERR_MEMORY, "%s: out of memory for metadata", path);
  }
  return M3_OK;
}

static m3_status parse_shape(const char *path, const char *name, const cJSON *j, entry *t) {
  if (!cJSON_IsArray(j)) return m3_fail(M3_ERR_FORMAT, "%s: tensor \"%s\": shape is not an array", path, name);
  int n = cJSON_GetArraySize(j);
  if (n > MAX_DIMS)
    return m3_fail(M3_ERR_FORMAT, "%s: tensor \"%s\": %d dims, at most %d are supported", path, name, n, MAX_DIMS);
  t->ndim = n;
  int32_t i = 0;
  for (const cJSON *d = j->child; d; d = d->next, i++)
    if (!json_uint(d, &t->shape[i]))
      return m3_fail(M3_ERR_FORMAT, "%s: tensor \"%s\": shape dim %d is not a non-negative integer", path, name, i);
  if (!shape_size(t->ndim, t->shape, t->dtype, &t->numel, &t->nbytes))
    return m3_fail(M3_ERR_FORMAT, "%s: tensor \"%s\": shape is too large (its byte size overflows)", path, name);
  return M3_OK;
}

static m3_status parse_offsets(const char *path, const char *name, const cJSON *j, int64_t data_size, entry *t) {
  if (!cJSON_IsArray(j) || cJSON_GetArraySize(j) != 2 || !json_uint(j->child, &t->begin) ||
      !json_uint(j->child->next, &t->end))
    return m3_fail(M3_ERR_FORMAT, "%s: tensor \"%s\": data_offsets is not two non-negative integers", path, name);
  if (t->begin > t->end)
    return m3_fail(M3_ERR_FORMAT, "%s: tensor \"%s\": data_offsets [%lld, %lld] begin after end", path, name,
                   (long long)t->begin, (long long)t->end);
  if (t->end > data_size)
    return m3_fail(M3_ERR_FORMAT, "%s: tensor \"%s\": data_offsets end %lld is beyond the data section (%lld bytes)",
                   path, name, (long long)t->end, (long long)data_size);
  if (t->end - t->begin != t->nbytes)
    return m3_fail(M3_ERR_FORMAT, "%s: tensor \"%s\": %lld data bytes, but %s shape needs %lld", path, name,
                   (long long)(t->end - t->begin), dtypes[t->dtype].name, (long long)t->nbytes);
  return M3_OK;
}

static m3_status parse_entry(const char *path, const cJSON *j, int64_t data_size, entry *t) {
  const char *name = j->string;
  if (!cJSON_IsObject(j)) return m3_fail(M3_ERR_FORMAT, "%s: tensor \"%s\" is not a JSON object", path, name);
  const cJSON *dt = cJSON_GetObjectItemCaseSensitive(j, "dtype");
  const cJSON *sh = cJSON_GetObjectItemCaseSensitive(j, "shape");
  const cJSON *off = cJSON_GetObjectItemCaseSensitive(j, "data_offsets");
  if (!dt || !sh || !off)
    return m3_fail(M3_ERR_FORMAT, "%s: tensor \"%s\" lacks %s", path, name,
                   !dt   ? "dtype"
                   : !sh ? "shape"
                         : "data_offsets");
  if (!cJSON_IsString(dt) || (t->dtype = dtype_from_name(dt->valuestring)) < 0)
    return m3_fail(M3_ERR_FORMAT, "%s: tensor \"%s\": unknown dtype %s%s%s", path, name, cJSON_IsString(dt) ? "\"" : "",
                   cJSON_IsString(dt) ? dt->valuestring : "(not a string)", cJSON_IsString(dt) ? "\"" : "");
  TRY(parse_shape(path, name, sh, t));
  TRY(parse_offsets(path, name, off, data_size, t));
  t->name = strdup(name);
  return t->name ? M3_OK : m3_fail(M3_ERR_MEMORY, "%s: out of memory", path);
}

static int by_name_cmp(const void *a, const void *b, void *ctx) {
  const entry *t = ctx;
  return strcmp(t[*(const int32_t *)a].name, t[*(const int32_t *)b].name);
}

static int by_offset_cmp(const void *a, const void *b, void *ctx) {
  const entry *t = ctx, *x = &t[*(const int32_t *)a], *y = &t[*(const int32_t *)b];
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  return (x->end > y->end) - (x->end < y->end);
}

/* The first string of a parsed header's text that holds an escaped NUL (\u0000), quotes
 * included (*len bytes), or NULL. cJSON would hand it out cut at the NUL, and names, dtypes and
 * metadata are C strings. In valid JSON every backslash starts an escape inside a string. */
static const char *string_with_nul(const char *text, int64_t *len) {
  const char *start = NULL;
  int nul = 0;
  for (const char *p = text; *p; p++) {
    if (!start) {
      if (*p == '"') {
        start = p;
        nul = 0;
      }
    } else if (*p == '\\') {
      nul |= strncmp(p + 1, "u0000", 5) == 0;
      p++; /* the escaped character; the text is valid JSON, so it is not the end */
    } else if (*p == '"') {
      if (nul) {
        *len = p - start + 1;
        return start;
      }
      start = NULL;
    }
  }
  return NULL;
}

/* Reads the header length and the header JSON; *data_size is what follows the header. */
static m3_status read_header(const char *path, FILE *fp, cJSON **root, int64_t *data_size) {
  struct stat st;
  if (fstat(fileno(fp), &st) != 0) return m3_fail(M3_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
  if (!S_ISREG(st.st_mode)) return m3_fail(M3_ERR_IO, "%s: not a regular file", path);
  int64_t size = st.st_size;
  unsigned char len_bytes[8];
  if (size < 8)
    return m3_fail(M3_ERR_FORMAT, "%s: %lld bytes, shorter than the 8-byte header length", path, (long long)size);
  if (fread(len_bytes, 1, 8, fp) != 8) return m3_fail(M3_ERR_IO, "%s: cannot read: %s", path, strerror(errno));
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = hlen << 8 | len_bytes[i];
  if (hlen > (uint64_t)(size - 8))
    return m3_fail(M3_ERR_FORMAT, "%s: header length %llu is larger than the %lld bytes after it", path,
                   (unsigned long long)hlen, (long long)(size - 8));
  if (hlen > MAX_HEADER_BYTES)
    return m3_fail(M3_ERR_FORMAT, "%s: header length %llu is absurd (more than %llu bytes)", path,
                   (unsigned long long)hlen, (unsigned long long)MAX_HEADER_BYTES);
  char *text = malloc(hlen + 1);
  if (!text) return m3_fail(M3_ERR_MEMORY, "%s: out of memory for a %llu-byte header", path, (unsigned long long)hlen);
  m3_status rc = M3_OK;
  if (fread(text, 1, hlen, fp) != hlen) {
    rc = m3_fail(M3_ERR_IO, "%s: cannot read the header: %s", path, ferror(fp) ? strerror(errno) : "file shrank");
  } else if (memchr(text, 0, hlen)) {
    rc = m3_fail(M3_ERR_FORMAT, "%s: header contains a NUL byte", path);
  } else {
    text[hlen] = 0;
    const char *end = NULL, *nul = NULL;
    int64_t nul_len = 0;
    *root = cJSON_ParseWithOpts(text, &end, 1);
    if (!*root)
      rc = m3_fail(M3_ERR_FORMAT, "%s: header is not valid JSON (error near byte %lld of %llu)", path,
                   end ? (long long)(end - text) : -1LL, (unsigned long long)hlen);
    else if (!cJSON_IsObject(*root))
      rc = m3_fail(M3_ERR_FORMAT, "%s: header is JSON but not an object", path);
    else if ((nul = string_with_nul(text, &nul_len)))
      rc = m3_fail(M3_ERR_FORMAT, "%s: header string %.*s%s (at header byte %lld) holds an escaped NUL (\\u0000): "
                   "names, dtypes and metadata are C strings", path, (int)(nul_len > 200 ? 200 : nul_len), nul,
                   nul_len > 200 ? "..." : "", (long long)(nul - text));
  }
  free(text);
  *data_size = size - 8 - (int64_t)hlen;
  return rc;
}

/* Fills the entries and metadata from the header object. */
static m3_status parse_header(const char *path, const cJSON *root, int64_t data_size, m3_tensor_file *f) {
  int32_t n = cJSON_GetArraySize(root);
  f->t = calloc((size_t)n + 1, sizeof *f->t);
  if (!f->t) return m3_fail(M3_ERR_MEMORY, "%s: out of memory for %d header entries", path, n);
  int seen_meta = 0;
  for (const cJSON *e = root->child; e; e = e->next) {
    if (strcmp(e->string, "__metadata__") == 0) {
      if (seen_meta++) return m3_fail(M3_ERR_FORMAT, "%s: __metadata__ appears twice", path);
      TRY(parse_metadata(path, e, f));
      continue;
    }
    TRY(parse_entry(path, e, data_size, &f->t[f->n]));
    f->n++;
  }
  return M3_OK;
}

/* Sorts the name index and rejects duplicate names. */
static m3_status index_names(const char *path, m3_tensor_file *f) {
  f->by_name = malloc(((size_t)f->n + 1) * sizeof *f->by_name);
  if (!f->by_name) return m3_fail(M3_ERR_MEMORY, "%s: out of memory", path);
  for (int32_t i = 0; i < f->n; i++) f->by_name[i] = i;
  qsort_r(f->by_name, (size_t)f->n, sizeof *f->by_name, by_name_cmp, f->t);
  for (int32_t i = 1; i < f->n; i++)
    if (strcmp(f->t[f->by_name[i - 1]].name, f->t[f->by_name[i]].name) == 0)
      return m3_fail(M3_ERR_FORMAT, "%s: tensor \"%s\" appears twice", path, f->t[f->by_name[i]].name);
  return M3_OK;
}

/* Checks that the tensors, in offset order, tile the data section exactly and gives each an
 * aligned slot; *total is the slot buffer size. */
static m3_status place_tensors(const char *path, m3_tensor_file *f, const int32_t *order, int64_t data_size,
                               int64_t *total) {
  int64_t expect = 0, slot = 0;
  for (int32_t i = 0; i < f->n; i++) {
    entry *t = &f->t[order[i]];
    if (t->begin != expect)
      return m3_fail(M3_ERR_FORMAT, "%s: tensor \"%s\" starts at data byte %lld, expected %lld (%s)", path, t->name,
                     (long long)t->begin, (long long)expect,
                     t->begin < expect ? "it overlaps another tensor" : "a gap");
    expect = t->end;
    t->slot = slot;
    slot += round_up(t->nbytes, SLOT_ALIGN);
  }
  if (expect != data_size)
    return m3_fail(M3_ERR_FORMAT, "%s: the data section has %lld bytes but the tensors cover %lld", path,
                   (long long)data_size, (long long)expect);
  *total = slot;
  return M3_OK;
}

/* Reads the data section (already tiled) tensor by tensor into the slots. */
static m3_status read_data(const char *path, FILE *fp, m3_tensor_file *f, const int32_t *order, int64_t total) {
  f->data = aligned_alloc(SLOT_ALIGN, (size_t)(total > 0 ? total : SLOT_ALIGN));
  if (!f->data) return m3_fail(M3_ERR_MEMORY, "%s: out of memory for %lld bytes of tensors", path, (long long)total);
  for (int32_t i = 0; i < f->n; i++) {
    const entry *t = &f->t[order[i]];
    if (fread(f->data + t->slot, 1, (size_t)t->nbytes, fp) != (size_t)t->nbytes)
      return m3_fail(M3_ERR_IO, "%s: cannot read tensor \"%s\": %s", path, t->name,
                     ferror(fp) ? strerror(errno) : "file shrank");
  }
  return M3_OK;
}

static m3_status open_file(const char *path, FILE *fp, m3_tensor_file *f) {
  cJSON *root = NULL;
  int64_t data_size = 0, total = 0;
  m3_status rc = read_header(path, fp, &root, &data_size);
  if (rc == M3_OK) rc = parse_header(path, root, data_size, f);
  cJSON_Delete(root);
  if (rc == M3_OK) rc = index_names(path, f);
  if (rc != M3_OK) return rc;
  int32_t *order = malloc(((size_t)f->n + 1) * sizeof *order);
  if (!order) return m3_fail(M3_ERR_MEMORY, "%s: out of memory", path);
  for (int32_t i = 0; i < f->n; i++) order[i] = i;
  qsort_r(order, (size_t)f->n, sizeof *order, by_offset_cmp, f->t);
  rc = place_tensors(path, f, order, data_size, &total);
  if (rc == M3_OK) rc = read_data(path, fp, f, order, total);
  free(order);
  return rc;
}

m3_status m3_tensor_file_open(const char *path, m3_tensor_file **out) {
  if (!out) return m3_fail(M3_ERR_ARGUMENT, "m3_tensor_file_open: out is NULL");
  *out = NULL;
  if (!path) return m3_fail(M3_ERR_ARGUMENT, "m3_tensor_file_open: path is NULL");
  /* O_NONBLOCK: a FIFO opens without waiting for a writer, and is then refused as not a regular file; a regular
   * file reads as without it */
  const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  FILE *fp = fd >= 0 ? fdopen(fd, "rb") : NULL;
  if (!fp) {
    const int err = errno;
    if (fd >= 0) close(fd);
    return m3_fail(M3_ERR_IO, "%s: cannot open: %s", path, strerror(err));
  }
  m3_tensor_file *f = calloc(1, sizeof *f);
  m3_status rc = f ? open_file(path, fp, f) : m3_fail(M3_ERR_MEMORY, "%s: out of memory", path);
  fclose(fp);
  if (rc != M3_OK) {
    m3_tensor_file_close(f);
    return rc;
  }
  *out = f;
  return M3_OK;
}

int32_t m3_tensor_file_count(const m3_tensor_file *f) { return f ? f->n : 0; }

m3_status m3_tensor_file_get(const m3_tensor_file *f, int32_t index, m3_file_tensor *out) {
  if (!f || !out) return m3_fail(M3_ERR_ARGUMENT, "m3_tensor_file_get: NULL argument");
  if (index < 0 || index >= f->n) return m3_fail(M3_ERR_ARGUMENT, "tensor index %d out of range [0, %d)", index, f->n);
  const entry *t = &f->t[index];
  memset(out, 0, sizeof *out);
  out->name = t->name;
  out->dtype = t->dtype;
  out->ndim = t->ndim;
  memcpy(out->shape, t->shape, sizeof t->shape);
  out->numel = t->numel;
  out->nbytes = (size_t)t->nbytes;
  out->data = f->data + t->slot;
  return M3_OK;
}

int32_t m3_tensor_file_find(const m3_tensor_file *f, const char *name) {
  if (!f || !name) return -1;
  int32_t lo = 0, hi = f->n;
  while (lo < hi) {
    int32_t mid = lo + (hi - lo) / 2;
    int c = strcmp(f->t[f->by_name[mid]].name, name);
    if (c == 0) return f->by_name[mid];
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return -1;
}

int32_t m3_tensor_file_metadata_count(const m3_tensor_file *f) { return f ? f->n_meta : 0; }

const char *m3_tensor_file_metadata_key(const m3_tensor_file *f, int32_t index) {
  return f && index >= 0 && index < f->n_meta ? f->meta_keys[index] : NULL;
}

const char *m3_tensor_file_metadata(const m3_tensor_file *f, const char *key) {
  if (!f || !key) return NULL;
  for (int32_t i = 0; i < f->n_meta; i++)
    if (strcmp(f->meta_keys[i], key) == 0) return f->meta_values[i];
  return NULL;
}

/* ---- writer ---------------------------------------------------------------------------- */

typedef struct wentry {
  char *name;
  int32_t dtype, ndim;
  int64_t shape[MAX_DIMS];
  int64_t nbytes;
  const void *data;
} wentry;

typedef struct kv {
  char *key, *value;
} kv;

struct m3_tensor_writer {
  int32_t n, cap, n_meta, meta_cap;
  int64_t nbytes; /* the data section so far: the next tensor's begin offset */
  wentry *t;
  kv *meta;
};

m3_status m3_tensor_writer_create(m3_tensor_writer **out) {
  if (!out) return m3_fail(M3_ERR_ARGUMENT, "m3_tensor_writer_create: out is NULL");
  *out = calloc(1, sizeof **out);
  return *out ? M3_OK : m3_fail(M3_ERR_MEMORY, "out of memory for a tensor writer");
}

void m3_tensor_writer_destroy(m3_tensor_writer *w) {
  if (!w) return;
  for (int32_t i = 0; i < w->n; i++) free(w->t[i].name);
  for (int32_t i = 0; i < w->n_meta; i++) {
    free(w->meta[i].key);
    free(w->meta[i].value);
  }
  free(w->t);
  free(w->meta);
  free(w);
}

/* The offset of the first byte of s that breaks UTF-8 (RFC 3629: no overlong forms, surrogates or code points
 * past U+10FFFF, no cut sequence), or -1 when s is UTF-8. */
static int64_t utf8_error_at(const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  for (int64_t i = 0; p[i];) {
    const unsigned c = p[i];
    int n = c < 0x80 ? 0 : c >= 0xc2 && c <= 0xdf ? 1 : c >= 0xe0 && c <= 0xef ? 2 : c >= 0xf0 && c <= 0xf4 ? 3 : -1;
    if (n < 0) return i;
    /* the second byte's range rules out overlong forms, surrogates and code points past U+10FFFF */
    const unsigned lo = c == 0xe0 ? 0xa0 : c == 0xf0 ? 0x90 : 0x80, hi = c == 0xed ? 0x9f : c == 0xf4 ? 0x8f : 0xbf;
    for (int k = 1; k <= n; k++)
      if (p[i + k] < (k == 1 ? lo : 0x80) || p[i + k] > (k == 1 ? hi : 0xbf)) return i;
    i += n + 1;
  }
  return -1;
}

/* M3_ERR_ARGUMENT when s (what: "tensor name", "metadata key", ...) is not UTF-8: a safetensors header is JSON,
 * which is UTF-8, and other readers (the Python safetensors package among them) refuse a file whose header is not.
 * The message shows s (its first 64 bytes) with bytes past ASCII as \xNN. */
static m3_status check_utf8(const char *what, const char *s) {
  const int64_t at = utf8_error_at(s);
  if (at < 0) return M3_OK;
  char shown[64 * 4 + 1];
  size_t n = 0;
  for (const unsigned char *p = (const unsigned char *)s; *p && p - (const unsigned char *)s < 64; p++)
    n += (size_t)snprintf(shown + n, sizeof shown - n, *p < 0x80 ? "%c" : "\\x%02x", *p);
  return m3_fail(M3_ERR_ARGUMENT,
                 "%s \"%s\"%s is not UTF-8 (byte %lld is 0x%02x): a safetensors header is JSON text, which must be "
                 "UTF-8 (other readers refuse the file)",
                 what, shown, strlen(s) > 64 ? "..." : "", (long long)at, ((const unsigned char *)s)[at]);
}

/* Makes room for one more element of an array of n (capacity *cap). */
static int grow(void **arr, int32_t *cap, int32_t n, size_t elem) {
  if (n < *cap) return 1;
  if (*cap > INT32_MAX / 2) return 0;
  int32_t c = *cap ? 2 * *cap : 16;
  void *p = realloc(*arr, (size_t)c * elem);
  if (!p) return 0;
  *arr = p;
  *cap = c;
  return 1;
}

static m3_status check_tensor_args(const m3_tensor_writer *w, const char *name, int32_t dtype, int32_t ndim,
                                   const int64_t *shape, const void *data, int64_t *nbytes) {
  if (!w || !name) return m3_fail(M3_ERR_ARGUMENT, "m3_tensor_writer_add: NULL writer or name");
  if (!name[0] || strcmp(name, "__metadata__") == 0)
    return m3_fail(M3_ERR_ARGUMENT, "tensor name \"%s\" is reserved or empty", name);
  TRY(check_utf8("tensor name", name));
  if (dtype < 0 || dtype >= N_DTYPES)
    return m3_fail(M3_ERR_ARGUMENT, "tensor \"%s\": dtype %d is not an m3_dtype (0..%d)", name, dtype, N_DTYPES - 1);
  if (ndim < 0 || ndim > MAX_DIMS || (ndim > 0 && !shape))
    return m3_fail(M3_ERR_ARGUMENT, "tensor \"%s\": ndim %d must be in [0, %d] with a shape", name, ndim, MAX_DIMS);
  for (int32_t i = 0; i < ndim; i++)
    if (shape[i] < 0 || shape[i] > MAX_EXACT_INT)
      return m3_fail(M3_ERR_ARGUMENT, "tensor \"%s\": dim %d is %lld: must be in [0, 2^53] (a reader takes JSON "
                     "integers up to 2^53 only)", name, i, (long long)shape[i]);
  int64_t numel;
  if (!shape_size(ndim, shape, dtype, &numel, nbytes))
    return m3_fail(M3_ERR_ARGUMENT, "tensor \"%s\": shape is too large (size overflows)", name);
  if (*nbytes > MAX_EXACT_INT - w->nbytes)
    return m3_fail(M3_ERR_ARGUMENT, "tensor \"%s\": %lld bytes after the %lld before it would end the data section "
                   "past byte 2^53 (a reader takes data offsets up to 2^53 only)", name, (long long)*nbytes,
                   (long long)w->nbytes);
  if (*nbytes > 0 && !data) return m3_fail(M3_ERR_ARGUMENT, "tensor \"%s\": data is NULL", name);
  for (int32_t i = 0; i < w->n; i++)
    if (strcmp(w->t[i].name, name) == 0) return m3_fail(M3_ERR_ARGUMENT, "tensor \"%s\" was already added", name);
  return M3_OK;
}

m3_status m3_tensor_writer_add(m3_tensor_writer *w, const char *name, int32_t dtype, int32_t ndim, const int64_t *shape,
                               const void *data) {
  int64_t nbytes = 0;
  TRY(check_tensor_args(w, name, dtype, ndim, shape, data, &nbytes));
  if (!grow((void **)&w->t, &w->cap, w->n, sizeof *w->t)) return m3_fail(M3_ERR_MEMORY, "out of memory");
  wentry *t = &w->t[w->n];
  memset(t, 0, sizeof *t);
  if (!(t->name = strdup(name))) return m3_fail(M3_ERR_MEMORY, "out of memory");
  t->dtype = dtype;
  t->ndim = ndim;
  for (int32_t i = 0; i < ndim; i++) t->shape[i] = shape[i];
  t->nbytes = nbytes;
  t->data = data;
  w->n++;
  w->nbytes += nbytes;
  return M3_OK;
}

m3_status m3_tensor_writer_add_metadata(m3_tensor_writer *w, const char *key, const char *value) {
  if (!w || !key || !value) return m3_fail(M3_ERR_ARGUMENT, "m3_tensor_writer_add_metadata: NULL argument");
  TRY(check_utf8("metadata key", key));
  if (utf8_error_at(value) >= 0) return m3_fail_context(check_utf8("the value", value), "metadata \"%s\"", key);
  for (int32_t i = 0; i < w->n_meta; i++)
    if (strcmp(w->meta[i].key, key) == 0) return m3_fail(M3_ERR_ARGUMENT, "metadata key \"%s\" was already added", key);
  if (!grow((void **)&w->meta, &w->meta_cap, w->n_meta, sizeof *w->meta))
    return m3_fail(M3_ERR_MEMORY, "out of memory");
  kv *e = &w->meta[w->n_meta];
  e->key = strdup(key);
  e->value = strdup(value);
  if (!e->key || !e->value) {
    free(e->key);
    free(e->value);
    return m3_fail(M3_ERR_MEMORY, "out of memory");
  }
  w->n_meta++;
  return M3_OK;
}

/* Appends an integer as raw JSON text (exact for every int64). */
static int add_int(cJSON *arr, int64_t v) {
  char buf[32];
  snprintf(buf, sizeof buf, "%lld", (long long)v);
  cJSON *item = cJSON_CreateRaw(buf);
  return item && cJSON_AddItemToArray(arr, item);
}

static int add_tensor_json(cJSON *root, const wentry *t, int64_t begin) {
  cJSON *o = cJSON_AddObjectToObject(root, t->name);
  if (!o || !cJSON_AddStringToObject(o, "dtype", dtypes[t->dtype].name)) return 0;
  cJSON *shape = cJSON_AddArrayToObject(o, "shape");
  if (!shape) return 0;
  for (int32_t i = 0; i < t->ndim; i++)
    if (!add_int(shape, t->shape[i])) return 0;
  cJSON *off = cJSON_AddArrayToObject(o, "data_offsets");
  return off && add_int(off, begin) && add_int(off, begin + t->nbytes);
}

/* The header JSON (malloc'd, unpadded), or NULL when out of memory. */
static char *header_json(const m3_tensor_writer *w) {
  cJSON *root = cJSON_CreateObject();
  int ok = root != NULL;
  if (ok && w->n_meta) {
    cJSON *meta = cJSON_AddObjectToObject(root, "__metadata__");
    ok = meta != NULL;
    for (int32_t i = 0; ok && i < w->n_meta; i++)
      ok = cJSON_AddStringToObject(meta, w->meta[i].key, w->meta[i].value) != NULL;
  }
  int64_t offset = 0;
  for (int32_t i = 0; ok && i < w->n; i++) {
    ok = add_tensor_json(root, &w->t[i], offset);
    offset += w->t[i].nbytes;
  }
  char *text = ok ? cJSON_PrintUnformatted(root) : NULL;
  cJSON_Delete(root);
  return text;
}

static int write_all(int fd, const void *buf, int64_t n) {
  const char *p = buf;
  while (n > 0) {
    ssize_t k = write(fd, p, n > (1 << 30) ? (size_t)1 << 30 : (size_t)n);
    if (k < 0 && errno == EINTR) continue;
    if (k == 0) errno = EIO;
    if (k <= 0) return 0;
    p += k;
    n -= k;
  }
  return 1;
}

/* Writes the length, the padded header and every tensor to fd; 0 with errno on failure. */
static int write_contents(int fd, const m3_tensor_writer *w, const char *header) {
  int64_t len = (int64_t)strlen(header), padded = round_up(len, 8);
  unsigned char len_bytes[8];
  for (int i = 0; i < 8; i++) len_bytes[i] = (unsigned char)((uint64_t)padded >> (8 * i));
  static const char spaces[] = "       "; /* padding is at most 7 bytes */
  if (!write_all(fd, len_bytes, 8) || !write_all(fd, header, len) || !write_all(fd, spaces, padded - len)) return 0;
  for (int32_t i = 0; i < w->n; i++)
    if (!write_all(fd, w->t[i].data, w->t[i].nbytes)) return 0;
  return 1;
}

/* Best effort: makes the rename durable by syncing the directory that holds path. */
static void sync_parent_dir(const char *path) {
  const char *slash = strrchr(path, '/');
  char *dir = slash ? strndup(path, slash == path ? 1 : (size_t)(slash - path)) : strdup(".");
  int fd = dir ? open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC) : -1;
  if (fd >= 0) {
    fsync(fd);
    close(fd);
  }
  free(dir);
}

/* What a file of mode m is, for a message. */
static const char *file_kind(mode_t m) {
  return S_ISDIR(m)    ? "a folder"
         : S_ISFIFO(m) ? "a FIFO (named pipe)"
         : S_ISCHR(m)  ? "a character device"
         : S_ISBLK(m)  ? "a block device"
         : S_ISSOCK(m) ? "a socket"
                       : "not a regular file";
}

/* The file that a write to path replaces (*target, malloc'd): path when nothing is there or a regular file is,
 * else the regular file a symbolic link resolves to. Anything else is refused, saying what is there. */
static m3_status write_target(const char *path, char **target) {
  static const char replaced[] = "only a regular file, or a symbolic link to one, is replaced";
  struct stat st;
  if (lstat(path, &st) != 0 || S_ISREG(st.st_mode)) {
    *target = strdup(path);
    return *target ? M3_OK : m3_fail(M3_ERR_MEMORY, "writing %s: out of memory", path);
  }
  if (!S_ISLNK(st.st_mode))
    return m3_fail(M3_ERR_IO, "writing %s: it exists and is %s; %s", path, file_kind(st.st_mode), replaced);
  *target = realpath(path, NULL);
  if (!*target) {
    const int err = errno;
    char link[4096];
    const ssize_t n = readlink(path, link, sizeof link - 1);
    link[n > 0 ? n : 0] = 0;
    return m3_fail(M3_ERR_IO, "writing %s: it is a symbolic link to %s, which does not resolve (%s); %s", path,
                   n > 0 ? link : "?", strerror(err), replaced);
  }
  if (stat(*target, &st) == 0 && S_ISREG(st.st_mode)) return M3_OK;
  m3_status rc = m3_fail(M3_ERR_IO, "writing %s: it is a symbolic link to %s, which is %s; %s", path, *target,
                         file_kind(st.st_mode), replaced);
  free(*target);
  *target = NULL;
  return rc;
}

/* Creates tmp and writes, fsyncs and closes it; NULL on success, else the failed step (errno
 * kept). *created tells whether tmp now exists. */
static const char *write_temp(const char *tmp, const m3_tensor_writer *w, const char *header, int *created) {
  int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  *created = fd >= 0;
  if (fd < 0) return "create failed";
  const char *fail = NULL;
  if (!write_contents(fd, w, header))
    fail = "write failed";
  else if (fsync(fd) != 0)
    fail = "fsync failed";
  int err = errno;
  if (close(fd) != 0 && !fail) {
    fail = "close failed";
    err = errno;
  }
  errno = err;
  return fail;
}

static m3_status write_file(const m3_tensor_writer *w, const char *path, const char *header) {
  static atomic_uint counter;
  char *target = NULL;
  TRY(write_target(path, &target));
  /* beside the target, named after at most its first 200 bytes: the suffix must not push a name the file system
   * takes (up to 255 bytes) past its limit */
  const char *slash = strrchr(target, '/');
  const int dir_len = slash ? (int)(slash - target + 1) : 0;
  const size_t base_len = strlen(target + dir_len);
  char *tmp = NULL;
  if (asprintf(&tmp, "%.*s%.*s.tmp.%ld.%u", dir_len, target, base_len > 200 ? 200 : (int)base_len,
               target + dir_len, (long)getpid(), atomic_fetch_add(&counter, 1)) < 0) {
    free(target);
    return m3_fail(M3_ERR_MEMORY, "writing %s: out of memory", path);
  }
  int created = 0;
  const char *fail = write_temp(tmp, w, header, &created);
  if (!fail && rename(tmp, target) != 0) fail = "rename onto the target failed";
  m3_status rc = M3_OK;
  if (fail) {
    rc = m3_fail(M3_ERR_IO, "writing %s: temporary file %s: %s: %s", path, tmp, fail, strerror(errno));
    if (created) unlink(tmp);
  } else {
    sync_parent_dir(target);
  }
  free(tmp);
  free(target);
  return rc;
}

m3_status m3_tensor_writer_write(m3_tensor_writer *w, const char *path) {
  if (!w || !path) return m3_fail(M3_ERR_ARGUMENT, "m3_tensor_writer_write: NULL writer or path");
  if (!path[0]) return m3_fail(M3_ERR_ARGUMENT, "m3_tensor_writer_write: the path is empty: expected a file name");
  char *header = header_json(w);
  if (!header) return m3_fail(M3_ERR_MEMORY, "writing %s: out of memory building the header", path);
  const int64_t padded = round_up((int64_t)strlen(header), 8);
  if ((uint64_t)padded > MAX_HEADER_BYTES) {
    free(header);
    return m3_fail(M3_ERR_ARGUMENT, "writing %s: the header (tensor names, shapes and metadata) takes %lld bytes: "
                   "must be at most %llu, the most a reader accepts", path, (long long)padded,
                   (unsigned long long)MAX_HEADER_BYTES);
  }
  m3_status rc = write_file(w, path, header);
  free(header);
  return rc;
}

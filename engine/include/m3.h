/*
 * m3.h — the public C API of libm3, a training engine for Mamba-3 SISO backbones.
 *
 * The math is ../shared/SPEC.md; the interface principles are ../shared/API.md:
 *   - opaque handles with create/destroy pairs (destroy is NULL-safe);
 *   - every fallible call returns an m3_status (M3_OK = 0); the message, with the failing
 *     call and file:line, is kept per thread and read with m3_last_error();
 *   - a NULL pointer where one is needed is M3_ERR_ARGUMENT (void calls do nothing);
 *   - the library never exits, aborts or prints on bad input and never touches a lua_State.
 *
 * Everything between the M3_FFI markers is plain C (no macros, no includes) so that the
 * LuaJIT binding's ffi.cdef is generated from this file (lua/m3/cdef.lua, at build time).
 * Shapes are row-major; "[B, T, d]" means B·T·d contiguous values, the last index fastest.
 */
#ifndef M3_H
#define M3_H

#include <stddef.h>
#include <stdint.h>

/* Bumped whenever a declaration below changes; the Lua binding refuses a library whose
 * m3_abi_version() differs from the header it was generated from. */
#define M3_ABI_VERSION 9

#ifdef __cplusplus
extern "C" {
#endif

/* M3_FFI_BEGIN */

/* ---- status and errors ------------------------------------------------------------- */

typedef enum m3_status {
  M3_OK = 0,
  M3_ERR_ARGUMENT = 1,    /* a bad argument: NULL, out of range, wrong shape or kind */
  M3_ERR_CONFIG = 2,      /* a model or trainer config field breaks a rule */
  M3_ERR_IO = 3,          /* a file could not be opened, read, written or renamed */
  M3_ERR_FORMAT = 4,      /* a malformed file: header, JSON, dtype, shape, offsets */
  M3_ERR_MEMORY = 5,      /* out of host or device memory */
  M3_ERR_ORDER = 6,       /* a call out of order (backward without forward, open window) */
  M3_ERR_NONFINITE = 7,   /* a non-finite gradient: the update was not applied */
  M3_ERR_UNSUPPORTED = 8, /* this backend or build cannot do it (graphs on CPU, sizes) */
  M3_ERR_CUDA = 9,        /* a CUDA, cuBLAS or driver call failed */
  M3_ERR_POISONED = 10,   /* an earlier sticky CUDA error poisoned this trainer */
  M3_ERR_INTERRUPTED = 11,/* m3_interrupt() stopped the call; nothing was applied */
  M3_ERR_CLOSED = 12,     /* the object was closed */
  M3_ERR_INTERNAL = 13    /* a broken internal invariant (a bug: please report it) */
} m3_status;

int32_t m3_abi_version(void);
const char *m3_version(void);
/* The message of the last failing call on this thread ("" when none). */
const char *m3_last_error(void);
/* A short constant name for a status ("M3_ERR_CONFIG"). */
const char *m3_status_name(int32_t status);

/* Interrupts (the m3lua host calls m3_interrupt from its SIGINT handler). Long loops in the
 * engine check the flag between layers and return M3_ERR_INTERRUPTED, leaving weights,
 * moments and the step counter untouched. The flag stays set until cleared. */
void m3_interrupt(void);
void m3_interrupt_clear(void);
int32_t m3_interrupted(void);

/* Build and machine facts. */
int32_t m3_has_cuda_build(void);   /* 1 when the library was built with the CUDA backend */
int32_t m3_cuda_device_count(void);/* usable CUDA devices (0 without a GPU or CUDA build) */
/* Page-locked host memory, zeroed (CUDA builds on a machine with a device): a batch whose large arrays
 * (input, d_out) live in it uploads straight from them, without the staging copy. NULL where it cannot
 * be had (no CUDA build or device, or the allocation failed). Free with m3_host_pinned_free. */
void *m3_host_pinned_alloc(size_t bytes);
void m3_host_pinned_free(void *p);
/* Threads used by the CPU backend (n <= 0: all cores); more than 4 per core is M3_ERR_ARGUMENT (it never
 * helps, and the thread runtime ends the process when it cannot start them). The count is an OpenMP setting of
 * the calling thread: other threads keep theirs, and m3_cpu_threads reads the caller's. Trainers and inference
 * objects take most of their threads from the count in force when they were created (their scratch is sized
 * for it), whatever it is later: set it before creating them. */
m3_status m3_cpu_set_threads(int32_t n);
int32_t m3_cpu_threads(void);
/* The kernel set OpenBLAS chose for this CPU ("SkylakeX", "Haswell", ...). */
const char *m3_cpu_blas_core(void);

/* ---- model configuration (SPEC.md §1) ------------------------------------------------ */

typedef enum m3_input_kind {
  M3_INPUT_FEATURES = 0,  /* linear input_proj with bias from input_dim features */
  M3_INPUT_IDENTITY = 1,  /* the input already is d_model wide */
  M3_INPUT_TOKENS = 2     /* embedding lookup of int32 token ids */
} m3_input_kind;

typedef enum m3_head_kind {
  M3_HEAD_NONE = 0,       /* the caller supplies dL/d out */
  M3_HEAD_LM = 1,         /* cross-entropy over vocab_size logits */
  M3_HEAD_MSE = 2         /* linear readout to out_dim, mean squared error */
} m3_head_kind;

typedef struct m3_config {
  int32_t d_model;        /* required, >= 1 */
  int32_t n_layers;       /* required, >= 1 */
  int32_t d_state;        /* N, default 128 */
  int32_t expand;         /* default 2; d_inner = expand * d_model */
  int32_t headdim;        /* P, default 64, divides d_inner */
  int32_t ngroups;        /* G, default 1, divides nheads */
  double rope_fraction;   /* 0, 0.5 (default) or 1.0 */
  double a_floor;         /* > 0, default 1e-4 */
  int32_t outproj_norm;   /* 0/1, default 0 */
  int32_t input;          /* m3_input_kind, default FEATURES */
  int32_t head;           /* m3_head_kind, default NONE */
  int32_t tie_embeddings; /* 0/1, default 1 ("lm" head only) */
  int32_t input_dim;      /* "features": width of the input */
  int32_t vocab_size;     /* "tokens" input or "lm" head: >= 2 */
  int32_t out_dim;        /* "mse" head: width of the readout */
} m3_config;

typedef struct m3_config_derived {
  int32_t d_inner;        /* expand * d_model */
  int32_t nheads;         /* d_inner / headdim */
  int32_t num_rope_angles;/* S */
  int32_t in_proj_dim;    /* 2 d_inner + 2 G N + 3 H + S */
  int32_t n_tensors;      /* parameter tensors */
  int64_t n_params;       /* parameter elements */
} m3_config_derived;

/* Defaults of SPEC.md §1; d_model and n_layers are left 0 (required). */
void m3_config_defaults(m3_config *cfg);
/* Checks every rule; the error names the field, the value and the rule. */
m3_status m3_config_validate(const m3_config *cfg);
m3_status m3_config_derive(const m3_config *cfg, m3_config_derived *out);
/* JSON with the SPEC.md §1 names (strings for input/head, booleans for flags). The reader
 * ignores keys it does not know (window sizes and the like), checks the derived sizes it
 * finds (d_inner, nheads, num_rope_angles, in_proj_dim, n_params) against the fields and
 * takes no boolean for an integer field; to_json returns a string owned by the library,
 * valid until the next call on this thread ("" for NULL or a config that breaks a rule:
 * m3_last_error says which). */
m3_status m3_config_from_json(const char *json, m3_config *out);
const char *m3_config_to_json(const m3_config *cfg);

/* ---- host weights (float32, SPEC.md §2 names) ---------------------------------------- */

typedef struct m3_weights m3_weights;

typedef struct m3_tensor_info {
  const char *name;       /* SPEC.md §2 name, e.g. "layers.0.mixer.in_proj.weight" */
  int32_t ndim;
  int64_t shape[4];
  int64_t numel;
  int64_t offset;         /* element offset in the flat arena (m3_weights_data) */
  int32_t no_decay;       /* 1: in the reference no-decay group (SPEC.md §7) */
  float *data;            /* numel float32 values inside the arena */
} m3_tensor_info;

/* Zero-filled weights for a validated config. */
m3_status m3_weights_create(const m3_config *cfg, m3_weights **out);
void m3_weights_destroy(m3_weights *w);
m3_status m3_weights_clone(const m3_weights *w, m3_weights **out);
/* Initialises every tensor from one seeded generator (SPEC.md §2; same bits everywhere). */
m3_status m3_weights_init(m3_weights *w, uint64_t seed);
/* Loads a safetensors file. cfg may be NULL: the config is then read from the file's
 * "config" metadata. Accepts the "backbone." prefix and ignores a lm_head.weight equal to
 * the tied embedding; missing, extra or mis-shaped tensors are errors, and so is a NaN or an
 * infinity among the values (M3_ERR_FORMAT, naming the tensor, the element and the value). */
m3_status m3_weights_load(const char *path, const m3_config *cfg, m3_weights **out);
/* Atomic write (temporary file, flush, rename) with the config as metadata. Weights holding a NaN or an
 * infinity are refused first (M3_ERR_ARGUMENT, in m3_weights_load's words); the target as for
 * m3_tensor_writer_write. */
m3_status m3_weights_save(const m3_weights *w, const char *path);
const m3_config *m3_weights_config(const m3_weights *w);
int32_t m3_weights_count(const m3_weights *w);
m3_status m3_weights_tensor(const m3_weights *w, int32_t index, m3_tensor_info *out);
/* Index of a tensor by name (the "backbone." prefix is accepted), -1 when absent. */
int32_t m3_weights_find(const m3_weights *w, const char *name);
float *m3_weights_data(m3_weights *w);
int64_t m3_weights_arena_size(const m3_weights *w); /* elements, padding included */

/* ---- safetensors files ----------------------------------------------------------------- */

typedef enum m3_dtype {
  M3_DTYPE_F32 = 0, M3_DTYPE_F64 = 1, M3_DTYPE_I32 = 2, M3_DTYPE_U8 = 3,
  M3_DTYPE_F16 = 4, M3_DTYPE_BF16 = 5, M3_DTYPE_I64 = 6, M3_DTYPE_I16 = 7,
  M3_DTYPE_I8 = 8, M3_DTYPE_BOOL = 9, M3_DTYPE_U16 = 10, M3_DTYPE_U32 = 11, M3_DTYPE_U64 = 12
} m3_dtype;

typedef struct m3_file_tensor {
  const char *name;
  int32_t dtype;          /* m3_dtype */
  int32_t ndim;
  int64_t shape[8];
  int64_t numel;
  size_t nbytes;
  const void *data;       /* little-endian values inside the opened file's buffer */
} m3_file_tensor;

typedef struct m3_tensor_file m3_tensor_file;

/* Reads and validates a whole file: header length, JSON, dtypes, shapes, offsets against
 * the file size, overlaps and gaps. Anything malformed is M3_ERR_FORMAT with a message. */
m3_status m3_tensor_file_open(const char *path, m3_tensor_file **out);
void m3_tensor_file_close(m3_tensor_file *f);
int32_t m3_tensor_file_count(const m3_tensor_file *f);
m3_status m3_tensor_file_get(const m3_tensor_file *f, int32_t index, m3_file_tensor *out);
int32_t m3_tensor_file_find(const m3_tensor_file *f, const char *name); /* -1 if absent */
/* __metadata__ entries (string values). */
int32_t m3_tensor_file_metadata_count(const m3_tensor_file *f);
const char *m3_tensor_file_metadata_key(const m3_tensor_file *f, int32_t index);
const char *m3_tensor_file_metadata(const m3_tensor_file *f, const char *key); /* NULL if absent */

typedef struct m3_tensor_writer m3_tensor_writer;

m3_status m3_tensor_writer_create(m3_tensor_writer **out);
void m3_tensor_writer_destroy(m3_tensor_writer *w);
/* The data pointer must stay valid until m3_tensor_writer_write returns. Shape dims and the data section's
 * running byte offset may be at most 2^53 (what a reader takes); more is M3_ERR_ARGUMENT. Names, metadata
 * keys and values must be UTF-8 (a safetensors header is JSON text); others are M3_ERR_ARGUMENT. */
m3_status m3_tensor_writer_add(m3_tensor_writer *w, const char *name, int32_t dtype,
                               int32_t ndim, const int64_t *shape, const void *data);
m3_status m3_tensor_writer_add_metadata(m3_tensor_writer *w, const char *key, const char *value);
/* Writes path atomically: a temporary file beside it, flushed and fsynced, then renamed. A header
 * (names, shapes, metadata) over the reader's 100 MB limit is M3_ERR_ARGUMENT and writes nothing.
 * A symbolic link is written through (the file it resolves to is replaced, the link stays); a
 * target that is neither a regular file nor a link to one (a folder, a FIFO, a device) is
 * M3_ERR_IO before anything is written; an empty path is M3_ERR_ARGUMENT. */
m3_status m3_tensor_writer_write(m3_tensor_writer *w, const char *path);

/* ---- trainer ----------------------------------------------------------------------------- */

typedef enum m3_device_kind {
  M3_DEVICE_AUTO = 0,     /* the first CUDA device when there is one, else the CPU */
  M3_DEVICE_CPU = 1,
  M3_DEVICE_CUDA = 2
} m3_device_kind;

typedef enum m3_precision {
  M3_PRECISION_F32 = 0,
  M3_PRECISION_BF16 = 1,
  M3_PRECISION_F16 = 2    /* with dynamic loss scaling */
} m3_precision;

typedef struct m3_trainer m3_trainer;

/* Creation options (m3_trainer_cfg_defaults fills the defaults); the on / off fields take 0 or 1. */
typedef struct m3_trainer_cfg {
  const m3_weights *weights; /* initial weights (copied; the caller keeps ownership); every value finite */
  int32_t device;         /* m3_device_kind */
  int32_t device_index;   /* CUDA ordinal for M3_DEVICE_CUDA */
  int32_t precision;      /* m3_precision */
  int32_t batch;          /* largest number of rows of a window */
  int32_t seq_len;        /* largest window length */
  double lr;              /* 1e-3 */
  double weight_decay;    /* 1e-2 */
  double beta1, beta2;    /* 0.9, 0.999 */
  double eps;             /* 1e-8 */
  int32_t no_decay;       /* 1: the reference no-decay group (default); 0: decay all */
  int32_t carry_state;    /* 1: windows continue the previous window's state; 0: they start from zero */
  double clip;            /* max global grad norm for m3_trainer_step; 0 = off */
  int32_t allow_tf32;     /* 1: f32 GEMMs may use TF32 on the GPU; 0: they may not */
  uint64_t seed;          /* the trainer's RNG (saved in checkpoints) */
} m3_trainer_cfg;

/* A window of rows x len tokens (rows <= batch, len <= seq_len). Unused fields are NULL. */
typedef struct m3_batch {
  int32_t rows, len;
  const float *input;         /* [rows, len, input_dim | d_model] ("features", "identity") */
  const int32_t *tokens;      /* [rows, len] ("tokens") in [0, vocab) */
  const int32_t *targets;     /* [rows, len] ("lm") in [0, vocab) or -1 (ignored) */
  const float *target_values; /* [rows, len, out_dim] ("mse") */
  const uint8_t *mask;        /* [rows, len] optional ("mse"): 1 = counted */
  const float *d_out;         /* [rows, len, d_model] ("none"): dL/d out */
  const uint8_t *resets;      /* [rows, len] optional: 1 = zero the state before token t */
} m3_batch;

typedef struct m3_backward_opts {
  double clip;            /* < 0: the trainer's clip; 0: none; > 0: max norm */
  int32_t accumulate;     /* 1: add gradients and keep the window open; 0: close it */
  double scale;           /* multiplies this micro-batch's loss (1/k for k micro-batches); > 0, float32 normal */
} m3_backward_opts;

typedef struct m3_metrics {
  int64_t step;           /* optimizer steps taken after this call */
  double loss;            /* valid when has_loss (not where the batch counts no position) */
  double accuracy;        /* "lm" evaluate: share of counted targets predicted (argmax) */
  double grad_norm;       /* pre-clip global norm, valid when has_grad_norm */
  double loss_scale;      /* f16: the scale used for this step */
  double ms;              /* wall time of the call */
  int64_t tokens;         /* rows * len */
  int64_t counted;        /* positions (lm) or elements (mse) in the loss mean */
  int32_t has_loss, has_accuracy, has_grad_norm;
  int32_t graph_replayed, optimizer_stepped, overflow_skipped;
} m3_metrics;

typedef struct m3_trainer_info {
  int32_t device;         /* M3_DEVICE_CPU or M3_DEVICE_CUDA */
  int32_t device_index;
  int32_t precision;
  int32_t batch, seq_len;
  int32_t carry_state;
  int32_t no_decay;
  double clip;
  int64_t step;
  int32_t pending_forward;/* 1 between a forward and its backward_step */
  int32_t window_open;    /* 1 while accumulated gradients wait for a closing backward */
  int32_t has_graph;
  int32_t poisoned;
  int64_t device_bytes;   /* bytes this trainer holds on the device (0 on the CPU) */
  double gemm_seconds;    /* wall time in matrix products since creation (-1: not measured) */
} m3_trainer_info;

void m3_trainer_cfg_defaults(m3_trainer_cfg *cfg);
m3_status m3_trainer_create(const m3_trainer_cfg *cfg, m3_trainer **out);
void m3_trainer_destroy(m3_trainer *tr);
const m3_config *m3_trainer_config(const m3_trainer *tr);
void m3_trainer_get_info(const m3_trainer *tr, m3_trainer_info *out);

/* Checks a window as m3_trainer_step would (its inputs and the head's fields) and runs nothing; *counted
 * (may be NULL) receives the positions its loss counts: "lm" targets other than -1, "mse" positions whose
 * mask is set (all without a mask), every position for "none". A batch that counts none passes (it may sit in an
 * accumulation window), though m3_trainer_step refuses it. */
m3_status m3_trainer_check_batch(const m3_trainer *tr, const m3_batch *b, int64_t *counted);
/* Fused forward + backward + optimizer (graph-replayed when captured). A batch that counts no position
 * ("lm": every target -1; "mse": every mask entry 0) has no loss and is refused before anything runs
 * (M3_ERR_ARGUMENT); so is a backward_step that would close a window whose micro-batches all count none
 * (the forward stays pending, the window open). An f32 / bf16 step whose gradient
 * is not finite (M3_ERR_NONFINITE) changes nothing, the carried state included (carry_state). An f16
 * overflow skips only the update. In the split API a backward_step refused as non-finite puts the state
 * back too where its window held one forward, keeping what the caller did after that forward (rows reset
 * are reset again; after a set_state the state stays as set, and the error says so); the forwards of a
 * longer window each moved it, and it stays where the last one left it (reset_state or set_states put it
 * where the caller wants). */
m3_status m3_trainer_step(m3_trainer *tr, const m3_batch *b, m3_metrics *out);
/* Split API. forward keeps the activations and the window's inputs; out (may be NULL)
 * receives [rows, len, d_model]. backward_step's batch supplies only the head's fields
 * (targets, target_values and mask, or d_out) for the same rows x len; inputs and resets
 * are the pending forward's. A forward while one is pending replaces it (the first's activations are
 * dropped; with carry_state the state moves on from where the first left it). */
m3_status m3_trainer_forward(m3_trainer *tr, const m3_batch *b, float *out);
m3_status m3_trainer_backward_step(m3_trainer *tr, const m3_batch *b,
                                   const m3_backward_opts *opts, m3_metrics *out);
/* Loss (and accuracy for "lm") without gradients or state changes; out may be NULL. */
m3_status m3_trainer_evaluate(m3_trainer *tr, const m3_batch *b, m3_metrics *metrics, float *out);

m3_status m3_trainer_capture_graph(m3_trainer *tr);
m3_status m3_trainer_drop_graph(m3_trainer *tr);
int32_t m3_trainer_has_graph(const m3_trainer *tr);

/* Phase timing (CUDA backend; a development aid, off by default). With profiling on, every
 * eager call that synchronises (step, forward, backward_step, evaluate, state and weight
 * reads) records device time between its phase boundaries; steps replayed from a captured
 * graph are not timed (drop the graph to profile). m3_trainer_profile writes the phases that
 * took time, in step order, as milliseconds per counted call: the first call after switching
 * on is not counted (it loads modules). Switching on or off clears the totals. The CPU backend
 * answers M3_ERR_UNSUPPORTED, after the checks of the arguments that every backend makes (on: 0 or 1;
 * out, n and calls not NULL; cap >= 0). */
typedef struct m3_phase_time {
  const char *name;       /* a static string: "scan fwd", "in_proj bwd", "update", ... */
  double ms_per_call;
} m3_phase_time;
m3_status m3_trainer_set_profiling(m3_trainer *tr, int32_t on);
/* out [cap] entries; *n = entries written, *calls = calls counted. */
m3_status m3_trainer_profile(const m3_trainer *tr, m3_phase_time *out, int32_t cap, int32_t *n, int64_t *calls);

m3_status m3_trainer_set_lr(m3_trainer *tr, double lr);
double m3_trainer_lr(const m3_trainer *tr);
/* reference: 1 the reference no-decay group (SPEC.md §7), 0 decay every tensor (else M3_ERR_CONFIG, as for the
 * trainer option it sets). */
m3_status m3_trainer_set_no_decay(m3_trainer *tr, int32_t reference);
m3_status m3_trainer_set_clip(m3_trainer *tr, double max_norm);

/* Recurrent state (SPEC.md §4). rows NULL: all rows (n_rows is then not read); else n_rows >= 0 entries in
 * [0, batch), a repeated one reset once. Per layer, batch first:
 * angle [batch, H, S], ssm [batch, H, P, N], k [batch, H, N], v [batch, H, P]; any pointer
 * may be NULL to skip that tensor. set_state needs a trainer that carries its state (carry_state = 1; without
 * it every window starts from zero, and the call is M3_ERR_UNSUPPORTED). */
m3_status m3_trainer_reset_state(m3_trainer *tr, const int32_t *rows, int32_t n_rows);
m3_status m3_trainer_get_state(const m3_trainer *tr, int32_t layer, float *angle, float *ssm,
                               float *k, float *v);
m3_status m3_trainer_set_state(m3_trainer *tr, int32_t layer, const float *angle,
                               const float *ssm, const float *k, const float *v);

/* Copies into weights of the same config: float32 masters / accumulated gradients. */
m3_status m3_trainer_snapshot(const m3_trainer *tr, m3_weights *out);
m3_status m3_trainer_grads(const m3_trainer *tr, m3_weights *out);
/* Replaces the master weights (and the 16-bit shadows); moments are kept. Weights holding a NaN or an
 * infinity are refused (M3_ERR_ARGUMENT) and the trainer keeps its own, as m3_trainer_create and
 * m3_infer_create refuse them. */
m3_status m3_trainer_load_weights(m3_trainer *tr, const m3_weights *w);

int64_t m3_trainer_step_count(const m3_trainer *tr);
/* f16 loss scaler; M3_ERR_UNSUPPORTED for other precisions. */
m3_status m3_trainer_scaler_state(const m3_trainer *tr, double *scale, int64_t *tracker);
m3_status m3_trainer_load_scaler_state(m3_trainer *tr, double scale, int64_t tracker);

/* Full checkpoint: weights, Adam moments, step, lr, loss scale, RNG, recurrent state, model
 * and trainer config, plus an opaque caller string (the Lua layer's `extra`; UTF-8, as all
 * safetensors metadata, else M3_ERR_ARGUMENT), under a checksum
 * that loading verifies (a damaged file is refused). Refused while an accumulation window is open or a
 * forward is pending. */
m3_status m3_trainer_save(const m3_trainer *tr, const char *path, const char *extra);

/* Loading may change the device, the precision (a new f16 scaler starts), the window length
 * and the batch; with another batch the saved recurrent state does not fit and every row
 * starts from zero state, as it does for a trainer without carry_state (its saved state, which
 * no window reads, is not loaded). Weights, moments, step, lr, RNG and `extra` always load. */
typedef struct m3_load_opts {
  int32_t device;         /* -1: as saved (falling back to the CPU without a GPU) */
  int32_t device_index;   /* -1: as saved */
  int32_t precision;      /* -1: as saved */
  int32_t batch;          /* -1: as saved */
  int32_t seq_len;        /* -1: as saved */
} m3_load_opts;

/* opts NULL: every field -1 (as saved). */
m3_status m3_trainer_load(const char *path, const m3_load_opts *opts, m3_trainer **out);
/* The `extra` string of the checkpoint this trainer was loaded from ("" otherwise). */
const char *m3_trainer_extra(const m3_trainer *tr);

/* The trainer's RNG (xoshiro256**), advanced by callers that need reproducible draws. */
uint64_t m3_trainer_rng_next(m3_trainer *tr);

/* ---- inference ------------------------------------------------------------------------------ */

/* A forward-only model: weights (16-bit shadows for bf16/f16), the recurrent state of `batch`
 * rows and one layer's worth of activations; no gradients, Adam moments or saved
 * activations. Steps run from the carried state and advance it, so a prompt given whole,
 * in pieces or token by token gives the same outputs (bitwise on the CPU). */
typedef struct m3_infer m3_infer;

/* Creation options (m3_infer_cfg_defaults fills the defaults); the on / off fields take 0 or 1. */
typedef struct m3_infer_cfg {
  const m3_weights *weights; /* copied; the caller keeps ownership; every value finite */
  int32_t device;         /* m3_device_kind */
  int32_t device_index;   /* CUDA ordinal for M3_DEVICE_CUDA */
  int32_t precision;      /* m3_precision */
  int32_t batch;          /* rows: 1 */
  int32_t max_len;        /* positions per engine window: 256; longer steps run in pieces */
  int32_t graph;          /* 1 (default): CUDA graphs replay one-token steps (one per row count); 0: eager */
  int32_t allow_tf32;     /* 1: f32 GEMMs may use TF32 on the GPU; 0: they may not */
} m3_infer_cfg;

typedef struct m3_infer_info {
  int32_t device;         /* M3_DEVICE_CPU or M3_DEVICE_CUDA */
  int32_t device_index;
  int32_t precision;
  int32_t batch, max_len;
  int32_t graph;
  int32_t poisoned;
  int32_t logit_rows;     /* rows of the last step (its logits are readable), 0 before any */
  int64_t device_bytes;   /* bytes held on the device (0 on the CPU) */
  int32_t fused_decode;   /* 1: a one-token step runs every layer in one launch (CUDA bf16/f16, small models) */
} m3_infer_info;

void m3_infer_cfg_defaults(m3_infer_cfg *cfg);
m3_status m3_infer_create(const m3_infer_cfg *cfg, m3_infer **out);
void m3_infer_destroy(m3_infer *inf);
const m3_config *m3_infer_config(const m3_infer *inf);
void m3_infer_get_info(const m3_infer *inf, m3_infer_info *out);
/* Runs rows x len positions (b->tokens or b->input, optional b->resets; other fields are
 * ignored) of rows [0, rows) from their carried state and advances it. out [rows, len, d_model]
 * and, for "lm" models, logits [rows, vocab] of the last position may be NULL (the logits
 * then stay on the device; m3_infer_logits reads them later). Bad input (a token out of range, a NaN or
 * infinite input feature) changes nothing; a
 * step longer than max_len interrupted between pieces keeps the pieces already run. */
m3_status m3_infer_step(m3_infer *inf, const m3_batch *b, float *out, float *logits);
/* The last step's last-position logits [logit_rows, vocab] ("lm" models). */
m3_status m3_infer_logits(const m3_infer *inf, float *logits);
/* State as the trainer's (rows NULL: all rows; per layer, batch first; NULL tensors skipped). */
m3_status m3_infer_reset(m3_infer *inf, const int32_t *rows, int32_t n_rows);
m3_status m3_infer_get_state(const m3_infer *inf, int32_t layer, float *angle, float *ssm, float *k, float *v);
m3_status m3_infer_set_state(m3_infer *inf, int32_t layer, const float *angle, const float *ssm, const float *k,
                             const float *v);

/* ---- sampling (host) ----------------------------------------------------------------------- */

typedef struct m3_sample_opts {
  double temperature;     /* 0: greedy (the argmax, lowest id among ties) */
  int32_t top_k;          /* keep the top_k largest logits; 0: all */
  double top_p;           /* then the shortest most-likely prefix reaching this mass; 1: all */
} m3_sample_opts;

/* The 4-word generator state (xoshiro256**) of stream `row` of a seed. */
void m3_sampler_seed(uint64_t seed, int32_t row, uint64_t *state);
/* One token per row from logits [rows, vocab] (softmax(logits / temperature), top_k, then top_p);
 * row r uses and advances rng[4 r .. 4 r + 3]. Rows run in parallel; a row's token depends only
 * on its logits and its generator. */
m3_status m3_sample(const float *logits, int32_t rows, int32_t vocab, const m3_sample_opts *opts, uint64_t *rng,
                    int32_t *out);

/* M3_FFI_END */

#ifdef __cplusplus
}
#endif

#endif /* M3_H */

-- m3.help — short help texts for the REPL's `?topic` and for tab completion.
--
--   help.show("trainer")          prints the text (or the closest topics)
--   help.show(tr) / help.show(m3.schedule.cosine)   a value: its kind or its name (a
--   string that names no topic is also tried as a global: "?tr" for a trainer in `tr`)
--   help.text(topic) -> text | nil, {suggestions}
--   help.topics() -> sorted topic names;  help.complete(prefix) -> topics starting with it
--
-- Topic names: "m3", "m3.cpu_threads" (every m3.* function), "trainer", "trainer:step" (any
-- method; also "infer:step", "weights:get", "source:next" for data sources, "rng:u32", "tensor:shape",
-- "checkpoint:save", "curriculum:phase", "sampling:draw"), "tensor", "config", "weights",
-- "weights.init", "infer", "m3.schedule", "schedule.cosine",
-- "m3.log", "log.jsonl", "log.svg.lines", "pytorch.export", "m3.data", "data.parity",
-- "data.rng", ... Every public function and method has one.
-- Lookups are forgiving: "tr:step", "trainer.step", "step", "inf:generate", "w:get",
-- "src:next", "m3.schedule.cosine", "m3.log.jsonl", "svg.write", "schedule" and "?cosine"
-- all find their topic. A qualified name finds only a topic of that name or one that ends in
-- it ("svg.write" is log.svg.write): "fs.write" and "checkpoint.nope" find nothing, not a
-- topic that merely shares the last name. A short name that several topics end in ("new")
-- finds none of them: help.text gives them as the suggestions; of a trainer method's name
-- ("step", "close") the trainer's topic is taken.

local help = {}

local T = {}

-- The topics "<class>:<name>" of texts, a table of method name -> text.
local function add_methods(class, texts)
  for name, text in pairs(texts) do T[class .. ":" .. name] = text end
end

T["m3"] = [[
m3 — train Mamba-3 models from Lua.   local m3 = require "m3"
  m3.config{...}, m3.preset(name), m3.presets, m3.weights, m3.trainer(w_or_cfg, opts), m3.tensor,
  m3.load_tensors(path), m3.save_tensors(path, t), m3.infer(w, opts) (inference, generation),
  m3.pytorch (export / import), m3.cpu_threads(n), m3.cuda_device_count(), m3.has_cuda_build(),
  m3.version, m3.config_from_json(s)
  training library: m3.schedule, m3.curriculum, m3.data, m3.accumulate, m3.checkpoint,
  m3.log, m3.sweep, m3.fit
  ?trainer, ?trainer:step, ?m3.schedule, ?schedule.cosine ... for details]]

T["trainer"] = [[
m3.trainer(weights_or_config, {device = "auto", dtype = "f32", batch = 8, seq_len = 256,
  lr = 1e-3, weight_decay = 1e-2, betas = {0.9, 0.999}, eps = 1e-8, no_decay = "reference",
  carry_state = false, clip = 0, seed = 0, allow_tf32 = false})  allow_tf32: f32 GEMMs may use TF32 (GPU)
A batch: {tokens = int32 [B,T] | input = float [B,T,D], targets = int32 [B,T] (-1 ignored)
  | float [B,T,out_dim], d_out = ..., resets = uint8 [B,T], mask = ...}; B <= batch, T <= seq_len.
methods: step forward backward_step evaluate check_batch capture_graph drop_graph has_graph set_profiling profile
  set_lr lr set_clip set_reference_no_decay reset_state states set_states snapshot grads load_weights save
  scaler_state load_scaler_state info device dtype batch seq_len step_count close
  tr.config: the validated config it was built with (a copy)
  m3.trainer.load(path, {device =, dtype =, batch =, seq_len =}) -> trainer, extra]]
T["trainer.new"] = "m3.trainer.new(weights_or_config, opts) -> trainer  what m3.trainer(...) does; see ?trainer"

local methods = {
  step = "tr:step(batch) -> metrics\n  fused forward + backward + AdamW (graph-replayed when captured).\n  metrics: step, loss, accuracy, grad_norm, tokens, counted, ms, optimizer_stepped, ...\n  counted: what the loss mean divides by, positions (\"lm\") or elements (\"mse\": positions x out_dim)\n  a batch that counts nothing (every target -1, every mask 0) has no loss: refused, nothing runs",
  forward = "tr:forward(batch) -> out [B,T,d_model]\n  split API: keeps activations; a backward_step must follow.\n  another forward before it replaces the pending one (its activations are dropped; with\n  carry_state the state moves on from where the first left it). To look without training: evaluate.",
  backward_step = "tr:backward_step(batch_or_d_out, {clip =, accumulate =, scale =}) -> metrics\n  backward of the pending forward; accumulate = true adds gradients without stepping,\n  a later call without it closes the window (clip applies there); a window that counts nothing\n  cannot close (refused; the forward stays pending). See ?m3.accumulate.",
  evaluate = "tr:evaluate(batch) -> metrics, out\n  loss (and accuracy for \"lm\") without gradients or state changes; no loss where nothing counts.",
  check_batch = "tr:check_batch(batch) -> counted\n  checks a batch as step would and runs nothing; counted: the positions its loss counts\n  (\"lm\": targets other than -1; \"mse\": mask set, or all; \"none\": all).\n  For \"mse\" a step's metrics.counted is this times out_dim (elements).",
  capture_graph = "tr:capture_graph()\n  CUDA graph of the fused step (after >= 1 eager step); set_lr needs no recapture.",
  drop_graph = "tr:drop_graph()  forget the captured graph",
  has_graph = "tr:has_graph() -> boolean",
  set_profiling = "tr:set_profiling(on)  CUDA: time the phases of eager calls (graph replays are not timed)",
  profile = "tr:profile() -> {calls =, phases = {{name =, ms =}, ...}}\n  ms per counted call; the first call after set_profiling(true) is not counted.",
  set_lr = "tr:set_lr(x)  learning rate (> 0, finite); see ?m3.schedule",
  lr = "tr:lr() -> the current learning rate",
  set_clip = "tr:set_clip(max_norm)  global gradient-norm clipping for tr:step (0: off)",
  set_reference_no_decay = "tr:set_reference_no_decay(on)  norms, dt_bias and D without weight decay",
  reset_state = "tr:reset_state(rows?)  zero the recurrent state (all rows or 0-based rows)",
  states = "tr:states() -> {{angle =, ssm =, k =, v =}, ...} one table per layer",
  set_states = "tr:set_states(s)  replace the recurrent state",
  snapshot = "tr:snapshot() -> weights  float32 master weights",
  grads = "tr:grads() -> weights  the accumulated gradients",
  load_weights = "tr:load_weights(w)  replace the master weights (and 16-bit copies) with w (same config);\n"
    .. "  Adam moments are kept",
  save = "tr:save(path, extra)  full checkpoint (weights, moments, step, lr, RNG, state) plus a\n  plain Lua table; see ?m3.checkpoint",
  load = "m3.trainer.load(path, {device =, dtype =, batch =, seq_len =}) -> trainer, extra\n"
    .. "  a trainer from a checkpoint (tr:save), on its device and dtype unless opts name others;\n"
    .. "  with another batch the saved recurrent state is not loaded: every row starts from zero",
  scaler_state = "tr:scaler_state() -> scale, tracker  (f16 only)",
  load_scaler_state = "tr:load_scaler_state(scale, tracker)",
  info = "tr:info() -> {device, dtype, batch, seq_len, step, window_open, pending_forward, ...}",
  device = "tr:device() -> \"cpu\" | \"cuda:N\"",
  dtype = "tr:dtype() -> \"f32\" | \"bf16\" | \"f16\"",
  batch = "tr:batch() -> rows the trainer was allocated for",
  seq_len = "tr:seq_len() -> the longest window",
  step_count = "tr:step_count() -> optimizer steps taken",
  close = "tr:close()  free device memory now; later calls raise \"trainer is closed\"",
}
add_methods("trainer", methods)

T["tensor"] = [[
m3.tensor(shape, dtype = "f32")  zeros; dtype "f32" | "f64" | "i32" | "u8" (or float32, double, int32, uint8)
m3.tensor(shape, dtype, {pinned = true})  page-locked (GPU batches upload without a copy; make once, refill)
  shape: a list of at most 8 integers in [0, 2^53] (or one number) whose product is below 2^53
m3.tensor.from(nested_table, dtype); m3.tensor.is(x); t[i] (0-based, bounds-checked) t.data #t
methods: shape numel dtype to_table clone
  A plain FFI array plus a shape ({data =, shape =}) is accepted wherever a tensor is.]]
T["tensor.new"] = "m3.tensor.new(shape, dtype = \"f32\", {pinned =}) -> zeros  what m3.tensor(...) does; see ?tensor"
T["tensor.from"] = "m3.tensor.from(v, dtype = \"f32\") -> a new tensor  v: a nested rectangular table of numbers, a\n"
  .. "  tensor or {data = <FFI array>, shape =} (converted copies); values the dtype cannot hold are an error"
T["tensor.is"] = "m3.tensor.is(x) -> true when x is an m3 tensor"
local tensor_methods = {
  shape = "t:shape() -> {d1, d2, ...}  a new list of the dims",
  numel = "t:numel() -> the number of elements (the product of the dims; also #t)",
  dtype = "t:dtype() -> \"f32\" | \"f64\" | \"i32\" | \"u8\"",
  to_table = "t:to_table() -> nested Lua lists of the values (shape {} gives {value})",
  clone = "t:clone() -> an independent copy (same dtype and shape)",
}
add_methods("tensor", tensor_methods)

T["config"] = [[
m3.config{d_model =, n_layers =, d_state = 128, expand = 2, headdim = 64, ngroups = 1,
  rope_fraction = 0.5 (0 = no RoPE), input = "features" | "identity" | "tokens",
  head = "none" | "lm" | "mse", vocab_size =, input_dim =, out_dim =, tie_embeddings = true}
  -> a validated copy with d_inner, nheads, num_rope_angles, n_params.  m3.presets.rl, .lm130]]

T["weights"] = [[
m3.weights.init(cfg, {seed =}), m3.weights.load(path, cfg?), m3.weights.is(x)  host float32 weights
methods: get set names save clone numel close   (w.config: a copy of the validated config, yours to change)]]
T["weights.init"] = "m3.weights.init(cfg, {seed = 0}) -> weights  SPEC.md §2 init from one seeded generator"
T["weights.load"] = "m3.weights.load(path, cfg?) -> weights  a safetensors file (SPEC.md §2 names, optional\n"
  .. "  \"backbone.\" prefix); the config from its metadata when cfg is nil"
T["weights.is"] = "m3.weights.is(x) -> true when x is a weights object"
local weights_methods = {
  get = "w:get(name) -> f32 tensor  a view into the weights: writes through it change them",
  set = "w:set(name, tensor | nested table | flat list)  copy values (f32 or f64, the parameter's shape) in;\n"
    .. "  returns w",
  names = "w:names() -> {name, ...}  the tensor names (SPEC.md §2)",
  save = "w:save(path) -> path  a safetensors file with the config in its metadata (m3.weights.load reads it)",
  clone = "w:clone() -> weights  an independent copy",
  numel = "w:numel() -> the number of parameters (w.config.n_params)",
  close = "w:close()  free the memory now (once no view from get is alive); later calls raise \"weights are closed\"",
}
add_methods("weights", weights_methods)

T["m3.load_tensors"] = "m3.load_tensors(path) -> {name = tensor}, metadata  any safetensors file\n"
  .. "  (F32/F64/I32/U8 as they are, F16/BF16 as f32, other integers as i32); metadata: key -> string"
T["m3.save_tensors"] = "m3.save_tensors(path, {name = tensor}, metadata?) -> path  written atomically\n"
  .. "  (temporary file + rename); metadata values: strings, numbers or booleans; names and metadata\n"
  .. "  must be UTF-8 (a safetensors header is JSON text)"
T["m3.config_from_json"] = "m3.config_from_json(json_text) -> config  a validated config from m3's config JSON"
T["m3.preset"] = "m3.preset(name, overrides?) -> config  a copy of m3.presets[name] with overrides, validated"
T["m3.presets"] = "m3.presets  validated configs by name: rl (d_model 128, 4 layers, identity/none), mid\n"
  .. "  (d_model 256, 8 layers), lm130 (d_model 768, 24 layers, vocab 50280, tokens/lm); each access\n"
  .. "  gives new copies, so changing one changes no later lookup"
T["m3.cpu_threads"] = "m3.cpu_threads(n?) -> threads  the CPU backend's thread count; n sets it (n <= 0: all cores)\n"
  .. "  for trainers and inference objects created after it (those made before keep the count they were made with)"
T["m3.cuda_device_count"] = "m3.cuda_device_count() -> the number of CUDA devices (0 without a CUDA build or GPU)"
T["m3.has_cuda_build"] = "m3.has_cuda_build() -> true when libm3 was built with the CUDA backend"
T["m3.version"] = "m3.version  libm3's version string"

T["infer"] = [[
m3.infer(weights | trainer | path, {device = "auto", dtype = "f32", batch = 1, max_len = 256,
  graph = true, allow_tf32 = false})
  path: a weights file (w:save) or a trainer checkpoint (tr:save, m3.checkpoint's
  step-N.ckpt): its float32 master weights (see ?infer.load_weights).
  a forward-only model that steps rows [0, B) from their carried state (no gradients, no
  moments; one-token steps replay a CUDA graph on the GPU). Prompts longer than max_len run
  in pieces; token by token, in pieces or whole give the same bits on the CPU.
methods: step reset states set_states generate info device dtype batch close
  inf:set_states(tr:states()) hands a trainer's state over (same batch). See ?m3.pytorch.]]
local infer_methods = {
  step = "inf:step(tokens | {tokens =, resets =} | input, {out = true, logits = true}) -> out, logits\n  out [B,T,d_model]; logits [B,vocab] of the last position (\"lm\"); carries the state.\n  out / logits = false: not copied; = an f32 tensor of that shape: written into it (reuse a buffer)",
  reset = "inf:reset(rows?)  zero the state (all rows or 0-based rows)",
  states = "inf:states() -> {{angle =, ssm =, k =, v =}, ...}  the trainer's format",
  set_states = "inf:set_states(s)  e.g. inf:set_states(tr:states())",
  generate = "inf:generate(prompt [B,T] | {ids}, n, {temperature = 1, top_k = 0, top_p = 1, seed = 0,\n  stop = id | {ids}, pad = <stop token>, carry = false}) -> tokens int32 [B,n], lengths\n  temperature 0: greedy. Rows start from zero state (carry: from theirs); a row that draws a\n  stop token is done: later positions hold pad; lengths[r] counts its tokens up to the stop.\n  Row r draws from its own generator (seed, r): deterministic per seed.",
  info = "inf:info() -> {device, dtype, batch, max_len, graph, device_bytes, fused_decode}",
  device = "inf:device() -> \"cpu\" | \"cuda:N\"",
  dtype = "inf:dtype() -> \"f32\" | \"bf16\" | \"f16\"",
  batch = "inf:batch() -> rows the inference object was allocated for",
  close = "inf:close()  free memory now; later calls raise \"inference object is closed\"",
}
add_methods("infer", infer_methods)
T["infer.new"] = "m3.infer.new(weights | trainer | path, opts) -> inf  what m3.infer(...) does; see ?infer"
T["infer.load_weights"] = "m3.infer.load_weights(path) -> weights  what m3.infer(path) steps: a weights file's (w:save),\n"
  .. "  or a trainer checkpoint's float32 master weights (tr:save, m3.checkpoint; read on the CPU in f32,\n"
  .. "  its checksum verified, whatever device and dtype it was trained on)"

T["m3.sampling"] = [[
m3.sampling.new(rows, {temperature = 1, top_k = 0, top_p = 1, seed = 0}, what) -> s
s:draw(logits, vocab, out, nonfinite)  one token per row from float [rows, vocab] into int32 [rows]
  logits / out: an f32 / i32 tensor (or FFI array plus a shape) of rows x vocab / rows elements
  (checked), or an FFI pointer to float / int32_t (its size unchecked); nonfinite(row), if given,
  returns the message (a string) of the error for a row with a non-finite logit
  the engine's sampler (m3_sample): rows in parallel, row r with its own generator (seed, r);
  temperature 0 = greedy; top_k, then top_p over the renormalised rest. inf:generate uses it.]]
T["sampling.new"] = "m3.sampling.new(rows, {temperature = 1, top_k = 0, top_p = 1, seed = 0},\n"
  .. "  what = \"m3.sampling\") -> s  a sampler for rows rows (other option keys are errors); what begins its\n"
  .. "  messages; see ?m3.sampling"
T["sampling:draw"] = "s:draw(logits, vocab, out, nonfinite?)  draws one token id per row into out: logits an f32\n"
  .. "  tensor of rows x vocab elements, out an i32 tensor of rows (or FFI pointers to float / int32_t, their\n"
  .. "  size unchecked); each call advances the rows' generators; a non-finite logit is an error\n"
  .. "  (nonfinite(row), a function, returns its message)"

T["m3.pytorch"] = [[
m3.pytorch.export(weights, dir)  config.json + model.safetensors for the public PyTorch
  Mamba-3 LM (mamba_ssm MambaLMHeadModel, ssm_cfg.layer = "Mamba3"; "backbone." names)
m3.pytorch.import(dir) -> weights   (same bits as exported)
m3.pytorch.config_json(cfg), m3.pytorch.config_from_json(t, dir)  the config.json mapping
scripts: m3lua scripts/export_pytorch.lua <weights or checkpoint> <dir>,
         m3lua scripts/import_pytorch.lua <dir> <weights.safetensors>]]
T["pytorch.export"] = "m3.pytorch.export(weights, dir) -> dir, n_tensors  writes dir/config.json and\n"
  .. "  dir/model.safetensors (\"backbone.\" names, lm_head.weight even when tied); input \"tokens\" and head\n"
  .. "  \"lm\" only; a NaN or an infinity in the weights is refused before anything is written"
T["pytorch.import"] = "m3.pytorch.import(dir) -> weights  float32 (F16/BF16/F64 files are converted); the same\n"
  .. "  bits as exported; dir/config.json must describe a SISO Mamba-3 LM"
T["pytorch.config_json"] = "m3.pytorch.config_json(cfg) -> table  the public MambaConfig fields of an m3 config\n"
  .. "  (ssm_cfg.layer = \"Mamba3\", pad_vocab_size_multiple = 1)"
T["pytorch.config_from_json"] = "m3.pytorch.config_from_json(t, dir?) -> config  the m3 config of a decoded\n"
  .. "  config.json (the vocabulary padded as the public model does); dir only names the folder in errors"

T["m3.schedule"] = [[
m3.schedule — pure functions step -> lr (1-based: f(s) is the lr of the s-th step).
  constant(lr)  linear{from, to, steps}  linear_warmup{peak, warmup}
  cosine{peak, total, floor = 0}  warmup_cosine{peak, warmup, total, floor = 0}
  step_decay{lr, gamma = 0.1, every = | milestones =}
  wsd{peak, warmup, total, decay = 0.2, floor = 0, shape = "linear"|"cosine"|"sqrt"}
  sequence{{f1, steps = n1}, {f2, steps = n2}, {f3}}  scale(f, k)
  apply(tr, f, step) -> tr:set_lr(f(step))   values(f, n) -> {f(1), ..., f(n)}
Warmup reaches peak at s = warmup; a decay over total steps ends at floor at s = total + 1.
A step that is not an integer from 1 to 2^53 is an error.]]
T["schedule.constant"] = "schedule.constant(lr)  the same lr at every step"
T["schedule.linear"] = "schedule.linear{from =, to =, steps =}  a rise is a warmup (to at step steps;\n"
  .. "  from = 0 works), a fall a decay (from at step 1, to at step steps + 1); then to"
T["schedule.linear_warmup"] = "schedule.linear_warmup{peak =, warmup =}  peak * s / warmup, then peak"
T["schedule.cosine"] = "schedule.cosine{peak =, total =, floor = 0}\n  floor + (peak - floor) * (1 + cos(pi * (s - 1) / total)) / 2, floor after total"
T["schedule.warmup_cosine"] = "schedule.warmup_cosine{peak =, warmup =, total =, floor = 0}\n  linear warmup to peak at s = warmup, then a half cosine reaching floor at s = total + 1"
T["schedule.step_decay"] = "schedule.step_decay{lr =, gamma = 0.1, every = n | milestones = {m1, m2, ...}}\n  lr * gamma^k: k = floor((s - 1) / every), or the number of milestones <= s"
T["schedule.wsd"] = "schedule.wsd{peak =, warmup = 0, total =, decay = 0.2, floor = 0, shape = \"linear\"}\n  warmup, constant peak, then decay over the last `decay` steps (or fraction of total)"
T["schedule.sequence"] = "schedule.sequence{{f1, steps = n1}, {f2, steps = n2}, ..., {fk}}\n  pieces one after another; each sees its own 1-based step"
T["schedule.scale"] = "schedule.scale(f, k)  k * f(s)"
T["schedule.apply"] = "schedule.apply(tr, f, step)  tr:set_lr(f(step)); returns the lr (no graph recapture)"
T["schedule.values"] = "schedule.values(f, n) -> {f(1), ..., f(n)}  (plots, tests)"

T["m3.curriculum"] = [[
m3.curriculum — phases as data: {steps =, length =, min_length =, batch =, <task options>,
  weights = <mixture>}; a phase inherits unset fields; the last may omit steps.
  local cur = m3.curriculum.new{{steps = 500, length = 8}, {steps = 500, length = 16}, {length = 32}}
  cur:phase(step) -> phase (with index, first, last)   cur:max("length")   cur:total()   cur:phases()
  for step, phase in cur:iter(1, n) do ... end
  m3.curriculum.lengths{from = 8, to = 32, steps = 3000, factor = 2, min_length = 1}]]
T["curriculum.new"] = "curriculum.new{phase1, phase2, ...}  see ?m3.curriculum"
local curriculum_methods = {
  phase = "cur:phase(step) -> a copy of the phase of 1-based step (with index, first, last); past the end: the last",
  max = "cur:max(field) -> the largest number a phase sets for field (nil when none sets it)",
  total = "cur:total() -> the steps of all phases (math.huge when the last phase runs on)",
  phases = "cur:phases() -> {phase, ...}  copies of the phases",
  iter = "cur:iter(first, last)  for step, phase in cur:iter(1, n) do ... end  (both bounds required)",
}
add_methods("curriculum", curriculum_methods)
T["curriculum.lengths"] = "curriculum.lengths{from =, to =, steps =, factor = 2, <fields for every phase>}\n  lengths from, from*factor, ..., to in equal shares of steps"

T["m3.data"] = [[
m3.data — deterministic, resumable sources: src:next(rows, opts) -> {tokens =, targets =}
  src:cursor() -> {seed =, index =}; src:seek(cursor); src.vocab, src.classes   (?source)
  data.parity{length =, min_length =, targets = "running" | "final", seed =}
  data.arithmetic{length =, brackets = false, ops = "+-*", modulus = 5, targets = "final"}
  data.mqar{keys = 32, values = 32, pairs =, queries = | length = 24}
  every source also takes seed =, cursor =, pad_to = and offset = (added to every id)
  data.mixture({src1, src2}, {weights = {w1, w2}, seed =})
  data.text(path, {split = "train" | "val" | "all", order = "random" | "sequential" | "stream", length =})
  data.tokens(path, {dtype = "u16" | "u32" | "u8", vocab =, ...})   files are read a window at a time
  data.evaluate(ids, modulus, first, last)   data.scaled_accuracy(acc, classes)   data.rng]]
T["data.parity"] = "data.parity{length = 32, min_length = length, targets = \"running\", density = 0.5, seed = 0}\n"
  .. "  bits 0/1, each 1 with probability density (\"random\": drawn per sample); targets: the parity of each\n"
  .. "  prefix (running) or only at the end (final)"
T["data.arithmetic"] = "data.arithmetic{length = 32, min_length =, brackets = false, ops = \"+-*\", modulus = 5,\n"
  .. "  targets = \"final\"}  an expression of length - 1 tokens, then '='; target: its value mod modulus\n"
  .. "  (vocab modulus + 6, at most 2^24); brackets: a boolean (true: \"final\" targets only)"
T["data.mqar"] = "data.mqar{keys = 32, values = 32, pairs =, queries = | length = 24}\n"
  .. "  key-value pairs, then queried keys; target at each query: its value"
T["data.text"] = "data.text(path, {split = \"train\" | \"val\" | \"all\", val_fraction = 0.1, order = \"random\",\n"
  .. "  length = 256, seed = 0, rows =, cursor =})  byte-level windows (vocab 256); targets are the next bytes.\n"
  .. "  order \"stream\": each of `rows` rows (default: the first next's count; another count is an error)\n"
  .. "  continues its own stretch of text. The file is read a window at a time (pread, no mapping); a file\n"
  .. "  cut short under the source is an error naming it (replace a file by renaming a new one over it)"
T["data.tokens"] = "data.tokens(path, {dtype = \"u16\" | \"u32\" | \"u8\", vocab =, split =, val_fraction =,\n"
  .. "  order =, length =, seed =, rows =, cursor =})  raw little-endian token ids (no header), read a window\n"
  .. "  at a time; vocab (an integer >= 1) is required for u16 and u32 (u8: 256); ids >= vocab are refused by the\n"
  .. "  trainer's step; a u32 id past 2^31 - 1 is an error when read. The rest as for data.text"
T["data.evaluate"] = "data.evaluate(ids, modulus = 5, first = 1, last = #ids) -> value | nil, message\n"
  .. "  the exact value mod modulus of the expression ids[first..last], a Lua list of arithmetic token ids\n"
  .. "  (not a tensor); stop last before the '=' of a data.arithmetic row"
T["data.scaled_accuracy"] = "data.scaled_accuracy(acc, classes) -> (acc - 1/classes) / (1 - 1/classes)\n"
  .. "  0 for a uniform guess, 1 when every answer is right; a constant answer scores more where the answers\n"
  .. "  are uneven (arithmetic with brackets: always 0 scores 12.5 %)"
T["data.mixture"] = "data.mixture({src1, src2, ...}, {weights =, seed =})  each row from a source drawn by weight\n"
  .. "  (weights: one finite number >= 0 per source, not all 0; default equal); no order = \"stream\" file sources"

T["source"] = [[
a data source (data.parity{...}, data.arithmetic, data.mqar, data.mixture, data.text, data.tokens):
  deterministic given its seed; a cursor (plain numbers) resumes it. src.vocab, src.classes
methods: next cursor seek sample (every source), slice count offset (data.text, data.tokens)
  see ?m3.data]]
local source_methods = {
  next = "src:next(rows, opts) -> {tokens =, targets =}  int32 [rows, T]: the rows samples after the cursor,\n"
    .. "  which moves past them; opts: this call's options over the source's (length =, pad_to =, ...;\n"
    .. "  a mixture's also weights =); options that need more ids than src.vocab are an error.\n"
    .. "  A batch holds at most 2^31 - 1 positions (rows * longest sample or pad_to), a sample at most 2^27 ids.\n"
    .. "  Shorter samples are padded: token 0, target -1",
  cursor = "src:cursor() -> {seed =, index =}  the seed and the samples drawn so far (an order = \"stream\"\n"
    .. "  file source's also rows =, position =); plain numbers, for a checkpoint's extra or JSON",
  seek = "src:seek(cursor)  continue from a cursor of src:cursor(): the next batches are the ones that followed it",
  sample = "src:sample(index, opts) -> tokens, targets  sample `index` as Lua lists; the cursor stays\n"
    .. "  (not for an order = \"stream\" file source)",
  slice = "src:slice(first, count) -> {ids}  data.text, data.tokens: the ids [first, first + count) of the whole\n"
    .. "  file (0-based) as a Lua list; ids past its end are an error",
  count = "src:count(L = length) -> the number of non-overlapping windows of length L in the split\n"
    .. "  (data.text, data.tokens: what order = \"sequential\" goes through before it wraps around)",
  offset = "src:offset(index, L) -> the file position (0-based) of window `index` of length L\n"
    .. "  (data.text, data.tokens of order \"random\" or \"sequential\")",
}
add_methods("source", source_methods)

T["data.rng"] = [[
m3.data.rng — the generator behind the sources and sweeps: xoshiro128** in pure Lua, the same
  draws on every machine; its state is four integers that serialize exactly.
  rng.new(seed, index, stream) -> r   rng.from_state(s) -> r
methods: u32 uniform below state]]
T["data.rng.new"] = "m3.data.rng.new(seed = 0, index = 0, stream = nil) -> r  sample `index`'s own generator\n"
  .. "  (seed, index: integers in [0, 2^53)); stream (an integer in [0, 2^32)) gives independent draws\n"
  .. "  for the same sample; nil, what the sources draw from, is a stream of its own (not 0)"
T["data.rng.from_state"] = "m3.data.rng.from_state({a, b, c, d}) -> r  the generator whose r:state() that was"
local rng_methods = {
  u32 = "r:u32() -> an integer in [0, 2^32)",
  uniform = "r:uniform() -> a number in [0, 1) with 53 random bits",
  below = "r:below(n) -> an integer in [0, n)",
  state = "r:state() -> {a, b, c, d}  plain integers; m3.data.rng.from_state makes the generator again",
}
add_methods("rng", rng_methods)

T["m3.accumulate"] = [[
m3.accumulate.step(tr, {b1, ..., bk}, {clip =}) -> metrics
  k micro-batches with backward_step{accumulate = true}, the window closed (and clipped) on
  bk; each loss scaled by its share of the counted targets: the big batch's update.
m3.accumulate.split(batch, k) -> k row views;  m3.accumulate.counted(tr, batch)]]
T["accumulate.step"] = "accumulate.step(tr, {b1, ..., bk}, {clip =}) -> metrics  one optimizer step over k\n"
  .. "  micro-batches, the same update as one big batch; metrics: the big batch's loss, accuracy, micro = k"
T["accumulate.split"] = "accumulate.split(batch, k) -> {b1, ..., bk}  k batches of consecutive rows (views, no\n"
  .. "  copies); k must divide the batch's rows"
T["accumulate.counted"] = "accumulate.counted(tr, batch) -> c  the positions the loss counts: targets other than -1\n"
  .. "  (\"lm\"), masked-in positions (\"mse\" with a mask), else rows x length"

T["m3.checkpoint"] = [[
m3.checkpoint.new{dir =, every = 0, keep = 3}
  ck:maybe_save(tr, step, extra)  ck:save(tr, step, extra)  ck:list()  ck:resume(opts)  ck:path(step)
  ck:save_interrupted(tr, step, extra)
  m3.checkpoint.resume(dir, opts) -> tr, extra, step  (the newest checkpoint that loads)
  keep = k: a save leaves the file it wrote and the k - 1 highest-step others (0: all)
  a step is an integer in [0, 10^15); another value is an error that names it
Files dir/step-00000100.ckpt, written atomically; extra: data cursor, schedule position,
curriculum phase, RNG states. m3.fit saves one on Ctrl-C / SIGTERM and on any error after a step.]]
T["checkpoint.new"] = "checkpoint.new{dir =, every = 0, keep = 3} -> ck  every: maybe_save's period\n"
  .. "  (0: only explicit saves); keep: the checkpoints a save leaves (0: all); see ?m3.checkpoint"
T["checkpoint.resume"] = "checkpoint.resume(dir, opts) -> tr, extra, step  the newest checkpoint in dir that loads\n"
  .. "  (a damaged one is reported on stderr and skipped); nil when there is none; opts: m3.trainer.load's"
local checkpoint_methods = {
  save = "ck:save(tr, step, extra) -> path  dir/step-<step>.ckpt (tr:save plus {step, extra}), written atomically;\n"
    .. "  then with keep = k > 0 only it and the k - 1 highest-step others remain",
  maybe_save = "ck:maybe_save(tr, step, extra) -> path | nil  ck:save when every > 0 and step is a multiple of it",
  list = "ck:list() -> {{step =, path =}, ...}  the checkpoints in dir, oldest first",
  resume = "ck:resume(opts) -> tr, extra, step  as m3.checkpoint.resume(ck.dir, opts)",
  path = "ck:path(step) -> \"dir/step-00000100.ckpt\"  the file of a step",
  save_interrupted = "ck:save_interrupted(tr, step, extra) -> path | nil, why  after an error that stops a run:\n"
    .. "  clears the engine's interrupt flag and saves (not inside an accumulation window)",
}
add_methods("checkpoint", checkpoint_methods)
T["checkpoint.is_interrupt"] = "checkpoint.is_interrupt(err) -> true when err is an interrupt (Ctrl-C / SIGTERM)"

T["m3.fit"] = [[
m3.fit.run{trainer =, data =, steps =, schedule =, curriculum =, batch =, clip =, data_opts =,
  checkpoint =, start =, dir =, eval = function(tr, step) ... end, eval_every =, extra =,
  graph = false, max_nonfinite = 10, progress = true, out =, print_every =, title =}
  -> {step =, loss =, tokens =, eval =, elapsed =}
  the training loop: lr per step, curriculum phase -> data options, accumulation when a
  step has more rows than the trainer's batch, metrics.jsonl + progress + plot.svg in dir,
  checkpoints every N steps and at the end; a step with a non-finite gradient taken again on the
  next rows (more than max_nonfinite in a row: the last good step saved, an error). An interrupt
  (Ctrl-C / SIGTERM) or any other error after a step of the run saves the last step taken; the
  error's message gets a last line naming the checkpoint. Bit-identical resume:
  local tr, start = m3.fit.resume(ck, opts)
m3.fit.evaluate(tr, src, {batches = 4, rows =, length =}) -> {loss =, accuracy =}]]
T["fit.run"] = "fit.run{trainer =, data =, steps =, ...} -> result  the training loop; on any error after a step\n"
  .. "  the last step taken is saved (the message's last line names the checkpoint); see ?m3.fit"
T["fit.check_rows"] = "fit.check_rows{trainer =, batch =, curriculum =, data_opts =}  raises what fit.run would for\n"
  .. "  rows a step the trainer cannot take (accumulation with carry_state or in f16) and for a phase's length or\n"
  .. "  pad_to past its seq_len, before anything is written"
T["fit.resume"] = "fit.resume(ck, opts) -> tr, start  from ck's newest checkpoint that loads (start for fit.run); nil\n"
  .. "  without one, an error when none of them loads (fit.run without start refuses a folder that holds some)"
T["fit.evaluate"] = "fit.evaluate(tr, src, {batches = 4, rows =, ...data options}) -> {loss =, accuracy =}\n"
  .. "  over the first batches of src (the same set every time; each window from a zero state when the\n"
  .. "  trainer carries its state)"

T["m3.log"] = [[
m3.log.progress{total =, every =, out =}  p:update(step, {loss =, lr =, tokens =})
  p:message(text)  p:finish()   a bar on a terminal, plain lines otherwise
m3.log.jsonl(path) -> w:write(record), w:close();  m3.log.read_jsonl(path) -> records, skipped
m3.log.plot(records, path), m3.log.plot_run(dir)  SVG loss / accuracy curves
m3.log.svg.lines{...}, .bars{...}, .document(charts), .write(path, charts), .nice_ticks(lo, hi, n)
m3.log.now(), m3.log.duration(s), m3.log.is_terminal(out), m3.log.plural(n, noun) -> "3 points"]]
T["log.progress"] = "m3.log.progress{total =, every = total/20, first = 0, out = io.stdout, width = 24, tty =,\n"
  .. "  interval = 30} -> p  p:update(step, {loss =, lr =, tokens =}), p:message(text), p:finish() -> seconds.\n"
  .. "  On a terminal a bar redrawn at most every 0.1 s, else a line every `every` steps and at least every\n"
  .. "  `interval` seconds (math.huge: only by steps); first: the step a resumed run starts after"
T["log.jsonl"] = "m3.log.jsonl(path, {truncate = false}) -> w  w:write(record) appends one JSON line and flushes;\n"
  .. "  w:close(). Appending after a line cut short by a crash first ends that line"
T["log.read_jsonl"] = "m3.log.read_jsonl(path) -> records, skipped  the JSON objects of a JSONL file; skipped: the\n"
  .. "  numbers of the lines that hold none (a line cut short by a crash), which are left out"
T["log.plot"] = "m3.log.plot(records, path, {x = \"step\", title =}) -> path  an SVG: keys with \"loss\" (not\n"
  .. "  loss_scale; log scale when they span > 20x), and a panel of keys with \"acc\""
T["log.plot_run"] = "m3.log.plot_run(dir, {x =, title = <dir's name>}) -> path  dir/metrics.jsonl -> dir/plot.svg"
T["log.now"] = "m3.log.now() -> seconds on a monotonic clock (differences are durations)"
T["log.duration"] = "m3.log.duration(seconds) -> \"42s\" | \"3m05s\" | \"2h07m\" (\"?\" when not finite)"
T["log.is_terminal"] = "m3.log.is_terminal(out) -> true when out is io.stdout or io.stderr on a terminal"
T["log.plural"] = "m3.log.plural(n, noun, nouns = noun .. \"s\") -> \"1 point\" | \"3 points\"  (the plural unless n is 1)"
T["log.svg"] = [[
m3.log.svg — standalone SVG charts: lines{...}, bars{...} -> a chart; document(charts) -> text;
  write(path, charts); nice_ticks(lo, hi, n)]]
T["log.svg.lines"] = "m3.log.svg.lines{title =, xlabel =, ylabel =, logy =, series = {{name =, x = {...}, y = {...},\n"
  .. "  color =}, ...}} -> chart  lines (more than 1500 points averaged in buckets; non-finite points break a line)"
T["log.svg.bars"] = "m3.log.svg.bars{title =, xlabel =, labels = {...}, values = {...}} -> chart  horizontal bars"
T["log.svg.document"] = "m3.log.svg.document(charts) -> SVG text with the charts stacked vertically"
T["log.svg.write"] = "m3.log.svg.write(path, charts)  writes the document atomically (the folder must exist)"
T["log.svg.nice_ticks"] = "m3.log.svg.nice_ticks(lo, hi, n = 5) -> ticks, axis_lo, axis_hi\n"
  .. "  about n (at most 100) ticks at 1, 2 or 5 times a power of ten covering [lo, hi]"

T["m3.sweep"] = [[
m3.sweep{grid = {lr = {1e-3, 3e-3}, d_model = {32, 64}} | random = {lr = {"log", 1e-4, 1e-2}},
  trials =, seed = 0, defaults = {...}, dir =, run = function(point, run_dir) return metrics end,
  metric = <loss, else the first by name>, mode = <"min" for a name with "loss", else "max">,
  parallel = N, gpus = {...}, command =} -> rows   (m3.sweep.run(opts) alike)
  swept keys are text other than "run" (the results' first column); random specs: a list of choices,
  {"log", lo, hi}, {"uniform", lo, hi}, {"int", lo, hi}.
  one folder per point named after the options that differ from defaults (exact names:
  "a/b" -> "a%2Fb", {0.9, 0.99} -> "[0.9,0.99]"; points that would share one are an error); done.json marks finished
  points with all their settings (skipped on re-run; one run with other settings, a changed default,
  is an error before anything runs); results.csv (RFC 4180), results.json, summary.svg, their numbers
  exact (they read back as the same numbers). Rows rank by metric (NaN and missing last). Points that
  failed are retried on the next run; once the others are done the sweep raises, naming them. An
  interrupt stops parallel children before the sweep ends.]]
T["sweep.run"] = "m3.sweep.run{grid = | random =, dir =, run =, ...} -> rows  what m3.sweep{...} does; see ?m3.sweep"
T["sweep.name"] = "m3.sweep.name(point, defaults?, keys?) -> the point's folder name: \"key=value\" for the keys\n"
  .. "  (default: all, sorted) whose value differs from defaults, joined by \",\"; \"defaults\" when none differs"
T["sweep.format_value"] = "m3.sweep.format_value(v, key?) -> v as a folder name writes it: numbers exactly,\n"
  .. "  lists \"[a,b]\", text with %XX for % / , = \\ [ ] blanks and control characters; other values are an\n"
  .. "  error naming key"

-- ---- lookup ------------------------------------------------------------------------------

local names
local function all_names()
  if not names then
    names = {}
    for k in pairs(T) do names[#names + 1] = k end
    table.sort(names)
  end
  return names
end

function help.topics()
  local out = {}
  for i, n in ipairs(all_names()) do out[i] = n end
  return out
end

function help.complete(prefix)
  local out = {}
  for _, n in ipairs(all_names()) do
    if n:sub(1, #prefix) == prefix then out[#out + 1] = n end
  end
  return out
end

-- The usual variable names of objects: "?tr:step", "?inf:generate", "?w:get", "?src:next", "?r:u32", "?t:shape",
-- "?ck:save", "?cur:phase", "?s:draw".
local OBJECT_NAMES = { tr = "trainer", inf = "infer", w = "weights", src = "source", r = "rng", t = "tensor",
  ck = "checkpoint", cur = "curriculum", s = "sampling" }

-- The topic a user's spelling means, or nil and the topics it could mean (a short name several end in).
local function resolve(q)
  q = q:gsub("^%s*%?*%s*", ""):gsub("%s+$", ""):gsub("%(%)$", "")
  if T[q] then return q end
  local bare = q:gsub("^m3%.", "")
  if T[bare] then return bare end
  if T["m3." .. bare] then return "m3." .. bare end
  local mod, fn = bare:match("^([%w_.]+)[.:]([%w_]+)$")
  local tail -- a pattern for the end of a topic's name that the spelling means
  if mod then
    mod = OBJECT_NAMES[mod] or mod
    for _, t in ipairs { mod .. ":" .. fn, mod .. "." .. fn } do
      if T[t] then return t end
    end
    tail = mod:gsub("%p", "%%%0") .. "[.:]" .. fn
  else
    if T["trainer:" .. bare] then return "trainer:" .. bare end
    tail = bare:gsub("%p", "%%%0")
  end
  local found = {}
  for _, n in ipairs(all_names()) do
    if n:match("[.:]" .. tail .. "$") then found[#found + 1] = n end
  end
  if #found == 1 then return found[1] end
  return nil, found
end

local function suggestions(q)
  local out = {}
  local key = q:gsub("^%s*%?*%s*", ""):gsub("^m3%.", ""):lower()
  for _, n in ipairs(all_names()) do
    if key ~= "" and n:lower():find(key, 1, true) then out[#out + 1] = n end
  end
  return out
end

-- The topic for a value: an m3 function by its name, a trainer, infer, weights, tensor, ... object, a module table.
local function topic_of_value(v)
  if package.loaded.m3 == v then return "m3" end
  for modname, mod in pairs(package.loaded) do
    if type(mod) == "table" and (modname == "m3" or modname:match("^m3%.")) then
      local short = modname:gsub("^m3%.?", "")
      if mod == v and (T[modname] or T[short]) then return T[modname] and modname or short end
      for k, f in pairs(mod) do
        if f == v and type(v) == "function" then
          local t = short == "" and "m3." .. k or short .. "." .. k
          if T[t] then return t end
        end
      end
    end
  end
  local mt = type(v) == "table" and getmetatable(v)
  if mt and type(v.step) == "function" and type(v.backward_step) == "function" then return "trainer" end
  if mt and type(v.step) == "function" and type(v.generate) == "function" then return "infer" end
  if mt and type(v.get) == "function" and type(v.names) == "function" then return "weights" end
  if mt and type(v.next) == "function" and type(v.cursor) == "function" then return "source" end
  if mt and type(v.u32) == "function" and type(v.state) == "function" then return "data.rng" end
  if mt and type(v.maybe_save) == "function" and type(v.list) == "function" then return "m3.checkpoint" end
  if mt and type(v.phase) == "function" and type(v.iter) == "function" then return "m3.curriculum" end
  if mt and type(v.draw) == "function" then return "m3.sampling" end
  local tensor = package.loaded["m3.tensor"]
  if type(v) == "cdata" and tensor and tensor.is(v) then return "tensor" end
end

-- The value a dotted global name refers to (`tr`, `m3.schedule.cosine`), or nil.
local function global_value(q)
  local v = _G
  for part in q:gsub("^%s*%?*%s*", ""):gmatch("[^.:]+") do
    if type(v) ~= "table" then return nil end
    v = v[part]
  end
  if v ~= _G then return v end
end

-- The text of topic (a spelling or a value), or nil and suggestions: the topics an ambiguous
-- short name could mean, else the topics whose names hold the spelling.
function help.text(topic)
  local t, candidates
  if type(topic) == "string" then
    t, candidates = resolve(topic)
    if not t then
      local ok, v = pcall(global_value, topic)
      if ok and v ~= nil then t = topic_of_value(v) end
    end
  else
    t = topic_of_value(topic)
  end
  if t then return T[t] end
  if candidates and #candidates > 1 then return nil, candidates end
  return nil, type(topic) == "string" and suggestions(topic) or {}
end

function help.show(topic)
  local text, near = help.text(topic == nil and "m3" or topic)
  if text then
    print(text)
  elseif #near > 0 then
    print("no help for " .. tostring(topic) .. "; try: " .. table.concat(near, ", "))
  else
    print("no help for " .. tostring(topic) .. "; topics: ?m3, ?trainer, ?m3.schedule, ?m3.data, ...")
  end
end

return help

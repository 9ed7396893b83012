-- m3.trainer — the training loop's handle (API.md "Trainer") over m3_trainer_*.
--
-- A trainer is a Lua table holding a box (an ffi.new struct whose __gc destroys the C
-- trainer), its private copy of the validated model config, _cfg (every buffer is sized from
-- it), `config` (another copy, the user's: changing it changes nothing the trainer does) and
-- reusable m3_batch / m3_metrics structs. Batches are Lua tables of tensors: each field is
-- checked here (name, dtype, shape [B, T(, D)] with B <= batch and T <= seq_len taken from
-- the first field given; for backward_step the pending forward's B and T) so errors name the
-- field and what was expected; token id and target ranges are checked by the engine. Float
-- fields also accept f64 tensors (converted to a f32 copy), and any field accepts a nested
-- Lua table, a `{data = <FFI array>, shape = {...}}` table, or a raw FFI array of exactly the
-- expected size; a pointer, whose size the FFI cannot tell, is refused. The tensors of a
-- batch stay referenced from the trainer until the engine call returns.

local ffi = require "ffi"
local lib = require "m3.lib"
local tensor = require "m3.tensor"
local config = require "m3.config"
local weights = require "m3.weights"
local serialize = require "m3.serialize"
local fs = require "m3.fs"
local options = require "m3.options"
local states = require "m3.states"

lib.internal_file(debug.getinfo(1, "S").source)

local C, check, raise = lib.C, lib.check, lib.raise

local Box = lib.box("m3_trainer", C.m3_trainer_destroy)

local DEVICE_CPU = options.DEVICE_CPU
local PRECISION_NAME = options.PRECISION_NAME
local show, want_int = options.show, options.want_int
local want_number, want_bool = options.want_number, options.want_bool
local parse_device, parse_dtype = options.parse_device, options.parse_dtype

local T = {}
T.__index = T

-- ---- construction -------------------------------------------------------------------------------

local OPTS = { device = true, dtype = true, batch = true, seq_len = true, lr = true, weight_decay = true,
               betas = true, eps = true, no_decay = true, carry_state = true, seed = true, clip = true,
               allow_tf32 = true }

local function fill_cfg(opts)
  local what = "m3.trainer"
  local c = ffi.new("m3_trainer_cfg")
  C.m3_trainer_cfg_defaults(c)
  if opts.device ~= nil then
    local kind, index = parse_device(opts.device, what)
    c.device, c.device_index = kind, index or 0
  end
  if opts.dtype ~= nil then c.precision = parse_dtype(opts.dtype, what) end
  if opts.batch ~= nil then c.batch = want_int(opts.batch, "m3.trainer: batch", 1) end
  if opts.seq_len ~= nil then c.seq_len = want_int(opts.seq_len, "m3.trainer: seq_len", 1) end
  if opts.lr ~= nil then c.lr = want_number(opts.lr, "m3.trainer: lr") end
  if opts.weight_decay ~= nil then c.weight_decay = want_number(opts.weight_decay, "m3.trainer: weight_decay") end
  if opts.betas ~= nil then
    local b = opts.betas
    if type(b) ~= "table" or #b ~= 2 or type(b[1]) ~= "number" or type(b[2]) ~= "number" then
      raise("m3.trainer: betas = " .. show(b) .. ": expected a table of two numbers {beta1, beta2}")
    end
    c.beta1, c.beta2 = b[1], b[2]
  end
  if opts.eps ~= nil then c.eps = want_number(opts.eps, "m3.trainer: eps") end
  if opts.no_decay ~= nil then
    if opts.no_decay ~= "reference" and opts.no_decay ~= "none" then
      raise("m3.trainer: no_decay = " .. show(opts.no_decay) .. ": expected \"reference\" or \"none\"")
    end
    c.no_decay = opts.no_decay == "reference" and 1 or 0
  end
  if opts.carry_state ~= nil then c.carry_state = want_bool(opts.carry_state, "m3.trainer: carry_state") and 1 or 0 end
  if opts.seed ~= nil then c.seed = options.check_seed(opts.seed, "m3.trainer") end
  if opts.clip ~= nil then c.clip = want_number(opts.clip, "m3.trainer: clip") end
  if opts.allow_tf32 ~= nil then c.allow_tf32 = want_bool(opts.allow_tf32, "m3.trainer: allow_tf32") and 1 or 0 end
  return c
end

-- The batch fields of a model: struct field, element dtype, trailing dim (nil: [B, T]).
local function batch_spec(cfg)
  local s = {}
  if cfg.input == "tokens" then
    s.tokens = { field = "tokens", dtype = "i32" }
  else
    s.input = { field = "input", dtype = "f32", dim = cfg.input == "features" and cfg.input_dim or cfg.d_model }
  end
  if cfg.head == "lm" then
    s.targets = { field = "targets", dtype = "i32" }
  elseif cfg.head == "mse" then
    s.targets = { field = "target_values", dtype = "f32", dim = cfg.out_dim }
    s.mask = { field = "mask", dtype = "u8" }
  else
    s.d_out = { field = "d_out", dtype = "f32", dim = cfg.d_model }
  end
  s.resets = { field = "resets", dtype = "u8" }
  return s
end

local function wrap_trainer(p)
  local box = Box()
  box.p = p
  local info = ffi.new("m3_trainer_info")
  C.m3_trainer_get_info(p, info)
  local cfg = config.from_c(C.m3_trainer_config(p))
  return setmetatable({
    _box = box,
    _cfg = cfg,
    config = config.copy(cfg),
    _spec = batch_spec(cfg),
    _batch = ffi.new("m3_batch"),
    _metrics = ffi.new("m3_metrics"),
    _keep = {},
    _info = info,
    _B = tonumber(info.batch),
    _T = tonumber(info.seq_len),
    _precision = PRECISION_NAME[info.precision],
    _device = info.device == DEVICE_CPU and "cpu" or "cuda:" .. tonumber(info.device_index),
  }, T)
end

-- m3.trainer(weights_or_config, opts)
local function new(w_or_cfg, opts)
  opts = options.opts_table(opts, OPTS, "m3.trainer")
  local c = fill_cfg(opts)
  local w, own
  if weights.is(w_or_cfg) then
    w = w_or_cfg
  elseif type(w_or_cfg) == "table" then
    w, own = weights.init(w_or_cfg, { seed = opts.seed }), true
  else
    raise("m3.trainer: expected weights (m3.weights) or a config table, got " .. type(w_or_cfg))
  end
  c.weights = weights.ptr(w)
  local out = ffi.new("m3_trainer *[1]")
  local st = C.m3_trainer_create(c, out)
  if own then w:close() end
  check(st)
  return wrap_trainer(out[0])
end

-- Raises unless self is a trainer (a method called with '.' gets its first argument instead).
local ITSELF = { [T] = true }
local function check_self(self)
  options.check_self(self, ITSELF, "m3.trainer", "a trainer")
end

local function live(self)
  check_self(self)
  local p = self._box.p
  if p == nil then raise("trainer is closed") end
  return p
end

-- ---- batches -----------------------------------------------------------------------------------

local ORDER = { "input", "tokens", "targets", "d_out", "resets", "mask" }
local LONG, describe = options.LONG, options.describe

local function expected(spec, B, T_)
  local dims = { B or "B", T_ or "T" }
  if spec.dim then dims[3] = spec.dim end
  return LONG[spec.dtype] .. " [" .. table.concat(dims, ", ") .. "]"
end

local function model_help(self, name)
  local cfg = self._cfg
  if name == "tokens" or name == "input" then
    return string.format("this model's input is %q: use batch.%s", cfg.input, cfg.input == "tokens" and "tokens" or "input")
  end
  if name == "mask" then return "mask applies to head \"mse\"" end
  return string.format("this model's head is %q: use batch.%s", cfg.head, cfg.head == "none" and "d_out" or "targets")
end

local function release(self)
  local keep = self._keep
  for k in pairs(keep) do keep[k] = nil end
end

local function unknown_field(self, k)
  for _, n in ipairs(ORDER) do
    if n == k then raise(string.format("batch.%s: not used by this model (%s)", k, model_help(self, k))) end
  end
  local valid = {}
  for _, n in ipairs(ORDER) do
    if self._spec[n] then valid[#valid + 1] = n end
  end
  raise(string.format("batch.%s: unknown field%s; valid fields: %s", tostring(k),
    type(k) == "string" and config.suggest(k, valid) or "", table.concat(valid, ", ")))
end

-- Fills self._batch from a Lua batch: need_input / need_target say which field groups the
-- call requires; window = {rows, len} (backward_step's pending forward) is the B and T every
-- field must have, else they come from the first field with a shape (raw FFI arrays alone: the
-- trainer's batch and seq_len). The resolved tensors wait in self._keep until release().
local function make_batch(self, b, need_input, need_target, window)
  if type(b) ~= "table" then raise("batch: expected a table of tensors, got " .. describe(b)) end
  release(self)
  local spec, keep = self._spec, self._keep
  for k in pairs(b) do
    if not spec[k] then unknown_field(self, k) end
  end
  local input_name = spec.tokens and "tokens" or "input"
  local target_name = spec.d_out and "d_out" or "targets"
  if need_input and b[input_name] == nil then
    raise(string.format("batch.%s: missing (%s)", input_name, expected(spec[input_name])))
  end
  if need_target and b[target_name] == nil then
    raise(string.format("batch.%s: missing (%s)", target_name, expected(spec[target_name])))
  end
  -- tensors (false: a raw FFI array, sized below); B and T from the window or the first with a shape
  local B, T_
  if window then B, T_ = window[1], window[2] end
  for i = 1, #ORDER do
    local name = ORDER[i]
    local v = b[name]
    if v ~= nil then
      local sp, t = spec[name], v
      if not tensor.is(v) then t = tensor.coerce(v, "batch." .. name, sp.dtype, nil, expected(sp)) or false end
      keep[name] = t
      if t and not B then
        local rows, len = t.dims_[0], t.dims_[1]
        if t.ndim_ ~= (sp.dim and 3 or 2) or rows < 1 or rows > self._B or len < 1 or len > self._T then
          raise(string.format("batch.%s: expected %s with B <= %d and T <= %d, got %s", name,
            expected(sp), self._B, self._T, describe(t)))
        end
        B, T_ = rows, len
      end
    end
  end
  B, T_ = B or self._B, T_ or self._T
  local cb = self._batch
  ffi.fill(cb, ffi.sizeof(cb))
  cb.rows, cb.len = B, T_
  for i = 1, #ORDER do
    local name = ORDER[i]
    local t = keep[name]
    if t ~= nil then
      local sp = spec[name]
      if t == false then -- raw FFI array: exactly the expected size
        t = tensor.coerce(b[name], "batch." .. name, sp.dtype, sp.dim and { B, T_, sp.dim } or { B, T_ },
          string.format("%s (%d values)", expected(sp, B, T_), B * T_ * (sp.dim or 1)))
      end
      local dtype = t:dtype()
      local ok = t.ndim_ == (sp.dim and 3 or 2) and t.dims_[0] == B and t.dims_[1] == T_
        and (not sp.dim or t.dims_[2] == sp.dim)
      if ok and dtype == "f64" and sp.dtype == "f32" then
        t, dtype = tensor.cast(t, "f32", "batch." .. name), "f32"
      end
      if not ok or dtype ~= sp.dtype then
        raise(string.format("batch.%s: expected %s, got %s", name, expected(sp, B, T_), describe(t)))
      end
      keep[name] = t
      cb[sp.field] = t.data
    end
  end
  return cb
end

-- Calls the engine and raises its status after letting the batch's tensors go. fn gets the
-- trainer's pointer, read here: building the batch can run the caller's code (a metamethod of a
-- batch table), which may have closed the trainer since the method began.
local function call(self, fn, ...)
  local p = self._box.p
  if p == nil then
    release(self)
    raise("trainer is closed")
  end
  local st = fn(p, ...)
  release(self)
  check(st)
end

local function metrics(self, m)
  local r = {
    step = tonumber(m.step),
    graph_replayed = m.graph_replayed ~= 0,
    optimizer_stepped = m.optimizer_stepped ~= 0,
    tokens = tonumber(m.tokens),
    ms = m.ms,
  }
  if self._cfg.head ~= "none" then r.counted = tonumber(m.counted) end
  if m.has_loss ~= 0 then r.loss = m.loss end -- none where nothing counted: a mean over no positions
  if m.has_accuracy ~= 0 then r.accuracy = m.accuracy end
  if m.has_grad_norm ~= 0 then r.grad_norm = m.grad_norm end
  if self._precision == "f16" then
    r.loss_scale, r.overflow_skipped = m.loss_scale, m.overflow_skipped ~= 0
  end
  return r
end

-- The metrics the engine wrote on the last step, backward_step or evaluate call. The host's
-- interrupt hook can raise right after a call took effect, before its metrics were returned:
-- m3.accumulate and m3.fit read them back here (binding-internal, not a user method).
function T:_last_metrics()
  return metrics(self, self._metrics)
end

-- ---- training calls ----------------------------------------------------------------------------

function T:step(batch)
  live(self)
  local b = make_batch(self, batch, true, true)
  local m = self._metrics
  call(self, C.m3_trainer_step, b, m)
  return metrics(self, m)
end

-- Checks a window as step would, running nothing; returns the positions its loss counts.
function T:check_batch(batch)
  live(self)
  local b = make_batch(self, batch, true, true)
  local counted = ffi.new("int64_t[1]")
  call(self, C.m3_trainer_check_batch, b, counted)
  return tonumber(counted[0])
end

-- Split API: the forward of a window; returns out [B, T, d_model] and marks a backward
-- pending. The window's shape is kept: a bare d_out given to backward_step takes it.
function T:forward(batch)
  live(self)
  local b = make_batch(self, batch, true, false)
  local out = tensor({ b.rows, b.len, self._cfg.d_model })
  local window = { b.rows, b.len }
  call(self, C.m3_trainer_forward, b, out.data)
  self._window = window
  return out
end

local BACKWARD_OPTS = { clip = true, accumulate = true, scale = true }

-- The scales float32 holds as normal numbers: a smaller one becomes a subnormal or 0 there (the
-- micro-batch would add nothing), a larger one infinity.
local SCALE_MIN, SCALE_MAX = 2 ^ -126, (2 - 2 ^ -23) * 2 ^ 127

local function is_tensor_like(x)
  return tensor.is(x) or type(x) == "cdata" or (type(x) == "table" and type(x.data) == "cdata")
end

-- Split API: backward of the pending forward, then the update unless accumulate is set.
function T:backward_step(batch_or_d_out, opts)
  live(self)
  opts = options.opts_table(opts, BACKWARD_OPTS, "backward_step")
  local o = ffi.new("m3_backward_opts", -1, 0, 1)
  if opts.clip ~= nil then
    o.clip = want_number(opts.clip, "backward_step: clip")
    if not (opts.clip >= 0) then -- the C API's clip < 0 stands for "the trainer's clip": leave clip out for that
      raise("backward_step: clip = " .. show(opts.clip) .. ": expected a number >= 0 (0 = off; leave it out for the "
            .. "trainer's clip)")
    end
  end
  if opts.accumulate ~= nil then o.accumulate = want_bool(opts.accumulate, "backward_step: accumulate") and 1 or 0 end
  if opts.scale ~= nil then
    local scale = opts.scale
    if type(scale) ~= "number" or not (scale >= SCALE_MIN and scale <= SCALE_MAX) then
      raise("backward_step: scale = " .. show(scale) .. ": expected a finite number > 0 that float32 holds as a "
        .. "normal number (2^-126 to about 3.4e38)")
    end
    o.scale = scale
  end
  local batch = batch_or_d_out
  if is_tensor_like(batch) then batch = { d_out = batch } end
  C.m3_trainer_get_info(live(self), self._info) -- (the options' metamethods may have closed it)
  local b = make_batch(self, batch, false, true, self._info.pending_forward ~= 0 and self._window or nil)
  local m = self._metrics
  call(self, C.m3_trainer_backward_step, b, o, m)
  return metrics(self, m)
end

-- Loss (and accuracy for "lm") without gradients or state changes → metrics, out.
function T:evaluate(batch)
  live(self)
  local b = make_batch(self, batch, true, self._cfg.head ~= "none")
  local out = tensor({ b.rows, b.len, self._cfg.d_model })
  local m = self._metrics
  call(self, C.m3_trainer_evaluate, b, m, out.data)
  return metrics(self, m), out
end

function T:capture_graph()
  check(C.m3_trainer_capture_graph(live(self)))
end

function T:drop_graph()
  check(C.m3_trainer_drop_graph(live(self)))
end

function T:has_graph()
  return C.m3_trainer_has_graph(live(self)) ~= 0
end

-- ---- phase timing (CUDA; m3.h m3_trainer_set_profiling) -----------------------------------------

function T:set_profiling(on)
  check(C.m3_trainer_set_profiling(live(self), on and 1 or 0))
end

-- {calls = n, phases = {{name =, ms =}, ...}}: ms per counted eager call, in step order.
function T:profile()
  local p = live(self)
  local cap = 64
  local out, n, calls = ffi.new("m3_phase_time[?]", cap), ffi.new("int32_t[1]"), ffi.new("int64_t[1]")
  check(C.m3_trainer_profile(p, out, cap, n, calls))
  local phases = {}
  for i = 0, n[0] - 1 do phases[#phases + 1] = { name = ffi.string(out[i].name), ms = out[i].ms_per_call } end
  return { calls = tonumber(calls[0]), phases = phases }
end

-- ---- hyper-parameters ----------------------------------------------------------------------------

function T:set_lr(lr)
  local p = live(self)
  check(C.m3_trainer_set_lr(p, want_number(lr, "set_lr: lr")))
end

function T:lr()
  return C.m3_trainer_lr(live(self))
end

function T:set_reference_no_decay(on)
  local p = live(self)
  check(C.m3_trainer_set_no_decay(p, want_bool(on, "set_reference_no_decay: on") and 1 or 0))
end

-- Max global gradient norm for step (nil or false: off).
function T:set_clip(max_norm)
  local p = live(self)
  if max_norm == nil or max_norm == false then max_norm = 0 end
  check(C.m3_trainer_set_clip(p, want_number(max_norm, "set_clip: max_norm")))
end

-- ---- recurrent state -------------------------------------------------------------------------------

-- Zeroes the state of all rows, or of a list of 0-based rows.
function T:reset_state(rows)
  live(self)
  local arr, n = states.rows(rows, "reset_state") -- (a metamethod of rows may close the trainer)
  check(C.m3_trainer_reset_state(live(self), arr, n))
end

-- A list with one {angle=, ssm=, k=, v=} table of float32 tensors per layer (copies).
function T:states()
  local p = live(self)
  return states.read(self._cfg, self._B, function(l, a, s, k, v) check(C.m3_trainer_get_state(p, l, a, s, k, v)) end)
end

-- Sets every layer's state from a list as states() returns (shapes checked first).
-- (The pointer is read when the checked states are set: checking runs the list's metamethods.)
function T:set_states(list)
  live(self)
  states.write(self._cfg, self._B, list,
    function(l, a, s, k, v) check(C.m3_trainer_set_state(live(self), l, a, s, k, v)) end)
end

-- ---- weights ----------------------------------------------------------------------------------------

function T:snapshot()
  local p = live(self)
  local w = weights.create(self._cfg)
  check(C.m3_trainer_snapshot(p, weights.ptr(w)))
  return w
end

function T:grads()
  local p = live(self)
  local w = weights.create(self._cfg)
  check(C.m3_trainer_grads(p, weights.ptr(w)))
  return w
end

function T:load_weights(w)
  local p = live(self)
  if not weights.is(w) then raise("load_weights: expected weights (m3.weights), got " .. describe(w)) end
  check(C.m3_trainer_load_weights(p, weights.ptr(w)))
end

-- ---- facts -------------------------------------------------------------------------------------------

function T:device()
  live(self)
  return self._device
end

function T:dtype()
  live(self)
  return self._precision
end

function T:batch()
  live(self)
  return self._B
end

function T:seq_len()
  live(self)
  return self._T
end

function T:step_count()
  return tonumber(C.m3_trainer_step_count(live(self)))
end

function T:info()
  local p = live(self)
  local i = ffi.new("m3_trainer_info")
  C.m3_trainer_get_info(p, i)
  return {
    device = i.device == DEVICE_CPU and "cpu" or "cuda",
    device_index = tonumber(i.device_index),
    dtype = PRECISION_NAME[i.precision],
    batch = tonumber(i.batch),
    seq_len = tonumber(i.seq_len),
    carry_state = i.carry_state ~= 0,
    no_decay = i.no_decay ~= 0 and "reference" or "none",
    clip = i.clip,
    step = tonumber(i.step),
    pending_forward = i.pending_forward ~= 0,
    window_open = i.window_open ~= 0,
    has_graph = i.has_graph ~= 0,
    poisoned = i.poisoned ~= 0,
    device_bytes = tonumber(i.device_bytes),
  }
end

-- f16 loss scaler: scale, tracker (nil for other dtypes).
function T:scaler_state()
  local p = live(self)
  if self._precision ~= "f16" then return nil end
  local scale, tracker = ffi.new("double[1]"), ffi.new("int64_t[1]")
  check(C.m3_trainer_scaler_state(p, scale, tracker))
  return scale[0], tonumber(tracker[0])
end

function T:load_scaler_state(scale, tracker)
  local p = live(self)
  check(C.m3_trainer_load_scaler_state(p, want_number(scale, "load_scaler_state: scale"),
    want_int(tracker, "load_scaler_state: tracker", 0)))
end

-- ---- checkpoints -----------------------------------------------------------------------------------

-- Full checkpoint plus `extra`, a plain Lua value (serialized exactly; see m3.serialize).
function T:save(path, extra)
  local p = live(self)
  fs.check_path(path, "save")
  local text = ""
  if extra ~= nil then
    local ok, s = pcall(serialize.dump, extra, "extra")
    if not ok then raise("save: " .. tostring(s):gsub("^serialize: ", "")) end
    text = s
  end
  check(C.m3_trainer_save(p, path, text))
  return path
end

-- m3.trainer.load(path, {device=, dtype=, batch=, seq_len=}) → trainer, extra
-- (another batch: the saved recurrent state is not loaded, every row starts from zero)
local function load(path, opts)
  fs.check_path(path, "m3.trainer.load")
  local o = options.load_opts(opts, "m3.trainer.load")
  local out = ffi.new("m3_trainer *[1]")
  check(C.m3_trainer_load(path, o, out))
  local tr = wrap_trainer(out[0])
  local text = ffi.string(C.m3_trainer_extra(out[0]))
  local extra
  if text ~= "" then
    local ok, v = pcall(serialize.load, text)
    if not ok then raise("m3.trainer.load: " .. path .. ": the checkpoint's extra does not load: " .. v) end
    extra = v
  end
  return tr, extra
end

-- Frees the trainer now (also on garbage collection); later calls raise "trainer is closed".
function T:close()
  check_self(self)
  local box = self._box
  if box.p ~= nil then
    C.m3_trainer_destroy(box.p)
    box.p = nil
  end
end

function T:__tostring()
  if self._box.p == nil then return "m3.trainer (closed)" end
  local c = self._cfg
  return string.format("m3.trainer(%s %s, batch %d x seq_len %d, step %d; d_model %d, n_layers %d, input %s, head %s)",
    self._device, self._precision, self._B, self._T, self:step_count(), c.d_model, c.n_layers, c.input, c.head)
end

return setmetatable({ new = new, load = load }, {
  __call = function(_, w_or_cfg, opts) return new(w_or_cfg, opts) end,
})

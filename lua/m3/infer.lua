-- m3.infer — the inference handle (API.md "Inference") over m3_infer_*: a forward-only copy
-- of the weights that steps rows from their carried recurrent state, and text generation.
--
--   local inf = m3.infer(weights_or_path_or_trainer, {device=, dtype=, batch=, max_len=, graph=})
--   local w = m3.infer.load_weights(path)               -- the weights m3.infer takes from a path
--   local out, logits = inf:step(tokens_or_batch)    -- one token or a whole prompt
--   local toks, lengths = inf:generate(prompt, n, {temperature=, top_k=, top_p=, seed=, stop=})
--
-- A path names a weights file (w:save, m3.weights.load) or a trainer checkpoint (tr:save,
-- m3.checkpoint), told apart by the "format" metadata in the file's safetensors header; a
-- checkpoint gives its float32 master weights, whatever device and dtype it was trained on: it
-- is loaded as a trainer on the CPU in f32, one row of one token (m3.trainer.load verifies its
-- checksum; no lighter public reader does). A path where no file is, or something other than a
-- regular file, is an error that names it and says what is expected.
--
-- An object is a Lua table holding a box (an ffi.new struct whose __gc destroys the C object),
-- its private copy of the config, _cfg (every buffer is sized from it), `config` (another
-- copy, the user's: changing it changes nothing the object does) and reusable buffers.
-- Inputs are checked here (shape, dtype; a pointer, whose size the FFI cannot tell, is
-- refused) and by the engine (token ids, empty prompts) before anything runs, so a bad call
-- raises a message naming the field and leaves the state as it was. states() / set_states()
-- use the trainer's format, so a trainer's state (same batch) hands over with
-- inf:set_states(tr:states()).
--
-- generate(prompt, n, opts) starts the prompt's rows from zero state (opts.carry = true: from
-- their carried state), feeds the prompt, then draws n tokens per row (m3.sampling, the
-- engine's sampler; row r draws from its own generator, stream (seed, r), so a row's tokens
-- do not depend on the other rows). A row that draws one of opts.stop has stopped: its later positions hold
-- opts.pad (default: the stop token it drew) and it is fed that token again; generation ends
-- early once every row has stopped. Returns the tokens [rows, n] (int32) and a Lua list of
-- each row's length (generated tokens up to and including its stop token; n when it did not
-- stop). Afterwards the rows' state has seen the prompt and every token fed.

local ffi = require "ffi"
local lib = require "m3.lib"
local tensor = require "m3.tensor"
local config = require "m3.config"
local weights = require "m3.weights"
local options = require "m3.options"
local states = require "m3.states"
local sampling = require "m3.sampling"
local trainer = require "m3.trainer"
local json = require "m3.json"
local fs = require "m3.fs"

lib.internal_file(debug.getinfo(1, "S").source)

local C, check, raise = lib.C, lib.check, lib.raise
local show, describe, want_int, want_bool = options.show, options.describe, options.want_int, options.want_bool

local Box = lib.box("m3_infer", C.m3_infer_destroy)

local I = {}
I.__index = I

-- ---- construction -------------------------------------------------------------------------------

local OPTS = { device = true, dtype = true, batch = true, max_len = true, graph = true, allow_tf32 = true }

local function fill_cfg(opts)
  local what = "m3.infer"
  local c = ffi.new("m3_infer_cfg")
  C.m3_infer_cfg_defaults(c)
  if opts.device ~= nil then
    local kind, index = options.parse_device(opts.device, what)
    c.device, c.device_index = kind, index or 0
  end
  if opts.dtype ~= nil then c.precision = options.parse_dtype(opts.dtype, what) end
  if opts.batch ~= nil then c.batch = want_int(opts.batch, "m3.infer: batch", 1) end
  if opts.max_len ~= nil then c.max_len = want_int(opts.max_len, "m3.infer: max_len", 1) end
  if opts.graph ~= nil then c.graph = want_bool(opts.graph, "m3.infer: graph") and 1 or 0 end
  if opts.allow_tf32 ~= nil then c.allow_tf32 = want_bool(opts.allow_tf32, "m3.infer: allow_tf32") and 1 or 0 end
  return c
end

-- A safetensors header is at most this long (the format's limit): a longer stated length is not one.
local MAX_HEADER_BYTES = 100 * 2 ^ 20

-- Whether the file at path is a trainer checkpoint: its safetensors header (only the header is read)
-- states a format "m3lua-checkpoint-<version>" in its metadata.
local function is_checkpoint(path)
  local f = io.open(path, "rb")
  if not f then return false end
  local prefix = f:read(8)
  local length = 0
  for i = 8, 1, -1 do length = length * 256 + (prefix and prefix:byte(i) or 0) end
  local header = prefix and #prefix == 8 and length <= MAX_HEADER_BYTES and f:read(length)
  f:close()
  if not header then return false end
  local ok, t = pcall(json.decode, header)
  local meta = ok and type(t) == "table" and t.__metadata__
  return type(meta) == "table" and type(meta.format) == "string" and meta.format:find("^m3lua%-checkpoint%-") ~= nil
end

local EXPECTED_FILE = "expected a weights file (w:save) or a trainer checkpoint (tr:save)"

-- The weights of the weights file at path, or the float32 master weights of the trainer checkpoint there
-- (what: the caller, for the messages).
local function weights_at(path, what)
  fs.check_path(path, what)
  if not fs.exists(path) then raise(string.format("%s: %s: no such file; %s", what, path, EXPECTED_FILE)) end
  local kind = fs.kind(path)
  if kind then raise(string.format("%s: %s is %s; %s", what, path, kind, EXPECTED_FILE)) end
  if not is_checkpoint(path) then return weights.load(path) end
  local tr = trainer.load(path, { device = "cpu", dtype = "f32", batch = 1, seq_len = 1 })
  local w = tr:snapshot()
  tr:close()
  return w
end

-- m3.infer.load_weights(path)
local function load_weights(path)
  return weights_at(path, "m3.infer.load_weights")
end

-- m3.infer(weights_or_path_or_trainer, opts)
local function new(w, opts)
  opts = options.opts_table(opts, OPTS, "m3.infer")
  local c = fill_cfg(opts)
  local own = false
  if type(w) == "string" then
    w, own = weights_at(w, "m3.infer"), true
  elseif type(w) == "table" and not weights.is(w) and type(w.snapshot) == "function" then
    w, own = w:snapshot(), true -- a trainer: its current weights
  elseif not weights.is(w) then
    raise("m3.infer: expected weights (m3.weights), a trainer, or the path of a weights file or a trainer checkpoint, "
      .. "got " .. describe(w))
  end
  c.weights = weights.ptr(w)
  local out = ffi.new("m3_infer *[1]")
  local st = C.m3_infer_create(c, out)
  if own then w:close() end
  check(st)
  local box = Box()
  box.p = out[0]
  local info = ffi.new("m3_infer_info")
  C.m3_infer_get_info(out[0], info)
  local cfg = config.from_c(C.m3_infer_config(out[0]))
  return setmetatable({
    _box = box,
    _cfg = cfg,
    config = config.copy(cfg),
    _B = tonumber(info.batch),
    _batch = ffi.new("m3_batch"),
    _logits = cfg.head == "lm" and ffi.new("float[?]", tonumber(info.batch) * cfg.vocab_size) or nil,
    _precision = options.PRECISION_NAME[info.precision],
    _device = info.device == options.DEVICE_CPU and "cpu" or "cuda:" .. tonumber(info.device_index),
  }, I)
end

-- Raises unless self is a inference object (a method called with '.' gets its first argument instead).
local ITSELF = { [I] = true }
local function check_self(self)
  options.check_self(self, ITSELF, "m3.infer", "an inference object")
end

local function live(self)
  check_self(self)
  local p = self._box.p
  if p == nil then raise("inference object is closed") end
  return p
end

-- ---- steps --------------------------------------------------------------------------------------

-- The input of a step as (field, tensor): tokens int32 [B, T] or input f32 [B, T, width].
local function step_input(self, b, what)
  local cfg = self._cfg
  local tokens = cfg.input == "tokens"
  local name = tokens and "tokens" or "input"
  local width = cfg.input == "features" and cfg.input_dim or cfg.d_model
  local want = tokens and "int32 [B, T]" or string.format("f32 [B, T, %d]", width)
  local t = b
  if type(b) == "table" and not tensor.is(b) and b.data == nil and (b.tokens ~= nil or b.input ~= nil or b.resets ~= nil) then
    for k in pairs(b) do
      if k ~= name and k ~= "resets" then
        raise(string.format("%s: batch.%s: not an input of this model (fields: %s, resets)", what, tostring(k), name))
      end
    end
    if b[name] == nil then raise(string.format("%s: batch.%s: missing (%s)", what, name, want)) end
    t = b[name]
  end
  t = tensor.coerce(t, what .. ": " .. name, tokens and "i32" or "f32", nil, want)
  if not t then raise(string.format("%s: %s: expected %s, got %s", what, name, want, describe(b))) end
  if not tokens and t:dtype() == "f64" then t = tensor.cast(t, "f32", what .. ": " .. name) end
  local ok = t:dtype() == (tokens and "i32" or "f32") and t.ndim_ == (tokens and 2 or 3)
    and (tokens or t.dims_[2] == width)
  if not ok then raise(string.format("%s: %s: expected %s, got %s", what, name, want, describe(t))) end
  local B, T_ = t.dims_[0], t.dims_[1]
  if B < 1 or B > self._B then
    raise(string.format("%s: %s has %d rows: expected 1 to %d (the inference batch)", what, name, B, self._B))
  end
  if T_ < 1 then raise(string.format("%s: %s is empty (%s): a step needs at least one position", what, name, describe(t))) end
  local resets
  if type(b) == "table" and not tensor.is(b) and b.resets ~= nil then
    resets = tensor.coerce(b.resets, what .. ": resets", "u8", { B, T_ }, "uint8 [B, T]")
    local s = resets:shape()
    if resets:dtype() ~= "u8" or #s ~= 2 or s[1] ~= B or s[2] ~= T_ then
      raise(string.format("%s: resets: expected uint8 [%d, %d], got %s", what, B, T_, describe(resets)))
    end
  end
  return t, resets
end

-- (p is read again here: checking the input runs the caller's code, a metamethod, that may have
-- closed the object since the method began.)
local function run(self, t, resets, out, logits)
  local p = live(self)
  local cb = self._batch
  ffi.fill(cb, ffi.sizeof(cb))
  cb.rows, cb.len = t.dims_[0], t.dims_[1]
  if self._cfg.input == "tokens" then cb.tokens = t.data else cb.input = t.data end
  if resets then cb.resets = resets.data end
  local st = C.m3_infer_step(p, cb, out, logits)
  cb.tokens, cb.input, cb.resets = nil, nil, nil
  check(st)
end

local STEP_OPTS = { out = true, logits = true }

-- Where step writes one of its results: nil or true: a new tensor; false: nowhere; a tensor: the
-- caller's, f32 of exactly that shape, overwritten (a buffer reused across steps allocates nothing).
local function destination(v, shape, what)
  if v == nil or v == true then return tensor(shape) end
  if v == false then return nil end
  if tensor.is(v) and v:dtype() == "f32" and v.ndim_ == #shape then
    local same = true
    for i = 1, #shape do same = same and v.dims_[i - 1] == shape[i] end
    if same then return v end
  end
  raise(string.format("%s: expected true, false or an f32 %s tensor, got %s", what, tensor.format_shape(shape),
    describe(v)))
end

-- One token or a whole prompt for rows [0, B): out [B, T, d_model] and, for "lm" models, the
-- last position's logits [B, vocab]. opts.out / opts.logits: false skips the copy (the logits
-- then stay on the device), a tensor of that shape receives it (see destination).
function I:step(batch, opts)
  live(self)
  opts = options.opts_table(opts, STEP_OPTS, "step")
  local t, resets = step_input(self, batch, "step")
  local B, T_ = t.dims_[0], t.dims_[1]
  local cfg = self._cfg
  local out = destination(opts.out, { B, T_, cfg.d_model }, "step: opts.out")
  local logits = nil
  if cfg.head == "lm" then
    logits = destination(opts.logits, { B, cfg.vocab_size }, "step: opts.logits")
  elseif tensor.is(opts.logits) then
    raise("step: opts.logits: the model's head is " .. show(cfg.head) .. ", it has no logits")
  end
  run(self, t, resets, out and out.data, logits and logits.data)
  return out, logits
end

-- Zeroes the state of all rows, or of a list of 0-based rows.
function I:reset(rows)
  live(self)
  local arr, n = states.rows(rows, "reset") -- (a metamethod of rows may close the object)
  check(C.m3_infer_reset(live(self), arr, n))
end

function I:states()
  local p = live(self)
  return states.read(self._cfg, self._B, function(l, a, s, k, v) check(C.m3_infer_get_state(p, l, a, s, k, v)) end)
end

function I:set_states(list)
  live(self)
  states.write(self._cfg, self._B, list,
    function(l, a, s, k, v) check(C.m3_infer_set_state(live(self), l, a, s, k, v)) end)
end

-- ---- generation ---------------------------------------------------------------------------------

local GEN_OPTS = { temperature = true, top_k = true, top_p = true, seed = true, stop = true, pad = true,
                   carry = true }

local function gen_options(self, opts)
  local what = "generate"
  opts = options.opts_table(opts, GEN_OPTS, what)
  local o = { sampler = { temperature = opts.temperature, top_k = opts.top_k, top_p = opts.top_p,
                          seed = opts.seed } }
  local V = self._cfg.vocab_size
  o.stop = {}
  local stop = opts.stop
  if type(stop) ~= "nil" and type(stop) ~= "number" and type(stop) ~= "table" then
    raise("generate: stop = " .. show(stop) .. ": expected a token id or a list of token ids")
  end
  local ids = type(stop) == "number" and { stop } or stop or {}
  local keys = 0
  for _ in pairs(ids) do keys = keys + 1 end
  if keys ~= #ids then
    raise("generate: stop = " .. show(stop) .. ": expected a token id or a list of token ids (keys 1 .. n, no holes)")
  end
  for i, id in ipairs(ids) do
    if type(id) ~= "number" or id ~= math.floor(id) or id < 0 or id >= V then
      local name = type(stop) == "number" and "stop" or string.format("stop[%d]", i)
      raise(string.format("generate: %s = %s: expected a token id in [0, %d)", name, show(id), V))
    end
    o.stop[id] = true
  end
  if opts.pad ~= nil then
    local pad = opts.pad
    if type(pad) ~= "number" or pad ~= math.floor(pad) or pad < -2147483648 or pad > 2147483647 then
      raise("generate: pad = " .. show(pad) .. ": expected an int32 (written after a row's stop token)")
    end
    o.pad = pad
  end
  o.carry = opts.carry ~= nil and want_bool(opts.carry, "generate: carry") or false
  return o
end

-- The prompt as int32 [B, T]: a tensor, a nested table {{...}, ...}, or a flat list (one row); and
-- whether its token ids were checked: a table's are, here, named as the caller wrote them (prompt[r][t],
-- 1-based).
local function prompt_tensor(prompt, V)
  if type(prompt) ~= "table" or tensor.is(prompt) or prompt.data ~= nil then return prompt, false end
  if #prompt == 0 then raise("generate: prompt is empty: expected int32 [B, T] with T >= 1") end
  local flat = type(prompt[1]) ~= "table"
  local rows = flat and { prompt } or prompt
  local T_ = #rows[1]
  for r, row in ipairs(rows) do
    local name = flat and "generate: prompt" or string.format("generate: prompt[%d]", r)
    if type(row) ~= "table" or tensor.is(row) then
      raise(string.format("%s: expected a list of token ids, got %s", name, describe(row)))
    end
    if #row ~= T_ then
      raise(string.format("%s has %d tokens, expected %d (as many as the first row)", name, #row, T_))
    end
    for t = 1, T_ do
      local id = row[t]
      if type(id) ~= "number" or id ~= math.floor(id) or id < 0 or id >= V then
        raise(string.format("%s[%d] = %s: expected a token id in [0, %d)", name, t, show(id), V))
      end
    end
  end
  return tensor.from(rows, "i32"), true
end

-- A tensor prompt's token ids (a table's were checked as it was converted), checked before
-- generate resets its rows: a bad prompt then changes no state (the engine checks them again after the reset).
local function check_prompt_ids(t, V)
  local T_ = t.dims_[1]
  for i = 0, t.dims_[0] * T_ - 1 do
    local id = t.data[i]
    if id < 0 or id >= V then
      raise(string.format("generate: prompt row %d, position %d (0-based) = %d: expected a token id in [0, %d)",
        math.floor(i / T_), i % T_, id, V))
    end
  end
end

function I:generate(prompt, n, opts)
  live(self)
  local cfg = self._cfg
  if cfg.head ~= "lm" then raise(string.format("generate: the model's head is %q; generate needs an \"lm\" model", cfg.head)) end
  if cfg.input ~= "tokens" then raise(string.format("generate: the model's input is %q; generate needs \"tokens\"", cfg.input)) end
  n = want_int(n, "generate: n", 1)
  local o = gen_options(self, opts)
  local V = cfg.vocab_size
  local tokens, checked = prompt_tensor(prompt, V)
  local t = step_input(self, tokens, "generate: prompt")
  local B = t.dims_[0]
  local sampler = sampling.new(B, o.sampler, "generate")
  if not checked then check_prompt_ids(t, V) end
  if not o.carry then
    local rows = {}
    for r = 1, B do rows[r] = r - 1 end
    self:reset(rows)
  end
  run(self, t, nil, nil, self._logits)
  local result = tensor({ B, n }, "i32")
  local next_tok, drawn = tensor({ B, 1 }, "i32"), ffi.new("int32_t[?]", B)
  local lengths, stopped, live_rows = {}, {}, B
  for r = 1, B do lengths[r] = n end
  local drawing -- the token being drawn, 0-based, for the message below
  local function nonfinite(r)
    return string.format("generate: the model produced a non-finite logit in row %d while drawing token %d "
      .. "(are some weights so large that float32 overflows?)", r, drawing + 1)
  end
  for i = 0, n - 1 do
    drawing = i
    sampler:draw(self._logits, V, drawn, nonfinite)
    for r = 0, B - 1 do
      local id
      if stopped[r] then
        id = stopped[r]
        result[r * n + i] = o.pad or id
      else
        id = drawn[r]
        result[r * n + i] = id
        if o.stop[id] then
          stopped[r], lengths[r + 1], live_rows = id, i + 1, live_rows - 1
        end
      end
      next_tok[r] = id
    end
    run(self, next_tok, nil, nil, self._logits)
    if live_rows == 0 then
      for j = i + 1, n - 1 do
        for r = 0, B - 1 do result[r * n + j] = o.pad or stopped[r] end
      end
      break
    end
  end
  return result, lengths
end

-- ---- facts and closing --------------------------------------------------------------------------

function I:device()
  live(self)
  return self._device
end

function I:dtype()
  live(self)
  return self._precision
end

function I:batch()
  live(self)
  return self._B
end

function I:info()
  local i = ffi.new("m3_infer_info")
  C.m3_infer_get_info(live(self), i)
  return {
    device = i.device == options.DEVICE_CPU and "cpu" or "cuda",
    device_index = tonumber(i.device_index),
    dtype = options.PRECISION_NAME[i.precision],
    batch = tonumber(i.batch),
    max_len = tonumber(i.max_len),
    graph = i.graph ~= 0,
    poisoned = i.poisoned ~= 0,
    device_bytes = tonumber(i.device_bytes),
    fused_decode = i.fused_decode ~= 0,
  }
end

-- Frees the object now (also on garbage collection); later calls raise "inference object is closed".
function I:close()
  check_self(self)
  local box = self._box
  if box.p ~= nil then
    C.m3_infer_destroy(box.p)
    box.p = nil
  end
end

function I:__tostring()
  if self._box.p == nil then return "m3.infer (closed)" end
  local c = self._cfg
  return string.format("m3.infer(%s %s, batch %d; d_model %d, n_layers %d, input %s, head %s)", self._device,
    self._precision, self._B, c.d_model, c.n_layers, c.input, c.head)
end

return setmetatable({ new = new, load_weights = load_weights }, {
  __call = function(_, w, opts) return new(w, opts) end,
})

-- m3.weights — host float32 weights (SPEC.md §2 names) owned by libm3.
--
-- A weights object is a Lua table holding a box (an ffi.new struct whose __gc destroys
-- the C weights), its private copy of the validated Lua config, _cfg (what numel, tostring and
-- m3.pytorch.export read), and `config` (another copy, the user's: changing it changes
-- nothing the weights report or write). get(name) returns a tensor VIEW
-- into the arena; a view keeps the box alive, so close() only frees the arena at once when
-- no view is alive (otherwise the last view's collection frees it). Methods of a closed
-- object raise "weights are closed".

local ffi = require "ffi"
local lib = require "m3.lib"
local tensor = require "m3.tensor"
local config = require "m3.config"
local options = require "m3.options"
local fs = require "m3.fs"

lib.internal_file(debug.getinfo(1, "S").source)

local C, check, raise = lib.C, lib.check, lib.raise

local Box = lib.box("m3_weights", C.m3_weights_destroy)

local weights = {}
local W = {}
W.__index = W

local function is_weights(x)
  return getmetatable(x) == W
end
weights.is = is_weights

-- Wraps an m3_weights pointer that this object now owns.
function weights.wrap(p)
  local box = Box()
  box.p = p
  local w = setmetatable({ _box = box, _views = setmetatable({}, { __mode = "k" }) }, W)
  w._cfg = config.from_c(C.m3_weights_config(p))
  w.config = config.copy(w._cfg)
  return w
end

local function create(cfg)
  if is_weights(cfg) then raise("m3.weights: expected a config, got weights (w.config is theirs; w:clone() copies them)") end
  local c = config.to_c(cfg)
  local out = ffi.new("m3_weights *[1]")
  check(C.m3_weights_create(c, out))
  return weights.wrap(out[0])
end

-- Raises unless w is a weights object (a method called with '.' gets its first argument instead).
local ITSELF = { [W] = true }
local function check_self(w)
  options.check_self(w, ITSELF, "m3.weights", "a weights object")
end

-- The live C pointer, or an error when closed.
local function ptr(w)
  check_self(w)
  local p = w._box.p
  if p == nil then raise("weights are closed") end
  return p
end
weights.ptr = ptr

-- m3.weights.create(cfg): zero-filled weights.
function weights.create(cfg)
  return create(cfg)
end

-- m3.weights.init(cfg, {seed=}): SPEC.md §2 init from one seeded generator.
function weights.init(cfg, opts)
  if type(opts) ~= "nil" and type(opts) ~= "table" then
    raise("m3.weights.init: opts must be a table, got " .. type(opts))
  end
  opts = opts or {}
  for k in pairs(opts) do
    if k ~= "seed" then raise(string.format("m3.weights.init: unknown option %s (valid: seed)", tostring(k))) end
  end
  local seed = options.check_seed(opts.seed, "m3.weights.init")
  local w = create(cfg)
  check(C.m3_weights_init(w._box.p, seed))
  return w
end

-- m3.weights.load(path, cfg?): a safetensors file (config from its metadata when cfg is nil).
function weights.load(path, cfg)
  fs.check_path(path, "m3.weights.load")
  if cfg ~= nil and (type(cfg) ~= "table" or is_weights(cfg)) then
    raise("m3.weights.load: cfg = " .. (is_weights(cfg) and "weights (w.config is theirs)" or options.show(cfg))
      .. ": expected a config (a table), or nil for the file's own")
  end
  local c = cfg ~= nil and config.to_c(cfg) or nil
  local out = ffi.new("m3_weights *[1]")
  check(C.m3_weights_load(path, c, out))
  return weights.wrap(out[0])
end

-- ---- methods ------------------------------------------------------------------------------------

function W:save(path)
  local p = ptr(self)
  fs.check_path(path, "weights:save")
  check(C.m3_weights_save(p, path))
  return path
end

local function index_of(self, p, name)
  if type(name) ~= "string" then raise("weights: tensor name must be a string, got " .. type(name)) end
  local i = C.m3_weights_find(p, name)
  if i < 0 then
    local names = self:names()
    raise(string.format("weights: no tensor named %q%s", name, config.suggest(name, names)))
  end
  return i
end

local function info_of(p, i)
  local info = ffi.new("m3_tensor_info")
  check(C.m3_weights_tensor(p, i, info))
  local shape = {}
  for d = 0, info.ndim - 1 do shape[d + 1] = tonumber(info.shape[d]) end
  return info, shape
end

-- A tensor view into the arena (writes go to the weights).
function W:get(name)
  local p = ptr(self)
  local info, shape = info_of(p, index_of(self, p, name))
  local view = tensor.view(info.data, shape, "f32", self._box)
  self._views[view] = true
  return view
end

-- Copies a tensor (or nested table, or flat table of numel values) into a parameter.
function W:set(name, value)
  local p = ptr(self)
  local info, shape = info_of(p, index_of(self, p, name))
  local what = "weights:set(" .. string.format("%q", name) .. ")"
  local t = tensor.coerce(value, what, "f32", shape)
  if type(value) == "table" and not value.data and t:numel() == tonumber(info.numel) and #t:shape() == 1 then
    t = tensor.view(t.data, shape, "f32", t) -- a flat Lua list of numel values
  end
  local have = t:shape()
  local same = #have == #shape and (t:dtype() == "f32" or t:dtype() == "f64")
  for d = 1, #shape do same = same and have[d] == shape[d] end
  if not same then
    raise(string.format("%s: expected f32 %s, got %s", what, tensor.format_shape(shape), tensor.describe(t)))
  end
  if t:dtype() == "f64" then t = tensor.cast(t, "f32", what) end
  -- reading value ran its metamethods, which may have closed these weights: the arena again
  info = info_of(ptr(self), index_of(self, ptr(self), name))
  ffi.copy(info.data, t.data, 4 * tonumber(info.numel))
  return self
end

function W:names()
  local p = ptr(self)
  local names = {}
  local info = ffi.new("m3_tensor_info")
  for i = 0, C.m3_weights_count(p) - 1 do
    check(C.m3_weights_tensor(p, i, info))
    names[i + 1] = ffi.string(info.name)
  end
  return names
end

function W:clone()
  local out = ffi.new("m3_weights *[1]")
  check(C.m3_weights_clone(ptr(self), out))
  return weights.wrap(out[0])
end

function W:numel()
  ptr(self)
  return self._cfg.n_params
end

-- Releases the weights (at once, unless tensor views from get() are still alive).
function W:close()
  check_self(self)
  local box = self._box
  if box.p == nil then return end
  if next(self._views) == nil then
    C.m3_weights_destroy(box.p)
    box.p = nil
  else
    self._box = Box()
  end
end

function W:__tostring()
  if self._box.p == nil then return "m3.weights (closed)" end
  local c = self._cfg
  return string.format("m3.weights: %d tensors, %d parameters (d_model %d, n_layers %d, d_state %d, "
    .. "headdim %d, input %s, head %s)", C.m3_weights_count(self._box.p), c.n_params, c.d_model,
    c.n_layers, c.d_state, c.headdim, c.input, c.head)
end

return weights

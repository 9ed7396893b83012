-- m3.options — checks of the option tables of the objects' constructors and methods (trainer,
-- infer): unknown keys (with the closest valid name), integers, seeds, numbers, booleans, lists, the
-- device and dtype strings, and how a value is shown in a message. Every error names the option and
-- what was expected.

local ffi = require "ffi"
local lib = require "m3.lib"
local tensor = require "m3.tensor"
local config = require "m3.config"

lib.internal_file(debug.getinfo(1, "S").source)

local raise = lib.raise

local options = {}

options.DEVICE_CPU, options.DEVICE_CUDA = 1, 2
options.PRECISIONS = { f32 = 0, bf16 = 1, f16 = 2 }
options.PRECISION_NAME = { [0] = "f32", "bf16", "f16" }

function options.show(v)
  if type(v) == "string" then return string.format("%q", v) end
  if type(v) ~= "table" or getmetatable(v) ~= nil then return tostring(v) end
  -- a plain table by its first items ({0.9}, {1, "x", {...}}), never by its address
  local items, n = {}, 0
  for _ in pairs(v) do n = n + 1 end
  for i = 1, math.min(#v, 4) do items[i] = type(v[i]) == "table" and "{...}" or options.show(v[i]) end
  if n > #items then items[#items + 1] = "..." end
  return "{" .. table.concat(items, ", ") .. "}"
end
local show = options.show

-- Raises unless self is an object whose metatable is a key of mts (a set): a method called with '.' instead of
-- ':' gets its first argument as self, or nil. "<what>: <method>: expected <noun> (call it as
-- <var>:<method>(<args>)), got <self>"; without var, method and args, "<what>: expected <noun> (call methods
-- with ':'), got <self>" (a check shared by every method). Every module's methods check self with it.
function options.check_self(self, mts, what, noun, var, method, args)
  if type(self) == "table" and mts[getmetatable(self)] then return self end
  if not method then
    raise(string.format("%s: expected %s (call methods with ':'), got %s", what, noun, show(self)))
  end
  raise(string.format("%s: %s: expected %s (call it as %s:%s(%s)), got %s", what, method, noun, var, method, args,
    show(self)))
end

-- A call's options table once its keys are valid (nil: {}); anything else than a table or nil, a NULL pointer
-- (which equals nil) too, is "<what>: opts must be a table, got <type>".
function options.opts_table(opts, valid, what)
  if type(opts) ~= "nil" and type(opts) ~= "table" then raise(what .. ": opts must be a table, got " .. type(opts)) end
  opts = opts or {}
  options.check_keys(opts, valid, what)
  return opts
end

function options.check_keys(t, valid, what)
  if type(t) ~= "table" then raise(string.format("%s: expected an options table, got %s", what, show(t))) end
  for k in pairs(t) do
    if not valid[k] then
      local names = {}
      for n in pairs(valid) do names[#names + 1] = n end
      table.sort(names)
      raise(string.format("%s: unknown option %s%s; valid options: %s", what, show(k),
        type(k) == "string" and config.suggest(k, names) or "", table.concat(names, ", ")))
    end
  end
end

-- o, once it is an options table with only the keys in valid.
function options.check_table(o, valid, what)
  if type(o) ~= "table" then raise(string.format("%s: expected an options table, got %s", what, show(o))) end
  options.check_keys(o, valid, what)
  return o
end

-- v, once it is an integer from lo to 2147483647 (the C side holds it in an int32).
function options.want_int(v, name, lo)
  if type(v) ~= "number" or v ~= math.floor(v) or v < lo or v == math.huge then
    raise(string.format("%s = %s: expected an integer >= %d", name, show(v), lo))
  end
  if v > 2147483647 then
    raise(string.format("%s = %s: expected an integer from %d to 2147483647 (an int32)", name, show(v), lo))
  end
  return v
end

-- seed (nil: 0), once it is an integer in [0, 2^53): what every seed option takes, the engine's
-- generators (weights, trainer, sampler) and m3.data.rng's alike (what: the caller, for the message).
function options.check_seed(seed, what)
  if seed == nil then return 0 end
  if type(seed) ~= "number" or seed < 0 or seed ~= math.floor(seed) or seed >= 2 ^ 53 then
    raise(string.format("%s: seed = %s: expected an integer in [0, 2^53)", what, show(seed)))
  end
  return seed
end

-- What keeps the table t from being a list (keys 1..n, no holes): "the key k" or "nil at [i]";
-- nil for a list.
function options.not_a_list(t)
  local n, max = 0, 0
  for k in pairs(t) do
    if type(k) ~= "number" or k ~= math.floor(k) or k < 1 then return "the key " .. options.show(k) end
    n, max = n + 1, math.max(max, k)
  end
  if max > n then -- n keys, one of them above n: a hole at or below n + 1
    for i = 1, n + 1 do
      if t[i] == nil then return "nil at [" .. i .. "]" end
    end
  end
end

-- Whether t is a list: a table whose keys are 1 to #t and nothing else (no hole, no named field).
function options.is_list(t)
  return type(t) == "table" and options.not_a_list(t) == nil
end

function options.want_number(v, name)
  if type(v) ~= "number" then raise(string.format("%s = %s: expected a number", name, show(v))) end
  return v
end

function options.want_bool(v, name)
  if type(v) ~= "boolean" then raise(string.format("%s = %s: expected a boolean", name, show(v))) end
  return v
end

local LONG = { f32 = "f32", f64 = "f64", i32 = "int32", u8 = "uint8" }
options.LONG = LONG

-- "f32 [4, 32]" for a tensor, a short description of anything else (for error messages).
function options.describe(t)
  if tensor.is(t) then return LONG[t:dtype()] .. " " .. tensor.format_shape(t:shape()) end
  return tensor.describe(t)
end

-- "auto" | "cpu" | "cuda" | "cuda:N" → device kind, index (index nil for a bare "cuda").
function options.parse_device(s, what)
  if s == "auto" then return 0, 0 end
  if s == "cpu" then return options.DEVICE_CPU, 0 end
  if s == "cuda" then return options.DEVICE_CUDA, nil end
  local n = type(s) == "string" and s:match("^cuda:(%d+)$")
  if n and tonumber(n) <= 2147483647 then return options.DEVICE_CUDA, tonumber(n) end
  if n then raise(string.format("%s: device = %s: the index must be below 2^31", what, show(s))) end
  raise(string.format("%s: device = %s: expected \"auto\", \"cpu\", \"cuda\" or \"cuda:N\"", what, show(s)))
end

function options.parse_dtype(s, what)
  local p = options.PRECISIONS[s]
  if not p then raise(string.format("%s: dtype = %s: expected \"f32\", \"bf16\" or \"f16\"", what, show(s))) end
  return p
end

local LOAD_OPTS = { device = true, dtype = true, batch = true, seq_len = true }

-- The m3_load_opts of m3.trainer.load's opts, once they are valid; what: the caller, for the messages
-- (m3.checkpoint checks them before it tries its files: options no file could be loaded with are not a
-- damaged file's).
function options.load_opts(opts, what)
  opts = options.opts_table(opts, LOAD_OPTS, what)
  local o = ffi.new("m3_load_opts", -1, -1, -1, -1, -1)
  if opts.device ~= nil then
    local kind, index = options.parse_device(opts.device, what)
    o.device, o.device_index = kind, index or -1
  end
  if opts.dtype ~= nil then o.precision = options.parse_dtype(opts.dtype, what) end
  if opts.batch ~= nil then o.batch = options.want_int(opts.batch, what .. ": batch", 1) end
  if opts.seq_len ~= nil then o.seq_len = options.want_int(opts.seq_len, what .. ": seq_len", 1) end
  return o
end

return options

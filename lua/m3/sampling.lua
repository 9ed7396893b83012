-- m3.sampling — tokens from rows of logits through the engine's sampler (m3_sample: greedy,
-- temperature, top-k, top-p; rows in parallel, each with its own seeded generator).
--
--   local s = sampling.new(rows, opts, what)   checked {temperature = 1, top_k = 0, top_p = 1,
--                                              seed = 0} (other keys are errors); row r's generator
--                                              is stream (seed, r); what (default "m3.sampling")
--                                              begins every message
--   s:draw(logits, vocab, out, nonfinite)      one token per row (float [rows, vocab] -> int32 [rows]);
--                                              logits / out: an f32 / i32 tensor (or FFI array plus a
--                                              shape) of rows x vocab / rows elements (checked), or an
--                                              FFI pointer or array (as it is: its size is the caller's
--                                              to get right);
--                                              nonfinite(row), if given, words the error for a row whose
--                                              logits are not all finite (else the engine's message)
--
-- temperature 0 is greedy (the argmax, lowest id among ties). Otherwise softmax(logits /
-- temperature) restricted to the top_k largest logits (0: all), then to the shortest
-- most-likely set whose mass reaches top_p (1: all), renormalised (engine/src/sample.c).

local ffi = require "ffi"
local lib = require "m3.lib"
local tensor = require "m3.tensor"
local options = require "m3.options"

lib.internal_file(debug.getinfo(1, "S").source)

local C, check, raise, show = lib.C, lib.check, lib.raise, options.show

local S = {}
S.__index = S

local sampling = {}

local OPTS = { temperature = true, top_k = true, top_p = true, seed = true }

function sampling.new(rows, opts, what)
  what = what or "m3.sampling"
  rows = options.want_int(rows, what .. ": rows", 1)
  if type(opts) ~= "nil" and type(opts) ~= "table" then raise(what .. ": opts must be a table, got " .. type(opts)) end
  opts = opts or {}
  options.check_keys(opts, OPTS, what)
  local o = ffi.new("m3_sample_opts", 1, 0, 1)
  if opts.temperature ~= nil then
    local t = opts.temperature
    if type(t) ~= "number" or not (t >= 0 and t < math.huge) then
      raise(string.format("%s: temperature = %s: expected a finite number >= 0 (0 = greedy)", what, show(t)))
    end
    o.temperature = t
  end
  if opts.top_k ~= nil then o.top_k = options.want_int(opts.top_k, what .. ": top_k", 0) end
  if opts.top_p ~= nil then
    local p = opts.top_p
    if type(p) ~= "number" or not (p > 0 and p <= 1) then
      raise(string.format("%s: top_p = %s: expected a number in (0, 1] (1 = off)", what, show(p)))
    end
    o.top_p = p
  end
  local seed = options.check_seed(opts.seed, what)
  local rng = ffi.new("uint64_t[?]", 4 * rows)
  for r = 0, rows - 1 do C.m3_sampler_seed(seed, r, rng + 4 * r) end
  return setmetatable({ opts = o, rng = rng, rows = rows, what = what }, S)
end

-- x as m3_sample takes it: a tensor (or an FFI array plus a shape) once it holds n elements of dtype; an
-- FFI pointer or array as it is.
local function data_of(x, dtype, n, name)
  if type(x) == "table" and x.data ~= nil then x = tensor.coerce(x, name, dtype) end
  if tensor.is(x) then
    if x:dtype() == dtype and x:numel() == n then return x.data end
  elseif type(x) == "cdata" then
    return x
  end
  raise(string.format("%s: expected an %s tensor of %d elements or an FFI pointer, got %s", name,
    options.LONG[dtype], n, options.describe(x)))
end

function S:draw(logits, vocab, out, nonfinite)
  local what = self.what .. ": draw"
  vocab = options.want_int(vocab, what .. ": vocab", 1)
  local lg = data_of(logits, "f32", self.rows * vocab, what .. ": logits")
  local ids = data_of(out, "i32", self.rows, what .. ": out")
  local st = C.m3_sample(lg, self.rows, vocab, self.opts, self.rng, ids)
  if st == C.M3_ERR_NONFINITE and nonfinite then
    for r = 0, self.rows - 1 do
      for i = r * vocab, (r + 1) * vocab - 1 do
        local v = lg[i]
        if v ~= v or v == math.huge or v == -math.huge then raise(nonfinite(r)) end
      end
    end
  end
  check(st)
end

return sampling

-- m3.sampling — tokens from rows of logits through the engine's sampler (m3_sample: greedy,
-- temperature, top-k, top-p; rows in parallel, each with its own seeded generator).
--
--   local s = sampling.new(rows, opts, what)   checked {temperature = 1, top_k = 0, top_p = 1,
--                                              seed = 0} (other keys are errors); row r's generator
--                                              is stream (seed, r) (32 bytes a row, in one FFI
--                                              allocation: rows past what it holds are an error);
--                                              what (a string, default "m3.sampling") begins every
--                                              message
--   s:draw(logits, vocab, out, nonfinite)      one token per row (float [rows, vocab] -> int32 [rows]);
--                                              logits / out: an f32 / i32 tensor (or FFI array plus a
--                                              shape) of rows x vocab / rows elements (checked), or an
--                                              FFI pointer or array (as it is: its size is the caller's
--                                              to get right; a pointer of another element type is an
--                                              error);
--                                              nonfinite(row), if given (a function), returns the message
--                                              (a string) of the error for a row whose logits are not all
--                                              finite (else the engine's message)
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
  if type(what) ~= "nil" and (type(what) ~= "string" or what == "") then
    raise("m3.sampling: what = " .. show(what) .. ": expected the name that begins its messages (a string)")
  end
  what = what or "m3.sampling"
  rows = options.want_int(rows, what .. ": rows", 1)
  opts = options.opts_table(opts, OPTS, what)
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
  local made, rng = pcall(ffi.new, "uint64_t[?]", 4 * rows)
  if not made then
    raise(string.format("%s: rows = %d: the rows' generators (32 bytes a row) cannot be allocated (%s)", what, rows,
      tostring(rng):match("%((.*)%)$") or tostring(rng)))
  end
  for r = 0, rows - 1 do C.m3_sampler_seed(seed, r, rng + 4 * r) end
  return setmetatable({ opts = o, rng = rng, rows = rows, what = what }, S)
end

-- One-slot arrays of the pointer types m3_sample takes: a cdata that can be stored in one is one it takes.
local SLOT = { f32 = ffi.new("const float *[1]"), i32 = ffi.new("int32_t *[1]") }
local ELEMENT = { f32 = "float", i32 = "int32_t" }
local function store(slot, x) slot[0] = x end

-- x as m3_sample takes it: a tensor (or an FFI array plus a shape) once it holds n elements of dtype; an
-- FFI pointer or array of dtype's elements as it is.
local function data_of(x, dtype, n, name)
  if type(x) == "table" and type(x.data) ~= "nil" then x = tensor.coerce(x, name, dtype) end
  if tensor.is(x) then
    if x:dtype() == dtype and x:numel() == n then return x.data end
  elseif type(x) == "cdata" and pcall(store, SLOT[dtype], x) then
    if x == nil then raise(name .. ": a NULL pointer") end
    return x
  end
  raise(string.format("%s: expected an %s tensor of %d elements or an FFI pointer to %s, got %s", name,
    options.LONG[dtype], n, ELEMENT[dtype], options.describe(x)))
end

local ITSELF = { [S] = true }

function S:draw(logits, vocab, out, nonfinite)
  options.check_self(self, ITSELF, "m3.sampling", "a sampler (m3.sampling.new)", "s", "draw",
    "logits, vocab, out, nonfinite")
  local what = self.what .. ": draw"
  vocab = options.want_int(vocab, what .. ": vocab", 1)
  if type(nonfinite) ~= "nil" and type(nonfinite) ~= "function" then
    raise(string.format("%s: nonfinite = %s: expected a function (row -> the message)", what, show(nonfinite)))
  end
  local lg = data_of(logits, "f32", self.rows * vocab, what .. ": logits")
  local ids = data_of(out, "i32", self.rows, what .. ": out")
  local st = C.m3_sample(lg, self.rows, vocab, self.opts, self.rng, ids)
  if st == C.M3_ERR_NONFINITE and nonfinite then
    for r = 0, self.rows - 1 do
      for i = r * vocab, (r + 1) * vocab - 1 do
        local v = lg[i]
        if v ~= v or v == math.huge or v == -math.huge then
          local msg = nonfinite(r)
          if type(msg) ~= "string" then
            raise(string.format("%s: row %d of the logits holds a non-finite value, and nonfinite(%d) returned %s "
              .. "instead of its message (a string)", what, r, r, show(msg)))
          end
          raise(msg)
        end
      end
    end
  end
  check(st)
end

return sampling

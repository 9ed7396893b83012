-- m3.data.rng — a small deterministic random number generator in pure Lua.
--
-- xoshiro128** (Blackman & Vigna) on four 32-bit words, computed with LuaJIT's `bit`
-- operations on plain numbers, so the state is four integers that serialize exactly
-- (m3.serialize, JSON) and every platform draws the same values. Products stay below 2^51
-- (the range `bit.tobit` reduces exactly), hence the 16-bit split in mul32.
--
-- Streams: rng.new(seed, index, stream) mixes the integers (seed, index in [0, 2^53),
-- stream nil or in [0, 2^32)) through the murmur3 finalizer into the initial state,
-- so sample `index` of a data source has its own generator and a data cursor is just
-- (seed, index); distinct streams give independent draws for the same sample. No stream
-- (nil: what the task sources, file windows and sweeps draw from, which runs and their
-- checkpoints depend on) is a stream of its own, not stream 0: rng.new(s, i) and
-- rng.new(s, i, 0) differ. A stream that is not nil or such an integer is an error.
--
--   r:u32()        integer in [0, 2^32)
--   r:uniform()    float in [0, 1) with 53 random bits
--   r:below(n)     integer in [0, n), for an integer n in [1, 2^53] (anything else is an error)
--   r:state(), rng.from_state(s)   a plain table {a, b, c, d} (32-bit words as int32) and back;
--                  from_state takes four integers in [-2^31, 2^32) (a word as int32 or uint32),
--                  not all 0 (xoshiro's one state that never changes: it draws only 0)

local bit = require "bit"
local lib = require "m3.lib"
local options = require "m3.options"

lib.internal_file(debug.getinfo(1, "S").source)
local bxor, band, rshift, lshift, rol, tobit = bit.bxor, bit.band, bit.rshift, bit.lshift, bit.rol, bit.tobit
local floor = math.floor

local rng = {}
local R = {}
R.__index = R

-- Raises unless self is a generator (a method called with '.' gets its first argument instead).
local ITSELF = { [R] = true }
local function check_self(self, method, args)
  options.check_self(self, ITSELF, "m3.data.rng", "a generator (m3.data.rng.new)", "r", method, args)
end

-- (a * b) mod 2^32 as an int32, for int32 or uint32 inputs.
local function mul32(a, b)
  local lo, hi = band(a, 0xffff), rshift(a, 16)
  return tobit(lo * b + lshift(tobit(hi * b), 16))
end

local function fmix(h)
  h = bxor(h, rshift(h, 16))
  h = mul32(h, 0x85ebca6b)
  h = bxor(h, rshift(h, 13))
  h = mul32(h, 0xc2b2ae35)
  return bxor(h, rshift(h, 16))
end

local function split53(x, what)
  if type(x) ~= "number" or x < 0 or x ~= floor(x) or x >= 2 ^ 53 then
    error(string.format("m3.data.rng: %s must be an integer in [0, 2^53), got %s", what, tostring(x)), 3)
  end
  local lo = x % 4294967296
  return tobit(lo), tobit((x - lo) / 4294967296)
end

function rng.new(seed, index, stream)
  local s_lo, s_hi = split53(seed or 0, "seed")
  local i_lo, i_hi = split53(index or 0, "index")
  if stream ~= nil and (type(stream) ~= "number" or not (stream >= 0 and stream < 2 ^ 32)
    or stream ~= floor(stream)) then
    error(string.format("m3.data.rng: stream must be nil or an integer in [0, 2^32), got %s", tostring(stream)), 2)
  end
  local h = fmix(bxor(fmix(bxor(s_lo, 0x3c6ef372)), s_hi))
  if stream then h = fmix(bxor(h, tobit(stream + 0x27d4eb2f))) end
  h = fmix(bxor(h, fmix(bxor(i_lo, 0x1b873593))))
  h = fmix(bxor(h, i_hi))
  local r = setmetatable({}, R)
  r.a = fmix(tobit(h + 0x1))
  r.b = fmix(tobit(h + 0x61c88647))
  r.c = fmix(tobit(h - 0x3c6ef372))
  r.d = fmix(tobit(h + 0x7f4a7c15))
  if r.a == 0 and r.b == 0 and r.c == 0 and r.d == 0 then r.a = 1 end
  return r
end

function R:u32()
  check_self(self, "u32", "")
  local a, b, c, d = self.a, self.b, self.c, self.d
  local result = tobit(rol(tobit(b * 5), 7) * 9)
  local t = lshift(b, 9)
  c = bxor(c, a)
  d = bxor(d, b)
  b = bxor(b, c)
  a = bxor(a, d)
  c = bxor(c, t)
  d = rol(d, 11)
  self.a, self.b, self.c, self.d = a, b, c, d
  return result % 4294967296
end

function R:uniform()
  check_self(self, "uniform", "")
  local hi = floor(self:u32() / 2048)     -- 21 bits
  local lo = self:u32()                   -- 32 bits
  return (hi * 4294967296 + lo) / 9007199254740992
end

function R:below(n)
  check_self(self, "below", "n")
  if type(n) ~= "number" or not (n >= 1 and n <= 2 ^ 53) or n ~= floor(n) then
    lib.raise("m3.data.rng: below: n = " .. options.show(n) .. ": expected an integer in [1, 2^53]")
  end
  return floor(self:uniform() * n)
end

function R:state()
  check_self(self, "state", "")
  return { self.a, self.b, self.c, self.d }
end

function rng.from_state(s)
  if type(s) ~= "table" or #s ~= 4 then
    error("m3.data.rng.from_state: expected a table of four integers (r:state())", 2)
  end
  local zero = true
  for i = 1, 4 do
    local w = s[i]
    if type(w) ~= "number" or not (w >= -2 ^ 31 and w < 2 ^ 32) or w ~= floor(w) then
      lib.raise(string.format("m3.data.rng.from_state: s[%d] = %s: expected an integer in [-2^31, 2^32) (a 32-bit "
        .. "word of r:state())", i, options.show(w)))
    end
    zero = zero and w == 0
  end
  if zero then
    lib.raise("m3.data.rng.from_state: the state {0, 0, 0, 0} never changes (the generator would draw only 0): "
      .. "expected a state r:state() gave")
  end
  local r = setmetatable({}, R)
  r.a, r.b, r.c, r.d = tobit(s[1]), tobit(s[2]), tobit(s[3]), tobit(s[4])
  return r
end

return rng

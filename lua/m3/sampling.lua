-- m3.sampling — one token from a row of logits: greedy, temperature, top-k and top-p
-- (nucleus) sampling, drawn from an m3.data.rng generator so a seed fixes the result.
--
--   sampling.options(opts, what)      checked {temperature, top_k, top_p} with defaults
--   sampling.draw(logits, V, o, rng)  a token id in [0, V) from logits (a float pointer)
--
-- temperature 0 is greedy (argmax, lowest id on ties) and draws nothing. Otherwise the
-- probabilities are softmax(logits / temperature) restricted to the top_k largest logits
-- (0: all) and then to the smallest set of most likely tokens whose mass reaches top_p
-- (1: all), renormalised. For top_p alone only tokens with p >= (1 - top_p) / V are sorted:
-- the others together hold less than 1 - top_p, so the nucleus never reaches them.

local ffi = require "ffi"
local lib = require "m3.lib"
local options = require "m3.options"

lib.internal_file(debug.getinfo(1, "S").source)

local raise, show = lib.raise, options.show
local exp = math.exp

local sampling = {}

function sampling.options(opts, what)
  local o = { temperature = 1, top_k = 0, top_p = 1 }
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
  return o
end

local function argmax(lg, V)
  local best, at = lg[0], 0
  for i = 1, V - 1 do
    if lg[i] > best then best, at = lg[i], i end
  end
  return at
end

-- Ids of the k largest logits, largest first (ties: lower id first).
local function top_k_ids(lg, V, k)
  local ids, n = {}, 0
  for i = 0, V - 1 do
    local v = lg[i]
    if n < k or v > lg[ids[n]] then
      local j = n < k and n + 1 or n
      while j > 1 and v > lg[ids[j - 1]] do
        ids[j] = ids[j - 1]
        j = j - 1
      end
      ids[j] = i
      if n < k then n = n + 1 end
    end
  end
  return ids, n
end

-- A draw among ids[1..n] with weights w[1..n] (unnormalised).
local function pick(ids, w, n, total, rng)
  local u, acc = rng:uniform() * total, 0
  for j = 1, n do
    acc = acc + w[j]
    if u < acc then return ids[j] end
  end
  return ids[n]
end

local function draw_all(lg, V, inv_t, rng, scratch)
  local m = lg[argmax(lg, V)]
  local total = 0
  for i = 0, V - 1 do
    local e = exp((lg[i] - m) * inv_t)
    scratch[i] = e
    total = total + e
  end
  local u, acc = rng:uniform() * total, 0
  for i = 0, V - 1 do
    acc = acc + scratch[i]
    if u < acc then return i end
  end
  return V - 1
end

-- The nucleus of sorted ids (weights w, total mass total): its length.
local function nucleus(w, n, total, top_p)
  local acc = 0
  for j = 1, n do
    acc = acc + w[j]
    if acc >= top_p * total then return j end
  end
  return n
end

local scratch_of = setmetatable({}, { __mode = "k" })

function sampling.draw(lg, V, o, rng)
  if o.temperature == 0 then return argmax(lg, V) end
  local inv_t = 1 / o.temperature
  if o.top_k == 0 and o.top_p >= 1 then
    local s = scratch_of[rng]
    if not s or s.n < V then
      s = { n = V, buf = ffi.new("double[?]", V) }
      scratch_of[rng] = s
    end
    return draw_all(lg, V, inv_t, rng, s.buf)
  end
  local ids, n, mass -- candidates, and the mass top_p is a share of (nil: theirs)
  local m = lg[argmax(lg, V)]
  if o.top_k > 0 then
    ids, n = top_k_ids(lg, V, math.min(o.top_k, V))
  else
    mass = 0
    for i = 0, V - 1 do mass = mass + exp((lg[i] - m) * inv_t) end
    local floor_ = (1 - o.top_p) / V * mass
    ids, n = {}, 0
    for i = 0, V - 1 do
      if exp((lg[i] - m) * inv_t) >= floor_ then
        n = n + 1
        ids[n] = i
      end
    end
    table.sort(ids, function(a, b)
      if lg[a] ~= lg[b] then return lg[a] > lg[b] end
      return a < b
    end)
  end
  local w, total = {}, 0
  for j = 1, n do
    w[j] = exp((lg[ids[j]] - m) * inv_t)
    total = total + w[j]
  end
  if o.top_p < 1 then
    n = nucleus(w, n, mass or total, o.top_p)
    total = 0
    for j = 1, n do total = total + w[j] end
  end
  return pick(ids, w, n, total, rng)
end

return sampling

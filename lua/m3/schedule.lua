-- m3.schedule — learning-rate schedules as pure functions step -> lr.
--
-- Steps are 1-based: f(s) is the learning rate of the s-th optimizer step (apply it
-- before that step). Internally t = s - 1 steps have been taken, as in PyTorch's
-- LambdaLR, so a warmup of w steps rises as peak * s / w and reaches peak at s = w, and a
-- decay over `total` steps starts at peak right after the warmup and reaches `floor` at
-- s = total + 1: every lr of steps 1..total stays above the floor (and > 0 with the
-- default floor 0, which the trainer requires). Every schedule, composed ones included,
-- raises an error for a step that is not an integer from 1 to 2^53 (0, a negative step,
-- NaN, 2.5; the trainer counts steps exactly up to 2^53) and for a value that is not a
-- finite number >= 0 (a step_decay whose gamma^k overflows, a piece of a sequence that
-- returns something else).
--
--   constant(lr)                                  lr
--   linear{from =, to =, steps =}                 from -> to over steps, then to; a rise
--                                                 is a warmup (to at s = steps: from = 0
--                                                 gives to / steps at s = 1), a fall a
--                                                 decay (from at s = 1, to at s = steps + 1);
--                                                 from and to not both 0
--   linear_warmup{peak =, warmup =}               peak * s / warmup, then peak
--   cosine{peak =, total =, floor = 0}            half cosine from peak to floor (no warmup
--                                                 option, not even 0: see warmup_cosine)
--   warmup_cosine{peak =, warmup =, total =, floor = 0}
--   step_decay{lr =, gamma = 0.1, every = | milestones = {...}}
--                                                 lr * gamma^k, k = decays taken: every
--                                                 `every` steps (steps every+1, 2*every+1,
--                                                 ... are the first decayed), or at each
--                                                 milestone m (step m is the first decayed)
--   wsd{peak =, warmup =, total =, decay = 0.2, floor = 0, shape = "linear"}
--                                                 warmup-stable-decay: warmup, constant
--                                                 peak, then a decay over the last `decay`
--                                                 steps (a count, or a fraction of total
--                                                 when < 1) with shape "linear", "cosine"
--                                                 or "sqrt" (1 - sqrt(p))
--   sequence{{f1, steps = n1}, {f2, steps = n2}, ..., {fk}}
--                                                 f1 for n1 steps (a finite count), then f2
--                                                 from its own step 1, ...; the last piece
--                                                 runs on
--   scale(f, k)                                   k * f(s), k > 0
--   apply(tr, f, step)                            tr:set_lr(f(step)); returns the lr; an lr
--                                                 that is not > 0 (a floor of 0 reached after
--                                                 the last step) is an error naming the step
--   values(f, n)                                  {f(1), ..., f(n)} (plots, tests)

local lib = require "m3.lib"
local options = require "m3.options"
local exact = require("m3.number_text").exact

lib.internal_file(debug.getinfo(1, "S").source)

local pi, cos, sqrt, floor, min, max = math.pi, math.cos, math.sqrt, math.floor, math.min, math.max
local raise, check_keys, want_int, show = lib.raise, options.check_keys, options.want_int, options.show

local schedule = {}

local function num(o, field, what, lo, optional_default)
  local v = o[field]
  if v == nil and optional_default ~= nil then return optional_default end
  if type(v) ~= "number" or v ~= v or v < lo or v == math.huge then
    raise(string.format("m3.schedule.%s: expected %s >= %s, got %s", what, field, tostring(lo),
      show(v)))
  end
  return v
end

local function int(o, field, what, lo, optional_default)
  local v = num(o, field, what, lo, optional_default)
  if v ~= floor(v) then
    raise(string.format("m3.schedule.%s: expected %s to be an integer, got %s", what, field, tostring(v)))
  end
  return v
end

local function opts(o, what, valid) return options.check_table(o, valid, "m3.schedule." .. what) end

local CONSTANT = { lr = true }
local LINEAR = { from = true, to = true, steps = true }
local LINEAR_WARMUP = { peak = true, warmup = true }
local COSINE = { peak = true, total = true, floor = true }
local WARMUP_COSINE = { peak = true, warmup = true, total = true, floor = true }
local WSD = { peak = true, warmup = true, total = true, floor = true, decay = true, shape = true }
local STEP_DECAY = { lr = true, gamma = true, every = true, milestones = true }
local PIECE = { steps = true }

local function positive(o, field, what)
  local v = o[field]
  if type(v) ~= "number" or not (v > 0) or v == math.huge then
    raise(string.format("m3.schedule.%s: expected %s > 0, got %s", what, field, show(v)))
  end
  return v
end

-- s, once it is a step: an integer from 1 to 2^53 (the trainer's step count, exact up to 2^53).
local function want_step(s, name)
  if type(s) ~= "number" or s ~= floor(s) or s < 1 or s == math.huge then
    raise(string.format("%s = %s: expected an integer >= 1", name, show(s)))
  end
  if s > 2 ^ 53 then raise(string.format("%s = %s: expected an integer from 1 to 2^53", name, exact(s))) end
  return s
end

-- lr, once it is a schedule's value at step s (what: the schedule): a finite number >= 0, or
-- > 0 for_trainer (what tr:set_lr takes).
local function want_value(lr, what, s, for_trainer)
  if type(lr) ~= "number" or not (lr > 0 or lr == 0 and not for_trainer) or lr == math.huge then
    raise(string.format("m3.schedule.%s: lr = %s at step %s: expected a finite number %s", what, show(lr), exact(s),
      for_trainer and "> 0 (the trainer's lr)" or ">= 0"))
  end
  return lr
end

-- The schedule f with its step and its value checked, else an error at the caller's line.
local function checked(what, f)
  local name = "m3.schedule." .. what .. ": step"
  return function(s)
    want_step(s, name)
    return want_value(f(s), what, s)
  end
end

-- Half-cosine from 1 at p = 0 to 0 at p = 1.
local function half_cosine(p) return 0.5 * (1 + cos(pi * p)) end

function schedule.constant(lr)
  if type(lr) == "table" then lr = opts(lr, "constant", CONSTANT).lr end
  if type(lr) ~= "number" or not (lr > 0) or lr == math.huge then
    raise("m3.schedule.constant: expected a learning rate > 0, got " .. show(lr))
  end
  return checked("constant", function() return lr end)
end

function schedule.linear(o)
  opts(o, "linear", LINEAR)
  local from, to = num(o, "from", "linear", 0), num(o, "to", "linear", 0)
  local steps = int(o, "steps", "linear", 1)
  if from == 0 and to == 0 then raise("m3.schedule.linear: expected from > 0 or to > 0, got both 0") end
  -- a rise is a warmup (from at step 0, never applied), a fall a decay (to at step steps + 1),
  -- as in warmup_cosine: an end at 0 is never the lr of a step of the ramp
  local t0 = to > from and 0 or 1
  return checked("linear", function(s)
    return from + (to - from) * min((s - t0) / steps, 1)
  end)
end

function schedule.linear_warmup(o)
  opts(o, "linear_warmup", LINEAR_WARMUP)
  local peak, warmup = positive(o, "peak", "linear_warmup"), int(o, "warmup", "linear_warmup", 1)
  return checked("linear_warmup", function(s)
    return s < warmup and peak * s / warmup or peak
  end)
end

local function warmup_decay(what, o)
  local peak = positive(o, "peak", what)
  local warmup = int(o, "warmup", what, 0, 0)
  local total = int(o, "total", what, 1)
  local floor_lr = num(o, "floor", what, 0, 0)
  if total <= warmup then
    raise(string.format("m3.schedule.%s: expected total > warmup, got total = %d, warmup = %d",
      what, total, warmup))
  end
  if floor_lr > peak then
    raise(string.format("m3.schedule.%s: expected floor <= peak, got %s > %s", what, floor_lr, peak))
  end
  return peak, warmup, total, floor_lr
end

local function warmup_cosine(what, o)
  local peak, warmup, total, floor_lr = warmup_decay(what, o)
  return checked(what, function(s)
    if s <= warmup then return peak * s / warmup end
    local p = min((s - 1 - warmup) / (total - warmup), 1)
    return floor_lr + (peak - floor_lr) * half_cosine(p)
  end)
end

function schedule.warmup_cosine(o)
  return warmup_cosine("warmup_cosine", opts(o, "warmup_cosine", WARMUP_COSINE))
end

function schedule.cosine(o)
  if type(o) == "table" and o.warmup ~= nil then
    raise("m3.schedule.cosine: warmup = " .. show(o.warmup) .. ": cosine has no warmup option; leave it out for "
      .. "none, or use warmup_cosine{peak =, warmup =, total =}")
  end
  opts(o, "cosine", COSINE)
  return warmup_cosine("cosine", o)
end

local decay_shapes = {
  linear = function(p) return 1 - p end,
  cosine = half_cosine,
  sqrt = function(p) return 1 - sqrt(p) end,
}

function schedule.wsd(o)
  local peak, warmup, total, floor_lr = warmup_decay("wsd", opts(o, "wsd", WSD))
  local given = num(o, "decay", "wsd", 0, 0.2)
  local decay = given < 1 and floor(given * total + 0.5) or given
  if decay ~= floor(decay) or decay < 1 or decay > total - warmup then
    raise(string.format("m3.schedule.wsd: expected decay (steps, or a fraction of total) in "
      .. "[1, total - warmup = %d] steps, got %s%s%s", total - warmup, show(given),
      o.decay == nil and " (the default)" or "",
      given < 1 and string.format(", %s steps of total = %s", exact(decay), exact(total)) or ""))
  end
  local shape = decay_shapes[o.shape or "linear"]
  if not shape then
    raise('m3.schedule.wsd: shape must be "linear", "cosine" or "sqrt", got ' .. show(o.shape))
  end
  local start = total - decay
  return checked("wsd", function(s)
    if s <= warmup then return peak * s / warmup end
    local t = s - 1
    if t < start then return peak end
    return floor_lr + (peak - floor_lr) * shape(min((t - start) / decay, 1))
  end)
end

function schedule.step_decay(o)
  opts(o, "step_decay", STEP_DECAY)
  local lr = positive(o, "lr", "step_decay")
  local gamma = o.gamma == nil and 0.1 or positive(o, "gamma", "step_decay")
  local every, milestones = o.every, o.milestones
  if (every == nil) == (milestones == nil) then
    raise("m3.schedule.step_decay: give exactly one of every (steps) and milestones (a list of steps)")
  end
  if every then
    every = int(o, "every", "step_decay", 1)
    return checked("step_decay", function(s) return lr * gamma ^ floor((s - 1) / every) end)
  end
  local want = "m3.schedule.step_decay: milestones must be a list of increasing steps (integers >= 1)"
  if not options.is_list(milestones) then raise(want .. ", got " .. show(milestones)) end
  for i, m in ipairs(milestones) do
    if type(m) ~= "number" or m ~= floor(m) or m < 1 or (i > 1 and m <= milestones[i - 1]) then
      raise(string.format("%s, got milestones[%d] = %s", want, i, show(m)))
    end
  end
  return checked("step_decay", function(s)
    local k = 0
    for _, m in ipairs(milestones) do
      if s >= m then k = k + 1 end
    end
    return lr * gamma ^ k
  end)
end

function schedule.sequence(pieces)
  if not options.is_list(pieces) or #pieces == 0 then -- a hole would drop the pieces after it
    raise("m3.schedule.sequence: expected a list of pieces {f, steps = n} (keys 1 to k, no hole), got " .. show(pieces))
  end
  local starts, fns = {}, {}
  local at = 0
  for i, p in ipairs(pieces) do
    if type(p) ~= "table" or type(p[1]) ~= "function" then
      raise(string.format("m3.schedule.sequence: piece %d must be {f, steps = n} with f a schedule", i))
    end
    local named = {}
    for k, v in pairs(p) do
      if k ~= 1 then named[k] = v end
    end
    check_keys(named, PIECE, string.format("m3.schedule.sequence: piece %d", i))
    starts[i], fns[i] = at, p[1]
    if i < #pieces then
      local n = p.steps
      if type(n) ~= "number" or n < 1 or n ~= floor(n) or n == math.huge then
        raise(string.format("m3.schedule.sequence: piece %d needs steps = an integer >= 1, got %s", i, show(n)))
      end
      at = at + n
    end
  end
  return checked("sequence", function(s)
    for i = #fns, 1, -1 do
      if s > starts[i] then return fns[i](s - starts[i]) end
    end
  end)
end

function schedule.scale(f, k)
  if type(f) ~= "function" then
    raise("m3.schedule.scale: expected a schedule (a function), got " .. type(f))
  end
  if type(k) ~= "number" or not (k > 0) or k == math.huge then
    raise("m3.schedule.scale: expected k > 0, got " .. show(k))
  end
  return checked("scale", function(s) return k * want_value(f(s), "scale", s) end)
end

function schedule.apply(tr, f, step)
  if type(tr) ~= "table" or type(tr.set_lr) ~= "function" then
    raise("m3.schedule.apply: expected a trainer (m3.trainer), got " .. options.describe(tr))
  end
  if type(f) ~= "function" then
    raise("m3.schedule.apply: expected a schedule (a function), got " .. type(f))
  end
  want_step(step, "m3.schedule.apply: step")
  local lr = want_value(f(step), "apply", step, true)
  tr:set_lr(lr)
  return lr
end

function schedule.values(f, n)
  if type(f) ~= "function" then
    raise("m3.schedule.values: expected a schedule (a function), got " .. type(f))
  end
  want_int(n, "m3.schedule.values: n", 0)
  local out = {}
  for s = 1, n do out[s] = f(s) end
  return out
end

return schedule

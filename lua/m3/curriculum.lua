-- m3.curriculum — training phases as data, looked up by step.
--
-- A curriculum is a list of phases; each phase is a plain table with `steps` (how many
-- optimizer steps it lasts; the last phase may omit it and runs on) and any training
-- knobs: `length` (sequence length), `min_length`, `batch` (rows per optimizer step),
-- task difficulty (e.g. `pairs` for mqar, `ops` for arithmetic), mixture `weights`, ...
-- A phase inherits every field it does not set from the phase before, and its fields are
-- named like the options of m3.data sources, so a phase can be passed to src:next as is.
-- The phase of a step is a pure function of the step, so a resumed run needs only its
-- step to be back in the right phase: new() keeps copies of the phases it is given, and
-- phase() and phases() hand out new copies (nested tables such as weights included), so
-- changing what they return changes no later lookup.
--
--   local cur = curriculum.new{ {steps = 100, length = 8, batch = 32}, {steps = 100,
--     length = 16}, {length = 32} }
--   cur:phase(150)             -> {steps = 100, length = 16, batch = 32, index = 2,
--                                  first = 101, last = 200}  (steps 1-based)
--   cur:max("length")          -> 32 (allocate the trainer once for the largest shape)
--   for step, phase in cur:iter(1, 300) do ... end   (both bounds required)
--   curriculum.lengths{from = 8, to = 32, steps = 3000, factor = 2, min_length = 1}
--                              -> lengths 8, 16, 32 in equal thirds of the steps
--                                 (min_length: each sample draws its length from
--                                 [min_length, length]; default: = length). Other
--                                 fields (batch, the options of the m3.data tasks,
--                                 pad_to, offset, weights) go into every phase; any
--                                 other name is an error. At most 1000 stages.

local lib = require "m3.lib"
local options = require "m3.options"
local source = require "m3.data.source"
local tasks = require "m3.data.tasks"

lib.internal_file(debug.getinfo(1, "S").source)

local curriculum = {}
local C = {}
C.__index = C

-- Raises unless self is a curriculum (a method called with '.' gets its first argument instead).
local ITSELF = { [C] = true }
local function check_self(self, method, args)
  options.check_self(self, ITSELF, "m3.curriculum", "a curriculum (m3.curriculum.new)", "cur", method, args)
end

local show = options.show

-- A copy of v: tables (without a metatable) copied through every level, anything else as is.
local function copy(v, seen)
  if type(v) ~= "table" or getmetatable(v) ~= nil then return v end
  seen = seen or {}
  if seen[v] then return seen[v] end
  local c = {}
  seen[v] = c
  for k, x in pairs(v) do c[copy(k, seen)] = copy(x, seen) end
  return c
end

-- A finite integer >= 1 (math.huge and NaN are not).
local function is_count(v)
  return type(v) == "number" and v >= 1 and v < math.huge and v == math.floor(v)
end

function curriculum.new(phases)
  if not options.is_list(phases) or #phases == 0 then -- a hole would drop the phases after it
    lib.raise("m3.curriculum.new: expected a list of phases (keys 1 to n, no hole), e.g. {{steps = 100, length = 8}, "
      .. "{length = 16}}, got " .. show(phases))
  end
  local self = setmetatable({ _list = {} }, C)
  local prev, first = {}, 1
  for i, p in ipairs(phases) do
    if type(p) ~= "table" then
      lib.raise(string.format("m3.curriculum.new: phase %d is a %s, expected a table", i, type(p)))
    end
    if p.steps == nil and i < #phases then
      lib.raise(string.format("m3.curriculum.new: phase %d needs steps (only the last phase may run on)", i))
    end
    if p.steps ~= nil and not is_count(p.steps) then
      lib.raise(string.format("m3.curriculum.new: phase %d: steps must be an integer >= 1, got %s", i,
        show(p.steps)))
    end
    local full = {}
    for k, v in pairs(prev) do full[k] = v end
    for k, v in pairs(p) do full[k] = copy(v) end
    full.steps = p.steps
    full.index, full.first = i, first
    full.last = p.steps and first + p.steps - 1 or math.huge
    self._list[i] = full
    prev, first = full, full.last + 1
  end
  return self
end

-- A copy of the phase of 1-based step s (the last phase for steps past the end).
function C:phase(s)
  check_self(self, "phase", "step")
  if not is_count(s) then
    lib.raise("m3.curriculum: phase expects a step (an integer >= 1), got " .. show(s))
  end
  local list = self._list
  for i = 1, #list do
    if s <= list[i].last then return copy(list[i]) end
  end
  return copy(list[#list])
end

-- The largest value of a numeric field over all phases (nil when no phase sets it).
function C:max(field)
  check_self(self, "max", "field")
  local m
  for _, p in ipairs(self._list) do
    local v = p[field]
    if type(v) == "number" and (m == nil or v > m) then m = v end
  end
  return m
end

-- Total steps of all phases (math.huge when the last phase runs on).
function C:total()
  check_self(self, "total", "")
  return self._list[#self._list].last
end

-- A list of copies of the phases.
function C:phases()
  check_self(self, "phases", "")
  local out = {}
  for i, p in ipairs(self._list) do out[i] = copy(p) end
  return out
end

-- Iterates step, phase for steps first..last (both required; none when last < first).
function C:iter(first, last)
  check_self(self, "iter", "first, last")
  if not (is_count(first) and is_count(last)) then
    lib.raise(string.format("m3.curriculum: iter(first, last) expects two steps (integers >= 1), got first = %s, "
      .. "last = %s", show(first), show(last)))
  end
  local s = first - 1
  return function()
    s = s + 1
    if s > last then return nil end
    return s, self:phase(s)
  end
end

-- The most stages curriculum.lengths makes, and how many of their lengths a message shows.
local MAX_STAGES, SHOWN = 1000, 8

-- The stage lengths for a message, ending at `to`: all of them when they are few (SHOWN and to,
-- where "..." would hide nothing), else the first SHOWN, "..." and to.
local function shown_lengths(lengths, to)
  if #lengths <= SHOWN + 1 and lengths[#lengths] == to then return table.concat(lengths, ", ") end
  return table.concat(lengths, ", ", 1, math.min(#lengths, SHOWN)) .. ", ..., " .. to
end

-- A length curriculum from `from` to `to` (multiplying by `factor`, default 2, the last
-- stage capped at `to`) over `steps` steps split evenly; extra fields of o are copied into
-- every phase.
-- The fields of curriculum.lengths: its own, and those it copies into every phase (a
-- phase's length is its own).
local LENGTHS = { from = true, to = true, steps = true, factor = true, batch = true, weights = true }
for k in pairs(source.OPTIONS) do LENGTHS[k] = true end
for _, task in pairs(tasks) do
  for k in pairs(type(task) == "table" and task.options or {}) do
    if k ~= "length" then LENGTHS[k] = true end
  end
end

function curriculum.lengths(o)
  options.check_table(o, LENGTHS, "m3.curriculum.lengths")
  local from, to, steps, factor = o.from, o.to, o.steps, o.factor or 2
  if not (is_count(from) and is_count(to) and from <= to) then
    lib.raise(string.format("m3.curriculum.lengths: expected integers 1 <= from <= to, got from = %s, to = %s",
      show(from), show(to)))
  end
  if not is_count(steps) then
    lib.raise("m3.curriculum.lengths: steps must be an integer >= 1, got " .. show(steps))
  end
  if type(factor) ~= "number" or not (factor > 1 and factor < math.huge) then
    lib.raise("m3.curriculum.lengths: factor must be a finite number > 1, got " .. show(factor))
  end
  if o.min_length ~= nil and not (is_count(o.min_length) and o.min_length <= from) then
    lib.raise(string.format("m3.curriculum.lengths: min_length must be an integer in [1, from = %d] (every stage "
      .. "draws lengths from [min_length, its length]), got %s", from, show(o.min_length)))
  end
  local lengths, L = {}, from
  while L < to do
    if #lengths + 2 > MAX_STAGES then -- L and to would make one stage too many
      lib.raise(string.format("m3.curriculum.lengths: from = %d to %d by factor = %s makes more than %d stages, "
        .. "the most it builds (lengths %s); use a larger factor", from, to, show(factor), MAX_STAGES,
        shown_lengths(lengths, to)))
    end
    lengths[#lengths + 1] = L
    L = math.max(L + 1, math.floor(L * factor + 0.5))
  end
  lengths[#lengths + 1] = to
  if #lengths > steps then
    lib.raise(string.format("m3.curriculum.lengths: %d stages (lengths %s) do not fit in %d steps: at least one "
      .. "step a stage", #lengths, shown_lengths(lengths, to), steps))
  end
  local phases, used = {}, 0
  for i, len in ipairs(lengths) do
    local n = math.floor(steps * i / #lengths) - used
    used = used + n
    local p = {}
    for k, v in pairs(o) do
      if k ~= "from" and k ~= "to" and k ~= "factor" and k ~= "steps" then p[k] = v end
    end
    p.length, p.steps = len, n
    phases[i] = p
  end
  return curriculum.new(phases)
end

return curriculum

-- m3.data.source — batches from a synthetic task, deterministic and resumable.
--
-- A source draws sample `index` from its own generator rng.new(seed, index), so the
-- whole stream is a pure function of (seed, index) and the options of each call: the
-- cursor {seed =, index =} is all a checkpoint needs to continue with the same batches.
--
--   local src = source.new(tasks.parity, {seed = 1, length = 32})
--   local batch = src:next(rows, {length = 16, min_length = 2})  -- options of this call
--   batch.tokens, batch.targets   int32 [rows, T] m3 tensors (T = longest sample, or
--                                 o.pad_to); shorter samples are padded with token 0
--                                 and target -1 after their end (causal models never see
--                                 the padding from the scored positions)
--   src:cursor(), src:seek(cursor)   (source.check_cursor: what every source's seek takes; the
--                                    rows =, position = of a stream's cursor only a stream's)
--   src.shortest                     the least length its task draws (tasks: shortest), the
--                                    least min_length a call may give
--
-- Options (o, per call over the source's defaults): the task's options (length,
-- min_length, targets, ...), pad_to (an integer >= 1), and offset (an integer >= 0, added
-- to every token and target id, to give several tasks of a mixture disjoint vocabularies).
-- src.vocab is fixed when the source is made: a call whose options need more ids (a larger
-- modulus, keys, values or offset) is an error, as its ids would reach past the model's vocab;
-- so is a vocab past 2^24, the largest vocab_size of a model. A batch holds at most 2^31 - 1
-- positions (source.MAX_POSITIONS: the engine counts rows * len in an int32): a call whose rows
-- of its longest sample (or pad_to) hold more is an error before any is drawn. src:_longest(o) is
-- the length of the longest sample a call with options o may draw (at most 2^27, tasks.MAX_LENGTH).
-- A call also takes the names m3.fit passes along (source.FIT) and min_length (a phase of
-- curriculum.lengths may hold it whatever the task; mqar draws no lengths); any other name
-- is an error, as in the constructor. src.next_options is the set of the names next takes.
--
-- source.mixture(sources, {seed =, weights =}) picks the source of each row with the
-- given weights (a list, one finite number >= 0 per source, not all 0; per call as
-- o.weights; both checked when given) from its own stream. Sources: task sources, file
-- sources of order "random" or "sequential" and mixtures (a stream's rows continue their
-- own text, which a mixture's rows cannot: refused); row `index` is the chosen source's
-- sample `index`. Its next takes weights, pad_to and the names any of its sources' next takes.

local lib = require "m3.lib"
local options = require "m3.options"
local rng = require "m3.data.rng"
local tasks = require "m3.data.tasks"
local tensor = require "m3.tensor"

lib.internal_file(debug.getinfo(1, "S").source)

local check_keys, want_int, show = options.check_keys, options.want_int, options.show

local source = {}

-- The options every source takes besides its task's, at construction and per call.
source.OPTIONS = { pad_to = true, offset = true }
-- The names m3.fit passes to a source's next besides the data options: a curriculum phase's
-- own (steps, batch, index, first, last) and fit.evaluate's (batches, rows).
source.FIT = { steps = true, batch = true, index = true, first = true, last = true, batches = true, rows = true }

local function overlay(...)
  local out = {}
  for i = 1, select("#", ...) do
    local t = select(i, ...)
    if t then for k, v in pairs(t) do out[k] = v end end
  end
  return out
end
source.overlay = overlay

-- Whether v is an integer in [0, 2^53): a seed or an index m3.data.rng takes.
local function is_id(v)
  return type(v) == "number" and v >= 0 and v < 2 ^ 53 and v == math.floor(v)
end
source.is_id = is_id

-- Raises (what: for the message) unless index is a sample index: an integer in [0, 2^53).
function source.check_index(index, what)
  if not is_id(index) then
    lib.raise(string.format("%s: index = %s: expected an integer in [0, 2^53)", what, show(index)))
  end
end

-- Raises (what: for the message) unless c is a cursor {seed =, index =} a source can seek to;
-- the fields an order = "stream" file source's cursor adds only where stream is true (a
-- source of another kind would drop where each row of the stream stood).
function source.check_cursor(c, what, stream)
  if type(c) ~= "table" or not is_id(c.seed) or not is_id(c.index) then
    lib.raise(what .. ": expected a cursor {seed =, index =}, each an integer in [0, 2^53), got "
      .. (type(c) == "table" and string.format("{seed = %s, index = %s}", show(c.seed), show(c.index)) or show(c)))
  end
  if stream then return end
  for _, field in ipairs { "rows", "position" } do
    if c[field] ~= nil then
      lib.raise(string.format('%s: cursor.%s = %s: the cursor of an order = "stream" file source, which this source '
        .. "cannot continue (its cursor is {seed =, index =})", what, field, show(c[field])))
    end
  end
end

-- opts.offset (0 when not given), once it is an integer >= 0 (what: for the message).
local function offset_of(opts, what)
  if opts.offset == nil then return 0 end
  return want_int(opts.offset, what .. ": offset", 0)
end

-- The vocab a task's options o need (offset included), at most a model's largest vocab_size,
-- and the options that set it, as text.
local function vocab_of(task, o)
  local what = "m3.data." .. task.name
  local off = offset_of(o, what)
  local vocab, sizes = task.vocab, "offset = " .. off
  if task.shape then
    local _
    vocab, _, sizes = task.shape(o)
    sizes = sizes .. ", offset = " .. off
  end
  if vocab + off > tasks.MAX_VOCAB then
    lib.raise(string.format("%s: offset = %d: the vocab (%d token ids of the task + offset) must be at most %d, the "
      .. "largest vocab_size of a model", what, off, vocab, tasks.MAX_VOCAB))
  end
  return vocab + off, sizes
end

-- The most positions of a batch: the engine counts a window's rows * len in an int32
-- (m3_trainer_cfg: batch * seq_len <= 2^31 - 1).
source.MAX_POSITIONS = 2147483647

-- Raises (what: for the message) unless rows rows of width ids (the longest a call may draw, or
-- its pad_to; rows_text: "rows of pad_to = %d ids", say) fit in a batch the engine can take, before
-- any is drawn.
function source.check_batch(rows, width, rows_text, what)
  if rows * width > source.MAX_POSITIONS then
    lib.raise(string.format("%s: %d %s make %.0f positions, more than a batch holds (%d: the engine counts rows * "
      .. "len in an int32); draw fewer rows or shorter ones", what, rows, string.format(rows_text, width),
      rows * width, source.MAX_POSITIONS))
  end
end

-- The longest row a call with options o may give (those options checked) and check_batch's text for it:
-- o.pad_to when given, else longest(o), the longest sample.
local function row_width(o, longest)
  if o and o.pad_to ~= nil then return want_int(o.pad_to, "m3.data: pad_to", 1), "rows of pad_to = %d ids" end
  return longest(o), "rows of samples of up to %d ids"
end

-- The full options of a call with options o (over src's defaults), once the ids they give fit
-- in src.vocab.
local function call_options(src, o)
  local opts = overlay(src.defaults, o)
  local need, sizes = vocab_of(src.task, opts)
  if need > src.vocab then
    lib.raise(string.format("m3.data.%s: this call's options (%s) need vocab %d, more than this source's %d "
      .. "(src.vocab, for the model's vocab_size): make the source with the options that need the most ids",
      src.task.name, sizes, need, src.vocab))
  end
  return opts
end

-- Sample `index` of src for the full options opts (call_options), token and target ids
-- shifted by opts.offset.
local function draw(src, index, opts)
  local off = opts.offset or 0
  local toks, tgts = src.task.sample(rng.new(src.seed, index), opts)
  if off ~= 0 then
    for t = 1, #toks do
      toks[t] = toks[t] + off
      if tgts[t] >= 0 then tgts[t] = tgts[t] + off end
    end
  end
  return toks, tgts
end

-- Packs samples (lists of {tokens, targets}) into int32 tensors [#samples, T].
function source.pack(samples, pad_to)
  local width = 0
  for _, s in ipairs(samples) do width = math.max(width, #s[1]) end
  if pad_to then
    want_int(pad_to, "m3.data: pad_to", 1)
    if pad_to < width then
      lib.raise(string.format("m3.data: pad_to = %d is shorter than the longest sample (%d)", pad_to, width))
    end
    width = pad_to
  end
  local rows = #samples
  local tokens, targets = tensor({ rows, width }, "i32"), tensor({ rows, width }, "i32")
  local tk, tg = tokens.data, targets.data
  for r = 1, rows do
    local base, toks, tgts = (r - 1) * width, samples[r][1], samples[r][2]
    local n = #toks
    for t = 1, n do
      tk[base + t - 1] = toks[t]
      tg[base + t - 1] = tgts[t]
    end
    for t = n + 1, width do
      tk[base + t - 1] = 0
      tg[base + t - 1] = -1
    end
  end
  return { tokens = tokens, targets = targets }
end

local S = {}
S.__index = S

-- The metatables of the data sources (task sources and mixtures here, m3.data.file's sources), and the check
-- of a method's self (a method called with '.' gets its first argument instead).
source.ITSELF = { [S] = true }
function source.check_self(self, method, args)
  options.check_self(self, source.ITSELF, "m3.data", "a data source", "src", method, args)
end
local check_self = source.check_self

-- A source over task (see m3.data.tasks) with default options opts (seed, cursor,
-- source.OPTIONS and the task's options, checked as far as they go without a call's: task.check;
-- other keys are errors).
function source.new(task, opts)
  opts = opts or {}
  local valid = overlay(task.options, source.OPTIONS, { seed = true, cursor = true })
  check_keys(opts, valid, "m3.data." .. task.name)
  local self = setmetatable({ task = task, shortest = task.shortest, next_options = overlay(task.options,
    source.OPTIONS, source.FIT, { min_length = true }) }, S)
  self.defaults = overlay(task.defaults, opts)
  self.defaults.seed, self.defaults.cursor = nil, nil
  self.seed = options.check_seed(opts.seed, "m3.data." .. task.name)
  if task.check then task.check(self.defaults, opts) end
  self.index = 0
  if opts.cursor then self:seek(opts.cursor) end
  self.vocab = vocab_of(task, self.defaults)
  self.classes = task.shape and select(2, task.shape(self.defaults)) or task.classes
  return self
end

-- Sample `index` for options o (over the defaults): tokens, targets as Lua arrays.
function S:sample(index, o)
  check_self(self, "sample", "index, o")
  source.check_index(index, "m3.data: sample")
  if type(o) ~= "nil" and type(o) ~= "table" then -- (unknown names: a mixture passes every source all of its own)
    lib.raise("m3.data: sample: expected an options table, got " .. options.show(o))
  end
  return draw(self, index, call_options(self, o))
end

-- The length of the longest sample of a call with options o (over the defaults; checked).
function S:_longest(o)
  check_self(self, "_longest", "o")
  return self.task.longest(call_options(self, o))
end

function S:next(rows, o)
  check_self(self, "next", "rows, o")
  want_int(rows, "m3.data: next: rows", 1)
  if type(o) ~= "nil" then options.check_table(o, self.next_options, "m3.data: next") end
  local opts = call_options(self, o)
  local width, rows_text = row_width(opts, self.task.longest)
  source.check_batch(rows, width, rows_text, "m3.data: next")
  local samples = {}
  for r = 1, rows do
    local toks, tgts = draw(self, self.index + r - 1, opts)
    samples[r] = { toks, tgts }
  end
  local batch = source.pack(samples, opts.pad_to)
  self.index = self.index + rows
  return batch
end

function S:cursor()
  check_self(self, "cursor", "")
  return { seed = self.seed, index = self.index }
end

function S:seek(c)
  check_self(self, "seek", "c")
  source.check_cursor(c, "m3.data: seek")
  self.seed, self.index = c.seed, c.index
end

-- ---- mixtures ---------------------------------------------------------------------------

local M = setmetatable({}, { __index = S })
M.__index = M
source.ITSELF[M] = true

-- weights, once it is a list of n finite numbers >= 0 with a finite sum > 0 (what: for messages).
local function check_weights(weights, n, what)
  if type(weights) ~= "table" or #weights ~= n then
    lib.raise(string.format("%s: weights = %s: expected a list of %d numbers >= 0, one per source", what,
      type(weights) == "table" and "a list of " .. #weights or show(weights), n))
  end
  local total = 0
  for i = 1, n do
    local w = weights[i]
    if type(w) ~= "number" or not (w >= 0 and w < math.huge) then
      lib.raise(string.format("%s: weights[%d] = %s: expected a finite number >= 0", what, i, show(w)))
    end
    total = total + w
  end
  if not (total > 0 and total < math.huge) then
    lib.raise(string.format("%s: the weights sum to %s: expected a finite sum > 0", what, show(total)))
  end
  return weights
end

-- The source drawn with weights (checked) from generator r.
local function pick(r, weights)
  local total = 0
  for _, w in ipairs(weights) do total = total + w end
  local u, acc = r:uniform() * total, 0
  for i, w in ipairs(weights) do
    acc = acc + w
    if u < acc then return i end
  end
  return #weights
end

local MIXTURE = { seed = true, weights = true, cursor = true }

function source.mixture(sources, opts)
  opts = options.check_table(opts or {}, MIXTURE, "m3.data.mixture")
  if type(sources) ~= "table" or #sources == 0 then
    lib.raise("m3.data.mixture: expected a list of sources, got " .. show(sources))
  end
  local problem = options.not_a_list(sources)
  if problem then
    lib.raise(string.format("m3.data.mixture: the sources have %s: expected a list of sources", problem))
  end
  for i, s in ipairs(sources) do
    if type(s) ~= "table" or type(s.sample) ~= "function" or type(s._longest) ~= "function"
      or type(s.vocab) ~= "number" or type(s.next_options) ~= "table" then
      lib.raise(string.format("m3.data.mixture: sources[%d] = %s: expected an m3.data source", i, show(s)))
    end
    if s.order == "stream" then
      lib.raise(string.format('m3.data.mixture: sources[%d] is an order = "stream" source: its rows continue their '
        .. 'own text, which rows drawn from a mixture cannot (use order = "random" or "sequential")', i))
    end
  end
  local self = setmetatable({ sources = sources, seed = options.check_seed(opts.seed, "m3.data.mixture"),
    index = 0 }, M)
  if opts.weights ~= nil then
    self.weights = check_weights(opts.weights, #sources, "m3.data.mixture")
  else
    self.weights = {}
    for i = 1, #sources do self.weights[i] = 1 end
  end
  self.vocab, self.classes, self.next_options = 0, 0, { weights = true, pad_to = true }
  for _, s in ipairs(sources) do
    self.vocab = math.max(self.vocab, s.vocab)
    self.classes = math.max(self.classes, s.classes)
    for k in pairs(s.next_options) do self.next_options[k] = true end
  end
  if opts.cursor then self:seek(opts.cursor) end
  return self
end

-- Sample `index`: the chosen source's own sample `index`. o.weights are this mixture's, not
-- passed on; a mixture among the sources picks with r, this one's generator after its pick
-- (a generator of its own would repeat this pick when the seeds are equal).
function M:sample(index, o, r)
  check_self(self, "sample", "index, o")
  source.check_index(index, "m3.data: sample")
  local weights = self.weights
  if o and o.weights ~= nil then
    weights = check_weights(o.weights, #self.sources, "m3.data.mixture: this call")
    o = overlay(o)
    o.weights = nil
  end
  r = r or rng.new(self.seed, index, 1)
  local s = self.sources[pick(r, weights)]
  if getmetatable(s) == M then return s:sample(index, o, r) end
  return s:sample(index, o)
end

-- The longest sample any of the sources may give a call with options o (o.weights aside).
function M:_longest(o)
  check_self(self, "_longest", "o")
  if o and o.weights ~= nil then
    o = overlay(o)
    o.weights = nil
  end
  local longest = 0
  for _, s in ipairs(self.sources) do longest = math.max(longest, s:_longest(o)) end
  return longest
end

function M:next(rows, o)
  check_self(self, "next", "rows, o")
  want_int(rows, "m3.data: next: rows", 1)
  if type(o) ~= "nil" then options.check_table(o, self.next_options, "m3.data: next") end
  local width, rows_text = row_width(o, function(opts) return self:_longest(opts) end)
  source.check_batch(rows, width, rows_text, "m3.data: next")
  local samples = {}
  for r = 1, rows do
    local toks, tgts = self:sample(self.index + r - 1, o)
    samples[r] = { toks, tgts }
  end
  local batch = source.pack(samples, o and o.pad_to)
  self.index = self.index + rows
  return batch
end

return source

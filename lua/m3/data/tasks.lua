-- m3.data.tasks — exact generators for the synthetic sequence tasks.
--
-- A task is a table {name, vocab, classes, shortest, defaults, options, sample} where options is
-- the set of its option names and sample(r, o) -> tokens, targets draws one sequence from the generator r (m3.data.rng)
-- for options o (the task's defaults overlaid with the caller's). Both results are Lua
-- arrays of the same length; targets hold a class id or -1 where nothing is scored. A task
-- whose vocab depends on its options has shape(o) -> vocab, classes, the options that set them
-- as text ("modulus = 7": for messages; those options checked). longest(o) is the length of the
-- longest sample of options o (those options checked): at most 2^27 (tasks.MAX_LENGTH), as a sample
-- is drawn as Lua lists, whose array part LuaJIT caps there. check(o, given) checks each option of o on
-- its own, and those that go together as far as the options given fix them (a call may give the others:
-- min_length <= length when given gives both): m3.data.source checks a source's options when it is made.
-- The models read tokens and predict targets with an "lm" head (vocab = task.vocab). shortest
-- is the least length a sample can have (the least min_length, or mqar's least length).
--
-- parity       tokens 0/1 (bits), each 1 with probability `density` (default 0.5; "random":
--              a density drawn per sample, so that long runs of 0s and of 1s both occur).
--              targets = "running" (default): the parity of the prefix at every position,
--              a dense signal that trains fast and whose last value is the answer;
--              "final": only the last position (the paper's metric: evaluate there).
--              Random guessing scores 1/2.
-- arithmetic   modulus m (default 5): tokens 0..m-1 digits, m '+', m+1 '-', m+2 '*',
--              m+3 '(', m+4 ')', m+5 '='; vocab m+6. A sample of length L is an expression
--              of L-1 tokens followed by '='; the target at '=' is its value mod m
--              (standard precedence: '*' before '+' and '-', left to right). The vocab m+6 is
--              at most 2^24 (m3.config's largest vocab_size), which keeps every product exact.
--              brackets = false: digits and binary operators only (Deletang et al. 2023,
--              "modular arithmetic"; the expression length is made odd by dropping one
--              token); targets = "running" also scores every digit with the value of the
--              expression that ends there. brackets = true: the context-free version
--              (every binary operation in brackets, unary minus on digits, any length >= 1;
--              "final" targets only); brackets is a boolean. ops: the operators drawn,
--              default "+-*". Its answers are not uniform: a product with a 0 factor is 0,
--              so about 30% of them are 0 at length 64 (27% at 12), and always answering 0
--              beats a uniform guess (1/m).
-- mqar         multi-query associative recall (Arora et al. 2023): `pairs` key-value pairs
--              (keys distinct, tokens 0..keys-1; values keys..keys+values-1), then
--              `queries` keys from those pairs; the target at each query is its value.
--              Those of pairs and queries not given come from a length L: pairs = floor(L/3)
--              (at most keys), queries = L - 2*pairs (at least 1); with both given, L is
--              not read. Its vocab keys + values is at most 2^24, the largest
--              vocab_size a model takes (m3.config); a sample costs O(pairs), whatever keys.
--
-- Lengths: parity and arithmetic draw each sample's length uniformly from
-- [min_length, length] (min_length defaults to length), as in length curricula where a
-- phase trains on all lengths up to its maximum.

local lib = require "m3.lib"
local options = require "m3.options"

lib.internal_file(debug.getinfo(1, "S").source)

local floor = math.floor
local raise, show = lib.raise, options.show

local tasks = {}

-- The largest vocab_size m3.config takes (engine/src/config.c: 2^24 per field).
local MAX_VOCAB = 16777216
tasks.MAX_VOCAB = MAX_VOCAB
-- The longest sample: a sample is drawn as two Lua lists, whose array part LuaJIT caps at 2^27 items.
local MAX_LENGTH = 134217728
tasks.MAX_LENGTH = MAX_LENGTH

-- o[field], once it is an integer from lo to hi (default 2^31 - 1: a tensor dimension; inf is not).
local function check_int(o, field, lo, task, hi)
  local v = o[field]
  if type(v) ~= "number" or v ~= floor(v) or v < lo then
    raise(string.format("m3.data.%s: %s must be an integer >= %d, got %s", task, field, lo, tostring(v)))
  end
  if hi and v > hi then
    raise(string.format("m3.data.%s: %s = %s: must be at most %d (a sample is drawn as Lua lists, which hold "
      .. "at most 2^27 items)", task, field, tostring(v), hi))
  elseif v > 2147483647 then
    raise(string.format("m3.data.%s: %s = %s: must be at most 2147483647", task, field, tostring(v)))
  end
  return v
end

-- The lengths a sample of options o may have: min_length, length (each checked).
local function length_range(o, lo, task)
  local hi = check_int(o, "length", lo, task, MAX_LENGTH)
  local min = o.min_length or hi
  if type(min) ~= "number" or min ~= floor(min) or min < lo or min > hi then
    raise(string.format("m3.data.%s: min_length must be an integer in [%d, length = %d], got %s",
      task, lo, hi, tostring(min)))
  end
  return min, hi
end

-- length and min_length of options o each an integer in range, and min_length <= length when given
-- (the options of a source) gives both.
local function check_lengths(o, given, task)
  local lo = tasks[task].shortest
  check_int(o, "length", lo, task, MAX_LENGTH)
  if o.min_length ~= nil then check_int(o, "min_length", lo, task, MAX_LENGTH) end
  if given.length ~= nil and given.min_length ~= nil then length_range(o, lo, task) end
end

-- The length of one sample: uniform in [min_length, length].
local function draw_length(r, o, lo, task)
  local min, hi = length_range(o, lo, task)
  return min + r:below(hi - min + 1)
end

local function check_targets(o, task, allowed)
  local t = o.targets
  if not allowed[t] then
    local names = {}
    for k in pairs(allowed) do names[#names + 1] = '"' .. k .. '"' end
    table.sort(names)
    raise(string.format("m3.data.%s: targets must be %s, got %s", task,
      table.concat(names, " or "), tostring(t)))
  end
  return t
end

-- ---- parity ------------------------------------------------------------------------------

tasks.parity = {
  name = "parity", vocab = 2, classes = 2, shortest = 1,
  defaults = { length = 32, targets = "running", density = 0.5 },
  options = { length = true, min_length = true, targets = true, density = true },
}

-- The longest sample of options o (its lengths checked): what a batch of them may need.
function tasks.parity.longest(o)
  return select(2, length_range(o, tasks.parity.shortest, "parity"))
end

-- o.density, once it is a probability or "random".
local function parity_density(o)
  local density = o.density
  if density ~= "random" and (type(density) ~= "number" or not (density >= 0 and density <= 1)) then -- NaN too
    raise('m3.data.parity: density must be a probability in [0, 1] or "random", got ' .. show(density))
  end
  return density
end

function tasks.parity.check(o, given)
  check_targets(o, "parity", { running = true, final = true })
  check_lengths(o, given, "parity")
  parity_density(o)
end

function tasks.parity.sample(r, o)
  local targets_kind = check_targets(o, "parity", { running = true, final = true })
  local n = draw_length(r, o, tasks.parity.shortest, "parity")
  local density = parity_density(o)
  if density == "random" then density = r:uniform() end
  local tokens, targets, p = {}, {}, 0
  for i = 1, n do
    local b = r:uniform() < density and 1 or 0
    p = (p + b) % 2
    tokens[i] = b
    targets[i] = (targets_kind == "running" or i == n) and p or -1
  end
  return tokens, targets
end

-- ---- modular arithmetic ------------------------------------------------------------------

-- Token ids of the arithmetic vocabulary for modulus m.
function tasks.arith_symbols(m)
  return { ["+"] = m, ["-"] = m + 1, ["*"] = m + 2, ["("] = m + 3, [")"] = m + 4, ["="] = m + 5 }
end

-- Exact value mod m of an expression given as token ids (tokens[first..last]) by recursive
-- descent over   expr := term {('+'|'-') term};  term := unary {'*' unary};
-- unary := '-' unary | digit | '(' expr ')'.   Returns nil and a message when malformed.
function tasks.evaluate(tokens, m, first, last)
  if type(tokens) ~= "table" then
    raise("m3.data.evaluate: expected a Lua list of token ids, got " .. show(tokens))
  end
  m = options.want_int(m or 5, "m3.data.evaluate: modulus", 2)
  first = options.want_int(first or 1, "m3.data.evaluate: first", 1)
  last = options.want_int(last or #tokens, "m3.data.evaluate: last", 0)
  local sym = tasks.arith_symbols(m)
  local pos = first
  local expr

  local function unary()
    local t = tokens[pos]
    if pos > last then error("expected a digit, '-' or '(' at the end", 0) end
    if t == sym["-"] then
      pos = pos + 1
      return (-unary()) % m
    elseif t == sym["("] then
      pos = pos + 1
      local v = expr()
      if tokens[pos] ~= sym[")"] or pos > last then error("expected ')' at token " .. pos, 0) end
      pos = pos + 1
      return v
    elseif type(t) == "number" and t >= 0 and t < m then
      pos = pos + 1
      return t
    end
    error("expected a digit, '-' or '(' at token " .. pos, 0)
  end

  local function term()
    local v = unary()
    while pos <= last and tokens[pos] == sym["*"] do
      pos = pos + 1
      v = (v * unary()) % m
    end
    return v
  end

  function expr()
    local v = term()
    while pos <= last and (tokens[pos] == sym["+"] or tokens[pos] == sym["-"]) do
      local op = tokens[pos]
      pos = pos + 1
      local w = term()
      v = op == sym["+"] and (v + w) % m or (v - w) % m
    end
    return v
  end

  local ok, v = pcall(expr)
  if not ok then return nil, v end
  if pos <= last then return nil, "unexpected token at " .. pos end
  return v
end

local function op_ids(o, sym)
  local ops = o.ops
  if type(ops) ~= "string" or #ops == 0 or ops:find("[^-+*]") then
    raise(string.format("m3.data.arithmetic: ops must be a non-empty string of '+', '-', '*', got %s", show(ops)))
  end
  local ids = {}
  for c in ops:gmatch(".") do ids[#ids + 1] = sym[c] end
  return ids
end

-- digits and binary operators; value tracked as sum + sign * product of the open term.
local function sample_flat(r, o, m, sym, ops)
  local targets_kind = check_targets(o, "arithmetic", { running = true, final = true })
  local n = draw_length(r, o, tasks.arithmetic.shortest, "arithmetic")
  local e = n - 1
  if e % 2 == 0 then e = e - 1 end
  local tokens, targets = {}, {}
  local sum, sign, prod = 0, 1, nil
  for i = 1, e do
    if i % 2 == 1 then
      local d = r:below(m)
      prod = prod and (prod * d) % m or d
      tokens[i] = d
      targets[i] = targets_kind == "running" and (sum + sign * prod) % m or -1
    else
      local op = ops[r:below(#ops) + 1]
      if op ~= sym["*"] then
        sum = (sum + sign * prod) % m
        sign = op == sym["+"] and 1 or -1
        prod = nil
      end
      tokens[i] = op
      targets[i] = -1
    end
  end
  tokens[e + 1] = sym["="]
  targets[e + 1] = (sum + sign * prod) % m
  return tokens, targets
end

-- An expression of exactly n tokens with brackets around every binary operation; appends
-- to out and returns its value mod m.
local function gen_bracketed(r, n, m, sym, ops, out)
  if n == 1 then
    local d = r:below(m)
    out[#out + 1] = d
    return d
  elseif n == 2 or n == 4 then
    if n == 4 then out[#out + 1] = sym["("] end
    local d = r:below(m)
    out[#out + 1] = sym["-"]
    out[#out + 1] = d
    if n == 4 then out[#out + 1] = sym[")"] end
    return (-d) % m
  elseif n == 3 then
    local d = r:below(m)
    out[#out + 1] = sym["("]
    out[#out + 1] = d
    out[#out + 1] = sym[")"]
    return d
  end
  local left = 1 + r:below(n - 4)
  local op = ops[r:below(#ops) + 1]
  out[#out + 1] = sym["("]
  local a = gen_bracketed(r, left, m, sym, ops, out)
  out[#out + 1] = op
  local b = gen_bracketed(r, n - 3 - left, m, sym, ops, out)
  out[#out + 1] = sym[")"]
  if op == sym["+"] then return (a + b) % m end
  if op == sym["-"] then return (a - b) % m end
  return (a * b) % m
end

local function sample_bracketed(r, o, m, sym, ops)
  check_targets(o, "arithmetic", { final = true })
  local n = draw_length(r, o, tasks.arithmetic.shortest, "arithmetic")
  local tokens = {}
  local v = gen_bracketed(r, n - 1, m, sym, ops, tokens)
  local targets = {}
  for i = 1, n - 1 do targets[i] = -1 end
  tokens[n], targets[n] = sym["="], v
  return tokens, targets
end

tasks.arithmetic = {
  name = "arithmetic", classes = 5, vocab = 11, shortest = 2,
  defaults = { length = 32, modulus = 5, ops = "+-*", brackets = false, targets = "final" },
  options = { length = true, min_length = true, modulus = true, ops = true, brackets = true, targets = true },
}

-- The modulus of options o, once it is an integer >= 2 whose vocab (m + 6) a model can take.
local function arith_modulus(o)
  local m = check_int(o, "modulus", 2, "arithmetic")
  if m + 6 > MAX_VOCAB then
    raise(string.format("m3.data.arithmetic: modulus = %d: the vocab (modulus + 6 token ids) must be at most %d, "
      .. "the largest vocab_size of a model", m, MAX_VOCAB))
  end
  return m
end

function tasks.arithmetic.longest(o)
  return select(2, length_range(o, tasks.arithmetic.shortest, "arithmetic"))
end

function tasks.arithmetic.check(o, given)
  op_ids(o, tasks.arith_symbols(arith_modulus(o)))
  local brackets = options.want_bool(o.brackets, "m3.data.arithmetic: brackets")
  check_targets(o, "arithmetic", brackets and { final = true } or { running = true, final = true })
  check_lengths(o, given, "arithmetic")
end

function tasks.arithmetic.sample(r, o)
  local m = arith_modulus(o)
  local sym = tasks.arith_symbols(m)
  local ops = op_ids(o, sym)
  if options.want_bool(o.brackets, "m3.data.arithmetic: brackets") then return sample_bracketed(r, o, m, sym, ops) end
  return sample_flat(r, o, m, sym, ops)
end

-- Vocabulary and class count of the arithmetic task for options o (its modulus checked), and
-- the option that sets them as text.
function tasks.arithmetic.shape(o)
  local m = arith_modulus(o)
  return m + 6, m, "modulus = " .. m
end

-- ---- multi-query associative recall ------------------------------------------------------

tasks.mqar = {
  name = "mqar", vocab = 64, classes = 32, shortest = 3,
  defaults = { length = 24, keys = 32, values = 32 },
  options = { length = true, keys = true, values = true, pairs = true, queries = true },
}

-- keys, values of mqar's options o, once they are integers >= 1 whose sum (the vocab) a model
-- can take.
local function mqar_sizes(o)
  local keys, values = check_int(o, "keys", 1, "mqar"), check_int(o, "values", 1, "mqar")
  if keys + values > MAX_VOCAB then
    raise(string.format("m3.data.mqar: keys + values = %d + %d = %d: the vocab (token ids 0..keys+values-1) must be "
      .. "at most %d, the largest vocab_size of a model", keys, values, keys + values, MAX_VOCAB))
  end
  return keys, values
end

-- pairs and queries of options o, those not given (nil) derived from o.length (see the header).
local function mqar_derived_counts(o, keys, pairs_n, queries)
  local length = check_int(o, "length", tasks.mqar.shortest, "mqar", MAX_LENGTH)
  if pairs_n == nil then
    pairs_n = floor(length / 3)
    if pairs_n > keys then
      raise(string.format("m3.data.mqar: length = %d gives pairs = floor(length / 3) = %d, more than keys = %d (the "
        .. "keys are distinct): give pairs, or more keys", length, pairs_n, keys))
    end
  end
  if queries == nil then
    queries = length - 2 * pairs_n
    if queries < 1 then
      raise(string.format("m3.data.mqar: length = %d leaves no query after pairs = %d (queries = length - 2 * pairs "
        .. "= %d): give queries, or a length >= %d", length, pairs_n, queries, 2 * pairs_n + 1))
    end
  end
  return pairs_n, queries
end

-- pairs and queries of options o: given, or derived from o.length (see the header).
local function mqar_counts(o, keys)
  local pairs_n, queries = o.pairs, o.queries
  if pairs_n ~= nil then
    check_int(o, "pairs", 1, "mqar")
    if pairs_n > keys then
      raise(string.format("m3.data.mqar: pairs = %d: must be at most keys = %d (the keys are distinct)", pairs_n, keys))
    end
  end
  if queries ~= nil then check_int(o, "queries", 1, "mqar", MAX_LENGTH) end
  if pairs_n == nil or queries == nil then pairs_n, queries = mqar_derived_counts(o, keys, pairs_n, queries) end
  if 2 * pairs_n + queries > MAX_LENGTH then
    raise(string.format("m3.data.mqar: pairs = %d and queries = %d make samples of 2 * pairs + queries = %d ids: "
      .. "must be at most %d (a sample is drawn as Lua lists, which hold at most 2^27 items)", pairs_n, queries,
      2 * pairs_n + queries, MAX_LENGTH))
  end
  return pairs_n, queries
end

-- The length of every sample of options o (its counts checked): 2 * pairs + queries.
function tasks.mqar.longest(o)
  local pairs_n, queries = mqar_counts(o, mqar_sizes(o))
  return 2 * pairs_n + queries
end

function tasks.mqar.check(o)
  mqar_sizes(o)
  check_int(o, "length", tasks.mqar.shortest, "mqar", MAX_LENGTH)
  if o.pairs ~= nil then check_int(o, "pairs", 1, "mqar") end
  if o.queries ~= nil then check_int(o, "queries", 1, "mqar", MAX_LENGTH) end
end

function tasks.mqar.sample(r, o)
  local keys = mqar_sizes(o)
  local pairs_n, queries = mqar_counts(o, keys)
  -- distinct keys: a partial Fisher-Yates shuffle of 0..keys-1, kept sparse (an unset perm[i] stands
  -- for i - 1), so that a sample costs O(pairs) whatever keys, and draws what the full table drew
  local perm = {}
  local tokens, targets, value_of = {}, {}, {}
  for p = 1, pairs_n do
    local j = p + r:below(keys - p + 1)
    perm[p], perm[j] = perm[j] or j - 1, perm[p] or p - 1
    local k, v = perm[p], keys + r:below(o.values)
    value_of[p] = v
    tokens[#tokens + 1], targets[#targets + 1] = k, -1
    tokens[#tokens + 1], targets[#targets + 1] = v, -1
  end
  for _ = 1, queries do
    local p = 1 + r:below(pairs_n)
    tokens[#tokens + 1], targets[#targets + 1] = perm[p], value_of[p]
  end
  return tokens, targets
end

-- Vocabulary and class count of the mqar task for options o (its keys and values checked), and
-- the options that set them as text.
function tasks.mqar.shape(o)
  local keys, values = mqar_sizes(o)
  return keys + values, values, string.format("keys = %d, values = %d", keys, values)
end

return tasks

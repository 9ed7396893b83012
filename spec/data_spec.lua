-- m3.data: generator labels (brute force on short inputs), determinism, cursor resume,
-- text and token file windows.

local data = require "m3.data"
local rng = require "m3.data.rng"
local tasks = require "m3.data.tasks"
local options = require "m3.options"
local helper = require "spec.helper"

-- Lua's own parser as the independent judge of an arithmetic expression: tokens[1..last], mod m
-- (default 5; its symbols m .. m + 4 are + - * ( )).
local function lua_value(tokens, last, m)
  m = m or 5
  local symbols = { [m] = " + ", [m + 1] = " - ", [m + 2] = " * ", [m + 3] = " ( ", [m + 4] = " ) " }
  local parts = {}
  for i = 1, last do parts[i] = symbols[tokens[i]] or tostring(tokens[i]) end
  return assert(loadstring("return " .. table.concat(parts)))() % m
end

-- How often each sample length of src occurs in its samples 0 .. n - 1.
local function length_counts(src, n)
  local counts = {}
  for i = 0, n - 1 do
    local len = #src:sample(i)
    counts[len] = (counts[len] or 0) + 1
  end
  return counts
end

-- Asserts that count is within 5 standard deviations of a binomial draw of n with probability p.
local function assert_binomial(count, n, p, what)
  local sd = math.sqrt(n * p * (1 - p))
  assert.is_true(math.abs(count - n * p) < 5 * sd,
    string.format("%s: %d of %d, expected %.1f +- %.1f", what, count, n, n * p, 5 * sd))
end

local function tmpfile(bytes)
  local path = os.tmpname()
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
  return path
end

-- The message of f's error, without the data_spec.lua:N: position it must start with.
local function message_of(f)
  return helper.error_of(f):match("^[^:]*data_spec%.lua:%d+: (.*)$")
end

-- Runs the Lua source code as a script of the m3lua program (a failure that would take busted down
-- with it, a hang or a signal, fails only the test: timeout ends it after 20 s); its output and exit status.
local function m3lua_script(code)
  local path = tmpfile(code)
  local out, status = helper.run("timeout 20 " .. helper.quote(helper.m3lua()) .. " " .. path)
  os.remove(path)
  return out, status
end

-- A temporary file of the n little-endian u16 ids 0, 1, ..., n - 1.
local function counting_u16_file(n)
  local ffi = require "ffi"
  local ids = ffi.new("uint16_t[?]", n)
  for i = 0, n - 1 do ids[i] = i end
  return tmpfile(ffi.string(ids, 2 * n))
end

describe("m3.data.rng", function()
  it("is xoshiro128** (reference outputs from state {1, 2, 3, 4})", function()
    local r = rng.from_state { 1, 2, 3, 4 }
    local got = {}
    for i = 1, 6 do got[i] = r:u32() end
    assert.same({ 11520, 0, 5927040, 70819200, 2031721883, 1637235492 }, got)
  end)

  it("gives the same stream for the same (seed, index) and different ones otherwise", function()
    local a, b, c = rng.new(7, 3), rng.new(7, 3), rng.new(7, 4)
    local same, differ = true, false
    for _ = 1, 100 do
      local x, y, z = a:u32(), b:u32(), c:u32()
      same = same and x == y
      differ = differ or x ~= z
    end
    assert.is_true(same)
    assert.is_true(differ)
    assert.are_not.equal(rng.new(7, 3):u32(), rng.new(7, 3, 1):u32())
  end)

  it("round-trips its state and draws in range", function()
    local r = rng.new(1, 2)
    r:u32()
    local s = r:state()
    local q = rng.from_state(s)
    for _ = 1, 1000 do
      local u, v = r:uniform(), q:uniform()
      assert.equal(u, v)
      assert.is_true(u >= 0 and u < 1)
      local k = r:below(7)
      assert.equal(k, q:below(7))
      assert.is_true(k >= 0 and k < 7 and k == math.floor(k))
    end
  end)

  it("refuses seeds that would not round-trip", function()
    assert.has_error(function() rng.new(-1) end)
    assert.has_error(function() rng.new(0.5) end)
    -- [0, 2^53): 2^53 itself is no seed and no index (nor a state of three or five words)
    for _, args in ipairs { { 2 ^ 53 }, { 0, 2 ^ 53 } } do
      local what = args[2] and "index" or "seed"
      assert.truthy(helper.error_of(rng.new, unpack(args)):find("m3.data.rng: " .. what
        .. " must be an integer in [0, 2^53), got " .. tostring(2 ^ 53), 1, true))
    end
    for _, s in ipairs { { 1, 2, 3 }, { 1, 2, 3, 4, 5 } } do
      assert.truthy(helper.error_of(rng.from_state, s):find("expected a table of four integers", 1, true))
    end
  end)

  it("gives seeds and indexes past 2^32 generators of their own (their high words count)", function()
    -- index i + 2^32 is another sample than i, seed s + 2^32 another run than s
    for _, pair in ipairs { { { 7, 0 }, { 7, 2 ^ 32 } }, { { 7, 3 }, { 7, 2 ^ 32 + 3 } },
                            { { 0, 3 }, { 2 ^ 32, 3 } }, { { 7, 3 }, { 7 + 2 ^ 32, 3 } } } do
      local a, b = rng.new(unpack(pair[1])), rng.new(unpack(pair[2]))
      assert.are_not.same({ a:u32(), a:u32() }, { b:u32(), b:u32() })
    end
    assert.is_true(rng.new(2 ^ 53 - 1, 2 ^ 53 - 1):u32() >= 0)
  end)

  it("keeps stream 1 as it was: a mixture picks each row's source from it, and its cursors resume with it", function()
    -- a regression pin like stream nil's (2179490263 above), the value since m3.data.rng first took streams: a
    -- changed stream 1 gives a mixture resumed from its cursor other rows than the run it continues
    assert.equal(1486391287, rng.new(7, 3, 1):u32())
  end)

  it("takes a stream nil (the sources' own, not stream 0) or an integer in [0, 2^32), and refuses any other", function()
    -- no stream is what the sources draw from (and runs resume with): it stays as it was
    assert.equal(2179490263, rng.new(7, 3):u32())
    assert.are_not.equal(rng.new(7, 3):u32(), rng.new(7, 3, 0):u32())
    assert.equal(rng.new(7, 3, 2 ^ 32 - 1):u32(), rng.new(7, 3, 2 ^ 32 - 1):u32())
    -- 2^32 drew stream 0's values, -1 stream 2^32 - 1's
    for _, stream in ipairs { -1, 0.5, 2 ^ 32, 0 / 0, math.huge, "1" } do
      local err = helper.error_of(rng.new, 7, 3, stream)
      assert.equal("m3.data.rng: stream must be nil or an integer in [0, 2^32), got " .. tostring(stream), err)
    end
  end)

  it("refuses a bound that is not an integer in [1, 2^53], a state that is not four 32-bit words or all 0s, "
    .. "and a method called with '.'", function()
    -- below(0) and below(2.5) drew 0, below(0 / 0) NaN, below(nil) a raw error; from_state{1, 2, 3, true} raised
    -- from bit.tobit, and {0, 0, 0, 0} made a generator that draws only 0
    local r = rng.new(1)
    for _, n in ipairs { 0, 2.5, 0 / 0, -1, math.huge, 2 ^ 53 + 2, "3" } do
      assert.equal("m3.data.rng: below: n = " .. options.show(n) .. ": expected an integer in [1, 2^53]",
        message_of(function() r:below(n) end))
    end
    assert.equal("m3.data.rng: below: n = nil: expected an integer in [1, 2^53]", message_of(function() r:below() end))
    assert.equal(0, r:below(1))
    assert.equal("m3.data.rng.from_state: s[4] = true: expected an integer in [-2^31, 2^32) (a 32-bit word of "
      .. "r:state())", message_of(function() rng.from_state { 1, 2, 3, true } end))
    assert.matches("^m3%.data%.rng%.from_state: the state {0, 0, 0, 0} never changes",
      message_of(function() rng.from_state { 0, 0, 0, 0 } end))
    assert.equal(rng.new(5):u32(), rng.from_state(rng.new(5):state()):u32())
    assert.equal("m3.data.rng: below: expected a generator (m3.data.rng.new) (call it as r:below(n)), got 5",
      message_of(function() r.below(5) end))
    assert.equal("m3.data.rng: u32: expected a generator (m3.data.rng.new) (call it as r:u32()), got nil",
      message_of(function() r.u32() end))
  end)
end)

describe("m3.data.parity", function()
  it("labels every prefix with its parity (running) on all short lengths", function()
    local src = data.parity { seed = 3, length = 10, min_length = 1 }
    local seen = {}
    for i = 0, 499 do
      local toks, tgts = src:sample(i)
      seen[#toks] = true
      local ones = 0
      for t = 1, #toks do
        assert.is_true(toks[t] == 0 or toks[t] == 1)
        if toks[t] == 1 then ones = ones + 1 end
        assert.equal(ones % 2, tgts[t])
      end
    end
    for n = 1, 10 do assert.is_true(seen[n], "length " .. n .. " drawn") end
  end)

  it("draws every length from min_length to length equally often", function()
    local counts = length_counts(data.parity { seed = 7, length = 9, min_length = 3 }, 7000)
    for n = 3, 9 do assert_binomial(counts[n] or 0, 7000, 1 / 7, "length " .. n) end
    for n in pairs(counts) do assert.is_true(n >= 3 and n <= 9, "length " .. n) end
  end)

  it("scores only the last position with targets = final", function()
    local src = data.parity { seed = 1, length = 6, targets = "final" }
    for i = 0, 99 do
      local toks, tgts = src:sample(i)
      assert.equal(6, #toks)
      local ones = 0
      for t = 1, 6 do ones = ones + toks[t] end
      for t = 1, 5 do assert.equal(-1, tgts[t]) end
      assert.equal(ones % 2, tgts[6])
    end
  end)

  it("draws 1 bits with the given density, or a density per sample", function()
    local ones, n = 0, 0
    local sparse = data.parity { seed = 2, length = 50, density = 0.1 }
    for i = 0, 99 do
      for _, b in ipairs((sparse:sample(i))) do ones, n = ones + b, n + 1 end
    end
    assert.is_true(math.abs(ones / n - 0.1) < 0.02)
    local mixed = data.parity { seed = 2, length = 50, density = "random" }
    local lo, hi = 1, 0
    for i = 0, 99 do
      local c = 0
      for _, b in ipairs((mixed:sample(i))) do c = c + b end
      lo, hi = math.min(lo, c / 50), math.max(hi, c / 50)
    end
    assert.is_true(lo < 0.15 and hi > 0.85)
    assert.has_error(function() data.parity { density = 2 }:sample(0) end)
  end)

  it("rejects bad options with a message naming the field", function()
    assert.has_error(function() data.parity { targets = "all" }:sample(0) end,
      'm3.data.parity: targets must be "final" or "running", got all')
    assert.has_error(function() data.parity { length = 4, min_length = 5 }:sample(0) end)
    -- at the caller's line; an infinite length is no length (it served [1, 0] batches)
    assert.equal("m3.data.parity: length = inf: must be at most 134217728 (a sample is drawn as Lua lists, which "
      .. "hold at most 2^27 items)",
      message_of(function() data.parity {}:next(1, { length = math.huge }) end))
    assert.equal("m3.data.mqar: pairs must be an integer >= 1, got 1.5",
      message_of(function() data.mqar {}:next(1, { length = 12, pairs = 1.5 }) end))
    assert.equal("m3.data.mqar: queries must be an integer >= 1, got nan",
      message_of(function() data.mqar {}:next(1, { length = 12, queries = 0 / 0 }) end))
  end)
end)

describe("m3.data.evaluate", function()
  it("agrees with Lua's parser on every expression of up to 3 digits", function()
    local count = 0
    local function walk(tokens, digits)
      if digits > 0 then
        assert.equal(lua_value(tokens, #tokens), data.evaluate(tokens, 5))
        count = count + 1
      end
      if digits == 3 then return end
      for d = 0, 4 do
        if digits == 0 then
          walk({ d }, 1)
        else
          for op = 5, 7 do
            local t = { unpack(tokens) }
            t[#t + 1], t[#t + 2] = op, d
            walk(t, digits + 1)
          end
        end
      end
    end
    walk({}, 0)
    assert.equal(5 + 5 * 15 + 5 * 15 * 15, count)
  end)

  it("handles brackets and unary minus, and rejects malformed input", function()
    -- (2 - (-3)) * 4 = 20 = 0 mod 5;  -(1) = 4
    assert.equal(0, data.evaluate({ 8, 2, 6, 8, 6, 3, 9, 9, 7, 4 }, 5))
    assert.equal(4, data.evaluate({ 6, 8, 1, 9 }, 5))
    assert.is_nil(data.evaluate({ 8, 1, 5, 2 }, 5))
    assert.is_nil(data.evaluate({ 1, 5 }, 5))
    assert.is_nil(data.evaluate({ 1, 2 }, 5))
  end)

  it("refuses what is not a token list, a modulus >= 2 or a position, naming it (nil gave a raw Lua error)", function()
    assert.equal("m3.data.evaluate: expected a Lua list of token ids, got nil",
      message_of(function() data.evaluate() end))
    assert.equal("m3.data.evaluate: modulus = 1: expected an integer >= 2",
      message_of(function() data.evaluate({ 0 }, 1) end))
    assert.equal("m3.data.evaluate: first = 0: expected an integer >= 1",
      message_of(function() data.evaluate({ 0 }, 5, 0) end))
    assert.equal("m3.data.evaluate: last = 1.5: expected an integer >= 0",
      message_of(function() data.evaluate({ 0 }, 5, 1, 1.5) end))
  end)
end)

describe("m3.data.arithmetic", function()
  it("labels expressions without brackets exactly (final and running targets)", function()
    local src = data.arithmetic { seed = 5, length = 12, min_length = 2, targets = "running" }
    for i = 0, 999 do
      local toks, tgts = src:sample(i)
      local n = #toks
      assert.equal(10, toks[n]) -- '='
      assert.equal(1, (n - 1) % 2)
      assert.equal(lua_value(toks, n - 1), tgts[n])
      for t = 1, n - 1 do
        if t % 2 == 1 then
          assert.is_true(toks[t] >= 0 and toks[t] < 5)
          assert.equal(lua_value(toks, t), tgts[t])
        else
          assert.is_true(toks[t] >= 5 and toks[t] <= 7)
          assert.equal(-1, tgts[t])
        end
      end
    end
  end)

  it("makes bracketed expressions of the exact length, labelled by their value", function()
    local src = data.arithmetic { seed = 9, length = 16, min_length = 2, brackets = true }
    local lengths = {}
    for i = 0, 1999 do
      local toks, tgts = src:sample(i)
      local n = #toks
      lengths[n] = true
      assert.equal(10, toks[n])
      for t = 1, n - 1 do assert.equal(-1, tgts[t]) end
      assert.equal(lua_value(toks, n - 1), tgts[n])
      assert.equal(tgts[n], data.evaluate(toks, 5, 1, n - 1))
    end
    for n = 2, 16 do assert.is_true(lengths[n], "length " .. n .. " drawn") end
  end)

  it("splits a bracketed expression's tokens between its two operands in every way (a bare digit on either side)",
    function()
      -- ( left op right ): 9 tokens leave 6 to the operands, so left has 1 .. 5 of them; an operand of 1 token is
      -- a digit, of 2 a unary minus on a digit, else it is in brackets
      local src = data.arithmetic { seed = 6, length = 10, brackets = true }
      local lefts = {}
      for i = 0, 299 do
        local toks = src:sample(i)
        assert.same({ 8, 9 }, { toks[1], toks[9] })
        local left
        if toks[2] < 5 then
          left = 1
        elseif toks[2] == 6 then
          left = 2
        else
          local depth, t = 0, 2
          repeat
            depth = depth + (toks[t] == 8 and 1 or toks[t] == 9 and -1 or 0)
            t = t + 1
          until depth == 0
          left = t - 2
        end
        assert.is_true(toks[2 + left] >= 5 and toks[2 + left] <= 7, "a binary operator after the left operand")
        lefts[left] = (lefts[left] or 0) + 1
      end
      for left = 1, 5 do assert.is_true((lefts[left] or 0) > 20, "left operand of " .. left .. " tokens") end
    end)

  it("draws answers of bracketed expressions unevenly: 0 is about 30% of them at length 64", function()
    -- scaled_accuracy is 0 for a uniform guess, not for every answer without skill: always 0 scores 12.5%
    local src = data.arithmetic { seed = 1, brackets = true, length = 64 }
    local zeros = 0
    for i = 0, 1999 do
      local _, tgts = src:sample(i)
      if tgts[#tgts] == 0 then zeros = zeros + 1 end
    end
    assert.is_true(zeros > 540 and zeros < 660, zeros .. " zeros in 2000")
    assert.equal(0, data.scaled_accuracy(1 / 5, 5))
    assert.near(0.125, data.scaled_accuracy(0.3, 5), 1e-12)
  end)

  it("scales accuracy only for a number of classes >= 2 (nil gave a raw Lua error, 1 gave -inf)", function()
    assert.equal(1, data.scaled_accuracy(1, 2))
    assert.equal(-1, data.scaled_accuracy(0, 2))
    for _, c in ipairs { 1, 2.5 } do
      assert.equal("m3.data.scaled_accuracy: classes = " .. c .. ": expected an integer >= 2",
        message_of(function() data.scaled_accuracy(0.5, c) end))
    end
    assert.equal("m3.data.scaled_accuracy: classes = nil: expected an integer >= 2",
      message_of(function() data.scaled_accuracy(0.5) end))
    assert.equal('m3.data.scaled_accuracy: acc = "0.5": expected a number',
      message_of(function() data.scaled_accuracy("0.5", 2) end))
  end)

  it("labels expressions exactly for other moduli and operator sets, with and without brackets", function()
    for _, m in ipairs { 2, 3, 7, 13 } do
      for _, ops in ipairs { "+-*", "-", "*+" } do
        local flat = data.arithmetic { seed = m, length = 11, min_length = 2, modulus = m, ops = ops,
          targets = "running" }
        local nested = data.arithmetic { seed = m, length = 14, min_length = 2, modulus = m, ops = ops,
          brackets = true }
        assert.same({ m + 6, m }, { flat.vocab, flat.classes })
        for _, src in ipairs { flat, nested } do
          for i = 0, 99 do
            local toks, tgts = src:sample(i)
            local n = #toks
            assert.equal(m + 5, toks[n]) -- '='
            assert.equal(lua_value(toks, n - 1, m), tgts[n])
            for t = 1, n do
              assert.is_true(toks[t] >= 0 and toks[t] < src.vocab)
              assert.is_true(tgts[t] == -1 or tgts[t] >= 0 and tgts[t] < src.classes)
              -- a binary operator (after a digit or ')'; a '-' elsewhere is a unary minus): one of ops
              local after_operand = t > 1 and (toks[t - 1] < m or toks[t - 1] == m + 4)
              if after_operand and t < n and toks[t] >= m and toks[t] <= m + 2 then
                assert.truthy(ops:find(({ "+", "-", "*" })[toks[t] - m + 1], 1, true))
              end
              if src == flat and t < n then
                assert.equal(t % 2 == 1 and lua_value(toks, t, m) or -1, tgts[t])
              end
            end
          end
        end
      end
    end
  end)

  it("draws lengths uniformly from min_length to length (without brackets: an odd one less one token)", function()
    local nested = length_counts(data.arithmetic { seed = 3, length = 9, min_length = 2, brackets = true }, 4000)
    for n = 2, 9 do assert_binomial(nested[n] or 0, 4000, 1 / 8, "bracketed length " .. n) end
    -- lengths 2k and 2k + 1 both give an expression of 2k - 1 tokens and '='
    local flat = length_counts(data.arithmetic { seed = 3, length = 9, min_length = 2 }, 2000)
    for n = 2, 8, 2 do assert_binomial(flat[n] or 0, 2000, 1 / 4, "length " .. n) end
    for n = 3, 9, 2 do assert.is_nil(flat[n]) end
  end)

  it("takes brackets as a boolean only (a string \"false\" drew bracketed expressions)", function()
    for _, b in ipairs { "false", 1, 0 } do
      local want = "m3.data.arithmetic: brackets = " .. (b == "false" and '"false"' or tostring(b))
        .. ": expected a boolean"
      assert.equal(want, message_of(function() data.arithmetic { brackets = b }:next(1) end))
      assert.equal(want, message_of(function() data.arithmetic {}:next(1, { brackets = b }) end))
    end
    assert.equal(9, #data.arithmetic { length = 9, brackets = true }:sample(0))
  end)

  it("bounds its modulus by a model's largest vocab_size (2^24), below which every product is exact", function()
    -- modulus 2^31 - 1 made a vocab no model takes, and products past 2^53 gave wrong targets
    for _, m in ipairs { 2 ^ 24 - 5, 2 ^ 31 - 1 } do
      assert.equal(string.format("m3.data.arithmetic: modulus = %d: the vocab (modulus + 6 token ids) must be at most "
        .. "16777216, the largest vocab_size of a model", m),
        message_of(function() data.arithmetic { modulus = m } end))
    end
    local ffi = require "ffi"
    local m = 2 ^ 24 - 6
    local src = data.arithmetic { seed = 1, modulus = m, length = 12, ops = "*" }
    assert.equal(2 ^ 24, src.vocab)
    for i = 0, 49 do
      local toks, tgts = src:sample(i)
      local product = ffi.new("uint64_t", toks[1]) -- exact: (2^24)^2 < 2^64
      for t = 3, #toks - 1, 2 do product = product * toks[t] % m end
      assert.equal(tonumber(product), tgts[#toks])
    end
  end)

  it("draws only the operators asked for", function()
    local src = data.arithmetic { seed = 2, length = 21, ops = "+-" }
    for i = 0, 99 do
      local toks = src:sample(i)
      for t = 2, #toks - 1, 2 do assert.is_true(toks[t] == 5 or toks[t] == 6) end
    end
    assert.equal(11, src.vocab)
    assert.equal(5, src.classes)
    assert.has_error(function() data.arithmetic { ops = "/" }:sample(0) end)
  end)
end)

describe("m3.data.mqar", function()
  it("asks for values of keys seen earlier", function()
    local src = data.mqar { seed = 4, pairs = 6, queries = 5, keys = 16, values = 8 }
    assert.equal(24, src.vocab)
    for i = 0, 199 do
      local toks, tgts = src:sample(i)
      assert.equal(17, #toks)
      local value_of, used = {}, {}
      for p = 1, 6 do
        local k, v = toks[2 * p - 1], toks[2 * p]
        assert.is_true(k >= 0 and k < 16 and not used[k])
        assert.is_true(v >= 16 and v < 24)
        used[k], value_of[k] = true, v
        assert.equal(-1, tgts[2 * p - 1])
        assert.equal(-1, tgts[2 * p])
      end
      for q = 13, 17 do assert.equal(value_of[toks[q]], tgts[q]) end
    end
  end)

  it("derives pairs and queries from a length", function()
    local toks = data.mqar { length = 30 }:sample(0)
    assert.equal(30, #toks)
  end)

  it("answers each query with its key's value at every length, within the reported vocab", function()
    local src = data.mqar { seed = 2, keys = 12, values = 5 }
    assert.same({ 17, 5 }, { src.vocab, src.classes })
    for length = 3, 36 do
      for i = 0, 9 do
        local toks, tgts = src:sample(i, { length = length })
        local pairs_n = math.floor(length / 3)
        assert.equal(length, #toks)
        local value_of = {}
        for t = 1, 2 * pairs_n, 2 do
          assert.is_true(toks[t] >= 0 and toks[t] < 12 and value_of[toks[t]] == nil)
          assert.is_true(toks[t + 1] >= 12 and toks[t + 1] < 17)
          assert.same({ -1, -1 }, { tgts[t], tgts[t + 1] })
          value_of[toks[t]] = toks[t + 1]
        end
        for t = 2 * pairs_n + 1, length do assert.equal(value_of[toks[t]], tgts[t]) end
      end
    end
  end)

  it("names length when the pairs it gives, or the room it leaves for queries, do not fit", function()
    -- "queries must be >= 1, got -16" for a length and pairs never given together; a length "x" a raw Lua error
    assert.equal("m3.data.mqar: length = 24 leaves no query after pairs = 20 (queries = length - 2 * pairs = -16): "
      .. "give queries, or a length >= 41", message_of(function() data.mqar { pairs = 20 }:next(1) end))
    assert.equal("m3.data.mqar: length must be an integer >= 3, got x",
      message_of(function() data.mqar { pairs = 4 }:next(1, { length = "x" }) end))
    assert.equal("m3.data.mqar: length = 100 gives pairs = floor(length / 3) = 33, more than keys = 32 (the keys "
      .. "are distinct): give pairs, or more keys", message_of(function() data.mqar {}:next(1, { length = 100 }) end))
    assert.equal("m3.data.mqar: pairs = 5: must be at most keys = 4 (the keys are distinct)",
      message_of(function() data.mqar { keys = 4, pairs = 5 }:next(1) end))
    assert.same({ 1, 41 }, data.mqar { pairs = 20 }:next(1, { length = 41 }).tokens:shape())
    assert.same({ 1, 43 }, data.mqar { pairs = 20, queries = 3 }:next(1, { length = "x" }).tokens:shape())
  end)

  it("bounds its vocab keys + values by a model's largest vocab_size (2^24); a sample costs O(pairs)", function()
    -- keys = 2^31 - 1 built a permutation table of that size for every sample: "table overflow"
    assert.equal("m3.data.mqar: keys + values = 2147483647 + 32 = 2147483679: the vocab (token ids "
      .. "0..keys+values-1) must be at most 16777216, the largest vocab_size of a model",
      message_of(function() data.mqar { keys = 2 ^ 31 - 1 } end))
    assert.equal("m3.data.mqar: keys + values = 16777180 + 37 = 16777217: the vocab (token ids "
      .. "0..keys+values-1) must be at most 16777216, the largest vocab_size of a model",
      message_of(function() data.mqar { keys = 16777180 }:next(1, { values = 37 }) end))
    local src = data.mqar { seed = 3, keys = 2 ^ 24 - 32, pairs = 8, queries = 4 }
    assert.equal(2 ^ 24, src.vocab)
    local start = os.clock()
    for i = 0, 99 do
      local toks = src:sample(i)
      local seen = {}
      for p = 1, 8 do
        local k = toks[2 * p - 1]
        assert.is_true(k >= 0 and k < 2 ^ 24 - 32 and not seen[k])
        seen[k] = true
      end
    end
    assert.is_true(os.clock() - start < 1, "100 samples took " .. os.clock() - start .. " s")
    -- samples of 2 * pairs + queries ids, at most 2^27: pairs = 1000 with 134215728 queries fill it exactly, one query
    -- more is past it (it counted pairs + queries, which fits)
    local o = { keys = 1000, values = 32, pairs = 1000 }
    o.queries = 2 ^ 27 - 2000
    assert.equal(2 ^ 27, tasks.mqar.longest(o))
    o.queries = 2 ^ 27 - 1999
    assert.equal("m3.data.mqar: pairs = 1000 and queries = 134215729 make samples of 2 * pairs + queries = 134217729 "
      .. "ids: must be at most 134217728 (a sample is drawn as Lua lists, which hold at most 2^27 items)",
      message_of(function() tasks.mqar.longest(o) end))
    -- the sparse shuffle draws what the full table drew
    local toks = data.mqar { seed = 1, keys = 6, values = 2, pairs = 6, queries = 2 }:sample(0)
    assert.same({ 1, 7, 5, 7, 3, 7, 4, 7, 0, 7, 2, 7, 5, 0 }, toks)
  end)
end)

describe("m3.data sources", function()
  it("are a pure function of (seed, index, options)", function()
    local a, b = data.arithmetic { seed = 11, brackets = true }, data.arithmetic { seed = 11, brackets = true }
    assert.same({ a:sample(42) }, { b:sample(42) })
    assert.are_not.same({ a:sample(42) }, { data.arithmetic { seed = 12, brackets = true }:sample(42) })
  end)

  it("mix sources with weights, deterministically", function()
    local p = data.parity { seed = 1, length = 8 }
    local m = data.arithmetic { seed = 1, length = 10, offset = 2 }
    local mix = data.mixture({ p, m }, { seed = 3, weights = { 1, 3 } })
    assert.equal(13, mix.vocab)
    local counts = { 0, 0 }
    for i = 0, 399 do
      local toks = mix:sample(i)
      counts[#toks == 8 and 1 or 2] = counts[#toks == 8 and 1 or 2] + 1
      if #toks == 10 then assert.equal(12, toks[10]) end
    end
    assert.is_true(counts[2] > 2 * counts[1] and counts[1] > 50)
    local only_parity = mix:sample(5, { weights = { 1, 0 } })
    assert.equal(8, #only_parity)
  end)

  it("add offset to every token and target id (class 0 too) and pad after a sample with token 0, target -1", function()
    local plain = data.parity { seed = 5, length = 6, min_length = 1 }
    local shifted = data.parity { seed = 5, length = 6, min_length = 1, offset = 3 }
    local zeros = 0
    for i = 0, 49 do
      local t0, g0 = plain:sample(i)
      local t1, g1 = shifted:sample(i)
      assert.equal(#t0, #t1)
      for t = 1, #t0 do
        assert.equal(t0[t] + 3, t1[t])
        assert.equal(g0[t] + 3, g1[t]) -- running parity targets: every position scored, 0 as 3
        if g0[t] == 0 then zeros = zeros + 1 end
      end
    end
    assert.is_true(zeros > 0)
    local b = shifted:next(8, { pad_to = 7 })
    local tokens, targets = b.tokens:to_table(), b.targets:to_table()
    for r = 1, 8 do
      local toks, tgts = shifted:sample(r - 1)
      for t = 1, 7 do
        assert.equal(toks[t] or 0, tokens[r][t])
        assert.equal(tgts[t] or -1, targets[r][t])
      end
    end
  end)

  it("take the largest vocab and class count of their sources, in any order", function()
    local arith, parity = data.arithmetic { modulus = 7 }, data.parity {}
    for _, list in ipairs { { arith, parity }, { parity, arith } } do
      local mix = data.mixture(list)
      assert.same({ 13, 7 }, { mix.vocab, mix.classes })
    end
  end)

  it("pick a row's source from a stream of their own, independent of the sources' draws when the seeds are equal",
    function()
      -- the same seed everywhere: a pick drawn from the sources' own generators would give the first source (lengths
      -- 1 and 2) only its short samples and the second (3 and 4) only its long ones
      local mix = data.mixture({ data.parity { seed = 1, length = 2, min_length = 1 },
        data.parity { seed = 1, length = 4, min_length = 3 } }, { seed = 1 })
      local counts = length_counts(mix, 4000)
      for n = 1, 4 do assert_binomial(counts[n] or 0, 4000, 1 / 4, "length " .. n) end
    end)

  it("apply a call's weights to every row of its batch, and leave the caller's options as they were", function()
    local mix = data.mixture({ data.parity { length = 3 }, data.parity { length = 4, targets = "final" } }, { seed = 2 })
    local o = { weights = { 0, 1 } }
    local b = mix:next(50, o)
    for _, row in ipairs(b.targets:to_table()) do assert.same({ -1, -1, -1 }, { row[1], row[2], row[3] }) end
    assert.same({ 0, 1 }, o.weights)
  end)

  it("hold at most 2^31 - 1 positions a batch (source.MAX_POSITIONS)", function()
    local source = require "m3.data.source"
    assert.equal(2 ^ 31 - 1, source.MAX_POSITIONS)
    source.check_batch(2 ^ 31 - 1, 1, "rows of %d ids", "x") -- fits
    assert.truthy(helper.error_of(source.check_batch, 2 ^ 30, 2, "rows of %d ids", "x"):find("x: 1073741824 rows of "
      .. "2 ids make 2147483648 positions, more than a batch holds (2147483647", 1, true))
  end)

  it("mix file sources and mixtures too, and refuse what a mixture cannot draw when it is made", function()
    local path = counting_u16_file(1000)
    local file = data.tokens(path, { vocab = 1000, length = 8, seed = 5 })
    local mix = data.mixture({ file, data.parity { length = 4 } }, { seed = 2 })
    assert.equal(1000, mix.vocab)
    local b = mix:next(16, { length = 6 })
    assert.same({ 16, 6 }, b.tokens:shape())
    local from_file = 0
    for _, row in ipairs(b.tokens:to_table()) do
      if row[1] > 1 then -- a window of the file: consecutive ids (file sample r with this call's length)
        from_file = from_file + 1
        for t = 2, 6 do assert.equal(row[1] + t - 1, row[t]) end
      end
    end
    assert.is_true(from_file > 2 and from_file < 14)
    -- a mixture of a mixture draws every leaf, whatever the seeds
    local inner = data.mixture({ data.parity { length = 3 }, data.parity { length = 5 } })
    local outer = data.mixture({ inner, data.parity { length = 7 } })
    local counts = {}
    for i = 0, 299 do
      local n = #outer:sample(i)
      counts[n] = (counts[n] or 0) + 1
    end
    assert.is_true(counts[3] > 40 and counts[5] > 40 and counts[7] > 100)
    assert.same({ 2, 7 }, outer:next(2, { weights = { 0, 1 } }).tokens:shape())
    assert.equal('m3.data.mixture: sources[2] is an order = "stream" source: its rows continue their own text, '
      .. 'which rows drawn from a mixture cannot (use order = "random" or "sequential")',
      message_of(function() data.mixture { file, data.tokens(path, { vocab = 1000, order = "stream" }) } end))
    assert.equal('m3.data.mixture: sources[1] = "p": expected an m3.data source',
      message_of(function() data.mixture { "p" } end))
    os.remove(path)
  end)

  it("honour mixture weights, of nested mixtures and per call too (counts within 5 standard deviations)", function()
    local leaves = { data.parity { length = 3 }, data.parity { length = 4 }, data.parity { length = 5 } }
    local mix = data.mixture(leaves, { seed = 4, weights = { 1, 2, 5 } })
    local counts = length_counts(mix, 8000)
    assert_binomial(counts[3], 8000, 1 / 8, "weight 1")
    assert_binomial(counts[4], 8000, 2 / 8, "weight 2")
    assert_binomial(counts[5], 8000, 5 / 8, "weight 5")
    local per_call = {}
    for i = 0, 1999 do
      local n = #mix:sample(i, { weights = { 0, 1, 3 } })
      per_call[n] = (per_call[n] or 0) + 1
    end
    assert.is_nil(per_call[3])
    assert_binomial(per_call[4], 2000, 1 / 4, "weight 1 of 4")
    local nested = data.mixture({ data.mixture({ leaves[1], leaves[2] }, { weights = { 1, 3 } }), leaves[3] })
    counts = length_counts(nested, 8000)
    assert_binomial(counts[3], 8000, 1 / 8, "1/2 * 1/4")
    assert_binomial(counts[4], 8000, 3 / 8, "1/2 * 3/4")
    assert_binomial(counts[5], 8000, 1 / 2, "1/2")
  end)

  it("continue with exactly the same batches from a cursor in a fresh source, for every kind", function()
    local path = counting_u16_file(3000)
    local makers = {
      parity = function() return data.parity { seed = 3, length = 9, min_length = 1, density = "random" } end,
      arithmetic = function() return data.arithmetic { seed = 4, length = 12, min_length = 2, targets = "running" } end,
      brackets = function() return data.arithmetic { seed = 5, length = 12, min_length = 2, brackets = true } end,
      mqar = function() return data.mqar { seed = 6, keys = 16, values = 8 } end,
      random = function() return data.tokens(path, { vocab = 3000, seed = 7 }) end,
      sequential = function() return data.tokens(path, { vocab = 3000, order = "sequential" }) end,
      stream = function() return data.tokens(path, { vocab = 3000, order = "stream" }) end,
      mixture = function()
        return data.mixture({ data.parity { seed = 1 }, data.arithmetic { seed = 2, offset = 2, min_length = 2 },
          data.mixture({ data.mqar { seed = 3 }, data.tokens(path, { vocab = 3000, seed = 8 }) }, { seed = 9 }) },
          { seed = 10, weights = { 1, 2, 3 } })
      end,
    }
    local lengths = { 6, 12, 9, 7, 11 }
    for kind, make in pairs(makers) do
      local a = make()
      for k = 1, 3 do a:next(4, { length = lengths[k] }) end
      local c = a:cursor()
      local b = make()
      b:seek(c)
      assert.same(c, b:cursor())
      for k = 4, 5 do
        local want, got = a:next(4, { length = lengths[k] }), b:next(4, { length = lengths[k] })
        assert.same(want.tokens:to_table(), got.tokens:to_table(), kind)
        assert.same(want.targets:to_table(), got.targets:to_table(), kind)
      end
      assert.same(a:cursor(), b:cursor())
    end
    os.remove(path)
  end)

  it("keep a call's ids within the source's vocab: a larger modulus, keys, values or offset per call is an error",
    function()
      -- a call with modulus = 7 gave ids up to 12 from a source of vocab 11
      local a = data.arithmetic { seed = 1, length = 8 }
      assert.equal("m3.data.arithmetic: this call's options (modulus = 7, offset = 0) need vocab 13, more than this "
        .. "source's 11 (src.vocab, for the model's vocab_size): make the source with the options that need the most "
        .. "ids",
        message_of(function() a:next(2, { modulus = 7 }) end))
      assert.equal(0, a:cursor().index)
      assert.matches("^m3%.data%.mqar: this call's options %(keys = 40, values = 32, offset = 0%) need vocab 72, more "
        .. "than this source's 64 ", message_of(function() data.mqar {}:sample(0, { keys = 40 }) end))
      assert.matches("^m3%.data%.parity: this call's options %(offset = 1%) need vocab 3, more than this source's 2 ",
        message_of(function() data.mixture { data.parity {} }:next(1, { offset = 1 }) end))
      -- what fits is drawn: every id below the source's vocab
      local big = data.arithmetic { seed = 1, length = 8, modulus = 7, offset = 1 }
      for _, o in ipairs { { modulus = 3 }, { modulus = 7, offset = 0 }, { modulus = 6, offset = 2 } } do
        local b = big:next(8, o)
        for i = 0, b.tokens:numel() - 1 do
          assert.is_true(b.tokens[i] >= 0 and b.tokens[i] < big.vocab and b.targets[i] < big.vocab)
        end
      end
    end)

  it("refuse a sample index that is not an integer in [0, 2^53) (a sequential file gave a window for -1 and 1.5)",
    function()
      local path = tmpfile("abcdefghijklmnopqrstuvwxyz0123456789")
      local sources = { data.parity { length = 3 }, data.mixture { data.parity { length = 3 } },
        data.text(path, { length = 3 }), data.text(path, { order = "sequential", length = 3 }) }
      for _, s in ipairs(sources) do
        for _, index in ipairs { -1, 1.5, "x", 2 ^ 53 } do
          assert.equal("m3.data: sample: index = " .. (index == "x" and '"x"' or tostring(index))
            .. ": expected an integer in [0, 2^53)", message_of(function() s:sample(index) end))
        end
      end
      assert.equal("m3.data: offset: index = -1: expected an integer in [0, 2^53)",
        message_of(function() sources[4]:offset(-1, 3) end))
      assert.equal("m3.data: offset: L = nil: expected an integer >= 1",
        message_of(function() sources[4]:offset(0) end))
      assert.equal(3, sources[4]:offset(1, 3))
      os.remove(path)
    end)

  it("refuse the cursor of a stream in a source of another kind (it dropped where each row stood)", function()
    local path = tmpfile("abcdefghijklmnopqrstuvwxyz0123456789")
    local st = data.text(path, { order = "stream", split = "all", length = 4 })
    st:next(2)
    local c = st:cursor()
    for _, s in ipairs { data.parity {}, data.mixture { data.parity {} }, data.text(path, { length = 4 }),
                         data.text(path, { order = "sequential", length = 4 }) } do
      assert.equal('m3.data: seek: cursor.rows = 2: the cursor of an order = "stream" file source, which this source '
        .. "cannot continue (its cursor is {seed =, index =})", message_of(function() s:seek(c) end))
      assert.equal(0, s:cursor().index)
    end
    assert.matches("m3.data: seek: cursor.position = 0: the cursor of an order = \"stream\"",
      message_of(function() data.parity { cursor = { seed = 0, index = 0, position = 0 } } end), 1, true)
    local again = data.text(path, { order = "stream", split = "all", length = 4, cursor = c })
    assert.same(st:next(2).tokens:to_table(), again:next(2).tokens:to_table())
    os.remove(path)
  end)

  it("refuse a mixture of sources that are not a list (a hole gave a raw Lua error when its index was drawn)",
    function()
      local a = data.parity {}
      assert.equal("m3.data.mixture: the sources have nil at [2]: expected a list of sources",
        message_of(function() data.mixture({ a, nil, data.parity {} }) end))
      assert.equal('m3.data.mixture: the sources have the key "x": expected a list of sources',
        message_of(function() data.mixture({ a, x = a }) end))
      assert.equal("m3.data.mixture: expected a list of sources, got {}", message_of(function() data.mixture {} end))
    end)

  it("refuse mixture weights that are not finite numbers >= 0, one per source, not all 0", function()
    local sources = { data.parity { seed = 1, length = 8 }, data.parity { seed = 2, length = 4 } }
    local cases = {
      { { 0 / 0, 1 }, "weights%[1%] = [-]?nan: expected a finite number >= 0" },
      { { math.huge, 1 }, "weights%[1%] = inf: expected a finite number >= 0" },
      { { 1, -2 }, "weights%[2%] = %-2: expected a finite number >= 0" },
      { { 1, "2" }, 'weights%[2%] = "2": expected a finite number >= 0' },
      { { 0, 0 }, "the weights sum to 0: expected a finite sum > 0" },
      { { 1e308, 1e308 }, "the weights sum to inf: expected a finite sum > 0" },
      { { 1 }, "weights = a list of 1: expected a list of 2 numbers >= 0, one per source" },
      { { 1, 2, 3 }, "weights = a list of 3: expected a list of 2 numbers >= 0, one per source" },
      { 5, "weights = 5: expected a list of 2 numbers >= 0, one per source" },
    }
    local mix = data.mixture(sources, { seed = 1 })
    for _, c in ipairs(cases) do
      assert.matches("^[^:]*data_spec%.lua:%d+: m3%.data%.mixture: " .. c[2] .. "$",
        helper.error_of(function() data.mixture(sources, { weights = c[1] }) end))
      assert.matches("^[^:]*data_spec%.lua:%d+: m3%.data%.mixture: this call: " .. c[2] .. "$",
        helper.error_of(function() mix:next(2, { weights = c[1] }) end))
    end
    assert.equal(0, mix:cursor().index)
    assert.same({ 2, 8 }, mix:next(2, { weights = { 1, 0 } }).tokens:shape())
  end)

  it("refuse NaN and other numbers out of range (density, modulus, keys, values, offset, pad_to), made and per call",
    function()
      local p = data.parity { seed = 1, length = 4 }
      -- density NaN made every bit 0
      for _, d in ipairs { 0 / 0, -0.5, 1.5, "0.5" } do
        local want = 'm3.data.parity: density must be a probability in [0, 1] or "random", got '
          .. (d == "0.5" and '"0.5"' or tostring(d))
        assert.equal(want, message_of(function() p:next(2, { density = d }) end))
        assert.equal(want, message_of(function() data.parity { density = d }:sample(0) end))
      end
      -- the vocab of a task made with them was NaN
      assert.equal("m3.data.arithmetic: modulus must be an integer >= 2, got nan",
        message_of(function() data.arithmetic { modulus = 0 / 0 } end))
      assert.equal("m3.data.mqar: keys must be an integer >= 1, got nan",
        message_of(function() data.mqar { keys = 0 / 0 } end))
      assert.equal("m3.data.mqar: values must be an integer >= 1, got 1.5",
        message_of(function() data.mqar { values = 1.5 } end))
      -- an offset of NaN gave ids of -2^31, one of 1.5 was cut to an integer
      for _, off in ipairs { 0 / 0, 1.5, -1, "2" } do
        local shown = off == "2" and '"2"' or tostring(off)
        assert.equal("m3.data.parity: offset = " .. shown .. ": expected an integer >= 0",
          message_of(function() data.parity { offset = off } end))
        assert.equal("m3.data.parity: offset = " .. shown .. ": expected an integer >= 0",
          message_of(function() p:next(2, { offset = off }) end))
      end
      -- a pad_to of "6" gave a raw comparison error, NaN the tensor's
      for _, pad in ipairs { 0 / 0, 5.5, math.huge, 0, "6" } do
        assert.equal("m3.data: pad_to = " .. (pad == "6" and '"6"' or tostring(pad)) .. ": expected an integer >= 1",
          message_of(function() p:next(2, { pad_to = pad }) end))
      end
      assert.equal(0, p:cursor().index)
      -- a call's offset within the source's vocab (one beyond it: see "keep a call's ids within the source's vocab")
      assert.same({ 2, 6 }, data.parity { seed = 1, length = 4, offset = 3 }:next(2, { pad_to = 6, offset = 2 })
        .tokens:shape())
      assert.equal(4, data.parity { offset = 2 }.vocab)
    end)

  it("refuse batches past the engine's int32 positions and samples past 2^27 ids before drawing any (they hung)",
    function()
      -- in a process of its own, which the timeout ends where a call would hang
      local out, status = m3lua_script([[
        local data = require "m3.data"
        local src = data.parity { length = 2 }
        for _, call in ipairs {
          function() src:next(2 ^ 31 - 1) end,
          function() src:next(2, { pad_to = 2 ^ 31 - 1 }) end,
          function() data.mixture { src, data.parity {} }:next(2 ^ 31 - 1, { length = 2 }) end,
          function() data.parity {}:next(1, { length = 2 ^ 31 - 1 }) end,
          function() data.arithmetic { brackets = true }:next(1, { length = 2 ^ 31 - 1 }) end,
          function() data.mqar {}:next(1, { pairs = 2, queries = 2 ^ 31 - 1 }) end,
          function() data.mqar { keys = 1000 }:next(1, { pairs = 1000, queries = 134217000 }) end,
        } do print((select(2, pcall(call)):gsub("^[^:]*:%d+: ", ""))) end
        print(src:cursor().index)
      ]])
      local too_many = "make 4294967294 positions, more than a batch holds (2147483647: the engine counts rows * len "
        .. "in an int32); draw fewer rows or shorter ones"
      local lists = ": must be at most 134217728 (a sample is drawn as Lua lists, which hold at most 2^27 items)"
      assert.equal(table.concat({
        "m3.data: next: 2147483647 rows of samples of up to 2 ids " .. too_many,
        "m3.data: next: 2 rows of pad_to = 2147483647 ids " .. too_many,
        "m3.data: next: 2147483647 rows of samples of up to 2 ids " .. too_many,
        "m3.data.parity: length = 2147483647" .. lists,
        "m3.data.arithmetic: length = 2147483647" .. lists,
        "m3.data.mqar: queries = 2147483647" .. lists,
        "m3.data.mqar: pairs = 1000 and queries = 134217000 make samples of 2 * pairs + queries = 134219000 ids"
          .. lists,
        "0", "" }, "\n"), out)
      assert.equal(0, status)
      -- a sample within the bounds is drawn
      assert.same({ 1, 5 }, data.mqar {}:next(1, { pairs = 2, queries = 1 }).tokens:shape())
    end)

  it("bound a task's vocab with its offset by a model's largest vocab_size (2^24; past 2^31 ids wrapped)", function()
    assert.equal("m3.data.parity: offset = 16777215: the vocab (2 token ids of the task + offset) must be at most "
      .. "16777216, the largest vocab_size of a model", message_of(function() data.parity { offset = 2 ^ 24 - 1 } end))
    assert.equal("m3.data.mqar: offset = 2147483647: the vocab (64 token ids of the task + offset) must be at most "
      .. "16777216, the largest vocab_size of a model",
      message_of(function() data.mqar {}:next(1, { offset = 2 ^ 31 - 1 }) end))
    assert.equal(2 ^ 24, data.parity { offset = 2 ^ 24 - 2 }.vocab)
  end)

  it("check a call's option names: the task's, pad_to, offset and those m3.fit passes along; a mixture's too",
    function()
      local p = data.parity { seed = 1, length = 4 }
      -- a misspelled name was ignored: the batch had the default length
      assert.equal('m3.data: next: unknown option "lenght" (did you mean "length"?); valid options: batch, batches, '
        .. "density, first, index, last, length, min_length, offset, pad_to, rows, steps, targets",
        message_of(function() p:next(1, { lenght = 3 }) end))
      assert.matches('^m3.data: next: unknown option "weights"; valid options: ',
        message_of(function() p:next(1, { weights = { 1 } }) end)) -- a mixture's, not this source's
      assert.matches('^m3.data: next: expected an options table, got 3$', message_of(function() p:next(1, 3) end))
      assert.equal(0, p:cursor().index)
      -- a curriculum phase as is, fit.evaluate's options, and min_length for mqar (curriculum.lengths sets it)
      assert.same({ 2, 3 }, p:next(2, { steps = 10, length = 3, batch = 2, index = 1, first = 1, last = 10 })
        .tokens:shape())
      assert.same({ 2, 3 }, p:next(2, { batches = 4, rows = 2, length = 3, min_length = 3, targets = "final" })
        .tokens:shape())
      assert.same({ 1, 9 }, data.mqar {}:next(1, { length = 9, min_length = 1, pairs = 3, queries = 3 }).tokens:shape())
      assert.matches('unknown option "modulo" %(did you mean "modulus"%?%)',
        message_of(function() data.arithmetic {}:next(1, { modulo = 7 }) end))
      -- a mixture takes weights, pad_to and its sources' names, nothing else
      local path = counting_u16_file(100)
      local mix = data.mixture { p, data.tokens(path, { vocab = 100, length = 4 }) }
      assert.equal('m3.data: next: unknown option "densty" (did you mean "density"?); valid options: batch, batches, '
        .. "density, first, index, last, length, min_length, offset, pad_to, rows, steps, targets, weights",
        message_of(function() mix:next(2, { densty = 0.2 }) end))
      assert.equal(0, mix:cursor().index)
      assert.same({ 2, 5 }, mix:next(2, { length = 3, density = 0.2, weights = { 1, 1 }, pad_to = 5 }).tokens:shape())
      os.remove(path)
    end)

  it("checks a source's options when it is made, each on its own and length with min_length, and names a method "
    .. "called with '.'", function()
    -- each was taken, and only a call of next raised (ops = "" as 'got ' with nothing after it)
    assert.equal("m3.data.parity: length must be an integer >= 1, got 0",
      message_of(function() data.parity { length = 0 } end))
    assert.equal("m3.data.parity: min_length must be an integer in [1, length = 4], got 8",
      message_of(function() data.parity { min_length = 8, length = 4 } end))
    for _, d in ipairs { 2, 0 / 0 } do
      assert.equal('m3.data.parity: density must be a probability in [0, 1] or "random", got ' .. options.show(d),
        message_of(function() data.parity { density = d } end))
    end
    for _, ops in ipairs { "", "/%" } do
      assert.equal("m3.data.arithmetic: ops must be a non-empty string of '+', '-', '*', got " .. options.show(ops),
        message_of(function() data.arithmetic { ops = ops } end))
    end
    assert.equal('m3.data.arithmetic: targets must be "final", got running',
      message_of(function() data.arithmetic { brackets = true, targets = "running" } end))
    -- a call may give what the source's own options leave open
    assert.same({ 1, 16 }, data.parity { min_length = 8 }:next(1, { length = 16 }).tokens:shape())
    local src = data.parity { length = 4 }
    assert.equal("m3.data: next: expected a data source (call it as src:next(rows, o)), got 2",
      message_of(function() src.next(2) end))
    assert.equal("m3.data: cursor: expected a data source (call it as src:cursor()), got nil",
      message_of(function() src.cursor() end))
    local mix = data.mixture { src, data.arithmetic {} }
    assert.equal("m3.data: next: expected a data source (call it as src:next(rows, o)), got 3",
      message_of(function() mix.next(3) end))
  end)
end)

describe("m3.data batches and files", function()
  it("pack samples into int32 tensors, padded, and resume from a cursor", function()
    local a = data.arithmetic { seed = 8, length = 12, min_length = 4, brackets = true }
    local b1 = a:next(3)
    local c = a:cursor()
    assert.same({ seed = 8, index = 3 }, c)
    local b2 = a:next(3, { pad_to = 16 })
    local b = data.arithmetic { seed = 8, length = 12, min_length = 4, brackets = true, cursor = c }
    local b2_again = b:next(3, { pad_to = 16 })
    assert.same(b2.tokens:to_table(), b2_again.tokens:to_table())
    assert.same(b2.targets:to_table(), b2_again.targets:to_table())
    assert.equal("i32", b1.tokens:dtype())
    assert.equal(16, b2.tokens:shape()[2])
    -- row r is sample index r; padding after the sample has target -1
    local toks, tgts = a:sample(4)
    local row = b2.targets:to_table()[2]
    for t = 1, 16 do assert.equal(tgts[t] or -1, row[t]) end
    assert.equal(toks[1], b2.tokens:to_table()[2][1])
  end)

  it("refuse a row count that is not a positive integer and stay usable", function()
    local path = tmpfile("abcdefghijklmnopqrstuvwxyz0123456789")
    local p = data.parity { seed = 1, length = 4 }
    local sources = { p, data.mixture({ p }, { seed = 2 }), data.text(path, { length = 4 }) }
    for _, s in ipairs(sources) do
      for _, rows in ipairs { -1, 0, 1.5, "2", 0 / 0 } do
        local ok, err = pcall(s.next, s, rows)
        assert.is_false(ok)
        assert.matches("m3.data: next: rows = " .. (type(rows) == "string" and '"2"' or tostring(rows)):gsub("%p", "%%%0")
          .. ": expected an integer >= 1", err)
        assert.same(0, s:cursor().index)
      end
      assert.same({ 2, 4 }, s:next(2).tokens:shape())
      assert.same(2, s:cursor().index)
    end
    -- a batch that cannot be packed leaves the cursor where it was
    for _, s in ipairs { sources[1], sources[2] } do
      assert.has_error(function() s:next(2, { pad_to = 3 }) end)
      assert.same(2, s:cursor().index)
    end
    os.remove(path)
  end)

  it("reject unknown options and bad choices when they are made", function()
    assert.has_error(function() data.parity { lenght = 3 } end,
      'm3.data.parity: unknown option "lenght" (did you mean "length"?); valid options: cursor, density, '
      .. "length, min_length, offset, pad_to, seed, targets")
    assert.has_error(function() data.arithmetic { modulo = 7 } end)
    assert.has_error(function() data.mqar { pair = 2 } end)
    local p = data.parity {}
    assert.has_error(function() data.mixture({ p }, { weight = { 1 } }) end,
      'm3.data.mixture: unknown option "weight" (did you mean "weights"?); valid options: cursor, seed, weights')
    -- options that are no table gave a raw error from inside pairs
    assert.equal("m3.data.mixture: expected an options table, got 5", message_of(function() data.mixture({ p }, 5) end))
    local path = tmpfile("abcdefghijklmnopqrstuvwxyz0123456789")
    assert.has_error(function() data.text(path, { lenght = 4 }) end,
      'm3.data.text: unknown option "lenght" (did you mean "length"?); valid options: cursor, length, order, rows, '
      .. "seed, split, val_fraction")
    assert.has_error(function() data.tokens(path, { dtype = "u8", splt = "val" }) end)
    assert.has_error(function() data.text(path, { split = "test" }) end,
      'm3.data.text: split = "test": expected "train", "val" or "all"')
    assert.has_error(function() data.text(path, { order = "shuffled" }) end,
      'm3.data.text: order = "shuffled": expected "random", "sequential" or "stream"')
    assert.has_error(function() data.tokens(path, { dtype = "u64" }) end,
      'm3.data.tokens: dtype = "u64": expected "u8", "u16" or "u32"')
    assert.has_error(function() data.text(path, { val_fraction = "a" }) end,
      'm3.data.text: val_fraction = "a": expected a number in [0, 1)')
    os.remove(path)
  end)

  it("name the split and its val_fraction when the split is too short for a window", function()
    local path = tmpfile("0123456789")
    -- the message said "ten ids in this split" without which split, or what sizes it
    assert.equal('m3.data: ' .. path .. ' has 1 ids in this split, a window of 4 needs 5 (split = "val": the last '
      .. "val_fraction = 0.1 of the file's 10 ids)",
      message_of(function() data.text(path, { split = "val", length = 4 }):next(1) end))
    assert.equal('m3.data: ' .. path .. ' has 9 ids in this split, a window of 9 needs 10 (split = "train": all but '
      .. "the last val_fraction = 0.1 of the file's 10 ids)",
      message_of(function() data.text(path, { order = "sequential" }):next(1, { length = 9 }) end))
    assert.equal('m3.data: ' .. path .. ' has 10 ids in this split, a window of 10 needs 11 (split = "all": the '
      .. "whole file)", message_of(function() data.text(path, { split = "all" }):sample(0, { length = 10 }) end))
    assert.equal('m3.data: 2 rows of windows of 4 do not fit in the 5 ids of this split (split = "train": all but the '
      .. "last val_fraction = 0.5 of the file's 10 ids)",
      message_of(function() data.text(path, { order = "stream", val_fraction = 0.5 }):next(2, { length = 4 }) end))
    os.remove(path)
  end)

  it("say when a path is a folder", function()
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir " .. dir) == 0)
    local ok, err = pcall(function() data.text(dir) end)
    assert.is_false(ok)
    assert.matches("^[^:]*data_spec%.lua:%d+: m3%.data%.text: " .. dir:gsub("%p", "%%%0") .. " is a folder, not a regular file: expected a file of ids$", err)
    ok, err = pcall(function() data.tokens(dir .. "/missing", { vocab = 10 }) end)
    assert.matches("^[^:]*data_spec%.lua:%d+: m3%.data%.tokens: cannot open .*missing: No such file or directory$", err)
    os.execute("rm -rf " .. dir)
  end)

  it("refuse a path that is not a regular file before opening it (a FIFO waited for a writer for ever)", function()
    local fifo = os.tmpname()
    os.remove(fifo)
    assert(os.execute("mkfifo " .. fifo) == 0)
    local out, status = m3lua_script(string.format([[
      local ok, err = pcall(require("m3.data").text, %q)
      print(err)
      local ok2, err2 = pcall(require("m3.data").tokens, "/dev/zero", { dtype = "u8" })
      print(err2)
    ]], fifo))
    os.remove(fifo)
    assert.equal(0, status, out)
    assert.equal("m3.data.text: " .. fifo .. " is a FIFO (named pipe), not a regular file: expected a file of ids\n"
      .. "m3.data.tokens: /dev/zero is a character device, not a regular file: expected a file of ids\n", out)
  end)

  it("raise an error naming the file when it was truncated in place while open", function()
    local path = tmpfile(string.rep("abcdefghij", 10000))
    local out, status = m3lua_script(string.format([[
      local src = require("m3.data").text(%q, { length = 64, seed = 1 })
      src:next(4)
      local f = assert(io.open(%q, "wb")) -- truncates the file in place
      f:write(string.rep("x", 1000))
      f:close()
      for _, read in ipairs { function() src:next(4) end, function() src:sample(7) end,
                              function() src:slice(0, 2) end } do
        local ok, err = pcall(read)
        print(ok, (tostring(err):gsub("^[^:]*:%%d+: ", "")))
      end
    ]], path, path))
    os.remove(path)
    assert.equal(0, status, out)
    local message = "m3.data: " .. path .. " now has 1000 bytes, fewer than the 100000 it had when this source was "
      .. "made: it was truncated in place while being read; replace a data file by writing the new one elsewhere and "
      .. "renaming it over the old (mv)"
    assert.equal(string.rep("false\t" .. message .. "\n", 3), out)
  end)

  it("never kill the process when the file is cut short and restored while windows are read (SIGBUS when mapped)",
    function()
    local body = string.rep("0123456789abcdef", 65536) -- 1 MiB
    local path, orig, done = tmpfile(body), tmpfile(body), os.tmpname()
    os.remove(done)
    local p = path:gsub("%p", "%%%0")
    -- once the source is open, a writer cuts the file to 1000 bytes and writes it back in place, 100 times, while
    -- the script reads windows until the writer is done; every read gives a batch or one of the two errors
    local out, status = m3lua_script(string.format([[
      local src = require("m3.data").text(%q, { length = 256, seed = 1 })
      local writer = io.popen("for i in $(seq 100); do truncate -s 1000 %s; cat %s > %s; done; touch %s")
      local reads, other = 0, 0
      repeat
        local ok, err = pcall(src.next, src, 16)
        err = tostring(err):gsub("^[^:]*:%%d+: ", "")
        if not (ok or err:find("^m3%%.data: %s now has %%d+ bytes, fewer than the 1048576 it had when this source was made")
          or err:find("^m3%%.data: %s: ids %%[%%d+, %%d+%%) run past the end of the file$")) then
          other = other + 1
          print(err)
        end
        reads = reads + 1
      until require("m3.fs").exists(%q)
      writer:close()
      print(reads > 0, other)
    ]], path, path, orig, path, done, p, p, done))
    os.remove(path)
    os.remove(orig)
    os.remove(done)
    assert.equal(0, status, out)
    assert.equal("true\t0\n", out)
  end)

  it("read text windows: targets are the next bytes; random, sequential and stream orders", function()
    local path = tmpfile("abcdefghijklmnopqrstuvwxyz0123456789")
    local s = data.text(path, { order = "sequential", split = "all", length = 5 })
    assert.equal(256, s.vocab)
    assert.equal(7, s:count())
    local b = s:next(2)
    assert.same({ { 97, 98, 99, 100, 101 }, { 102, 103, 104, 105, 106 } }, b.tokens:to_table())
    assert.same({ 98, 99, 100, 101, 102 }, b.targets:to_table()[1])
    local st = data.text(path, { order = "stream", split = "all" })
    local x, y = st:next(2, { length = 4 }), st:next(2, { length = 4 })
    assert.same({ 97, 98, 99, 100 }, x.tokens:to_table()[1])
    assert.same({ 101, 102, 103, 104 }, y.tokens:to_table()[1])   -- row 0 continues
    assert.same({ 115, 116, 117, 118 }, x.tokens:to_table()[2]) -- "stuv": the second half
    local r1 = data.text(path, { seed = 4, length = 6 })
    local first = r1:next(4).tokens:to_table()
    local again = data.text(path, { seed = 4, length = 6 }):next(4).tokens:to_table()
    assert.same(first, again)
    local text = "abcdefghijklmnopqrstuvwxyz0123456789"
    for _, row in ipairs(first) do
      assert.truthy(text:find(string.char(unpack(row)), 1, true))
    end
    local val = data.text(path, { split = "val", order = "sequential", val_fraction = 0.25, length = 3 })
    assert.same({ 49, 50, 51 }, val:next(1).tokens:to_table()[1]) -- "123": from byte 27 on
    os.remove(path)
  end)

  it("draw random windows at every offset that holds one (the last too), sequential ones within the split", function()
    -- 6 ids hold windows of 4 (and their last target) at offsets 0 and 1
    local path = tmpfile("abcdef")
    local s = data.text(path, { split = "all", length = 4, seed = 3 })
    local seen = {}
    for i = 0, 199 do
      local off = s:offset(i, 4)
      seen[off] = (seen[off] or 0) + 1
      local toks, tgts = s:sample(i)
      assert.same({ 97 + off, 98 + off, 99 + off, 100 + off }, toks)
      assert.same({ 98 + off, 99 + off, 100 + off, 101 + off }, tgts)
    end
    assert.is_true(seen[0] > 50 and seen[1] > 50)
    for off in pairs(seen) do assert.is_true(off == 0 or off == 1, "offset " .. off) end
    os.remove(path)
    -- 8 ids hold one window of 4 and its last target (ids 0 .. 4), not two: window 1 wraps around to it; so does
    -- the train split of 10 ids with val_fraction = 0.2 (its 8 ids; the 9th is val's)
    local eight, ten = tmpfile("abcdefgh"), tmpfile("abcdefghij")
    for _, q in ipairs { data.text(eight, { split = "all", order = "sequential", length = 4 }),
                         data.text(ten, { val_fraction = 0.2, order = "sequential", length = 4 }) } do
      assert.equal(1, q:count())
      local b = q:next(2)
      assert.same({ { 97, 98, 99, 100 }, { 97, 98, 99, 100 } }, b.tokens:to_table())
      assert.same({ 98, 99, 100, 101 }, b.targets:to_table()[2])
    end
    os.remove(eight)
    os.remove(ten)
  end)

  it("split the file at floor(n * (1 - val_fraction)): train never holds more than its share", function()
    local path = tmpfile("0123456789")
    -- 10 ids, val_fraction 0.25: train the first 7 (7.5 of them would be its share), val the last 3
    local train = data.text(path, { val_fraction = 0.25, order = "sequential", length = 1 })
    local val = data.text(path, { split = "val", val_fraction = 0.25, order = "sequential", length = 1 })
    assert.same({ 6, 2 }, { train:count(), val:count() })
    assert.same({ { 48 }, { 49 }, { 50 }, { 51 }, { 52 }, { 53 } }, train:next(6).tokens:to_table())
    local b = val:next(2)
    assert.same({ { 55 }, { 56 } }, b.tokens:to_table())
    assert.same({ { 56 }, { 57 } }, b.targets:to_table())
    os.remove(path)
  end)

  it("start a stream's row over only when its window and last target would run past its stretch", function()
    local path = counting_u16_file(1000)
    local s = data.tokens(path, { vocab = 1000, length = 8, order = "stream", split = "all", rows = 2 })
    -- stretches of 500 ids: a window of 8 at 491 reads ids 491 .. 499 (its last target), at 492 it would need 500
    s:seek { seed = 0, index = 2, rows = 2, position = 491 }
    local b = s:next(2)
    assert.same({ 491, 991 }, { b.tokens:to_table()[1][1], b.tokens:to_table()[2][1] })
    assert.same({ 499, 999 }, { b.targets:to_table()[1][8], b.targets:to_table()[2][8] })
    s:seek { seed = 0, index = 2, rows = 2, position = 492 }
    b = s:next(2)
    assert.same({ 0, 500 }, { b.tokens:to_table()[1][1], b.tokens:to_table()[2][1] })
    -- a cursor without rows (earlier versions) leaves the stream's count as it was
    s:seek { seed = 0, index = 4 }
    assert.has_error(function() s:next(4) end, 'm3.data: next: rows = 4, but this order = "stream" source serves 2 '
      .. "rows a call (row r continues row r's text)")
    assert.same({ 2, 8 }, s:next(2).tokens:shape())
    os.remove(path)
  end)

  it("serve a stream's rows in one count a call, so that each row's text goes on", function()
    local path = tmpfile("abcdefghijklmnopqrstuvwxyz0123456789")
    local st = data.text(path, { order = "stream", split = "all", length = 4 })
    assert.same({ 97, 98, 99, 100 }, st:next(2).tokens:to_table()[1])
    for _, rows in ipairs { 1, 3 } do
      assert.has_error(function() st:next(rows) end, "m3.data: next: rows = " .. rows
        .. ', but this order = "stream" source serves 2 rows a call (row r continues row r\'s text)')
    end
    assert.same({ 101, 102, 103, 104 }, st:next(2).tokens:to_table()[1])
    local declared = data.text(path, { order = "stream", split = "all", length = 4, rows = 3 })
    assert.has_error(function() declared:next(2) end)
    assert.equal(0, declared:cursor().index)
    assert.same({ 3, 4 }, declared:next(3).tokens:shape())
    assert.has_error(function() data.text(path, { rows = 2 }) end,
      'm3.data.text: rows = 2: only for order = "stream" (got order "random")')
    assert.has_error(function() data.text(path, { order = "stream", rows = 0 }) end,
      "m3.data.text: rows = 0: expected an integer >= 1")
    os.remove(path)
  end)

  it("resume a stream with its row count: the cursor carries it", function()
    local path = tmpfile("abcdefghijklmnopqrstuvwxyz0123456789")
    local a = data.text(path, { order = "stream", split = "all", length = 2, rows = 2 })
    assert.same({ seed = 0, index = 0, rows = 2, position = 0 }, a:cursor())
    a:next(2)
    local c = a:cursor()
    assert.equal(2, c.rows)
    local want = a:next(2).tokens:to_table()
    local b = data.text(path, { order = "stream", split = "all", length = 2, cursor = c })
    assert.has_error(function() b:next(4) end, 'm3.data: next: rows = 4, but this order = "stream" source serves 2 '
      .. "rows a call (row r continues row r's text)")
    assert.same(want, b:next(2).tokens:to_table())
    assert.equal("m3.data.text: rows = 3, but the cursor's stream serves 2 rows a call",
      message_of(function() data.text(path, { order = "stream", rows = 3, cursor = c }) end))
    assert.equal("m3.data: seek: cursor.rows = 0: expected an integer >= 1",
      message_of(function() b:seek { seed = 0, index = 0, rows = 0 } end))
    -- a cursor of earlier versions (no rows) leaves the count as it was
    local old = data.text(path, { order = "stream", split = "all", length = 2, cursor = { seed = 0, index = 4 } })
    assert.same({ 4, 2 }, old:next(4).tokens:shape())
    os.remove(path)
  end)

  it("continue each row of a stream where it stopped when the length changes, also after a resume", function()
    local path = counting_u16_file(1000)
    local function open(cursor)
      return data.tokens(path, { vocab = 1000, length = 8, order = "stream", split = "all", cursor = cursor })
    end
    local function first_ids(b) -- the first token of each row
      local out = {}
      for r, row in ipairs(b.tokens:to_table()) do out[r] = row[1] end
      return out
    end
    local s = open()
    assert.same({ 0, 500 }, first_ids(s:next(2)))
    assert.same({ 8, 508 }, first_ids(s:next(2)))
    local b = s:next(2, { length = 16 })
    assert.same({ 16, 516 }, first_ids(b))
    assert.equal(31, b.tokens:to_table()[1][16])
    local c = s:cursor()
    assert.same({ seed = 0, index = 6, rows = 2, position = 32 }, c)
    local want = s:next(2, { length = 4 }).tokens:to_table()
    assert.same({ 32, 532 }, { want[1][1], want[2][1] })
    assert.same(want, open(c):next(2, { length = 4 }).tokens:to_table())
    -- a window that would run past a row's stretch (500 ids) starts it over
    s:seek { seed = 0, index = 8, rows = 2, position = 490 }
    assert.same({ 490, 990 }, first_ids(s:next(2, { length = 9 })))
    assert.same({ 0, 500 }, first_ids(s:next(2, { length = 2 })))
    -- a cursor of earlier versions: window index / rows of the call's length
    assert.same({ 16, 516 }, first_ids(open { seed = 0, index = 4 }:next(2)))
    local ok, err = pcall(function() s:seek { seed = 0, index = 0, position = -1 } end)
    assert.is_false(ok)
    assert.equal("m3.data: seek: cursor.position = -1: expected an integer in [0, 2^53)",
      err:match("^[^:]*data_spec%.lua:%d+: (.*)$"))
    os.remove(path)
  end)

  it("seek file sources only to cursors the task sources take, with the same message", function()
    local path = tmpfile("abcdefghijklmnopqrstuvwxyz0123456789")
    for _, index in ipairs { 1.5, -3, 0 / 0 } do
      local c = { seed = 0, index = index }
      local shown = "{seed = 0, index = " .. tostring(index) .. "}"
      local want = "m3.data: seek: expected a cursor {seed =, index =}, each an integer in [0, 2^53), got " .. shown
      local task_err = helper.error_of(function() data.parity { cursor = c } end)
      assert.equal(want, task_err:match("^[^:]*data_spec%.lua:%d+: (.*)$"))
      for _, order in ipairs { "sequential", "random", "stream" } do
        assert.equal(task_err:gsub("^[^:]*:%d+", ""),
          (helper.error_of(function() data.text(path, { order = order, length = 8, cursor = c }) end):gsub("^[^:]*:%d+", "")))
        local s = data.text(path, { order = order, length = 8 })
        assert.matches(want:gsub("%p", "%%%0"), helper.error_of(function() s:seek(c) end))
      end
    end
    assert.matches("m3.data: seek: expected a cursor .*, got nil",
      helper.error_of(function() data.text(path):seek(nil) end))
    local st = data.text(path, { order = "stream", split = "all", length = 4, cursor = { seed = 0, index = 3 } })
    assert.matches("m3.data: next: the cursor's index 3 is not a multiple of the stream's 2 rows",
      helper.error_of(function() st:next(2) end))
    os.remove(path)
  end)

  it("refuse a cursor index that is not a finite integer below 2^53, in every order", function()
    local path = tmpfile("abcdefghijklmnopqrstuvwxyz0123456789")
    local sources = { data.parity {}, data.mixture({ data.parity {} }) }
    for _, order in ipairs { "sequential", "random", "stream" } do
      sources[#sources + 1] = data.text(path, { order = order, length = 4 })
    end
    for _, s in ipairs(sources) do
      for _, index in ipairs { math.huge, 2 ^ 53, 2 ^ 60 } do
        local ok, err = pcall(function() s:seek { seed = 0, index = index } end)
        assert.is_false(ok)
        assert.equal("m3.data: seek: expected a cursor {seed =, index =}, each an integer in [0, 2^53), got "
          .. "{seed = 0, index = " .. tostring(index) .. "}", err:match("^[^:]*data_spec%.lua:%d+: (.*)$"))
      end
      assert.equal(0, s:cursor().index)
    end
    os.remove(path)
  end)

  it("check a call's options like the constructor's: length, and no unknown names", function()
    local path = tmpfile("abcdefghijklmnopqrstuvwxyz0123456789")
    for _, order in ipairs { "sequential", "random", "stream" } do
      local s = data.text(path, { order = order, split = "all", length = 4 })
      for _, L in ipairs { 0, -1, 2.5, 0 / 0, math.huge, "3" } do
        assert.equal("m3.data: next: length = " .. (L == "3" and '"3"' or tostring(L)) .. ": expected an integer >= 1",
          message_of(function() s:next(2, { length = L }) end))
      end
      assert.equal('m3.data: next: unknown option "lenght" (did you mean "length"?); valid options: batch, batches, '
        .. "first, index, last, length, rows, steps", message_of(function() s:next(2, { lenght = 3 }) end))
      assert.equal(0, s:cursor().index)
      -- a curriculum phase passes as is
      assert.same({ 2, 3 }, s:next(2, { steps = 10, length = 3, batch = 2, index = 1, first = 1, last = 10 })
        .tokens:shape())
    end
    local mix = data.mixture { data.text(path, { length = 4 }) }
    assert.equal("m3.data: next: length = 0: expected an integer >= 1",
      message_of(function() mix:next(2, { length = 0 }) end))
    assert.equal("m3.data: sample: length = 0: expected an integer >= 1",
      message_of(function() mix:sample(0, { length = 0 }) end))
    os.remove(path)
  end)

  it("check seeds where they are given: the constructor's and seek's line", function()
    local path = tmpfile("abcdefghijklmnopqrstuvwxyz0123456789")
    local makers = {
      ["m3.data.parity"] = function(seed) return data.parity { seed = seed } end,
      ["m3.data.mixture"] = function(seed) return data.mixture({ data.parity {} }, { seed = seed }) end,
      ["m3.data.text"] = function(seed) return data.text(path, { seed = seed }) end,
      ["m3.data.tokens"] = function(seed) return data.tokens(path, { dtype = "u8", seed = seed }) end,
    }
    for what, make in pairs(makers) do
      for _, seed in ipairs { "x", 1.5, -1, 2 ^ 53, math.huge, 0 / 0 } do
        local ok, err = pcall(function() make(seed) end)
        assert.is_false(ok)
        assert.equal(what .. ": seed = " .. (type(seed) == "string" and '"x"' or tostring(seed))
          .. ": expected an integer in [0, 2^53)", err:match("^[^:]*data_spec%.lua:%d+: (.*)$"))
      end
      local s = make(2 ^ 53 - 1)
      assert.same({ 1, 4 }, s:next(1, { length = 4 }).tokens:shape())
      local ok, err = pcall(function() s:seek { seed = -1, index = 0 } end)
      assert.is_false(ok)
      assert.matches("^[^:]*data_spec%.lua:%d+: m3%.data: seek: expected a cursor .*, got {seed = %-1, index = 0}$",
        err)
    end
    os.remove(path)
  end)

  it("take a token file's vocab as an integer from 1 to 2^24 (a model's largest vocab_size), required for u16 and "
    .. "u32 ids", function()
    local path = tmpfile("abcd")
    local function refusal(opts)
      local ok, err = pcall(function() data.tokens(path, opts) end)
      assert.is_false(ok)
      return err:match("^[^:]*data_spec%.lua:%d+: (.*)$")
    end
    for _, v in ipairs { -1, 0, 2.5 } do
      assert.equal("m3.data.tokens: vocab = " .. v .. ": expected an integer >= 1", refusal { vocab = v })
    end
    assert.equal('m3.data.tokens: vocab = "x": expected an integer >= 1', refusal { vocab = "x" })
    -- a vocab no model takes was accepted (m3.config refused it only later)
    assert.equal("m3.data.tokens: vocab = 16777217: expected at most 16777216, the largest vocab_size of a model",
      refusal { dtype = "u32", vocab = 2 ^ 24 + 1 })
    assert.equal(2 ^ 24, data.tokens(path, { dtype = "u8", vocab = 2 ^ 24 }).vocab)
    for _, dtype in ipairs { "u16", "u32" } do
      assert.equal('m3.data.tokens: vocab: required for dtype "' .. dtype .. '" ids (an integer >= 1: the model\'s '
        .. "vocab_size)", refusal { dtype = dtype })
    end
    assert.equal(256, data.tokens(path, { dtype = "u8" }).vocab)
    assert.equal(50, data.tokens(path, { dtype = "u8", vocab = 50 }).vocab)
    assert.equal(70000, data.tokens(path, { vocab = 70000 }).classes)
    os.remove(path)
  end)

  it("slice ids of the file and refuse a slice past its end", function()
    local path = counting_u16_file(100)
    local s = data.tokens(path, { vocab = 100 })
    assert.same({ 98, 99 }, s:slice(98, 2))
    assert.equal(89, s:count(1)) -- the train split: 90 ids
    assert.equal('m3.data: count: L = "x": expected an integer >= 1', message_of(function() s:count("x") end))
    assert.same({}, s:slice(100, 0))
    local function refusal(...)
      local ok, err = pcall(s.slice, s, ...)
      assert.is_false(ok)
      return err
    end
    assert.equal("m3.data: slice(0, 3000000): ids [0, 3000000) run past the end of " .. path .. " (100 ids)",
      refusal(0, 3e6))
    -- checked before any read: slice's own message, not the one of a read that met the end of the file
    assert.equal("m3.data: slice(99, 2): ids [99, 101) run past the end of " .. path .. " (100 ids)", refusal(99, 2))
    assert.equal("m3.data: slice: first = -1: expected an integer >= 0", refusal(-1, 2))
    assert.equal("m3.data: slice: count = 1.5: expected an integer >= 0", refusal(0, 1.5))
    os.remove(path)
  end)

  it("slice at offsets past 2^31 (a text file of over 2.4 GB: its validation split's start), up to 2^53", function()
    local path = os.tmpname()
    local f = assert(io.open(path, "wb")) -- a sparse file of 2.6 GB: zeros but the last byte
    assert(f:seek("set", 2599999999))
    f:write("z")
    f:close()
    local val = data.text(path, { split = "val" })
    assert.equal(2340000000, val.lo)
    assert.same({ 0, 0 }, val:slice(val.lo, 2))
    assert.same({ 0, 122 }, val:slice(2599999998, 2))
    local ok, err = pcall(val.slice, val, 2 ^ 53, 1)
    os.remove(path)
    assert.is_false(ok)
    assert.equal("m3.data: slice: first = " .. tostring(2 ^ 53) .. ": expected an integer below 2^53 (offsets are "
      .. "exact up to there)", err)
  end)

  it("refuse a window batch past the engine's int32 positions before reading any", function()
    local path = counting_u16_file(100)
    local s = data.tokens(path, { vocab = 100, split = "all", length = 4 })
    assert.equal("m3.data: next: 65536 windows of length = 65536 make 4294967296 positions, more than a batch holds "
      .. "(2147483647: the engine counts rows * len in an int32); draw fewer rows or shorter ones",
      message_of(function() s:next(65536, { length = 65536 }) end))
    assert.equal(0, s:cursor().index)
    assert.equal("m3.data: sample: length = 134217729: must be at most 134217728 (a sample is drawn as Lua lists, "
      .. "which hold at most 2^27 items)", message_of(function() s:sample(0, { length = 2 ^ 27 + 1 }) end))
    assert.equal("m3.data: slice: count = 134217729: must be at most 134217728 (the slice is a Lua list, which holds "
      .. "at most 2^27 items)", message_of(function() s:slice(0, 2 ^ 27 + 1) end))
    os.remove(path)
  end)

  it("read windows and slices longer than one read (1048576 ids) whole, across the reads", function()
    local n = 2 * 1048576 + 10
    local ffi = require "ffi"
    local ids = ffi.new("uint32_t[?]", n)
    for i = 0, n - 1 do ids[i] = i end
    local path = tmpfile(ffi.string(ids, 4 * n))
    local s = data.tokens(path, { dtype = "u32", vocab = n, split = "all", order = "sequential", length = n - 1 })
    local b = s:next(1)
    for _, t in ipairs { 0, 1048575, 1048576, 1048577, n - 2 } do
      assert.equal(t, b.tokens[t])
      assert.equal(t + 1, b.targets[t])
    end
    local toks, tgts = s:sample(0)
    assert.equal(n - 1, #toks)
    assert.equal(n - 1, #tgts)
    assert.same({ 1048575, 1048576, 1048577 }, { toks[1048576], toks[1048577], toks[1048578] })
    assert.same({ 1048576, 1048577, 1048578 }, { tgts[1048576], tgts[1048577], tgts[1048578] })
    local slice = s:slice(5, n - 5)
    assert.equal(n - 5, #slice)
    assert.same({ 1048580, 1048581, n - 1 }, { slice[1048576], slice[1048577], slice[n - 5] })
    os.remove(path)
  end)

  it("refuse a u32 id that no int32 token holds (4294967295 became the ignored target -1)", function()
    local ffi = require "ffi"
    local ids = ffi.new("uint32_t[4]", { 1, 2, 4294967295, 3 })
    local path = tmpfile(ffi.string(ids, 16))
    local s = data.tokens(path, { dtype = "u32", vocab = 10, split = "all", order = "sequential", length = 2 })
    local expected = "m3.data: " .. path .. ": id 4294967295 at offset 2 does not fit an int32 token id: expected "
      .. "ids below vocab = 10"
    assert.equal(expected, message_of(function() s:next(1) end))
    assert.equal(expected, message_of(function() s:sample(0) end))
    assert.equal(expected, message_of(function() data.mixture { s }:next(1) end))
    assert.equal(0, s:cursor().index)
    os.remove(path)
  end)

  it("map uint16 and uint32 token files", function()
    local ffi = require "ffi"
    for _, dt in ipairs { { "u16", "uint16_t", 2 }, { "u32", "uint32_t", 4 } } do
      local ids = ffi.new(dt[2] .. "[?]", 100)
      for i = 0, 99 do ids[i] = 1000 + i * 7 end
      local path = tmpfile(ffi.string(ids, 100 * dt[3]))
      local s = data.tokens(path, { dtype = dt[1], vocab = 2000, order = "sequential", split = "all", length = 10 })
      s:seek { seed = 0, index = 3 }
      local b = s:next(1)
      assert.equal(1000 + 30 * 7, b.tokens[0])
      assert.equal(1000 + 31 * 7, b.targets[0])
      assert.equal(1000 + 40 * 7, b.targets[9])
      os.remove(path)
    end
    assert.has_error(function() data.tokens("/nonexistent/file", { dtype = "u16" }) end)
    local odd = tmpfile("abc")
    assert.has_error(function() data.tokens(odd, { dtype = "u16" }) end)
    os.remove(odd)
  end)
end)

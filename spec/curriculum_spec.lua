-- m3.curriculum: phases by step (handed out as copies), inheritance, maxima, length curricula
-- (at most 1000 stages), validation.

local curriculum = require "m3.curriculum"
local options = require "m3.options"
local helper = require "spec.helper"

describe("m3.curriculum", function()
  local cur = curriculum.new {
    { steps = 100, length = 8, batch = 32, weights = { 1, 0 } },
    { steps = 50, length = 16 },
    { length = 32, batch = 16, weights = { 1, 1 } },
  }

  it("maps steps to phases (1-based, inclusive bounds)", function()
    assert.equal(1, cur:phase(1).index)
    assert.equal(1, cur:phase(100).index)
    assert.equal(2, cur:phase(101).index)
    assert.equal(2, cur:phase(150).index)
    assert.equal(3, cur:phase(151).index)
    assert.equal(3, cur:phase(10 ^ 9).index)
    assert.equal(101, cur:phase(120).first)
    assert.equal(150, cur:phase(120).last)
    assert.equal(math.huge, cur:total())
  end)

  it("inherits fields a phase does not set", function()
    local p = cur:phase(120)
    assert.equal(16, p.length)
    assert.equal(32, p.batch)
    assert.same({ 1, 0 }, p.weights)
    assert.equal(16, cur:phase(200).batch)
    assert.same({ 1, 1 }, cur:phase(200).weights)
    -- steps is a phase's own: the last phase runs on, it does not take the 50 of the phase before
    assert.equal(50, p.steps)
    assert.is_nil(cur:phase(200).steps)
    assert.is_nil(cur:phases()[3].steps)
  end)

  -- the phase of a step is a pure function of the step: what phase() and phases() hand out, and the tables
  -- new() was given, are not the curriculum's own
  it("hands out copies of its phases, nested tables included", function()
    local weights = { 1, 0 }
    local given = { { steps = 10, length = 8, weights = weights }, { length = 16 } }
    local c = curriculum.new(given)
    local p = c:phase(1)
    p.length, p.weights[2] = 999, 5
    c:phases()[2].weights[1] = 7
    c:phases()[1].length = 3
    given[1].length, weights[1] = 4, 6
    assert.equal(8, c:phase(1).length)
    assert.same({ 1, 0 }, c:phase(1).weights)
    assert.same({ 1, 0 }, c:phase(11).weights)
    assert.equal(8, c:phases()[1].length)
    assert.equal(16, c:max("length"))
    assert.are_not.equal(c:phase(1), c:phase(1))
  end)

  it("gives the largest value of a field", function()
    assert.equal(32, cur:max("length"))
    assert.equal(32, cur:max("batch"))
    assert.is_nil(cur:max("pairs"))
  end)

  it("iterates steps with their phases", function()
    local seen = {}
    for s, p in cur:iter(99, 102) do seen[#seen + 1] = s .. ":" .. p.length end
    assert.same({ "99:8", "100:8", "101:16", "102:16" }, seen)
  end)

  it("needs both bounds of iter", function()
    assert.has_error(function() cur:iter() end,
      "m3.curriculum: iter(first, last) expects two steps (integers >= 1), got first = nil, last = nil")
    assert.has_error(function() cur:iter(1) end,
      "m3.curriculum: iter(first, last) expects two steps (integers >= 1), got first = 1, last = nil")
    assert.has_error(function() cur:iter("1", 0 / 0) end,
      'm3.curriculum: iter(first, last) expects two steps (integers >= 1), got first = "1", last = nan')
    local err = helper.error_of(function() cur:iter() end)
    assert.truthy(err:find("curriculum_spec.lua:%d+: m3.curriculum: iter"), err)
  end)

  it("builds length curricula in equal stages", function()
    local c = curriculum.lengths { from = 8, to = 32, steps = 300, min_length = 1, batch = 4 }
    local ph = c:phases()
    assert.equal(3, #ph)
    assert.same({ 8, 16, 32 }, { ph[1].length, ph[2].length, ph[3].length })
    assert.same({ 100, 100, 100 }, { ph[1].steps, ph[2].steps, ph[3].steps })
    assert.equal(1, ph[2].min_length)
    assert.equal(4, ph[3].batch)
    assert.equal(300, c:total())
    local d = curriculum.lengths { from = 10, to = 160, steps = 10 }
    local lens = {}
    for i, p in ipairs(d:phases()) do lens[i] = p.length end
    assert.same({ 10, 20, 40, 80, 160 }, lens)
    local e = curriculum.lengths { from = 3, to = 40, steps = 7, factor = 3 }
    lens = {}
    local total = 0
    for i, p in ipairs(e:phases()) do lens[i], total = p.length, total + p.steps end
    assert.same({ 3, 9, 27, 40 }, lens)
    assert.equal(7, total)
    -- each length is the previous times factor rounded to the nearest integer: 3 * 1.6 = 4.8 -> 5, 5 * 1.6 = 8,
    -- 8 * 1.6 = 12.8 -> 13, 13 * 1.6 = 20.8 -> 21, then to
    lens = {}
    for i, p in ipairs(curriculum.lengths { from = 3, to = 30, steps = 6, factor = 1.6 }:phases()) do lens[i] = p.length end
    assert.same({ 3, 5, 8, 13, 21, 30 }, lens)
    -- 7 steps in 4 stages: stage i ends at step floor(7 * i / 4) = 1, 3, 5, 7, the longer stages last
    local steps = {}
    for i, p in ipairs(e:phases()) do steps[i] = p.steps end
    assert.same({ 1, 2, 2, 2 }, steps)
    -- min_length may be from itself: every stage draws from [from, its length]
    local m = curriculum.lengths { from = 8, to = 16, steps = 2, min_length = 8 }
    assert.same({ 8, 8 }, { m:phase(1).min_length, m:phase(2).min_length })
    -- refused where they are made, not when a stage first draws a length
    local function err(o)
      local ok, e = pcall(curriculum.lengths, o)
      assert.is_false(ok)
      return e
    end
    assert.matches("min_length must be an integer in %[1, from = 12%].*, got 30",
      err { from = 12, to = 48, steps = 30, min_length = 30 })
    assert.matches("3 stages %(lengths 12, 24, 48%) do not fit in 2 steps", err { from = 12, to = 48, steps = 2 })
    assert.equal("m3.curriculum.lengths: 11 stages (lengths 1, 2, 4, 8, 16, 32, 64, 128, ..., 1024) do not fit in 3 "
      .. "steps: at least one step a stage", err { from = 1, to = 1024, steps = 3 })
    -- nine lengths are all shown: a "..." between the eighth and the last would hide nothing
    assert.matches("9 stages %(lengths 1, 2, 4, 8, 16, 32, 64, 128, 256%) do not fit",
      err { from = 1, to = 256, steps = 3 })
  end)

  -- factor 1 + 1e-7 from 1 to 2^31 made 64 million stages (9 s) and a 670 MB message
  it("builds at most 1000 stages, and says so at once with a short message", function()
    local t0 = os.clock()
    local ok, e = pcall(curriculum.lengths, { from = 1, to = 2 ^ 31, steps = 10, factor = 1.0000001 })
    assert.is_false(ok)
    assert.equal("m3.curriculum.lengths: from = 1 to 2147483648 by factor = 1.0000001 makes more than 1000 stages, "
      .. "the most it builds (lengths 1, 2, 3, 4, 5, 6, 7, 8, ..., 2147483648); use a larger factor", e)
    assert.is_true(os.clock() - t0 < 1)
    local c = curriculum.lengths { from = 1, to = 1000, steps = 1000, factor = 1.0001 }
    assert.equal(1000, #c:phases())
    assert.has_error(function() curriculum.lengths { from = 1, to = 1001, steps = 1001, factor = 1.0001 } end)
  end)

  it("passes a phase to a source as is, which refuses a name it does not take", function()
    local src = require("m3.data").parity { seed = 1 }
    local typo = curriculum.new { { steps = 1, length = 4 }, { lenght = 8 } }
    assert.same({ 2, 4 }, src:next(2, typo:phase(1)).tokens:shape())
    -- the misspelled length was ignored: phase 2 drew length 4 too
    assert.matches('m3.data: next: unknown option "lenght" %(did you mean "length"%?%)',
      helper.error_of(src.next, src, 2, typo:phase(2)))
    assert.equal(2, src:cursor().index)
    -- every name of a phase of curriculum.lengths passes
    for _, p in ipairs(curriculum.lengths { from = 2, to = 8, steps = 3, min_length = 1, batch = 2 }:phases()) do
      assert.is_true(src:next(2, p).tokens:shape()[2] <= p.length)
    end
  end)

  -- ipairs used to stop at a hole: the phases after it were dropped, the one before it ran on in their steps
  it("refuses a list of phases with a hole", function()
    local past = { { steps = 2, length = 4 }, { steps = 2, length = 8 }, { length = 16 } }
    past[2] = nil
    local before = { { steps = 2, length = 4 } }
    before[3] = { length = 16 }
    assert.same({ 3, 1 }, { #past, #before }) -- both lengths LuaJIT gives a list with a hole
    for _, phases in ipairs { past, before } do
      assert.equal("m3.curriculum.new: expected a list of phases (keys 1 to n, no hole), e.g. {{steps = 100, length = "
        .. "8}, {length = 16}}, got " .. options.show(phases), helper.error_of(curriculum.new, phases))
    end
  end)

  it("explains bad input", function()
    assert.has_error(function() curriculum.new {} end)
    assert.has_error(function() curriculum.new { { length = 8 }, { length = 16 } } end)
    assert.has_error(function() curriculum.new { { steps = 0 } } end)
    assert.has_error(function() curriculum.lengths { from = 32, to = 8, steps = 10 } end)
    assert.has_error(function() curriculum.lengths { from = 1, to = 1024, steps = 3 } end)
    assert.has_error(function() cur:phase(0) end)
    assert.has_error(function() curriculum.lengths { from = 8, to = 32, steps = 30, foo = 1 } end,
      'm3.curriculum.lengths: unknown option "foo" (did you mean "from"?); valid options: batch, brackets, density, factor, from, '
      .. "keys, min_length, modulus, offset, ops, pad_to, pairs, queries, steps, targets, to, values, weights")
    assert.has_error(function() curriculum.lengths { from = 8, to = 32, steps = 30, min_lenght = 1 } end)
  end)

  it("refuses steps that are not integers >= 1", function()
    for _, s in ipairs({ 0 / 0, 1.1, 0, math.huge }) do
      assert.has_error(function() cur:phase(s) end,
        "m3.curriculum: phase expects a step (an integer >= 1), got " .. tostring(s))
    end
    assert.has_error(function() cur:phase("5") end, 'm3.curriculum: phase expects a step (an integer >= 1), got "5"')
    assert.has_error(function() curriculum.new { { steps = "10" } } end,
      'm3.curriculum.new: phase 1: steps must be an integer >= 1, got "10"')
  end)

  it("refuses NaN and infinite numbers", function()
    local function lengths(o)
      o.from, o.to, o.steps = o.from or 1, o.to or 8, o.steps or 10
      return function() curriculum.lengths(o) end
    end
    assert.has_error(lengths { factor = 0 / 0 }, "m3.curriculum.lengths: factor must be a finite number > 1, got nan")
    assert.has_error(lengths { factor = math.huge },
      "m3.curriculum.lengths: factor must be a finite number > 1, got inf")
    assert.has_error(lengths { factor = "3" }, 'm3.curriculum.lengths: factor must be a finite number > 1, got "3"')
    assert.has_error(lengths { to = math.huge },
      "m3.curriculum.lengths: expected integers 1 <= from <= to, got from = 1, to = inf")
    assert.has_error(lengths { from = "2" },
      'm3.curriculum.lengths: expected integers 1 <= from <= to, got from = "2", to = 8')
    assert.has_error(lengths { steps = math.huge }, "m3.curriculum.lengths: steps must be an integer >= 1, got inf")
    assert.has_error(lengths { steps = 0 / 0 }, "m3.curriculum.lengths: steps must be an integer >= 1, got nan")
    assert.has_error(function() curriculum.new { { steps = math.huge }, { length = 8 } } end,
      "m3.curriculum.new: phase 1: steps must be an integer >= 1, got inf")
  end)

  it("names a method called with '.' instead of ':'", function()
    -- each raised "attempt to index local 'self'"
    assert.has_error(function() cur.phase(3) end,
      "m3.curriculum: phase: expected a curriculum (m3.curriculum.new) (call it as cur:phase(step)), got 3")
    assert.has_error(function() cur.total() end,
      "m3.curriculum: total: expected a curriculum (m3.curriculum.new) (call it as cur:total()), got nil")
    assert.has_error(function() cur.iter(1, 2) end,
      "m3.curriculum: iter: expected a curriculum (m3.curriculum.new) (call it as cur:iter(first, last)), got 1")
  end)
end)

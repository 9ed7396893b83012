-- m3.schedule: values at known steps, composition, validation (steps up to 2^53, values that
-- are finite and >= 0), apply.

local m3 = require "m3"
local schedule = require "m3.schedule"
local options = require "m3.options"
local helper = require "spec.helper"

local function near(want, got)
  assert.is_true(math.abs(want - got) <= 1e-12 * math.max(1, math.abs(want)),
    string.format("expected %.17g, got %.17g", want, got))
end

describe("m3.schedule", function()
  it("constant", function()
    local f = schedule.constant(3e-4)
    assert.equal(3e-4, f(1))
    assert.equal(3e-4, f(1000))
    assert.equal(1e-3, schedule.constant { lr = 1e-3 }(7))
    assert.has_error(function() schedule.constant(0) end)
  end)

  it("linear", function()
    local f = schedule.linear { from = 1, to = 0.5, steps = 10 }
    near(1, f(1))
    near(0.75, f(6))
    near(0.5, f(11))
    near(0.5, f(100))
  end)

  it("linear from 0 is a warmup: its first lr is > 0, as warmup_cosine's", function()
    local f = schedule.linear { from = 0, to = 1e-3, steps = 4 }
    near(2.5e-4, f(1))
    near(1e-3, f(4))
    near(1e-3, f(5))
    local warmup = schedule.linear_warmup { peak = 1e-3, warmup = 4 }
    for s = 1, 10 do near(warmup(s), f(s)) end
    local rise = schedule.linear { from = 0.5, to = 1, steps = 10 }
    near(0.55, rise(1))
    near(1, rise(10))
    -- a warmup piece then a cosine is warmup_cosine; a fall to 0 is wsd's linear decay
    local wc = schedule.warmup_cosine { peak = 1, warmup = 5, total = 20 }
    local seq = schedule.sequence { { schedule.linear { from = 0, to = 1, steps = 5 }, steps = 5 },
      { schedule.cosine { peak = 1, total = 15 } } }
    for s = 1, 22 do near(wc(s), seq(s)) end
    local fall, wsd = schedule.linear { from = 1, to = 0, steps = 10 }, schedule.wsd { peak = 1, total = 10, decay = 10 }
    for s = 1, 12 do near(wsd(s), fall(s)) end
    -- every step of the ramp is one the trainer takes
    local tr = m3.trainer(helper.tokens_lm(), { device = "cpu", batch = 1, seq_len = 4 })
    for s = 1, 5 do
      assert.equal(f(s), schedule.apply(tr, f, s))
      assert.equal(f(s), tr:lr())
    end
    for s = 1, 10 do schedule.apply(tr, fall, s) end
    tr:close()
    assert.equal("m3.schedule.linear: expected from > 0 or to > 0, got both 0",
      helper.error_of(schedule.linear, { from = 0, to = 0, steps = 3 }))
  end)

  it("linear warmup", function()
    local f = schedule.linear_warmup { peak = 1e-3, warmup = 4 }
    near(2.5e-4, f(1))
    near(5e-4, f(2))
    near(1e-3, f(4))
    near(1e-3, f(50))
  end)

  it("cosine", function()
    local f = schedule.cosine { peak = 1, total = 100 }
    near(1, f(1))
    near(0.5, f(51))
    near(0, f(101))
    near(0, f(500))
    near(0.5 * (1 + math.cos(math.pi * 0.99)), f(100))
    assert.is_true(f(100) > 0)
    local g = schedule.cosine { peak = 1, total = 100, floor = 0.1 }
    near(0.55, g(51))
    near(0.1, g(101))
  end)

  it("warmup-cosine with a floor", function()
    local f = schedule.warmup_cosine { peak = 1e-3, warmup = 10, total = 110, floor = 1e-5 }
    near(1e-4, f(1))
    near(1e-3, f(10))
    near(1e-3, f(11))
    near(1e-5 + (1e-3 - 1e-5) * 0.5, f(61))
    near(1e-5, f(111))
    near(1e-5, f(10 ^ 6))
    for s = 2, 110 do assert.is_true(f(s) > 0) end
    for s = 12, 111 do assert.is_true(f(s) <= f(s - 1)) end
  end)

  it("step decay, every n steps and at milestones", function()
    local f = schedule.step_decay { lr = 1, gamma = 0.5, every = 10 }
    near(1, f(1))
    near(1, f(10))
    near(0.5, f(11))
    near(0.25, f(21))
    local g = schedule.step_decay { lr = 1, milestones = { 5, 8 } }
    near(1, g(4))
    near(0.1, g(5))
    near(0.01, g(8))
    assert.has_error(function() schedule.step_decay { lr = 1 } end)
    assert.has_error(function() schedule.step_decay { lr = 1, every = 2, milestones = { 3 } } end)
    -- milestones are steps: >= 1, increasing, a list without holes (ipairs would stop at one)
    assert.matches("milestones must be a list of increasing steps %(integers >= 1%), got milestones%[1%] = %-5",
      helper.error_of(schedule.step_decay, { lr = 1, milestones = { -5, 2 } }))
    assert.matches("milestones must be a list of increasing steps %(integers >= 1%), got {",
      helper.error_of(schedule.step_decay, { lr = 1, milestones = { 1, nil, 4 } }))
  end)

  it("WSD: warmup, stable, decay", function()
    local f = schedule.wsd { peak = 1, warmup = 10, total = 100, decay = 0.2 }
    near(0.1, f(1))
    near(1, f(10))
    near(1, f(50))
    near(1, f(81))
    near(0.5, f(91))
    near(0.05, f(100))
    near(0, f(101))
    local c = schedule.wsd { peak = 1, total = 100, decay = 20, shape = "cosine", floor = 0.2 }
    near(1, c(81))
    near(0.6, c(91))
    near(0.2, c(101))
    local q = schedule.wsd { peak = 1, total = 100, decay = 20, shape = "sqrt" }
    near(1 - math.sqrt(0.25), q(86))
    assert.has_error(function() schedule.wsd { peak = 1, warmup = 90, total = 100, decay = 20 } end)
    assert.has_error(function() schedule.wsd { peak = 1, total = 100, shape = "exp" } end)
  end)


  -- decay as a fraction of total rounds to the nearest step count: 0.2 * 13 = 2.6 is 3 steps (11, 12, 13, at
  -- 1, 2/3, 1/3 of peak), and step 10, the last stable one, is peak, not above it
  it("WSD: a fractional decay rounds to the nearest step; the stable part ends at peak", function()
    local f = schedule.wsd { peak = 1, total = 13, decay = 0.2 }
    for s = 1, 10 do near(1, f(s)) end
    near(1, f(11))
    near(2 / 3, f(12))
    near(1 / 3, f(13))
    near(0, f(14))
  end)

  it("a floor equal to peak is a constant lr after the warmup", function()
    local f = schedule.warmup_cosine { peak = 1e-3, warmup = 2, total = 10, floor = 1e-3 }
    near(5e-4, f(1))
    for s = 2, 12 do near(1e-3, f(s)) end
    local g = schedule.wsd { peak = 2, total = 10, decay = 5, floor = 2 }
    for s = 1, 12 do near(2, g(s)) end
  end)

  -- the default decay (0.2 of total) rounds to too few or too many steps for a short run: the message says
  -- which value was taken and the steps it came to, not "got nil"
  it("WSD: names the default decay and its steps when they do not fit", function()
    assert.equal("m3.schedule.wsd: expected decay (steps, or a fraction of total) in [1, total - warmup = 2] steps, "
      .. "got 0.2 (the default), 0 steps of total = 2", helper.error_of(schedule.wsd, { peak = 1, total = 2 }))
    assert.equal("m3.schedule.wsd: expected decay (steps, or a fraction of total) in [1, total - warmup = 1] steps, "
      .. "got 0.2 (the default), 2 steps of total = 10",
      helper.error_of(schedule.wsd, { peak = 1, warmup = 9, total = 10 }))
    assert.equal("m3.schedule.wsd: expected decay (steps, or a fraction of total) in [1, total - warmup = 10] steps, "
      .. "got 11", helper.error_of(schedule.wsd, { peak = 1, total = 10, decay = 11 }))
  end)

  -- ipairs used to stop at a hole: the pieces after it were dropped, and the piece before it ran on in their steps
  it("sequence: refuses a list of pieces with a hole", function()
    local past = { { schedule.constant(1), steps = 2 }, { schedule.constant(2), steps = 2 }, { schedule.constant(3) } }
    past[2] = nil
    local before = { { schedule.constant(1), steps = 2 } }
    before[3] = { schedule.constant(3) }
    assert.same({ 3, 1 }, { #past, #before }) -- both lengths LuaJIT gives a list with a hole
    for _, pieces in ipairs { past, before } do
      assert.equal("m3.schedule.sequence: expected a list of pieces {f, steps = n} (keys 1 to k, no hole), got "
        .. options.show(pieces), helper.error_of(schedule.sequence, pieces))
    end
  end)

  it("sequence: later pieces see their own step", function()
    local f = schedule.sequence {
      { schedule.linear_warmup { peak = 1, warmup = 5 }, steps = 5 },
      { schedule.constant(0.5), steps = 3 },
      { schedule.cosine { peak = 0.5, total = 10 } },
    }
    near(0.2, f(1))
    near(1, f(5))
    near(0.5, f(6))
    near(0.5, f(8))
    near(0.5, f(9))
    near(0.25, f(14))
    near(0, f(19))
    assert.has_error(function() schedule.sequence { { schedule.constant(1) }, { schedule.constant(1) } } end)
    for _, n in ipairs { math.huge, 0 / 0, 0, 2.5 } do
      assert.matches("^[^:]*schedule_spec%.lua:%d+: m3%.schedule%.sequence: piece 1 needs steps = an integer >= 1, got "
        .. tostring(n):gsub("%p", "%%%0") .. "$",
        helper.error_of(function() schedule.sequence { { schedule.constant(1), steps = n }, { schedule.constant(2) } } end))
    end
  end)

  it("scale", function()
    local f = schedule.scale(schedule.cosine { peak = 1, total = 10 }, 3)
    near(3, f(1))
    near(1.5, f(6))
  end)

  it("names the field and the rule in errors", function()
    assert.has_error(function() schedule.warmup_cosine { peak = 1, warmup = 10, total = 10 } end,
      "m3.schedule.warmup_cosine: expected total > warmup, got total = 10, warmup = 10")
    local ok, err = pcall(schedule.cosine, { total = 10 })
    assert.is_false(ok)
    assert.truthy(err:find("m3.schedule.cosine: expected peak > 0, got nil", 1, true))
    assert.has_error(function() schedule.cosine(5) end)
    -- cosine has no warmup option: the message says what to use instead, for warmup = 0 too
    for _, w in ipairs { 0, 10 } do
      assert.has_error(function() schedule.cosine { peak = 1, total = 10, warmup = w } end,
        "m3.schedule.cosine: warmup = " .. w .. ": cosine has no warmup option; leave it out for none, or use "
        .. "warmup_cosine{peak =, warmup =, total =}")
    end
    -- a string where a number belongs is shown quoted: "1", not 1
    assert.matches('constant: expected a learning rate > 0, got "1"$', helper.error_of(schedule.constant, "1"))
    assert.matches('linear: expected from >= 0, got "1"$',
      helper.error_of(schedule.linear, { from = "1", to = 1, steps = 3 }))
    assert.matches('scale: expected k > 0, got "2"$', helper.error_of(schedule.scale, schedule.constant(1), "2"))
  end)

  it("rejects unknown options with the closest valid name", function()
    local ok, err = pcall(schedule.warmup_cosine, { peak = 1e-3, warmpu = 100, total = 1000 })
    assert.is_false(ok)
    assert.equal('m3.schedule.warmup_cosine: unknown option "warmpu" (did you mean "warmup"?); '
      .. "valid options: floor, peak, total, warmup", err)
    local f = schedule.constant(1)
    for name, call in pairs {
      constant = function() schedule.constant { lr = 1, lrr = 2 } end,
      linear = function() schedule.linear { from = 1, to = 0, steps = 5, stpes = 1 } end,
      linear_warmup = function() schedule.linear_warmup { peak = 1, warmup = 5, total = 9 } end,
      cosine = function() schedule.cosine { peak = 1, total = 10, flor = 0.1 } end,
      step_decay = function() schedule.step_decay { lr = 1, every = 5, gama = 0.5 } end,
      wsd = function() schedule.wsd { peak = 1, total = 10, decay_shape = "cosine" } end,
      sequence = function() schedule.sequence { { f, steps = 2 }, { f, step = 3 } } end,
    } do
      local err = helper.error_of(call)
      assert.truthy(err:find("m3.schedule." .. name .. ": ", 1, true) and err:find("unknown option", 1, true), err)
    end
  end)

  it("reports errors at the caller's line", function()
    for _, call in ipairs {
      function() schedule.warmup_cosine { peak = 0 / 0, warmup = 10, total = 100 } end,
      function() schedule.warmup_cosine { peak = 1, warmup = 1.5, total = 100 } end,
      function() schedule.warmup_cosine { peak = 1, warmup = 10, total = 10 } end,
      function() schedule.warmup_cosine { peak = 1, total = 10, floor = 2 } end,
      function() schedule.linear_warmup { peak = 1, warmup = 0 } end,
      function() schedule.wsd { peak = 1, total = 10, decay = 20 } end,
      function() schedule.step_decay { lr = 1 } end,
      function() schedule.constant(-1) end,
      function() schedule.sequence { { 1 } } end,
      function() schedule.cosine { peak = 1, total = 10, warmup = 2 } end,
      function() schedule.cosine(5) end,
    } do
      local err = helper.error_of(call)
      assert.matches("^[^:]*schedule_spec%.lua:%d+: m3%.schedule%.", err)
    end
    assert.matches("expected peak > 0, got nan", helper.error_of(schedule.warmup_cosine,
      { peak = 0 / 0, warmup = 10, total = 100 }), 1, true)
  end)

  it("every schedule raises at the caller's line for a step that is not an integer >= 1", function()
    local c = schedule.constant(1)
    local all = {
      constant = c,
      linear = schedule.linear { from = 1, to = 0.5, steps = 10 },
      linear_warmup = schedule.linear_warmup { peak = 1e-3, warmup = 10 },
      cosine = schedule.cosine { peak = 1e-3, total = 10 },
      warmup_cosine = schedule.warmup_cosine { peak = 1e-3, warmup = 3, total = 10 },
      step_decay = schedule.step_decay { lr = 1, every = 5 },
      wsd = schedule.wsd { peak = 1, warmup = 2, total = 10 },
      sequence = schedule.sequence { { c, steps = 2 }, { schedule.cosine { peak = 1, total = 5 } } },
      scale = schedule.scale(c, 2),
    }
    all.milestones = schedule.step_decay { lr = 1, milestones = { 3 } }
    for name, f in pairs(all) do
      for _, s in ipairs { 0, -5, 0 / 0, math.huge, -math.huge, 1.5, "1", nil } do
        local err = helper.error_of(function() local lr = f(s); return lr end)
        assert.matches("^[^:]*schedule_spec%.lua:%d+: m3%.schedule%.[%w_]+: step = ", err)
        assert.truthy(err:find(": expected an integer >= 1", 1, true), err)
        if name ~= "milestones" then assert.truthy(err:find("m3.schedule." .. name .. ": step", 1, true), err) end
      end
      assert.is_true(f(1) > 0, name)
    end
    assert.equal("m3.schedule.cosine: step = 0: expected an integer >= 1",
      helper.error_of(function() local lr = all.cosine(0); return lr end):match(": (m3%.schedule.*)$"))
    assert.matches("schedule_spec%.lua:%d+: m3%.schedule%.apply: step = %-1: expected an integer >= 1",
      helper.error_of(function() schedule.apply({ set_lr = function() end }, c, -1) end))
    assert.matches("schedule_spec%.lua:%d+: m3%.schedule%.scale: expected k > 0, got %-1",
      helper.error_of(function() schedule.scale(c, -1) end))
    assert.matches("schedule_spec%.lua:%d+: m3%.schedule%.values: n = 2%.5",
      helper.error_of(function() schedule.values(c, 2.5) end))
    assert.same({}, schedule.values(c, 0))
  end)

  it("takes steps up to 2^53, the trainer's step count", function()
    local big = 2 ^ 53
    assert.equal(1, schedule.constant(1)(big))
    near(0.1, schedule.warmup_cosine { peak = 1, warmup = 2, total = 10, floor = 0.1 }(2 ^ 31))
    near(2, schedule.sequence { { schedule.constant(1), steps = 2 ^ 40 }, { schedule.constant(2) } }(big))
    local seen
    assert.equal(3, schedule.apply({ set_lr = function(_, x) seen = x end }, schedule.constant(3), big))
    assert.equal(3, seen)
    assert.matches("schedule_spec%.lua:%d+: m3%.schedule%.constant: step = 9007199254740994: "
      .. "expected an integer from 1 to 2%^53$", helper.error_of(function() local lr = schedule.constant(1)(big + 2); return lr end))
    assert.matches("schedule_spec%.lua:%d+: m3%.schedule%.apply: step = 1%.152921504606847e%+18: "
      .. "expected an integer from 1 to 2%^53$", helper.error_of(function() schedule.apply({ set_lr = print }, schedule.constant(1), 2 ^ 60) end))
  end)

  it("raises at the caller's line for a value that is not a finite lr", function()
    local f = schedule.step_decay { lr = 1, gamma = 1e300, every = 1 }
    assert.equal(1e300, f(2))
    assert.matches("^[^:]*schedule_spec%.lua:%d+: m3%.schedule%.step_decay: lr = inf at step 3: "
      .. "expected a finite number >= 0$", helper.error_of(function() local lr = f(3); return lr end))
    assert.matches("^[^:]*schedule_spec%.lua:%d+: m3%.schedule%.scale: lr = inf at step 1: expected a finite number >= 0$",
      helper.error_of(function() local lr = schedule.scale(schedule.constant(1e300), 1e300)(1); return lr end))
    assert.matches('^[^:]*schedule_spec%.lua:%d+: m3%.schedule%.sequence: lr = "x" at step 1: expected a finite',
      helper.error_of(function() local lr = schedule.sequence { { function() return "x" end } }(1); return lr end))
    assert.matches("m3%.schedule%.scale: lr = nil at step 2: expected a finite number >= 0$",
      helper.error_of(function() local lr = schedule.scale(function() end, 2)(2); return lr end))
    assert.matches("m3%.schedule%.sequence: lr = nan at step 1", helper.error_of(function()
      local lr = schedule.sequence { { function() return 0 / 0 end } }(1); return lr end))
    -- an lr of 0 is a value (a floor reached after the last step) but not one the trainer takes
    local called = false
    local tr = { set_lr = function() called = true end }
    local cosine = schedule.cosine { peak = 1, total = 10 }
    assert.equal(0, cosine(11))
    assert.matches("^[^:]*schedule_spec%.lua:%d+: m3%.schedule%.apply: lr = 0 at step 11: "
      .. "expected a finite number > 0 %(the trainer's lr%)$", helper.error_of(function() schedule.apply(tr, cosine, 11) end))
    assert.matches("m3%.schedule%.apply: lr = %-1 at step 1: expected a finite number > 0",
      helper.error_of(schedule.apply, tr, function() return -1 end, 1))
    assert.matches("m3%.schedule%.apply: lr = inf at step 1: expected a finite number > 0",
      helper.error_of(schedule.apply, tr, function() return math.huge end, 1))
    assert.is_false(called)
  end)

  it("apply refuses what is not a trainer at the caller's line", function()
    local f = schedule.constant(1)
    for _, tr in ipairs { {}, 5, "tr", { set_lr = 1 } } do
      assert.matches("^[^:]*schedule_spec%.lua:%d+: m3%.schedule%.apply: expected a trainer %(m3%.trainer%), got a ",
        helper.error_of(function() schedule.apply(tr, f, 1) end))
    end
    assert.matches("m3%.schedule%.apply: expected a trainer %(m3%.trainer%), got nil$",
      helper.error_of(schedule.apply, nil, f, 1))
  end)

  it("apply calls set_lr with the schedule's value and returns it", function()
    local seen = {}
    local tr = { set_lr = function(_, x) seen[#seen + 1] = x end }
    local f = schedule.warmup_cosine { peak = 1, warmup = 2, total = 10 }
    assert.equal(0.5, schedule.apply(tr, f, 1))
    schedule.apply(tr, f, 2)
    assert.same({ 0.5, 1 }, seen)
    assert.same({ 0.5, 1, 1 }, schedule.values(f, 3))
  end)
end)

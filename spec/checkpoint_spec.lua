-- m3.checkpoint and m3.fit: keep the last k, skip damaged files, ignore and clear away the
-- temporary files of interrupted writes, and resume bit-identically
-- (CPU: 10 steps against 5 + save + load + 5, with carried state or with accumulation; also
-- after interrupts, each metrics record once); fit.run's refusals (also of an earlier run's
-- checkpoints without start); a run without start keeps no earlier run's plot.svg; a step
-- whose gradient is not finite passed over (the run is the one without its rows), more than
-- max_nonfinite in a row stopping the run with the last good step saved (and loadable) and a
-- status that ends a script without a traceback; another error after a step saves that step
-- and says so below the error (one traceback in a script). Saving: an extra nested 100 tables deep loads
-- back, a deeper one is refused before anything is written; an extra holding text that is not
-- UTF-8 is written as UTF-8; a FIFO or a dangling link is refused and left as it is (and
-- loading a FIFO is refused, not waited on), a link to a file is saved through; a path
-- holding a NUL byte is refused to save and to load.

local ffi = require "ffi"
local m3 = require "m3"
local lib = require "m3.lib"
local checkpoint = require "m3.checkpoint"
local curriculum = require "m3.curriculum"
local data = require "m3.data"
local fit = require "m3.fit"
local fs = require "m3.fs"
local log = require "m3.log"
local schedule = require "m3.schedule"
local helper = require "spec.helper"

local tmpdir = helper.tmpdir

-- A text-like file of 4000 bytes drawn from a small alphabet.
local function text_file(dir)
  local r = data.rng.new(5)
  local chars = {}
  for i = 1, 4000 do chars[i] = string.char(97 + r:below(8)) end
  local path = dir .. "/text.txt"
  fs.write(path, table.concat(chars))
  return path
end

local cfg = m3.config { d_model = 16, n_layers = 2, d_state = 8, headdim = 8, input = "tokens",
  head = "lm", vocab_size = 256 }

-- The runs under test, lengths 8 then 16 and warmup-cosine, on a trainer of batch 2: "carry"
-- reads the text as 2 continuing streams with the state carried across windows (2 rows a
-- step); "accumulate" draws 4 random windows a step as 2 micro-batches of 2.
local MODES = {
  carry = { carry_state = true, order = "stream", batch = 2 },
  accumulate = { carry_state = false, order = "random", batch = 4 },
}

local function new_trainer(mode)
  return m3.trainer(cfg, { device = "cpu", batch = 2, seq_len = 16, seed = 3, lr = 1e-2,
    carry_state = MODES[mode or "carry"].carry_state })
end

local function run(o, path)
  local mode = MODES[o.mode or "carry"]
  return fit.run {
    trainer = o.trainer, start = o.start, steps = o.steps, checkpoint = o.checkpoint, dir = o.dir,
    data = data.text(path, { order = mode.order, seed = 1 }),
    curriculum = curriculum.new { { steps = 4, length = 8 }, { length = 16 } },
    schedule = schedule.warmup_cosine { peak = 1e-2, warmup = 3, total = 10, floor = 1e-3 },
    batch = mode.batch, clip = 1.0, progress = false, eval = o.eval, eval_every = o.eval_every,
  }
end

local function bytes(w)
  local out = {}
  for _, name in ipairs(w:names()) do
    local t = w:get(name)
    out[name] = ffi.string(t.data, t:numel() * 4)
  end
  return out
end

local function state_bytes(tr)
  local out = {}
  for i, layer in ipairs(tr:states()) do
    for k, t in pairs(layer) do out[i .. k] = ffi.string(t.data, t:numel() * 4) end
  end
  return out
end

local function losses(dir)
  local out = {}
  for _, r in ipairs(log.read_jsonl(dir .. "/metrics.jsonl")) do
    if r.loss then out[r.step] = r.loss end
  end
  return out
end

describe("m3.checkpoint", function()
  local dir, path
  local reference = {} -- of each mode

  setup(function()
    dir = tmpdir()
    path = text_file(dir)
    for mode in pairs(MODES) do
      local tr = new_trainer(mode)
      run({ trainer = tr, mode = mode, steps = 10, dir = dir .. "/ref-" .. mode }, path)
      reference[mode] = { weights = bytes(tr:snapshot()), states = state_bytes(tr), step = tr:step_count(),
        losses = losses(dir .. "/ref-" .. mode), lr = tr:lr() }
    end
  end)

  teardown(function() os.execute("rm -rf '" .. dir .. "'") end)

  it("saves every N steps, keeps the last k and lists them oldest first", function()
    local ck = checkpoint.new { dir = dir .. "/keep", every = 2, keep = 2 }
    local tr = new_trainer()
    assert.is_nil(ck:maybe_save(tr, 1, {}))
    for s = 1, 7 do ck:maybe_save(tr, s, { s = s }) end
    local all = ck:list()
    assert.equal(2, #all)
    assert.same({ 4, 6 }, { all[1].step, all[2].step })
    assert.equal(dir .. "/keep/step-00000006.ckpt", all[2].path)
    local tr2, extra, step = ck:resume { device = "cpu" }
    assert.equal(6, step)
    assert.same({ s = 6 }, extra)
    assert.equal(16, tr2:seq_len())
  end)

  it("never prunes the checkpoint it has just written", function()
    local ck = checkpoint.new { dir = dir .. "/older", every = 1, keep = 2 }
    local tr = new_trainer()
    ck:save(tr, 10)
    ck:save(tr, 20)
    local p = ck:save(tr, 5, { note = "x" })
    assert.truthy(fs.exists(p))
    local all = ck:list()
    assert.same({ 5, 20 }, { all[1].step, all[2].step })
    -- keep = 1 keeps only the file just written
    local one = checkpoint.new { dir = dir .. "/older", keep = 1 }
    one:save(tr, 7)
    assert.same({ { step = 7, path = one:path(7) } }, one:list())
    -- a step whose name would not read back (1e20 printed as a negative int64) is refused
    assert.matches("save expects a step %(an integer in %[0, 10%^15%)%), got 1e%+20",
      helper.error_of(function() one:save(tr, 1e20) end))
    assert.matches('got "3"', helper.error_of(function() one:save(tr, "3") end))
    one:save(tr, 1e15 - 1)
    assert.same({ 1e15 - 1 }, { one:list()[1].step })
  end)

  -- checkpoint.new{dir =} is every = 0 (maybe_save never saves) and keep = 3
  it("by default saves only when asked and keeps the last 3", function()
    local ck = checkpoint.new { dir = dir .. "/defaults" }
    local tr = new_trainer()
    for s = 1, 4 do assert.is_nil(ck:maybe_save(tr, s)) end
    assert.same({}, ck:list())
    for s = 1, 5 do ck:save(tr, s) end
    local steps = {}
    for i, c in ipairs(ck:list()) do steps[i] = c.step end
    assert.same({ 3, 4, 5 }, steps)
  end)

  it("refuses step 10^15 itself, the first past its range", function()
    local ck = checkpoint.new { dir = dir .. "/range" }
    assert.matches("path expects a step %(an integer in %[0, 10%^15%)%), got 1e%+15",
      helper.error_of(function() ck:path(1e15) end))
    assert.matches("save expects a step %(an integer in %[0, 10%^15%)%), got 1e%+15",
      helper.error_of(function() ck:save(new_trainer(), 1e15) end))
    assert.same({}, ck:list())
  end)

  -- the step is the one saved in the file: a checkpoint copied under another step's name resumes at its own
  it("resumes at the step saved in the checkpoint, not the one in its name", function()
    local ck = checkpoint.new { dir = dir .. "/renamed" }
    local p = ck:save(new_trainer(), 4, { at = 4 })
    fs.write(ck:path(9), fs.read(p))
    os.remove(p)
    local _, extra, step = ck:resume()
    assert.equal(4, step)
    assert.same({ at = 4 }, extra)
  end)

  -- a forward pending is the middle of a step (its backward not yet run): save_interrupted writes nothing then
  it("save_interrupted saves nothing while a forward is pending", function()
    local ck = checkpoint.new { dir = dir .. "/pending" }
    local tr = new_trainer("accumulate")
    tr:forward(helper.batch(cfg, 2, 16, helper.rng(1)))
    local path, why = ck:save_interrupted(tr, 1)
    assert.is_nil(path)
    assert.equal("the run stopped inside an accumulation window", why)
    assert.same({}, ck:list())
  end)

  -- a bad step or trainer is named by the method that got it (no Lua error from inside, no silent skip of a
  -- NaN step), a string option is shown as a string, and every = math.huge (which would never save) is refused
  it("names the method and the value of a bad step, trainer, folder or option", function()
    local ck = checkpoint.new { dir = dir .. "/bad-args", every = 2 }
    local tr = new_trainer()
    local cases = {
      { function() ck:maybe_save(tr, nil) end, "m3.checkpoint: maybe_save expects a step (an integer in [0, 10^15)), "
        .. "got nil" },
      { function() ck:maybe_save(tr, 0 / 0) end, "maybe_save expects a step (an integer in [0, 10^15)), got nan" },
      { function() ck:maybe_save(tr, "4") end, 'maybe_save expects a step (an integer in [0, 10^15)), got "4"' },
      { function() ck:maybe_save(nil, 4) end, "m3.checkpoint: maybe_save expects a trainer (m3.trainer), got nil" },
      { function() ck:save({}, 4) end, "m3.checkpoint: save expects a trainer (m3.trainer), got a table" },
      { function() ck:path("x") end, 'm3.checkpoint: path expects a step (an integer in [0, 10^15)), got "x"' },
      { function() checkpoint.resume(nil) end,
        "m3.checkpoint.resume: expected the checkpoint folder (a path), got nil" },
      { function() checkpoint.new { dir = dir, every = "5" } end, "m3.checkpoint.new: every must be an integer >= 0 "
        .. '(0: only explicit saves), got "5"' },
      { function() checkpoint.new { dir = dir, every = math.huge } end, "every must be an integer >= 0 (0: only "
        .. "explicit saves), got inf" },
      { function() checkpoint.new { dir = dir, keep = "2" } end,
        'keep must be an integer >= 0 (0: keep all), got "2"' },
    }
    for _, c in ipairs(cases) do
      local err = helper.error_of(c[1])
      assert.truthy(err:find(c[2], 1, true), err)
      assert.falsy(err:find("checkpoint.lua", 1, true), err)
    end
    assert.same({}, ck:list())
  end)

  it("names a wrong argument of fit.run, fit.evaluate, fit.resume, accumulate.counted and save_interrupted",
    function()
    local tr, src = new_trainer(), data.parity { length = 4 }
    local base = { trainer = tr, data = src, steps = 1, progress = false, dir = dir .. "/wrong" }
    local function with(k, v)
      local o = {}
      for key, value in pairs(base) do o[key] = value end
      o[k] = v
      return o
    end
    -- each raised "attempt to index/call ..." from inside m3.fit before
    for _, case in ipairs {
      { "curriculum", true, "curriculum = true: expected an m3.curriculum" },
      { "checkpoint", "", 'checkpoint = "": expected an m3.checkpoint (m3.checkpoint.new)' },
      { "start", 5, "start = 5: expected what m3.fit.resume returns" },
      { "schedule", 1e-3, "schedule = 0.001: expected a function" },
      { "eval", true, "eval = true: expected a function" },
      { "extra", {}, "extra = {}: expected a function" },
      { "dir", true, "dir = true: expected a folder path" },
      { "data_opts", true, "data_opts = true: expected a table of data options" },
      -- a NULL pointer counted as graph = true, and as a clip failed inside set_clip
      { "graph", require("ffi").new("void *"), "graph = cdata<void *>: NULL: expected a boolean" },
      { "clip", require("ffi").new("void *"), "clip = cdata<void *>: NULL: expected a number >= 0 (0 = off)" },
      { "graph", 1, "graph = 1: expected a boolean" },
      { "trainer", {}, "trainer = {}: expected an m3.trainer" },
    } do
      assert.matches("^m3%.fit%.run: " .. case[3]:gsub("%p", "%%%0") .. "$",
        helper.error_of(fit.run, with(case[1], case[2])), case[1])
    end
    assert.is_false(fs.exists(dir .. "/wrong"))
    assert.matches("m3%.fit%.evaluate: tr = nil: expected an m3%.trainer", helper.error_of(fit.evaluate, nil, src))
    assert.matches("m3%.fit%.evaluate: src = \"x\": expected a data source", helper.error_of(fit.evaluate, tr, "x"))
    assert.matches("m3%.fit%.evaluate: expected an options table, got true",
      helper.error_of(fit.evaluate, tr, src, true))
    assert.matches("m3%.fit%.resume: ck = nil: expected an m3%.checkpoint", helper.error_of(fit.resume))
    assert.matches("m3%.fit%.check_rows: trainer = nil: expected an m3%.trainer", helper.error_of(fit.check_rows, {}))
    assert.matches("m3%.accumulate%.counted: expected a trainer", helper.error_of(m3.accumulate.counted, nil, {}))
    local ck = checkpoint.new { dir = dir .. "/wrong_ck" }
    assert.matches("m3%.checkpoint: save_interrupted expects a trainer",
      helper.error_of(ck.save_interrupted, ck, nil, 1))
  end)

  it("resume raises options no checkpoint could load with, instead of skipping every file", function()
    local ck = checkpoint.new { dir = dir .. "/resume_opts" }
    ck:save(new_trainer(), 1)
    -- before: each file was "skipped" on stderr and resume returned nil, as if there were none
    assert.matches("m3%.checkpoint: resume: batch = 0: expected an integer >= 1",
      helper.error_of(ck.resume, ck, { batch = 0 }))
    assert.matches('m3%.checkpoint: resume: unknown option "bach"',
      helper.error_of(checkpoint.resume, ck.dir, { bach = 2 }))
    assert.is_table((ck:resume { batch = 1 }))
  end)

  it("rejects unknown options of checkpoint.new, fit.run and the log writers", function()
    local function err(f, ...)
      local ok, e = pcall(f, ...)
      assert.is_false(ok)
      return e
    end
    assert.equal('m3.checkpoint.new: unknown option "kept" (did you mean "keep"?); valid options: dir, every, keep',
      err(checkpoint.new, { dir = dir .. "/opts", kept = 2 }))
    assert.matches('^m3.fit.run: unknown option "eval_evry" %(did you mean "eval_every"%?%); valid options: batch, ',
      err(fit.run, { trainer = new_trainer(), data = data.parity {}, steps = 1, eval_evry = 5 }))
    assert.matches('^m3.log.jsonl: unknown option "truncat"', err(log.jsonl, dir .. "/opts.jsonl", { truncat = true }))
    assert.matches('^m3.log.plot: unknown option "titel"', err(log.plot, {}, dir .. "/p.svg", { titel = "x" }))
    assert.matches('^m3.log.progress: unknown option "evry"', err(log.progress, { total = 5, evry = 1 }))
    assert.is_false(fs.exists(dir .. "/opts.jsonl"))
    assert.is_false(fs.exists(dir .. "/p.svg"))
  end)

  it("says when its folder is a file", function()
    local file = dir .. "/a-file"
    fs.write(file, "keep me")
    local ck = checkpoint.new { dir = file, keep = 1 }
    local ok, err = pcall(function() ck:save(new_trainer(), 1) end)
    assert.is_false(ok)
    assert.matches("^[^:]*checkpoint_spec%.lua:%d+: m3%.checkpoint: save: cannot create the folder "
      .. file:gsub("%p", "%%%0")
      .. ": it exists and is not a folder$", err)
    assert.equal("keep me", fs.read(file))
    -- list and resume found "no checkpoint" in it ({} and nil)
    assert.equal("m3.checkpoint: " .. file .. " is a file, not a folder of checkpoints", helper.error_of(ck.list, ck))
    assert.equal("m3.checkpoint: " .. file .. " is a file, not a folder of checkpoints",
      helper.error_of(checkpoint.resume, file))
  end)

  it("names the call: a method called with '.', save's extra, accumulate.step's clip, a folder fit.run cannot make",
    function()
    local ck = checkpoint.new { dir = dir .. "/dot" }
    -- "attempt to index local 'self'"
    assert.equal("m3.checkpoint: list: expected a checkpoint manager (m3.checkpoint.new) (call it as ck:list()), got "
      .. "nil", helper.error_of(ck.list))
    local tr = new_trainer("accumulate")
    assert.matches("^m3%.checkpoint: save: expected a checkpoint manager %(m3%.checkpoint%.new%) %(call it as "
      .. "ck:save%(tr, step, extra%)%), got m3%.trainer", helper.error_of(ck.save, tr, 5))
    -- "serialize: extra.x ..."
    assert.equal("save: extra.x is a function (only nil, booleans, numbers, strings and tables can be saved)",
      helper.error_of(tr.save, tr, dir .. "/dot.ckpt", { x = print }))
    assert.is_false(fs.exists(dir .. "/dot.ckpt"))
    -- "m3: backward_step: clip = inf must be finite", after the forwards: the trainer was left with one pending
    local src = data.parity { length = 4 }
    assert.equal("m3.accumulate.step: clip = inf: expected a finite number >= 0 (0 = off)",
      helper.error_of(m3.accumulate.step, tr, { src:next(2), src:next(2) }, { clip = math.huge }))
    assert.is_false(tr:info().pending_forward)
    -- "m3.fs: cannot create the folder ..."
    local file = dir .. "/dot-file"
    fs.write(file, "x")
    assert.equal("m3.fit.run: cannot create the folder " .. file .. ": it exists and is not a folder",
      helper.error_of(fit.run, { trainer = tr, data = src, steps = 1, progress = false, dir = file }))
    -- a NULL pointer was taken for no batch (nil), then compared: "attempt to compare number with float *"
    assert.matches("^m3%.fit%.run: batch = cdata<float %*>: NULL: expected an integer >= 1$",
      helper.error_of(fit.run, { trainer = tr, data = src, steps = 1, progress = false, batch = ffi.new("float *") }))
  end)

  it("skips a damaged newest checkpoint and finds none in an empty folder", function()
    local ck = checkpoint.new { dir = dir .. "/damaged" }
    ck:save(new_trainer(), 3, { a = 1 })
    fs.write(ck:path(9), "not a checkpoint")
    local real = io.stderr
    local said = {}
    io.stderr = { write = function(_, ...) said[#said + 1] = table.concat({ ... }) end }
    local tr, extra, step = ck:resume()
    io.stderr = real
    assert.equal(3, step)
    assert.same({ a = 1 }, extra)
    assert.truthy(tr)
    assert.truthy(said[1]:find("skipping .*step%-00000009%.ckpt"))
    assert.is_nil(checkpoint.resume(dir .. "/nothing-here"))
  end)

  it("raises a refusal that is not the file's (a dtype this device cannot run) instead of skipping", function()
    local ck = checkpoint.new { dir = dir .. "/unsupported" }
    ck:save(new_trainer(), 3, { a = 1 })
    ck:save(new_trainer(), 5, { a = 2 })
    local real = io.stderr
    local said = {}
    io.stderr = { write = function(_, ...) said[#said + 1] = table.concat({ ... }) end }
    local ok, err = pcall(ck.resume, ck, { device = "cpu", dtype = "bf16" })
    io.stderr = real
    assert.is_false(ok)
    assert.matches("dtype bf16: the CPU backend computes in f32 only", err)
    assert.same({}, said)
  end)

  it("never takes a write's temporary file for a checkpoint, and removes those whose writer is gone", function()
    local ck = checkpoint.new { dir = dir .. "/stale", keep = 2 }
    local tr = new_trainer()
    ck:save(tr, 3, { a = 3 })
    local complete = fs.read(checkpoint.new { dir = dir .. "/stale-source" }:save(tr, 9, { a = 9 }))
    local sh = io.popen("sh -c 'echo $$'")
    local dead = tonumber(sh:read("*l")) -- a process that has ended
    sh:close()
    pcall(ffi.cdef, "int getpid(void);")
    local function temporary(step, pid, count)
      return string.format("%s/step-%08d.ckpt.tmp.%d.%d", ck.dir, step, pid, count)
    end
    local stale = { temporary(9, dead, 0), temporary(10, ffi.C.getpid(), 4) }
    local kept = {
      temporary(11, 1, 0), -- pid 1 lives: its write may still finish
      ck.dir .. "/step-00000012.ckpt.tmp." .. dead, -- not libm3's name (no count)
      ck.dir .. "/step-00000012.ckpt.tmp.x.0",
      ck.dir .. "/notes.ckpt.tmp." .. dead .. ".0",
      ck.dir .. "/step-00000012.ckpt.tmp.99999999999.0", -- no pid
    }
    for _, p in ipairs(stale) do fs.write(p, complete) end
    for _, p in ipairs(kept) do fs.write(p, complete) end
    assert.same({ { step = 3, path = ck:path(3) } }, ck:list())
    local _, extra, step = ck:resume()
    assert.equal(3, step)
    assert.same({ a = 3 }, extra)
    ck:save(tr, 4)
    ck:save(tr, 5)
    for _, p in ipairs(stale) do assert.is_false(fs.exists(p), p) end
    for _, p in ipairs(kept) do assert.equal(complete, fs.read(p), p) end
    assert.same({ 4, 5 }, { ck:list()[1].step, ck:list()[2].step })
  end)

  for mode in pairs(MODES) do
    it("resumes bit-identically: 10 steps = 5 + save + load + 5 (" .. mode .. ")", function()
      local d, ref = dir .. "/split-" .. mode, reference[mode]
      local ck = checkpoint.new { dir = d .. "/checkpoints", every = 5 }
      run({ trainer = new_trainer(mode), mode = mode, steps = 5, checkpoint = ck, dir = d }, path)
      local tr, start = fit.resume(ck, { device = "cpu" })
      assert.equal(5, start.step)
      assert.equal(5, tr:step_count())
      run({ trainer = tr, mode = mode, start = start, steps = 10, checkpoint = ck, dir = d }, path)
      assert.same(ref.weights, bytes(tr:snapshot()))
      assert.same(ref.states, state_bytes(tr))
      assert.equal(ref.step, tr:step_count())
      assert.equal(ref.lr, tr:lr())
      assert.same(ref.losses, losses(d))
    end)
  end

  it("refuses a run without start over an earlier run's checkpoints, and a resume where none loads", function()
    local d = dir .. "/earlier"
    local ck = checkpoint.new { dir = d .. "/checkpoints", every = 2 }
    run({ trainer = new_trainer(), steps = 4, checkpoint = ck, dir = d }, path)
    local function steps()
      local out = {}
      for i, c in ipairs(ck:list()) do out[i] = c.step end
      return out
    end
    local metrics = fs.read(d .. "/metrics.jsonl")
    local ok, err = pcall(run, { trainer = new_trainer(), steps = 4, checkpoint = ck, dir = d }, path)
    assert.is_false(ok)
    assert.matches("m3%.fit%.run: " .. ck.dir:gsub("%p", "%%%0") .. " holds the checkpoints of an earlier run %(the "
      .. "newest: step 4%); continue it %(start = fit%.resume's%) or remove them$", err)
    assert.same({ 2, 4 }, steps())
    assert.equal(metrics, fs.read(d .. "/metrics.jsonl"))
    for _, c in ipairs(ck:list()) do fs.write(c.path, "damaged") end
    local real = io.stderr
    io.stderr = { write = function() end } -- each damaged file is reported there
    ok, err = pcall(fit.resume, ck)
    io.stderr = real
    assert.is_false(ok)
    assert.matches("m3%.fit%.resume: no checkpoint in " .. ck.dir:gsub("%p", "%%%0") .. " loads %(2 there, the "
      .. "newest: step 4%)$", err)
    assert.is_nil(fit.resume(checkpoint.new { dir = d .. "/none" }))
  end)

  it("starts a run without start with no record or plot of an earlier run in its folder", function()
    local d = dir .. "/replaced"
    run({ trainer = new_trainer(), steps = 2, dir = d }, path)
    assert.is_true(fs.is_file(d .. "/plot.svg"))
    local ok = pcall(run, { trainer = new_trainer(), steps = 4, dir = d, eval_every = 1,
      eval = function() error("stopped in the first evaluation") end }, path)
    assert.is_false(ok)
    local records = log.read_jsonl(d .. "/metrics.jsonl")
    assert.same({ 1 }, { records[1].step, records[2] and records[2].step }) -- step 1's record alone
    assert.is_false(fs.exists(d .. "/plot.svg")) -- the 2-step run's plot stayed beside the new run's records
  end)

  it("raises a callback's error value as it is: a table, a number, a message with its traceback", function()
    local function raised(value)
      local ok, err = pcall(fit.run, { trainer = new_trainer("accumulate"), data = data.parity { length = 4 },
        steps = 1, progress = false, eval = function() error(value, 0) end })
      assert.is_false(ok)
      return err
    end
    local value = { code = 7 }
    assert.equal(value, raised(value))
    assert.equal(42, raised(42))
    assert.matches("^boom\nstack traceback:\n", raised("boom"))
  end)

  it("evaluates a trainer that carries its state from a zero state: the same weights give the same loss", function()
    local tr = new_trainer("carry")
    local train, val = data.text(path, { order = "stream", seed = 1 }), data.text(path, { order = "sequential" })
    for _ = 1, 3 do tr:step(train:next(2, { length = 8 })) end
    local states = tr:states()
    local carried = fit.evaluate(tr, val, { batches = 2, length = 8 })
    assert.is_true(helper.same_states(states, tr:states())) -- the training streams' state is left alone
    tr:reset_state()
    assert.equal(fit.evaluate(tr, val, { batches = 2, length = 8 }).loss, carried.loss)
  end)

  it("refuses to average an evaluation whose batches count no position (every target -1)", function()
    local tr = new_trainer("accumulate")
    local masked = {
      cursor = function() return { seed = 0, index = 0 } end,
      seek = function() end,
      next = function(_, rows)
        local targets = m3.tensor({ rows, 4 }, "i32")
        for i = 0, rows * 4 - 1 do targets[i] = -1 end
        return { tokens = m3.tensor({ rows, 4 }, "i32"), targets = targets }
      end,
    }
    assert.equal("m3.fit.evaluate: no position counts (every target is -1 in the 2 batches): there is no loss to average",
      helper.error_of(fit.evaluate, tr, masked, { batches = 2 }))
  end)

  it("refuses accumulated steps on a trainer that carries its state or computes in f16", function()
    local src = data.text(path, { order = "stream" })
    local function refusal(o)
      local ok, err = pcall(function() fit.run(o) end)
      assert.is_false(ok)
      return err
    end
    assert.matches("^[^:]*checkpoint_spec%.lua:%d+: m3%.fit%.run: batch = 4 rows a step, but the trainer carries "
      .. "its state %(carry_state%) in 2 rows; accumulated micro%-batches would mix the rows' streams: use a "
      .. "batch <= 2$", refusal { trainer = new_trainer("carry"), data = src, steps = 2, batch = 4,
        dir = dir .. "/refused" })
    assert.matches("m3%.fit%.run: phase 2: batch = 3 rows a step", refusal { trainer = new_trainer("carry"),
      data = src, steps = 2, curriculum = curriculum.new { { steps = 1, batch = 2 }, { batch = 3 } } })
    -- f16 cannot accumulate (the engine refuses it; CUDA only, so a stand-in trainer here)
    local f16 = { batch = function() return 2 end, info = function() return { carry_state = false } end,
      dtype = function() return "f16" end, seq_len = function() return 16 end }
    assert.matches("^m3%.fit%.run: batch = 4 rows a step, but the trainer computes "
      .. "in f16 with 2 rows; an overflow skips a whole update, so it cannot accumulate micro%-batches %(bf16 and "
      .. "f32 can%): use a batch <= 2$", helper.error_of(fit.check_rows, { trainer = f16, batch = 4 }))
    assert.matches("m3%.fit%.run: phase 2: batch = 3 rows a step, but the trainer computes in f16",
      helper.error_of(fit.check_rows, { trainer = f16, curriculum = curriculum.new { { steps = 1 }, { batch = 3 } } }))
    assert.matches("^m3%.fit%.run: batch = 4 rows a step, but", helper.error_of(fit.check_rows, { trainer = f16,
      batch = 4, curriculum = curriculum.lengths { from = 2, to = 8, steps = 4 } })) -- its phases leave the rows
    fit.check_rows { trainer = f16, batch = 2 }
    local cpu = new_trainer("carry")
    assert.matches("m3%.fit%.run: graph = true needs a CUDA trainer %(this one runs on cpu%)",
      refusal { trainer = cpu, data = src, steps = 2, graph = true, dir = dir .. "/refused" })
    assert.equal(0, cpu:step_count())
    assert.is_false(fs.exists(dir .. "/refused"))
    assert.equal(0, src:cursor().index)
  end)

  it("refuses before step 1 a phase whose length or pad_to is not an integer the trainer's seq_len holds", function()
    local src = data.text(path, { order = "random" })
    local function refusal(o)
      local tr = new_trainer("accumulate") -- seq_len 16
      o.trainer, o.data, o.steps, o.progress = tr, src, 4, false
      o.dir, o.checkpoint = dir .. "/too-long", checkpoint.new { dir = dir .. "/too-long/ck", every = 1 }
      local err = helper.error_of(function() fit.run(o) end)
      assert.equal(0, tr:step_count())
      assert.is_false(fs.exists(dir .. "/too-long/metrics.jsonl"))
      assert.equal(0, src:cursor().index)
      return err
    end
    -- phase 2's length was found too long at step 3, once steps 1-2 had trained (and no checkpoint was saved)
    assert.matches("^[^:]*checkpoint_spec%.lua:%d+: m3%.fit%.run: phase 2: length = 20: expected an integer from 1 "
      .. "to the trainer's seq_len 16$",
      refusal { curriculum = curriculum.new { { steps = 2, length = 8 }, { length = 20 } } })
    assert.matches("m3%.fit%.run: phase 1: pad_to = 17: expected an integer from 1 to the trainer's seq_len 16$",
      refusal { curriculum = curriculum.new { { steps = 2, length = 8, pad_to = 17 }, { length = 16 } } })
    assert.matches('m3%.fit%.run: phase 2: length = "8": expected an integer from 1 to the trainer\'s seq_len 16$',
      refusal { curriculum = curriculum.new { { steps = 2, length = 8 }, { length = "8" } } })
    assert.matches("m3%.fit%.run: length = 32: expected an integer from 1 to the trainer's seq_len 16$",
      refusal { data_opts = { length = 32 } })
    assert.matches("m3%.fit%.run: length = 32: expected", refusal { data_opts = { length = 32 },
      curriculum = curriculum.new { { steps = 2, batch = 4 }, { batch = 2 } } }) -- no phase sets it
    assert.matches("m3%.fit%.run: phase 3: length = 24: expected an integer from 1 to the trainer's seq_len 16$",
      helper.error_of(fit.check_rows, { trainer = new_trainer(), curriculum = curriculum.lengths { from = 6, to = 24,
        steps = 9 } }))
    fit.check_rows { trainer = new_trainer(), curriculum = curriculum.lengths { from = 4, to = 16, steps = 9 } }
  end)

  it("refuses an eval that returns no table of metrics, at the first evaluation", function()
    for _, case in ipairs { { false, "false" }, { 5, "5" }, { "loss", '"loss"' } } do
      local tr, steps = new_trainer("accumulate"), 0
      local err = helper.error_of(fit.run, { trainer = tr, data = data.parity { length = 4 }, steps = 3,
        progress = false, eval_every = 2, eval = function() steps = tr:step_count() return case[1] end })
      -- it was "bad argument #1 to 'pairs' (table expected, got number)"
      assert.matches("^m3%.fit%.run: eval must return a table of metrics, got " .. case[2] .. "\n", err)
      assert.equal(2, steps)
    end
    local err = helper.error_of(fit.run, { trainer = new_trainer("accumulate"), data = data.parity { length = 4 },
      steps = 1, progress = false, eval = function() end })
    assert.matches("^m3%.fit%.run: eval must return a table of metrics, got nil\n", err)
  end)

  it("evaluates a run resumed past its end once, at the step it stands at, without taking a step", function()
    local d = helper.tmpdir()
    local function go(tr, steps, start, seen)
      return fit.run { trainer = tr, data = data.parity { length = 4 }, steps = steps, start = start, progress = false,
        checkpoint = checkpoint.new { dir = d }, eval_every = 100,
        eval = function(_, s) seen[#seen + 1] = s return { probe = s } end }
    end
    local seen = {}
    assert.same({ probe = 5 }, go(new_trainer("accumulate"), 5, nil, seen).eval)
    assert.same({ 5 }, seen) -- the last step's evaluation
    local tr, start = fit.resume(checkpoint.new { dir = d }, { device = "cpu" })
    seen = {}
    local r = go(tr, 3, start, seen) -- step 5 of a run of 3: no evaluation is due there, yet the run ends at it
    assert.equal(5, tr:step_count())
    assert.same({ 5 }, seen)
    assert.same({ probe = 5 }, r.eval)
    os.execute("rm -rf " .. helper.quote(d))
  end)

  it("writes each record once, however often a run is resumed (at its end, or cut in an evaluation)", function()
    local probe = data.text(path, { order = "sequential", length = 8 }):next(2)
    local cut_at -- the step whose evaluation is interrupted once
    local function eval(tr, s)
      if s == cut_at then
        cut_at = nil
        error("interrupted!")
      end
      return { val_loss = tr:evaluate(probe).loss }
    end
    local function records(d)
      local out = {}
      for i, r in ipairs(log.read_jsonl(d .. "/metrics.jsonl")) do
        r.ms = nil
        out[i] = r
      end
      return out
    end
    run({ trainer = new_trainer(), steps = 10, dir = dir .. "/once-ref", eval = eval, eval_every = 3 }, path)
    cut_at = 6
    local d = dir .. "/once"
    local ck = checkpoint.new { dir = d .. "/checkpoints", every = 100 }
    local ok, err = pcall(run, { trainer = new_trainer(), steps = 10, checkpoint = ck, dir = d, eval = eval,
      eval_every = 3 }, path)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("^interrupted at step 6; saved"), err)
    local before_eval = { unpack(records(dir .. "/once-ref"), 1, 7) } -- steps 1..6 and the evaluation at 3
    assert.same(before_eval, records(d))
    cut_at = 6 -- and the evaluation that the resume does again there
    local tr, start = fit.resume(ck)
    ok, err = pcall(run, { trainer = tr, start = start, steps = 10, checkpoint = ck, dir = d, eval = eval,
      eval_every = 3 }, path)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("^interrupted at step 6; saved"), err)
    assert.same(before_eval, records(d))
    for _ = 1, 3 do
      local tr, start = fit.resume(ck)
      run({ trainer = tr, start = start, steps = 10, checkpoint = ck, dir = d, eval = eval, eval_every = 3 }, path)
    end
    assert.same(records(dir .. "/once-ref"), records(d))
    -- a run interrupted before its first step resumes from step 0 with no evaluation there
    local d0 = dir .. "/once0"
    local ck0 = checkpoint.new { dir = d0 .. "/checkpoints", every = 100 }
    local real_text = data.text
    data.text = function(...)
      local src = real_text(...)
      local next_, first = src.next, true
      src.next = function(self, ...)
        if first then
          first = false
          error("interrupted!")
        end
        return next_(self, ...)
      end
      return src
    end
    ok = pcall(run, { trainer = new_trainer(), steps = 10, checkpoint = ck0, dir = d0, eval = eval, eval_every = 3 },
      path)
    data.text = real_text
    assert.is_false(ok)
    local tr0, start0 = fit.resume(ck0)
    assert.equal(0, start0.step)
    run({ trainer = tr0, start = start0, steps = 10, checkpoint = ck0, dir = d0, eval = eval, eval_every = 3 }, path)
    assert.same(records(dir .. "/once-ref"), records(d0))
  end)

  -- A source that raises an interrupt, in Lua or through the engine's flag, on one call.
  local function interrupting(src, at_call, how)
    local calls, next_fn = 0, src.next
    function src.next(self, rows, o)
      calls = calls + 1
      local b = next_fn(self, rows, o)
      if calls == at_call then
        if how == "engine" then lib.C.m3_interrupt() else error("interrupted!") end
      end
      return b
    end
    return src
  end

  for _, how in ipairs { "lua", "engine" } do
    for mode, m in pairs(MODES) do
      it("saves on an interrupt (" .. how .. ", " .. mode .. ") and resumes bit-identically", function()
        local d = dir .. "/int-" .. how .. "-" .. mode
        local ck = checkpoint.new { dir = d .. "/checkpoints", every = 100 }
        local o = { trainer = new_trainer(mode), mode = mode, steps = 10, checkpoint = ck, dir = d }
        local real_text = data.text
        -- the call that draws the (first micro-batch of the) rows of step 7: steps 1..6 are done
        local calls_a_step = m.batch / 2
        data.text = function(...) return interrupting(real_text(...), 6 * calls_a_step + 1, how) end
        local ok, err = pcall(run, o, path)
        data.text = real_text
        assert.is_false(ok)
        assert.truthy(tostring(err):find("^interrupted at step 6; saved .*step%-00000006%.ckpt"), err)
        assert.equal(0, lib.C.m3_interrupted())
        local tr, start = fit.resume(ck)
        assert.equal(6, start.step)
        run({ trainer = tr, mode = mode, start = start, steps = 10, checkpoint = ck, dir = d }, path)
        assert.same(reference[mode].weights, bytes(tr:snapshot()))
        assert.same(reference[mode].states, state_bytes(tr))
        assert.same(reference[mode].losses, losses(d))
      end)
    end
  end
end)

-- A source of random "features" windows (input [n, L, 3], targets [n, L, 2]) whose draws numbered in `bad`
-- (1-based) get a NaN input, or, with bad = "skip", are drawn and dropped: the rows a run sees once it passes
-- over the poisoned ones. cursor / seek as m3.data's (the draws made).
local function features_source(bad, skip)
  local calls = 0
  local function draw(n, opts)
    calls = calls + 1
    local r, L = data.rng.new(1000 + calls), opts.length or 4
    local b = { input = m3.tensor({ n, L, 3 }), targets = m3.tensor({ n, L, 2 }) }
    for i = 0, n * L * 3 - 1 do b.input[i] = r:uniform() - 0.5 end
    for i = 0, n * L * 2 - 1 do b.targets[i] = r:uniform() - 0.5 end
    return b
  end
  return {
    next = function(_, n, opts)
      local b = draw(n, opts or {})
      while skip and skip[calls] do b = draw(n, opts or {}) end
      if bad and bad[calls] then b.input[0] = 0 / 0 end
      return b
    end,
    cursor = function() return calls end,
    seek = function(_, c) calls = c end,
  }
end

describe("m3.fit.run and non-finite gradients", function()
  local features = m3.config { d_model = 16, n_layers = 1, d_state = 8, headdim = 8, input = "features",
    input_dim = 3, head = "mse", out_dim = 2 }
  local function trainer() return m3.trainer(features, { device = "cpu", batch = 2, seq_len = 4, seed = 1 }) end
  local function said()
    local lines = {}
    return lines, { write = function(_, ...) lines[#lines + 1] = table.concat({ ... }) end, flush = function() end }
  end

  it("passes over a step whose gradient is not finite: the run is the one without those rows", function()
    local d = tmpdir()
    local lines, out = said()
    local tr = trainer()
    local r = fit.run { trainer = tr, data = features_source({ [2] = true, [3] = true }), steps = 4, dir = d,
      out = out, data_opts = { length = 4 } }
    local ref = trainer()
    fit.run { trainer = ref, data = features_source(nil, { [2] = true, [3] = true }), steps = 4, progress = false,
      data_opts = { length = 4 } }
    assert.equal(4, r.step)
    assert.equal(4, tr:step_count())
    assert.same(bytes(ref:snapshot()), bytes(tr:snapshot()))
    local steps = {}
    for _, rec in ipairs(log.read_jsonl(d .. "/metrics.jsonl")) do steps[#steps + 1] = rec.step end
    assert.same({ 1, 2, 3, 4 }, steps) -- no record of a refused step
    local text = table.concat(lines)
    assert.matches("step 2: non%-finite gradient %(global norm nan%): update refused, its rows dropped, the step "
      .. "taken again on the next %(1 in a row; more than 10 stop the run%)", text)
    assert.matches("%(2 in a row; more than 10 stop the run%)", text)
  end)

  -- "in a row": a step taken resets the count, so two refusals with a good step between them pass max_nonfinite = 1
  it("counts only refusals in a row against max_nonfinite", function()
    local lines, out = said()
    local r = fit.run { trainer = trainer(), data = features_source({ [2] = true, [4] = true }), steps = 4,
      max_nonfinite = 1, out = out, data_opts = { length = 4 } }
    assert.equal(4, r.step)
    local text = table.concat(lines)
    assert.matches("step 3: non%-finite gradient .* %(1 in a row; more than 1 stop the run%)", text)
  end)

  -- 5 rows a step on a trainer of batch 2: micro-batches of 2, 2 and 1 (5 windows of 4 positions, 20 tokens a
  -- step), and the run's tokens are those of all its steps
  it("takes a step's rows in micro-batches of the trainer's batch, the last one short, and sums its tokens", function()
    local d = tmpdir()
    local src = features_source()
    local r = fit.run { trainer = trainer(), data = src, steps = 2, batch = 5, dir = d, progress = false,
      data_opts = { length = 4 } }
    assert.equal(6, src:cursor()) -- 3 draws a step
    local tokens = {}
    for _, rec in ipairs(log.read_jsonl(d .. "/metrics.jsonl")) do
      if rec.tokens then tokens[#tokens + 1] = rec.tokens end
    end
    assert.same({ 20, 20 }, tokens)
    assert.equal(40, r.tokens)
  end)

  it("stops after more than max_nonfinite in a row, saving the last good step, with a status", function()
    local d = tmpdir()
    local ck = checkpoint.new { dir = d .. "/checkpoints", every = 100 }
    local ok, err = pcall(fit.run, { trainer = trainer(), data = features_source({ [3] = true, [4] = true,
      [5] = true }), steps = 6, dir = d, checkpoint = ck, progress = false, max_nonfinite = 2,
      data_opts = { length = 4 } })
    assert.is_false(ok)
    assert.equal(1, err.status)
    assert.equal("m3.fit.run: 3 steps in a row had a non-finite gradient (the last at step 3: global norm nan); "
      .. "stopped at step 2, saved " .. ck.dir .. "/step-00000002.ckpt (lower the learning rate or look at the "
      .. "data; resume from it or an earlier one)", tostring(err))
    local tr, start = fit.resume(ck, { device = "cpu" })
    assert.equal(2, start.step)
    assert.equal(2, tr:step_count())
    -- max_nonfinite = 0: the first one stops the run
    ok, err = pcall(fit.run, { trainer = trainer(), data = features_source({ [1] = true }), steps = 2,
      progress = false, max_nonfinite = 0, data_opts = { length = 4 } })
    assert.is_false(ok)
    assert.matches("^m3%.fit%.run: 1 step in a row had a non%-finite gradient %(the last at step 1: global norm nan%); "
      .. "stopped at step 0, no checkpoint saved", tostring(err))
  end)

  it("ends a script with its message and status 1, without a traceback (m3.flags)", function()
    local d = tmpdir()
    fs.write(d .. "/t.txt", string.rep("the quick brown fox jumps over the lazy dog. ", 200))
    local script = fs.realpath(helper.repo_dir() .. "/scripts/lm.lua") -- the command runs in d
    local out, code = helper.run("sh -c " .. helper.quote("cd " .. helper.quote(d) .. " && timeout 60 "
      .. helper.quote(helper.m3lua()) .. " " .. helper.quote(script) .. " --data t.txt --steps 30 --lr 1e9 "
      .. "--d_model 16 --n_layers 1 --batch 4 --micro_batch 4 --seq_len 16 --run big"))
    assert.equal(1, code, out)
    assert.is_nil(out:find("traceback", 1, true), out)
    assert.matches("\nlm%.lua: m3%.fit%.run: 11 steps in a row had a non%-finite gradient .*saved runs/big/checkpoints/"
      .. "step%-%d+%.ckpt", out)
  end)
end)

describe("m3.fit.run stopped by an error", function()
  local features = m3.config { d_model = 16, n_layers = 1, d_state = 8, headdim = 8, input = "features",
    input_dim = 3, head = "mse", out_dim = 2 }
  local function trainer() return m3.trainer(features, { device = "cpu", batch = 2, seq_len = 4, seed = 1 }) end
  -- features_source, whose next raises value (as it is) at its call `at` (a data file cut short)
  local function failing_source(at, value)
    local src, calls = features_source(), 0
    local next = src.next
    src.next = function(self, n, opts)
      calls = calls + 1
      if calls == at then error(value, 0) end
      return next(self, n, opts)
    end
    return src
  end
  -- fit.run over src in a new folder d with checkpoints ck (saved only at the end or on a stop): ok, err, d, ck
  local function run(src)
    local d = tmpdir()
    local ck = checkpoint.new { dir = d .. "/checkpoints", every = 100 }
    local ok, err = pcall(fit.run, { trainer = trainer(), data = src, steps = 6, dir = d, checkpoint = ck,
      progress = false, data_opts = { length = 4 } })
    return ok, err, d, ck
  end

  it("saves the last step taken and says so below the error's traceback; the error value stays as it is", function()
    local ok, err, d, ck = run(failing_source(4, "data gone"))
    assert.is_false(ok)
    assert.matches("^data gone\nstack traceback:\n", err)
    assert.matches("\nm3%.fit%.run: stopped at step 3; saved " .. (ck.dir .. "/step-00000003.ckpt"):gsub("%p", "%%%0")
      .. " %(resume from it%)$", err)
    local tr, start = fit.resume(ck, { device = "cpu" })
    assert.same({ 3, 3 }, { start.step, tr:step_count() })
    local steps = {}
    for _, rec in ipairs(log.read_jsonl(d .. "/metrics.jsonl")) do steps[#steps + 1] = rec.step end
    assert.same({ 1, 2, 3 }, steps)
    -- a value that is not a message is raised as it is, the step saved all the same
    local value = { code = 7 }
    ok, err, _, ck = run(failing_source(3, value))
    assert.equal(value, err)
    local saved = ck:list()
    assert.same({ 1, 2 }, { #saved, saved[1].step })
  end)

  it("saves nothing when no step of the run was taken (a rerun needs no --overwrite)", function()
    local ok, err, _, ck = run(failing_source(1, "data gone"))
    assert.is_false(ok)
    assert.matches("^data gone\nstack traceback:\n", err)
    assert.is_nil(err:find("m3.fit.run: stopped", 1, true))
    assert.same({}, ck:list())
  end)

  it("ends a script with the message, one traceback and where it stopped, status 1 (m3.flags)", function()
    local d = tmpdir()
    local script = d .. "/stop.lua"
    fs.write(script, string.format([[
      local m3 = require "m3"
      local calls = 0
      local src = { -- zero features; the 4th batch is "data gone"
        next = function(_, n, o)
          calls = calls + 1
          if calls == 4 then error("data gone", 0) end
          return { input = m3.tensor({ n, o.length, 3 }), targets = m3.tensor({ n, o.length, 2 }) }
        end,
        cursor = function() return calls end, seek = function(_, c) calls = c end,
      }
      require("m3.flags").interruptible("stop.lua", require("m3.fit").run, {
        trainer = m3.trainer(m3.config { d_model = 16, n_layers = 1, d_state = 8, headdim = 8, input = "features",
          input_dim = 3, head = "mse", out_dim = 2 }, { device = "cpu", batch = 2, seq_len = 4, seed = 1 }),
        data = src, steps = 6, progress = false, data_opts = { length = 4 },
        checkpoint = require("m3.checkpoint").new { dir = %q, every = 100 } })
    ]], d .. "/checkpoints"))
    local out, code = helper.run(helper.quote(helper.m3lua()) .. " " .. helper.quote(script))
    assert.equal(1, code, out)
    assert.matches("^stop%.lua: data gone\nstack traceback:\n", out)
    local _, tracebacks = out:gsub("stack traceback:", "")
    assert.equal(1, tracebacks, out) -- not the host's too
    assert.matches("\nm3%.fit%.run: stopped at step 3; saved [^\n]*step%-00000003%.ckpt %(resume from it%)\n$", out)
  end)
end)

describe("saving a checkpoint", function()
  local REPLACED = "; only a regular file, or a symbolic link to one, is replaced"

  local function quoted(s)
    return (s:gsub("%p", "%%%0"))
  end

  -- depth levels of tables, {x = {x = ... innermost}}.
  local function nested(depth, innermost)
    local t = innermost or {}
    for _ = 2, depth do t = { x = t } end
    return t
  end

  it("loads back an extra of 100 levels of tables, and refuses a deeper one before writing anything", function()
    local dir = tmpdir()
    local tr = new_trainer()
    local deepest = nested(100, { [-1 / 0] = -1 / 0, n = -5, s = "s" }) -- what takes the parser the most levels
    tr:save(dir .. "/100.ckpt", deepest)
    local _, extra = m3.trainer.load(dir .. "/100.ckpt")
    assert.same(deepest, extra)
    local err = helper.error_of(function() tr:save(dir .. "/101.ckpt", nested(101)) end)
    assert.matches("^[^:]*checkpoint_spec%.lua:%d+: save: extra" .. ("%.x"):rep(100) .. " is a table nested "
      .. "101 deep %(at most 100 levels of tables can be saved and loaded back%)$", err)
    -- m3.checkpoint keeps the caller's extra one level down, under {step =, extra =}
    local ck = checkpoint.new { dir = dir .. "/ck" }
    assert.matches("save: extra%.extra" .. ("%.x"):rep(99) .. " is a table nested 101 deep",
      helper.error_of(function() ck:save(tr, 1, nested(100)) end))
    assert.same({}, fs.list(ck.dir))
    ck:save(tr, 2, nested(99))
    local _, saved, step = ck:resume()
    local names = fs.list(dir)
    os.execute("rm -rf '" .. dir .. "'")
    assert.same(nested(99), saved)
    assert.equal(2, step)
    assert.same({ "100.ckpt", "ck" }, names)
  end)

  it("saves an extra holding text that is not UTF-8 (a Latin-1 file name) as UTF-8 metadata, and loads it back",
    function()
    local dir = tmpdir()
    local tr = new_trainer()
    local extra = { data = { path = "caf\233.txt", ["key\255"] = "\255" .. "1" }, utf8 = "caf\195\169" }
    tr:save(dir .. "/latin1.ckpt", extra)
    local _, meta = m3.load_tensors(dir .. "/latin1.ckpt")
    local _, back = m3.trainer.load(dir .. "/latin1.ckpt")
    os.execute("rm -rf '" .. dir .. "'")
    assert.is_nil(require("m3.json").utf8_error(meta.extra)) -- what Python's safetensors package reads
    assert.truthy(meta.extra:find('"caf\195\169"', 1, true)) -- UTF-8 text is kept as it is
    assert.same(extra, back)
  end)

  it("refuses an extra too large for the parser to load back, keeping the checkpoints it has", function()
    local dir = tmpdir()
    local tr = new_trainer()
    local ck = checkpoint.new { dir = dir .. "/ck", keep = 1 }
    ck:save(tr, 1, { cursor = 1 })
    -- 66000 small tables: more constants than one chunk may hold; it saved, and the load failed, so the
    -- run resumed from nothing (keep = 1 had already pruned step 1)
    local history = {}
    for i = 1, 66000 do history[i] = { i } end
    assert.matches("save: extra is too large to load back %(LuaJIT: main function has more than 65536 "
      .. "constants%); keep fewer tables in it", helper.error_of(function() ck:save(tr, 2, { history = history }) end))
    local _, extra, step = ck:resume()
    -- 66000 numbers in one flat list are fine
    for i = 1, 66000 do history[i] = i end
    ck:save(tr, 3, { history = history })
    local _, flat, step3 = ck:resume()
    os.execute("rm -rf '" .. dir .. "'")
    assert.same({ cursor = 1 }, extra)
    assert.equal(1, step)
    assert.equal(3, step3)
    assert.equal(66000, #flat.history)
  end)

  it("refuses a FIFO or a link to nothing, leaving them as they are, and saves through a link into its file", function()
    local dir = tmpdir()
    local q = "'" .. dir .. "'"
    local tr = new_trainer()
    os.execute("cd " .. q .. " && mkfifo fifo && ln -s real.ckpt link")
    local onto_fifo = helper.error_of(function() tr:save(dir .. "/fifo") end)
    local from_fifo = helper.error_of(function() m3.trainer.load(dir .. "/fifo") end) -- not waiting for a writer
    local onto_dangling = helper.error_of(function() tr:save(dir .. "/link", { a = 1 }) end)
    fs.write(dir .. "/real.ckpt", "an older file")
    tr:save(dir .. "/link", { a = 2 })
    local kept = os.execute("cd " .. q .. " && test -p fifo && test -L link && test -f real.ckpt")
    local _, extra = m3.trainer.load(dir .. "/real.ckpt")
    local names = fs.list(dir)
    os.execute("rm -rf " .. q)
    assert.matches("^[^:]*checkpoint_spec%.lua:%d+: m3: writing " .. quoted(dir) .. "/fifo: it exists and is a FIFO "
      .. "%(named pipe%)" .. quoted(REPLACED), onto_fifo)
    assert.matches("m3: " .. quoted(dir) .. "/fifo: not a regular file", from_fifo)
    assert.matches("m3: writing " .. quoted(dir) .. "/link: it is a symbolic link to real%.ckpt, which does not "
      .. "resolve %(No such file or directory%)" .. quoted(REPLACED), onto_dangling)
    assert.equal(0, kept)
    assert.same({ a = 2 }, extra)
    assert.same({ "fifo", "link", "real.ckpt" }, names) -- and no temporary file
  end)

  it("refuses a path holding a NUL byte, to save and to load (C would take the name before it)", function()
    local dir = tmpdir()
    local tr = new_trainer()
    local path = dir .. "/with\0nul.ckpt"
    local saving = helper.error_of(function() tr:save(path) end)
    local names = fs.list(dir)
    tr:save(dir .. "/with") -- the file the cut name reaches
    local loading = helper.error_of(function() m3.trainer.load(path) end)
    os.execute("rm -rf '" .. dir .. "'")
    local says = '"' .. quoted(dir) .. '/with\\0nul%.ckpt" holds a NUL byte, which no file name can hold$'
    assert.matches("^[^:]*checkpoint_spec%.lua:%d+: save: path " .. says, saving)
    assert.matches("^[^:]*checkpoint_spec%.lua:%d+: m3%.trainer%.load: path " .. says, loading)
    assert.same({}, names)
  end)
end)

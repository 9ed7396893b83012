-- m3.checkpoint and m3.fit: keep the last k, skip damaged files, and resume bit-identically
-- (CPU: 10 steps against 5 + save + load + 5, with carried state; also after interrupts).

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

local function tmpdir()
  local d = os.tmpname()
  os.remove(d)
  fs.mkdir(d)
  return d
end

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

local function new_trainer()
  return m3.trainer(cfg, { device = "cpu", batch = 2, seq_len = 16, seed = 3, lr = 1e-2,
    carry_state = true })
end

-- The run under test: lengths 8 then 16, warmup-cosine, 4 rows per step as 2 micro-batches
-- of 2 (accumulation), text read as 2 continuing streams (carried state).
local function run(o, path)
  return fit.run {
    trainer = o.trainer, start = o.start, steps = o.steps, checkpoint = o.checkpoint, dir = o.dir,
    data = data.text(path, { order = "stream", seed = 1 }),
    curriculum = curriculum.new { { steps = 4, length = 8 }, { length = 16 } },
    schedule = schedule.warmup_cosine { peak = 1e-2, warmup = 3, total = 10, floor = 1e-3 },
    batch = 4, clip = 1.0, progress = false, eval = o.eval, eval_every = o.eval_every,
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
  local dir, path, reference

  setup(function()
    dir = tmpdir()
    path = text_file(dir)
    local tr = new_trainer()
    run({ trainer = tr, steps = 10, dir = dir .. "/ref" }, path)
    reference = { weights = bytes(tr:snapshot()), states = state_bytes(tr), step = tr:step_count(),
      losses = losses(dir .. "/ref"), lr = tr:lr() }
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
    assert.matches("^[^:]*checkpoint_spec%.lua:%d+: m3%.fs: cannot create the folder " .. file:gsub("%p", "%%%0")
      .. ": it exists and is not a folder$", err)
    assert.equal("keep me", fs.read(file))
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

  it("resumes bit-identically: 10 steps = 5 + save + load + 5 (carried state, accumulation)", function()
    local ck = checkpoint.new { dir = dir .. "/split/checkpoints", every = 5 }
    run({ trainer = new_trainer(), steps = 5, checkpoint = ck, dir = dir .. "/split" }, path)
    local tr, start = fit.resume(ck, { device = "cpu" })
    assert.equal(5, start.step)
    assert.equal(5, tr:step_count())
    run({ trainer = tr, start = start, steps = 10, checkpoint = ck, dir = dir .. "/split" }, path)
    assert.same(reference.weights, bytes(tr:snapshot()))
    assert.same(reference.states, state_bytes(tr))
    assert.equal(reference.step, tr:step_count())
    assert.equal(reference.lr, tr:lr())
    assert.same(reference.losses, losses(dir .. "/split"))
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
    it("saves on an interrupt (" .. how .. ") and resumes bit-identically", function()
      local ck = checkpoint.new { dir = dir .. "/int-" .. how .. "/checkpoints", every = 100 }
      local o = { trainer = new_trainer(), steps = 10, checkpoint = ck, dir = dir .. "/int-" .. how }
      local real_text = data.text
      data.text = function(...) return interrupting(real_text(...), 13, how) end
      local ok, err = pcall(run, o, path)
      data.text = real_text
      assert.is_false(ok)
      -- call 13 is the first micro-batch of step 7: steps 1..6 are done
      assert.truthy(tostring(err):find("^interrupted at step 6; saved .*step%-00000006%.ckpt"), err)
      assert.equal(0, lib.C.m3_interrupted())
      local tr, start = fit.resume(ck)
      assert.equal(6, start.step)
      run({ trainer = tr, start = start, steps = 10, checkpoint = ck, dir = o.dir }, path)
      assert.same(reference.weights, bytes(tr:snapshot()))
      assert.same(reference.losses, losses(o.dir))
    end)
  end
end)

-- m3.fit — the training loop that ties schedule, curriculum, data, accumulation,
-- checkpoints and logging together, resumable bit-identically.
--
--   local ck = m3.checkpoint.new{dir = run_dir .. "/checkpoints", every = 200, keep = 3}
--   local tr, start = fit.resume(ck, {device = "auto"})   -- nil, nil without a checkpoint; an
--                                                         -- error when ck has some but none loads
--   tr = tr or m3.trainer(cfg, {batch = 16, seq_len = cur:max("length")})
--   local result = fit.run{
--     trainer = tr, data = src, steps = 2000,
--     schedule = m3.schedule.warmup_cosine{peak = 3e-3, warmup = 100, total = 2000},
--     curriculum = cur,      -- the phase of each step is passed to data:next as options
--     batch = 64,            -- rows per optimizer step (a phase's `batch` wins); more rows
--                            -- than the trainer's batch run as accumulated micro-batches
--                            -- (an error for a trainer with carry_state: its state rows are
--                            -- the trainer's batch rows, one stream each; and in f16, which
--                            -- cannot accumulate: fit.check_rows(o) tells beforehand)
--     clip = 1.0, checkpoint = ck, start = start, dir = run_dir,
--     eval = function(tr, step) return {val_loss =, val_acc =} end, eval_every = 200,
--     extra = function() return my_state end,   -- saved too (start.extra.user on resume)
--     graph = true,          -- CUDA: capture the fused step after its first run (the
--                            -- engine keeps one graph per window shape; lr changes need
--                            -- no recapture); steps with accumulation run eagerly
--     max_nonfinite = 10,    -- steps in a row with a non-finite gradient passed over
--   }
--
-- Each step: phase = curriculum:phase(step); lr = schedule(step) (tr:set_lr); rows from
-- data:next(n, phase); tr:step, or m3.accumulate.step over k micro-batches; metrics to
-- dir/metrics.jsonl (one record per step, one per evaluation) and the progress display
-- (m3.log.progress); a checkpoint every `every` steps and at the end, with extra =
-- {data = cursor, phase = index, lr = lr, user = extra()}. At the end dir/plot.svg (a run
-- without start first empties dir/metrics.jsonl and removes an earlier run's plot.svg).
-- A length or pad_to of a phase (or of data_opts) that is not an integer from 1 to the
-- trainer's seq_len is refused before step 1, as are rows a step the trainer cannot take.
-- A run without start whose checkpoint folder already holds checkpoints (an earlier run's) is
-- refused before anything is written: its saves would mix with theirs, and keep would prune
-- them or its own; continue them (start) or remove them first.
-- Resuming (start = {step, extra} from fit.resume) seeks the data back, drops the
-- metrics records past the checkpoint's step record (its evaluation's too), evaluates
-- again at that step when an evaluation is due there or was dropped, and continues:
-- schedule and curriculum are pure functions of the step, so the run goes on exactly as
-- if never stopped, each record written once.
-- A step whose gradient is not finite changes nothing in the trainer (SPEC.md §7; the engine
-- refuses its update): the run says so, drops that step's rows and takes the step again on the
-- next rows, writing no record for the refused one. More than max_nonfinite (default 10; 0:
-- none) such steps in a row stop the run: the last good step's state is saved as a checkpoint
-- and fit.run raises an error object {message =, status = 1} (tostring gives the message,
-- which names the checkpoint; m3.flags ends a script with it, without a traceback).
-- Interrupts (Ctrl-C / SIGTERM make a trainer call, or the host's hook, raise an error
-- containing "interrupted"; m3.accumulate first closes an open window): the state that
-- matches the trainer's own step count is saved as a checkpoint and the error is raised
-- again with the checkpoint's path, so the host exits with 128 + the signal number. An
-- f16 step skipped for overflow at the very moment of an interrupt is replayed after the
-- resume. Any other error after a step of the run (a data file cut short, a bug in eval)
-- saves that state too and is raised as it was, a message with a last line that names the
-- checkpoint ("m3.fit.run: stopped at step N; saved <path> (resume from it)"; m3.flags ends a
-- script with it and status 1); an error before the run's first step saves nothing.
--
--   fit.evaluate(tr, src, {batches = 4, rows =, ...data options}) -> {loss, accuracy}
--       over the first batches of src (from index 0: the same set every time), each window from a
--       zero state (a reset at position 0) when the trainer carries its state; an error when no position
--       of them counts (every target -1), which leaves no loss to average

local accumulate = require "m3.accumulate"
local checkpoint = require "m3.checkpoint"
local fs = require "m3.fs"
local json = require "m3.json"
local lib = require "m3.lib"
local log = require "m3.log"
local progress = require "m3.log.progress"
local options = require "m3.options"
local schedule = require "m3.schedule"
local source = require "m3.data.source"
local tensor = require "m3.tensor"

lib.internal_file(debug.getinfo(1, "S").source)

local fit = {}

-- Raises "<what>: <name> = ...: expected <expected>" unless v is a table with the methods
-- (what an object of that kind has, so that a wrong value is named here instead of failing deep
-- inside); optional: nil is also taken.
local function want_object(v, methods, what, name, expected, optional)
  if type(v) == "nil" and optional then return v end
  local ok = type(v) == "table"
  for _, m in ipairs(methods) do ok = ok and type(v[m]) == "function" end
  if not ok then lib.raise(string.format("%s: %s = %s: expected %s", what, name, options.show(v), expected)) end
  return v
end

local TRAINER = { "step", "info", "batch", "seq_len", "lr", "step_count" } -- what fit.run calls
local LIMITS = { "batch", "info", "seq_len" } -- what fit.check_rows reads
local SOURCE = { "next", "cursor", "seek" }

function fit.resume(ck, opts)
  want_object(ck, { "resume", "list" }, "m3.fit.resume", "ck", "an m3.checkpoint (m3.checkpoint.new)")
  local tr, extra, step = ck:resume(opts)
  if not tr then
    local found = ck:list()
    if #found > 0 then -- the reason of each is on stderr
      lib.raise(string.format("m3.fit.resume: no checkpoint in %s loads (%d there, the newest: step %d)",
        ck.dir, #found, found[#found].step))
    end
    return nil
  end
  return tr, { step = step, extra = extra }
end

-- b with a reset at every row's first position (b's own resets kept): evaluated by a trainer that carries its
-- state, the window then starts from zero instead of where the training streams are.
local function from_zero_state(b)
  local x = b.tokens or b.input
  local rows, len
  if tensor.is(x) then rows, len = x:shape()[1], x:shape()[2] else rows, len = #x, #x[1] end
  local resets = type(b.resets) ~= "nil" and tensor.from(b.resets, "u8", "batch.resets") or tensor({ rows, len }, "u8")
  for r = 0, rows - 1 do resets[r * len] = 1 end
  local out = {}
  for k, v in pairs(b) do out[k] = v end
  out.resets = resets
  return out
end

function fit.evaluate(tr, src, o)
  want_object(tr, { "info", "batch", "evaluate" }, "m3.fit.evaluate", "tr", "an m3.trainer")
  want_object(src, SOURCE, "m3.fit.evaluate", "src", "a data source with :next, :cursor and :seek (m3.data)")
  if type(o) ~= "nil" and type(o) ~= "table" then
    lib.raise("m3.fit.evaluate: expected an options table, got " .. options.show(o))
  end
  o = o or {}
  local batches = options.want_int(o.batches or 4, "m3.fit.evaluate: batches", 1)
  local carry = tr:info().carry_state
  local saved = src:cursor()
  src:seek { seed = saved.seed, index = 0 }
  local loss, acc, counted = 0, 0, 0
  for _ = 1, batches do
    local b = src:next(o.rows or tr:batch(), o)
    local m = tr:evaluate(carry and from_zero_state(b) or b)
    local c = m.counted or 1
    if c > 0 then
      loss, counted = loss + m.loss * c, counted + c
      if m.accuracy then acc = acc + m.accuracy * c end
    end
  end
  src:seek(saved)
  if counted == 0 then
    lib.raise(string.format("m3.fit.evaluate: no position counts (every target is -1 in the %s): there is no "
      .. "loss to average", log.plural(batches, "batch", "batches")))
  end
  return { loss = loss / counted, accuracy = acc / counted }
end

-- Keeps the records of dir/metrics.jsonl before step and step's own record (its first: an
-- evaluation at step is written after it); a resumed run writes the rest again. Returns
-- whether an evaluation record at step was dropped.
local function truncate_metrics(path, step)
  if not fs.is_file(path) then return false end -- nothing yet, or a FIFO another process reads
  local keep, seen_step, dropped_eval = {}, false, false
  for _, r in ipairs(log.read_jsonl(path)) do
    if type(r.step) == "number" and r.step < step or (r.step == step and not seen_step) then
      keep[#keep + 1] = json.encode(r)
      seen_step = seen_step or r.step == step
    elseif r.step == step then
      dropped_eval = true
    end
  end
  fs.write(path, #keep > 0 and table.concat(keep, "\n") .. "\n" or "")
  return dropped_eval
end

local OPTS = { trainer = true, data = true, steps = true, schedule = true, curriculum = true, batch = true,
               clip = true, checkpoint = true, start = true, dir = true, eval = true, eval_every = true,
               extra = true, graph = true, data_opts = true, progress = true, out = true, print_every = true,
               title = true, max_nonfinite = true }

local function check(o)
  options.check_table(o, OPTS, "m3.fit.run")
  if type(o.trainer) ~= "table" then lib.raise("m3.fit.run: trainer = an m3.trainer is required") end
  want_object(o.trainer, TRAINER, "m3.fit.run", "trainer", "an m3.trainer")
  if type(o.data) ~= "table" or type(o.data.next) ~= "function" then
    lib.raise("m3.fit.run: data = a source with :next(rows, opts) is required (m3.data)")
  end
  want_object(o.data, SOURCE, "m3.fit.run", "data", "a data source with :next, :cursor and :seek (m3.data)")
  want_object(o.curriculum, { "phase", "phases" }, "m3.fit.run", "curriculum", "an m3.curriculum", true)
  want_object(o.checkpoint, { "list", "save", "save_interrupted" }, "m3.fit.run", "checkpoint",
    "an m3.checkpoint (m3.checkpoint.new)", true)
  if type(o.start) ~= "nil" and (type(o.start) ~= "table" or type(o.start.step) ~= "number"
      or type(o.start.extra) ~= "table") then
    lib.raise("m3.fit.run: start = " .. options.show(o.start) .. ": expected what m3.fit.resume returns")
  end
  for _, name in ipairs { "schedule", "eval", "extra" } do
    if type(o[name]) ~= "nil" and type(o[name]) ~= "function" then
      lib.raise(string.format("m3.fit.run: %s = %s: expected a function", name, options.show(o[name])))
    end
  end
  if type(o.dir) ~= "nil" and (type(o.dir) ~= "string" or o.dir == "") then
    lib.raise("m3.fit.run: dir = " .. options.show(o.dir) .. ": expected a folder path")
  end
  if type(o.title) ~= "nil" and type(o.title) ~= "string" then
    lib.raise("m3.fit.run: title = " .. options.show(o.title) .. ": expected a string")
  end
  if type(o.data_opts) ~= "nil" and type(o.data_opts) ~= "table" then
    lib.raise("m3.fit.run: data_opts = " .. options.show(o.data_opts) .. ": expected a table of data options")
  end
  options.want_int(o.steps, "m3.fit.run: steps", 1)
  if type(o.batch) ~= "nil" then options.want_int(o.batch, "m3.fit.run: batch", 1) end
  if type(o.eval_every) ~= "nil" then options.want_int(o.eval_every, "m3.fit.run: eval_every", 1) end
  if type(o.max_nonfinite) ~= "nil" then options.want_int(o.max_nonfinite, "m3.fit.run: max_nonfinite", 0) end
  if type(o.graph) ~= "nil" then options.want_bool(o.graph, "m3.fit.run: graph") end -- (a NULL pointer is true)
  if type(o.clip) ~= "nil" and type(o.clip) ~= "number" then -- (the trainer's set_clip checks the number)
    lib.raise("m3.fit.run: clip = " .. options.show(o.clip) .. ": expected a number >= 0 (0 = off)")
  end
  if o.graph and o.trainer.device and o.trainer:device() == "cpu" then -- refused before the first step
    lib.raise("m3.fit.run: graph = true needs a CUDA trainer (this one runs on " .. o.trainer:device() .. ")")
  end
  local earlier = o.checkpoint and not o.start and o.checkpoint:list() or {}
  if #earlier > 0 then
    lib.raise(string.format("m3.fit.run: %s holds the checkpoints of an earlier run (the newest: step %d); continue "
      .. "it (start = fit.resume's) or remove them", o.checkpoint.dir, earlier[#earlier].step))
  end
end

-- What limits a step's rows: a trainer that carries its state holds one state row per row of
-- its batch, so its steps take no more rows than that (the micro-batches of an accumulated step
-- would run other windows through the same state rows); one in f16 cannot accumulate either (an
-- overflow skips a whole update, so the engine refuses accumulation windows in f16). And what
-- limits its windows: the trainer's seq_len.
local function limits_of(tr)
  return { micro = tr:batch(), carry = tr:info().carry_state, f16 = tr.dtype ~= nil and tr:dtype() == "f16",
    seq_len = tr:seq_len() }
end

-- The rows of a step in phase (nil without a curriculum) under the trainer's limits.
local function rows_of(o, phase, lim)
  local rows = (phase and phase.batch) or o.batch or lim.micro
  if rows > lim.micro and (lim.carry or lim.f16) then
    local where = phase and phase.batch and phase.index and "phase " .. phase.index .. ": " or "" -- it set the rows
    local why = lim.carry and "carries its state (carry_state) in %s; accumulated micro-batches would mix the "
      .. "rows' streams" or "computes in f16 with %s; an overflow skips a whole update, so it cannot accumulate "
      .. "micro-batches (bf16 and f32 can)"
    lib.raise(string.format("m3.fit.run: %sbatch = %d rows a step, but the trainer " .. why .. ": use a batch <= %d",
      where, rows, log.plural(lim.micro, "row"), lim.micro))
  end
  return rows
end

-- Raises unless the windows of a step in phase (nil without a curriculum) fit the trainer: their
-- length and pad_to (the phase's over o.data_opts), when given, are integers from 1 to its seq_len.
local function check_length(o, phase, lim)
  local opts = source.overlay(o.data_opts, phase)
  for _, field in ipairs { "length", "pad_to" } do
    local n = opts[field]
    if n ~= nil and not (type(n) == "number" and n >= 1 and n <= lim.seq_len and n == math.floor(n)) then
      local where = phase and phase[field] ~= nil and phase.index and "phase " .. phase.index .. ": " or ""
      lib.raise(string.format("m3.fit.run: %s%s = %s: expected an integer from 1 to the trainer's seq_len %d", where,
        field, options.show(n), lim.seq_len))
    end
  end
end

-- The trainer's limits, once every step's rows (o.batch, each phase of o.curriculum) and
-- window lengths are within them; else raises what fit.run would.
local function checked_limits(o)
  local lim = limits_of(o.trainer)
  if not o.curriculum then
    rows_of(o, nil, lim)
    check_length(o, nil, lim)
  elseif o.curriculum.phases then -- the steps check each phase's rows again
    for _, phase in ipairs(o.curriculum:phases()) do
      rows_of(o, phase, lim)
      check_length(o, phase, lim)
    end
  end
  return lim
end

-- Raises what fit.run(o) would for rows a step, or windows longer than its seq_len, that
-- o.trainer cannot take. fit.run checks it before anything is written; a script can call it
-- before it writes anything of its own.
function fit.check_rows(o)
  options.check_table(o, OPTS, "m3.fit.check_rows")
  want_object(o.trainer, LIMITS, "m3.fit.check_rows", "trainer", "an m3.trainer")
  want_object(o.curriculum, { "phase", "phases" }, "m3.fit.check_rows", "curriculum", "an m3.curriculum", true)
  if type(o.batch) ~= "nil" then options.want_int(o.batch, "m3.fit.check_rows: batch", 1) end
  if type(o.data_opts) ~= "nil" and type(o.data_opts) ~= "table" then
    lib.raise("m3.fit.check_rows: data_opts = " .. options.show(o.data_opts) .. ": expected a table of data options")
  end
  checked_limits(o)
end

-- One optimizer step over batches (one: tr:step, several: an accumulation window): its metrics, or nil and
-- the engine's words ("global norm nan") when it refused the update as non-finite, which changed nothing.
-- Any other error goes up.
local function take_step(tr, batches, clip)
  lib.last_status = nil
  local ok, m = pcall(function()
    if #batches == 1 then return tr:step(batches[1]) end
    return accumulate.step(tr, batches, { clip = clip })
  end)
  if ok then return m end
  if lib.last_status == lib.C.M3_ERR_NONFINITE and not checkpoint.is_interrupt(m) then
    return nil, tostring(m):match("non%-finite gradient %((.-)%)") or tostring(m)
  end
  error(m, 0)
end

-- The error object of a run stopped by non-finite gradients (see the header).
local Stopped = { __tostring = function(e) return e.message or "m3.fit.run: stopped by non-finite gradients" end }

function fit.run(o)
  check(o)
  local lim = checked_limits(o)
  local tr, src, total = o.trainer, o.data, o.steps
  local micro = lim.micro
  if o.clip then tr:set_clip(o.clip) end
  local step = 0
  if o.start then
    step = o.start.step
    src:seek(o.start.extra.data)
  end
  local metrics_path = o.dir and o.dir .. "/metrics.jsonl"
  local writer, dropped_eval
  if o.dir then
    fs.mkdir(o.dir, "m3.fit.run")
    if o.start then
      dropped_eval = truncate_metrics(metrics_path, step)
    else -- a new run: no record or plot of an earlier run in dir passes for its own
      fs.write(metrics_path, "")
      os.remove(o.dir .. "/plot.svg")
    end
    writer = log.jsonl(metrics_path)
  end
  local show = o.progress ~= false
  local bar = show and log.progress { total = total, first = step, out = o.out, every = o.print_every } or nil
  local function say(text)
    if bar then bar:message(text) end
  end

  local lr, phase = tr:lr(), nil
  local function state_now()
    return { data = src:cursor(), phase = phase and phase.index, lr = lr, user = o.extra and o.extra() }
  end
  local committed = { count = tr:step_count(), step = step, extra = state_now(), written = true } -- the start
  local pending, committed_at_start = committed, step
  local result = { step = step, tokens = 0 }
  local max_nonfinite, refused = o.max_nonfinite or 10, 0 -- refused: steps in a row passed over

  local function evaluate(s)
    local e = o.eval(tr, s)
    if type(e) ~= "table" then
      lib.raise("m3.fit.run: eval must return a table of metrics, got " .. options.show(e))
    end
    local rec = { step = s }
    local parts = { string.format("eval step %d:", s) }
    local keys = {}
    for k in pairs(e) do keys[#keys + 1] = k end
    table.sort(keys)
    for _, k in ipairs(keys) do
      rec[k] = e[k]
      parts[#parts + 1] = k .. " " .. (type(e[k]) == "number" and progress.fixed(e[k]) or tostring(e[k]))
    end
    if writer then writer:write(rec) end
    say(table.concat(parts, "  "))
    result.eval = e
  end

  local function eval_due(s) -- step 0 (a run interrupted before its first step) has no evaluation
    return o.eval and s >= 1 and ((o.eval_every and s % o.eval_every == 0) or s == total)
  end

  local function record_of(p, m)
    return { step = p.step, loss = m.loss, lr = p.lr, tokens = m.tokens, ms = m.ms, length = p.length,
      rows = p.rows, grad_norm = m.grad_norm, accuracy = m.accuracy }
  end

  -- step s took effect with metrics m: its record, the progress, an evaluation and a checkpoint when due
  local function done(s, m)
    pending.record = record_of(pending, m)
    if writer then
      writer:write(pending.record)
      pending.written = true
    end
    step = s
    committed = pending
    committed.count = tr:step_count()
    result.step, result.loss, result.tokens = s, m.loss, result.tokens + (m.tokens or 0)
    if bar then bar:update(s, { loss = m.loss, lr = lr, tokens = m.tokens }) end
    if eval_due(s) then evaluate(s) end
    if o.checkpoint and s < total then o.checkpoint:maybe_save(tr, s, committed.extra) end
  end

  local function body()
    -- a resumed run evaluates again at its checkpoint's step (an evaluation there may have been
    -- cut short by the interrupt, and its record was dropped with the others past the step record)
    if o.start and o.eval and (dropped_eval or eval_due(step)) then evaluate(step) end
    while step < total do
      local s = step + 1
      phase = o.curriculum and o.curriculum:phase(s) or nil
      if o.schedule then lr = schedule.apply(tr, o.schedule, s) end
      local opts = source.overlay(o.data_opts, phase)
      local rows = rows_of(o, phase, lim)
      local batches, left = {}, rows
      while left > 0 do
        local n = math.min(micro, left)
        batches[#batches + 1] = src:next(n, opts)
        left = left - n
      end
      pending = { count = committed.count + 1, step = s, extra = state_now(), lr = lr,
        length = opts.length, rows = rows }
      local m, why = take_step(tr, batches, o.clip)
      if m then
        refused = 0
        if #batches == 1 and o.graph and not tr:has_graph() then tr:capture_graph() end
        done(s, m)
      else -- nothing changed: the same step again, on the next rows
        pending, refused = committed, refused + 1
        if refused > max_nonfinite then error(setmetatable({ status = 1, step = s, why = why }, Stopped), 0) end
        say(string.format("step %d: non-finite gradient (%s): update refused, its rows dropped, the step taken "
          .. "again on the next (%d in a row; more than %d stop the run)", s, why, refused, max_nonfinite))
      end
    end
    if o.eval and not result.eval then evaluate(step) end -- a run resumed past its end
    if o.checkpoint then o.checkpoint:save(tr, step, committed.extra) end
  end

  -- a message gets the traceback of where it was raised; any other error value stays as it is
  local ok, err = xpcall(body, function(e)
    return type(e) == "string" and debug.traceback(e, 2) or e
  end)
  if bar then result.elapsed = bar:finish() end
  if not ok and getmetatable(err) == Stopped then -- the last good step saved, and the error says where
    if writer then writer:close() end
    local path, why = nil, "no checkpoint folder given"
    if o.checkpoint then path, why = o.checkpoint:save_interrupted(tr, committed.step, committed.extra) end
    err.message = string.format("m3.fit.run: %s in a row had a non-finite gradient (the last at step %d: %s); "
      .. "stopped at step %d, %s (lower the learning rate or look at the data; resume from it or an earlier one)",
      log.plural(refused, "step"), err.step, err.why, committed.step,
      path and "saved " .. path or "no checkpoint saved (" .. tostring(why) .. ")")
    error(err, 0)
  end
  -- an interrupt, or an error after a step of this run (the data file cut short, a bug in a callback), saves
  -- the state that matches the trainer: the pending step's if the engine applied it (a poisoned trainer has
  -- no count to tell, and saves nothing)
  if not ok and o.checkpoint then
    local interrupted = checkpoint.is_interrupt(err)
    local counted, count = pcall(tr.step_count, tr)
    local at = counted and count == pending.count and pending or committed
    if counted and (interrupted or at.step > committed_at_start) then
      if writer and not at.written then -- a step that took effect before the error was raised
        writer:write(at.record or record_of(at, type(err) == "table" and err.metrics or tr:_last_metrics()))
      end
      if writer then writer:close() end
      local path, why = o.checkpoint:save_interrupted(tr, at.step, at.extra)
      local saved = path and string.format("saved %s (resume from it)", path)
        or string.format("no checkpoint saved (%s)", why)
      if interrupted then error(string.format("interrupted at step %d; %s", at.step, saved), 0) end
      -- the error as it was raised (a value that is not a message stays as it is), its message with a last
      -- line that says where the run stopped
      if type(err) == "string" then
        err = string.format("%s\nm3.fit.run: stopped at step %d; %s", err, at.step, saved)
      end
    end
  end
  if writer then writer:close() end
  if not ok then error(err, 0) end
  if o.dir then log.plot_run(o.dir, { title = o.title }) end
  return result
end

return fit

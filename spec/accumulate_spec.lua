-- m3.accumulate: k micro-batches with backward_step{accumulate} and a clipped closing call
-- give the update of one big batch (ragged target counts included, every head) and its
-- metrics; a trainer mid-window or f16 with k >= 2 is refused before anything runs.

local m3 = require "m3"
local data = require "m3.data"
local accumulate = require "m3.accumulate"
local options = require "m3.options"
local helper = require "spec.helper"

local cfg = m3.config { d_model = 16, n_layers = 1, d_state = 8, headdim = 8, input = "tokens",
  head = "lm", vocab_size = 2 }

local function new_trainer(batch)
  return m3.trainer(cfg, { device = "cpu", batch = batch, seq_len = 12, seed = 1, lr = 1e-2 })
end

-- Largest relative L2 difference over the tensors of two weight sets.
local function max_rel_diff(a, b)
  local worst = 0
  for _, name in ipairs(a:names()) do
    local x, y = a:get(name), b:get(name)
    local num, den = 0, 0
    for i = 0, x:numel() - 1 do
      local d = x[i] - y[i]
      num, den = num + d * d, den + y[i] * y[i]
    end
    worst = math.max(worst, math.sqrt(num / math.max(den, 1e-30)))
  end
  return worst
end

describe("m3.accumulate", function()
  -- running parity targets on lengths 2..12: the halves count different numbers of targets
  local big = data.parity { seed = 3, length = 12, min_length = 2 }:next(8, { pad_to = 12 })

  it("counts the scored positions of a micro-batch", function()
    local halves = accumulate.split(big, 2)
    local tr = new_trainer(8)
    local c1, c2 = accumulate.counted(tr, halves[1]), accumulate.counted(tr, halves[2])
    assert.equal(accumulate.counted(tr, big), c1 + c2)
    assert.are_not.equal(c1, c2)
  end)

  it("splits a batch into row views", function()
    local parts = accumulate.split(big, 4)
    assert.equal(4, #parts)
    assert.same({ 2, 12 }, parts[3].tokens:shape())
    assert.equal(big.tokens[4 * 12 + 5], parts[3].tokens[5])
    assert.has_error(function() accumulate.split(big, 3) end,
      "m3.accumulate.split: k must divide the batch's 8 rows, got 3")
    assert.has_error(function() accumulate.split(big, 1.6) end,
      "m3.accumulate.split: k must divide the batch's 8 rows, got 1.6")
    assert.has_error(function() accumulate.split(big, "2") end,
      "m3.accumulate.split: k must divide the batch's 8 rows, got \"2\"")
  end)

  -- the short field visited first or last by pairs(): views past its end, or rows of the others
  -- dropped; fields are checked in name order, so tokens is compared with targets either way
  for _, short in ipairs { "tokens", "targets" } do
    it("refuses fields with different rows (batch." .. short .. " short) before making any view", function()
      local b = { tokens = big.tokens, targets = big.targets }
      b[short] = m3.tensor({ 2, 12 }, "i32")
      local rows = { tokens = 8, targets = 8 }
      rows[short] = 2
      assert.has_error(function() accumulate.split(b, 2) end, string.format("m3.accumulate.split: batch.tokens"
        .. " (int32 [%d, 12]) has %d rows, batch.targets (int32 [%d, 12]) %d: every field needs the same rows",
        rows.tokens, rows.tokens, rows.targets, rows.targets))
    end)
  end

  it("refuses fields with different lengths, comparing dimension 2 only", function()
    local b = { tokens = big.tokens, targets = m3.tensor({ 8, 6 }, "i32") }
    assert.has_error(function() accumulate.split(b, 2) end, "m3.accumulate.split: batch.tokens (int32 [8, 12])"
      .. " has length 12, batch.targets (int32 [8, 6]) 6: every field needs the same length (dimension 2)")
    -- mse: input [B,T,in] and targets [B,T,out] may differ in dimension 3
    local mse = { input = m3.tensor({ 4, 12, 3 }), targets = m3.tensor({ 4, 12, 5 }),
      mask = m3.tensor({ 4, 12 }, "u8") }
    assert.same({ 2, 12, 5 }, accumulate.split(mse, 2)[2].targets:shape())
    mse.mask = m3.tensor({ 4, 11 }, "u8")
    assert.has_error(function() accumulate.split(mse, 2) end, "m3.accumulate.split: batch.mask (uint8 [4, 11])"
      .. " has length 11, batch.input (f32 [4, 12, 3]) 12: every field needs the same length (dimension 2)")
  end)

  it("says what a batch or field is when it is not a table of m3 tensors", function()
    assert.has_error(function() accumulate.split(nil, 2) end,
      "m3.accumulate.split: expected a batch (a table of m3 tensors), got nil")
    assert.has_error(function() accumulate.split(big.tokens, 2) end,
      "m3.accumulate.split: expected a batch (a table of m3 tensors), got int32 [8, 12]")
    assert.has_error(function() accumulate.split({ tokens = big.tokens:to_table(), targets = big.targets }, 2) end,
      "m3.accumulate.split: batch.tokens is a table: expected an m3 tensor with the rows first"
      .. " (split makes views of its rows)")
    assert.has_error(function() accumulate.split({ tokens = big.tokens, targets = m3.tensor({}, "i32") }, 2) end,
      "m3.accumulate.split: batch.targets is int32 []: expected an m3 tensor with the rows first"
      .. " (split makes views of its rows)")
  end)

  it("checks every micro-batch and option before the first forward, leaving no window open", function()
    local tr = new_trainer(4)
    local parts = accumulate.split(big, 2)
    local bad = { tokens = parts[2].tokens, targets = parts[2].targets:clone() }
    bad.targets[3] = 5
    local err = tostring(select(2, pcall(accumulate.step, tr, { parts[1], bad })))
    assert.matches("micro%-batch 2: .*batch.targets%[3%] .* = 5: must be in %[0, 2%)", err)
    assert.matches("clip = %-1: expected a finite number >= 0",
      tostring(select(2, pcall(accumulate.step, tr, parts, { clip = -1 }))))
    assert.matches("micro%-batch 1: batch.targets: missing",
      tostring(select(2, pcall(accumulate.step, tr, { { tokens = parts[1].tokens }, parts[2] }))))
    -- a micro-batch whose fields disagree on rows (not made by split) is refused by the trainer's check
    local short = { tokens = parts[2].tokens, targets = accumulate.split(parts[2], 2)[1].targets }
    assert.matches("micro%-batch 2: batch.targets: expected int32 %[4, 12%], got int32 %[2, 12%]",
      tostring(select(2, pcall(accumulate.step, tr, { parts[1], short }))))
    assert.is_false(tr:info().pending_forward)
    assert.equal(0, tr:step_count())
    assert.is_number(tr:step(parts[1]).loss) -- nothing was left open
  end)

  -- a list with a hole: # may count past it (the nil used to be found only after micro-batch 1 had opened the
  -- window) or stop before it (the batches after it dropped without a word)
  it("refuses a list of micro-batches with a hole or other keys before the first forward", function()
    local tr = new_trainer(2)
    local parts = accumulate.split(big, 4)
    local past = { parts[1], parts[2], parts[3] }
    past[2] = nil
    local before = { parts[1] }
    before[3] = parts[3]
    assert.same({ 3, 1 }, { #past, #before }) -- both lengths LuaJIT gives a list with a hole
    for _, list in ipairs { past, before, { parts[1], parts[2], rows = 4 } } do
      assert.equal("m3.accumulate.step: expected a list of micro-batches (keys 1 to k, no hole), got "
        .. options.show(list) .. "; nothing was run", helper.error_of(accumulate.step, tr, list))
      assert.is_false(tr:info().pending_forward)
      assert.is_false(tr:info().window_open)
    end
    assert.equal(0, tr:step_count())
  end)

  it("takes micro-batches that count nothing and nested tables, as a fused step does", function()
    local parts = accumulate.split(big, 2)
    local none = { tokens = parts[1].tokens, targets = m3.tensor({ 4, 12 }, "i32") }
    for i = 0, none.targets:numel() - 1 do none.targets[i] = -1 end
    local a, b = new_trainer(4), new_trainer(4)
    local m = accumulate.step(a, { none, parts[2] })
    local ref = b:step(parts[2])
    assert.equal(ref.loss, m.loss)
    assert.equal(0, max_rel_diff(b:snapshot(), a:snapshot()))
    local nested = { tokens = parts[2].tokens:to_table(), targets = parts[2].targets:to_table() }
    assert.equal(accumulate.counted(a, parts[2]), accumulate.counted(a, nested))
    assert.is_number(accumulate.step(a, { parts[1], nested }).loss)
  end)

  it("refuses micro-batches that all count nothing, before the first forward", function()
    local parts = accumulate.split(big, 2)
    local none = {}
    for i = 1, 2 do
      none[i] = { tokens = parts[i].tokens, targets = m3.tensor({ 4, 12 }, "i32") }
      for j = 0, none[i].targets:numel() - 1 do none[i].targets[j] = -1 end
    end
    local tr = new_trainer(4)
    local w0 = tr:snapshot()
    assert.equal("m3.accumulate.step: the 2 micro-batches count no position (every target is -1 in each): there is "
      .. "no loss to take the gradient of; nothing was run", tostring(select(2, pcall(accumulate.step, tr, none))))
    assert.is_false(tr:info().pending_forward)
    assert.is_false(tr:info().window_open)
    assert.equal(0, tr:step_count())
    assert.equal(0, max_rel_diff(w0, tr:snapshot()))
  end)

  for _, k in ipairs { 2, 4 } do
    it("gives the big batch's update with k = " .. k .. " (clipped)", function()
      local a, b = new_trainer(8), new_trainer(8 / k)
      for _ = 1, 3 do
        a:forward(big)
        local ma = a:backward_step(big, { clip = 0.05 })
        local mb = accumulate.step(b, accumulate.split(big, k), { clip = 0.05 })
        assert.is_true(math.abs(ma.loss - mb.loss) <= 1e-6 * ma.loss)
        assert.is_true(math.abs(ma.accuracy - mb.accuracy) <= 1e-6)
        assert.is_true(math.abs(ma.grad_norm - mb.grad_norm) <= 1e-5 * ma.grad_norm)
        assert.is_true(ma.grad_norm > 0.05) -- clipping was active
        assert.equal(ma.step, mb.step)
        assert.equal(k, mb.micro)
        assert.equal(8 * 12, mb.tokens)
      end
      assert.is_true(max_rel_diff(b:snapshot(), a:snapshot()) < 1e-5)
      assert.is_false(b:info().window_open)
    end)
  end

  -- d_out is dL/dout of the big batch: its rows' slices at scale 1 sum to the big batch's gradient (scaled
  -- by 1/k, the gradient was 1/k of it: grad_norm exactly half for k = 2)
  it("gives the big batch's update and grad_norm for head \"none\" (to float rounding)", function()
    local ncfg = m3.config(helper.features_none())
    local b = helper.batch(ncfg, 4, 6, helper.rng(5))
    for i = 0, b.d_out:numel() - 1 do b.d_out[i] = b.d_out[i] * 10 end
    local a = m3.trainer(ncfg, { device = "cpu", batch = 4, seq_len = 6, seed = 1, clip = 0.05 })
    local c = m3.trainer(ncfg, { device = "cpu", batch = 2, seq_len = 6, seed = 1 })
    c.config.head = "mse" -- the user's copy: accumulate goes by the trainer's own
    for _ = 1, 3 do
      local ma = a:step(b)
      local mc = accumulate.step(c, accumulate.split(b, 2), { clip = 0.05 })
      assert.is_true(ma.grad_norm > 0.05) -- clipping was active
      assert.is_true(math.abs(ma.grad_norm - mc.grad_norm) <= 1e-5 * ma.grad_norm,
        string.format("grad_norm %.9g vs %.9g", ma.grad_norm, mc.grad_norm))
      assert.is_nil(ma.counted)
      assert.is_nil(mc.counted)
      assert.equal(ma.tokens, mc.tokens)
    end
    assert.is_true(max_rel_diff(c:snapshot(), a:snapshot()) < 1e-5)
  end)

  it("reports the counted of a step on the whole batch (\"mse\": elements, as the engine counts them)", function()
    local mcfg = m3.config(helper.identity_mse())
    local b = helper.batch(mcfg, 4, 4, helper.rng(6))
    b.mask = m3.tensor({ 4, 4 }, "u8")
    for i = 0, 9 do b.mask[i] = 1 end
    local a = m3.trainer(mcfg, { device = "cpu", batch = 4, seq_len = 4, seed = 1 })
    local c = m3.trainer(mcfg, { device = "cpu", batch = 4, seq_len = 4, seed = 1 })
    local ma = a:step(b)
    assert.equal(30, ma.counted) -- 10 masked-in positions x out_dim 3
    assert.equal(30, accumulate.step(c, accumulate.split(b, 2)).counted)
    assert.equal(30, accumulate.step(c, { b }).counted)
    assert.equal(ma.counted, c:evaluate(b).counted)
  end)

  -- its loss and counted would describe its own micro-batches only, and a pending forward would be replaced
  it("refuses a trainer with a forward pending or a window open, running nothing", function()
    local parts = accumulate.split(big, 2)
    local tr = new_trainer(4)
    tr:forward(parts[1])
    assert.has_error(function() accumulate.step(tr, parts) end, "m3.accumulate.step: the trainer has a forward "
      .. "pending (tr:forward was called); finish it with tr:backward_step first; nothing was run")
    assert.is_true(tr:info().pending_forward)
    tr:backward_step(parts[1], { accumulate = true })
    local g = tr:grads()
    assert.has_error(function() accumulate.step(tr, parts) end, "m3.accumulate.step: the trainer has an "
      .. "accumulation window open (backward_step with accumulate = true); close it with tr:forward and a "
      .. "tr:backward_step without accumulate first; nothing was run")
    assert.is_true(tr:info().window_open)
    assert.is_false(tr:info().pending_forward)
    assert.equal(0, max_rel_diff(tr:grads(), g))
    tr:forward(parts[2])
    tr:backward_step(parts[2])
    assert.equal(1, tr:step_count())
    assert.equal(2, accumulate.step(tr, parts).step)
  end)

  -- the engine refuses backward_step{accumulate} under f16: the first call would fail after forward(b1) ran
  it("refuses k >= 2 micro-batches on an f16 trainer before running anything", function()
    local parts = accumulate.split(big, 2)
    local tr = new_trainer(4)
    tr.info = function(self)
      local i = getmetatable(self).info(self)
      i.dtype = "f16"
      return i
    end
    assert.has_error(function() accumulate.step(tr, parts) end, "m3.accumulate.step: 2 micro-batches on an f16 "
      .. "trainer: f16 does not accumulate gradients (an overflow skips the whole update); use one batch, or a bf16 or "
      .. "f32 trainer; nothing was run")
    assert.is_false(tr:info().pending_forward)
    assert.equal(0, tr:step_count())
    assert.equal(1, accumulate.step(tr, { parts[1] }).step)
  end)

  it("with one micro-batch equals a fused step", function()
    local a, b = new_trainer(8), new_trainer(8)
    local ma = a:step(big)
    local mb = accumulate.step(b, { big })
    assert.equal(ma.loss, mb.loss)
    assert.is_true(max_rel_diff(b:snapshot(), a:snapshot()) < 1e-6)
  end)

  -- An interrupt inside the window, from the engine (the next forward refuses) or from the
  -- host's Lua hook (an error right after a backward_step took effect, before it returned:
  -- after the first micro-batch's or after the closing one).
  for _, case in ipairs { { how = "engine", at = 1 }, { how = "hook", at = 1 }, { how = "hook", at = 2 } } do
    local name = case.how .. " after call " .. case.at
    it("finishes the window on an interrupt (" .. name .. "), then raises it with the step's metrics", function()
      local lib = require "m3.lib"
      local a, b = new_trainer(4), new_trainer(4)
      local ma = accumulate.step(a, accumulate.split(big, 2), { clip = 0.05 })
      local calls = 0
      b.backward_step = function(self, ...)
        local m = getmetatable(self).backward_step(self, ...)
        calls = calls + 1
        if calls == case.at then
          if case.how == "engine" then lib.C.m3_interrupt() else error("interrupted!") end
        end
        return m
      end
      local ok, err = pcall(accumulate.step, b, accumulate.split(big, 2), { clip = 0.05 })
      assert.is_false(ok)
      assert.truthy(tostring(err):find("interrupted.*the accumulation window was closed first"))
      assert.equal(0, lib.C.m3_interrupted())
      assert.is_false(b:info().window_open)
      assert.equal(2, calls)
      -- the completed step's metrics, as without the interrupt
      for _, k in ipairs { "step", "loss", "accuracy", "grad_norm", "tokens", "counted", "micro" } do
        assert.equal(ma[k], err.metrics[k], k)
      end
      assert.equal(0, max_rel_diff(b:snapshot(), a:snapshot()))
    end)
  end

  -- the host's hook can raise inside backward_step before the engine ran it: the forward is still pending, so
  -- that micro-batch's backward is run again, not skipped (the next forward would meet a pending one)
  it("runs a backward again that an interrupt stopped before it took effect", function()
    local lib = require "m3.lib"
    local a, b = new_trainer(4), new_trainer(4)
    local ma = accumulate.step(a, accumulate.split(big, 2), { clip = 0.05 })
    local calls, raised = 0, false
    b.backward_step = function(self, ...)
      calls = calls + 1
      if calls == 1 then
        assert.is_true(self:info().pending_forward)
        raised = true
        error("interrupted!")
      end
      return getmetatable(self).backward_step(self, ...)
    end
    local ok, err = pcall(accumulate.step, b, accumulate.split(big, 2), { clip = 0.05 })
    assert.is_true(raised)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("interrupted.*the accumulation window was closed first"), tostring(err))
    assert.equal(3, calls)
    assert.is_false(b:info().window_open)
    assert.is_false(b:info().pending_forward)
    for _, k in ipairs { "step", "loss", "accuracy", "grad_norm", "tokens", "counted", "micro" } do
      assert.equal(ma[k], err.metrics[k], k)
    end
    assert.equal(0, max_rel_diff(b:snapshot(), a:snapshot()))
    assert.equal(0, lib.C.m3_interrupted())
  end)

  -- ms is the time of the whole step: the sum of what each micro-batch's call reported, in order
  it("reports ms summed over the micro-batches", function()
    local tr = new_trainer(2)
    local seen = {}
    tr.backward_step = function(self, ...)
      local m = getmetatable(self).backward_step(self, ...)
      seen[#seen + 1] = m.ms
      return m
    end
    local m = accumulate.step(tr, accumulate.split(big, 4))
    assert.equal(4, #seen)
    for i = 1, 4 do assert.is_true(seen[i] > 0) end
    assert.equal(((0 + seen[1]) + seen[2] + seen[3]) + seen[4], m.ms)
  end)

  it("raises an interrupt before the first forward as it comes", function()
    local lib = require "m3.lib"
    local tr = new_trainer(4)
    lib.C.m3_interrupt()
    local ok, err = pcall(accumulate.step, tr, accumulate.split(big, 2))
    lib.C.m3_interrupt_clear()
    assert.is_false(ok)
    assert.truthy(tostring(err):find("interrupted"))
    assert.is_nil(tostring(err):find("closed first"))
    assert.equal(0, tr:step_count())
  end)

  it("refuses an empty list", function()
    assert.has_error(function() accumulate.step(new_trainer(8), {}) end,
      "m3.accumulate.step: expected a list of micro-batches (keys 1 to k, no hole), got {}; nothing was run")
  end)

  it("refuses a missing trainer and options that are not a table", function()
    local parts = accumulate.split(big, 2)
    assert.has_error(function() accumulate.step(nil, parts) end,
      "m3.accumulate.step: expected a trainer (m3.trainer), got nil")
    local tr = new_trainer(4)
    assert.has_error(function() accumulate.step(tr, parts, "x") end,
      'm3.accumulate.step: expected an options table, got "x"')
    assert.equal(0, tr:step_count())
  end)

  it("refuses unknown options", function()
    local tr = new_trainer(8)
    assert.has_error(function() accumulate.step(tr, accumulate.split(big, 2), { clipp = 1 }) end,
      'm3.accumulate.step: unknown option "clipp" (did you mean "clip"?); valid options: clip')
    assert.equal(0, tr:step_count())
  end)
end)

describe("m3.accumulate on CUDA #gpu", function()
  it("refuses k >= 2 micro-batches on an f16 trainer before running anything; takes k = 1", function()
    if not helper.need_gpu(pending) then return end
    local big = data.parity { seed = 3, length = 12, min_length = 2 }:next(8, { pad_to = 12 })
    local tr = m3.trainer(cfg, { device = "cuda", dtype = "f16", batch = 4, seq_len = 12, seed = 1 })
    assert.matches("2 micro%-batches on an f16 trainer", helper.error_of(accumulate.step, tr, accumulate.split(big, 2)))
    assert.is_false(tr:info().pending_forward)
    assert.is_false(tr:info().window_open)
    assert.equal(0, tr:step_count())
    assert.equal(1, accumulate.step(tr, { accumulate.split(big, 2)[1] }).micro)
    assert.is_false(tr:info().window_open)
  end)
end)

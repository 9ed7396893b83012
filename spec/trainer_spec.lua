-- m3.trainer contract (API.md): weights that are not finite, a changed tr.config changing
-- nothing, split = fused bit for bit, accumulation, interlocks, input errors (pointers
-- refused), non-finite steps, learning rate, closed handles, carried state and resets, states
-- round trip, short windows, evaluate, checkpoints, graphs.
-- CPU unless tagged #gpu.

local m3 = require "m3"
local helper = require "spec.helper"

local CPU = { device = "cpu" }

local function opts(over)
  local t = { device = "cpu", batch = 3, seq_len = 7 }
  for k, v in pairs(over or {}) do t[k] = v end
  return t
end

-- Two trainers starting from the same weights.
local function pair(cfg, o)
  local w = m3.weights.init(cfg, { seed = 11 })
  return m3.trainer(w, o), m3.trainer(w, o), w
end

local function row_window(t, r, t0, n)
  return helper.window(helper.rows({ x = t }, r, 1), t0, n).x
end

-- At step 1 Adam moves every weight with a gradient by about lr (m / sqrt(v) = +-1 after the bias corrections),
-- also for betas within float32's rounding of 1: 1 - beta formed in float32 was 0 for beta2 = 1 - 1e-9 (steps
-- of size lr / eps) and for beta1 = 1 - 1e-9 (no step at all).
local function first_adam_steps_by_lr(device)
  local cfg = helper.tokens_lm()
  local batch = helper.batch(cfg, 3, 7, helper.rng(9))
  for _, betas in ipairs { { 0.9, 0.999 }, { 0.9, 1 - 1e-9 }, { 1 - 1e-9, 0.999 } } do
    local tr = m3.trainer(m3.weights.init(cfg, { seed = 11 }), opts({ device = device, betas = betas,
      weight_decay = 0 }))
    local w0 = tr:snapshot()
    tr:step(batch)
    local w1, most = tr:snapshot(), 0
    for _, name in ipairs(w0:names()) do
      local p0, p1 = w0:get(name), w1:get(name)
      for i = 0, p0:numel() - 1 do most = math.max(most, math.abs(p1[i] - p0[i])) end
    end
    assert.near(1e-3, most, 1e-5, string.format("%s, betas %.10g, %.10g", device, betas[1], betas[2]))
  end
end

local KINDS = { features_none = helper.features_none, tokens_lm = helper.tokens_lm, identity_mse = helper.identity_mse }

describe("m3.trainer", function()
  after_each(helper.cleanup)

  describe("construction", function()
    it("builds from weights or from a config with a seed", function()
      local cfg = helper.tokens_lm()
      local tr = m3.trainer(cfg, opts({ seed = 5 }))
      assert.is_true(helper.same_weights(tr:snapshot(), m3.weights.init(cfg, { seed = 5 })))
      assert.equal("cpu", tr:device())
      assert.equal("f32", tr:dtype())
      assert.equal(3, tr:batch())
      assert.equal(7, tr:seq_len())
      assert.equal(0, tr:step_count())
      assert.equal(16, tr.config.d_model)
      assert.equal(m3.config(cfg).n_params, tr.config.n_params)
      local info = tr:info()
      assert.equal("cpu", info.device)
      assert.is_false(info.pending_forward)
      assert.is_nil(tr:scaler_state())
      assert.matches("m3.trainer%(cpu f32, batch 3 x seq_len 7", tostring(tr))
    end)

    -- tr.config is the user's copy: a script changing it (to describe another model, say) once made forward
    -- and evaluate size out, states() its tensors and set_states its checks from the changed table, and the
    -- engine then wrote or read past them
    it("sizes every buffer from its own config: changing tr.config changes nothing the trainer does", function()
      local tr = m3.trainer(helper.features_none(), opts({ carry_state = true }))
      local b = helper.batch(tr.config, 3, 7, helper.rng(30))
      tr.config.d_model, tr.config.d_state, tr.config.n_layers = 1, 2, 1
      assert.matches("d_model 16, n_layers 2", tostring(tr))
      assert.same({ 3, 7, 16 }, tr:forward(b):shape())
      tr:backward_step(b)
      local _, out = tr:evaluate(b)
      assert.same({ 3, 7, 16 }, out:shape())
      for _ = 1, 20 do
        local s = tr:states()
        assert.equal(2, #s)
        assert.same({ 3, 4, 8, 8 }, s[1].ssm:shape())
        tr:set_states(s)
      end
      local small = tr:states()
      small[1].ssm = m3.tensor({ 3, 4, 8, 2 })
      assert.matches("states%[1%].ssm: expected f32 %[3, 4, 8, 8%], got f32 %[3, 4, 8, 2%]",
        helper.error_of(tr.set_states, tr, small))
      assert.equal(m3.config(helper.features_none()).n_params, tr:snapshot():numel())
    end)

    it("rejects unknown and malformed options", function()
      local cfg = helper.features_none()
      local err = helper.error_of(function() local _ = m3.trainer(cfg, { bach = 2 }) end)
      assert.matches('unknown option "bach" %(did you mean "batch"%?%)', err)
      assert.matches("trainer_spec.lua:%d+:", err)
      assert.matches('device = "gpu"', helper.error_of(m3.trainer, cfg, { device = "gpu" }))
      assert.matches('device = "cuda:4294967297": the index must be below 2%^31',
        helper.error_of(m3.trainer, cfg, { device = "cuda:4294967297" }))
      assert.matches('dtype = "fp32"', helper.error_of(m3.trainer, cfg, { dtype = "fp32" }))
      assert.matches("batch = 0", helper.error_of(m3.trainer, cfg, { device = "cpu", batch = 0 }))
      assert.matches("betas", helper.error_of(m3.trainer, cfg, { device = "cpu", betas = { 0.9 } }))
      assert.matches("m3: lr = %-1", helper.error_of(m3.trainer, cfg, { device = "cpu", lr = -1 }))
      -- the update computes in float32: values that would reach it as inf or 0 are refused
      assert.matches("lr = 1e%+39: lr / %(1 %- beta1%) = 1e%+40 must be at most 3.40282e%+38 %(float32%)",
        helper.error_of(m3.trainer, cfg, { device = "cpu", lr = 1e39 }))
      assert.matches("lr = 3e%+38: lr / %(1 %- beta1%) = 3e%+39", helper.error_of(m3.trainer, cfg, { device = "cpu", lr = 3e38 }))
      assert.matches("weight_decay = 1e%+39 with lr = 0.001: their product must be at most",
        helper.error_of(m3.trainer, cfg, { device = "cpu", weight_decay = 1e39 }))
      assert.matches("weight_decay = 1e%+36 with lr = 1000",
        helper.error_of(m3.trainer, cfg, { device = "cpu", lr = 1e3, weight_decay = 1e36 }))
      assert.matches("eps = 1e%-50: must be at least 1.4013e%-45 %(float32%)",
        helper.error_of(m3.trainer, cfg, { device = "cpu", eps = 1e-50 }))
      -- a table option is shown by its items, not by its address
      assert.matches("betas = {0.9}: expected a table of two numbers", helper.error_of(m3.trainer, cfg, { betas = { 0.9 } }),
        1, true)
      assert.matches('betas = {0.9, "x"}: expected', helper.error_of(m3.trainer, cfg, { betas = { 0.9, "x" } }), 1, true)
      assert.matches("carry_state = 1", helper.error_of(m3.trainer, cfg, { carry_state = 1 }))
      assert.matches("expected weights", helper.error_of(m3.trainer, "rl"))
    end)

    it("refuses weights holding a NaN or an infinity, naming the tensor, the element and the value", function()
      local cfg = helper.tokens_lm()
      local good = m3.weights.init(cfg, { seed = 1 })
      local bad = good:clone()
      local D = bad:get("layers.0.mixer.D")
      D[3] = 0 / 0 -- a NaN whose sign bit is set on x86: still "nan"
      local err = helper.error_of(function() local _ = m3.trainer(bad, { device = "cpu" }) end)
      assert.matches("^[^\n]-trainer_spec.lua:%d+: m3: weights: layers.0.mixer.D %[3%] = nan: expected a finite value",
        err)
      D[3] = -math.huge
      assert.matches("m3: weights: layers.0.mixer.D %[3%] = %-inf: expected a finite value",
        helper.error_of(m3.trainer, bad, { device = "cpu" }))
      local tr = m3.trainer(good, { device = "cpu" })
      D[3] = math.huge
      assert.matches("trainer_spec.lua:%d+: m3: weights: layers.0.mixer.D %[3%] = inf: expected a finite value",
        helper.error_of(function() tr:load_weights(bad) end))
      assert.is_true(helper.same_weights(good, tr:snapshot())) -- the refused weights left nothing behind
      D[3] = 0.5
      tr:load_weights(bad)
      assert.is_true(helper.same_weights(bad, tr:snapshot()))
    end)
  end)

  describe("split API", function()
    for kind, make in pairs(KINDS) do
      it("forward + backward_step equals step bit for bit over 3 steps (" .. kind .. ")", function()
        local fused, split = pair(make(), opts({ carry_state = true }))
        local rng = helper.rng(1)
        for _ = 1, 3 do
          local b = helper.batch(fused.config, 3, 7, rng)
          local mf = fused:step(b)
          local out = split:forward(b)
          assert.same({ 3, 7, 16 }, out:shape())
          local ms = split:backward_step(b)
          assert.equal(mf.loss, ms.loss)
          assert.equal(mf.step, ms.step)
          assert.is_true(ms.optimizer_stepped)
        end
        assert.is_true(helper.same_weights(fused:snapshot(), split:snapshot()))
        assert.is_true(helper.same_states(fused:states(), split:states()))
        assert.equal(3, split:step_count())
      end)
    end

    it("takes a bare d_out tensor in backward_step", function()
      local fused, split = pair(helper.features_none(), opts())
      local b = helper.batch(fused.config, 3, 7, helper.rng(2))
      fused:step(b)
      split:forward(b)
      split:backward_step(b.d_out)
      assert.is_true(helper.same_weights(fused:snapshot(), split:snapshot()))
    end)
  end)

  describe("accumulation", function()
    for kind, make in pairs(KINDS) do
      it("k = 2 micro-batches equal one step on the whole batch (" .. kind .. ")", function()
        local whole, acc = pair(make(), opts({ batch = 4 }))
        local b = helper.batch(whole.config, 4, 6, helper.rng(3))
        whole:step(b)
        -- "none" has a summed loss: the halves add up without scaling
        local scale = kind == "features_none" and 1 or 0.5
        local b1, b2 = helper.rows(b, 0, 2), helper.rows(b, 2, 2)
        acc:forward(b1)
        local m1 = acc:backward_step(b1, { accumulate = true, scale = scale })
        assert.is_false(m1.optimizer_stepped)
        assert.equal(0, m1.step)
        assert.is_true(acc:info().window_open)
        acc:forward(b2)
        local m2 = acc:backward_step(b2, { scale = scale })
        assert.is_true(m2.optimizer_stepped)
        assert.equal(1, acc:step_count())
        local err, name = helper.weights_rel(acc:snapshot(), whole:snapshot())
        assert.is_true(err <= 1e-5, string.format("weights: rel %g at %s", err, tostring(name)))
        err, name = helper.weights_rel(acc:grads(), whole:grads())
        assert.is_true(err <= 1e-5, string.format("grads: rel %g at %s", err, tostring(name)))
      end)
    end
  end)

  describe("interlocks", function()
    local tr, b
    before_each(function()
      tr = m3.trainer(helper.features_none(), opts())
      b = helper.batch(tr.config, 3, 7, helper.rng(4))
    end)

    it("backward_step needs a pending forward, once per forward", function()
      assert.matches("no pending forward", helper.error_of(tr.backward_step, tr, b))
      tr:forward(b)
      assert.is_true(tr:info().pending_forward)
      tr:backward_step(b)
      assert.matches("no pending forward", helper.error_of(tr.backward_step, tr, b))
      assert.equal(1, tr:step_count())
    end)

    -- the pending forward's window is for its own backward: once that is done, a d_out of another shape gets the
    -- engine's "no pending forward", not a shape error from a window that is gone
    it("a finished forward leaves no window: a d_out of another shape then has no pending forward", function()
      tr:forward(b)
      tr:backward_step(b)
      local small = helper.batch(tr.config, 1, 2, helper.rng(5))
      assert.matches("no pending forward", helper.error_of(tr.backward_step, tr, small.d_out))
    end)

    it("refuses clip with accumulate", function()
      tr:forward(b)
      assert.matches("clip", helper.error_of(tr.backward_step, tr, b, { clip = 1, accumulate = true }))
      local m = tr:backward_step(b, { clip = 1 })
      assert.is_number(m.grad_norm)
      assert.matches("unknown option", helper.error_of(tr.backward_step, tr, b, { acumulate = true }))
    end)

    it("refuses a negative or NaN clip, and the forward stays pending", function()
      tr:forward(b)
      assert.matches("clip = %-5: expected a number >= 0", helper.error_of(tr.backward_step, tr, b, { clip = -5 }))
      assert.matches("clip = nan", helper.error_of(tr.backward_step, tr, b, { clip = 0 / 0 }))
      assert.is_true(tr:info().pending_forward)
      assert.is_number(tr:backward_step(b, { clip = 0.5 }).grad_norm)
    end)

    it("refuses step while a window is open, until it is closed", function()
      tr:forward(b)
      tr:backward_step(b, { accumulate = true })
      assert.matches("window is open", helper.error_of(tr.step, tr, b))
      tr:forward(b)
      tr:backward_step(b)
      assert.equal(1, tr:step_count())
      tr:step(b)
      assert.equal(2, tr:step_count())
    end)

    it("a second forward replaces the pending one; a carried state moves on from where the first left it", function()
      local o = opts({ carry_state = true })
      local a, twin = m3.trainer(helper.features_none(), o), m3.trainer(helper.features_none(), o)
      local c = helper.batch(a.config, 3, 7, helper.rng(41))
      a:forward(b)
      twin:set_states(a:states())
      a:forward(c)
      twin:forward(c)
      assert.equal(twin:backward_step(c).loss, a:backward_step(c).loss)
      assert.is_true(helper.same_weights(twin:snapshot(), a:snapshot()))
      assert.is_true(helper.same_states(twin:states(), a:states()))
    end)

    it("refuses evaluate while a forward is pending", function()
      tr:forward(b)
      assert.matches("forward is pending", helper.error_of(tr.evaluate, tr, b))
      tr:backward_step(b)
      tr:evaluate(b)
    end)

    it("names the pending forward's shape for a d_out of another shape", function()
      tr:forward(b)
      assert.matches("batch.d_out: expected f32 %[3, 7, 16%], got f32 %[1, 1, 1%]",
        helper.error_of(tr.backward_step, tr, { d_out = { { { 1 } } } }))
      assert.matches("batch.d_out: expected f32 %[3, 7, 16%], got f32 %[1, 7, 16%]",
        helper.error_of(tr.backward_step, tr, m3.tensor({ 1, 7, 16 })))
      assert.is_true(tr:info().pending_forward)
      tr:backward_step(b)
      assert.equal(1, tr:step_count())
    end)

    -- the engine scales in float32: a scale that is 0 or a subnormal there adds nothing, a negative one ascends
    it("refuses a scale that is not a finite number > 0 float32 holds as a normal number", function()
      tr:forward(b)
      for _, scale in ipairs { -1, 0, 1e-300, 2 ^ -127, 0 / 0, math.huge, 1e39, "1" } do
        local shown = type(scale) == "string" and '"1"' or tostring(scale):gsub("[%-%+%.]", "%%%0")
        assert.matches("backward_step: scale = " .. shown .. ": expected a finite number > 0 that float32 holds as a "
          .. "normal number %(2%^%-126 to about 3.4e38%)", helper.error_of(tr.backward_step, tr, b, { scale = scale }))
      end
      assert.is_true(tr:info().pending_forward)
      tr:backward_step(b, { scale = 2 ^ -126, accumulate = true })
      tr:forward(b)
      tr:backward_step(b)
      assert.equal(1, tr:step_count())
    end)

    it("raises at the caller's line", function()
      local err = helper.error_of(function() tr:backward_step(b) end)
      assert.matches("^[^\n]-trainer_spec.lua:%d+: m3: backward_step: no pending forward", err)
    end)
  end)

  describe("bad input", function()
    local tr, b
    before_each(function()
      tr = m3.trainer(helper.tokens_lm(), opts({ batch = 2, seq_len = 8 }))
      b = helper.batch(tr.config, 2, 8, helper.rng(5))
    end)

    local function with(field, value)
      local t = {}
      for k, v in pairs(b) do t[k] = v end
      t[field] = value
      return t
    end

    it("refuses a NULL pointer or another non-table as an options table, naming the call", function()
      -- a NULL pointer compares equal to nil, so it passed the "opts ~= nil and not a table" checks and failed
      -- inside pairs: "'float' has no '__pairs' metamethod"
      local null = require("ffi").new("float *")
      local w = m3.weights.init(tr.config)
      assert.matches("m3%.trainer: opts must be a table, got cdata", helper.error_of(m3.trainer, w, null))
      assert.matches("m3%.weights%.init: opts must be a table, got cdata", helper.error_of(m3.weights.init, tr.config,
        null))
      assert.matches("m3%.trainer%.load: opts must be a table, got cdata", helper.error_of(m3.trainer.load, "x", null))
      assert.matches("m3%.infer: opts must be a table, got cdata", helper.error_of(m3.infer, w, null))
      assert.matches("m3%.preset: overrides must be a table, got cdata", helper.error_of(m3.preset, "rl", null))
      assert.matches("m3%.save_tensors: metadata must be a table", helper.error_of(m3.save_tensors, helper.tmpname(),
        { a = m3.tensor({ 1 }) }, null))
      tr:forward(b)
      assert.matches("backward_step: opts must be a table, got cdata", helper.error_of(tr.backward_step, tr, b, null))
      assert.matches("m3%.data%.text: expected an options table, got true", helper.error_of(m3.data.text, "x", true))
      assert.matches("m3%.data: sample: expected an options table, got true",
        helper.error_of(m3.data.parity {}.sample, m3.data.parity {}, 0, true))
      assert.is_number(tr:backward_step(b).loss)
    end)

    it("names the field and what was expected, and the trainer still works", function()
      local cases = {
        { with("tokens", m3.tensor({ 2, 8 })), "batch.tokens: expected int32 %[2, 8%], got f32 %[2, 8%]" },
        { with("tokens", m3.tensor({ 2, 9 }, "i32")), "batch.tokens: expected int32 %[B, T%] with B <= 2 and T <= 8, got int32 %[2, 9%]" },
        { with("tokens", m3.tensor({ 3, 8 }, "i32")), "batch.tokens: .*B <= 2" },
        { with("targets", m3.tensor({ 2, 7 }, "i32")), "batch.targets: expected int32 %[2, 8%], got int32 %[2, 7%]" },
        { with("targets", nil), "batch.targets: missing" },
        { with("tokens", nil), "batch.tokens: missing" },
        { with("tokens", "abc"), "batch.tokens: expected int32 %[B, T%], got a string" },
        { with("tokens", { { 1, 1.5 } }), "batch.tokens: element %[1%]%[2%] = 1.5: expected an integer" },
        { with("targets", { { 1, "a" } }), "batch.targets: element %[1%]%[2%] is a string, expected a number" },
        { with("resets", m3.tensor({ 2, 8 }, "i32")), "batch.resets: expected uint8 %[2, 8%], got int32 %[2, 8%]" },
        { with("input", m3.tensor({ 2, 8, 16 })), "batch.input: not used by this model" },
        { with("tagrets", b.targets), 'batch.tagrets: unknown field %(did you mean "targets"%?%)' },
        { with("mask", m3.tensor({ 2, 8 }, "u8")), "batch.mask: not used by this model" },
      }
      for _, case in ipairs(cases) do
        local err = helper.error_of(function() tr:step(case[1]) end)
        assert.matches(case[2], err)
        assert.matches("trainer_spec.lua:%d+:", err)
      end
      assert.matches("batch: expected a table", helper.error_of(tr.step, tr, 42))
      assert.equal(0, tr:step_count())
      tr:step(b)
      assert.equal(1, tr:step_count())
    end)

    it("reports out-of-range token ids and targets with index and value", function()
      local bad = b.tokens:clone()
      bad[9] = 13
      assert.matches("batch.tokens%[9%] %(row 1, position 1%) = 13", helper.error_of(tr.step, tr, with("tokens", bad)))
      local neg = b.targets:clone()
      neg[0] = -2
      assert.matches("batch.targets%[0%]", helper.error_of(tr.step, tr, with("targets", neg)))
      tr:step(b)
      assert.equal(1, tr:step_count())
    end)

    it("accepts nested tables, {data=, shape=} tables, raw FFI arrays and f64 floats", function()
      local ffi = require "ffi"
      local ref = m3.trainer(helper.tokens_lm(), opts({ batch = 2, seq_len = 8, seed = 1 }))
      local alt = m3.trainer(helper.tokens_lm(), opts({ batch = 2, seq_len = 8, seed = 1 }))
      local raw = ffi.new("int32_t[?]", 16)
      ffi.copy(raw, b.targets.data, 64)
      local plain = ffi.new("int32_t[16]")
      ffi.copy(plain, b.tokens.data, 64)
      local m1 = ref:step(b)
      local m2 = alt:step({ tokens = { data = plain, shape = { 2, 8 } }, targets = raw })
      assert.equal(m1.loss, m2.loss)
      local m3_ = alt:evaluate({ tokens = b.tokens:to_table(), targets = b.targets:to_table() })
      assert.equal(alt:evaluate(b).loss, m3_.loss)
      assert.matches("batch.targets: expected int32 %[2, 8%] %(16 values%)",
        helper.error_of(alt.step, alt, { tokens = b.tokens, targets = ffi.new("int32_t[?]", 15) }))

      local f = m3.trainer(helper.features_none(), opts({ seed = 2 }))
      local g = m3.trainer(helper.features_none(), opts({ seed = 2 }))
      local fb = helper.batch(f.config, 3, 7, helper.rng(6))
      local f64 = { input = m3.tensor.from(fb.input, "f64"), d_out = m3.tensor.from(fb.d_out, "f64") }
      f:step(fb)
      g:step(f64)
      assert.is_true(helper.same_weights(f:snapshot(), g:snapshot()))
    end)
  end)

  -- a pointer's memory may hold fewer values than the shape says: the engine read past it (or crashed)
  it("refuses pointers, whose size the FFI cannot tell, in batches and set_states, running nothing", function()
    local ffi = require "ffi"
    local tr = m3.trainer(helper.tokens_lm(), opts({ batch = 2, seq_len = 8, carry_state = true }))
    local b = helper.batch(tr.config, 2, 8, helper.rng(31))
    local arr = ffi.new("int32_t[16]")
    ffi.copy(arr, b.tokens.data, 64)
    local ptr = ffi.cast("int32_t *", arr)
    local as_data = { tokens = { data = ptr, shape = { 2, 8 } }, targets = b.targets }
    local bare = { tokens = b.tokens, targets = ptr }
    local data_msg = "batch.tokens: data is a pointer %(ctype<int %*>%), whose size the FFI cannot tell: pass an FFI "
      .. "array %(ffi.new%(\"int32_t%[%?%]\", n%)%) or an m3.tensor" -- the field's element type
    local bare_msg = "batch.targets: got a pointer %(ctype<int %*>%), whose size the FFI cannot tell"
    for _, call in ipairs { tr.step, tr.evaluate, tr.check_batch } do
      assert.matches(data_msg, helper.error_of(call, tr, as_data))
      assert.matches(bare_msg, helper.error_of(call, tr, bare))
    end
    assert.matches(data_msg, helper.error_of(tr.forward, tr, { tokens = as_data.tokens }))
    tr:forward(b)
    assert.matches(bare_msg, helper.error_of(tr.backward_step, tr, { targets = ptr }))
    assert.is_true(tr:info().pending_forward)
    tr:backward_step(b)
    local s = tr:states()
    local kept = tr:states()
    s[2].ssm = { data = ffi.cast("float *", s[2].ssm.data), shape = s[2].ssm:shape() }
    assert.matches("set_states: states%[2%].ssm: data is a pointer %(ctype<float %*>%)",
      helper.error_of(tr.set_states, tr, s))
    s[2].ssm = ffi.cast("float *", kept[2].ssm.data)
    assert.matches("set_states: states%[2%].ssm: got a pointer", helper.error_of(tr.set_states, tr, s))
    assert.is_true(helper.same_states(kept, tr:states()))
    assert.equal(1, tr:step_count())
  end)

  it("names the field of an f64 value that float32 cannot hold", function()
    local tr = m3.trainer(helper.identity_mse(), opts({ batch = 2, seq_len = 4, carry_state = true }))
    local b = helper.batch(tr.config, 2, 4, helper.rng(32))
    local big = m3.tensor.from(b.targets, "f64")
    big[5] = 1e300
    assert.matches("^[^\n]-trainer_spec.lua:%d+: batch.targets: converting to f32: element 5 = 1e%+300 is outside "
      .. "float32's range", helper.error_of(function() tr:step({ input = b.input, targets = big }) end))
    local s = tr:states()
    s[2].ssm = m3.tensor.from(s[2].ssm, "f64")
    s[2].ssm[0] = -1e300
    assert.matches("set_states: states%[2%].ssm: converting to f32: element 0 = %-1e%+300 is outside float32's range",
      helper.error_of(tr.set_states, tr, s))
    assert.equal(0, tr:step_count())
  end)

  it("raises on a non-finite step and leaves weights and step count unchanged", function()
    local tr = m3.trainer(helper.features_none(), opts())
    local b = helper.batch(tr.config, 3, 7, helper.rng(7))
    tr:step(b)
    local before = tr:snapshot()
    local bad = { input = b.input:clone(), d_out = b.d_out }
    bad.input[4] = 0 / 0
    assert.matches("non%-finite", helper.error_of(tr.step, tr, bad))
    assert.is_true(helper.same_weights(before, tr:snapshot()))
    assert.equal(1, tr:step_count())
    tr:step(b)
    assert.equal(2, tr:step_count())
  end)

  -- two trainers of one model that carry their state: one takes a refused update, the other shows where it should be
  local function carrying_twins()
    return m3.trainer(helper.features_none(), opts({ carry_state = true })),
      m3.trainer(helper.features_none(), opts({ carry_state = true }))
  end

  it("puts the carried state back after a non-finite step, so the next clean step trains", function()
    local tr, twin = carrying_twins()
    local rng = helper.rng(8)
    local b, c = helper.batch(tr.config, 3, 7, rng), helper.batch(tr.config, 2, 7, rng)
    tr:step(b)
    twin:step(b)
    local bad = { input = c.input:clone(), d_out = c.d_out }
    bad.input[4] = 0 / 0
    assert.matches("Adam moments, the carried state and the step count are unchanged",
      helper.error_of(tr.step, tr, bad))
    assert.is_true(helper.same_states(twin:states(), tr:states()))
    local m = tr:step(c) -- as if the bad window had never come
    assert.equal(m.loss, twin:step(c).loss)
    assert.is_true(helper.same_states(twin:states(), tr:states()))
    assert.is_true(helper.same_weights(twin:snapshot(), tr:snapshot()))
    -- the split calls alike, for a window of one forward
    tr:forward(bad)
    assert.matches("Adam moments, the carried state and the step count are unchanged",
      helper.error_of(tr.backward_step, tr, bad))
    assert.is_true(helper.same_states(twin:states(), tr:states()))
    tr:forward(c)
    tr:backward_step(c)
    twin:step(c)
    assert.is_true(helper.same_states(twin:states(), tr:states()))
    assert.is_true(helper.same_weights(twin:snapshot(), tr:snapshot()))
  end)

  it("keeps a reset or set_state made after the forward when a refused backward_step puts the state back", function()
    local tr, twin = carrying_twins()
    local b = helper.batch(tr.config, 3, 7, helper.rng(31))
    tr:step(b)
    twin:step(b)
    local bad = { input = b.input:clone(), d_out = b.d_out }
    bad.input[4] = 0 / 0
    tr:forward(bad)
    tr:reset_state({ 1 }) -- row 1's episode ended: the rewind must not bring its state back
    assert.matches("Adam moments, the carried state and the step count are unchanged",
      helper.error_of(tr.backward_step, tr, bad))
    twin:reset_state({ 1 })
    assert.is_true(helper.same_states(twin:states(), tr:states()))
    tr:step(b)
    local chosen = twin:states()
    tr:forward(bad)
    tr:set_states(chosen)
    assert.matches("the step count are unchanged; the carried state stays where set_state put it after the forward",
      helper.error_of(tr.backward_step, tr, bad))
    assert.is_true(helper.same_states(chosen, tr:states()))
    tr:forward(bad) -- a new forward forgets what was done after the last one
    assert.matches("Adam moments, the carried state and the step count are unchanged",
      helper.error_of(tr.backward_step, tr, bad))
    assert.is_true(helper.same_states(chosen, tr:states()))
    tr:forward(bad)
    tr:reset_state() -- every row, after the forward
    assert.matches("Adam moments, the carried state and the step count are unchanged",
      helper.error_of(tr.backward_step, tr, bad))
    twin:reset_state()
    assert.is_true(helper.same_states(twin:states(), tr:states()))
  end)

  -- what reset_state or set_states did after a split forward is for that forward's backward_step alone: a later
  -- refused update (a fused step, or the backward_step of a new forward) puts the state back where its own forward
  -- began, neither keeping it as set nor resetting those rows again
  it("forgets a reset or set_state made after an earlier forward when a later refused update puts the state back",
    function()
      local tr, twin = carrying_twins()
      local b = helper.batch(tr.config, 3, 7, helper.rng(32))
      local bad = { input = b.input:clone(), d_out = b.d_out }
      bad.input[4] = 0 / 0
      for _, t in ipairs { tr, twin } do
        t:step(b)
        t:forward(b)
        t:reset_state({ 1 })
        t:set_states(t:states())
        t:backward_step(b)
        t:step(b) -- row 1 carries a state again
      end
      assert.matches("Adam moments, the carried state and the step count are unchanged",
        helper.error_of(tr.step, tr, bad))
      assert.is_true(helper.same_states(twin:states(), tr:states()))
      for _, t in ipairs { tr, twin } do
        t:forward(b)
        t:reset_state({ 1 })
        t:backward_step(b)
        t:step(b)
      end
      tr:forward(bad)
      assert.matches("Adam moments, the carried state and the step count are unchanged",
        helper.error_of(tr.backward_step, tr, bad))
      assert.is_true(helper.same_states(twin:states(), tr:states()))
      assert.is_true(helper.same_weights(twin:snapshot(), tr:snapshot()))
    end)

  it("leaves the state where a longer window's last forward left it when the window's update is refused", function()
    local tr, twin = carrying_twins()
    local rng = helper.rng(33)
    local b, c = helper.batch(tr.config, 3, 7, rng), helper.batch(tr.config, 3, 7, rng)
    local bad = c.d_out:clone()
    bad[0] = 0 / 0 -- the forward's state stays finite, the gradient does not
    for _, t in ipairs { tr, twin } do
      t:forward(b)
      t:backward_step(b, { accumulate = true })
      t:forward(c)
    end
    assert.matches("weights, Adam moments and the step count are unchanged", helper.error_of(tr.backward_step, tr, bad))
    twin:backward_step(c) -- an update moves no state
    assert.is_true(helper.same_states(twin:states(), tr:states()))
    assert.equal(0, tr:step_count())
  end)

  it("raises an error starting with \"interrupted\" after m3_interrupt, applying nothing", function()
    local C = require("m3.lib").C
    local tr = m3.trainer(helper.features_none(), opts())
    local b = helper.batch(tr.config, 3, 7, helper.rng(22))
    local before = tr:snapshot()
    C.m3_interrupt()
    local ok, err = pcall(tr.step, tr, b)
    C.m3_interrupt_clear()
    assert.is_false(ok)
    assert.matches("^interrupted", err)
    assert.matches("interrupted before the step", err, 1, true) -- before the forward began, not inside it
    assert.is_true(helper.same_weights(before, tr:snapshot()))
    assert.equal(0, tr:step_count())
    tr:step(b)
    assert.equal(1, tr:step_count())
  end)

  it("sizes a raw d_out array from the pending forward's window", function()
    local ffi = require "ffi"
    local fused, split = pair(helper.features_none(), opts())
    local b = helper.batch(fused.config, 2, 4, helper.rng(23))
    fused:step(b)
    split:forward(b)
    local raw = ffi.new("float[?]", 2 * 4 * 16)
    ffi.copy(raw, b.d_out.data, ffi.sizeof(raw))
    split:backward_step(raw)
    assert.is_true(helper.same_weights(fused:snapshot(), split:snapshot()))
  end)

  it("validates set_lr and applies it", function()
    local a, b2 = pair(helper.features_none(), opts())
    local w0 = a:snapshot()
    for _, bad in ipairs({ 0, -1, 0 / 0, 1 / 0 }) do
      assert.matches("lr", helper.error_of(a.set_lr, a, bad))
    end
    assert.matches("expected a number", helper.error_of(a.set_lr, a, "x"))
    -- 0 / 0 is a NaN whose sign bit is set on x86: the messages still say "nan"
    assert.matches("set_lr: lr = nan must be a finite number > 0", helper.error_of(a.set_lr, a, 0 / 0), 1, true)
    assert.matches("set_lr: lr = 0 must be a finite number > 0", helper.error_of(a.set_lr, a, 0), 1, true)
    assert.matches("set_clip: max_norm = nan must be a finite number >= 0", helper.error_of(a.set_clip, a, 0 / 0), 1,
      true)
    assert.matches("set_lr: lr = 1e%+39: lr / %(1 %- beta1%) = 1e%+40 must be at most", helper.error_of(a.set_lr, a, 1e39))
    -- an lr that rounds to 0 in float32, where the update runs, would move nothing while the step counts
    assert.matches("set_lr: lr = 1e%-50: must be at least 1%.4013e%-45 %(float32%)", helper.error_of(a.set_lr, a, 1e-50))
    assert.equal(1e-3, a:lr())
    b2:set_lr(2e-3)
    assert.equal(2e-3, b2:lr())
    local batch = helper.batch(a.config, 3, 7, helper.rng(8))
    a:step(batch)
    b2:step(batch)
    local wa, wb = a:snapshot(), b2:snapshot()
    local da, db = 0, 0
    for _, name in ipairs(w0:names()) do
      local p0, pa, pb = w0:get(name), wa:get(name), wb:get(name)
      for i = 0, p0:numel() - 1 do
        da, db = da + (pa[i] - p0[i]) ^ 2, db + (pb[i] - p0[i]) ^ 2
      end
    end
    assert.near(2, math.sqrt(db / da), 1e-3)
  end)

  it("takes Adam's 1 - beta from the double: a beta within float32's rounding of 1 still updates", function()
    first_adam_steps_by_lr("cpu")
  end)

  -- betas = {beta1, beta2} (API.md): beta1 weighs the first moment, beta2 the second. Step 1 does not show them (the
  -- bias corrections cancel them); step 2 is recomputed in double from grads() and the snapshots, with betas far
  -- apart so that swapping them moves the weights far more than the tolerance.
  it("applies betas = {beta1, beta2} in that order (Adam's step 2 recomputed in double)", function()
    local cfg = helper.tokens_lm()
    local lr, b1, b2, eps = 1e-2, 0.5, 0.99, 1e-8
    local tr = m3.trainer(m3.weights.init(cfg, { seed = 11 }), opts({ lr = lr, betas = { b1, b2 }, eps = eps,
      weight_decay = 0, clip = 0 }))
    local M, V, worst = {}, {}, 0
    for t = 1, 2 do
      local w0 = tr:snapshot()
      assert.is_nil(tr:step(helper.batch(tr.config, 3, 7, helper.rng(40 + t))).grad_norm) -- no clipping
      local g, w1 = tr:grads(), tr:snapshot()
      for _, name in ipairs(w0:names()) do
        local p0, p1, gx = w0:get(name), w1:get(name), g:get(name)
        M[name], V[name] = M[name] or {}, V[name] or {}
        for i = 0, p0:numel() - 1 do
          M[name][i] = b1 * (M[name][i] or 0) + (1 - b1) * gx[i]
          V[name][i] = b2 * (V[name][i] or 0) + (1 - b2) * gx[i] * gx[i]
          local want = p0[i] - lr / (1 - b1 ^ t) * M[name][i] / (math.sqrt(V[name][i] / (1 - b2 ^ t)) + eps)
          worst = math.max(worst, math.abs(p1[i] - want))
        end
      end
    end
    assert.is_true(worst < 1e-4 * lr, string.format("worst difference %.3g", worst))
  end)

  it("set_clip(false) and set_clip(nil) turn clipping off, as clip = 0 does", function()
    local tr = m3.trainer(helper.features_none(), opts({ clip = 1 }))
    local b = helper.batch(tr.config, 3, 7, helper.rng(9))
    tr:set_clip(false)
    assert.equal(0, tr:info().clip)
    assert.is_nil(tr:step(b).grad_norm)
    tr:set_clip(0.5)
    assert.equal(0.5, tr:info().clip)
    tr:set_clip(nil)
    assert.equal(0, tr:info().clip)
  end)

  it("info() reports batch and seq_len apart", function()
    local tr = m3.trainer(helper.features_none(), opts({ batch = 2, seq_len = 5 }))
    local i = tr:info()
    assert.equal(2, i.batch)
    assert.equal(5, i.seq_len)
    assert.equal(2, tr:batch())
    assert.equal(5, tr:seq_len())
  end)

  -- head "none" has no loss: evaluate takes the input alone (no d_out) and returns out [B, T, d_model]
  it("evaluates a head \"none\" model from its input alone", function()
    local tr = m3.trainer(helper.features_none(), opts())
    local b = helper.batch(tr.config, 2, 5, helper.rng(30))
    local m, out = tr:evaluate({ input = b.input })
    assert.same({ 2, 5, tr.config.d_model }, out:shape())
    assert.is_nil(m.loss)
    assert.equal(10, m.tokens)
    assert.equal(0, tr:step_count())
  end)

  -- AdamW redone in double from what the trainer shows: grads() after each step (the unclipped, summed gradient),
  -- the snapshot before it. The global norm is the L2 norm over every tensor; with clip c > 0 and norm n the
  -- gradient is scaled by c / (n + 1e-6) when that is < 1; the weights of the reference no_decay group (norms,
  -- dt_bias, D: help's set_reference_no_decay) are not decayed unless no_decay is "none"; weight_decay defaults
  -- to 1e-2. Steps 1-2 unclipped (clip 100 >> the norm), 3-4 clipped, 5 with no_decay = "none", 6 unclipped by a
  -- backward_step's clip = 0 on a trainer whose clip is active.
  it("updates as AdamW recomputed in double: global norm, clipping, weight decay and its no_decay group", function()
    local cfg = helper.tokens_lm()
    local lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-6, 1e-2
    local tr = m3.trainer(m3.weights.init(cfg, { seed = 11 }), opts({ lr = lr, eps = eps, clip = 100 }))
    local function skips_decay(name)
      return name:match("norm%.weight$") or name:match("norm_f%.weight$") or name:match("%.dt_bias$")
        or name:match("%.D$")
    end
    local M, V, worst, decayed_norms = {}, {}, 0, 0
    for t = 1, 6 do
      local b = helper.batch(tr.config, 3, 7, helper.rng(20 + t))
      local clip = t <= 2 and 100 or 0.05
      if t == 3 then tr:set_clip(clip) end
      if t == 5 then tr:set_reference_no_decay(false) end
      local w0 = tr:snapshot()
      local m
      if t == 6 then
        tr:forward(b)
        m = tr:backward_step(b, { clip = 0 })
        assert.is_nil(m.grad_norm) -- clip 0 is off, not the trainer's clip
        clip = 0
      else
        m = tr:step(b)
      end
      local g, w1 = tr:grads(), tr:snapshot()
      local sq = 0
      for _, name in ipairs(g:names()) do
        local x = g:get(name)
        for i = 0, x:numel() - 1 do sq = sq + x[i] * x[i] end
      end
      local norm = math.sqrt(sq)
      if t < 6 then
        assert.is_true(math.abs(m.grad_norm - norm) <= 1e-9 * norm, string.format("step %d: grad_norm %.17g, "
          .. "the norm of grads() %.17g", t, m.grad_norm, norm))
      end
      local cs = 1
      if clip > 0 and clip / (norm + 1e-6) < 1 then cs = clip / (norm + 1e-6) end
      if t <= 2 then assert.equal(1, cs) elseif t <= 5 then assert.is_true(cs < 0.5, "step " .. t .. " clipped") end
      local bc1, bc2 = 1 - b1 ^ t, 1 - b2 ^ t
      for _, name in ipairs(w0:names()) do
        local p0, p1, gx = w0:get(name), w1:get(name), g:get(name)
        local decay = (t < 5 and skips_decay(name)) and 0 or wd
        M[name], V[name] = M[name] or {}, V[name] or {}
        local Mn, Vn = M[name], V[name]
        for i = 0, p0:numel() - 1 do
          local gi = gx[i] * cs
          Mn[i] = b1 * (Mn[i] or 0) + (1 - b1) * gi
          Vn[i] = b2 * (Vn[i] or 0) + (1 - b2) * gi * gi
          local want = p0[i] * (1 - lr * decay) - lr / bc1 * Mn[i] / (math.sqrt(Vn[i]) / math.sqrt(bc2) + eps)
          worst = math.max(worst, math.abs(p1[i] - want) / math.max(1, math.abs(p0[i])))
          if t == 5 and skips_decay(name) then decayed_norms = decayed_norms + 1 end
        end
      end
      assert.is_true(worst < 1e-4 * lr, string.format("step %d: worst difference %.3g", t, worst))
    end
    assert.is_true(decayed_norms > 0)
  end)

  -- with d_model = 64 the arena ends on norm_f.weight's last entry (no alignment padding after it): the global norm
  -- counts every entry up to the last
  it("reports the norm of the whole gradient, the arena's last entry included", function()
    local tr = m3.trainer(helper.features_none({ d_model = 64 }), opts({ clip = 1 }))
    local m = tr:step(helper.batch(tr.config, 3, 7, helper.rng(9)))
    local g = tr:grads()
    local names, sq = g:names(), 0
    for _, name in ipairs(names) do
      local x = g:get(name)
      for i = 0, x:numel() - 1 do sq = sq + x[i] * x[i] end
    end
    local last = g:get("norm_f.weight")
    assert.equal(64, last:numel())
    assert.is_true(last[63] ~= 0)
    assert.is_true(math.abs(m.grad_norm - math.sqrt(sq)) <= 1e-12 * m.grad_norm,
      string.format("grad_norm %.17g, the norm of grads() %.17g", m.grad_norm, math.sqrt(sq)))
  end)

  it("reports the grad norm when clipping", function()
    local tr = m3.trainer(helper.features_none(), opts({ clip = 1 }))
    local b = helper.batch(tr.config, 3, 7, helper.rng(9))
    assert.is_number(tr:step(b).grad_norm)
    tr:set_clip(nil)
    assert.is_nil(tr:step(b).grad_norm)
    tr:set_clip(0.5)
    assert.is_number(tr:step(b).grad_norm)
    assert.matches("max_norm", helper.error_of(tr.set_clip, tr, -1))
  end)

  it("closes idempotently and refuses later calls", function()
    local tr = m3.trainer(helper.features_none(), opts())
    local b = helper.batch(tr.config, 3, 7, helper.rng(10))
    tr:close()
    tr:close()
    assert.equal("m3.trainer (closed)", tostring(tr))
    local calls = {
      "step", "forward", "backward_step", "evaluate", "capture_graph", "drop_graph", "has_graph", "lr",
      "reset_state", "states", "snapshot", "grads", "device", "dtype", "batch", "seq_len", "step_count",
      "info", "scaler_state", "set_profiling", "profile",
    }
    for _, name in ipairs(calls) do
      assert.matches("trainer is closed", helper.error_of(tr[name], tr, b), name)
    end
    assert.matches("trainer is closed", helper.error_of(tr.set_lr, tr, 1e-3))
    assert.matches("trainer is closed", helper.error_of(tr.save, tr, helper.tmpname()))
    assert.matches("trainer is closed", helper.error_of(tr.load_weights, tr, m3.weights.create(tr.config)))
    assert.equal(16, tr.config.d_model)
    -- a method called with '.' on something else (close raised "attempt to index local 'box'")
    for _, name in ipairs { "close", "step", "set_lr" } do
      assert.matches("^[^:]*trainer_spec%.lua:%d+: m3%.trainer: expected a trainer %(call methods with ':'%), "
          .. "got {}$",
        helper.error_of(function() tr[name]({}, b) end), name)
    end
  end)

  it("refuses a call whose batch or options close the trainer while they are read, instead of using it freed",
    function()
    local cfg = helper.features_none()
    local b = helper.batch(m3.config(cfg), 3, 7, helper.rng(10))
    local closing = helper.closing
    local calls = {
      step = function(tr) return tr:step(closing(tr, b)) end,
      forward = function(tr) return tr:forward(closing(tr, b)) end,
      evaluate = function(tr) return tr:evaluate(closing(tr, b)) end,
      check_batch = function(tr) return tr:check_batch(closing(tr, b)) end,
      backward_step = function(tr)
        tr:forward(b)
        return tr:backward_step(closing(tr, b))
      end,
      backward_step_opts = function(tr)
        tr:forward(b)
        return tr:backward_step(b, closing(tr, {}))
      end,
      set_states = function(tr)
        local s = tr:states()
        s[1] = closing(tr, s[1])
        return tr:set_states(s)
      end,
    }
    for name, call in pairs(calls) do
      local tr = m3.trainer(cfg, opts())
      assert.matches("trainer is closed", helper.error_of(call, tr), name)
      assert.equal("m3.trainer (closed)", tostring(tr), name)
    end
  end)

  describe("recurrent state", function()
    local cfg = helper.features_none()

    it("two windows with carry_state equal one long window", function()
      local long, short = pair(cfg, opts({ batch = 2, seq_len = 8, carry_state = true }))
      local b = helper.batch(long.config, 2, 8, helper.rng(12))
      local out = long:forward(b)
      local o1 = short:forward(helper.window(b, 0, 3))
      local o2 = short:forward(helper.window(b, 3, 5))
      assert.is_true(helper.rel_l2(o1, helper.window({ x = out }, 0, 3).x) <= 1e-5)
      assert.is_true(helper.rel_l2(o2, helper.window({ x = out }, 3, 5).x) <= 1e-5)
      local sl, ss = long:states(), short:states()
      for l = 1, #sl do
        for _, k in ipairs({ "angle", "ssm", "k", "v" }) do
          assert.is_true(helper.rel_l2(ss[l][k], sl[l][k]) <= 1e-5, l .. "." .. k)
        end
      end
    end)

    it("without carry_state every window starts from zero", function()
      local tr = m3.trainer(cfg, opts({ batch = 2, seq_len = 8 }))
      local b = helper.batch(tr.config, 2, 8, helper.rng(13))
      local o1 = tr:forward(b)
      local o2 = tr:forward(b)
      assert.equal(helper.bytes(o1), helper.bytes(o2))
    end)

    it("a reset at t makes that row a fresh start from t", function()
      local tr, fresh = pair(cfg, opts({ batch = 2, seq_len = 8, carry_state = true }))
      local rng = helper.rng(14)
      tr:forward(helper.batch(tr.config, 2, 8, rng)) -- nonzero incoming state
      local b = helper.batch(tr.config, 2, 8, rng, { resets = { { 1, 3 } } })
      local out = tr:forward(b)
      local tail = helper.window(b, 3, 5)
      tail.resets = nil
      local ref = fresh:forward(tail)
      assert.is_true(helper.rel_l2(row_window(out, 1, 3, 5), row_window(ref, 1, 0, 5)) <= 1e-5)
      assert.is_true(helper.rel_l2(row_window(out, 0, 3, 5), row_window(ref, 0, 0, 5)) > 1e-3)
    end)

    it("reset_state zeroes all rows or the rows given", function()
      local tr = m3.trainer(cfg, opts({ batch = 2, seq_len = 8, carry_state = true }))
      tr:forward(helper.batch(tr.config, 2, 8, helper.rng(15)))
      local s1 = tr:states()
      tr:reset_state({ 1 })
      local s2 = tr:states()
      for l = 1, #s1 do
        for _, k in ipairs({ "angle", "ssm", "k", "v" }) do
          local r0a, r0b = helper.rows({ x = s1[l][k] }, 0, 1).x, helper.rows({ x = s2[l][k] }, 0, 1).x
          assert.equal(helper.bytes(r0a), helper.bytes(r0b))
          local r1 = helper.rows({ x = s2[l][k] }, 1, 1).x
          for i = 0, r1:numel() - 1 do assert.equal(0, r1[i]) end
        end
      end
      assert.is_true(helper.rel_l2(s1[1].ssm, s2[1].ssm) > 0)
      tr:reset_state()
      for _, s in ipairs(tr:states()) do
        for _, k in ipairs({ "angle", "ssm", "k", "v" }) do
          for i = 0, s[k]:numel() - 1 do assert.equal(0, s[k][i]) end
        end
      end
      assert.matches("row 2 out of range", helper.error_of(tr.reset_state, tr, { 2 }))
      assert.matches("rows%[1%] = 0.5", helper.error_of(tr.reset_state, tr, { 0.5 }))
      assert.matches("rows must be a list of 0%-based row indices, got a table with key \"a\"",
        helper.error_of(tr.reset_state, tr, { a = 1 }))
    end)

    it("states / set_states round-trip and check shapes", function()
      local tr = m3.trainer(cfg, opts({ batch = 2, seq_len = 8, carry_state = true }))
      local rng = helper.rng(16)
      local s = tr:states()
      assert.equal(2, #s)
      assert.same({ 2, 4, 2 }, s[1].angle:shape())
      assert.same({ 2, 4, 8, 8 }, s[1].ssm:shape())
      assert.same({ 2, 4, 8 }, s[1].k:shape())
      assert.same({ 2, 4, 8 }, s[1].v:shape())
      for l = 1, #s do
        for _, k in ipairs({ "angle", "ssm", "k", "v" }) do s[l][k] = helper.randn(rng, s[l][k]:shape(), 0.5) end
        for i = 0, s[l].angle:numel() - 1 do s[l].angle[i] = math.abs(s[l].angle[i]) end
      end
      tr:set_states(s)
      assert.is_true(helper.same_states(s, tr:states()))
      local b = helper.batch(tr.config, 2, 8, rng)
      local carried = tr:forward(b)
      tr:reset_state()
      assert.is_true(helper.rel_l2(tr:forward(b), carried) > 1e-3)

      local bad = tr:states()
      bad[1].ssm = m3.tensor({ 2, 4, 8, 7 })
      assert.matches("states%[1%].ssm: expected f32 %[2, 4, 8, 8%], got f32 %[2, 4, 8, 7%]",
        helper.error_of(tr.set_states, tr, bad))
      bad = tr:states()
      bad[2].k = nil
      assert.matches("states%[2%].k: missing", helper.error_of(tr.set_states, tr, bad))
      assert.matches("list of 2 layer tables", helper.error_of(tr.set_states, tr, { bad[1] }))
      bad = tr:states()
      bad[1].q = bad[1].k
      assert.matches("states%[1%].q: unknown field", helper.error_of(tr.set_states, tr, bad))
      local kept = tr:states()
      bad = tr:states()
      bad[1].ssm[0] = 7
      bad[2].k[3] = 0 / 0
      assert.matches("states%[2%].k%[3%] = %-?nan: not finite %(no layer was set%)",
        helper.error_of(tr.set_states, tr, bad))
      bad[2].k[3] = math.huge
      assert.matches("states%[2%].k%[3%] = inf: not finite", helper.error_of(tr.set_states, tr, bad))
      assert.is_true(helper.same_states(kept, tr:states()))
      -- a trainer that does not carry its state would take one and never use it
      local fresh = m3.trainer(cfg, opts({ batch = 2, seq_len = 8 }))
      assert.matches("set_state: this trainer does not carry its state %(carry_state = false%)",
        helper.error_of(fresh.set_states, fresh, kept))
    end)
  end)

  it("works with windows shorter than seq_len and fewer rows than batch", function()
    local tr = m3.trainer(helper.tokens_lm(), opts({ batch = 4, seq_len = 8 }))
    local b = helper.batch(tr.config, 2, 5, helper.rng(17))
    local m = tr:step(b)
    assert.equal(10, m.tokens)
    assert.same({ 2, 5, 16 }, tr:forward(b):shape())
    tr:backward_step(b)
    local em, out = tr:evaluate(helper.batch(tr.config, 1, 3, helper.rng(18)))
    assert.same({ 1, 3, 16 }, out:shape())
    assert.is_number(em.loss)
    assert.equal(2, tr:step_count())
  end)

  -- a window of fewer rows moves only its own rows' state: the other rows keep theirs, a reset one stays reset
  it("leaves the carried state of the rows a narrower window does not hold as it was", function()
    local tr = m3.trainer(helper.features_none(), opts({ carry_state = true }))
    local rng = helper.rng(19)
    tr:step(helper.batch(tr.config, 3, 7, rng))
    tr:reset_state({ 2 })
    local before = tr:states()
    tr:step(helper.batch(tr.config, 2, 7, rng))
    local after = tr:states()
    for l = 1, #after do
      local moved = helper.rows(after[l], 0, 2)
      assert.is_false(helper.same_states({ helper.rows(before[l], 0, 2) }, { moved }))
      assert.is_true(helper.same_states({ helper.rows(before[l], 2, 1) }, { helper.rows(after[l], 2, 1) }))
    end
  end)

  it("check_batch checks a window as step would and counts its scored positions, running nothing", function()
    local tr = m3.trainer(helper.tokens_lm(), opts({ carry_state = true }))
    local b = helper.batch(tr.config, 3, 7, helper.rng(24), { ignore = 0.3 })
    local scored = 0
    for i = 0, b.targets:numel() - 1 do
      if b.targets[i] ~= -1 then scored = scored + 1 end
    end
    local s0 = tr:states()
    assert.equal(scored, tr:check_batch(b))
    assert.is_true(helper.same_states(s0, tr:states()))
    assert.equal(0, tr:step_count())
    assert.matches("batch.targets: missing", helper.error_of(tr.check_batch, tr, { tokens = b.tokens }))
    local bad = { tokens = b.tokens:clone(), targets = b.targets }
    bad.tokens[2] = 99
    assert.matches("batch.tokens%[2%] .* = 99", helper.error_of(tr.check_batch, tr, bad))
    local mse = m3.trainer(helper.identity_mse(), opts())
    local mb = helper.batch(mse.config, 2, 5, helper.rng(25))
    assert.equal(10, mse:check_batch({ input = mb.input, targets = mb.targets }))
  end)

  describe("a batch that counts no position", function()
    -- an "lm" batch whose targets are all -1 (ignore = 1), or an "mse" batch whose mask is all 0
    local function counting_none(tr, seed)
      local b = helper.batch(tr.config, 3, 7, helper.rng(seed), { ignore = 1 })
      if tr.config.head == "mse" then b.mask = m3.tensor({ 3, 7 }, "u8") end
      return b
    end

    for _, kind in ipairs { "tokens_lm", "identity_mse" } do
      it("is refused by step before anything runs (" .. kind .. ")", function()
        local tr, ref = pair(KINDS[kind](), opts({ carry_state = true }))
        local b = counting_none(tr, 41)
        local s0 = tr:states()
        assert.equal(0, tr:check_batch(b))
        local why = kind == "tokens_lm" and "every target is %-1" or "every mask entry is 0"
        assert.matches("step: the batch counts no position %(" .. why .. "%), so there is no loss .* nothing was run",
          helper.error_of(tr.step, tr, b))
        assert.equal(0, tr:step_count())
        assert.is_true(helper.same_weights(ref:snapshot(), tr:snapshot()))
        assert.is_true(helper.same_states(s0, tr:states()))
        -- evaluate has no loss to report, only the count
        local m = tr:evaluate(b)
        assert.is_nil(m.loss)
        assert.is_nil(m.accuracy)
        assert.equal(0, m.counted)
      end)
    end

    it("closes no window: backward_step refuses it with the forward kept pending", function()
      local tr, ref = pair(helper.tokens_lm(), opts())
      local none = counting_none(tr, 42)
      local real = { tokens = none.tokens, targets = helper.batch(tr.config, 3, 7, helper.rng(43)).targets }
      tr:forward(none)
      assert.matches("backward_step: the batch counts no position %(every target is %-1%).* %(the forward is still "
        .. "pending%)", helper.error_of(tr.backward_step, tr, none))
      assert.is_true(tr:info().pending_forward)
      -- a micro-batch that counts none may sit in a window (a zero gradient), but cannot close one alone
      local m = tr:backward_step(none, { accumulate = true })
      assert.is_nil(m.loss)
      assert.equal(0, m.counted)
      tr:forward(none)
      assert.matches("backward_step: the accumulation window counts no position %(every target is %-1 in each of "
        .. "its micro%-batches%).* %(the forward is still pending and the window open%)",
        helper.error_of(tr.backward_step, tr, none))
      assert.is_true(tr:info().window_open)
      assert.equal(0, tr:step_count())
      -- closed by a batch that counts: the update of that batch alone
      local closed = tr:backward_step(real)
      assert.is_true(closed.optimizer_stepped)
      ref:forward(none)
      local plain = ref:backward_step(real)
      assert.equal(plain.loss, closed.loss)
      assert.is_true(helper.same_weights(ref:snapshot(), tr:snapshot()))
    end)

    it("counts over the whole window and only while it is open", function()
      local tr = m3.trainer(helper.tokens_lm(), opts())
      local none = counting_none(tr, 44)
      local real = { tokens = none.tokens, targets = helper.batch(tr.config, 3, 7, helper.rng(45)).targets }
      tr:step(real)
      -- a window that counted in its first micro-batch is closed by ones that count none
      tr:forward(none)
      assert.equal(1, tr:backward_step(real, { accumulate = true }).step)
      tr:forward(none)
      tr:backward_step(none, { accumulate = true })
      tr:forward(none)
      assert.is_true(tr:backward_step(none).optimizer_stepped)
      assert.equal(2, tr:step_count())
      -- what the closed window counted went with it
      tr:forward(none)
      assert.matches("backward_step: the batch counts no position", helper.error_of(tr.backward_step, tr, none))
      tr:backward_step(real)
      assert.equal(3, tr:evaluate(real).step)
    end)
  end)

  it("gives the same bits for any CPU thread count", function()
    -- 8 x 64 = 512 rows: the products of several blocks of rows, whatever the threads
    local cfg = helper.tokens_lm({ d_model = 32, d_state = 16, headdim = 16 })
    local rng = helper.rng(23)
    local batches = {}
    local probe = m3.trainer(cfg, opts({ batch = 8, seq_len = 64 }))
    for i = 1, 3 do batches[i] = helper.batch(probe.config, 8, 64, rng) end
    probe:close()
    local threads = m3.cpu_threads()
    local function train(n)
      m3.cpu_threads(n)
      local tr = m3.trainer(cfg, opts({ batch = 8, seq_len = 64, carry_state = true, seed = 4 }))
      for i = 1, 3 do tr:step(batches[i]) end
      return tr
    end
    assert.matches("cpu_threads: n = 100000: at most", helper.error_of(m3.cpu_threads, 100000))
    assert.matches("n must be an int32 integer, got 10000000000", helper.error_of(m3.cpu_threads, 1e10))
    assert.equal(threads, m3.cpu_threads())
    local ref = train(1)
    for _, n in ipairs({ 2, 3, 4, 5 }) do
      local tr = train(n)
      assert.is_true(helper.same_weights(ref:snapshot(), tr:snapshot()), n .. " threads: weights")
      assert.is_true(helper.same_states(ref:states(), tr:states()), n .. " threads: states")
    end
    m3.cpu_threads(threads)
  end)

  it("evaluate changes neither weights nor states", function()
    local tr = m3.trainer(helper.tokens_lm(), opts({ carry_state = true }))
    local rng = helper.rng(19)
    tr:step(helper.batch(tr.config, 3, 7, rng))
    tr:step(helper.batch(tr.config, 3, 7, rng))
    local w0, s0 = tr:snapshot(), tr:states()
    local b = helper.batch(tr.config, 3, 7, rng, { ignore = 0.2 })
    local m, out = tr:evaluate(b)
    assert.is_true(helper.same_weights(w0, tr:snapshot()))
    assert.is_true(helper.same_states(s0, tr:states()))
    assert.equal(2, tr:step_count())
    assert.is_number(m.loss)
    assert.is_true(m.accuracy >= 0 and m.accuracy <= 1)
    assert.same({ 3, 7, 16 }, out:shape())
    assert.near(m.loss, tr:step(b).loss, 1e-6 * math.abs(m.loss))
  end)

  describe("checkpoints", function()
    it("5 steps + save + load + 5 steps equals 10 steps bit for bit (carry_state)", function()
      local cfg = helper.tokens_lm()
      local o = opts({ carry_state = true, clip = 1 })
      local a, b = pair(cfg, o)
      local rng = helper.rng(20)
      local batches = {}
      for i = 1, 10 do batches[i] = helper.batch(a.config, 3, 7, rng, { ignore = 0.1 }) end
      for i = 1, 10 do a:step(batches[i]) end
      for i = 1, 5 do b:step(batches[i]) end
      b:set_lr(a:lr())
      local extra = { cursor = { file = "x.bin", offset = 12345 }, lrs = { 1e-3, 0.1, 1 / 3 }, name = "run\n1",
                      done = false, big = 2 ^ 60, inf = 1 / 0 }
      local path = helper.tmpname(".ckpt")
      b:save(path, extra)
      local c, got = m3.trainer.load(path)
      assert.same(extra, got)
      assert.equal(5, c:step_count())
      assert.same(b.config, c.config)
      assert.equal(3, c:batch())
      assert.equal(7, c:seq_len())
      assert.is_true(c:info().carry_state)
      for i = 6, 10 do c:step(batches[i]) end
      assert.equal(10, c:step_count())
      assert.is_true(helper.same_weights(a:snapshot(), c:snapshot()))
      assert.is_true(helper.same_states(a:states(), c:states()))
    end)

    it("saves under any name the file system takes, 255 bytes included", function()
      local tr = m3.trainer(helper.features_none(), opts())
      local dir = helper.tmpdir()
      local path = dir .. "/" .. string.rep("a", 250) .. ".ckpt"
      tr:save(path)
      assert.equal(0, m3.trainer.load(path):step_count())
      local w = dir .. "/" .. string.rep("w", 255)
      tr:snapshot():save(w)
      assert.is_true(helper.same_weights(tr:snapshot(), m3.weights.load(w)))
      os.execute("rm -rf " .. dir)
    end)

    it("round-trips a missing extra as nil and rejects unsaveable values", function()
      local tr = m3.trainer(helper.features_none(), opts())
      local path = helper.tmpname(".ckpt")
      tr:save(path)
      local c, extra = m3.trainer.load(path, { device = "cpu", dtype = "f32" })
      assert.is_nil(extra)
      assert.equal("cpu", c:device())
      local err = helper.error_of(function() tr:save(path, { data = { fn = print } }) end)
      assert.matches("extra.data.fn is a function", err)
      assert.matches("trainer_spec.lua:%d+:", err)
      assert.matches("unknown option", helper.error_of(m3.trainer.load, path, { batch_size = 2 }))
      assert.matches("m3: ", helper.error_of(m3.trainer.load, "/nonexistent.ckpt"))
    end)

    it("refuses a checkpoint whose metadata or values are damaged, naming what is wrong", function()
      local function saved()
        local tr = m3.trainer(helper.tokens_lm(), opts({ carry_state = true }))
        tr:step(helper.batch(tr.config, 3, 7, helper.rng(22)))
        local path = helper.tmpname(".ckpt")
        tr:save(path)
        return path
      end
      -- a copy of the checkpoint at path with change(tensors, metadata) applied, without its checksum (as a
      -- file written before checksums): each value's own check must hold on its own
      local function damaged(path, change)
        local tensors, meta = m3.load_tensors(path)
        meta.checksum = nil
        change(tensors, meta)
        local out = helper.tmpname(".ckpt")
        m3.save_tensors(out, tensors, meta)
        return out
      end
      local f32 = saved()
      local function refused(pattern, change)
        assert.matches(pattern, helper.error_of(m3.trainer.load, damaged(f32, change)))
      end
      refused('step "abc": expected an integer in %[0, ', function(_, m) m.step = "abc" end)
      refused('step "%-5": expected an integer', function(_, m) m.step = "-5" end)
      refused('step "3x": expected an integer', function(_, m) m.step = "3x" end)
      refused('step "9223372036854775807": expected an integer in %[0, 9007199254740992%]',
        function(_, m) m.step = "9223372036854775807" end)
      refused('loss_scale "nan": expected a finite number', function(_, m) m.loss_scale = "nan" end)
      refused("loss_scale 2, tracker 0: a trainer without f16 has 1 and 0", function(_, m) m.loss_scale = "2" end)
      refused('tracker "%-1": expected an integer', function(_, m) m.tracker = "-1" end)
      refused('"state.0.v" %[3%] = %-?nan: expected a finite value', function(t) t["state.0.v"][3] = 0 / 0 end)
      refused('"param.embedding.weight" %[0%] = inf: expected a finite value', function(t) t["param.embedding.weight"][0] = 1 / 0 end)
      refused('"adam_m.norm_f.weight" %[1%] = %-?nan', function(t) t["adam_m.norm_f.weight"][1] = 0 / 0 end)
      refused('"adam_v.norm_f.weight" %[2%] = %-1: expected a finite, nonnegative value',
        function(t) t["adam_v.norm_f.weight"][2] = -1 end)
      local json = require "m3.json"
      local function trainer_option(key, value)
        return function(_, m)
          local t = json.decode(m.trainer)
          t[key] = value
          m.trainer = json.encode(t)
        end
      end
      refused('"batch" = 4.7: expected an integer', trainer_option("batch", 4.7))
      refused('"carry_state" = 0.5: expected an integer', trainer_option("carry_state", 0.5))
      refused('"carry_state" = 2: expected 0 or 1', trainer_option("carry_state", 2))
      refused('"no_decay" = %-1: expected 0 or 1', trainer_option("no_decay", -1))
      refused('"allow_tf32" = 7: expected 0 or 1', trainer_option("allow_tf32", 7))
      refused('"seed" must be a decimal string', trainer_option("seed", "zz"))
      refused('"seed" must be a decimal string', trainer_option("seed", "-1"))
      refused('rng "0 0 0 0": expected four hex words, not all 0', function(_, m) m.rng = "0 0 0 0" end)
      refused("expected four hex words", function(_, m) m.rng = m.rng .. " junk" end)
      -- an extra whose long strings hide a call from the literal check (a quote inside [=[ ]=])
      refused("extra does not load: serialize.load: long strings and comments are not accepted",
        function(_, m) m.extra = 'return {[=["]=], ([=[ab]=]):rep(3), [=["]=]}' end)
      assert.equal(1, m3.trainer.load(damaged(f32, function() end)):step_count())
      -- one bit off in the key "checksum" does not make the file one written before checksums
      refused('the file is damaged: it states no checksum and holds the unknown metadata key "ghecksum"',
        function(t, m)
          m.ghecksum = select(2, m3.load_tensors(f32)).checksum
          t["param.norm_f.weight"][0] = t["param.norm_f.weight"][0] + 1
        end)
    end)

    it("refuses flags other than 0 and 1 in the C API's trainer options", function()
      local w = m3.weights.init(helper.tokens_lm(), { seed = 1 })
      helper.c_flags_checked("trainer", { "no_decay", "carry_state", "allow_tf32" }, function(c)
        c.weights, c.device, c.batch, c.seq_len = m3.weights.ptr(w), 1, 2, 4 -- M3_DEVICE_CPU
      end)
      -- and in m3_trainer_set_no_decay, as its trainer option
      local C, tr = require("m3.lib").C, m3.trainer(w, opts())
      assert.equal(2, tonumber(C.m3_trainer_set_no_decay(tr._box.p, 5))) -- M3_ERR_CONFIG
      assert.matches("^reference = 5: must be 0 or 1", require("ffi").string(C.m3_last_error()))
      assert.equal("reference", tr:info().no_decay)
      tr:set_reference_no_decay(false)
      assert.equal("none", tr:info().no_decay)
    end)

    it("takes -1 in the C API's load options as the saved value and refuses other negative values", function()
      local ffi = require "ffi"
      local C = require("m3.lib").C
      local tr = m3.trainer(helper.tokens_lm(), opts())
      local path = helper.tmpname(".ckpt")
      tr:save(path)
      local out = ffi.new("m3_trainer *[1]")
      local fields = { "device", "device_index", "precision", "batch", "seq_len" }
      for _, field in ipairs(fields) do
        local o = ffi.new("m3_load_opts", -1, -1, -1, -1, -1)
        o[field] = -7
        assert.equal(2, tonumber(C.m3_trainer_load(path, o, out)), field) -- M3_ERR_CONFIG
        assert.matches("= %-7", ffi.string(C.m3_last_error()), field)
        assert.is_true(out[0] == nil)
      end
      assert.equal(0, tonumber(C.m3_trainer_load(path, ffi.new("m3_load_opts", -1, -1, -1, -1, -1), out)))
      C.m3_trainer_destroy(out[0])
    end)

    it("refuses a checkpoint with a flipped byte anywhere in its values (the checksum)", function()
      local tr = m3.trainer(helper.tokens_lm(), opts({ carry_state = true }))
      tr:step(helper.batch(tr.config, 3, 7, helper.rng(23)))
      local path = helper.tmpname(".ckpt")
      tr:save(path, { cursor = 12 })
      local f = io.open(path, "rb")
      local bytes = f:read("*a")
      f:close()
      local n = 0 -- the header's length; the tensor data follow it
      for i = 1, 8 do n = n + bytes:byte(i) * 256 ^ (i - 1) end
      local rng = helper.rng(5)
      for _ = 1, 20 do
        local at = 8 + n + rng:int(#bytes - 8 - n) + 1
        local bad = helper.tmpname(".ckpt")
        local out = io.open(bad, "wb")
        out:write(bytes:sub(1, at - 1), string.char((bytes:byte(at) + 1) % 256), bytes:sub(at + 1))
        out:close()
        assert.matches("the file is damaged: its checksum is %x+, it states %x+", helper.error_of(m3.trainer.load, bad))
      end
      assert.equal(1, m3.trainer.load(path):step_count())
    end)

    it("loads with another window length and batch (the state then starts from zero)", function()
      local o = opts({ carry_state = true })
      local a = m3.trainer(helper.tokens_lm(), o)
      local rng = helper.rng(21)
      for _ = 1, 3 do a:step(helper.batch(a.config, 3, 7, rng)) end
      local path = helper.tmpname(".ckpt")
      a:save(path, { phase = 2 })
      local longer, extra = m3.trainer.load(path, { seq_len = 12 })
      assert.same({ phase = 2 }, extra)
      assert.equal(12, longer:seq_len())
      assert.equal(3, longer:batch())
      assert.is_true(helper.same_states(a:states(), longer:states()))
      local wider = m3.trainer.load(path, { batch = 5, seq_len = 12 })
      assert.equal(5, wider:batch())
      assert.equal(3, wider:step_count())
      assert.equal(a:lr(), wider:lr())
      assert.is_true(helper.same_weights(a:snapshot(), wider:snapshot()))
      for _, layer in ipairs(wider:states()) do
        assert.same({ 5, 4, 2 }, layer.angle:shape())
        for i = 0, layer.ssm:numel() - 1 do assert.equal(0, layer.ssm[i]) end
      end
      wider:step(helper.batch(wider.config, 5, 12, rng))
      assert.equal(4, wider:step_count())
      -- the moments came along: one more step from the same batch matches on both
      local b1 = helper.batch(a.config, 3, 7, rng)
      local same = m3.trainer.load(path, { batch = 3 })
      same:reset_state()
      a:reset_state()
      a:step(b1)
      same:step(b1)
      assert.is_true(helper.same_weights(a:snapshot(), same:snapshot()))
      assert.matches("batch", helper.error_of(m3.trainer.load, path, { batch = 0 }))
      assert.matches("seq_len", helper.error_of(m3.trainer.load, path, { seq_len = 1.5 }))
    end)

    it("refuses to save while an accumulation window is open", function()
      local tr = m3.trainer(helper.features_none(), opts())
      local b = helper.batch(tr.config, 3, 7, helper.rng(21))
      tr:forward(b)
      tr:backward_step(b, { accumulate = true })
      assert.matches("m3: save: an accumulation window is open", helper.error_of(tr.save, tr, helper.tmpname()))
    end)

    it("refuses to save while a forward is pending (a file that could not resume the run)", function()
      -- its carried state would be the window's end, and the loaded trainer could not run the backward
      local tr = m3.trainer(helper.features_none(), opts({ carry_state = true }))
      local b = helper.batch(tr.config, 3, 7, helper.rng(22))
      tr:forward(b)
      local path = helper.tmpname()
      assert.matches("m3: save: a forward is pending; finish it with backward_step before saving",
        helper.error_of(tr.save, tr, path))
      assert.is_nil(io.open(path))
      tr:backward_step(b)
      tr:save(path)
      assert.equal(1, m3.trainer.load(path):step_count())
    end)
  end)

  it("snapshot, grads and load_weights use the trainer's config", function()
    local tr = m3.trainer(helper.features_none(), opts())
    local w = m3.weights.init(tr.config, { seed = 99 })
    tr:load_weights(w)
    assert.is_true(helper.same_weights(w, tr:snapshot()))
    assert.equal(tr.config.n_params, tr:grads():numel())
    -- the message names the first field that differs, the weights' value first
    assert.matches("m3: load_weights: the weights' config differs from the trainer's %(d_state: 4 vs %d+%)",
      helper.error_of(tr.load_weights, tr, m3.weights.init(helper.features_none({ d_state = 4 }))))
    assert.matches("the weights' config differs from the trainer's %(a_floor: 0%.5 vs ",
      helper.error_of(tr.load_weights, tr, m3.weights.init(helper.features_none({ a_floor = 0.5 }))))
  end)

  it("refuses capture_graph on the CPU, naming CUDA; drop_graph has nothing to drop", function()
    local tr = m3.trainer(helper.features_none(), CPU)
    assert.matches("CUDA", helper.error_of(tr.capture_graph, tr))
    assert.is_false(tr:has_graph())
    tr:drop_graph()
    assert.is_false(tr:has_graph())
  end)

  it("refuses phase profiling on the CPU, naming CUDA, and stays usable", function()
    local tr = m3.trainer(helper.features_none(), CPU)
    assert.matches("needs the CUDA backend", helper.error_of(tr.set_profiling, tr, true))
    assert.matches("needs the CUDA backend", helper.error_of(tr.profile, tr))
    tr:step(helper.batch(tr.config, 2, 5, helper.rng(3)))
    assert.equal(1, tr:step_count())
  end)

  it("has no loss scaler outside f16", function()
    local tr = m3.trainer(helper.features_none(), CPU)
    assert.is_nil(tr:scaler_state())
    assert.matches("f16", helper.error_of(tr.load_scaler_state, tr, 2, 0))
  end)
end)

describe("m3.trainer on CUDA #gpu", function()
  it("matches fused and split steps and replays a captured graph", function()
    if not helper.need_gpu(pending) then return end
    local cfg = helper.tokens_lm()
    local o = { device = "cuda", batch = 3, seq_len = 7, carry_state = true }
    local a, b = pair(cfg, o)
    local rng = helper.rng(30)
    local batches = {}
    for i = 1, 4 do batches[i] = helper.batch(a.config, 3, 7, rng) end
    for i = 1, 4 do a:step(batches[i]) end
    b:step(batches[1])
    b:capture_graph()
    assert.is_true(b:has_graph())
    for i = 2, 4 do assert.is_true(b:step(batches[i]).graph_replayed) end
    assert.is_true(helper.weights_rel(b:snapshot(), a:snapshot()) <= 1e-6)
    local s, f = pair(cfg, o)
    for i = 1, 2 do
      s:forward(batches[i])
      s:backward_step(batches[i])
      f:step(batches[i])
    end
    assert.is_true(helper.same_weights(s:snapshot(), f:snapshot()))
    assert.matches("^cuda:%d+$", a:device())
  end)

  it("takes Adam's 1 - beta from the double, as the CPU does", function()
    if not helper.need_gpu(pending) then return end
    first_adam_steps_by_lr("cuda")
  end)

  it("applies set_lr under a captured graph from the next replay", function()
    if not helper.need_gpu(pending) then return end
    local eager, graphed = pair(helper.features_none(), { device = "cuda", batch = 3, seq_len = 7 })
    local rng = helper.rng(31)
    local batches = {}
    for i = 1, 4 do batches[i] = helper.batch(eager.config, 3, 7, rng) end
    eager:step(batches[1])
    graphed:step(batches[1])
    graphed:capture_graph()
    for i = 2, 4 do
      local lr = 1e-3 * i
      eager:set_lr(lr)
      graphed:set_lr(lr)
      eager:step(batches[i])
      assert.is_true(graphed:step(batches[i]).graph_replayed)
    end
    assert.is_true(helper.weights_rel(graphed:snapshot(), eager:snapshot()) <= 1e-6)
    graphed:drop_graph()
    assert.is_false(graphed:has_graph())
  end)

  it("resumes a checkpoint bit for bit on the same device and dtype", function()
    if not helper.need_gpu(pending) then return end
    for _, dtype in ipairs({ "f32", "bf16", "f16" }) do
      local o = { device = "cuda", dtype = dtype, batch = 3, seq_len = 7, carry_state = true }
      local a, b = pair(helper.tokens_lm(), o)
      local rng = helper.rng(32)
      local batches = {}
      for i = 1, 6 do batches[i] = helper.batch(a.config, 3, 7, rng) end
      for i = 1, 6 do a:step(batches[i]) end
      for i = 1, 3 do b:step(batches[i]) end
      local path = helper.tmpname(".ckpt")
      b:save(path, { dtype = dtype })
      local c, extra = m3.trainer.load(path)
      assert.same({ dtype = dtype }, extra)
      assert.equal(dtype, c:dtype())
      for i = 4, 6 do c:step(batches[i]) end
      assert.is_true(helper.same_weights(a:snapshot(), c:snapshot()), dtype)
      assert.is_true(helper.same_states(a:states(), c:states()), dtype)
      if dtype == "f16" then
        local scale, tracker = c:scaler_state()
        assert.same({ a:scaler_state() }, { scale, tracker })
      else
        assert.is_nil(c:scaler_state())
      end
    end
    helper.cleanup()
  end)
end)

-- CUDA trainers through the Lua binding (#gpu: pending without a CUDA device). The numeric
-- parity suites are C tests (engine/tests/test_cuda_parity.c, test_cuda_golden.c); these check
-- what a Lua user sees: training makes progress in every dtype, graphs and set_lr, m3.fit under
-- graphs, checkpoint resume bit-identical on the GPU, the carried state put back after a refused
-- step, state tensors, the arena size and the size limit message, a trainer too large for the
-- device's memory, batches in pinned tensors.

local ffi = require "ffi"
local m3 = require "m3"
local helper = require "spec.helper"

describe("CUDA trainer #gpu", function()
  after_each(helper.cleanup)

  for _, dtype in ipairs({ "f32", "bf16", "f16" }) do
    it("learns a fixed lm batch in " .. dtype, function()
      if not helper.need_gpu(pending) then return end
      local tr = m3.trainer(helper.tokens_lm({ d_model = 32, d_state = 16, headdim = 16 }),
        { device = "cuda", dtype = dtype, batch = 4, seq_len = 24, lr = 1e-2, seed = 3 })
      local b = helper.batch(tr.config, 4, 24, helper.rng(7))
      local first, last
      for i = 1, 40 do
        local m = tr:step(b)
        assert.is_true(m.loss == m.loss, "loss is NaN")
        first = first or m.loss
        last = m.loss
      end
      assert.is_true(last < 0.8 * first, string.format("loss %.4f -> %.4f", first, last))
      tr:close()
    end)

    it("resumes a checkpoint bit-identically on the GPU in " .. dtype, function()
      if not helper.need_gpu(pending) then return end
      local cfg = helper.features_none({ d_model = 32, d_state = 16, headdim = 16 })
      local o = { device = "cuda", dtype = dtype, batch = 2, seq_len = 16, carry_state = true, seed = 5 }
      local rng = helper.rng(8)
      local bs = {}
      for i = 1, 4 do
        bs[i] = helper.batch(m3.config(cfg), 2, 16, rng)
        if dtype == "f16" then
          for k = 0, bs[i].d_out:numel() - 1 do bs[i].d_out[k] = bs[i].d_out[k] * 1e-2 end
        end
      end
      local a = m3.trainer(cfg, o)
      a:step(bs[1])
      a:step(bs[2])
      local path = helper.tmpname(".ckpt")
      a:save(path)
      local b = m3.trainer.load(path, { device = "cuda" })
      for i = 3, 4 do
        a:step(bs[i])
        b:step(bs[i])
      end
      assert.is_true(helper.same_weights(a:snapshot(), b:snapshot()))
      assert.is_true(helper.same_states(a:states(), b:states()))
      assert.are.equal(a:step_count(), b:step_count())
      a:close()
      b:close()
    end)
  end

  -- SPEC.md §7's dynamic loss scaling: an overflow halves the scale (not below 1) and restarts the count of clean
  -- steps; 2000 clean steps in a row double it (not above 2^24). Eager and replayed alike.
  it("grows the f16 loss scale after 2000 clean steps up to 2^24, halves it on an overflow down to 1", function()
    if not helper.need_gpu(pending) then return end
    local cfg = helper.features_none({ d_model = 32, d_state = 16, headdim = 16 })
    local tr = m3.trainer(cfg, { device = "cuda", dtype = "f16", batch = 2, seq_len = 8, lr = 1e-4, seed = 4 })
    assert.same({ 2 ^ 16, 0 }, { tr:scaler_state() }) -- the start
    local b = helper.batch(m3.config(cfg), 2, 8, helper.rng(12))
    for k = 0, b.d_out:numel() - 1 do b.d_out[k] = b.d_out[k] * 1e-6 end -- clean at every scale up to 2^24
    local huge = { input = b.input, d_out = b.d_out:clone() }
    for k = 0, huge.d_out:numel() - 1 do huge.d_out[k] = 1e6 end -- past f16's 65504 at any scale
    for _, graph in ipairs({ false, true }) do
      if graph then tr:capture_graph() end
      tr:load_scaler_state(2 ^ 20, 1998)
      assert.is_true(tr:step(b).optimizer_stepped)
      assert.same({ 2 ^ 20, 1999 }, { tr:scaler_state() })
      assert.equal(2 ^ 20, tr:step(b).loss_scale) -- the 2000th clean step runs at the old scale, then doubles it
      assert.same({ 2 ^ 21, 0 }, { tr:scaler_state() })
      tr:load_scaler_state(2 ^ 24, 1999)
      tr:step(b)
      assert.same({ 2 ^ 24, 0 }, { tr:scaler_state() }) -- the cap
      local steps = tr:step_count()
      tr:load_scaler_state(2, 1500)
      local m = tr:step(huge)
      assert.is_true(m.overflow_skipped)
      assert.equal(steps, tr:step_count())
      assert.same({ 1, 0 }, { tr:scaler_state() })
      assert.is_true(tr:step(huge).overflow_skipped)
      assert.same({ 1, 0 }, { tr:scaler_state() }) -- the floor
      assert.is_true(tr:step(b).optimizer_stepped)
      assert.same({ 1, 1 }, { tr:scaler_state() })
    end
    -- a checkpoint keeps the scaler exactly, a scale that is no power of 2 too (load_scaler_state takes any in [1, 2^24])
    tr:load_scaler_state(1 + 1 / 3, 1234)
    local path = helper.tmpname(".ckpt")
    tr:save(path)
    local back = m3.trainer.load(path, { device = "cuda" })
    assert.same({ 1 + 1 / 3, 1234 }, { back:scaler_state() })
    back:close()
    tr:close()
  end)

  for _, dtype in ipairs({ "f32", "bf16" }) do
    it("puts the carried state back after a non-finite step in " .. dtype .. ", eager and replayed", function()
      if not helper.need_gpu(pending) then return end
      local cfg = helper.features_none({ d_model = 32, d_state = 16, headdim = 16 })
      local o = { device = "cuda", dtype = dtype, batch = 3, seq_len = 16, carry_state = true, seed = 6 }
      local rng = helper.rng(9)
      local b, c = helper.batch(m3.config(cfg), 3, 16, rng), helper.batch(m3.config(cfg), 2, 16, rng)
      local bad = { input = c.input:clone(), d_out = c.d_out }
      bad.input[5] = 0 / 0
      local tr, twin = m3.trainer(cfg, o), m3.trainer(cfg, o)
      for _, graph in ipairs({ false, true }) do
        if graph then tr:capture_graph() end -- the twin stays eager: replays match eager steps bit for bit
        tr:step(b)
        twin:step(b)
        assert.matches("the carried state and the step count are unchanged", helper.error_of(tr.step, tr, bad))
        assert.is_true(helper.same_states(twin:states(), tr:states()))
        assert.equal(graph, tr:step(c).graph_replayed)
        twin:step(c)
        assert.is_true(helper.same_states(twin:states(), tr:states()))
        assert.is_true(helper.same_weights(twin:snapshot(), tr:snapshot()))
      end
      tr:forward(bad) -- the split calls alike, for a window of one forward
      assert.matches("the carried state and the step count are unchanged", helper.error_of(tr.backward_step, tr, bad))
      assert.is_true(helper.same_states(twin:states(), tr:states()))
      tr:forward(bad) -- a row reset after the forward stays reset
      tr:reset_state({ 1 })
      assert.matches("the carried state and the step count are unchanged", helper.error_of(tr.backward_step, tr, bad))
      twin:reset_state({ 1 })
      assert.is_true(helper.same_states(twin:states(), tr:states()))
      tr:close()
      twin:close()
    end)
  end

  it("times the phases of eager steps without changing a bit of the result", function()
    if not helper.need_gpu(pending) then return end
    local cfg = helper.identity_mse({ d_model = 32, d_state = 16, headdim = 16 })
    local o = { device = "cuda", dtype = "bf16", batch = 2, seq_len = 20, seed = 9 }
    local rng = helper.rng(5)
    local bs = {}
    for i = 1, 3 do bs[i] = helper.batch(m3.config(cfg), 2, 20, rng) end
    local p, e = m3.trainer(cfg, o), m3.trainer(cfg, o)
    p:set_profiling(true)
    for i = 1, 3 do
      p:step(bs[i])
      e:step(bs[i])
    end
    local prof = p:profile()
    assert.equal(2, prof.calls) -- the first step after switching on is not counted
    local names, total = {}, 0
    for _, ph in ipairs(prof.phases) do
      assert.is_true(ph.ms > 0, ph.name)
      names[ph.name] = true
      total = total + ph.ms
    end
    assert.is_true(names["scan fwd"] and names["scan bwd"] and names["update"])
    assert.is_true(total < 1000)
    assert.is_true(helper.same_weights(p:snapshot(), e:snapshot()))
    p:set_profiling(false)
    assert.equal(0, p:profile().calls)
    p:close()
    e:close()
  end)

  it("uploads batches in pinned tensors straight from them, with the same result", function()
    if not helper.need_gpu(pending) then return end
    -- input and d_out of 1 MiB each: the large-upload path (copy stream), here without staging
    local cfg = helper.features_none({ d_model = 64, input_dim = 64 })
    local o = { device = "cuda", dtype = "bf16", batch = 4, seq_len = 1024, seed = 5 }
    local rng = helper.rng(3)
    local a, b = m3.trainer(cfg, o), m3.trainer(cfg, o)
    for _ = 1, 2 do
      local plain, pinned = helper.batch(m3.config(cfg), 4, 1024, rng), {}
      for k, t in pairs(plain) do
        pinned[k] = m3.tensor(t:shape(), t:dtype(), { pinned = true })
        ffi.copy(pinned[k].data, t.data, t:numel() * 4)
      end
      local ma, mb = a:step(plain), b:step(pinned)
      assert.equal(ma.grad_norm, mb.grad_norm)
    end
    assert.is_true(helper.same_weights(a:snapshot(), b:snapshot()))
    a:close()
    b:close()
  end)

  it("replays a graph, applies set_lr at the next replay, and drops it", function()
    if not helper.need_gpu(pending) then return end
    local cfg = helper.identity_mse({ d_model = 32, d_state = 16, headdim = 16 })
    local o = { device = "cuda", dtype = "bf16", batch = 2, seq_len = 20, seed = 9 }
    local rng = helper.rng(4)
    local bs = {}
    for i = 1, 4 do bs[i] = helper.batch(m3.config(cfg), 2, 20, rng) end
    local g, e = m3.trainer(cfg, o), m3.trainer(cfg, o)
    g:step(bs[1])
    e:step(bs[1])
    g:capture_graph()
    assert.is_true(g:has_graph())
    assert.is_true(g:info().has_graph)
    assert.is_true(g:step(bs[2]).graph_replayed)
    assert.is_false(e:step(bs[2]).graph_replayed)
    g:set_lr(3e-3)
    e:set_lr(3e-3)
    g:step(bs[3])
    e:step(bs[3])
    g:drop_graph()
    assert.is_false(g:has_graph())
    assert.is_false(g:step(bs[4]).graph_replayed)
    e:step(bs[4])
    assert.is_true(helper.same_weights(g:snapshot(), e:snapshot()))
    g:close()
    e:close()
  end)

  it("runs m3.fit with graph = true: the step captured after its first run, replayed after it", function()
    if not helper.need_gpu(pending) then return end
    local tr = m3.trainer(helper.tokens_lm({ d_model = 32, d_state = 16, headdim = 16 }),
      { device = "cuda", dtype = "bf16", batch = 4, seq_len = 16, seed = 2 })
    local src = m3.data.parity { seed = 1, length = 16, min_length = 16 }
    local result = m3.fit.run { trainer = tr, data = src, steps = 3, graph = true }
    assert.equal(3, result.step)
    assert.equal(3, tr:step_count())
    assert.is_true(tr:has_graph())
    assert.is_true(tr:step(src:next(4)).graph_replayed)
    tr:close()
  end)

  it("reports the device arena and batch-first states", function()
    if not helper.need_gpu(pending) then return end
    local cfg = helper.features_none({ d_model = 32, d_state = 16, headdim = 8 })
    local tr = m3.trainer(cfg, { device = "cuda", dtype = "bf16", batch = 3, seq_len = 10, carry_state = true })
    local info = tr:info()
    assert.are.equal("cuda", info.device)
    assert.is_true(info.device_bytes > 0)
    tr:step(helper.batch(tr.config, 3, 10, helper.rng(2)))
    local s = tr:states()
    assert.are.equal(cfg.n_layers, #s)
    local H = 2 * cfg.d_model / cfg.headdim
    assert.are.same({ 3, H, cfg.headdim, cfg.d_state }, s[1].ssm:shape())
    assert.are.same({ 3, H, cfg.d_state }, s[1].k:shape())
    assert.are.same({ 3, H, cfg.headdim }, s[1].v:shape())
    tr:reset_state({ 1 })
    local r = tr:states()
    for i = 0, H * cfg.headdim * cfg.d_state - 1 do
      assert.are.equal(0, r[2].ssm[cfg.d_state * cfg.headdim * H + i])
    end
    tr:set_states(s)
    assert.is_true(helper.same_states(s, tr:states()))
    tr:close()
  end)

  it("refuses sizes beyond the kernels at creation with a clear message", function()
    if not helper.need_gpu(pending) then return end
    local cfg = helper.identity_mse({ d_model = 256, d_state = 16, headdim = 256 })
    local err = helper.error_of(m3.trainer, cfg, { device = "cuda", batch = 1, seq_len = 4 })
    assert.matches("headdim", err)
  end)

  it("refuses a trainer larger than the device's memory with a clear message, and the device stays usable", function()
    if not helper.need_gpu(pending) then return end
    local cfg = helper.features_none({ d_model = 32, d_state = 16, headdim = 16 })
    local err = helper.error_of(m3.trainer, cfg, { device = "cuda", dtype = "bf16", batch = 8192, seq_len = 65536 })
    assert.matches("memory", err)
    local tr = m3.trainer(cfg, { device = "cuda", dtype = "bf16", batch = 2, seq_len = 16, seed = 1 })
    local m = tr:step(helper.batch(tr.config, 2, 16, helper.rng(3)))
    assert.is_true(m.loss == m.loss and m.optimizer_stepped)
    tr:close()
  end)
end)

-- m3.infer contract (API.md "Inference"): a prompt stepped token by token, in pieces or whole
-- gives the same bits on the CPU; the logits are the last position's; rows and resets; states
-- hand over from a trainer; generation is deterministic per seed and per row, stops and pads;
-- bad prompts raise and change nothing; a changed inf.config changes nothing; pointers are
-- refused; a checkpoint's path gives its master weights, and a path holding neither a weights file
-- nor a checkpoint is named; m3.pytorch export/import round trips bit for bit.
-- CPU unless tagged #gpu (those are pending without a CUDA device).

local m3 = require "m3"
local helper = require "spec.helper"

local KINDS = { tokens_lm = helper.tokens_lm, features_none = helper.features_none, identity_mse = helper.identity_mse,
  -- products wider than one 64-output panel of the CPU kernel (full panels and a tail)
  wide_lm = function() return helper.tokens_lm({ d_model = 48, d_state = 16, headdim = 16, vocab_size = 70 }) end }

local function inputs(cfg, B, T, rng)
  local b = helper.batch(cfg, B, T, rng)
  return cfg.input == "tokens" and b.tokens or b.input
end

-- Positions [t0, t0 + n) of every row of an input tensor.
local function cols(x, t0, n)
  return helper.window({ x = x }, t0, n).x
end

-- out of T one-token steps, assembled as [B, T, d_model], and the last step's logits.
local function token_by_token(inf, x)
  local s = x:shape()
  local B, T = s[1], s[2]
  local dm = inf.config.d_model
  local out, logits = m3.tensor({ B, T, dm }), nil
  for t = 0, T - 1 do
    local o
    o, logits = inf:step(cols(x, t, 1))
    for r = 0, B - 1 do
      for j = 0, dm - 1 do out[(r * T + t) * dm + j] = o[r * dm + j] end
    end
  end
  return out, logits
end

local function same(a, b)
  return helper.bytes(a) == helper.bytes(b)
end

describe("m3.infer", function()
  after_each(helper.cleanup)

  it("builds from weights or a weights file, with checked options", function()
    local w = m3.weights.init(helper.tokens_lm(), { seed = 1 })
    local inf = m3.infer(w, { device = "cpu", batch = 2 })
    assert.equal("cpu", inf:device())
    assert.equal("f32", inf:dtype())
    assert.equal(2, inf:batch())
    assert.equal(256, inf:info().max_len)
    assert.matches("m3.infer%(cpu f32, batch 2", tostring(inf))
    local path = helper.tmpname(".safetensors")
    w:save(path)
    assert.equal(16, m3.infer(path, { device = "cpu" }).config.d_model)
    local tr = m3.trainer(w, { device = "cpu", batch = 2, seq_len = 4 })
    local x = helper.randint(helper.rng(1), { 2, 4 }, 13)
    assert.equal(helper.bytes(inf:step(x)), helper.bytes(m3.infer(tr, { device = "cpu", batch = 2 }):step(x)))
    -- the same weights from a file, and a trained trainer's from the trainer and from its checkpoint
    local function fresh_out(src) return helper.bytes(m3.infer(src, { device = "cpu", batch = 2 }):step(x)) end
    assert.equal(fresh_out(w), fresh_out(path))
    tr:step(helper.batch(m3.config(helper.tokens_lm()), 2, 4, helper.rng(2)))
    local ck = helper.tmpname(".m3ckpt")
    tr:save(ck)
    assert.equal(fresh_out(tr), fresh_out(m3.trainer.load(ck, { device = "cpu" })))
    assert.are_not.equal(fresh_out(w), fresh_out(tr))
    assert.matches('unknown option "bach" %(did you mean "batch"%?%)', helper.error_of(m3.infer, w, { bach = 2 }))
    assert.matches("batch = 0", helper.error_of(m3.infer, w, { batch = 0 }))
    assert.matches("dtype bf16: the CPU backend computes in f32 only", helper.error_of(m3.infer, w, { device = "cpu", dtype = "bf16" }))
    assert.matches("expected weights", helper.error_of(m3.infer, 42))
  end)

  it("builds from a trainer checkpoint's path: its float32 master weights, whatever it was trained on", function()
    local cfg = m3.config(helper.tokens_lm())
    local tr = m3.trainer(m3.weights.init(cfg, { seed = 1 }), { device = "cpu", batch = 2, seq_len = 4 })
    tr:step(helper.batch(cfg, 2, 4, helper.rng(2)))
    local dir = helper.tmpdir()
    local ck = m3.checkpoint.new { dir = dir }:save(tr, 1000, { cursor = 7 })
    assert.matches("step%-00001000%.ckpt$", ck)
    local x = helper.randint(helper.rng(3), { 2, 4 }, 13)
    local function out(src) return helper.bytes(m3.infer(src, { device = "cpu", batch = 2 }):step(x)) end
    assert.equal(out(tr), out(ck))
    assert.equal(out(m3.trainer.load(ck, { device = "cpu" })), out(ck))
    assert.is_true(helper.same_weights(tr:snapshot(), m3.infer.load_weights(ck)))
    -- options as for weights: checked before the file is read
    assert.equal(3, m3.infer(ck, { device = "cpu", batch = 3 }):batch())
    assert.matches('unknown option "bach"', helper.error_of(m3.infer, ck, { bach = 2 }))
    -- a checkpoint of a CUDA bf16 run (its checksum left out, as in a file written before checksums) loads on the CPU
    local tensors, meta = m3.load_tensors(ck)
    local options = m3.json.decode(meta.trainer)
    options.device, options.precision = 2, 1
    meta.trainer, meta.checksum = m3.json.encode(options), nil
    local bf16 = helper.tmpname(".ckpt")
    m3.save_tensors(bf16, tensors, meta)
    assert.equal(out(tr), out(bf16))
    os.execute("rm -rf " .. helper.quote(dir))
  end)

  it("names a path that holds no weights file or checkpoint, and says what it expects", function()
    local expected = "expected a weights file %(w:save%) or a trainer checkpoint %(tr:save%)"
    local missing = helper.tmpname(".ckpt")
    assert.matches("^[^:]*infer_spec%.lua:%d+: m3%.infer: " .. missing:gsub("%p", "%%%0") .. ": no such file; "
      .. expected .. "$", helper.error_of(function() m3.infer(missing, { device = "cpu" }) end))
    assert.matches("^[^:]*infer_spec%.lua:%d+: m3%.infer%.load_weights: " .. missing:gsub("%p", "%%%0")
      .. ": no such file; " .. expected .. "$", helper.error_of(function() m3.infer.load_weights(missing) end))
    local dir = helper.tmpdir()
    assert.matches("m3%.infer: " .. dir:gsub("%p", "%%%0") .. " is a folder; " .. expected .. "$",
      helper.error_of(m3.infer, dir))
    local fifo = dir .. "/fifo"
    assert.equal(0, os.execute("mkfifo " .. helper.quote(fifo)))
    assert.matches("m3%.infer: " .. fifo:gsub("%p", "%%%0") .. " is a FIFO %(named pipe%); " .. expected .. "$",
      helper.error_of(m3.infer, fifo))
    local text = dir .. "/notes.txt"
    m3.fs.write(text, "not a model")
    assert.matches("^m3: " .. text:gsub("%p", "%%%0") .. ": header length %d+ is larger than",
      helper.error_of(m3.infer, text))
    assert.matches('m3%.infer: path "a\0b" holds a NUL byte', helper.error_of(m3.infer, "a\0b"))
    -- a damaged checkpoint is refused in the engine's words, not taken for a weights file
    local tr = m3.trainer(m3.config(helper.tokens_lm()), { device = "cpu", batch = 1, seq_len = 2 })
    local ck = dir .. "/damaged.ckpt"
    tr:save(ck)
    local tensors, meta = m3.load_tensors(ck)
    tensors["param.norm_f.weight"][0] = 2
    m3.save_tensors(ck, tensors, meta)
    assert.matches("^m3: [^\n]*damaged%.ckpt[^\n]*checksum", helper.error_of(m3.infer, ck))
    os.execute("rm -rf " .. helper.quote(dir))
  end)

  it("refuses flags other than 0 and 1 in the C API's options", function()
    local w = m3.weights.init(helper.tokens_lm(), { seed = 1 })
    helper.c_flags_checked("infer", { "graph", "allow_tf32" }, function(c)
      c.weights, c.device = m3.weights.ptr(w), 1 -- M3_DEVICE_CPU
    end)
  end)

  it("refuses weights holding a NaN, from a weights object or a weights file, naming the tensor", function()
    local w = m3.weights.init(helper.tokens_lm(), { seed = 1 })
    w:get("embedding.weight")[5] = 0 / 0
    local want = "m3: weights: embedding.weight %[5%] = nan: expected a finite value"
    assert.matches("infer_spec.lua:%d+: " .. want, helper.error_of(function() m3.infer(w, { device = "cpu" }) end))
    local path = helper.tmpname(".safetensors")
    local tensors, meta = m3.load_tensors(m3.weights.init(helper.tokens_lm(), { seed = 1 }):save(path))
    tensors["embedding.weight"][5] = 0 / 0 -- w:save refuses it: the file is written as tensors
    m3.save_tensors(path, tensors, meta)
    assert.matches("m3: [^\n]+%.safetensors: " .. want:sub(5), helper.error_of(m3.infer, path, { device = "cpu" }))
  end)

  for name, make in pairs(KINDS) do
    it("gives the same bits token by token, in pieces and whole (" .. name .. ")", function()
      local cfg = m3.config(make())
      local w = m3.weights.init(cfg, { seed = 2 })
      local x = inputs(cfg, 3, 11, helper.rng(4))
      local whole = m3.infer(w, { device = "cpu", batch = 3 })
      local out, logits = whole:step(x)
      for _, max_len in ipairs({ 1, 4, 5 }) do
        local pieces = m3.infer(w, { device = "cpu", batch = 3, max_len = max_len })
        local o, l = pieces:step(x)
        assert.is_true(same(o, out), "max_len " .. max_len)
        if logits then assert.is_true(same(l, logits)) end
      end
      local stepped = m3.infer(w, { device = "cpu", batch = 3 })
      local o, l = token_by_token(stepped, x)
      assert.is_true(same(o, out))
      assert.is_true(helper.same_states(stepped:states(), whole:states()))
      if logits then
        assert.is_true(same(l, logits))
      else
        assert.is_nil(l)
      end
      -- and the trainer's forward agrees (BLAS products there: within rounding)
      local tr = m3.trainer(w, { device = "cpu", batch = 3, seq_len = 11 })
      local b = helper.batch(cfg, 3, 11, helper.rng(4))
      assert.is_true(helper.rel_l2(out, tr:forward(b)) <= 1e-6)
    end)
  end

  it("returns the last position's logits (out . W^T)", function()
    local cfg = m3.config(helper.tokens_lm({ tie_embeddings = false }))
    local w = m3.weights.init(cfg, { seed = 3 })
    local inf = m3.infer(w, { device = "cpu", batch = 2 })
    local out, logits = inf:step(helper.randint(helper.rng(5), { 2, 6 }, 13))
    local W = w:get("lm_head.weight")
    local want = m3.tensor({ 2, 13 }, "f64")
    for r = 0, 1 do
      for v = 0, 12 do
        local s = 0
        for j = 0, 15 do s = s + out[(r * 6 + 5) * 16 + j] * W[v * 16 + j] end
        want[r * 13 + v] = s
      end
    end
    assert.is_true(helper.rel_l2(logits, want) <= 1e-6)
    local o2, l2 = inf:step(helper.randint(helper.rng(5), { 2, 1 }, 13), { out = false, logits = false })
    assert.is_nil(o2)
    assert.is_nil(l2)
  end)

  it("writes into the caller's out and logits tensors, and refuses ones of another shape", function()
    local cfg = m3.config(helper.tokens_lm())
    local w = m3.weights.init(cfg, { seed = 3 })
    local x = helper.randint(helper.rng(5), { 2, 6 }, 13)
    local fresh_out, fresh_logits = m3.infer(w, { device = "cpu", batch = 2 }):step(x)
    local inf = m3.infer(w, { device = "cpu", batch = 2 })
    local out, logits = m3.tensor({ 2, 6, 16 }), m3.tensor({ 2, 13 })
    for i = 0, #logits - 1 do logits[i] = 0 / 0 end -- every element must be overwritten
    local o, l = inf:step(x, { out = out, logits = logits })
    assert.equal(out, o)
    assert.equal(logits, l)
    assert.is_true(same(out, fresh_out))
    assert.is_true(same(logits, fresh_logits))
    local before = inf:states()
    assert.matches("step: opts.logits: expected true, false or an f32 %[2, 13%] tensor, got f64",
      helper.error_of(inf.step, inf, x, { logits = m3.tensor({ 2, 13 }, "f64") }))
    assert.matches("step: opts.out: expected true, false or an f32 %[2, 6, 16%] tensor",
      helper.error_of(inf.step, inf, x, { out = m3.tensor({ 2, 5, 16 }) }))
    assert.is_true(helper.same_states(inf:states(), before), "a refused step leaves the state")
    local plain = m3.infer(m3.weights.init(m3.config(helper.features_none()), { seed = 1 }), { device = "cpu", batch = 2 })
    assert.matches("step: opts.logits: the model's head is \"none\", it has no logits",
      helper.error_of(plain.step, plain, helper.randn(helper.rng(2), { 2, 3, 5 }), { logits = m3.tensor({ 2, 13 }) }))
  end)

  -- a step of B rows (fewer than the batch) returns out [B, T, d_model] and logits [B, vocab]; the caller's tensors must
  -- have those B rows, and resets must be uint8 [B, T]
  it("sizes out, logits and resets by the rows stepped, not by the batch", function()
    local cfg = m3.config(helper.tokens_lm())
    local inf = m3.infer(m3.weights.init(cfg, { seed = 3 }), { device = "cpu", batch = 3 })
    local x = helper.randint(helper.rng(5), { 2, 4 }, 13)
    local out, logits = inf:step(x)
    assert.same({ 2, 4, 16 }, out:shape())
    assert.same({ 2, 13 }, logits:shape())
    local before = inf:states()
    assert.matches("step: opts.out: expected true, false or an f32 %[2, 4, 16%] tensor",
      helper.error_of(inf.step, inf, x, { out = m3.tensor({ 3, 4, 16 }) }))
    assert.matches("step: opts.logits: expected true, false or an f32 %[2, 13%] tensor",
      helper.error_of(inf.step, inf, x, { logits = m3.tensor({ 3, 13 }) }))
    assert.matches("step: resets: expected uint8 %[2, 4%]",
      helper.error_of(inf.step, inf, { tokens = x, resets = m3.tensor({ 2, 5 }, "u8") }))
    assert.matches("step: resets: expected uint8 %[2, 4%]",
      helper.error_of(inf.step, inf, { tokens = x, resets = m3.tensor({ 3, 4 }, "u8") }))
    assert.is_true(helper.same_states(inf:states(), before), "a refused step leaves the state")
  end)

  it("takes max_len from its options", function()
    local w = m3.weights.init(helper.tokens_lm(), { seed = 1 })
    assert.equal(64, m3.infer(w, { device = "cpu", max_len = 64 }):info().max_len)
  end)

  it("steps fewer rows than its batch, resets rows and honours resets", function()
    local cfg = m3.config(helper.tokens_lm())
    local w = m3.weights.init(cfg, { seed = 6 })
    local x = helper.randint(helper.rng(7), { 2, 8 }, 13)
    local a = m3.infer(w, { device = "cpu", batch = 2 })
    local b = m3.infer(w, { device = "cpu", batch = 2 })
    a:step(x)
    b:step(x)
    local before = b:states()
    b:step(helper.rows({ x = x }, 0, 1).x) -- row 0 only
    local after = b:states()
    local per = after[1].ssm:numel() / 2
    assert.equal(helper.bytes(before[1].ssm):sub(per * 4 + 1), helper.bytes(after[1].ssm):sub(per * 4 + 1))
    assert.are_not.equal(helper.bytes(before[1].ssm):sub(1, per * 4), helper.bytes(after[1].ssm):sub(1, per * 4))
    -- a reset at position 3 of row 1 equals a fresh start there
    local resets = m3.tensor({ 2, 8 }, "u8")
    resets[8 + 3] = 1
    a:reset()
    local o = a:step({ tokens = x, resets = resets })
    local fresh = m3.infer(w, { device = "cpu", batch = 1 })
    local o1 = fresh:step(cols(helper.rows({ x = x }, 1, 1).x, 3, 5))
    local o_tail = cols(helper.rows({ x = o }, 1, 1).x, 3, 5)
    assert.is_true(same(o1, o_tail))
    a:reset({ 1 })
    local s = a:states()
    for i = s[1].ssm:numel() / 2, s[1].ssm:numel() - 1 do assert.equal(0, s[1].ssm[i]) end
    -- a table that is not a list of rows is refused, not taken for an empty list
    assert.has_error(function() a:reset({ a = 1 }) end,
      'reset: rows must be a list of 0-based row indices, got a table with key "a"')
    assert.has_error(function() a:reset({ [2] = 1 }) end,
      "reset: rows must be a list of 0-based row indices, got a table with key 2")
  end)

  it("takes over a trainer's state (same batch) and continues the sequence", function()
    local cfg = m3.config(helper.features_none())
    local w = m3.weights.init(cfg, { seed = 8 })
    local rng = helper.rng(9)
    local b1, b2 = helper.batch(cfg, 2, 6, rng), helper.batch(cfg, 2, 6, rng)
    local tr = m3.trainer(w, { device = "cpu", batch = 2, seq_len = 6, carry_state = true })
    tr:forward(b1)
    tr:backward_step(b1.d_out, { accumulate = true })
    local inf = m3.infer(w, { device = "cpu", batch = 2 })
    inf:set_states(tr:states())
    assert.is_true(helper.same_states(inf:states(), tr:states()))
    local _, want = tr:evaluate(b2)
    assert.is_true(helper.rel_l2(inf:step(b2.input), want) <= 1e-6)
    assert.matches("list of 2 layer tables", helper.error_of(inf.set_states, inf, {}))
  end)

  -- inf.config is the user's copy: step once sized out and logits, generate its draws, states() its tensors
  -- and set_states its checks from the table a script could change, and the engine wrote or read past them
  it("sizes every buffer from its own config: changing inf.config changes nothing the object does", function()
    local w = m3.weights.init(m3.config(helper.tokens_lm()), { seed = 12 })
    local inf, ref = m3.infer(w, { device = "cpu", batch = 2 }), m3.infer(w, { device = "cpu", batch = 2 })
    local x = helper.randint(helper.rng(13), { 2, 6 }, 13)
    inf.config.d_model, inf.config.vocab_size, inf.config.d_state, inf.config.input = 1, 100000, 2, "identity"
    assert.matches("d_model 16, n_layers 2, input tokens", tostring(inf))
    local out, logits = inf:step(x)
    local want_out, want_logits = ref:step(x)
    assert.is_true(same(want_out, out))
    assert.is_true(same(want_logits, logits))
    local s = inf:states()
    assert.same({ 2, 4, 8, 8 }, s[1].ssm:shape())
    inf:set_states(s)
    s[2].ssm = m3.tensor({ 2, 4, 8, 2 })
    assert.matches("states%[2%].ssm: expected f32 %[2, 4, 8, 8%], got f32 %[2, 4, 8, 2%]",
      helper.error_of(inf.set_states, inf, s))
    local toks = inf:generate({ { 1, 2 } }, 20, { seed = 1 })
    assert.same(ref:generate({ { 1, 2 } }, 20, { seed = 1 }):to_table(), toks:to_table())
  end)

  it("refuses pointers, whose size the FFI cannot tell, and names the input of an f64 value float32 cannot hold",
    function()
    local ffi = require "ffi"
    local w = m3.weights.init(m3.config(helper.features_none()), { seed = 14 })
    local inf = m3.infer(w, { device = "cpu", batch = 2 })
    local x = helper.randn(helper.rng(15), { 2, 3, 5 })
    local before = inf:states()
    local ptr = ffi.cast("float *", x.data)
    assert.matches("step: input: data is a pointer %(ctype<float %*>%), whose size the FFI cannot tell: pass an FFI "
      .. "array", helper.error_of(inf.step, inf, { input = { data = ptr, shape = { 2, 3, 5 } } }))
    assert.matches("step: input: got a pointer %(ctype<float %*>%)", helper.error_of(inf.step, inf, ptr))
    local resets = ffi.new("uint8_t[6]")
    assert.matches("step: resets: got a pointer %(ctype<unsigned char %*>%)",
      helper.error_of(inf.step, inf, { input = x, resets = ffi.cast("uint8_t *", resets) }))
    local s = inf:states()
    s[1].k = ffi.cast("float *", s[1].k.data)
    assert.matches("set_states: states%[1%].k: got a pointer", helper.error_of(inf.set_states, inf, s))
    local big = m3.tensor.from(x, "f64")
    big[4] = 1e300
    assert.matches("step: input: converting to f32: element 4 = 1e%+300 is outside float32's range",
      helper.error_of(inf.step, inf, big))
    assert.is_true(helper.same_states(before, inf:states()))
  end)

  it("refuses a step or state change whose input closes the object while it is read, instead of using it freed",
    function()
    local w = m3.weights.init(m3.config(helper.tokens_lm()), { seed = 14 })
    local tokens = helper.batch(w.config, 2, 3, helper.rng(15)).tokens
    local closing = helper.closing
    local calls = {
      step = function(inf) return inf:step(closing(inf, { tokens = tokens })) end,
      step_opts = function(inf) return inf:step(tokens, closing(inf, {})) end,
      generate_carry = function(inf) return inf:generate(tokens, 2, closing(inf, { carry = true })) end,
      set_states = function(inf)
        local s = inf:states()
        s[1] = closing(inf, s[1])
        return inf:set_states(s)
      end,
    }
    for name, call in pairs(calls) do
      local inf = m3.infer(w, { device = "cpu", batch = 2 })
      assert.matches("inference object is closed", helper.error_of(call, inf), name)
      assert.equal("m3.infer (closed)", tostring(inf), name)
    end
  end)

  describe("generate", function()
    local cfg = m3.config(helper.tokens_lm({ d_model = 32, d_state = 16, headdim = 16 }))
    local w = m3.weights.init(cfg, { seed = 10 })
    local prompt = m3.tensor.from({ { 1, 2, 3, 4 }, { 5, 6, 7, 8 }, { 9, 10, 11, 12 } }, "i32")

    it("is deterministic for a seed, and a row depends only on its prompt and index", function()
      local inf = m3.infer(w, { device = "cpu", batch = 3 })
      local o = { temperature = 0.9, top_k = 8, top_p = 0.95, seed = 3 }
      local a = inf:generate(prompt, 20, o)
      assert.same({ 3, 20 }, a:shape())
      assert.equal("i32", a:dtype())
      assert.is_true(same(a, inf:generate(prompt, 20, o)))
      o.seed = 4
      assert.is_false(same(a, inf:generate(prompt, 20, o)))
      o.seed = 3
      local single = m3.infer(w, { device = "cpu", batch = 1 })
      assert.is_true(same(single:generate(helper.rows({ x = prompt }, 0, 1).x, 20, o), helper.rows({ x = a }, 0, 1).x))
      local others = prompt:clone() -- rows 0 and 2 replaced: row 1's tokens stay
      for i = 0, 3 do others[i], others[8 + i] = 12 - i, i end
      assert.is_true(same(helper.rows({ x = inf:generate(others, 20, o) }, 1, 1).x, helper.rows({ x = a }, 1, 1).x))
      for i = 0, a:numel() - 1 do assert.is_true(a[i] >= 0 and a[i] < 13) end
    end)

    it("is greedy at temperature 0 (the argmax of the step's logits)", function()
      local inf = m3.infer(w, { device = "cpu", batch = 1 })
      local p = helper.rows({ x = prompt }, 0, 1).x
      local g = inf:generate(p, 1, { temperature = 0 })
      inf:reset()
      local _, logits = inf:step(p)
      local best = 0
      for v = 1, 12 do
        if logits[v] > logits[best] then best = v end
      end
      assert.equal(best, g[0])
      assert.is_true(same(g, inf:generate({ 1, 2, 3, 4 }, 1, { temperature = 0 })))
    end)

    it("stops rows at a stop token and pads them", function()
      local inf = m3.infer(w, { device = "cpu", batch = 3 })
      local free = inf:generate(prompt, 30, { seed = 1, temperature = 1.5 })
      local stop = free[5] -- row 0's sixth token
      local g, lengths = inf:generate(prompt, 30, { seed = 1, temperature = 1.5, stop = stop, pad = -1 })
      local first = nil
      for i = 0, 29 do
        if free[i] == stop then first = first or i end
      end
      assert.equal(first + 1, lengths[1])
      for i = 0, 29 do
        if i < lengths[1] then assert.equal(free[i], g[i]) else assert.equal(-1, g[i]) end
      end
      local d = inf:generate(prompt, 30, { seed = 1, temperature = 1.5, stop = { stop } })
      for i = lengths[1], 29 do assert.equal(stop, d[i]) end -- default pad: the stop token
    end)

    -- generation ends once every row has stopped: the state has then seen the prompt and the tokens drawn up to the
    -- stop token, not n tokens (header of m3.infer)
    it("ends once every row has stopped: the state has seen the prompt and the tokens up to the stop", function()
      local inf = m3.infer(w, { device = "cpu", batch = 1 })
      local p = helper.rows({ x = prompt }, 0, 1).x
      local free = inf:generate(p, 10, { temperature = 0 })
      local stop, first = free[2], nil
      for i = 0, 9 do
        if free[i] == stop then first = first or i end
      end
      local _, lengths = inf:generate(p, 10, { temperature = 0, stop = stop })
      assert.equal(first + 1, lengths[1])
      local ref = m3.infer(w, { device = "cpu", batch = 1 })
      ref:step(p)
      for i = 0, first do ref:step(m3.tensor.from({ { free[i] } }, "i32")) end
      assert.is_true(helper.same_states(ref:states(), inf:states()))
    end)

    it("raises on bad prompts and options and stays usable", function()
      local inf = m3.infer(w, { device = "cpu", batch = 2 })
      inf:step(helper.rows({ x = prompt }, 0, 2).x)
      local before = inf:states()
      local bad = m3.tensor.from({ { 1, 2, 13 } }, "i32")
      assert.matches("generate: prompt row 0, position 2 %(0%-based%) = 13: expected a token id in %[0, 13%)",
        helper.error_of(inf.generate, inf, bad, 4, { carry = true }))
      assert.matches("generate: prompt row 0, position 2 %(0%-based%) = 13: expected a token id in %[0, 13%)",
        helper.error_of(inf.generate, inf, bad, 4))
      -- a table prompt's entries are named as the caller wrote them
      for _, case in ipairs({
        { { { 1, 99 } }, "generate: prompt%[1%]%[2%] = 99: expected a token id in %[0, 13%)" },
        { { 1, 99 }, "generate: prompt%[2%] = 99: expected a token id in %[0, 13%)" },
        { { { 1.5 } }, "generate: prompt%[1%]%[1%] = 1.5: expected a token id in %[0, 13%)" },
        { { { 1 }, { "2" } }, 'generate: prompt%[2%]%[1%] = "2": expected a token id in %[0, 13%)' },
        { { { 1, 2 }, { 3 } }, "generate: prompt%[2%] has 1 tokens, expected 2" },
        { { { 1 }, 2 }, "generate: prompt%[2%]: expected a list of token ids, got a number" },
      }) do
        assert.matches(case[2], helper.error_of(inf.generate, inf, case[1], 4))
      end
      assert.matches("prompt is empty", helper.error_of(inf.generate, inf, {}, 4))
      assert.matches("generate: prompt: tokens: expected int32 %[B, T%], got nil$",
        helper.error_of(inf.generate, inf, nil, 4))
      assert.matches("tokens is empty", helper.error_of(inf.step, inf, m3.tensor({ 1, 0 }, "i32")))
      assert.matches("expected int32 %[B, T%], got f32", helper.error_of(inf.step, inf, m3.tensor({ 1, 3 })))
      assert.matches("expected int32 %[B, T%], got int32 %[1, 3, 1%]",
        helper.error_of(inf.step, inf, m3.tensor({ 1, 3, 1 }, "i32")))
      assert.matches("has 3 rows: expected 1 to 2", helper.error_of(inf.generate, inf, prompt, 4))
      assert.matches("n = 0", helper.error_of(inf.generate, inf, bad, 0))
      assert.matches("generate: n = 2147483648: expected an integer from 1 to 2147483647 %(an int32%)",
        helper.error_of(inf.generate, inf, bad, 2 ^ 31))
      assert.matches("temperature = %-1", helper.error_of(inf.generate, inf, { 1 }, 2, { temperature = -1 }))
      assert.matches("top_p = 0", helper.error_of(inf.generate, inf, { 1 }, 2, { top_p = 0 }))
      assert.matches("generate: stop = 13: expected a token id in %[0, 13%)",
        helper.error_of(inf.generate, inf, { 1 }, 2, { stop = 13 }))
      assert.matches("generate: stop%[2%] = 99: expected a token id",
        helper.error_of(inf.generate, inf, { 1 }, 2, { stop = { 1, 99 } }))
      assert.matches("generate: stop = {...}: expected a token id or a list of token ids",
        helper.error_of(inf.generate, inf, { 1 }, 2, { stop = { a = 1 } }))
      assert.matches('unknown option "sed"', helper.error_of(inf.generate, inf, { 1 }, 2, { sed = 1 }))
      assert.matches("batch.input: not an input", helper.error_of(inf.step, inf, { input = m3.tensor({ 1, 1, 16 }) }))
      assert.is_true(helper.same_states(inf:states(), before))
      assert.equal(3, inf:generate({ 1 }, 3):numel())
    end)

    it("names a non-finite logit as the model's, with its row and token", function()
      local big = m3.weights.init(cfg, { seed = 10 })
      local g = big:get("norm_f.weight")
      for i = 0, g:numel() - 1 do g[i] = 3e38 end -- finite, but the logits overflow float32
      local inf = m3.infer(big, { device = "cpu" })
      assert.matches("generate: the model produced a non%-finite logit in row 0 while drawing token 1 "
        .. "%(are some weights so large that float32 overflows%?%)",
        helper.error_of(inf.generate, inf, { 1, 2 }, 3, { temperature = 0 }))
    end)

    it("needs an lm model, and closed objects raise", function()
      local inf = m3.infer(m3.weights.init(helper.features_none()), { device = "cpu" })
      assert.matches('head is "none"', helper.error_of(inf.generate, inf, { 1 }, 2))
      inf:close()
      inf:close()
      assert.matches("inference object is closed", helper.error_of(inf.step, inf, m3.tensor({ 1, 1, 5 })))
      assert.equal("m3.infer (closed)", tostring(inf))
      for _, name in ipairs { "close", "step" } do -- close raised "attempt to index local 'box'"
        assert.matches("^[^:]*infer_spec%.lua:%d+: m3%.infer: expected an inference object %(call methods with ':'%), "
          .. "got {}$",
          helper.error_of(function() inf[name]({}) end), name)
      end
    end)
  end)

  describe("m3.sampling", function()
    local ffi = require "ffi"
    local V, R = 5, 4000
    local lg = ffi.new("float[?]", R * V)
    for r = 0, R - 1 do
      for v = 0, V - 1 do lg[r * V + v] = ({ 1.0, 3.0, 2.0, 3.0, -1.0 })[v + 1] end
    end

    local function counts(opts)
      local out = ffi.new("int32_t[?]", R)
      m3.sampling.new(R, opts, "test"):draw(lg, V, out)
      local c = { [0] = 0, 0, 0, 0, 0 }
      for r = 0, R - 1 do c[out[r]] = c[out[r]] + 1 end
      return c, out
    end

    it("draws from softmax(logits / temperature), restricted by top_k and top_p", function()
      local c = counts({ seed = 1 })
      local z = math.exp(1) + 2 * math.exp(3) + math.exp(2) + math.exp(-1)
      for v, l in ipairs({ 1.0, 3.0, 2.0, 3.0, -1.0 }) do
        local p = math.exp(l) / z
        assert.is_true(math.abs(c[v - 1] / R - p) < 4 * math.sqrt(p * (1 - p) / R), "token " .. (v - 1))
      end
      assert.same({ [0] = 0, R, 0, 0, 0 }, (counts({ temperature = 0 }))) -- ties: the lowest id
      assert.same({ [0] = 0, R, 0, 0, 0 }, (counts({ top_k = 1, seed = 2 })))
      local k2 = counts({ top_k = 2, seed = 3 }) -- the two 3.0 logits, equally likely
      assert.equal(R, k2[1] + k2[3])
      assert.is_true(math.abs(k2[1] - R / 2) < 4 * math.sqrt(R / 4))
      local p = counts({ top_p = 0.5, seed = 4 }) -- {1, 3} hold 0.79 of the mass, 1 alone 0.40
      assert.equal(R, p[1] + p[3])
      local cold = counts({ temperature = 0.05, top_p = 0.99, seed = 5 })
      assert.equal(R, cold[1] + cold[3])
    end)

    -- The exact distribution of the sampler's rule for the logits in lg (float64 of their float32 values):
    -- order by logit then id, keep top_k, weights exp((l - max) / temperature), keep the shortest prefix
    -- reaching top_p of their sum, renormalise.
    local function expected(opts)
      local ids = {}
      for v = 0, V - 1 do ids[v + 1] = v end
      table.sort(ids, function(a, b) return lg[a] > lg[b] or (lg[a] == lg[b] and a < b) end)
      local k = (opts.top_k or 0) > 0 and math.min(opts.top_k, V) or V
      local w, total = {}, 0
      for j = 1, k do
        w[j] = math.exp((lg[ids[j]] - lg[ids[1]]) / (opts.temperature or 1))
        total = total + w[j]
      end
      local kept, acc = k, 0
      for j = 1, k do
        acc = acc + w[j]
        if acc >= (opts.top_p or 1) * total then kept = j break end
      end
      local p, sum = {}, 0
      for v = 0, V - 1 do p[v] = 0 end
      for j = 1, kept do sum = sum + w[j] end
      for j = 1, kept do p[ids[j]] = w[j] / sum end
      return p
    end

    it("draws each token as often as its probability under temperature, top_k and top_p (chi-square)", function()
      for _, opts in ipairs({ { temperature = 0.5, seed = 11 }, { temperature = 2.5, seed = 12 },
                              { top_k = 3, temperature = 1.5, seed = 13 }, { top_p = 0.9, temperature = 2, seed = 14 },
                              { top_k = 4, top_p = 0.8, temperature = 3, seed = 15 } }) do
        local c, p = counts(opts), expected(opts)
        local chi2, cells = 0, 0
        for v = 0, V - 1 do
          if p[v] == 0 then
            assert.equal(0, c[v], "token " .. v .. " is outside the kept set")
          else
            chi2, cells = chi2 + (c[v] - R * p[v]) ^ 2 / (R * p[v]), cells + 1
          end
        end
        -- 25 is far in the tail for at most 4 degrees of freedom (p < 1e-4), never reached by a right sampler
        assert.is_true(cells >= 3 and chi2 < 25, string.format("%s: chi-square %.1f over %d tokens",
          m3.json.encode(opts), chi2, cells))
      end
    end)

    it("draws among the largest logits only at temperatures whose inverse overflows a float", function()
      for _, t in ipairs({ 1e-30, 1e-39, 1e-300, 5e-324 }) do
        for _, opts in ipairs({ { temperature = t, seed = 7 }, { temperature = t, top_k = 3, seed = 7 },
                                 { temperature = t, top_p = 0.9, seed = 7 } }) do
          local c = counts(opts)
          assert.equal(R, c[1] + c[3], "temperature " .. t)
          assert.is_true(c[1] > R / 4 and c[3] > R / 4, "temperature " .. t .. ": both ties drawn")
        end
      end
    end)

    it("draws with top_p from finite logits spread wider than the largest float", function()
      local wide = ffi.new("float[3]", { 3e38, -3e38, 0 })
      local out = ffi.new("int32_t[1]")
      for seed = 1, 20 do
        m3.sampling.new(1, { top_p = 0.5, seed = seed }, "test"):draw(wide, 3, out)
        assert.equal(0, out[0])
      end
    end)

    it("draws about evenly at temperatures so high that their inverse rounds to 0 in float, logits spread wider "
      .. "than the largest float included", function()
      local FLT_MAX = 3.4028234663852886e38
      local wide = ffi.new("float[?]", 2 * R)
      for r = 0, R - 1 do wide[2 * r], wide[2 * r + 1] = FLT_MAX, -FLT_MAX end
      local out = ffi.new("int32_t[?]", R)
      for _, opts in ipairs({ { temperature = 1e300, seed = 8 }, { temperature = 1e300, top_k = 2, seed = 8 },
                              { temperature = 1e46, top_p = 0.9, seed = 8 } }) do
        m3.sampling.new(R, opts, "test"):draw(wide, 2, out)
        local ones = 0
        for r = 0, R - 1 do ones = ones + out[r] end
        assert.is_true(math.abs(ones - R / 2) < 4 * math.sqrt(R / 4),
          string.format("temperature %g, top_k %d: id 1 drawn %d times of %d", opts.temperature, opts.top_k or 0,
            ones, R))
      end
    end)

    it("checks its arguments, names them, and draws from logits and out given as tensors", function()
      for _, case in ipairs({
        { { 2, { temp = 0 } }, 'm3.sampling: unknown option "temp"; valid options: seed, temperature, top_k, top_p' },
        { { 2, 5 }, "m3.sampling: opts must be a table, got number" },
        { { 0 }, "m3.sampling: rows = 0: expected an integer >= 1" },
        { { 1.5 }, "m3.sampling: rows = 1.5: expected an integer >= 1" },
        { { nil, {}, "test" }, "test: rows = nil: expected an integer >= 1" },
        { { 2, { temperature = -1 } }, "m3.sampling: temperature = %-1" },
      }) do
        assert.matches(case[2], helper.error_of(m3.sampling.new, unpack(case[1], 1, 3)))
      end
      local s = m3.sampling.new(R, { seed = 1 })
      local logits, out = m3.tensor({ R, V }), m3.tensor({ R }, "i32")
      ffi.copy(logits.data, lg, 4 * R * V)
      assert.matches("m3.sampling: draw: logits: expected an f32 tensor of 20000 elements or an FFI pointer to "
        .. "float, got f32 %[4000, 4%]", helper.error_of(s.draw, s, m3.tensor({ R, V - 1 }), V, out))
      assert.matches("m3.sampling: draw: out: expected an int32 tensor of 4000 elements or an FFI pointer to "
        .. "int32_t, got f32 %[4000%]", helper.error_of(s.draw, s, logits, V, m3.tensor({ R })))
      assert.matches("m3.sampling: draw: out: expected an int32 tensor of 4000 elements or an FFI pointer to "
        .. "int32_t, got nil",
        helper.error_of(s.draw, s, logits, V, nil))
      assert.matches("m3.sampling: draw: vocab = 0: expected an integer >= 1",
        helper.error_of(s.draw, s, logits, 0, out))
      s:draw(logits, V, out)
      local _, want = counts({ seed = 1 })
      assert.equal(ffi.string(want, 4 * R), ffi.string(out.data, 4 * R))
    end)

    it("names a bad what, too many rows, a bad nonfinite or self, and a pointer of another type", function()
      -- each failed inside before: a concatenation, "size of C type is unknown or too large", "attempt to
      -- call", error(nil), "cannot convert", "attempt to index local 'self'"
      assert.equal("m3.sampling: what = true: expected the name that begins its messages (a string)",
        helper.error_of(m3.sampling.new, 2, {}, true))
      assert.matches("^m3%.sampling: rows = 2147483647: the rows' generators %(32 bytes a row%) cannot be allocated",
        helper.error_of(m3.sampling.new, 2 ^ 31 - 1))
      local s = m3.sampling.new(2, { seed = 1 })
      local logits, out = m3.tensor.from({ { 1, 2, 0 / 0 }, { 1, 2, 3 } }, "f32"), m3.tensor({ 2 }, "i32")
      assert.equal("m3.sampling: draw: nonfinite = true: expected a function (row -> the message)",
        helper.error_of(s.draw, s, logits, 3, out, true))
      assert.equal("m3.sampling: draw: row 0 of the logits holds a non-finite value, and nonfinite(0) returned nil "
        .. "instead of its message (a string)", helper.error_of(s.draw, s, logits, 3, out, function() end))
      assert.equal("row 0 is bad", helper.error_of(s.draw, s, logits, 3, out, function(r) return "row " .. r
        .. " is bad" end))
      assert.equal("m3.sampling: draw: logits: expected an f32 tensor of 6 elements or an FFI pointer to float, got "
        .. "ctype<int64_t>", helper.error_of(s.draw, s, 5LL, 3, out))
      assert.equal("m3.sampling: draw: out: expected an int32 tensor of 2 elements or an FFI pointer to int32_t, got "
        .. "ctype<float [2]>", helper.error_of(s.draw, s, logits, 3, ffi.new("float[2]")))
      assert.equal("m3.sampling: draw: logits: a NULL pointer", helper.error_of(s.draw, s, ffi.new("float *"), 3, out))
      assert.equal("m3.sampling: draw: expected a sampler (m3.sampling.new) (call it as s:draw(logits, vocab, out, "
        .. "nonfinite)), got nil", helper.error_of(s.draw, nil, logits, 3, out))
      logits[2] = 0
      s:draw(logits, 3, out)
    end)

    it("refuses non-finite logits and leaves the generators as they were", function()
      local s = m3.sampling.new(2, { seed = 1 }, "test")
      local bad = ffi.new("float[10]")
      bad[7] = 0 / 0
      local out = ffi.new("int32_t[2]")
      assert.matches("row 1 of the logits holds a non%-finite value", helper.error_of(s.draw, s, bad, 5, out))
      bad[7] = 0
      s:draw(bad, 5, out)
      local fresh = m3.sampling.new(2, { seed = 1 }, "test")
      local out2 = ffi.new("int32_t[2]")
      fresh:draw(bad, 5, out2)
      assert.equal(ffi.string(out, 8), ffi.string(out2, 8))
    end)

    -- nonfinite(row) words the error: each row's logits are searched to their last entry
    it("names the row of a non-finite logit through nonfinite, the last of a row included", function()
      local out = ffi.new("int32_t[2]")
      for _, case in ipairs({ { 4, math.huge, 0 }, { 9, -math.huge, 1 }, { 5, 0 / 0, 1 }, { 0, 0 / 0, 0 } }) do
        local bad = ffi.new("float[10]")
        bad[case[1]] = case[2]
        local s = m3.sampling.new(2, { seed = 1 }, "test")
        assert.matches("bad row " .. case[3] .. "$",
          helper.error_of(s.draw, s, bad, 5, out, function(r) return "bad row " .. r end))
      end
    end)

    -- the ends of the ranges are the options' "off" values: top_k = 0 keeps all, top_p = 1 all the mass
    it("takes top_k = 0 and top_p = 1, the defaults, and draws as without them", function()
      local _, plain = counts({ seed = 9 })
      local _, off = counts({ seed = 9, top_k = 0, top_p = 1 })
      assert.equal(ffi.string(plain, 4 * R), ffi.string(off, 4 * R))
      assert.matches("test: top_k = %-1", helper.error_of(m3.sampling.new, 2, { top_k = -1 }, "test"))
      assert.matches("test: top_p = 1%.5", helper.error_of(m3.sampling.new, 2, { top_p = 1.5 }, "test"))
    end)

    it("gives the same tokens for any thread count", function()
      local threads = m3.cpu_threads()
      local _, a = counts({ top_k = 3, top_p = 0.9, seed = 6 })
      m3.cpu_threads(1)
      local _, b = counts({ top_k = 3, top_p = 0.9, seed = 6 })
      m3.cpu_threads(threads)
      assert.equal(ffi.string(a, 4 * R), ffi.string(b, 4 * R))
    end)
  end)

  describe("m3.pytorch", function()
    for _, tied in ipairs({ true, false }) do
      it("export then import gives the same bits (tie_embeddings " .. tostring(tied) .. ")", function()
        local cfg = m3.config(helper.tokens_lm({ tie_embeddings = tied, outproj_norm = not tied, ngroups = 2 }))
        local w = m3.weights.init(cfg, { seed = 12 })
        local dir = helper.tmpname("-export")
        m3.pytorch.export(w, dir)
        local tensors, meta = m3.load_tensors(dir .. "/model.safetensors")
        assert.equal("pt", meta.format)
        assert.is_not_nil(tensors["backbone.layers.1.mixer.in_proj.weight"])
        assert.is_not_nil(tensors["backbone.norm_f.weight"])
        assert.is_true(same(tensors["lm_head.weight"], w:get(tied and "embedding.weight" or "lm_head.weight")))
        local conf = m3.json.decode(m3.fs.read(dir .. "/config.json"))
        assert.equal("Mamba3", conf.ssm_cfg.layer)
        assert.equal(2, conf.n_layer)
        assert.equal(tied, conf.tie_embeddings)
        local back = m3.pytorch.import(dir)
        assert.is_true(helper.same_weights(back, w))
        assert.same(cfg, back.config)
        os.remove(dir .. "/model.safetensors")
        os.remove(dir .. "/config.json")
      end)
    end

    it("refuses models the public LM cannot hold, and foreign configs", function()
      assert.matches('needs input "tokens" and head "lm"',
        helper.error_of(m3.pytorch.export, m3.weights.init(helper.features_none()), helper.tmpname()))
      local dir = helper.tmpname("-bad")
      m3.fs.mkdir(dir)
      m3.fs.write(dir .. "/config.json", '{"d_model": 16, "n_layer": 2, "vocab_size": 13, "ssm_cfg": {"layer": "Mamba2"}}')
      assert.matches('ssm_cfg.layer must be "Mamba3"', helper.error_of(m3.pytorch.import, dir))
      os.remove(dir .. "/config.json")
      -- a config.json that cannot be read: the file named once, with why
      assert.equal("m3.pytorch.import: " .. dir .. "/config.json: No such file or directory",
        helper.error_of(m3.pytorch.import, dir))
      m3.fs.mkdir(dir .. "/config.json")
      assert.equal("m3.pytorch.import: " .. dir .. "/config.json is a folder, not a regular file",
        helper.error_of(m3.pytorch.import, dir))
      os.remove(dir .. "/config.json")
      -- each field the LM loader cannot honour is named with its value; JSON null counts as absent
      local good = m3.pytorch.config_json(m3.config(helper.tokens_lm()))
      local function refused(pattern, edit)
        local t = m3.json.decode(m3.json.encode(good))
        edit(t)
        assert.matches(pattern, helper.error_of(m3.pytorch.config_from_json, t))
      end
      refused("^.-m3.pytorch.config_from_json: attn_layer_idx = 5: must be an empty list",
        function(t) t.attn_layer_idx = 5 end)
      refused("attn_layer_idx = a non%-empty table", function(t) t.attn_layer_idx = { ["0"] = 1 } end)
      refused("pad_vocab_size_multiple = 0: must be an integer >= 1", function(t) t.pad_vocab_size_multiple = 0 end)
      refused("pad_vocab_size_multiple = %-3: must be an integer >= 1", function(t) t.pad_vocab_size_multiple = -3 end)
      refused("ssm_cfg.is_mimo = 0: m3lua trains the SISO layer only", function(t) t.ssm_cfg.is_mimo = 0 end)
      assert.matches("m3.pytorch.config_from_json: expected a JSON object, got nil",
        helper.error_of(m3.pytorch.config_from_json, nil))
      good.ssm_cfg.is_mimo = m3.json.null
      assert.equal(good.d_model, m3.pytorch.config_from_json(good).d_model)
    end)

    it("names <dir>/config.json and the field in import's errors, and the defaults taken when the weights do not fit",
      function()
      local dir = helper.tmpname("-fields")
      local w = m3.weights.init(m3.config(helper.tokens_lm()), { seed = 3 })
      m3.pytorch.export(w, dir)
      local good = m3.fs.read(dir .. "/config.json")
      local file = dir .. "/config.json"
      for _, case in ipairs {
        { function(t) t.vocab_size = nil end, file .. ": vocab_size is required" },
        { function(t) t.n_layer = nil end, file .. ": n_layer is required" },
        { function(t) t.d_model = nil end, file .. ": d_model is required" },
        { function(t) t.d_model = "16" end, file .. ': m3.config: d_model = "16": expected an integer' },
        { function(t) t.vocab_size = 1 end, file .. ": m3: vocab_size = 1: " },
        { function(t) t.tie_embeddings = m3.json.null end,
          file .. ": m3.config: tie_embeddings = null: expected a boolean" },
        { function(t) t.pad_vocab_size_multiple = nil end,
          "m3.pytorch.import: m3: " .. dir .. "/model.safetensors: tensor backbone.embedding.weight: expected shape "
          .. "[16, 16], got [13, 16] (weights_io.c:109); " .. file
          .. " leaves out pad_vocab_size_multiple (the public default 8 pads vocab_size 13 to 16)" },
        { function(t) t.ssm_cfg.d_state, t.ssm_cfg.expand = nil, nil end,
          "; " .. file .. " leaves out ssm_cfg.d_state (the public default 128), "
          .. "ssm_cfg.expand (the public default 2)" },
        { function(t) t.ssm_cfg.headdim = nil end, file .. ": m3: headdim = 64: must divide d_inner = expand * d_model "
          .. "= 32 (config.c:54); it leaves out ssm_cfg.headdim (the public default 64)" },
      } do
        local t = m3.json.decode(good)
        case[1](t)
        m3.fs.write(file, m3.json.encode(t))
        local ok, err = pcall(function() m3.pytorch.import(dir) end)
        assert.is_false(ok)
        assert.matches("^[^:]*infer_spec%.lua:%d+: ", err)
        assert.truthy(err:find(case[2], 1, true), err)
      end
      local t = m3.json.decode(good)
      t.ssm_cfg.d_state = 8.5
      assert.matches("^[^:]*infer_spec%.lua:%d+: m3%.pytorch%.config_from_json: m3%.config: d_state = 8%.5",
        helper.error_of(function() m3.pytorch.config_from_json(t) end))
      m3.fs.write(file, good)
      assert.is_true(helper.same_weights(m3.pytorch.import(dir), w))
      os.execute("rm -rf '" .. dir .. "'")
    end)

    it("names bad arguments at the caller's line", function()
      local w = m3.weights.init(m3.config(helper.tokens_lm()), { seed = 1 })
      local file = helper.tmpname("-file")
      m3.fs.write(file, "x")
      for _, case in ipairs {
        { function() m3.pytorch.export(w, file) end,
          "m3.pytorch.export: cannot write into " .. file .. ": it exists and is not a folder" },
        { function() m3.pytorch.export(w, nil) end, "m3.pytorch.export: expected a folder path, got nil" },
        { function() m3.pytorch.export(nil, file) end, "m3.pytorch.export: expected weights (m3.weights), got nil" },
        { function() m3.pytorch.import(file) end, "m3.pytorch.import: there is no folder " .. file },
        { function() m3.pytorch.import(nil) end, "m3.pytorch.import: expected a folder path, got nil" },
        { function() m3.pytorch.config_json(m3.config(helper.features_none())) end,
          'm3.pytorch.config_json: the public LM needs input "tokens" and head "lm"' },
        { function() m3.pytorch.config_json(nil) end, "m3.config: expected a table, got nil" },
        { function() m3.pytorch.config_from_json({}, 5) end, "m3.pytorch.config_from_json: dir = 5" },
      } do
        local ok, err = pcall(case[1])
        assert.is_false(ok)
        assert.matches("^[^:]*infer_spec%.lua:%d+: ", err)
        assert.truthy(err:find(case[2], 1, true), err)
      end
    end)

    it("scripts report a bad input or output by its message alone (no file:line, no traceback), status 2; --help: 0",
      function()
      local m3lua = os.getenv("M3LUA") or helper.repo_dir() .. "/build/m3lua"
      local errfile = helper.tmpname("-stderr")
      -- m3lua's stderr (one line) and its status for a script and its arguments
      local function run(script, ...)
        local cmd = { m3lua, helper.repo_dir() .. "/scripts/" .. script, ... }
        for i, a in ipairs(cmd) do cmd[i] = "'" .. a:gsub("'", "'\\''") .. "'" end
        local ok, _, rc = os.execute(table.concat(cmd, " ") .. " >/dev/null 2>" .. errfile)
        local err = io.open(errfile):read("*a")
        return err:match("^(.-)\n$") or err, type(ok) == "number" and ok / 256 or rc
      end
      local src = helper.tmpname(".safetensors")
      m3.weights.init(m3.config(helper.tokens_lm()), { seed = 1 }):save(src)
      local file = helper.tmpname("-file")
      m3.fs.write(file, "x")
      local err, rc = run("export_pytorch.lua", src, file)
      assert.equal("export_pytorch.lua: m3.pytorch.export: cannot write into " .. file
        .. ": it exists and is not a folder", err)
      assert.equal(2, rc)
      err, rc = run("export_pytorch.lua", file .. "-missing", helper.tmpname())
      assert.equal("export_pytorch.lua: m3.infer.load_weights: " .. file .. "-missing: no such file; expected a "
        .. "weights file (w:save) or a trainer checkpoint (tr:save)", err)
      assert.equal(2, rc)
      err, rc = run("import_pytorch.lua", file, helper.tmpname())
      assert.equal("import_pytorch.lua: m3.pytorch.import: there is no folder " .. file, err)
      assert.equal(2, rc)
      err, rc = run("import_pytorch.lua", file)
      assert.equal("expected 2 arguments, got 1\nusage: m3lua scripts/import_pytorch.lua <dir> <weights.safetensors>", err)
      assert.equal(2, rc)
      err, rc = run("export_pytorch.lua", "--help")
      assert.same({ "", 0 }, { err, rc })
    end)
  end)
end)

describe("m3.infer on CUDA #gpu", function()
  for _, dtype in ipairs({ "f32", "bf16" }) do
    it("steps token by token (graph replays) like the whole window and the CPU in " .. dtype, function()
      if not helper.need_gpu(pending) then return end
      local cfg = m3.config(helper.tokens_lm({ d_model = 32, d_state = 16, headdim = 16 }))
      local w = m3.weights.init(cfg, { seed = 20 })
      local x = helper.randint(helper.rng(21), { 3, 12 }, 13)
      local whole = m3.infer(w, { device = "cuda", dtype = dtype, batch = 3 })
      local out, logits = whole:step(x)
      local graphed = m3.infer(w, { device = "cuda", dtype = dtype, batch = 3 })
      assert.is_true(graphed:info().graph)
      local o, l = token_by_token(graphed, x)
      local eager = m3.infer(w, { device = "cuda", dtype = dtype, batch = 3, graph = false })
      local oe, le = token_by_token(eager, x)
      assert.is_true(same(o, oe), "graph replay = eager")
      assert.is_true(same(l, le))
      local tol = dtype == "f32" and 1e-5 or 2e-2
      assert.is_true(helper.rel_l2(o, out) <= tol)
      assert.is_true(helper.rel_l2(l, logits) <= tol)
      local cpu_out, cpu_logits = m3.infer(w, { device = "cpu", batch = 3 }):step(x)
      assert.is_true(helper.rel_l2(out, cpu_out) <= tol, "vs CPU " .. helper.rel_l2(out, cpu_out))
      assert.is_true(helper.rel_l2(logits, cpu_logits) <= tol)
      local pieces = m3.infer(w, { device = "cuda", dtype = dtype, batch = 3, max_len = 5 })
      assert.is_true(helper.rel_l2(pieces:step(x), out) <= tol)
    end)
  end

  it("runs prompts longer than one chunk (the chunked scan in bf16) like the CPU and token by token", function()
    if not helper.need_gpu(pending) then return end
    local cfg = m3.config(helper.tokens_lm({ d_model = 32, d_state = 16, headdim = 16 }))
    local w = m3.weights.init(cfg, { seed = 22 })
    local x = helper.randint(helper.rng(23), { 2, 150 }, 13)
    local out, logits = m3.infer(w, { device = "cuda", dtype = "bf16", batch = 2 }):step(x)
    local cpu_out, cpu_logits = m3.infer(w, { device = "cpu", batch = 2 }):step(x)
    assert.is_true(helper.rel_l2(out, cpu_out) <= 2e-2, "vs CPU " .. helper.rel_l2(out, cpu_out))
    assert.is_true(helper.rel_l2(logits, cpu_logits) <= 2e-2)
    local o, l = token_by_token(m3.infer(w, { device = "cuda", dtype = "bf16", batch = 2 }), x)
    assert.is_true(helper.rel_l2(o, out) <= 2e-2)
    assert.is_true(helper.rel_l2(l, logits) <= 2e-2)
    local pieces = m3.infer(w, { device = "cuda", dtype = "bf16", batch = 2, max_len = 70 })
    assert.is_true(helper.rel_l2(pieces:step(x), out) <= 2e-2)
  end)

  it("generates deterministically and takes a CUDA trainer's state", function()
    if not helper.need_gpu(pending) then return end
    local cfg = m3.config(helper.tokens_lm({ d_model = 32, d_state = 16, headdim = 16 }))
    local w = m3.weights.init(cfg, { seed = 22 })
    local inf = m3.infer(w, { device = "cuda", batch = 2 })
    local p = helper.randint(helper.rng(23), { 2, 5 }, 13)
    local a = inf:generate(p, 16, { seed = 7, top_k = 5 })
    assert.is_true(same(a, inf:generate(p, 16, { seed = 7, top_k = 5 })))
    local tr = m3.trainer(w, { device = "cuda", batch = 2, seq_len = 5, carry_state = true })
    local b = helper.batch(cfg, 2, 5, helper.rng(24))
    tr:evaluate(b)
    tr:step(b)
    inf:set_states(tr:states())
    assert.is_true(helper.same_states(inf:states(), tr:states()))
    assert.matches("^cuda:%d+$", inf:device())
    assert.is_true(inf:info().device_bytes > 0)
  end)
end)

-- Golden parity (../shared/golden, SPEC.md §8): for each case, load the config, parameters,
-- inputs and incoming states, run forward + backward_step({accumulate = true}) (the window
-- stays open, so nothing is updated) and compare out, loss, every gradient and the final
-- states with the float64 reference by relative L2 error.
-- M3_TEST_DEVICE (default "cpu") and M3_TEST_DTYPE (default "f32") choose the trainer; bf16
-- and f16 use the SPEC.md §8 bf16 tolerances (out ≤ 2e-2, gradient cosine ≥ 0.99; states
-- and loss: 2e-2, our choice). f16 cannot accumulate, so there the backward_step closes the
-- window (an update at loss scale 1) and grads() still holds the window's gradients.
-- "lm" cases also check the golden logits [B, T, vocab], every position, through m3.infer
-- (same device and dtype, the case's incoming states, its resets) at the out tolerance: the
-- window stepped one token at a time (inf:step's logits, the last position's, are position
-- t's; all of them as one tensor and each position alone), then stepped whole (its last
-- position).

local m3 = require "m3"
local helper = require "spec.helper"

local device = os.getenv("M3_TEST_DEVICE") or "cpu"
local dtype = os.getenv("M3_TEST_DTYPE") or "f32"
local on_gpu = device ~= "cpu"

local TOL = {
  f32 = { out = 1e-5, loss = 1e-5, grad_rel = 1e-4, state = 1e-5 },
  bf16 = { out = 2e-2, loss = 2e-2, grad_cos = 0.99, state = 2e-2 },
}
TOL.f16 = TOL.bf16
local tol = assert(TOL[dtype], "M3_TEST_DTYPE must be f32, bf16 or f16")

local dir = helper.shared_dir() .. "/golden"

local function cases()
  local list = {}
  local p = io.popen('ls -1 "' .. dir .. '" 2>/dev/null')
  for name in p:lines() do
    if name:match("%.safetensors$") then list[#list + 1] = name end
  end
  p:close()
  table.sort(list)
  return list
end

local function meta_int(json, key)
  return tonumber(json:match('"' .. key .. '"%s*:%s*(%-?%d+)'))
end

local function check_rel(what, got, ref, limit)
  local e = helper.rel_l2(got, ref)
  assert.is_true(e <= limit, string.format("%s: relative L2 error %.3g > %g", what, e, limit))
end

-- Angles live in [0, 2π): compare by the wrapped difference, so a value that crossed 2π on
-- one side only counts by how far it really is.
local function check_angle(what, got, ref, limit)
  local num, den = 0, 0
  for i = 0, ref:numel() - 1 do
    local d = (got[i] - ref[i] + math.pi) % (2 * math.pi) - math.pi
    num, den = num + d * d, den + ref[i] * ref[i]
  end
  local e = den > 0 and math.sqrt(num / den) or math.sqrt(num)
  assert.is_true(e <= limit, string.format("%s: relative L2 error (wrapped) %.3g > %g", what, e, limit))
end

-- Positions [t0, t0 + n) of every row of the reference logits [B, T, V], as [B, n, V] (f64).
local function positions(ref, t0, n)
  local s = ref:shape()
  local B, T, V = s[1], s[2], s[3]
  local c = m3.tensor({ B, n, V }, "f64")
  for r = 0, B - 1 do
    for t = 0, n - 1 do
      for v = 0, V - 1 do c[(r * n + t) * V + v] = ref[(r * T + t0 + t) * V + v] end
    end
  end
  return c
end

local function check_logits(w, cfg, t, B, T, incoming)
  local inf = m3.infer(w, { device = device, dtype = dtype, batch = B })
  local function start()
    inf:reset()
    if incoming then inf:set_states(incoming) end
  end
  local V = cfg.vocab_size
  local x = { tokens = t.tokens, input = t.input, resets = t.resets }
  if cfg.input == "tokens" then x.input = nil else x.tokens = nil end
  local ref = assert(t.logits, "missing logits")

  start()
  local got = m3.tensor({ B, T, V }, "f64")
  for s = 0, T - 1 do
    local _, logits = inf:step(helper.window(x, s, 1))
    for r = 0, B - 1 do
      for v = 0, V - 1 do got[(r * T + s) * V + v] = logits[r * V + v] end
    end
    check_rel(string.format("logits (stepped), position %d", s), positions(got, s, 1), positions(ref, s, 1), tol.out)
  end
  check_rel("logits (stepped token by token)", got, ref, tol.out)

  start()
  local _, last = inf:step(x)
  check_rel("logits (whole window, last position)", last, positions(ref, T - 1, 1), tol.out)
  inf:close()
end

local function run_case(file)
  local t, meta = m3.load_tensors(dir .. "/" .. file)
  local json = assert(meta.config, "no config metadata")
  local cfg = m3.config_from_json(json)
  local B, T = meta_int(json, "batch"), meta_int(json, "seq_len")
  local stateful = meta_int(json, "stateful") == 1

  local w = m3.weights.create(cfg)
  for _, name in ipairs(w:names()) do
    w:set(name, assert(t["param." .. name], "missing param." .. name))
  end
  local tr = m3.trainer(w, { device = device, dtype = dtype, batch = B, seq_len = T, carry_state = stateful })
  local incoming
  if stateful then
    incoming = {}
    for l = 1, cfg.n_layers do
      incoming[l] = {}
      for _, k in ipairs({ "angle", "ssm", "k", "v" }) do incoming[l][k] = t[string.format("init.%d.%s", l - 1, k)] end
    end
    tr:set_states(incoming)
  end

  local batch = { input = t.input, tokens = t.tokens, resets = t.resets }
  if cfg.head == "lm" then batch.targets = t.targets end
  if cfg.head == "mse" then batch.targets = t.targets end
  if cfg.head == "none" then batch.d_out = t.d_out end

  -- f16 cannot keep a window open; its step runs at loss scale 1 so the gradients are exact
  if dtype == "f16" then tr:load_scaler_state(1, 0) end
  local out = tr:forward(batch)
  local m = tr:backward_step(batch, { accumulate = dtype ~= "f16" })
  check_rel("out", out, t.out, tol.out)
  if cfg.head == "lm" then check_rel("loss", { m.loss }, t.loss, tol.loss) end

  local grads = tr:grads()
  for _, name in ipairs(grads:names()) do
    local ref = assert(t["grad." .. name], "missing grad." .. name)
    if tol.grad_rel then
      check_rel("grad." .. name, grads:get(name), ref, tol.grad_rel)
    else
      local c = helper.cosine(grads:get(name), ref)
      assert.is_true(c >= tol.grad_cos, string.format("grad.%s: cosine %.5f < %g", name, c, tol.grad_cos))
    end
  end

  local states = tr:states()
  for l = 1, cfg.n_layers do
    for _, k in ipairs({ "angle", "ssm", "k", "v" }) do
      local name = string.format("final.%d.%s", l - 1, k)
      local check = k == "angle" and check_angle or check_rel
      check(name, states[l][k], t[name], tol.state)
    end
  end
  tr:close()
  if cfg.head == "lm" then check_logits(w, cfg, t, B, T, incoming) end
end

describe(string.format("golden parity (%s %s)%s", device, dtype, on_gpu and " #gpu" or ""), function()
  local list = cases()
  if #list == 0 then
    it("runs the golden cases", function() pending("skipped: no ../shared/golden") end)
    return
  end
  for _, file in ipairs(list) do
    it(file, function()
      if on_gpu and m3.cuda_device_count() == 0 then
        pending("skipped: no CUDA device")
        return
      end
      run_case(file)
    end)
  end
end)

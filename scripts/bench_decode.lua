-- scripts/bench_decode.lua — decode speed of m3.infer: one-token steps from a carried state
-- (the CUDA-graph replay on a GPU), median µs per step and tokens/s (rows per step / time),
-- for the rl model (B 1, B 64) and lm130 (B 1, B 128), bf16 and f32.
--
--   m3lua scripts/bench_decode.lua [--configs rl,lm130] [--dtypes bf16,f32] [--device cuda|cpu]
--                                  [--steps N]
--   m3lua scripts/bench.lua --decode [same flags]
--
-- Columns: "fused" says whether a one-token step runs as one launch (decode_fused.cu: small
-- models on CUDA); "step" is the engine step alone (out and logits stay on the device); "+logits"
-- adds copying the [B, vocab] logits to the host into one reused tensor ("lm" only; a new tensor
-- per step adds its zero fill and page faults: a [128, 50280] copy took 25.7 ms with a new tensor,
-- 7.4 ms into a reused one, on the 2-core development machine); "generate" is inf:generate with
-- temperature sampling on the host (tokens/s over the rows, prompt excluded), measured over a
-- few tokens. The rl model has input "identity" and head "none" (d_model 128, 4 layers,
-- d_state 16, headdim 16); lm130 is the preset (tokens, tied "lm" head over 50280 tokens).
-- Bars (bf16, GPU): rl B 1 <= 30 µs per step, lm130 B 128 <= 1000 µs per step.
-- On the CPU (the default without a GPU) it times f32 only, with fewer steps, lm130 at B 1 only;
-- the CPU reports no device memory ("-" in the mem column).
-- Exit status: 2 for a bad flag or a device / dtype that cannot run here (--device cuda without
-- a GPU; bf16 or f16 on the CPU, which computes in f32 only), 130 / 143 on Ctrl-C / SIGTERM,
-- which stop it at once, 1 when a row FAILED, else 0.

local ffi = require "ffi"
io.stdout:setvbuf("line")
local m3 = require "m3"
local log = require "m3.log"

local CONFIGS = {
  rl = { model = m3.presets.rl, batches = { 1, 64 }, bar = { [1] = 30 } },
  lm130 = { model = m3.presets.lm130, batches = { 1, 128 }, bar = { [128] = 1000 } },
}

local flags = require "m3.flags"

local o = flags.parse({ ... }, {
  { "configs", "", "comma list; empty: rl,lm130", list = true, choices = { "lm130", "rl" } },
  { "dtypes", "", "comma list; empty: bf16,f32 on CUDA (the CPU computes in f32 only)", list = true,
    choices = { "bf16", "f32", "f16" } },
  { "device", "auto", "auto | cuda | cpu; auto: cuda when there is a GPU", choices = { "auto", "cuda", "cpu" } },
  { "steps", 200, "timed one-token steps (at most 20 on the CPU)", int = true, min = 1 },
}, "m3lua scripts/bench_decode.lua [flags]")
local opt = {
  configs = o.configs ~= "" and flags.list(o.configs) or { "rl", "lm130" },
  dtypes = o.dtypes ~= "" and flags.list(o.dtypes) or nil,
  device = o.device ~= "auto" and o.device or nil,
  steps = o.steps,
}

local scripts = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
opt.device = dofile(scripts .. "/bench_device.lua")("bench_decode.lua", opt.device, opt.dtypes, o.dtypes)
if opt.device == "cpu" then -- lm130 at B 128 holds 2.4 GB of state: GPU only
  opt.dtypes = { "f32" }
  opt.steps = math.min(opt.steps, 20)
  CONFIGS.lm130.batches = { 1 }
end
opt.dtypes = opt.dtypes or { "bf16", "f32" }

local function median(xs)
  table.sort(xs)
  local n = #xs
  return n % 2 == 1 and xs[(n + 1) / 2] or 0.5 * (xs[n / 2] + xs[n / 2 + 1])
end

-- The median µs of fn() over n calls (after 3 warm-up calls).
local function time_us(fn, n)
  for _ = 1, 3 do fn() end
  local ts = {}
  for k = 1, n do
    local t0 = log.now()
    fn()
    ts[k] = (log.now() - t0) * 1e6
  end
  return median(ts)
end

local function input_of(cfg, B, T, seed)
  local g = m3.data.rng.new(seed)
  if cfg.input == "tokens" then
    local t = m3.tensor({ B, T }, "i32")
    for k = 0, B * T - 1 do t[k] = g:below(cfg.vocab_size) end
    return t
  end
  local t = m3.tensor({ B, T, cfg.d_model })
  for k = 0, t:numel() - 1 do t[k] = g:uniform() * 2 - 1 end
  return t
end

local rows = {}
local function run(name, dtype, B)
  local c = CONFIGS[name]
  local cfg = c.model
  io.write(string.format("== %s %s B %d ... ", name, dtype, B))
  io.flush()
  local ok, err = pcall(flags.interruptible, "bench_decode.lua", function() -- an interrupt ends the script
    local w = m3.weights.init(cfg, { seed = 1 })
    local inf = m3.infer(w, { device = opt.device, dtype = dtype, batch = B, max_len = 64 })
    w:close()
    inf:step(input_of(cfg, B, 16, 1), { out = false, logits = false }) -- a prompt, then tokens
    local tok = input_of(cfg, B, 1, 2)
    local no_copy = { out = false, logits = false }
    local n = (name == "lm130" and opt.device == "cpu") and 3 or opt.steps
    local info = inf:info()
    local r = { name = name, dtype = dtype, B = B, fused = info.fused_decode,
                mem = opt.device == "cuda" and string.format("%.2f", info.device_bytes / 2 ^ 30) or "-" }
    r.us = time_us(function() inf:step(tok, no_copy) end, n)
    if cfg.head == "lm" then
      local with_logits = { out = false, logits = m3.tensor({ B, cfg.vocab_size }) } -- one buffer, reused
      r.us_logits = time_us(function() inf:step(tok, with_logits) end, n)
      local prompt = input_of(cfg, B, 4, 3)
      local gen_n = opt.device == "cpu" and 2 or 8
      local t0 = log.now()
      inf:generate(prompt, gen_n, { temperature = 1, seed = 1, carry = true })
      local t1 = log.now()
      inf:step(prompt, no_copy) -- the generate's prompt part alone, subtracted
      local t2 = log.now()
      r.gen_tok_s = B * gen_n / math.max((t1 - t0) - (t2 - t1), 1e-9)
    end
    r.tok_s = B / (r.us * 1e-6)
    r.bar = c.bar[B]
    rows[#rows + 1] = r
    inf:close()
  end)
  if not ok then
    print("FAILED: " .. tostring(err))
    rows[#rows + 1] = { name = name, dtype = dtype, B = B, failed = tostring(err) }
  else
    local r = rows[#rows]
    print(string.format("%.1f µs/step, %.0f tokens/s", r.us, r.tok_s))
  end
  collectgarbage()
end

print(string.format("m3lua %s decode bench on %s (%s)", m3.version, opt.device, os.date("!%Y-%m-%d %H:%M UTC")))
flags.interruptible("bench_decode.lua", function()
  for _, name in ipairs(opt.configs) do
    for _, dtype in ipairs(opt.dtypes) do
      for _, B in ipairs(CONFIGS[name].batches) do run(name, dtype, B) end
    end
  end
end)

print("")
print(string.format("%-7s %-5s %5s %12s %12s %14s %14s %8s %6s %6s", "decode", "dtype", "B", "µs/step", "tokens/s",
  "+logits µs", "generate tok/s", "mem GiB", "fused", "bar"))
for _, r in ipairs(rows) do
  if r.failed then
    print(string.format("%-7s %-5s %5d FAILED: %s", r.name, r.dtype, r.B, r.failed:sub(1, 80)))
  else
    local bar = "-"
    if r.bar and r.dtype == "bf16" and opt.device == "cuda" then bar = r.us <= r.bar and "ok" or ">" .. r.bar end
    print(string.format("%-7s %-5s %5d %12.1f %12.0f %14s %14s %8s %6s %6s", r.name, r.dtype, r.B, r.us, r.tok_s,
      r.us_logits and string.format("%.1f", r.us_logits) or "-",
      r.gen_tok_s and string.format("%.0f", r.gen_tok_s) or "-", r.mem, r.fused and "yes" or "no", bar))
  end
end
for _, r in ipairs(rows) do
  if r.failed then os.exit(1) end
end

-- scripts/bench.lua — full training steps (forward + backward + AdamW) of the DESIGN.md
-- benchmark configs: median ms per step, tokens/s, model TFLOP/s (6 * params * tokens / s),
-- device memory of the trainer, and the public PyTorch + Triton Mamba-3 numbers for scale; on CUDA the
-- bf16 speed bars, and for rl and rl-batch the f32 / bf16 step-time ratio against its bar (1.5).
--
--   m3lua scripts/bench.lua [--configs rl,rl-batch,mid,lm130,lm130-b16] [--dtypes bf16,f32]
--                           [--device cuda|cpu] [--steps N] [--no_graph] [--profile]
--   m3lua scripts/bench.lua --decode [flags]   inference decode speed (scripts/bench_decode.lua)
--
-- Exit status: 2 for a bad flag or a device / dtype that cannot run here (--device cuda without
-- a GPU; bf16 or f16 on the CPU, which computes in f32 only; --profile on the CPU), or when no
-- listed config runs in a listed dtype (lm130-b16 runs in bf16 only: a line says when it is left
-- out); 130 / 143 on Ctrl-C / SIGTERM, which stop it at once; 1 when a config FAILED, else 0.
--
-- On CUDA every config is timed with a captured graph (after eager warm-up steps). The
-- timer is the trainer's own wall time of each step call, which returns after the step's
-- metrics are back on the host (the device is idle between steps). rl, rl-batch and mid
-- use input "identity" and head "none" with a fixed random d_out (no head cost); lm130 uses
-- tokens and the tied "lm" head over 50280 tokens (its GEMMs count in the FLOPs). The batch
-- is in pinned tensors (m3.tensor(..., {pinned = true}): uploads without a staging copy);
-- --pageable times ordinary host memory instead.
-- --profile (CUDA) times eagerly instead and prints each config's phases (tr:profile()):
-- device ms per step in upload, norms, in_proj, scan, out_proj, head, update, ...
-- `lm130-b16` only checks that lm130 at B 16 x T 2048 fits in bf16 (two steps, memory).
-- On the CPU (the default without a GPU) it times each config (default rl-batch) at B 16 x T 256
-- in f32 and reports each one's share of the step spent in matrix products (trainer info
-- gemm_seconds); the CPU trainer reports no device memory ("-" in the mem column).

local ffi = require "ffi"
io.stdout:setvbuf("line")
local m3 = require "m3"
local lib = require "m3.lib"

local CONFIGS = {
  ["rl"] = { model = { d_model = 128, n_layers = 4, d_state = 16, headdim = 16, input = "identity", head = "none" },
             B = 1, T = 32, public = { 1.68, 1.68 } },
  ["rl-batch"] = { model = { d_model = 128, n_layers = 4, d_state = 16, headdim = 16, input = "identity",
                             head = "none" }, B = 16, T = 256, public = { 2.79, 2.79 } },
  ["mid"] = { model = { d_model = 256, n_layers = 8, d_state = 64, headdim = 32, input = "identity", head = "none" },
              B = 16, T = 1024, public = { 37, 50 } },
  ["lm130"] = { model = { d_model = 768, n_layers = 24, d_state = 128, headdim = 64, input = "tokens",
                          vocab_size = 50280, head = "lm" }, B = 8, T = 2048, public = { 119, 174 } },
  ["lm130-b16"] = { model = { d_model = 768, n_layers = 24, d_state = 128, headdim = 64, input = "tokens",
                              vocab_size = 50280, head = "lm" }, B = 16, T = 2048, fit_only = true,
                    only_dtype = "bf16" },
}
local BAR_BF16 = { ["rl"] = 0.25, ["rl-batch"] = 0.6, ["mid"] = 10, ["lm130"] = 45 }
local BAR_F32_RATIO = { ["rl"] = 1.5, ["rl-batch"] = 1.5 } -- f32 ms within this factor of bf16's

-- ---- arguments --------------------------------------------------------------------------------

local flags = require "m3.flags"

local args = { ... }
local SCRIPTS = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
if args[1] == "--decode" then -- inference decode speed: scripts/bench_decode.lua
  return assert(loadfile(SCRIPTS .. "/bench_decode.lua"))(select(2, ...))
end
local CONFIG_NAMES = {}
for name in pairs(CONFIGS) do CONFIG_NAMES[#CONFIG_NAMES + 1] = name end
table.sort(CONFIG_NAMES)
local o = flags.parse(args, {
  { "configs", "", "comma list; empty: all on CUDA, rl-batch on the CPU", list = true, choices = CONFIG_NAMES },
  { "dtypes", "", "comma list; empty: bf16,f32 on CUDA (the CPU computes in f32 only)", list = true,
    choices = { "bf16", "f32", "f16" } },
  { "device", "auto", "auto | cuda | cpu; auto: cuda when there is a GPU", choices = { "auto", "cuda", "cpu" } },
  { "steps", 20, "timed steps per config", int = true, min = 1 },
  { "no_graph", false, "time eager steps instead of graph replays" },
  { "profile", false, "eager steps with the per-phase profile (CUDA)" },
  { "pageable", false, "batches in ordinary host memory instead of pinned tensors" },
}, "m3lua scripts/bench.lua [flags]    (--decode [flags]: scripts/bench_decode.lua)")
local opt = {
  configs = o.configs ~= "" and flags.list(o.configs) or nil,
  dtypes = o.dtypes ~= "" and flags.list(o.dtypes) or nil,
  device = o.device ~= "auto" and o.device or nil,
  steps = o.steps,
  graph = not (o.no_graph or o.profile),
  profile = o.profile,
  pinned = { pinned = not o.pageable },
}

opt.device = dofile(SCRIPTS .. "/bench_device.lua")("bench.lua", opt.device, opt.dtypes, o.dtypes)
if opt.device == "cpu" then
  opt.configs = opt.configs or { "rl-batch" }
  opt.dtypes = { "f32" }
else
  opt.configs = opt.configs or { "rl", "rl-batch", "mid", "lm130", "lm130-b16" }
  opt.dtypes = opt.dtypes or { "bf16", "f32" }
end

-- The runs, {name, dtype} for each listed config and dtype, and left_out: a line saying why for
-- each config that runs in one dtype only (lm130-b16: bf16) when that one is not listed. Raises
-- an error (flags.check: exit 2) when nothing would run, or for --profile on the CPU.
local function plan()
  if opt.profile and opt.device == "cpu" then
    error("--profile: the phase timing needs the CUDA backend (this run is on the CPU)", 0)
  end
  local runs, left_out = {}, {}
  for _, name in ipairs(opt.configs) do
    local only, n = CONFIGS[name].only_dtype, #runs
    for _, dtype in ipairs(opt.dtypes) do
      if not only or dtype == only then runs[#runs + 1] = { name, dtype } end
    end
    if #runs == n then
      left_out[#left_out + 1] = string.format("%s runs in %s only (%s)", name, only,
        opt.device == "cpu" and "the CPU computes in f32 only" or "--dtypes " .. o.dtypes)
    end
  end
  if #runs == 0 then error("nothing to run: " .. table.concat(left_out, "; "), 0) end
  return runs, left_out
end
local runs, left_out = flags.check("bench.lua", plan)

-- ---- helpers ------------------------------------------------------------------------------------

-- splitmix64 on uint64 cdata: deterministic batches
local state = ffi.new("uint64_t", 12345)
local function u32()
  state = state + 0x9E3779B97F4A7C15ULL
  local z = state
  z = bit.bxor(z, bit.rshift(z, 30)) * 0xBF58476D1CE4E5B9ULL
  z = bit.bxor(z, bit.rshift(z, 27)) * 0x94D049BB133111EBULL
  return tonumber(bit.rshift(bit.bxor(z, bit.rshift(z, 31)), 32))
end
local function normal()
  local u1, u2 = (u32() + 0.5) / 4294967296, (u32() + 0.5) / 4294967296
  return math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)
end

local function make_batch(cfg, B, T)
  local b = {}
  if cfg.input == "tokens" then
    b.tokens = m3.tensor({ B, T }, "i32", opt.pinned)
    for k = 0, B * T - 1 do b.tokens[k] = u32() % cfg.vocab_size end
  else
    b.input = m3.tensor({ B, T, cfg.d_model }, "f32", opt.pinned)
    for k = 0, B * T * cfg.d_model - 1 do b.input[k] = normal() end
  end
  if cfg.head == "lm" then
    b.targets = m3.tensor({ B, T }, "i32", opt.pinned)
    for k = 0, B * T - 1 do b.targets[k] = u32() % cfg.vocab_size end
  else
    b.d_out = m3.tensor({ B, T, cfg.d_model }, "f32", opt.pinned)
    for k = 0, B * T * cfg.d_model - 1 do b.d_out[k] = 1e-2 * normal() end
  end
  return b
end

local function median(xs)
  local t = {}
  for k = 1, #xs do t[k] = xs[k] end
  table.sort(t)
  local n = #t
  if n % 2 == 1 then return t[(n + 1) / 2] end
  return 0.5 * (t[n / 2] + t[n / 2 + 1])
end

-- gemm_seconds of the C trainer info (nil when the library does not measure it)
local function gemm_seconds(tr)
  local ok, v = pcall(function()
    local info = ffi.new("m3_trainer_info")
    lib.C.m3_trainer_get_info(tr._box.p, info)
    return info.gemm_seconds
  end)
  if ok and v and v >= 0 then return v end
  return nil
end

-- ---- runs -----------------------------------------------------------------------------------------

local rows = {}
local function run(name, dtype)
  local c = CONFIGS[name]
  local cfg = m3.config(c.model)
  local B, T = c.B, c.T
  if opt.device == "cpu" then B, T = 16, 256 end
  io.write(string.format("== %s %s B %d x T %d (%.1f M params) ... ", name, dtype, B, T, cfg.n_params / 1e6))
  io.flush()
  local ok, err = pcall(flags.interruptible, "bench.lua", function() -- an interrupt ends the script
    local tr = m3.trainer(cfg, { device = opt.device, dtype = dtype, batch = B, seq_len = T, seed = 1 })
    local batch = make_batch(cfg, B, T)
    local warm = c.fit_only and 2 or 3
    for _ = 1, warm do tr:step(batch) end
    local graphed = opt.device == "cuda" and opt.graph and not c.fit_only
    if graphed then
      tr:capture_graph()
      for _ = 1, 3 do tr:step(batch) end
    end
    local profiled = opt.profile and opt.device == "cuda" and not c.fit_only
    if profiled then tr:set_profiling(true) end
    local times, last = {}, nil
    local g0 = gemm_seconds(tr)
    local n = c.fit_only and 0 or opt.steps
    local t_total = 0
    for k = 1, n do
      local m = tr:step(batch)
      times[k] = m.ms
      t_total = t_total + m.ms
      last = m
    end
    local g1 = gemm_seconds(tr)
    local info = tr:info()
    local r = { name = name, dtype = dtype, B = B, T = T, graph = graphed,
                mem = opt.device == "cuda" and string.format("%.2f", info.device_bytes / 2 ^ 30) or nil,
                fit_only = c.fit_only, public = c.public, profile = profiled and tr:profile() or nil }
    if n > 0 then
      r.ms = median(times)
      r.tok_s = B * T / (r.ms / 1e3)
      r.tflops = 6 * cfg.n_params * r.tok_s / 1e12
      r.loss = last.loss
      if g0 and g1 and t_total > 0 then r.gemm_share = (g1 - g0) * 1e3 / t_total end
    end
    rows[#rows + 1] = r
    tr:close()
  end)
  if not ok then
    print("FAILED: " .. tostring(err))
    rows[#rows + 1] = { name = name, dtype = dtype, B = B, T = T, failed = tostring(err) }
  else
    local r = rows[#rows]
    if r.ms then
      print(string.format("%.3f ms/step, %.0f tokens/s, %.2f TFLOP/s%s%s", r.ms, r.tok_s, r.tflops,
        r.mem and ", " .. r.mem .. " GiB" or "",
        r.gemm_share and string.format(", GEMM share %.0f%%", 100 * r.gemm_share) or ""))
    else
      print(string.format("fits: %s GiB of device memory", r.mem))
    end
    if r.profile then
      local total = 0
      for _, ph in ipairs(r.profile.phases) do total = total + ph.ms end
      print(string.format("  profile: %s timed, %.3f ms of device time per step",
        m3.log.plural(r.profile.calls, "eager step"), total))
      for _, ph in ipairs(r.profile.phases) do
        print(string.format("  %-14s %9.3f ms/step %5.1f%%", ph.name, ph.ms, 100 * ph.ms / total))
      end
    end
  end
  collectgarbage()
end

print(string.format("m3lua %s bench on %s (%s)", m3.version, opt.device, os.date("!%Y-%m-%d %H:%M UTC")))
if opt.device == "cpu" then print("CPU: every config at B 16 x T 256 (not its CUDA shape), f32") end
for _, why in ipairs(left_out) do print("left out: " .. why) end
flags.interruptible("bench.lua", function()
  for _, r in ipairs(runs) do run(r[1], r[2]) end
end)

-- ---- the table ------------------------------------------------------------------------------------------

print("")
print(string.format("%-10s %-5s %-11s %5s %10s %12s %8s %8s %12s %8s %6s", "config", "dtype", "B x T", "graph",
  "ms/step", "tokens/s", "TFLOP/s", "mem GiB", "public ms", "speedup", "bar"))
for _, r in ipairs(rows) do
  local shape = string.format("%dx%d", r.B, r.T)
  if r.failed then
    print(string.format("%-10s %-5s %-11s FAILED: %s", r.name, r.dtype, shape, r.failed:sub(1, 80)))
  elseif not r.ms then
    print(string.format("%-10s %-5s %-11s %5s %10s %12s %8s %8s %12s %8s %6s", r.name, r.dtype, shape, "-", "-",
      "-", "-", r.mem, "-", "-", "fits"))
  else
    local pub, speed, bar = "-", "-", "-"
    if r.public and opt.device == "cuda" then
      pub = r.public[1] == r.public[2] and string.format("%.2f", r.public[1])
        or string.format("%g-%g", r.public[1], r.public[2])
      speed = string.format("%.1fx", r.public[1] / r.ms)
    end
    local b = BAR_BF16[r.name]
    if b and r.dtype == "bf16" and opt.device == "cuda" then bar = r.ms <= b and "ok" or string.format(">%g", b) end
    print(string.format("%-10s %-5s %-11s %5s %10.3f %12.0f %8.2f %8s %12s %8s %6s", r.name, r.dtype, shape,
      r.graph and "yes" or "no", r.ms, r.tok_s, r.tflops, r.mem or "-", pub, speed, bar))
  end
end
if opt.device == "cuda" then
  local ms = {}
  for _, r in ipairs(rows) do
    if r.ms then ms[r.name .. "/" .. r.dtype] = r.ms end
  end
  local ratios = {}
  for _, name in ipairs(opt.configs) do
    local f, b, bar = ms[name .. "/f32"], ms[name .. "/bf16"], BAR_F32_RATIO[name]
    if f and b and bar then
      ratios[#ratios + 1] = string.format("%s %.2f (bar %g: %s)", name, f / b, bar, f / b <= bar and "ok" or "missed")
    end
  end
  if #ratios > 0 then print("f32 / bf16: " .. table.concat(ratios, ", ")) end
end
if opt.device == "cpu" then
  local shares, timed = {}, 0
  for _, r in ipairs(rows) do
    if r.ms then timed = timed + 1 end
    if r.gemm_share then shares[#shares + 1] = string.format("%s %.0f%%", r.name, 100 * r.gemm_share) end
  end
  if #shares > 0 then
    print("CPU: share of the step in matrix products: " .. table.concat(shares, ", "))
  elseif timed > 0 then
    print("CPU: the share of time in matrix products is unavailable (the library does not measure it)")
  end
end
for _, r in ipairs(rows) do
  if r.failed then os.exit(1) end
end

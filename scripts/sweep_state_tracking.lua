-- scripts/sweep_state_tracking.lua — the state-tracking experiment of the Mamba-3 paper
-- (Lahoti et al. 2026, Table 5b): parity and modular arithmetic without / with brackets,
-- for Mamba-3 and Mamba-3 without RoPE (rope_fraction = 0).
--
--   m3lua scripts/sweep_state_tracking.lua --parallel 8 --device cuda   # the paper's setup
--   m3lua scripts/sweep_state_tracking.lua --quick                      # a CPU smoke run
--
-- On one GPU the parallel points share it by time slices unless the CUDA MPS daemon runs
-- (`nvidia-cuda-mps-control -d`; `echo quit | nvidia-cuda-mps-control` stops it): with it,
-- the 24 points of 6000 steps took 150 s on an H200 (2026-11-30). 20000 steps (the default)
-- took arithmetic from 10 to 60 scaled accuracy at length 256 in that session's runs.
--
-- Setup (the paper's appendix): a length curriculum up to --max_length (160), evaluation at
-- --eval_length (256), 1 layer for parity and 3 for arithmetic, state size 64, a small sweep
-- over d_model and learning rates; each point reports its best validation score during
-- training as scaled accuracy, (acc - 1/classes) / (1 - 1/classes), and the table shows the
-- best point per task and model beside the paper's numbers, with that point's best score at
-- the longest training length in brackets (learned the task vs generalised in length).
-- Tasks (m3.data): parity with running-parity targets; arithmetic mod 5 over + - * with
-- running targets (every digit scored with the value so far) without brackets and the
-- final value only with brackets; evaluation scores only the final answer.
-- --parity_density random trains parity on strings whose share of 1s is drawn per string, so
-- training sees up to max_length 1s (a uniform string of eval_length holds about half that);
-- evaluation strings are uniform (0.5) either way.
-- One run folder per point under --dir (m3.sweep): results.csv / results.json sorted by the
-- score, summary.svg, and each run's metrics.jsonl and plot.svg; finished points are
-- skipped when the script runs again, so an interrupted sweep goes on with the points it had
-- not finished (a point cut short starts again from its first step: points keep no checkpoints).
-- Each point records the flags that change its results (all but the swept lists, --dir and
-- --parallel; --quick's values as set): a re-run in the same --dir with other values stops
-- (exit 2) before any point runs instead of showing the old scores.
-- Flags, the model, data and device each point would build from them, and the sweep folder are
-- checked before any point runs ("sweep_state_tracking.lua: <why>", exit 2 when one is wrong); a
-- point that fails leaves the others going, and the script exits 1 after the table (a re-run tries
-- that point again).

-- stdout line by line: in piped output (`2>&1 | tail`) the header and the table keep their places
-- among m3.sweep's lines and the errors on stderr
io.stdout:setvbuf("line")
local m3 = require "m3"
local flags = require "m3.flags"
local fit = require "m3.fit"
local fs = require "m3.fs"
local json = require "m3.json"

local spec = {
  { "tasks", "parity,arithmetic,brackets", "tasks to run (comma-separated)", list = true,
    choices = { "parity", "arithmetic", "brackets" } },
  { "models", "rope,norope", "rope: Mamba-3; norope: rope_fraction = 0", list = true, choices = { "rope", "norope" } },
  { "d_models", "64,128", "d_model values of the sweep", list = true, int = true, min = 1 },
  { "lrs", "1e-3,3e-3", "peak learning rates of the sweep", list = true, min = 1e-9 },
  { "steps", 20000, "optimizer steps per point", int = true, min = 1, max = flags.INT32 },
  { "batch", 64, "sequences per optimizer step", int = true, min = 1, max = flags.INT32 },
  { "micro_batch", 64, "sequences per micro-batch (the trainer's batch)", int = true, min = 1 },
  { "from_length", 10, "longest sequence of the first curriculum phase", int = true, min = 2 },
  { "max_length", 160, "longest training sequence", int = true, min = 2 },
  { "eval_length", 256, "evaluation length", int = true, min = 1 },
  { "d_state", 64, "state size N", int = true, min = 1 },
  { "headdim", 32, "head dimension P", int = true, min = 1 },
  { "parity_density", "0.5", "share of 1s in training bit strings: a probability, or random (drawn per string);"
    .. " evaluation strings always use 0.5" },
  { "layers_parity", 1, "layers for parity", int = true, min = 1 },
  { "layers_arithmetic", 3, "layers for the arithmetic tasks", int = true, min = 1 },
  { "eval_every", 1000, "steps between validations", int = true, min = 1, max = flags.INT32 },
  { "eval_batches", 4, "micro-batches per validation", int = true, min = 1, max = flags.INT32 },
  { "seed", 0, "seed of weights and data", int = true, min = 0,
    max = 2 ^ 53 - 1 - 1000003 }, -- the evaluation data's seed, seed + 1000003, is one the library takes too
  { "device", "auto", "auto | cpu | cuda", choices = { "auto", "cpu", "cuda" } },
  { "dtype", "f32", "f32 | bf16 (bf16 needs a GPU)", choices = { "f32", "bf16" } },
  { "parallel", 1, "points run at once as separate processes (one per GPU)", int = true, min = 1 },
  { "dir", "runs/state_tracking", "sweep folder (--quick: runs/state_tracking_quick)" },
  { "quick", false, "a small CPU version (lengths to 48, eval at 64, one d_model and lr); flags given win" },
}

local o, changed = flags.parse(arg, spec, "m3lua scripts/sweep_state_tracking.lua [flags]")
if o.quick then
  -- small enough for a CPU; 2 layers for parity, which 1 layer learns only with long training
  local quick = { d_models = "32", lrs = "5e-3", steps = 3000, batch = 32, micro_batch = 32,
    from_length = 12, max_length = 48, eval_length = 64, d_state = 16, headdim = 16,
    eval_every = 200, eval_batches = 8, layers_parity = 2, layers_arithmetic = 2,
    dir = "runs/state_tracking_quick" }
  local given = {}
  for _, k in ipairs(changed) do given[k] = true end
  for k, v in pairs(quick) do
    if not given[k] then o[k] = v end
  end
end

local function parity_density(v)
  if v == "random" then return v end
  local p = tonumber(v)
  if not (p and p >= 0 and p <= 1) then -- refuses NaN too
    error("--parity_density must be a probability in [0, 1] or random, got " .. tostring(v), 0)
  end
  return p
end

local list = flags.list

local PAPER = {
  parity = { rope = 100.00, norope = 2.27, label = "parity" },
  arithmetic = { rope = 98.51, norope = 1.49, label = "arithmetic, no brackets" },
  brackets = { rope = 87.75, norope = 0.72, label = "arithmetic, brackets" },
}

-- Training or evaluation data of a task (evaluation parity strings: density 0.5).
local function sources(task, seed, training)
  if task == "parity" then
    return m3.data.parity { seed = seed, targets = "running",
      density = training and parity_density(o.parity_density) or 0.5 }
  elseif task == "arithmetic" then
    return m3.data.arithmetic { seed = seed, targets = "running" }
  end
  return m3.data.arithmetic { seed = seed, brackets = true }
end

-- What a point trains with: data, evaluation data, curriculum, model config, trainer options.
local function setup(p)
  local train, evalset = sources(p.task, o.seed, true), sources(p.task, o.seed + 1000003, false)
  local cur = m3.curriculum.lengths { from = o.from_length, to = o.max_length, steps = o.steps,
    min_length = 2 }
  local cfg = m3.config { d_model = p.d_model, d_state = o.d_state, headdim = o.headdim,
    n_layers = p.task == "parity" and o.layers_parity or o.layers_arithmetic,
    rope_fraction = p.model == "rope" and 0.5 or 0, input = "tokens", head = "lm",
    vocab_size = train.vocab }
  local trainer_opts = { device = o.device, dtype = o.dtype, batch = o.micro_batch,
    seq_len = math.max(o.eval_length, o.max_length), lr = p.lr, weight_decay = 0, seed = o.seed }
  return train, evalset, cur, cfg, trainer_opts
end

-- Trains one point of the sweep; returns its metrics (best scaled accuracy first).
local function run(p, run_dir)
  local train, evalset, cur, cfg, trainer_opts = setup(p)
  local tr = m3.trainer(cfg, trainer_opts)
  local best, best_train = -math.huge, -math.huge
  local function eval_at(length)
    return { length = length, min_length = length, targets = "final", batches = o.eval_batches }
  end
  local eval_opts, train_opts = eval_at(o.eval_length), eval_at(o.max_length)
  local result = fit.run {
    trainer = tr, data = train, steps = o.steps, batch = o.batch, curriculum = cur, clip = 1.0,
    schedule = m3.schedule.warmup_cosine { peak = p.lr, warmup = math.floor(o.steps / 20),
      total = o.steps, floor = p.lr / 10 },
    dir = run_dir, title = run_dir:match("[^/]+$"), eval_every = o.eval_every,
    graph = tr:device() ~= "cpu",
    eval = function(t)
      local e, et = fit.evaluate(t, evalset, eval_opts), fit.evaluate(t, evalset, train_opts)
      local scaled = 100 * m3.data.scaled_accuracy(e.accuracy, train.classes)
      local train_scaled = 100 * m3.data.scaled_accuracy(et.accuracy, train.classes)
      best, best_train = math.max(best, scaled), math.max(best_train, train_scaled)
      return { val_loss = e.loss, val_acc = e.accuracy, val_scaled = scaled, train_len_scaled = train_scaled }
    end,
  }
  tr:close()
  return { best_scaled = best, final_scaled = result.eval.val_scaled, final_loss = result.loss,
    best_train_len_scaled = best_train }
end

-- The distinct values of a list flag (a value listed twice is one point of the sweep).
local function distinct(text, convert)
  local out, seen = {}, {}
  for _, v in ipairs(list(text, convert)) do
    if not seen[v] then out[#out + 1], seen[v] = v, true end
  end
  return out
end

local grid = {
  { "task", distinct(o.tasks) },
  { "model", distinct(o.models) },
  { "d_model", distinct(o.d_models, tonumber) },
  { "lr", distinct(o.lrs, tonumber) },
}

-- Everything a point builds before training is checked here, so a bad combination of flags stops
-- the script (exit 2) instead of failing every point. A trainer is made only where it costs no GPU
-- memory (on the CPU, or where CUDA is missing and asking for it fails at once). The sweep folder is
-- made last: a bad flag leaves none behind, a folder that cannot be made stops the script too.
flags.check("sweep_state_tracking.lua", function()
  if not o.dir:find("%S") then error(string.format("--dir must name the sweep folder, got %q", o.dir), 0) end
  parity_density(o.parity_density)
  for _, task in ipairs(grid[1][2]) do
    for _, d_model in ipairs(grid[3][2]) do
      setup { task = task, model = grid[2][2][1], d_model = d_model, lr = grid[4][2][1] }
    end
  end
  if o.device == "cpu" or m3.cuda_device_count() == 0 then
    local _, _, _, cfg, trainer_opts = setup { task = grid[1][2][1], model = grid[2][2][1], d_model = grid[3][2][1],
      lr = grid[4][2][1] }
    trainer_opts.batch, trainer_opts.seq_len = 1, 1
    m3.trainer(cfg, trainer_opts):close()
  end
  fs.mkdir(o.dir)
end)

-- The flags that change a point's results, recorded in its done.json (m3.sweep's defaults): a re-run
-- in the same --dir with other values is refused instead of showing the old scores. Not recorded:
-- the swept lists, the folder and how many points run at once.
local NOT_RECORDED = { tasks = true, models = true, d_models = true, lrs = true, dir = true, parallel = true,
  quick = true }
local settings = {}
for _, flag in ipairs(spec) do
  if not NOT_RECORDED[flag[1]] then settings[flag[1]] = o[flag[1]] end
end
settings.parity_density = parity_density(o.parity_density)
if o.device == "auto" then settings.device = m3.cuda_device_count() > 0 and "cuda" or "cpu" end -- as m3.trainer

print(string.format("state tracking: %s, %s each, lengths up to %d, evaluated at %d -> %s",
  m3.log.plural(#grid[1][2] * #grid[2][2] * #grid[3][2] * #grid[4][2], "point"), m3.log.plural(o.steps, "step"),
  o.max_length, o.eval_length, o.dir))

-- an interrupt ends the script (exit status 130 or 143); a failed point makes m3.sweep raise once
-- the others are done: the table still shows them
local swept, rows = pcall(flags.interruptible, "sweep_state_tracking.lua", m3.sweep, {
  grid = grid, defaults = settings, dir = o.dir, run = run, metric = "best_scaled", mode = "max",
  parallel = o.parallel,
})
local failure = not swept and rows
-- refused before any point ran (e.g. --dir holds results of other settings): no table of old scores
if failure and not tostring(failure):find("m3%.sweep: %d+ of %d+ points? failed %(") then
  flags.check("sweep_state_tracking.lua", error, failure, 0)
end
if failure then rows = json.read(o.dir .. "/results.json") or {} end

-- the best point per task and model (rows come sorted by best_scaled, unscored ones last)
local best = {}
for _, r in ipairs(rows) do
  local key = r.task .. "/" .. r.model
  best[key] = best[key] or r
end
local function cell(task, model, field)
  local r = best[task .. "/" .. model]
  return r and type(r[field]) == "number" and string.format("%7.2f", r[field]) or "      -"
end
print()
print(string.format("Scaled accuracy (%%) at length %d, best over d_model x lr (ours / paper), and at the", o.eval_length))
print(string.format("longest training length %d for the same point (ours; did it learn the task at all?):", o.max_length))
print(string.format("  %-26s %-30s %-30s", "task", "Mamba-3", "Mamba-3 w/o RoPE"))
for _, task in ipairs { "parity", "arithmetic", "brackets" } do
  local p = PAPER[task]
  print(string.format("  %-26s %s / %6.2f  (%s)      %s / %6.2f  (%s)", p.label, cell(task, "rope", "best_scaled"),
    p.rope, cell(task, "rope", "best_train_len_scaled"), cell(task, "norope", "best_scaled"), p.norope,
    cell(task, "norope", "best_train_len_scaled")))
end
print("per point: " .. o.dir .. "/results.csv")
if failure then
  io.stderr:write(tostring(failure), "\n")
  os.exit(1)
end

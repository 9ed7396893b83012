-- scripts/lm.lua — a byte-level Mamba-3 language model on any text file, with validation
-- loss during training and a sample of generated text at the end.
--
--   m3lua scripts/lm.lua                                  # data/fables.txt, a few minutes on a CPU
--   m3lua scripts/lm.lua --data book.txt --steps 5000 --d_model 256 --n_layers 4 --device cuda
--   m3lua scripts/lm.lua --resume                         # continue an interrupted run
--
-- Training windows of --seq_len bytes are drawn at random from the first 90% of the file
-- (--carry: each of the --batch rows reads its stretch of the text on in order and the
-- recurrent state carries from window to window instead; no accumulation then, so
-- --micro_batch must equal --batch); validation is the loss on the last 10%, in bits per byte,
-- over its first --eval_batches x --micro_batch windows (distinct and consecutive, the same
-- every time; where it holds fewer, each of them once, which the script says at the start).
-- The sample comes from m3.infer's generate (temperature sampling, seeded by --seed),
-- prompted by --prompt or the first 64 bytes of the validation text (all of it when shorter).
-- --data must be a regular file; while a run reads it, replace it only by renaming a new file
-- over it (mv), never truncate it in place (m3.data.file).
-- Output: runs/<name>/ under the current folder (metrics.jsonl, plot.svg, checkpoints/,
-- options.json, sample.txt, lock); <name> is the file and the flags that differ from their
-- defaults, numbered -2, -3, ... past folders that hold an earlier run's checkpoints or that a
-- live run has claimed (lock), so that the same command again keeps them (--resume continues
-- the one whose newest checkpoint is the newest; --overwrite starts <name> afresh, deleting its
-- checkpoints). A folder named with --run that holds checkpoints needs --resume or
-- --overwrite; one a live run has claimed is refused. --resume takes the run's own flag values
-- from options.json (a missing or unreadable one is refused); flags
-- given with it change them, except those --help marks "fixed for a run" (the model, the text
-- and how it is read), which are refused when they differ. Where such a change makes <name>
-- a folder without checkpoints, --resume takes the run it changes (its other flags agree;
-- several such runs: name one with --run). Bad flag values, and a file too
-- short for the windows, are refused before anything is written, the folder the run claimed
-- removed again ("lm.lua: <why>", exit status 2). Ctrl-C or SIGTERM saves a checkpoint
-- and ends the script with its path on stderr and exit status 130 / 143.

local m3 = require "m3"
local flags = require "m3.flags"
local fit = require "m3.fit"
local fs = require "m3.fs"
local rundir = require "m3.rundir"

-- the repository root, from this script's path (data/ lies beside scripts/)
local root = (arg and arg[0] or ""):match("^(.-)/?scripts/[^/]*$") or ""
root = root == "" and "" or root .. "/"

local spec = {
  { "data", root .. "data/fables.txt", "a text file (bytes are the tokens)", fixed = true, path = true },
  { "steps", 600, "optimizer steps", int = true, min = 1, max = flags.INT32 },
  { "d_model", 64, "model width", int = true, min = 1, fixed = true },
  { "n_layers", 2, "layers", int = true, min = 1, fixed = true },
  { "d_state", 32, "state size N", int = true, min = 1, fixed = true },
  { "headdim", 16, "head dimension P", int = true, min = 1, fixed = true },
  { "seq_len", 128, "bytes per training window", int = true, min = 1, fixed = true },
  { "batch", 16, "windows per optimizer step", int = true, min = 1, max = flags.INT32, fixed = true },
  { "micro_batch", 16, "windows per micro-batch (the trainer's batch)", int = true, min = 1, fixed = true },
  { "lr", 3e-3, "peak learning rate", min = 0 },
  { "warmup", 0.05, "warmup steps, or a fraction of --steps when < 1", min = 0 },
  { "floor", 0.1, "final learning rate as a fraction of the peak", min = 0 },
  { "weight_decay", 0.01, "AdamW weight decay", min = 0, fixed = true },
  { "clip", 1.0, "gradient-norm clipping (0: off)", min = 0 },
  { "carry", false, "read the text in order and carry the state across windows", fixed = true },
  { "eval_every", 100, "steps between validations", int = true, min = 1, max = flags.INT32 },
  { "eval_batches", 8, "micro-batches per validation", int = true, min = 1, max = flags.INT32 },
  { "save_every", 200, "steps between checkpoints (0: only at the end)", int = true, min = 0 },
  { "keep", 3, "checkpoints kept (0: all)", int = true, min = 0 },
  { "sample_len", 400, "bytes to generate at the end", int = true, min = 1, max = flags.INT32 },
  { "temperature", 0.8, "sampling temperature (0: greedy)", min = 0 },
  { "prompt", "", "text to continue; empty: the start of the validation text" },
  { "seed", 0, "seed of the weights, the data and the sampler", int = true, min = 0, max = 2 ^ 53 - 1,
    fixed = true },
  { "device", "auto", "auto | cpu | cuda | cuda:N" },
  { "dtype", "f32", "f32 | bf16 | f16 (f16 cannot accumulate: --batch <= --micro_batch)",
    choices = { "f32", "bf16", "f16" } },
  { "run", "", "run name: one folder name under runs/ (no /); empty: lm-<data file name> and the flags\n"
    .. "    that differ, then -2, -3, ... past folders holding an earlier run's checkpoints (--resume: the newest)" },
  { "resume", false, "continue the run from its latest checkpoint with its own flag values; flags given "
    .. "change them, except those fixed for a run" },
  { "overwrite", false, "start afresh in a run folder that holds checkpoints (deletes them)" },
}

local o, _, given = flags.parse(arg, spec, "m3lua scripts/lm.lua [flags]")

-- the run's name: the file and the options that shape the result
local not_in_name = { data = true, run = true, resume = true, overwrite = true, device = true,
  eval_every = true, save_every = true, keep = true, sample_len = true, temperature = true, prompt = true }
local base = "lm-" .. (o.data:match("([^/]+)$") or "text"):gsub("%.[^.]*$", "")

-- everything the flags build; a value the library refuses, or a file too short for the
-- windows, stops the script here (exit 2) before anything is written: options.json is written
-- only once all of it has been built, and the folder, made when the run claimed it, is removed
-- again (rundir.setup), so nothing is left behind
local dir, why, train, val, eval_rows, eval_batches, eval_note, prompt, sched, ck, tr, start
-- The run's setup in dir, which this process has claimed (rundir.setup).
local function setup()
  rundir.open(dir, o, given, spec)
  train = m3.data.text(o.data, { split = "train", order = o.carry and "stream" or "random",
    rows = o.carry and o.batch or nil, seed = o.seed, length = o.seq_len })
  val = m3.data.text(o.data, { split = "val", order = "sequential", length = o.seq_len })
  -- a batch of each split drawn now (then the cursor put back): a file too short for the
  -- windows fails here, not at the first step or validation
  for _, src in ipairs { train, val } do
    local at = src:cursor()
    src:next(math.min(o.batch, o.micro_batch))
    src:seek(at)
  end
  -- the validation windows: --eval_batches batches of --micro_batch rows; a split with fewer windows
  -- is read once whole, in batches of the largest divisor of its window count up to --micro_batch
  local asked, held = o.eval_batches * o.micro_batch, val:count(o.seq_len)
  eval_rows, eval_batches = o.micro_batch, o.eval_batches
  if held < asked then
    while held % eval_rows ~= 0 do eval_rows = eval_rows - 1 end
    eval_batches = held / eval_rows
    eval_note = string.format("validation: the validation text holds %d windows of %d bytes, fewer than "
      .. "--eval_batches x --micro_batch = %d: each counts once (%d batches of %d)", held, o.seq_len, asked,
      eval_batches, eval_rows)
  end

  prompt = {}
  if o.prompt ~= "" then
    for i = 1, #o.prompt do prompt[i] = o.prompt:byte(i) end
  else
    prompt = val:slice(val.lo, math.min(64, val.span))
  end

  local warmup = o.warmup < 1 and math.floor(o.warmup * o.steps + 0.5) or o.warmup
  sched = m3.schedule.warmup_cosine { peak = o.lr, warmup = warmup, total = o.steps, floor = o.lr * o.floor }
  ck = m3.checkpoint.new { dir = dir .. "/checkpoints", every = o.save_every, keep = o.keep }
  local cfg = m3.config { d_model = o.d_model, n_layers = o.n_layers, d_state = o.d_state,
    headdim = o.headdim, input = "tokens", head = "lm", vocab_size = train.vocab }

  if o.resume then
    tr, start = fit.resume(ck, { device = o.device, dtype = o.dtype })
    print(tr and string.format("resuming %s at step %d%s", dir, start.step, why and " (" .. why .. ")" or "")
      or "no checkpoint in " .. ck.dir .. "; starting from scratch")
  end
  if not tr then
    tr = m3.trainer(cfg, { device = o.device, dtype = o.dtype, batch = o.micro_batch, seq_len = o.seq_len,
      lr = o.lr, weight_decay = o.weight_decay, carry_state = o.carry, seed = o.seed })
  end
  fit.check_rows { trainer = tr, batch = o.batch } -- f16 and carry_state cannot accumulate
  rundir.create(dir, o)
end
flags.check("lm.lua", function()
  if o.carry and o.batch ~= o.micro_batch then
    error(string.format("--carry reads --batch streams, one per state row of the trainer: --micro_batch "
      .. "(%d) must equal --batch (%d)", o.micro_batch, o.batch), 0)
  end
  dir, why = rundir.path(o, given, spec, base, not_in_name)
  rundir.setup(dir, setup)
end)
print(string.format("%s: %s (%d KB, %d KB for validation), %d parameters, %s %s",
  dir, o.data, math.floor(train.span / 1024), math.floor(val.span / 1024), tr.config.n_params,
  tr:device(), tr:dtype()))
if eval_note then print(eval_note) end

-- Ctrl-C or SIGTERM (here or while sampling): a checkpoint, its path on stderr, exit status 130 or 143
local result = flags.interruptible("lm.lua", fit.run, {
  trainer = tr, data = train, steps = o.steps, start = start, batch = o.batch, clip = o.clip,
  schedule = sched, checkpoint = ck, dir = dir, title = dir:match("[^/]+$"), eval_every = o.eval_every,
  graph = tr:device() ~= "cpu",
  eval = function(t)
    local e = fit.evaluate(t, val, { batches = eval_batches, rows = eval_rows, length = o.seq_len })
    return { val_loss = e.loss, val_bpb = e.loss / math.log(2) }
  end,
})

-- ---- sampling ----------------------------------------------------------------------------

-- Continues prompt (a list of bytes) by n bytes: m3.infer over the trained weights, the
-- prompt stepped whole, then one byte at a time (a CUDA graph replay on the GPU).
local function sample(prompt, n)
  local w = tr:snapshot()
  local inf = m3.infer(w, { device = tr:device(), dtype = tr:dtype(), batch = 1 })
  w:close()
  local p = m3.tensor({ 1, #prompt }, "i32")
  for i, b in ipairs(prompt) do p[i - 1] = b end
  local out = inf:generate(p, n, { temperature = o.temperature, seed = o.seed })
  inf:close()
  local bytes = {}
  for i = 0, n - 1 do bytes[i + 1] = out[i] end
  return bytes
end

-- The text of a list of bytes (string.char(unpack(bytes)) stops at LuaJIT's 7999 values).
local function text_of(bytes)
  local chars = {}
  for i, b in ipairs(bytes) do chars[i] = string.char(b) end
  return table.concat(chars)
end

local generated = flags.interruptible("lm.lua", sample, prompt, o.sample_len)
local text = text_of(prompt) .. text_of(generated)
fs.write(dir .. "/sample.txt", text .. "\n")

local e = result.eval
print(string.format("validation: %.4f nats/byte = %.3f bits/byte after %d steps (%s)", e.val_loss,
  e.val_bpb, result.step, m3.log.duration(result.elapsed or 0)))
print("sample (prompt, then " .. o.sample_len .. " generated bytes):")
print(text)

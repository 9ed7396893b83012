-- The shipped scripts as programs (build/m3lua, see helper.m3lua): bad flags and settings stop
-- them before any work with exit status 2, a failure while they run gives a non-zero one, and
-- SIGINT / SIGTERM / SIGHUP end a training run with its checkpoint's path and 128 + the signal.
-- Also m3.flags' list flags, which the scripts use for their comma-separated values.

local m3 = require "m3"
local flags = require "m3.flags"
local helper = require "spec.helper"

local quote = helper.quote
-- M3LUA and SCRIPTS (a prefix of the scripts' paths) are quoted for the shell commands below
local M3LUA = quote(helper.m3lua())
local pwd = io.popen("cd " .. quote(helper.repo_dir()) .. " && pwd")
local SCRIPTS = quote(pwd:read("*l") .. "/scripts/") -- absolute: some runs happen in a folder of their own
pwd:close()

local tmpdir = helper.tmpdir

-- Runs scripts/<name> with the arguments (words, no quoting needed); returns output and exit status.
local function script(name, args)
  return helper.run(M3LUA .. " " .. SCRIPTS .. name .. " " .. args)
end

-- Runs scripts/<name> with args in folder dir (where its runs/ goes); returns output and exit status.
local function script_in(dir, name, args)
  return helper.run("sh -c " .. quote("cd " .. dir .. " && " .. M3LUA .. " " .. SCRIPTS .. name .. " " .. args))
end

-- Runs scripts/<name> with args in folder dir, in the background with SIGINT and SIGHUP at their
-- default (sh starts background jobs with SIGINT ignored; nohup ignores SIGHUP), and sends it signal
-- sig (INT, TERM, HUP) once the file ready
-- (relative to dir) holds a training step's record (or the word mark, when given); returns its
-- output and exit status.
local function signalled(name, args, dir, ready, sig, mark)
  local line = ("cd %s && { env --default-signal=INT,HUP %s %s%s %s & pid=$!; n=0; "
    .. "while ! grep -qs %s %s && [ $n -lt 600 ]; do sleep 0.05; n=$((n + 1)); done; kill -s %s $pid; wait $pid; }")
    :format(dir, M3LUA, SCRIPTS, name, args, mark or "loss", ready, sig)
  return helper.run("sh -c " .. quote(line))
end

describe("m3.flags", function()
  it("checks every item of a list flag", function()
    local spec = {
      { "widths", "64", "", list = true, int = true, min = 1 },
      { "rates", "1e-3", "", list = true, min = 1e-9 },
      { "tasks", "a,b", "", list = true, choices = { "a", "b" } },
    }
    local o = flags.values({ "--widths", "32,64", "--rates=1e-3,3e-3", "--tasks", "b" }, spec)
    assert.same({ widths = "32,64", rates = "1e-3,3e-3", tasks = "b" }, o)
    local function err(...) return helper.error_of(flags.values, { ... }, spec) end
    assert.equal('--widths expects a comma-separated list of integers >= 1, got "32,0"', err("--widths", "32,0"))
    assert.equal('--widths expects a comma-separated list of integers >= 1, got "1.5"', err("--widths", "1.5"))
    assert.equal('--widths expects a comma-separated list of integers >= 1, got ""', err("--widths="))
    assert.equal('--rates expects a comma-separated list of numbers >= 1e-09, got "-1"', err("--rates", "-1"))
    assert.equal('--tasks expects a comma-separated list of a | b, got "a,A"', err("--tasks", "a,A"))
    -- an item given twice would run (or sweep) the same thing twice under one name
    assert.equal('--tasks repeats an item ("a" and "a") in "a,b,a": give each once', err("--tasks", "a,b,a"))
    assert.equal('--tasks expects a comma-separated list of a | b, got ""', err("--tasks="))
    assert.equal('--rates repeats an item ("1e-3" and "0.001") in "1e-3,0.001": give each once',
      err("--rates", "1e-3,0.001"))
  end)

  it("takes an empty list for a list flag whose default is empty (the script's own choice), no other", function()
    local spec = { { "configs", "", "comma list; empty: all", list = true, choices = { "a", "b" } },
      { "widths", "", "", list = true, int = true, min = 1 } }
    assert.same({ configs = "", widths = "" }, flags.values({ "--configs", "", "--widths=" }, spec))
    assert.equal('--configs expects a comma-separated list of a | b, got ","',
      helper.error_of(flags.values, { "--configs", "," }, spec))
  end)

  it("bounds a number flag by max", function()
    local spec = { { "steps", 600, "", int = true, min = 1, max = flags.INT32 }, { "scale", 1, "", max = 2 } }
    assert.same({ steps = 2147483647, scale = -3 }, (flags.values({ "--steps", "2147483647", "--scale", "-3" }, spec)))
    local function err(...) return helper.error_of(flags.values, { ... }, spec) end
    assert.equal('--steps expects an integer from 1 to 2147483647, got "1e10"', err("--steps", "1e10"))
    assert.equal('--scale expects a number <= 2, got "3"', err("--scale", "3"))
    -- given twice: the last value (a wrapper's defaults, then the user's), each checked
    assert.same({ steps = 7, scale = 1 }, (flags.values({ "--steps", "5", "--steps=7" }, spec)))
    assert.equal('--steps expects an integer from 1 to 2147483647, got "0"', err("--steps", "0", "--steps", "5"))
  end)

  it("takes decimal numbers only, also in lists", function()
    local spec = { { "shift", 0, "" }, { "steps", 10, "", int = true, min = 1 },
      { "lrs", "1", "", list = true, min = 0 } }
    local o = flags.values({ "--shift", "-1.5e+2", "--steps", "1E1", "--lrs", ".5,5.,+2,3e-4" }, spec)
    assert.same({ shift = -150, steps = 10, lrs = ".5,5.,+2,3e-4" }, o)
    assert.equal(-0.5, (flags.values({ "--shift=-.5" }, spec)).shift)
    local function err(...) return helper.error_of(flags.values, { ... }, spec) end
    for _, text in ipairs { "0x10", "inf", "-inf", "nan", " 5", "5 ", "1e", "0b1", "0x1p4", ".", "-", "1e+", "1.2.3",
      "e5", "5e1.5", "" } do
      assert.equal(string.format("--shift expects a finite number, got %q", text), err("--shift", text))
    end
    assert.equal('--steps expects an integer >= 1, got "0x10"', err("--steps", "0x10"))
    assert.equal('--lrs expects a comma-separated list of numbers >= 0, got "1,0x10"', err("--lrs", "1,0x10"))
  end)

  it("takes no flag for the value of the flag before it, except in the --name=value form", function()
    local spec = { { "run", "", "" }, { "resume", false, "" }, { "shift", 0, "" } }
    local function err(...) return helper.error_of(flags.values, { ... }, spec) end
    assert.equal("--run expects a value; got the flag --resume: use --run=--resume for a value that starts with --",
      err("--run", "--resume"))
    assert.equal("--shift expects a value; got the flag --run=x: use --shift=--run=x for a value that starts with --",
      err("--shift", "--run=x"))
    assert.equal("--run expects a value; got the flag --: use --run=-- for a value that starts with --",
      err("--run", "--"))
    assert.same({ run = "--resume", resume = false, shift = -1 },
      (flags.values({ "--run=--resume", "--shift", "-1" }, spec)))
    assert.same({ run = "-h", resume = true, shift = 0 }, (flags.values({ "--run", "-h", "--resume" }, spec)))
  end)

  it("prints the usage for --help or -h where a flag is expected, not for -h as the value of the flag before", function()
    local out, code = script("train.lua", "--run -h --steps 0")
    assert.equal(2, code, out) -- the run "-h": the bad --steps is what stops it (it printed the usage, status 0)
    assert.matches("^%-%-steps expects an integer from 1 to 2147483647, got \"0\"\n", out)
    for _, args in ipairs { "--run --help", "--resume -h", "--steps 0 -h" } do
      out, code = script("train.lua", args)
      assert.equal(0, code, args)
      assert.matches("^m3lua scripts/train%.lua %[flags%]\n", out, nil, args)
    end
  end)

  it("says which flags were given, also at their default value", function()
    local spec = { { "steps", 600, "" }, { "lr", 1e-3, "" }, { "resume", false, "" } }
    local o, changed, given = flags.values({ "--steps=600", "--lr", "2e-3" }, spec)
    assert.same({ steps = 600, lr = 2e-3, resume = false }, o)
    assert.same({ "lr" }, changed)
    assert.same({ steps = true, lr = true }, given)
  end)
end)

describe("scripts/train.lua", function()
  local TINY = "--d_model 8 --headdim 8 --d_state 8 --n_layers 1 --batch 4 --micro_batch 4 --eval_batches 1 "
    .. "--device cpu"

  it("never starts over the checkpoints of an earlier run unless told to (--resume, --overwrite)", function()
    local dir = tmpdir()
    local function steps()
      local out = {}
      for _, c in ipairs(m3.checkpoint.new { dir = dir .. "/runs/r/checkpoints" }:list()) do out[#out + 1] = c.step end
      return out
    end
    local function run(args) return script_in(dir, "train.lua", "--run r " .. TINY .. " " .. args) end
    local out, code = run("--steps 6 --save_every 2")
    assert.equal(0, code, out)
    assert.same({ 2, 4, 6 }, steps())
    out, code = run("--steps 3")
    assert.equal(2, code, out)
    assert.equal("train.lua: runs/r holds the checkpoints of an earlier run (the newest: step 6); pass --resume to "
      .. "continue it, --overwrite to start afresh (deleting them), or choose another --run\n", out)
    out, code = run("--steps 3 --resume --overwrite")
    assert.equal(2, code, out)
    assert.equal("train.lua: --resume continues the run in runs/r, --overwrite starts it afresh: give one of them\n", out)
    assert.same({ 2, 4, 6 }, steps())
    out, code = run("--steps 8 --save_every 2 --resume")
    assert.equal(0, code, out)
    assert.matches("resuming runs/r at step 6", out, 1, true)
    assert.same({ 4, 6, 8 }, steps())
    out, code = run("--steps 3 --overwrite")
    assert.equal(0, code, out)
    assert.same({ 3 }, steps())
    os.execute("rm -rf " .. dir)
  end)

  it("trains every task with its default lengths; refuses lengths a task cannot draw before writing anything",
    function()
    local dir = tmpdir()
    for _, task in ipairs { "parity", "arithmetic", "brackets", "mqar" } do
      -- arithmetic and brackets draw no sequence shorter than 2: the default --min_length 1 failed at step 1
      local out, code = script_in(dir, "train.lua", "--run " .. task .. " --task " .. task .. " --steps 3 " .. TINY)
      assert.equal(0, code, out)
      assert.matches("accuracy at length 64", out)
    end
    local out, code = script_in(dir, "train.lua", "--run a1 --task arithmetic --min_length 1 --steps 3 " .. TINY)
    assert.equal(2, code, out)
    assert.equal("train.lua: m3.data.arithmetic: min_length must be an integer in [2, length = 12], got 1\n", out)
    assert.is_false(m3.fs.exists(dir .. "/runs/a1"))
    os.execute("rm -rf " .. dir)
  end)

  it("--help names the shortest sequence of each task that draws none of length 1 (--min_length's default)", function()
    local out, code = script("train.lua", "--help")
    assert.equal(0, code, out)
    local line = out:match("%-%-min_length.-%(default") -- the flag's text, over its two lines
    local sources = { parity = m3.data.parity {}, arithmetic = m3.data.arithmetic {},
      brackets = m3.data.arithmetic { brackets = true }, mqar = m3.data.mqar {} }
    for task, src in pairs(sources) do
      if src.shortest > 1 then -- mqar's 3 was missing
        assert.matches(src.shortest .. " for [%w%s]-" .. task, line, nil, task)
      end
    end
  end)

  it("trains on the GPU under captured graphs; refuses f16 accumulation before writing anything #gpu", function()
    if not helper.need_gpu(pending) then return end
    local dir = tmpdir()
    local on_gpu = TINY:gsub("cpu$", "cuda")
    local out, code = script_in(dir, "train.lua", "--run g --steps 4 --dtype bf16 " .. on_gpu)
    assert.equal(0, code, out)
    assert.matches("runs/g: parity, %d+ parameters, cuda:0 bf16", out)
    -- f16 cannot accumulate: --batch 8 over --micro_batch 4 stops before anything is written
    out, code = script_in(dir, "train.lua", "--run h --steps 4 --dtype f16 " .. on_gpu .. " --batch 8")
    assert.equal(2, code, out)
    assert.matches("^train.lua: m3.fit.run: batch = 8 rows a step, but the trainer computes in f16 with 4 rows", out)
    assert.is_false(m3.fs.exists(dir .. "/runs/h"))
    out, code = script_in(dir, "train.lua", "--run h --steps 4 --dtype f16 " .. on_gpu)
    assert.equal(0, code, out)
    os.execute("rm -rf " .. dir)
  end)

  it("numbers an automatic run name past earlier runs' checkpoints; --resume takes the newest", function()
    local dir = tmpdir()
    local args = TINY .. " --steps 3 --save_every 3"
    local function steps(run)
      local out = {}
      for _, c in ipairs(m3.checkpoint.new { dir = dir .. "/" .. run .. "/checkpoints" }:list()) do
        out[#out + 1] = c.step
      end
      return out
    end
    local out, code = script_in(dir, "train.lua", args)
    assert.equal(0, code, out)
    local base = out:match("(runs/[^:\n]+): parity")
    assert.truthy(base, out)
    local pattern = base:gsub("%p", "%%%0")
    out, code = script_in(dir, "train.lua", args)
    assert.equal(0, code, out)
    assert.matches(pattern .. "%-2: parity", out)
    assert.same({ 3 }, steps(base))
    assert.same({ 3 }, steps(base .. "-2"))
    out, code = script_in(dir, "train.lua", args .. " --resume")
    assert.equal(0, code, out)
    assert.matches("resuming " .. pattern .. "%-2 at step 3", out)
    out, code = script_in(dir, "train.lua", args .. " --overwrite")
    assert.equal(0, code, out)
    assert.matches(pattern .. ": parity", out)
    assert.same({ 3 }, steps(base))
    assert.same({ 3 }, steps(base .. "-2"))
    assert.same({}, steps(base .. "-3"))
    os.execute("rm -rf " .. dir)
  end)

  it("--resume with flags that change an automatically named run continues that run; several are an error", function()
    local dir = tmpdir()
    local function run(args) return script_in(dir, "train.lua", TINY .. " --save_every 100 " .. args) end
    local out, code = run("--steps 3")
    assert.equal(0, code, out)
    local first = out:match("(runs/[^:\n]+): parity")
    assert.truthy(first, out)
    -- --steps 5 names another folder, which holds no checkpoints: the run that --steps changes goes on
    out, code = run("--steps 5 --resume")
    assert.equal(0, code, out)
    assert.matches("resuming " .. first:gsub("%p", "%%%0") .. " at step 3\n", out)
    out, code = run("--steps 3 --lr 0.001")
    assert.equal(0, code, out)
    local second = out:match("(runs/[^:\n]+): parity")
    assert.matches("lr=0.001", second, 1, true)
    -- --lr not given keeps the first run's; given, it could change either run
    out, code = run("--steps 7 --resume")
    assert.equal(0, code, out)
    assert.matches("resuming " .. first:gsub("%p", "%%%0") .. " at step 5\n", out)
    out, code = run("--steps 9 --lr 0.002 --resume")
    assert.equal(2, code, out)
    assert.matches("^train%.lua: %-%-resume: runs/[^\n]+lr=0%.002[^\n]+ holds no checkpoints, and the flags given could "
      .. "change any of " .. first:gsub("%p", "%%%0") .. ", " .. second:gsub("%p", "%%%0") .. ": name the run to "
      .. "resume with %-%-run\n$", out)
    -- a fixed flag that differs matches no run: a new one
    out, code = run("--steps 9 --d_model 16 --headdim 16 --resume")
    assert.equal(0, code, out)
    assert.matches("no checkpoint in runs/[^\n]+; starting from scratch\n", out)
    os.execute("rm -rf " .. dir)
  end)

  it("resumes with the run's own flag values, refuses a fixed one that differs, records only those used", function()
    local dir = tmpdir()
    local options = dir .. "/runs/r/options.json"
    local function run(args) return script_in(dir, "train.lua", "--run r " .. args) end
    local out, code = run(TINY .. " --steps 4 --save_every 2 --lr 0.004")
    assert.equal(0, code, out)
    local made = m3.fs.read(options)
    out, code = run("--resume --steps 6 --d_model 16 --n_layers 1 --headdim 4 --lr 0.002")
    assert.equal(2, code, out)
    assert.equal("train.lua: runs/r: --d_model 16 --headdim 4 differ from the run's own --d_model 8 --headdim 8; a "
      .. "resumed run keeps the flags fixed for a run (see --help): leave them out, or start a new run (another "
      .. "--run, or --overwrite)\n", out)
    assert.equal(made, m3.fs.read(options))
    -- flags left out keep the run's values (its model, --lr, --device); --steps given goes on to 6
    out, code = run("--resume --steps 6 --n_layers 1")
    assert.equal(0, code, out)
    assert.matches("resuming runs/r at step 4\nruns/r: parity, %d+ parameters, cpu f32; .*; 6 steps of 4 sequences", out)
    assert.matches("; runs/r in %d+s %(from step 4 on%)\n$", out) -- the time is this process's
    local saved = m3.json.read(options)
    assert.same({ 8, 1, 0.004, "cpu", 6 }, { saved.d_model, saved.n_layers, saved.lr, saved.device, saved.steps })
    assert.is_nil(saved.resume)
    os.execute("rm -rf " .. dir)
  end)

  it("saves a checkpoint on SIGINT, SIGTERM or SIGHUP and ends with its message and 128 + the signal, no traceback",
    function()
      local dir = tmpdir()
      for sig, status in pairs { INT = 130, TERM = 143, HUP = 129 } do
        local out, code = signalled("train.lua", TINY .. " --steps 100000 --eval_every 100000 --run " .. sig, dir,
          "runs/" .. sig .. "/metrics.jsonl", sig)
        assert.equal(status, code, out)
        local step = out:match("\ntrain%.lua: interrupted at step (%d+); saved runs/" .. sig
          .. "/checkpoints/step%-0*%1%.ckpt %(resume from it%)\n$")
        assert.truthy(step, out)
        assert.is_nil(out:find("traceback", 1, true), out)
      end
      os.execute("rm -rf " .. dir)
    end)

  it("--resume continues the run whose checkpoint is the newest: <name> restarted by --overwrite, not <name>-2",
    function()
      local dir = tmpdir()
      local args = TINY .. " --steps 3 --save_every 3"
      local out, code = script_in(dir, "train.lua", args)
      assert.equal(0, code, out)
      local base = out:match("(runs/[^:\n]+): parity")
      local pattern = base:gsub("%p", "%%%0")
      out, code = script_in(dir, "train.lua", args)
      assert.equal(0, code, out)
      out, code = script_in(dir, "train.lua", args .. " --overwrite")
      assert.equal(0, code, out)
      out, code = script_in(dir, "train.lua", args .. " --resume")
      assert.equal(0, code, out)
      assert.matches("^resuming " .. pattern .. " at step 3 %(its newest checkpoint, saved [%d-]+ [%d:]+, is newer "
        .. "than those of " .. pattern .. "%-2%)\n", out)
      os.execute("rm -rf " .. dir)
    end)

  it("--resume refuses a run whose options.json cannot be read, naming it, and writes nothing", function()
    local dir = tmpdir()
    local options = dir .. "/runs/r/options.json"
    local out, code = script_in(dir, "train.lua", "--run r " .. TINY .. " --steps 3 --save_every 3 --lr 0.004")
    assert.equal(0, code, out)
    -- a stray comma: the run trained on with the default flags and wrote them over the record
    local made = m3.fs.read(options)
    local broken = made:gsub("}%s*$", ",}\n")
    m3.fs.write(options, broken)
    out, code = script_in(dir, "train.lua", "--run r --resume --steps 6")
    assert.equal(2, code, out)
    assert.matches("^train%.lua: %-%-resume: runs/r holds checkpoints, but its options%.json cannot be used %(runs/r/"
      .. "options%.json: json%.decode: .-%); %-%-resume takes the run's flags from it: restore the file, or start "
      .. "afresh %(%-%-overwrite%)\n$", out)
    assert.equal(broken, m3.fs.read(options))
    assert.equal(1, #m3.checkpoint.new { dir = dir .. "/runs/r/checkpoints" }:list())
    -- a value of the right type that the flag does not take: "attempt to call a nil value" for the task, a library
    -- message without the file for --save_every
    for _, case in ipairs {
      { "task", "nope", 'task = "nope": --task expects one of parity | arithmetic | brackets | mqar, got "nope"' },
      { "save_every", 2.5, 'save_every = 2.5: --save_every expects an integer >= 0, got "2.5"' },
    } do
      local saved = m3.json.decode(made)
      saved[case[1]] = case[2]
      m3.fs.write(options, m3.json.encode(saved))
      out, code = script_in(dir, "train.lua", "--run r --resume --steps 6")
      assert.equal(2, code, out)
      assert.equal("train.lua: --resume: runs/r holds checkpoints, but its options.json cannot be used (runs/r/"
        .. "options.json: " .. case[3] .. "); --resume takes the run's flags from it: restore the file, or start "
        .. "afresh (--overwrite)\n", out)
    end
    os.execute("rm -rf " .. dir)
  end)

  it("gives two identical commands started together a run folder each", function()
    local dir = tmpdir()
    -- numbering skipped only folders with checkpoints: both took the same one, where keep pruned each other's
    local command = M3LUA .. " " .. SCRIPTS .. "train.lua " .. TINY .. " --steps 40 --save_every 10"
    helper.run("sh -c " .. quote(("cd %s && { %s >a.out 2>&1 & %s >b.out 2>&1 & wait; }"):format(dir, command,
      command)))
    local a, b = m3.fs.read(dir .. "/a.out"), m3.fs.read(dir .. "/b.out")
    local ra, rb = a:match("(runs/[^:\n]+): parity"), b:match("(runs/[^:\n]+): parity")
    assert.truthy(ra and rb, a .. b)
    assert.are_not.equal(ra, rb)
    assert.equal((ra:gsub("%-2$", "")), (rb:gsub("%-2$", "")))
    os.execute("rm -rf " .. dir)
  end)

  it("takes every --seed the data takes: the evaluation set's seed wraps around below 2^53", function()
    local dir = tmpdir()
    -- --seed + 1000003 was refused for seeds from 2^53 - 1000003 on
    local out, code = script_in(dir, "train.lua", "--run s " .. TINY .. " --steps 3 --seed 9007199254740000")
    assert.equal(0, code, out)
    assert.matches("accuracy at length 64", out, 1, true)
    os.execute("rm -rf " .. dir)
    -- 2^53 and past: refused with the flags (it reached the library as a rounded seed that looked valid)
    for _, name in ipairs { "train.lua", "lm.lua" } do
      out, code = script(name, "--seed 9007199254740992")
      assert.equal(2, code, out)
      assert.matches('^%-%-seed expects an integer from 0 to [^,]+, got "9007199254740992"\n', out)
    end
  end)
end)

describe("m3.rundir", function()
  it("resumes a path flag fixed for a run when it names the run's own file, and refuses another file", function()
    local rundir = require "m3.rundir"
    local dir = tmpdir()
    local run = dir .. "/runs/r"
    assert(os.execute("mkdir -p " .. run .. "/checkpoints && touch " .. run .. "/checkpoints/step-00000002.ckpt") == 0)
    m3.fs.write(dir .. "/data.txt", "abc")
    m3.fs.write(dir .. "/other.txt", "abc")
    m3.fs.write(run .. "/options.json", m3.json.encode { data = dir .. "/data.txt", steps = 4 })
    local spec = { { "data", "", "", fixed = true, path = true }, { "steps", 1, "", int = true },
      { "resume", false, "" }, { "overwrite", false, "" } }
    local o = { data = dir .. "/./runs/../data.txt", steps = 6, resume = true, overwrite = false }
    rundir.open(run, o, { data = true, steps = true, resume = true }, spec)
    assert.equal(dir .. "/./runs/../data.txt", o.data)
    o = { data = dir .. "/other.txt", steps = 6, resume = true, overwrite = false }
    local err = helper.error_of(rundir.open, run, o, { data = true, steps = true, resume = true }, spec)
    os.execute("rm -rf " .. dir)
    assert.equal(run .. ": --data " .. dir .. "/other.txt differs from the run's own --data " .. dir .. "/data.txt; a "
      .. "resumed run keeps the flags fixed for a run (see --help): leave it out, or start a new run (another --run, "
      .. "or --overwrite)", err)
  end)
end)

describe("scripts/lm.lua", function()
  it("--resume takes no run of another --data whose folder a numbered one seems (lm-wiki-2 of wiki-2.txt)", function()
    local dir = tmpdir()
    local r, chars = m3.data.rng.new(5), {}
    for i = 1, 4000 do chars[i] = string.char(97 + r:below(20)) end
    m3.fs.write(dir .. "/wiki.txt", table.concat(chars))
    m3.fs.write(dir .. "/wiki-2.txt", table.concat(chars))
    local out, code = script_in(dir, "lm.lua", "--run src --data wiki.txt --steps 2 --save_every 2 --eval_batches 1 "
      .. "--sample_len 1 --device cpu")
    assert.equal(0, code, out)
    -- runs/lm-wiki: the run of wiki.txt with the default flags; runs/lm-wiki-2, newer: that of wiki-2.txt
    for i, name in ipairs { "lm-wiki", "lm-wiki-2" } do
      assert(os.execute("cp -r " .. dir .. "/runs/src " .. dir .. "/runs/" .. name) == 0)
      local saved = m3.json.read(dir .. "/runs/src/options.json")
      saved.run, saved.steps, saved.eval_batches, saved.data = "", 600, 8, name:sub(4) .. ".txt"
      m3.fs.write(dir .. "/runs/" .. name .. "/options.json", m3.json.encode(saved))
      assert(os.execute(("touch -d '2026-01-01 00:00:0%d' %s/runs/%s/checkpoints/*"):format(i, dir, name)) == 0)
    end
    -- --steps 2 names runs/lm-wiki-steps=2, which holds none: the run of wiki.txt it changes goes on (it took
    -- runs/lm-wiki-2, then refused: "--data wiki.txt differs from the run's own --data wiki-2.txt")
    out, code = script_in(dir, "lm.lua", "--data wiki.txt --steps 2 --sample_len 1 --resume")
    assert.equal(0, code, out)
    assert.matches("^resuming runs/lm%-wiki at step 2\n", out)
    assert.matches("bits/byte after 2 steps %(%d+s from step 2 on%)\n", out)
    os.execute("rm -rf " .. dir)
  end)

  it("never starts over the checkpoints of an earlier run unless told to", function()
    local dir = tmpdir()
    local file = dir .. "/runs/r/checkpoints/step-00000005.ckpt"
    assert(os.execute("mkdir -p " .. dir .. "/runs/r/checkpoints && echo kept > " .. file) == 0)
    local out, code = script_in(dir, "lm.lua", "--run r --steps 1")
    assert.equal(2, code, out)
    assert.equal("lm.lua: runs/r holds the checkpoints of an earlier run (the newest: step 5); pass --resume to "
      .. "continue it, --overwrite to start afresh (deleting them), or choose another --run\n", out)
    assert.equal("kept\n", m3.fs.read(file))
    os.execute("rm -rf " .. dir)
  end)

  local TINY = "--d_model 16 --n_layers 1 --headdim 8 --d_state 8 --seq_len 16 --batch 4 --micro_batch 4 --device cpu"

  it("writes a sample of 8000 bytes or more, and prompts with the validation text of a file over 2.4 GB", function()
    local dir = tmpdir()
    -- a sparse file of 2.6 GB: its validation text starts past 2^31 (zeros, but for the last byte)
    local f = assert(io.open(dir .. "/big.txt", "wb"))
    assert(f:seek("set", 2599999999))
    f:write("z")
    f:close()
    local out, code = script_in(dir, "lm.lua", "--run big --data big.txt --steps 1 --eval_batches 1 --sample_len 8000 "
      .. TINY)
    assert.equal(0, code, out)
    assert.equal(8000, #m3.fs.read(dir .. "/runs/big/sample.txt"))
    assert.equal(string.rep("\0", 64), m3.fs.read(dir .. "/runs/big/prompt.txt"))
    out, code = script_in(dir, "lm.lua", "--run prompt --data big.txt --steps 1 --eval_batches 1 --sample_len 1 "
      .. "--prompt " .. string.rep("a", 9000) .. " " .. TINY)
    assert.equal(0, code, out)
    assert.equal(string.rep("a", 9000), m3.fs.read(dir .. "/runs/prompt/prompt.txt"))
    assert.equal(1, #m3.fs.read(dir .. "/runs/prompt/sample.txt"))
    os.execute("rm -rf " .. dir)
  end)

  it("names the file's size and its parts (adding up), shows the prompt and the generation apart; --sample_len 0: none",
    function()
      local dir = tmpdir()
      local r, chars = m3.data.rng.new(4), {}
      for i = 1, 1000 do chars[i] = string.char(97 + r:below(20)) end
      -- 303076 bytes: 272768 for training (266.4 KB), 30308 for validation (29.6 KB), 296.0 KB in all
      m3.fs.write(dir .. "/lic.txt", (table.concat(chars):rep(304)):sub(1, 303076))
      local out, code = script_in(dir, "lm.lua", "--run s --data lic.txt --steps 1 --eval_batches 1 --sample_len 5 "
        .. "--prompt abc " .. TINY)
      assert.equal(0, code, out)
      assert.matches("^runs/s: lic%.txt %(296 KB: 266 KB for training, 30 KB for validation%), %d+ parameters, cpu f32\n",
        out)
      local sample = m3.fs.read(dir .. "/runs/s/sample.txt")
      assert.equal(5, #sample)
      assert.equal("abc", m3.fs.read(dir .. "/runs/s/prompt.txt"))
      assert.matches("\nvalidation: [^\n]* after 1 step %(%d+s%)\nprompt %(3 bytes, in prompt%.txt%):\nabc\n", out)
      local tail = "\nabc\ngenerated (5 bytes, in sample.txt):\n" .. sample .. (sample:sub(-1) == "\n" and "" or "\n")
      assert.equal(tail, out:sub(-#tail))
      out, code = script_in(dir, "lm.lua", "--run n --data lic.txt --steps 1 --eval_batches 1 --sample_len 0 " .. TINY)
      assert.equal(0, code, out)
      assert.matches("after 1 step %(%d+s%)\n$", out)
      assert.is_nil(io.open(dir .. "/runs/n/sample.txt"))
      assert.is_nil(io.open(dir .. "/runs/n/prompt.txt"))
      -- the run that --overwrite replaces leaves no sample behind (they passed for the new run's)
      out, code = script_in(dir, "lm.lua", "--run s --overwrite --data lic.txt --steps 1 --eval_batches 1 "
        .. "--sample_len 0 " .. TINY)
      assert.equal(0, code, out)
      assert.is_nil(io.open(dir .. "/runs/s/sample.txt"))
      assert.is_nil(io.open(dir .. "/runs/s/prompt.txt"))
      os.execute("rm -rf " .. dir)
    end)

  it("validates on distinct windows, each once where the validation text holds fewer than asked, and says so",
    function()
      local dir = tmpdir()
      local r, chars = m3.data.rng.new(3), {}
      for i = 1, 2000 do chars[i] = string.char(97 + r:below(20)) end
      m3.fs.write(dir .. "/small.txt", table.concat(chars))
      -- 200 bytes for validation: 12 windows of 16; 8 batches of 4 drew 32 of them, the 12 over and over
      local out, code = script_in(dir, "lm.lua", "--run v --data small.txt --steps 3 --save_every 3 --sample_len 1 "
        .. TINY)
      assert.equal(0, code, out)
      assert.matches("^runs/v: small%.txt %(2000 bytes: 1800 bytes for training, 200 bytes for validation%)", out)
      assert.matches("\nvalidation: the validation text holds 12 windows of 16 bytes, fewer than --eval_batches x "
        .. "--micro_batch = 32: each counts once (3 batches of 4)\n", out, 1, true)
      local records = m3.log.read_jsonl(dir .. "/runs/v/metrics.jsonl")
      local last = records[#records]
      assert.equal(3, last.step)
      -- the loss over the 12 windows, one a batch, from the run's last checkpoint
      local tr = m3.checkpoint.resume(dir .. "/runs/v/checkpoints", { device = "cpu" })
      local val = m3.data.text(dir .. "/small.txt", { split = "val", order = "sequential", length = 16 })
      local e = m3.fit.evaluate(tr, val, { batches = 12, rows = 1, length = 16 })
      assert.near(e.loss, last.val_loss, 1e-5 * e.loss)
      assert.near(e.loss / math.log(2), last.val_bpb, 1e-5 * e.loss)
      tr:close()
      os.execute("rm -rf " .. dir)
    end)
end)

describe("scripts/sweep_state_tracking.lua", function()
  local SMALL = "--quick --steps 4 --from_length 16 --max_length 16 --eval_length 16 --eval_every 2 "
    .. "--eval_batches 1 --batch 4 --micro_batch 4 --models rope"

  it("stops on bad flags before any point runs", function()
    local dir = tmpdir() .. "/never"
    for args, message in pairs {
      ["--tasks bogus"] = "--tasks expects a comma-separated list of parity | arithmetic | brackets",
      ["--tasks ''"] = '--tasks expects a comma-separated list of parity | arithmetic | brackets, got ""',
      ["--models ROPE"] = "--models expects a comma-separated list of rope | norope",
      ["--d_models 0"] = "--d_models expects a comma-separated list of integers >= 1",
      ["--lrs -1"] = "--lrs expects a comma-separated list of numbers >= 1e-09",
      ["--steps 0"] = "--steps expects an integer from 1 to 2147483647",
      ["--eval_batches 1e10"] = "--eval_batches expects an integer from 1 to 2147483647",
      ["--dtype f16"] = "--dtype expects one of f32 | bf16",
      ["--d_models 40 --headdim 32"] = "sweep_state_tracking.lua: m3: headdim = 32: must divide d_inner",
      ["--parity_density 2"] = "sweep_state_tracking.lua: --parity_density must be a probability in [0, 1] or random",
      ["--tasks arithmetic --parity_density x"] = "--parity_density must be a probability in [0, 1] or random, got x",
    } do
      local out, code = script("sweep_state_tracking.lua", "--dir " .. dir .. " " .. args)
      assert.equal(2, code, args)
      assert.matches(message, out, 1, true)
      assert.is_nil(out:find("traceback", 1, true), out)
    end
    if m3.cuda_device_count() == 0 then
      local out, code = script("sweep_state_tracking.lua", "--dir " .. dir .. " --dtype bf16")
      assert.equal(2, code)
      assert.matches("the CPU backend computes in f32 only", out, 1, true)
    end
    assert.is_nil(io.open(dir))
  end)

  it("stops before any point runs when the sweep folder cannot be made", function()
    local file = tmpdir() .. "/file"
    assert(os.execute("touch " .. file) == 0)
    local out, code = script("sweep_state_tracking.lua", SMALL .. " --dir " .. file .. "/sweep")
    assert.equal(2, code, out)
    assert.equal("sweep_state_tracking.lua: m3.fs: cannot create the folder " .. file .. "/sweep: Not a directory\n", out)
    os.remove(file)
  end)

  it("prints its header before a point's error in piped output; 1 point, not 1 points", function()
    local dir = tmpdir()
    assert(os.execute("touch " .. dir .. "/task=parity,model=rope,d_model=32,lr=0.005") == 0)
    local out, code = script("sweep_state_tracking.lua", SMALL .. " --dir " .. dir .. " --tasks parity --lrs 5e-3")
    assert.equal(1, code, out)
    assert.matches("^state tracking: 1 point, 4 steps each, lengths up to 16, evaluated at 16 %-> ", out)
    -- the table (stdout) comes before the failure's last line (stderr)
    assert.matches("\nper point: [^\n]*results%.csv\nm3%.sweep: 1 of 1 point failed ", out)
    os.execute("rm -rf " .. dir)
  end)

  it("exits 1 when a point failed (a repeated list item is refused by m3.flags)", function()
    local dir = tmpdir()
    -- a file where the parity point's folder goes: that point fails, arithmetic runs
    assert(os.execute("touch " .. dir .. "/task=parity,model=rope,d_model=32,lr=0.005") == 0)
    local out, code = script("sweep_state_tracking.lua", SMALL .. " --dir " .. dir
      .. " --tasks parity,arithmetic --lrs 5e-3")
    assert.equal(1, code, out)
    assert.matches("state tracking: 2 points,", out, 1, true)
    assert.matches("m3.sweep: 1 of 2 points failed (task=parity,model=rope,d_model=32,lr=0.005;", out, 1, true)
    assert.matches("arithmetic, no brackets%s+%-?%d+%.%d%d /  98%.51", out)
    os.execute("rm -rf " .. dir)
  end)
end)

describe("scripts/bench.lua and bench_decode.lua", function()
  it("refuse a device or dtype that cannot run here before timing anything", function()
    for _, bench in ipairs { "bench.lua", "bench.lua --decode" } do
      local name = bench == "bench.lua" and "bench.lua" or "bench_decode.lua"
      local cases = {
        ["--device gpu"] = '--device expects one of auto | cuda | cpu, got "gpu"',
        ["--configs bogus"] = "--configs expects a comma-separated list of",
        ["--device cpu --dtypes f32,bf16"] = name .. ": --dtypes f32,bf16: the CPU backend computes in f32 only",
      }
      if m3.cuda_device_count() == 0 then
        cases["--device cuda"] = name .. ": --device cuda: no CUDA device here"
      end
      for args, message in pairs(cases) do
        local out, code = script(bench, args)
        assert.equal(2, code, bench .. " " .. args .. ": " .. out)
        assert.matches(message, out, 1, true)
        assert.is_nil(out:find("FAILED", 1, true))
      end
    end
  end)

  it("stop at once on SIGINT or SIGTERM, with the interrupt and 128 + the signal, no FAILED rows", function()
    local dir = tmpdir()
    local cases = {
      ["bench.lua"] = { "--device cpu --configs rl-batch,rl --steps 100000",
        "== rl%-batch f32 B 16 x T 256 %([%d.]+ M params%) %.%.%. " },
      ["bench_decode.lua"] = { "--device cpu --configs lm130,rl", "== lm130 f32 B 1 %.%.%. " },
    }
    for name, case in pairs(cases) do
      for sig, status in pairs { INT = 130, TERM = 143 } do
        os.remove(dir .. "/out") -- the last run's, which would be taken as ready
        local _, code = signalled(name, case[1] .. " >out 2>&1", dir, "out", sig, "==")
        local f = assert(io.open(dir .. "/out"))
        local out = f:read("*a")
        f:close()
        assert.equal(status, code, name .. " " .. sig .. ": " .. out)
        assert.matches("\n" .. case[2] .. name:gsub("%.", "%%.") .. ": interrupted[^\n]*\n$", out)
        assert.is_nil(out:find("FAILED", 1, true), out)
      end
    end
    os.execute("rm -rf " .. dir)
  end)

  it("bench.lua names a config left out for its dtype, and refuses when nothing or --profile would run", function()
    for args, message in pairs {
      ["--device cpu --configs lm130-b16"] = "bench.lua: nothing to run: lm130-b16 runs in bf16 only "
        .. "(the CPU computes in f32 only)\n",
      ["--device cpu --profile"] = "bench.lua: --profile: the phase timing needs the CUDA backend",
      -- an empty --configs is the default (rl-batch here): the flag takes it, --profile stops the run
      ["--device cpu --configs '' --profile"] = "bench.lua: --profile: the phase timing needs the CUDA backend",
    } do
      local out, code = script("bench.lua", args)
      assert.equal(2, code, args .. ": " .. out)
      assert.matches(message, out, 1, true)
      assert.is_nil(out:find("==", 1, true), out)
    end
    local out, code = script("bench.lua", "--device cpu --configs lm130-b16,rl --steps 1")
    assert.equal(0, code, out)
    assert.matches("\nleft out: lm130-b16 runs in bf16 only (the CPU computes in f32 only)\n== rl f32 ", out, 1, true)
  end)

  it("on the CPU describe what ran: each config's matrix-product share, no device memory", function()
    local out, code = script("bench.lua", "--device cpu --configs rl,rl-batch --steps 1")
    assert.equal(0, code, out)
    assert.matches("\nCPU: every config at B 16 x T 256 (not its CUDA shape), f32\n", out, 1, true)
    assert.matches("\nCPU: share of the step in matrix products: rl %d+%%, rl%-batch %d+%%\n$", out)
    assert.is_nil(out:find("%d GiB"), out)
    for _, name in ipairs { "rl", "rl%-batch" } do
      assert.matches("\n" .. name .. " +f32 +16x256 +no +[%d.]+ +%d+ +[%d.]+ +%- +%- +%- +%-\n", out)
    end
    out, code = script("bench.lua", "--decode --device cpu --configs rl --steps 1")
    assert.equal(0, code, out)
    for _, B in ipairs { 1, 64 } do
      assert.matches("\nrl +f32 +" .. B .. " +[%d.]+ +%d+ +%- +%- +%- +no +%-\n", out)
    end
  end)
end)

describe("m3.flags spellings", function()
  local spec = { { "resume", false, "continue" }, { "max_steps", 10, "steps", int = true } }

  it("takes a switch's value as true/false, 1/0 and on/off", function()
    for text, want in pairs { ["true"] = true, ["1"] = true, on = true, ["false"] = false, ["0"] = false, off = false } do
      assert.equal(want, (flags.values({ "--resume=" .. text }, spec)).resume, text)
    end
    assert.equal('--resume expects true or false, got "yes"', helper.error_of(flags.values, { "--resume=yes" }, spec))
  end)

  it("reads a dash in a flag's name as an underscore", function()
    assert.equal(5, (flags.values({ "--max-steps", "5" }, spec)).max_steps)
    assert.equal(6, (flags.values({ "--max-steps=6" }, spec)).max_steps)
  end)
end)

-- m3.rundir: which run folder --resume takes (the newest checkpoint, not the highest number; on
-- a tie the highest number; only runs named automatically whose flags of the name and flags
-- fixed for a run agree), the refusal of a run whose options.json cannot be used (also a value
-- its flag does not take), and the claim a process holds on its run folder (skipped by the
-- numbering, refused to open, gone with the process, given up with what it made when the setup
-- or the claim itself fails). In a temporary folder of its own (the runs/ there), with
-- other run names in each test (the claims of this process stay with their names).

local ffi = require "ffi"
local fs = require "m3.fs"
local json = require "m3.json"
local rundir = require "m3.rundir"
local helper = require "spec.helper"

pcall(ffi.cdef, "int chdir(const char *path);")

local M3LUA = helper.m3lua() -- here, where a relative $M3LUA points

local SPEC = { { "steps", 3, "", int = true, min = 1 }, { "lr", 1, "" },
  { "data", "", "", fixed = true, path = true }, { "dtype", "f32", "", choices = { "f32", "bf16" } },
  { "run", "", "" }, { "resume", false, "" }, { "overwrite", false, "" } }
local SKIP = { run = true, resume = true, overwrite = true }

-- The flag values of SPEC with those of t over them.
local function flags_of(t)
  local o = { steps = 3, lr = 1, data = "", dtype = "f32", run = "", resume = false, overwrite = false }
  for k, v in pairs(t or {}) do o[k] = v end
  return o
end

-- Runs fn(dir) with the current folder a new temporary one, dir; back in the first one after, the folder removed.
local function in_folder(fn)
  local dir = helper.tmpdir()
  local pwd = io.popen("pwd")
  local back = pwd:read("*l")
  pwd:close()
  assert(ffi.C.chdir(dir) == 0)
  local ok, err = pcall(fn, dir)
  assert(ffi.C.chdir(back) == 0)
  os.execute("rm -rf " .. dir)
  assert(ok, err)
end

-- A run folder runs/<name> holding options.json (a table of flags, or the file's text) and a checkpoint of step
-- whose file was last written at time ("2026-01-01 00:00:05", for touch -d).
local function run_folder(name, options, step, time)
  local dir = "runs/" .. name
  fs.mkdir(dir .. "/checkpoints")
  fs.write(dir .. "/options.json", type(options) == "string" and options or json.encode(flags_of(options)))
  local file = string.format("%s/checkpoints/step-%08d.ckpt", dir, step)
  fs.write(file, "checkpoint")
  assert(os.execute(string.format("touch -d '%s' '%s'", time, file)) == 0)
end

-- rundir.path for the flag values t (given: the names in t) of a run named by default after base (skip: SKIP).
local function path(base, t, skip)
  local given = {}
  for k in pairs(t or {}) do given[k] = true end
  return rundir.path(flags_of(t), given, SPEC, base, skip or SKIP)
end

-- The time of the day 2026-01-01 at 00:00:<sec>, as the reasons of --resume write it.
local function date(sec)
  return os.date("%Y-%m-%d %H:%M:%S", os.time { year = 2026, month = 1, day = 1, hour = 0, min = 0, sec = sec })
end

describe("m3.rundir --resume", function()
  it("takes the folder whose newest checkpoint is the newest, not the one numbered highest, and says why", function()
    in_folder(function()
      -- runs filled a and a-2, then --overwrite restarted a: the -2 run is the older
      run_folder("a", {}, 7, "2026-01-01 00:00:09")
      run_folder("a-2", {}, 40, "2026-01-01 00:00:05")
      local dir, why = path("a", { resume = true })
      assert.equal("runs/a", dir)
      assert.equal("its newest checkpoint, saved " .. date(9) .. ", is newer than those of runs/a-2", why)
      -- three runs, -2 deleted, the next run took the freed -2: the numbering stopped at the gap
      run_folder("b", {}, 3, "2026-01-01 00:00:01")
      run_folder("b-3", {}, 3, "2026-01-01 00:00:03")
      assert.equal("runs/b-3", (path("b", { resume = true })))
      run_folder("b-2", {}, 3, "2026-01-01 00:00:04")
      assert.equal("runs/b-2", (path("b", { resume = true })))
      -- a folder named like a number of the run with --run, for other flags, is not one of them
      run_folder("b-4", { lr = 2 }, 3, "2026-01-01 00:00:08")
      assert.equal("runs/b-2", (path("b", { resume = true })))
      -- one folder: no reason to give
      run_folder("c", {}, 3, "2026-01-01 00:00:01")
      assert.same({ "runs/c" }, { path("c", { resume = true }) })
    end)
  end)

  it("on a tie of checkpoint times takes the folder numbered highest (the later run), and says so", function()
    in_folder(function()
      -- fs.list's text order put runs/t-10 before runs/t-2, which took the tie and was "newer"
      for _, name in ipairs { "t", "t-2", "t-10" } do run_folder(name, {}, 3, "2026-01-01 00:00:05") end
      run_folder("t-3", {}, 3, "2026-01-01 00:00:01")
      local dir, why = path("t", { resume = true })
      assert.equal("runs/t-10", dir)
      assert.equal("its newest checkpoint, saved " .. date(5) .. ", is as new as those of runs/t, runs/t-2 (it has "
        .. "the highest number) and newer than those of runs/t-3", why)
      run_folder("w", {}, 3, "2026-01-01 00:00:05")
      run_folder("w-2", {}, 3, "2026-01-01 00:00:05")
      assert.same({ "runs/w-2", "its newest checkpoint, saved " .. date(5) .. ", is as new as those of runs/w (it "
        .. "has the highest number)" }, { path("w", { resume = true }) })
    end)
  end)

  it("chooses only runs whose flags fixed for a run agree, also one left out of the name (lm.lua's --data)",
    function()
      in_folder(function()
        fs.write("wiki.txt", "wiki")
        fs.write("wiki-2.txt", "wiki 2")
        -- runs/lm-wiki-2 is the run of wiki-2.txt with the default flags, not a second run of wiki.txt: newer, it
        -- was taken, and then refused ("--data wiki.txt differs from the run's own --data wiki-2.txt")
        run_folder("lm-wiki", { data = "wiki.txt" }, 3, "2026-01-01 00:00:01")
        run_folder("lm-wiki-2", { data = "wiki-2.txt" }, 3, "2026-01-01 00:00:09")
        local skip = { data = true, run = true, resume = true, overwrite = true }
        assert.same({ "runs/lm-wiki" }, { path("lm-wiki", { data = "wiki.txt", resume = true }, skip) })
        -- the same where the flags given change the run (runs/lm-wiki-steps=5 holds no checkpoints)
        assert.same({ "runs/lm-wiki" }, { path("lm-wiki", { data = "wiki.txt", resume = true, steps = 5 }, skip) })
        assert.same({ "runs/lm-wiki-2" }, { path("lm-wiki-2", { data = "wiki-2.txt", resume = true }, skip) })
      end)
    end)

  it("leaves a folder named with --run to that --run, which keeps the name the run was started with", function()
    in_folder(function()
      -- a copy of runs/k, or a run named so: options.json says "run": "k-2"
      run_folder("k", {}, 3, "2026-01-01 00:00:01")
      run_folder("k-2", { run = "k-2" }, 3, "2026-01-01 00:00:09")
      assert.same({ "runs/k" }, { path("k", { resume = true }) })
      run_folder("k-3", { steps = 5, run = "k-3" }, 3, "2026-01-01 00:00:09")
      assert.same({ "runs/k" }, { path("k", { resume = true, steps = 5 }) })
      -- --run k --resume continued the automatic runs/k: its options.json keeps "", so --resume still finds it
      local o = flags_of { run = "k", resume = true }
      rundir.open("runs/k", o, { run = true, resume = true }, SPEC)
      assert.equal("", o.run)
    end)
  end)

  it("of the numbered folders of a run that the flags given change, takes the newest too", function()
    in_folder(function()
      run_folder("d-steps=5", { steps = 5 }, 5, "2026-01-01 00:00:07")
      run_folder("d-steps=5-2", { steps = 5 }, 5, "2026-01-01 00:00:02")
      run_folder("d-steps=5-3", { steps = 5 }, 5, "2026-01-01 00:00:03")
      local dir, why = path("d", { resume = true, steps = 9 })
      assert.equal("runs/d-steps=5", dir)
      assert.matches("is newer than those of runs/d%-steps=5%-2, runs/d%-steps=5%-3$", why)
    end)
  end)

  it("counts <name>-N as a number of <name> for N >= 2 only, and <base>-* as runs of base, not <base>* alone", function()
    in_folder(function()
      -- runs/m-1 is no numbered folder of m (the numbering writes m, m-2, m-3, ...): newer, it is not taken
      run_folder("m", {}, 3, "2026-01-01 00:00:01")
      run_folder("m-1", {}, 3, "2026-01-01 00:00:09")
      assert.same({ "runs/m" }, { path("m", { resume = true }) })
      -- runs/pq, an automatic run of base pq, is no run of base p that --steps 9 could change
      run_folder("pq", {}, 3, "2026-01-01 00:00:01")
      assert.same({ "runs/p-steps=9" }, { path("p", { resume = true, steps = 9 }) })
    end)
  end)

  it("gives a flag newer than the run (not in its options.json) its default", function()
    in_folder(function()
      run_folder("n", '{"run": "n", "steps": 4, "lr": 2}', 2, "2026-01-01 00:00:01")
      local o = flags_of { resume = true, run = "n", dtype = "bf16", data = "x.txt" }
      rundir.open("runs/n", o, { resume = true, run = true }, SPEC)
      assert.same({ 4, 2, "f32", "" }, { o.steps, o.lr, o.dtype, o.data })
    end)
  end)

  it("takes a --run of a single folder name only: no \"/\", not \".\", \"..\" or blank", function()
    for _, run in ipairs { "..", " .. ", ".", "a/b", "  " } do
      assert.equal("--run " .. string.format("%q", run) .. ': a run name is a single folder name under runs/ (no "/", '
        .. 'not "." or "..", not blank)', helper.error_of(path, "x", { run = run }))
    end
    assert.equal("runs/..a", path("x", { run = "..a" }))
  end)

  it("refuses a run folder with checkpoints whose options.json cannot be used, naming it, before writing", function()
    in_folder(function()
      local cases = {
        { '{"steps": 4, "lr": 2,}', "runs/e1/options.json: " },
        { '[1, 2]', "runs/e2/options.json: holds none of the run's flags (expected a JSON object of them)" },
        { "{}", "runs/e3/options.json: holds none of the run's flags (expected a JSON object of them)" },
        { '{"steps": "4", "lr": 2}', 'runs/e4/options.json: steps = "4": expected a number, as --steps takes' },
        -- a value of the right type that the flag does not take, as m3.flags says it of the command line
        { '{"steps": 2.5, "lr": 2}', 'runs/e5/options.json: steps = 2.5: --steps expects an integer >= 1, got "2.5"' },
        { '{"steps": 0, "lr": 2}', 'runs/e6/options.json: steps = 0: --steps expects an integer >= 1, got "0"' },
        { '{"steps": 4, "dtype": "nope"}',
          'runs/e7/options.json: dtype = "nope": --dtype expects one of f32 | bf16, got "nope"' },
      }
      for i, case in ipairs(cases) do
        local name = "e" .. i
        run_folder(name, case[1], 2, "2026-01-01 00:00:01")
        local err = helper.error_of(rundir.open, "runs/" .. name, flags_of { resume = true, run = name },
          { resume = true, run = true }, SPEC)
        assert.matches("--resume: runs/" .. name .. " holds checkpoints, but its options.json cannot be used ("
          .. case[2], err, 1, true)
        assert.matches("); --resume takes the run's flags from it: restore the file, or start afresh (--overwrite)",
          err, 1, true)
        assert.equal(case[1], fs.read("runs/" .. name .. "/options.json"))
      end
      run_folder("e0", {}, 2, "2026-01-01 00:00:01")
      os.remove("runs/e0/options.json")
      local err = helper.error_of(rundir.open, "runs/e0", flags_of { resume = true, run = "e0" },
        { resume = true, run = true }, SPEC)
      assert.matches("--resume: runs/e0 holds checkpoints, but its options.json cannot be used (runs/e0/options.json: "
        .. "No such file or directory); --resume takes", err, 1, true)
      assert.is_false(fs.exists("runs/e0/options.json"))
      -- where the flags given could change it, a bad file is refused too: which run it is cannot be told
      run_folder("f", "{", 2, "2026-01-01 00:00:01")
      assert.matches("--resume: runs/f holds checkpoints, but its options.json cannot be used",
        helper.error_of(path, "f", { resume = true, steps = 8 }), 1, true)
    end)
  end)
end)

describe("m3.rundir options.json", function()
  it("keeps a flag's text that is not UTF-8 (a file name, a byte prompt) as its bytes in hex, and reads it back", function()
    in_folder(function()
      fs.mkdir("runs/u/checkpoints")
      rundir.create("runs/u", flags_of { data = "caf\233.txt", run = "u", steps = 5 })
      local text = fs.read("runs/u/options.json")
      assert.matches('"data":{"bytes_hex":"636166e92e747874"}', text, 1, true)
      assert.same({ bytes_hex = "636166e92e747874" }, json.decode(text).data) -- UTF-8: any JSON reader takes it
      fs.write("runs/u/checkpoints/step-00000002.ckpt", "checkpoint")
      local o = flags_of { resume = true, run = "u" }
      rundir.open("runs/u", o, { resume = true, run = true }, SPEC)
      assert.equal("caf\233.txt", o.data)
      assert.equal(5, o.steps)
      -- a UTF-8 text is saved as it is, and an object that is no such record stays an error of type
      rundir.create("runs/u", flags_of { data = "café.txt", run = "u" })
      assert.equal("café.txt", json.decode(fs.read("runs/u/options.json")).data)
      run_folder("v", '{"steps": 4, "lr": 2, "data": {"bytes_hex": "6x"}}', 2, "2026-01-01 00:00:01")
      -- nor is a record of an odd number of hex digits, which names no bytes
      run_folder("v2", '{"steps": 4, "lr": 2, "data": {"bytes_hex": "636"}}', 2, "2026-01-01 00:00:01")
      assert.matches('runs/v2/options.json: data = {"bytes_hex":"636"}: expected a string',
        helper.error_of(rundir.open, "runs/v2", flags_of { resume = true, run = "v2" }, { resume = true, run = true },
          SPEC), 1, true)
      assert.matches('runs/v/options.json: data = {"bytes_hex":"6x"}: expected a string',
        helper.error_of(rundir.open, "runs/v", flags_of { resume = true, run = "v" }, { resume = true, run = true },
          SPEC), 1, true)
    end)
  end)
end)

describe("m3.rundir claims", function()
  it("skips a folder a live process claimed when numbering, refuses to open it, and holds none after it died",
    function()
      in_folder(function(dir)
        -- another process claims runs/g (the first free folder of g), then waits until killed (60 s at most)
        local child = dir .. "/child.lua"
        fs.write(child, "local rundir = require 'm3.rundir'\n"
          .. "local o = { run = '', resume = false, overwrite = false }\n"
          .. "print(rundir.path(o, {}, { { 'run', '' }, { 'resume', false }, { 'overwrite', false } }, 'g', "
          .. "{ run = true, resume = true, overwrite = true }))\n"
          .. "io.stdout:flush()\nos.execute('sleep 60')\n")
        local started = io.popen("cd " .. dir .. " && { " .. helper.quote(M3LUA)
          .. " child.lua >claimed 2>&1 & echo $!; }")
        local pid = started:read("*l")
        started:close()
        finally(function() os.execute("kill -9 " .. pid .. " 2>/dev/null") end)
        for _ = 1, 200 do
          if (fs.read("claimed") or "") ~= "" then break end
          os.execute("sleep 0.05")
        end
        assert.equal("runs/g\n", fs.read("claimed"))
        assert.equal(pid, fs.read("runs/g/lock"))
        -- the same command again: runs/g holds no checkpoints yet, but it is taken
        assert.equal("runs/g-2", path("g"))
        for _, flag in ipairs { "run", "resume", "overwrite" } do
          local o = flags_of { run = "g", [flag] = flag ~= "run" or nil }
          assert.equal("runs/g is in use: process " .. pid .. " has claimed it for a run that writes there (started "
            .. "the same command twice?); wait until it ends, or choose another --run",
            helper.error_of(rundir.open, "runs/g", o, { run = true, [flag] = true }, SPEC))
        end
        -- killed, it leaves no claim: the folder is free again
        os.execute("kill -9 " .. pid .. " 2>/dev/null; sleep 0.2")
        rundir.open("runs/g", flags_of { run = "g" }, { run = true }, SPEC)
        assert.equal(tostring(ffi.C.getpid()), fs.read("runs/g/lock"))
      end)
    end)

  it("gives up the claim of a setup that fails, with the folders it made, so that nothing is left", function()
    in_folder(function()
      local dir = path("h")
      assert.equal("runs/h", dir)
      assert.is_true(fs.is_file("runs/h/lock"))
      local err = helper.error_of(rundir.setup, dir, function() error("the setup failed", 0) end)
      assert.equal("the setup failed", err)
      assert.is_false(fs.exists("runs"))
      -- a folder that was there (an earlier run's) stays, without the lock file
      run_folder("i", {}, 2, "2026-01-01 00:00:01")
      helper.error_of(rundir.setup, "runs/i", function() rundir.open("runs/i", flags_of { run = "i" }, { run = true },
        SPEC) end)
      assert.same({ "checkpoints", "options.json" }, fs.list("runs/i"))
    end)
  end)

  it("removes the folders it made when the lock file cannot be opened", function()
    in_folder(function()
      -- a folder of 4094 bytes: mkdir takes it, but its lock file's path is past PATH_MAX (4096 with the NUL)
      local dir = "runs/" .. string.rep(string.rep("x", 200) .. "/", 20) .. string.rep("y", 4094 - 5 - 20 * 201)
      assert.equal(4094, #dir)
      assert.equal("cannot claim the run folder " .. dir .. ": cannot open " .. dir .. "/lock: File name too long",
        helper.error_of(rundir.open, dir, flags_of { run = "j" }, { run = true }, SPEC))
      assert.is_false(fs.exists("runs"))
    end)
  end)
end)

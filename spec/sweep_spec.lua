-- m3.sweep: folder naming, grid and random points, results sorted by the metric (results.csv
-- quoted as RFC 4180, header and data, its numbers exact), skip-on-rerun and its check of the
-- recorded settings, metrics that cannot be kept, failed points, parallel child processes (the
-- executable's path, a killed sweep's children) and sweeps inside them.
-- Also scripts/sweep_state_tracking.lua's checks of its sweep folder, --parity_density nan and a
-- re-run with other settings (its other flags: scripts_spec).

local sweep = require "m3.sweep"
local json = require "m3.json"
local helper = require "spec.helper"

local tmpdir = helper.tmpdir

-- The lines fn(...) writes to io.stderr, then fn's results (io.stderr is put back even if fn raises).
local function with_stderr(fn, ...)
  local real, messages = io.stderr, {}
  io.stderr = { write = function(_, ...) messages[#messages + 1] = table.concat({ ... }) end }
  local results = { pcall(fn, ...) }
  io.stderr = real
  if not results[1] then error(results[2], 0) end
  return messages, unpack(results, 2, table.maxn(results))
end

local function read(path)
  local f = io.open(path)
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

local quote = helper.quote
local M3LUA = quote(helper.m3lua()) -- a word of the shell commands below

-- A sweep script in dir: body with DIR (the sweep folder, dir/out) defined and m3 on package.path.
local function write_script(dir, body)
  local script = dir .. "/sweep_script.lua"
  local f = assert(io.open(script, "w"))
  f:write(string.format("package.path = %q\nlocal DIR = %q\n", package.path, dir .. "/out"), body)
  f:close()
  return script
end

describe("m3.sweep", function()
  it("names folders after the options that differ from the defaults", function()
    local d = { lr = 1e-3, d_model = 32 }
    assert.equal("d_model=64,lr=0.003", sweep.name({ lr = 3e-3, d_model = 64 }, d))
    assert.equal("lr=0.0003", sweep.name({ lr = 3e-4, d_model = 32 }, d))
    assert.equal("defaults", sweep.name({ lr = 1e-3, d_model = 32 }, d))
    assert.equal("lr=0.001,d_model=64", sweep.name({ lr = 1e-3, d_model = 64 }, {}, { "lr", "d_model" }))
    assert.equal("task=a%2Fb,x=1e-05", sweep.name({ task = "a/b", x = 1e-5 }, {}))
  end)

  it("gives distinct points distinct folders", function()
    local names = {}
    for _, v in ipairs { "a/b", "a_b", "a b", "a,b", "a=b", "a%2Fb", 0.1, 0.1 + 1e-12, 1 / 3, 1e300, -0.5 } do
      local name = sweep.name({ x = v }, {})
      assert.is_nil(names[name], name)
      names[name] = true
      assert.is_nil(name:find("/", 1, true), name)
    end
    assert.equal("x=0.1", sweep.name({ x = 0.1 }, {}))
    assert.equal(0.1 + 1e-12, tonumber(sweep.name({ x = 0.1 + 1e-12 }, {}):match("^x=(.*)$")))

    -- a re-run reads each point's own results
    local dir = tmpdir() .. "/distinct"
    local function run(p) return { loss = (p.x == "a/b" or p.x == 0.1) and 1 or 2 } end
    for _ = 1, 2 do
      local rows = sweep { grid = { x = { "a/b", "a_b", 0.1, 0.1 + 1e-12 } }, dir = dir, run = run }
      local loss = {}
      for _, r in ipairs(rows) do loss[r.x] = r.loss end
      assert.same({ ["a/b"] = 1, a_b = 2, [0.1] = 1, [0.1 + 1e-12] = 2 }, loss)
    end
    os.execute("rm -rf " .. dir)
  end)

  it("names list values by their contents, the same in every process", function()
    assert.equal("betas=[0.9,0.99],lr=1", sweep.name({ betas = { 0.9, 0.99 }, lr = 1 }, {}))
    assert.equal("x=[[1,a%20b],[]]", sweep.name({ x = { { 1, "a b" }, {} } }, {}))
    assert.equal("lr=2", sweep.name({ betas = { 0.9, 0.99 }, lr = 2 }, { betas = { 0.9, 0.99 } }))
    local names = {}
    for _, v in ipairs { { 1, 2 }, { 12 }, { { 1 }, 2 }, { 1, { 2 } }, "[1,2]", "[12]", {}, "[]" } do
      local name = sweep.name({ x = v }, {})
      assert.is_nil(names[name], name)
      names[name] = true
    end
    local never = tmpdir() .. "/never-made"
    assert.matches("^[^:]*sweep_spec%.lua:%d+: m3%.sweep: betas%[2%] = function: .*: a function value cannot name a "
      .. "run folder; use numbers, text, booleans or lists of them$",
      select(2, pcall(function() sweep { grid = { betas = { { 1, print } } }, dir = never, run = print } end)))
    assert.matches('m3.sweep: opt = {...}: a table with the key "a" cannot name a run folder',
      helper.error_of(sweep, { random = { opt = { { a = 1 } } }, trials = 1, dir = never, run = print }))
    assert.is_nil(io.open(never))

    -- equal lists are one point; a re-run and the children of a parallel sweep find every point
    local dir = tmpdir()
    local script = write_script(dir, [[
local calls = 0
local rows = require "m3.sweep" {
  grid = { betas = { { 0.9, 0.99 }, { 0.9, 0.999 }, { 0.9, 0.99 } }, lr = { 1, 2 } }, dir = DIR, parallel = PARALLEL,
  run = function(p) calls = calls + 1; return { loss = p.lr + p.betas[2] } end,
}
print("rows", #rows, rows[1].run, calls)
]])
    local out, code = helper.run("luajit -e 'PARALLEL = 1' " .. script)
    assert.equal(0, code, out)
    assert.equal("rows\t4\tbetas=[0.9,0.99],lr=1\t4\n", out)
    assert.equal("run,betas,lr,loss", read(dir .. "/out/results.csv"):match("^[^\n]*"))
    assert.matches('\n"betas=[0.9,0.99],lr=1","[0.9,0.99]",1,1.99\n', read(dir .. "/out/results.csv"), 1, true)
    out, code = helper.run("luajit -e 'PARALLEL = 1' " .. script)
    assert.equal("rows\t4\tbetas=[0.9,0.99],lr=1\t0\n", out)
    os.execute("rm -rf " .. dir .. "/out")
    out, code = helper.run("luajit -e 'PARALLEL = 2' " .. script)
    assert.equal(0, code, out)
    assert.equal(4, select(2, out:gsub("m3.sweep: [^\n]* finished", "")), out)
    assert.equal("rows\t4\tbetas=[0.9,0.99],lr=1\t0", out:match("([^\n]*)\n$"))
    os.execute("rm -rf " .. dir)
  end)

  it("refuses points that would share a folder before running any", function()
    local dir = tmpdir() .. "/clash"
    local ran = 0
    local err = helper.error_of(sweep, { grid = { x = { 1, "1" } }, dir = dir,
      run = function() ran = ran + 1; return {} end })
    assert.equal(0, ran)
    assert.matches('m3.sweep: the points x = 1 and x = "1" would share the run folder .*/x=1', err)
    -- random points alike (they ran one of the two without a word)
    err = helper.error_of(sweep, { random = { x = { 1, "1" } }, trials = 10, dir = dir,
      run = function() ran = ran + 1; return {} end })
    assert.equal(0, ran)
    assert.matches("m3.sweep: the points x = .* and x = .* would share the run folder .*/x=1", err)
  end)

  it("refuses a run folder name longer than 255 bytes before running any point, sequential or parallel", function()
    local dir = tmpdir() .. "/long"
    local ran = 0
    local long = string.rep("y", 254) -- "a=" and 254 bytes: 256
    for _, parallel in ipairs { 1, 2 } do
      local err = helper.error_of(sweep, { grid = { a = { "x", long, string.rep("y", 253) } }, dir = dir,
        parallel = parallel, run = function() ran = ran + 1; return {} end })
      assert.equal('m3.sweep: the point a = "' .. long .. '" would have a run folder name of 256 bytes (a='
        .. string.rep("y", 38) .. "...), longer than the 255 a folder name can have; nothing ran: sweep shorter "
        .. "values (an index into a list of them, say)", err)
    end
    assert.equal(0, ran)
    assert.is_nil(io.open(dir))
    -- 255 bytes are a folder name
    local rows = sweep { grid = { a = { string.rep("y", 253) } }, dir = dir, run = function() return {} end }
    assert.equal("a=" .. string.rep("y", 253), rows[1].run)
    os.execute("rm -rf " .. dir)
  end)

  it("runs a NaN grid value listed twice once, as any value (it was refused as two points sharing a folder)",
    function()
      local dir = tmpdir() .. "/nan-grid"
      local ran = {}
      local rows = sweep { grid = { a = { 0 / 0, 1, 0 / 0 }, b = { { 0 / 0 }, { 0 / 0 } } }, dir = dir,
        run = function(p) ran[#ran + 1] = sweep.name(p); return { loss = 1, a = p.a } end }
      assert.same({ "a=1,b=[nan]", "a=nan,b=[nan]" }, (function() table.sort(ran); return ran end)())
      assert.equal(2, #rows)
      -- a re-run reads both from done.json
      assert.equal(2, #sweep { grid = { a = { 0 / 0, 1 }, b = { { 0 / 0 } } }, dir = dir,
        run = function() error("ran again") end })
      os.execute("rm -rf " .. dir)
    end)

  it("runs every grid point once, writes sorted results, and skips finished points", function()
    local dir = tmpdir() .. "/sw"
    local calls = {}
    local function run(point, run_dir)
      calls[#calls + 1] = run_dir
      assert.equal(7, point.steps) -- defaults are merged in
      return { score = point.lr * point.d_model, loss = 1 / point.d_model }
    end
    local opts = {
      grid = { lr = { 1, 2 }, d_model = { 10, 20, 30 } },
      defaults = { lr = 1, d_model = 10, steps = 7 },
      dir = dir, run = run, metric = "score",
    }
    local rows = sweep(opts)
    assert.equal(6, #calls)
    assert.equal(6, #rows)
    assert.same({ 60, 40, 30, 20, 20, 10 }, (function()
      local s = {}
      for i, r in ipairs(rows) do s[i] = r.score end
      return s
    end)())
    assert.equal("d_model=30,lr=2", rows[1].run)
    assert.equal("d_model=20,lr=2", rows[2].run)
    assert.equal("defaults", rows[6].run)
    assert.equal(dir .. "/defaults", calls[1])
    local done = json.read(dir .. "/d_model=30,lr=2/done.json")
    assert.equal(60, done.metrics.score)
    assert.equal(7, done.point.steps)
    local csv = read(dir .. "/results.csv")
    local header, first = csv:match("^([^\n]+)\n([^\n]+)")
    assert.equal("run,d_model,lr,loss,score", header)
    assert.equal('"d_model=30,lr=2",30,2,0.03333333333333333,60', first)
    assert.equal(6, #json.read(dir .. "/results.json"))
    assert.truthy(read(dir .. "/summary.svg"):find("<svg", 1, true))

    -- a re-run runs nothing and gives the same table; a new grid value runs only itself
    calls = {}
    local again = sweep(opts)
    assert.equal(0, #calls)
    assert.same(rows, again)
    opts.grid.d_model[4] = 40
    local more = sweep(opts)
    assert.equal(2, #calls)
    assert.equal(8, #more)
    assert.equal("d_model=40,lr=2", more[1].run)
    os.execute("rm -rf " .. dir)
  end)

  it("refuses finished points run with other settings before running any, and keeps their results", function()
    local dir = tmpdir() .. "/settings"
    local calls = 0
    local function run(p) calls = calls + 1; return { loss = p.lr * 10 + p.steps } end
    sweep { grid = { lr = { 1, 3 } }, defaults = { lr = 1, steps = 100 }, dir = dir, run = run }
    local csv, done = read(dir .. "/results.csv"), read(dir .. "/defaults/done.json")
    calls = 0
    -- a changed default: the folder "defaults" holds lr = 1's results, lr = 3 would be read as them
    local err = helper.error_of(sweep, { grid = { lr = { 1, 3 } }, defaults = { lr = 3, steps = 100 }, dir = dir,
      run = run })
    assert.equal("m3.sweep: " .. dir .. "/defaults holds results of other settings than this sweep's (lr: 1 -> 3); "
      .. "nothing ran: use another dir, or remove that folder to run the point again", err)
    -- a changed setting that is not swept: every finished point
    err = helper.error_of(sweep, { grid = { lr = { 1, 3 } }, defaults = { lr = 1, steps = 5, note = "a b" },
      dir = dir, run = run })
    assert.matches(dir .. "/defaults holds results of other settings than this sweep's (note: (none) -> \"a b\", "
      .. "steps: 100 -> 5); so does lr=3; nothing ran: use another dir, or remove those folders to run those points "
      .. "again", err, 1, true)
    assert.equal(0, calls)
    assert.equal(csv, read(dir .. "/results.csv"))
    assert.equal(done, read(dir .. "/defaults/done.json"))
    -- the same settings again, a NaN default (null in done.json) alike: nothing runs
    sweep { grid = { lr = { 1, 3 } }, defaults = { lr = 1, steps = 100 }, dir = dir, run = run }
    assert.equal(0, calls)
    sweep { grid = { x = { 1 } }, defaults = { y = 0 / 0 }, dir = dir .. "-nan", run = function() return {} end }
    assert.equal(1, #sweep { grid = { x = { 1 } }, defaults = { y = 0 / 0 }, dir = dir .. "-nan", run = run })
    assert.equal(0, calls)
    -- a done.json that records no settings: a setting it lacks counts as changed
    local f = assert(io.open(dir .. "/lr=3/done.json", "w"))
    f:write('{"name": "lr=3", "metrics": {"loss": 130}}')
    f:close()
    assert.matches("/lr=3 holds results of other settings than this sweep's (lr: (none) -> 3, steps: (none) -> 100)",
      helper.error_of(sweep, { grid = { lr = { 1, 3 } }, defaults = { lr = 1, steps = 100 }, dir = dir, run = run }),
      1, true)
    assert.equal(0, calls)
    -- settings done.json cannot record are refused before anything runs
    local never = tmpdir() .. "/never-made"
    assert.matches("^m3%.sweep: defaults%.f = function: .*: done%.json cannot record it %(json%.encode: cannot encode "
      .. "a function%); expected numbers, text, booleans or tables of them$",
      helper.error_of(sweep, { grid = { x = { 1 } }, defaults = { f = print }, dir = never, run = run }))
    assert.equal("m3.sweep: defaults has the key 1: expected names (text) as keys",
      helper.error_of(sweep, { grid = { x = { 1 } }, defaults = { 5 }, dir = never, run = run }))
    assert.equal("m3.sweep: defaults = 5: expected a table of settings by name",
      helper.error_of(sweep, { grid = { x = { 1 } }, defaults = 5, dir = never, run = run }))
    assert.is_nil(io.open(never))
    assert.equal(0, calls)
    os.execute("rm -rf " .. dir .. " " .. dir .. "-nan")
  end)

  it("fails a point whose metric would change a column or cannot be recorded, and runs the others", function()
    local dir = tmpdir() .. "/metrics"
    local cycle = {}
    cycle.self = cycle
    local returns = {
      { run = "X", loss = 1 }, { x = 99, loss = 2 }, { f = print, loss = 3 }, { c = cycle, loss = 4 },
      { x = 5, run = "x=5", loss = 5, hist = { 1, 2 } }, -- the column's own values: fine
      { [1] = 0.5, loss = 6 }, { ["caf\233"] = 1, loss = 7 }, -- a name that is not UTF-8
    }
    local messages, ok, err = with_stderr(pcall, sweep, { grid = { x = { 1, 2, 3, 4, 5, 6, 7 } }, dir = dir,
      run = function(p) return returns[p.x] end })
    assert.is_false(ok)
    assert.matches("m3.sweep: 6 of 7 points failed (x=1, x=2, x=3, x=4, x=6, x=7;", err, 1, true)
    local all = table.concat(messages, "\n")
    assert.matches('x=1 failed: run returned the metric run = "X", but the column run of the results holds "x=1"; '
      .. "give the metric another name", all, 1, true)
    assert.matches("x=2 failed: run returned the metric x = 99, but the column x of the results holds 2", all, 1, true)
    assert.matches("x=3 failed: run returned the metric f = function: [^\n]*, which done.json cannot record "
      .. "%(json.encode: cannot encode a function%); expected numbers, text, booleans or tables of them", all)
    assert.matches("x=4 failed: run returned the metric c = {...}, which done.json cannot record (json.encode: "
      .. "cannot encode a table that contains itself)", all, 1, true)
    assert.matches("x=6 failed: run returned a metric named 1, expected names (text)", all, 1, true)
    assert.matches('x=7 failed: run returned the metric caf\233 = 1, which done.json cannot record (json.encode: '
      .. 'cannot encode the key at ["caf\\233"]: not UTF-8', all, 1, true)
    assert.equal("run,x,loss\nx=5,5,5\n", read(dir .. "/results.csv"))
    assert.is_nil(read(dir .. "/x=2/done.json"))
    os.execute("rm -rf " .. dir)
  end)

  it("keeps a NaN metric's column on a re-run, where done.json holds null", function()
    local dir = tmpdir() .. "/nan-metric"
    local o = { grid = { lr = { 1, 2 } }, dir = dir, metric = "acc",
      run = function(p) return { acc = p.lr == 1 and 0 / 0 or 0.5, loss = p.lr } end }
    local first = sweep(o)
    local csv = read(dir .. "/results.csv")
    assert.equal("run,lr,acc,loss\nlr=2,2,0.5,2\nlr=1,1,nan,1\n", csv)
    local again = sweep(o) -- from done.json
    assert.equal(csv, read(dir .. "/results.csv"))
    assert.equal("lr=1", again[2].run)
    assert.is_true(again[2].acc ~= again[2].acc and first[2].acc ~= first[2].acc)
    os.execute("rm -rf " .. dir)
  end)

  it("quotes header and data cells of results.csv that hold a comma, a quote or a line break", function()
    local dir = tmpdir() .. "/csv"
    sweep { grid = { name = { "a,b", 'q"x', "cr\rx" }, ["k,ey"] = { 1 } }, dir = dir, metric = "lo,ss",
      run = function() return { ["lo,ss"] = 1, ['sc"ore'] = 2, ["line\nbreak"] = 3 } end }
    assert.equal('run,"k,ey",name,"line\nbreak","lo,ss","sc""ore"\n'
      .. '"k%2Cey=1,name=a%2Cb",1,"a,b",3,1,2\n'
      .. '"k%2Cey=1,name=cr%0Dx",1,"cr\rx",3,1,2\n'
      .. '"k%2Cey=1,name=q""x",1,"q""x",3,1,2\n', read(dir .. "/results.csv"))
    os.execute("rm -rf " .. dir)
  end)

  it("writes the numbers of results.csv so that they read back exactly", function()
    local dir = tmpdir() .. "/csv-numbers"
    local lrs = { 1e-3, 1e-3 + 1e-15, 2 ^ 53 }
    sweep { grid = { lr = lrs }, dir = dir, metric = "lr_times",
      run = function(p) return { lr_times = p.lr * 3, sum = 0.1 + 0.2, big = 1e15 + 1 } end }
    local lines = {}
    for line in read(dir .. "/results.csv"):gmatch("[^\n]+") do lines[#lines + 1] = line end
    assert.equal("run,lr,big,lr_times,sum", lines[1])
    assert.equal(4, #lines)
    for i = 2, 4 do
      local lr, big, lr_times, sum = lines[i]:match("^[^,]*,([^,]*),([^,]*),([^,]*),([^,]*)$")
      local want = lrs[5 - i] -- sorted by lr_times, highest first
      assert.equal(want, tonumber(lr))
      assert.equal(want * 3, tonumber(lr_times))
      assert.equal(0.1 + 0.2, tonumber(sum))
      assert.equal(1e15 + 1, tonumber(big))
    end
    os.execute("rm -rf " .. dir)
  end)

  it("ranks missing and non-finite metrics last, the same on a re-run", function()
    local dir = tmpdir() .. "/nan"
    local y = { 2, 0 / 0, 3, math.huge, 1 }
    for _, mode in ipairs { "max", "min" } do
      local expected = mode == "max" and { "x=3", "x=1", "x=5", "x=2", "x=4" } or { "x=5", "x=1", "x=3", "x=2", "x=4" }
      for _ = 1, 2 do -- the second time from done.json, where NaN and inf are null
        local rows = sweep { grid = { x = { 1, 2, 3, 4, 5 } }, dir = dir, metric = "y", mode = mode,
          run = function(p) return { y = y[p.x] } end }
        local order = {}
        for i, r in ipairs(rows) do order[i] = r.run end
        assert.same(expected, order)
      end
    end
    os.execute("rm -rf " .. dir)
  end)

  it("ranks by the default metric of all the rows, whichever point finished first", function()
    local dir = tmpdir() .. "/default-metric"
    local csv
    for _ = 1, 2 do -- the second time from done.json
      local rows = sweep { grid = { lr = { 1, 2, 3 } }, dir = dir, run = function(p)
        if p.lr == 1 then return { acc = 0.1 } end -- the first point has no loss
        return { loss = 10 - p.lr, acc = 0.5 }
      end }
      local order = {}
      for i, r in ipairs(rows) do order[i] = r.run end
      assert.same({ "lr=3", "lr=2", "lr=1" }, order) -- by loss, lowest first; no loss last
      assert.equal(csv or read(dir .. "/results.csv"), read(dir .. "/results.csv"))
      csv = read(dir .. "/results.csv")
    end
    assert.matches("loss, lowest is best", read(dir .. "/summary.svg"), 1, true)
    os.execute("rm -rf " .. dir)
  end)

  it("raises after the runs when no run returned the metric", function()
    local dir = tmpdir() .. "/bogus"
    local ran = 0
    local ok, e = pcall(function()
      sweep { grid = { x = { 1, 2 } }, dir = dir, metric = "bogus", run = function(p)
        ran = ran + 1
        return { y = p.x, loss = 1 }
      end }
    end)
    assert.is_false(ok)
    assert.equal(2, ran)
    assert.matches("^[^:]*sweep_spec%.lua:%d+: m3%.sweep: no run returned the metric", e)
    assert.matches('"bogus" (they returned: loss, y); ' .. dir .. "/results.csv is unsorted", e, 1, true)
    assert.equal(3, select(2, read(dir .. "/results.csv"):gsub("\n", "")))
    -- without a metric asked for by name, runs that return no metrics are fine
    local rows = sweep { grid = { x = { 1, 2 } }, dir = dir .. "-none", run = function() return {} end }
    assert.equal(2, #rows)
    os.execute("rm -rf " .. dir .. " " .. dir .. "-none")
  end)

  it("keeps a failed point unfinished, the others going, and raises at the end", function()
    local dir = tmpdir() .. "/fail"
    assert(os.execute("mkdir -p " .. dir .. " && touch " .. dir .. "/x=4") == 0) -- a folder it cannot make
    local messages, ok, err = with_stderr(pcall, function()
      sweep {
        grid = { { "x", { 1, 2, 3, 4 } } }, dir = dir, metric = "y", mode = "min",
        run = function(p)
          if p.x == 2 then error("boom") end
          return { y = -p.x }
        end,
      }
    end)
    assert.is_false(ok)
    assert.matches("^[^:]*sweep_spec%.lua:%d+: m3%.sweep: 2 of 4 points failed %(x=2, x=4; ", err)
    assert.matches("the results of the others are in " .. dir .. "/results.csv", err, 1, true)
    local rows = json.read(dir .. "/results.json")
    assert.equal(2, #rows)
    assert.equal("x=3", rows[1].run)
    assert.truthy(messages[1]:find("x=2 failed: .*boom"))
    assert.truthy(messages[2]:find("x=4 failed: .*cannot create the folder"))
    assert.is_nil(read(dir .. "/x=2/done.json"))
    os.execute("rm -rf " .. dir)
  end)

  it("stops on an interrupt", function()
    local dir = tmpdir() .. "/int"
    local n = 0
    assert.has_error(function()
      sweep { grid = { x = { 1, 2 } }, dir = dir, run = function() n = n + 1; error("interrupted: Ctrl-C") end }
    end)
    assert.equal(1, n)
    os.execute("rm -rf " .. dir)
  end)

  it("draws random points deterministically from the seed", function()
    local dir = tmpdir() .. "/rand"
    local seen = {}
    local opts = {
      random = { lr = { "log", 1e-4, 1e-2 }, width = { 16, 32, 64 }, layers = { "int", 1, 3 } },
      trials = 6, seed = 3, dir = dir, metric = "lr", mode = "min",
      run = function(p)
        seen[#seen + 1] = p
        assert.is_true(p.lr >= 1e-4 and p.lr <= 1e-2)
        assert.equal(tonumber(string.format("%.3g", p.lr)), p.lr)
        assert.truthy(p.width == 16 or p.width == 32 or p.width == 64)
        assert.truthy(p.layers >= 1 and p.layers <= 3 and p.layers % 1 == 0)
        return { lr = p.lr }
      end,
    }
    local rows = sweep(opts)
    assert.equal(#seen, #rows)
    for i = 2, #rows do assert.is_true(rows[i - 1].lr <= rows[i].lr) end
    os.execute("rm -rf " .. dir)
    local first = seen
    seen = {}
    sweep(opts)
    assert.same(first, seen)
    os.execute("rm -rf " .. dir)
  end)

  it("draws random values inside their range, integers only for int", function()
    local dir = tmpdir() .. "/ranges"
    local seen = {}
    sweep { random = { n = { "int", -2, 3 }, u = { "uniform", 1.2345, 1.2346 }, l = { "log", 1.0001, 1.0002 } },
      trials = 40, dir = dir, run = function(p)
        seen[#seen + 1] = p
        return { n = p.n }
      end }
    local counts = {}
    for _, p in ipairs(seen) do
      assert.is_true(p.n >= -2 and p.n <= 3 and p.n % 1 == 0, tostring(p.n))
      assert.is_true(p.u >= 1.2345 and p.u <= 1.2346, tostring(p.u))
      assert.is_true(p.l >= 1.0001 and p.l <= 1.0002, tostring(p.l))
      counts[p.n] = true
    end
    for n = -2, 3 do assert.is_true(counts[n], "never drew " .. n) end
    os.execute("rm -rf " .. dir)
    local function bad(spec)
      return helper.error_of(sweep, { random = { n = spec }, trials = 3, dir = dir, run = print })
    end
    assert.matches('m3.sweep: random.n = {"int", lo, hi} needs integers lo <= hi in [-2^53, 2^53] (where every '
      .. 'integer is a double) and hi - lo < 2^53, got 1.5 and 3',
      bad { "int", 1.5, 3 }, 1, true)
    assert.matches('and hi - lo < 2^53, got 1 and 2.5', bad { "int", 1, 2.5 }, 1, true)
    assert.matches('and hi - lo < 2^53, got -1e+308 and 1e+308', bad { "int", -1e308, 1e308 },
      1, true)
    -- past 2^53 not every integer is a double: {"int", 2^60, 2^60 + 100} drew 2^60 every time
    assert.matches('and hi - lo < 2^53, got 1.1529215046068e+18 and 1.1529215046068e+18',
      bad { "int", 2 ^ 60, 2 ^ 60 + 100 }, 1, true)
    assert.matches('and hi - lo < 2^53, got -9.007199254741e+15 and 0', bad { "int", -2 ^ 53 - 2, 0 }, 1, true)
    assert.matches('needs finite numbers lo <= hi, got 0 and inf', bad { "uniform", 0, math.huge }, 1, true)
    assert.matches('needs finite numbers lo <= hi and lo > 0, got nan and 1', bad { "log", 0 / 0, 1 }, 1, true)
    assert.matches('m3.sweep: random.n must be a list of choices or {"log"|"uniform"|"int", lo, hi}, got 0.5',
      bad(0.5), 1, true)
    assert.is_nil(io.open(dir))
  end)

  it("draws from ranges whose width overflows", function()
    local dir = tmpdir() .. "/wide"
    local big = 1.7976931348623157e308
    local seen = {}
    local rows = sweep { random = { u = { "uniform", -big, big }, w = { "uniform", -1e308, 1e308 },
      l = { "log", 5e-324, big }, n = { "int", -2 ^ 52, 2 ^ 52 - 1 } }, trials = 3, dir = dir,
      run = function(p) seen[#seen + 1] = p; return {} end }
    assert.equal(3, #rows)
    local distinct = {}
    for _, p in ipairs(seen) do
      assert.is_true(p.u > -big and p.u < big and p.w > -1e308 and p.w < 1e308, p.u .. " " .. p.w)
      assert.is_true(p.l >= 5e-324 and p.l < big and p.n >= -2 ^ 52 and p.n < 2 ^ 52 and p.n % 1 == 0)
      distinct[p.u], distinct[p.w] = true, true
    end
    local count = 0
    for _ in pairs(distinct) do count = count + 1 end
    assert.equal(6, count)
    os.execute("rm -rf " .. dir)
  end)

  it("draws every choice of a list, reals spread over their range, and a range of one value (lo = hi)", function()
    local dir = tmpdir() .. "/spread"
    local seen = {}
    sweep { random = { c = { "a", "b", "c" }, u = { "uniform", 0, 1 }, l = { "log", 1, 10000 },
      one = { "uniform", 0.5, 0.5 }, n = { "int", 7, 7 }, g = { "log", 3, 3 } }, trials = 200, dir = dir,
      run = function(p) seen[#seen + 1] = p; return {} end }
    local choices, low_u, low_l = {}, 0, 0
    for _, p in ipairs(seen) do
      choices[p.c] = (choices[p.c] or 0) + 1
      if p.u < 0.25 then low_u = low_u + 1 end
      if p.l < 10 then low_l = low_l + 1 end -- log-uniform: a quarter of them in [1, 10), as in [1000, 10000]
      assert.same({ 0.5, 7, 3 }, { p.one, p.n, p.g })
    end
    assert.equal(200, #seen)
    for _, c in ipairs { "a", "b", "c" } do assert.is_true((choices[c] or 0) > 30, c .. ": " .. (choices[c] or 0)) end
    -- a quarter of them in the first quarter: within 5 standard deviations (6.1) of 50 of 200
    assert.is_true(math.abs(low_u - 50) < 30, "uniform: " .. low_u .. " below 0.25")
    assert.is_true(math.abs(low_l - 50) < 30, "log: " .. low_l .. " below 10")
    os.execute("rm -rf " .. dir)
    -- 2^53 + 1 integers are too many (hi - lo < 2^53)
    assert.matches('and hi - lo < 2^53, got 0 and 9.007199254741e+15',
      helper.error_of(sweep, { random = { n = { "int", 0, 2 ^ 53 } }, trials = 1, dir = dir, run = print }), 1, true)
    assert.is_nil(io.open(dir))
  end)

  it("keeps a non-finite metric as NaN in the rows on the first run too (inf: null in done.json)", function()
    local dir = tmpdir() .. "/inf"
    local o = { grid = { x = { 1, 2 } }, dir = dir, metric = "y",
      run = function(p) return { y = p.x == 1 and math.huge or 1 } end }
    for _ = 1, 2 do
      local rows = sweep(o)
      assert.same({ "x=2", "x=1" }, { rows[1].run, rows[2].run })
      assert.is_true(rows[2].y ~= rows[2].y, tostring(rows[2].y))
      assert.equal("run,x,y\nx=2,2,1\nx=1,1,nan\n", read(dir .. "/results.csv"))
    end
    os.execute("rm -rf " .. dir)
  end)

  it("runs a point again whose done.json holds no metrics, and raises for a metric no run returned of one point",
    function()
      local dir = tmpdir() .. "/no-metrics"
      assert(os.execute("mkdir -p " .. dir .. "/x=1") == 0)
      local f = assert(io.open(dir .. "/x=1/done.json", "w"))
      f:write('{"name": "x=1", "point": {"x": 1}}') -- cut short: not a finished point
      f:close()
      local ran = 0
      local rows = sweep { grid = { x = { 1 } }, dir = dir, run = function() ran = ran + 1; return { loss = 2 } end }
      assert.equal(1, ran)
      assert.equal(2, rows[1].loss)
      assert.equal(2, json.read(dir .. "/x=1/done.json").metrics.loss)
      assert.matches('m3.sweep: no run returned the metric "acc" (they returned: loss)',
        helper.error_of(sweep, { grid = { x = { 1 } }, dir = dir, metric = "acc", run = print }), 1, true)
      os.execute("rm -rf " .. dir)
    end)

  it("names every stale folder past the first: so does one, so do two", function()
    local dir = tmpdir() .. "/stale3"
    local function run() return { loss = 1 } end
    sweep { grid = { lr = { 1, 2, 3 } }, defaults = { lr = 1, steps = 1 }, dir = dir, run = run }
    assert.equal("m3.sweep: " .. dir .. "/defaults holds results of other settings than this sweep's (steps: 1 -> 2); "
      .. "so do lr=2, lr=3; nothing ran: use another dir, or remove those folders to run those points again",
      helper.error_of(sweep, { grid = { lr = { 1, 2, 3 } }, defaults = { lr = 1, steps = 2 }, dir = dir, run = run }))
    os.execute("rm -rf " .. dir)
  end)

  it("runs points as separate processes with parallel = N", function()
    local dir = tmpdir()
    local script = dir .. "/sweep_script.lua"
    local f = assert(io.open(script, "w"))
    f:write(string.format([[
package.path = %q
local sweep = require "m3.sweep"
local rows = sweep {
  grid = { a = { 1, 2, 3, 4 } }, dir = %q, parallel = 2, metric = "b", gpus = { 0, 1 },
  run = function(p, run_dir)
    local g = io.open(run_dir .. "/env", "w")
    g:write(os.getenv("M3_SWEEP_POINT"), " ", os.getenv("CUDA_VISIBLE_DEVICES"))
    g:close()
    return { b = p.a * 10 }
  end,
}
print("rows", #rows, rows[1].run, rows[1].b)
]], package.path, dir .. "/out"))
    f:close()
    local p = io.popen("M3LUA=luajit luajit " .. script .. " 2>&1")
    local out = p:read("*a")
    p:close()
    assert.equal("rows\t4\ta=4\t40", out:match("([^\n]*)\n$"))
    assert.equal(4, select(2, out:gsub("m3.sweep: a=%d started %(CUDA_VISIBLE_DEVICES=[01], log in ", "")))
    assert.equal(4, select(2, out:gsub("m3.sweep: a=%d finished", "")))
    for a = 1, 4 do
      local env = read(dir .. "/out/a=" .. a .. "/env")
      assert.truthy(env:match("^a=" .. a .. " [01]$"), env)
    end
    -- a re-run starts no process
    os.execute("rm " .. dir .. "/out/a=*/env")
    p = io.popen("M3LUA=luajit luajit " .. script .. " 2>&1")
    assert.equal("rows\t4\ta=4\t40\n", p:read("*a"))
    p:close()
    assert.is_nil(read(dir .. "/out/a=1/env"))
    os.execute("rm -rf " .. dir)
  end)

  it("starts the children with the parent's interpreter and host options", function()
    local dir = tmpdir()
    local script = write_script(dir, [[
local rows = require "m3.sweep" {
  grid = { a = { 1, 2 } }, dir = DIR, parallel = 2, metric = "b",
  run = function(p) return { b = p.a * SCALE } end,
}
print("best", rows[1].run, rows[1].b)
]])
    for _, options in ipairs { "-joff -e 'SCALE = 10'", "-e 'SCALE = 10' --" } do
      os.execute("rm -rf " .. dir .. "/out")
      local out, code = helper.run(M3LUA .. " " .. options .. " " .. script)
      assert.equal(0, code, out)
      assert.matches("best\ta=2\t20\n$", out)
    end
    os.execute("rm -rf " .. dir)
  end)

  it("starts the children with an executable whose path holds a blank: command, M3LUA or the interpreter", function()
    local dir = tmpdir()
    local script = write_script(dir, [[
local command = os.getenv("SWEEP_COMMAND")
local rows = require "m3.sweep" {
  grid = { a = { 1, 2 } }, dir = DIR, parallel = 2, metric = "a", command = command ~= "" and command or nil,
  run = function(p) return { a = p.a } end,
}
print("best", rows[1].run)
]])
    local exe = dir .. "/with blank/m3lua"
    os.execute(string.format("mkdir %s && ln -s %s %s", quote(dir .. "/with blank"),
      quote(helper.run("readlink -f " .. M3LUA):match("^(.-)\n")), quote(exe)))
    local ways = { -- environment, interpreter
      { "SWEEP_COMMAND=" .. quote(exe), M3LUA }, { "M3LUA=" .. quote(exe), M3LUA }, { "M3LUA=", quote(exe) },
    }
    for _, way in ipairs(ways) do
      os.execute("rm -rf " .. dir .. "/out")
      local out, code = helper.run(way[1] .. " " .. way[2] .. " " .. script)
      assert.equal(0, code, out)
      assert.matches("best\ta=2\n$", out)
    end
    assert.equal("m3.sweep: command = {}: expected the path of the m3lua executable",
      helper.error_of(sweep, { grid = { a = { 1 } }, dir = dir .. "/never", run = print, command = {}, parallel = 2 }))
    os.execute("rm -rf " .. dir)
  end)

  it("runs a sweep inside a child's point as a sweep of its own, and refuses a stray environment", function()
    local dir = tmpdir()
    local script = write_script(dir, [[
local sweep = require "m3.sweep"
-- a sweep of another dir before the parallel one: the children only read it (x = 2 is not retried there)
pcall(sweep, { grid = { x = { 1, 2 } }, dir = DIR .. "-before", run = function(p)
  local f = io.open(DIR .. "-tries", "a")
  f:write(p.x, "\n")
  f:close()
  if p.x == 2 then error("boom") end
  return { loss = p.x }
end })
local rows = sweep {
  grid = { outer = { 1, 2 } }, dir = DIR, parallel = 2,
  run = function(p, run_dir)
    local inner = sweep { grid = { x = { 1, 2, 3 } }, dir = run_dir .. "/inner",
      run = function(q) return { loss = q.x * p.outer } end }
    return { loss = inner[1].loss, n_inner = #inner }
  end,
}
print("rows", rows[1].run, rows[1].n_inner, rows[2].run, rows[2].n_inner)
]])
    local out, code = helper.run("luajit " .. script)
    assert.equal(0, code, out)
    assert.equal("rows\touter=1\t3\touter=2\t3", out:match("([^\n]*)\n$"))
    assert.equal("1\n2\n", read(dir .. "/out-tries"))
    os.execute("rm -rf " .. dir .. "/out*")
    local unset = "a parallel sweep sets M3_SWEEP_DIR and M3_SWEEP_POINT (and M3_SWEEP_OUTER) for the child that "
      .. "runs a point; unset them to run the sweep"
    for env, message in pairs {
      ["M3_SWEEP_POINT=foo"] = 'm3.sweep: M3_SWEEP_POINT = "foo" is set without M3_SWEEP_DIR: ' .. unset,
      ["M3_SWEEP_DIR=" .. dir .. "/out M3_SWEEP_POINT=foo"] = 'm3.sweep: M3_SWEEP_POINT = "foo" names no point of the '
        .. "sweep in " .. dir .. "/out: " .. unset,
      ["M3_SWEEP_DIR=" .. dir .. "/elsewhere M3_SWEEP_POINT=outer=1"] = 'm3.sweep: M3_SWEEP_DIR = "' .. dir
        .. '/elsewhere" and M3_SWEEP_POINT = "outer=1" name no run folder: ' .. unset,
      ["M3_SWEEP_OUTER=x"] = 'm3.sweep: M3_SWEEP_OUTER = "x" is set without M3_SWEEP_DIR and M3_SWEEP_POINT: '
        .. unset,
      ["M3_SWEEP_DIR=" .. dir .. "/out M3_SWEEP_POINT=outer=1 M3_SWEEP_OUTER='[1]'"] = 'm3.sweep: M3_SWEEP_OUTER = '
        .. '"[1]" is not a json list of {dir, point}: ' .. unset,
    } do
      out, code = helper.run(env .. " luajit " .. script)
      assert.equal(1, code, out)
      assert.matches(message, out, 1, true)
      assert.is_nil(read(dir .. "/out-tries"))
      assert.is_nil(io.open(dir .. "/out"))
    end
    os.execute("rm -rf " .. dir)
  end)

  it("runs a parallel sweep inside a parallel sweep's point", function()
    local dir = tmpdir()
    local script = write_script(dir, [[
local sweep = require "m3.sweep"
local rows = sweep {
  grid = { outer = { 1, 2 } }, dir = DIR, parallel = 2,
  run = function(p, run_dir)
    local inner = sweep { grid = { x = { 1, 2, 3 } }, dir = run_dir .. "/inner", parallel = 2,
      run = function(q)
        if q.x == 3 and p.outer == 2 and os.getenv("FAIL_ONE") then error("boom") end
        return { loss = q.x * p.outer }
      end }
    return { loss = inner[1].loss, n_inner = #inner }
  end,
}
print("rows", rows[1].run, rows[1].loss, rows[1].n_inner, rows[2].run, rows[2].loss, rows[2].n_inner)
]])
    local out, code = helper.run("FAIL_ONE=1 luajit " .. script)
    assert.equal(1, code, out)
    assert.matches("m3.sweep: outer=2 failed: exit status 1", out, 1, true)
    assert.matches("m3.sweep: x=3 failed: exit status 1; see " .. dir .. "/out/outer=2/inner/x=3/log.txt",
      read(dir .. "/out/outer=2/log.txt"), 1, true)
    assert.matches("boom", read(dir .. "/out/outer=2/inner/x=3/log.txt"), 1, true)
    out, code = helper.run("luajit " .. script)
    assert.equal(0, code, out)
    assert.equal("rows\touter=1\t1\t3\touter=2\t2\t3", out:match("([^\n]*)\n$"))
    local inner = json.read(dir .. "/out/outer=2/inner/results.json")
    assert.equal(3, #inner)
    for _, r in ipairs(inner) do assert.equal(r.x * 2, r.loss) end
    os.execute("rm -rf " .. dir)
  end)

  it("runs a parallel sweep inside a sequential sweep's point, at any depth", function()
    -- one sweep per level of P (parallel = P[i]), each inside a point of the one before; loss: the digits x1 x2 ...
    local dir = tmpdir()
    local script = write_script(dir, [[
local sweep = require "m3.sweep"
local function level(i, dir, at)
  return sweep { grid = { ["x" .. i] = { 1, 2 } }, dir = dir, parallel = P[i], metric = "loss",
    run = function(p, run_dir)
      local here = at * 10 + p["x" .. i]
      if i == #P then return { loss = here } end
      local rows = level(i + 1, run_dir .. "/in", here)
      return { loss = rows[1].loss, n = #rows }
    end }
end
local rows = level(1, DIR, 0)
print("rows", #rows, rows[1].run, rows[1].loss, rows[2].run, rows[2].loss)
]])
    -- sequential outer, parallel inner
    local out, code = helper.run("luajit -e 'P = {1, 2}' " .. script)
    assert.equal(0, code, out)
    assert.equal("rows\t2\tx1=1\t11\tx1=2\t21", out:match("([^\n]*)\n$"))
    assert.equal(2, #json.read(dir .. "/out/x1=2/in/results.json"))
    assert.is_not_nil(read(dir .. "/out/x1=2/in/x2=2/log.txt")) -- ran as a child
    assert.is_nil(read(dir .. "/out/x1=2/log.txt")) -- ran in the sweep's process
    os.execute("rm -rf " .. dir .. "/out")
    -- parallel outer, sequential middle, parallel inner
    out, code = helper.run("luajit -e 'P = {2, 1, 2}' " .. script)
    assert.equal(0, code, out)
    assert.equal("rows\t2\tx1=1\t111\tx1=2\t211", out:match("([^\n]*)\n$"))
    local inner = json.read(dir .. "/out/x1=2/in/x2=2/in/results.json")
    assert.same({ 221, 222 }, { inner[1].loss, inner[2].loss })
    assert.is_nil(read(dir .. "/out/x1=2/in/x2=2/log.txt"))
    assert.is_not_nil(read(dir .. "/out/x1=2/in/x2=2/in/x3=1/log.txt"))
    os.execute("rm -rf " .. dir)
  end)

  it("fails a child that ends without reaching its point, saying so", function()
    local dir = tmpdir()
    local script = write_script(dir, [[
if os.getenv("M3_SWEEP_POINT") and QUIT then os.exit(0) end
-- in a child, a sweep of another dir than the parent's: the child never reaches its point
require "m3.sweep" { grid = { x = { 1, 2 } }, parallel = 2, dir = os.getenv("M3_SWEEP_POINT") and DIR .. "-x" or DIR,
  run = function(p) return { loss = p.x } end }
]])
    local out, code = helper.run("luajit " .. script)
    assert.equal(1, code, out)
    assert.matches("m3.sweep: x=1 failed: exit status 1; see " .. dir .. "/out/x=1/log.txt", out, 1, true)
    assert.equal("m3.sweep: the script ended without running the point x=1 of the sweep in " .. dir .. "/out that "
      .. "this child of a parallel sweep was started for; it runs the same script as the sweep and must reach that "
      .. "sweep the same way\n", read(dir .. "/out/x=1/log.txt"))
    -- a child that does not even run a sweep
    os.execute("rm -rf " .. dir .. "/out " .. dir .. "/out-x")
    out, code = helper.run("luajit -e 'QUIT = true' " .. script)
    assert.equal(1, code, out)
    assert.matches("m3.sweep: x=2 failed: exit status 0 without finishing its point; see " .. dir
      .. "/out/x=2/log.txt", out, 1, true)
    os.execute("rm -rf " .. dir)
  end)

  it("says which signal killed a child", function()
    local dir = tmpdir()
    local script = write_script(dir, [[
local ffi = require "ffi"
ffi.cdef "int kill(int pid, int sig); int getpid(void);"
require "m3.sweep" {
  grid = { a = { 1, 2 } }, dir = DIR, parallel = 2,
  run = function(p)
    if p.a == 2 then ffi.C.kill(ffi.C.getpid(), 9) end
    return { b = p.a }
  end,
}
]])
    local out, code = helper.run("luajit " .. script)
    assert.equal(1, code)
    assert.matches("m3.sweep: a=2 failed: killed by signal 9 (Killed); see " .. dir .. "/out/a=2/log.txt", out, 1, true)
    os.execute("rm -rf " .. dir)
  end)

  it("stops its children when it is interrupted", function()
    local dir = tmpdir()
    local script = write_script(dir, [[
local ffi = require "ffi"
local lib = require "m3.lib"
pcall(ffi.cdef, "int usleep(unsigned int usec); int getpid(void);")
require "m3.sweep" {
  grid = { a = { 1, 2, 3 } }, dir = DIR, parallel = 2,
  run = function(p, run_dir) -- 10 s unless interrupted, like a training loop
    local f = io.open(run_dir .. "/pid", "w")
    f:write(ffi.C.getpid())
    f:close()
    for _ = 1, 1000 do
      if lib.C.m3_interrupted() ~= 0 then error("interrupted: the test's signal", 0) end
      ffi.C.usleep(10000)
    end
    return { b = p.a }
  end,
}
]])
    local out = dir .. "/out"
    -- SIGTERM once both children run; then: the sweep's exit status, and any child still alive
    local report = helper.run("sh -c " .. quote(string.format([[
%s %s > %s/log 2>&1 &
sweep=$!
n=0
while { [ ! -e %s/a=1/pid ] || [ ! -e %s/a=2/pid ]; } && [ $n -lt 200 ]; do sleep 0.05; n=$((n + 1)); done
kill -s TERM $sweep
wait $sweep
echo "sweep $?"
for f in %s/a=*/pid; do kill -0 $(cat $f) 2> /dev/null && echo "alive $f" && kill -s KILL $(cat $f); done
true]], M3LUA, script, dir, out, out, out)))
    assert.equal("sweep 143\n", report)
    local log = read(dir .. "/log")
    assert.matches("m3.sweep: stopping a=1 (signal 15)", log, 1, true)
    assert.matches("m3.sweep: stopping a=2 (signal 15)", log, 1, true)
    assert.matches("interrupted", read(out .. "/a=1/log.txt"), 1, true)
    assert.is_nil(read(out .. "/a=1/done.json"))
    assert.is_nil(read(out .. "/a=3/pid"))
    os.execute("rm -rf " .. dir)
  end)

  it("leaves no child running its point after the sweep is killed", function()
    if require("ffi").os ~= "Linux" then return pending("PR_SET_PDEATHSIG is Linux's") end
    local dir = tmpdir()
    local script = write_script(dir, [[
local ffi = require "ffi"
pcall(ffi.cdef, "int usleep(unsigned int usec); int getpid(void);")
require "m3.sweep" {
  grid = { a = { 1, 2 } }, dir = DIR, parallel = 2,
  run = function(p, run_dir) -- 10 s unless interrupted
    local f = io.open(run_dir .. "/pid", "w")
    f:write(ffi.C.getpid())
    f:close()
    for _ = 1, 1000 do ffi.C.usleep(10000) end
    return { b = p.a }
  end,
}
]])
    local out = dir .. "/out"
    -- SIGKILL (nothing passed on) once both children run; then any child still alive after 5 s
    local report = helper.run("sh -c " .. quote(string.format([[
%s %s > /dev/null 2>&1 &
sweep=$!
n=0
while { [ ! -e %s/a=1/pid ] || [ ! -e %s/a=2/pid ]; } && [ $n -lt 200 ]; do sleep 0.05; n=$((n + 1)); done
kill -s KILL $sweep
n=0
while { kill -0 $(cat %s/a=1/pid) || kill -0 $(cat %s/a=2/pid); } 2> /dev/null && [ $n -lt 100 ]; do
  sleep 0.05; n=$((n + 1))
done
for f in %s/a=*/pid; do kill -0 $(cat $f) 2> /dev/null && echo "alive $f" && kill -s KILL $(cat $f); done
true]], M3LUA, script, out, out, out, out, out)))
    assert.equal("", report)
    assert.is_nil(read(out .. "/a=1/done.json"))
    assert.matches("interrupted", read(out .. "/a=1/log.txt"), 1, true)
    os.execute("rm -rf " .. dir)
  end)

  it("explains bad options", function()
    assert.has_error(function() sweep { dir = "x", run = print } end, "m3.sweep: give exactly one of grid and random")
    assert.has_error(function() sweep { grid = { a = {} }, dir = "/tmp/x", run = print } end)
    assert.has_error(function() sweep { grid = { a = { 1 } }, run = print } end)
    local never = tmpdir() .. "/never-made"
    local function err(o)
      o.dir, o.run = never, print
      o.grid = o.grid or (not o.random and { a = { 1 } }) or nil
      return helper.error_of(sweep, o)
    end
    assert.equal('m3.sweep: unknown option "paralel" (did you mean "parallel"?); valid options: command, defaults, '
      .. "dir, gpus, grid, metric, mode, parallel, random, run, seed, trials", err { paralel = 2 })
    assert.equal('m3.sweep: mode = "up": expected "min" or "max"', err { mode = "up" })
    assert.equal("m3.sweep: parallel = 1.5: expected an integer >= 1", err { parallel = 1.5 })
    assert.equal("m3.sweep: metric = 3: expected the name of a metric", err { metric = 3 })
    assert.equal("m3.sweep: trials = 2.5: expected an integer >= 1", err { random = { a = { 1, 2 } }, trials = 2.5 })
    local gpu_list = 'expected a non-empty list of GPU indices or names, e.g. {0, 1} or {"GPU-<uuid>"}'
    assert.equal("m3.sweep: gpus = 7: " .. gpu_list, err { gpus = 7, parallel = 2 })
    assert.equal('m3.sweep: gpus = "0,1": ' .. gpu_list, err { gpus = "0,1", parallel = 2 })
    assert.equal("m3.sweep: gpus = {}: " .. gpu_list, err { gpus = {}, parallel = 2 })
    assert.equal("m3.sweep: gpus has the key \"x\": " .. gpu_list, err { gpus = { 0, x = 1 }, parallel = 2 })
    assert.equal("m3.sweep: gpus[1] = true: expected a GPU index (an integer from 0 to 2^31 - 1) or a device name",
      err { gpus = { true }, parallel = 2 })
    assert.equal("m3.sweep: gpus[2] = -1: expected a GPU index (an integer from 0 to 2^31 - 1) or a device name",
      err { gpus = { 0, -1 } })
    assert.equal("m3.sweep: gpus[1] = inf: expected a GPU index (an integer from 0 to 2^31 - 1) or a device name",
      err { gpus = { math.huge } })
    assert.is_nil(io.open(never))
    local ok, e = pcall(function() sweep { grid = { lr = {} }, dir = never, run = print } end)
    assert.is_false(ok)
    assert.matches('^[^:]*sweep_spec%.lua:%d+: m3%.sweep: grid%.lr is an empty list; give it at least one value$', e)
    ok, e = pcall(function() sweep { dir = never, run = print } end)
    assert.matches("^[^:]*sweep_spec%.lua:%d+: m3%.sweep: give exactly one of grid and random$", e)
    -- malformed grids: a hole in a list, a key given twice, a key that is not a name, a map for a list
    assert.matches("^m3%.sweep: grid%.lr = {1, .*}: expected a list of values, found nil at %[2%]$",
      err { grid = { lr = { 1, nil, 3 } } })
    assert.equal("m3.sweep: grid.lr = {1, ...}: expected a list of values, found nil at [2]",
      err { grid = { lr = { 1, [3] = 3 } } })
    assert.equal('m3.sweep: grid[2] names "lr" again; give each name once', err { grid = { { "lr", { 1, 2 } },
      { "lr", { 3 } } } })
    assert.equal('m3.sweep: grid is a list of {name, {values...}} but has the key "x"',
      err { grid = { { "lr", { 1 } }, x = { 2 } } })
    assert.equal("m3.sweep: grid has the key 5: expected names (text) as keys",
      err { grid = { x = { 1 }, [5] = { 2 } } })
    assert.equal('m3.sweep: grid.x = {...}: expected a list of values, found the key "a"',
      err { grid = { x = { a = 1 } } })
    assert.equal("m3.sweep: grid.x = 5: expected a list of values, found a number", err { grid = { x = 5 } })
    assert.equal("m3.sweep: random has the key 2: expected names (text) as keys",
      err { random = { x = { 1 }, [2] = { 1 } }, trials = 1 })
    assert.matches("m3.sweep: random.x must be a list of choices", err { random = { x = { 1, nil, 3 } }, trials = 1 },
      1, true)
    assert.equal('m3.sweep: random.x = {"log", 1, 10, 100}: expected {"log", lo, hi}, 3 items',
      err { random = { x = { "log", 1, 10, 100 } }, trials = 1 })
    assert.equal("m3.sweep: gpus has nil at [2]: " .. gpu_list, err { gpus = { 0, nil, 1 }, parallel = 2 })
    -- run is the results' column of folder names; done.json records every swept value, as UTF-8 json
    assert.equal('m3.sweep: grid has the key "run": expected other names, run is the results\' column of run folders',
      err { grid = { run = { 1, "a" } } })
    assert.equal('m3.sweep: random has the key "run": expected other names, run is the results\' column of run '
      .. "folders", err { random = { run = { 1, 2 } }, trials = 2 })
    assert.matches('^m3%.sweep: grid%.name = "caf\233": done%.json cannot record it %(json%.encode: cannot encode the '
      .. "string at %.name: not UTF%-8", err { grid = { name = { "ok", "caf\233" } } })
    assert.is_nil(io.open(never))
    ok, e = pcall(function() sweep { grid = { a = { 1 } }, dir = never, run = print, gpus = { true } } end)
    assert.matches("^[^:]*sweep_spec%.lua:%d+: m3%.sweep: gpus%[1%] = true: expected a GPU index", e)
  end)

  it("names a bad point, defaults, keys or key, and refuses a list that holds itself", function()
    -- each failed inside before: "bad argument #1 to 'pairs'", a concatenation, a stack overflow
    assert.has_error(function() sweep.name(nil) end, "m3.sweep.name: point = nil: expected a table of settings")
    assert.has_error(function() sweep.name({ x = 1 }, 5) end,
      "m3.sweep.name: defaults = 5: expected a table of settings or nil")
    assert.has_error(function() sweep.name({ x = 1 }, {}, "x") end,
      'm3.sweep.name: keys = "x": expected a list of the point\'s keys or nil')
    assert.has_error(function() sweep.name({ 1, x = 2 }) end,
      "m3.sweep.name: point has the key 1: expected names (text) as keys, or give keys")
    assert.equal("[1]", sweep.format_value({ 1 }, nil))
    assert.has_error(function() sweep.format_value({ 1 }, 3) end,
      "m3.sweep.format_value: key = 3: expected the option's name (a string) or nil")
    local c = { 1 }
    c[2] = c
    assert.has_error(function() sweep.format_value(c, "x") end,
      "m3.sweep: x[2] is a list it is inside of (a cycle): it cannot name a run folder")
    local shared = { 1 }
    assert.equal("[[1],[1]]", sweep.format_value({ shared, shared }, "s")) -- the same list twice is no cycle
    local dir = tmpdir() .. "/cycle"
    assert.has_error(function()
      sweep.run { grid = { x = { c } }, dir = dir, run = function() return { loss = 1 } end }
    end, "m3.sweep: x[2] is a list it is inside of (a cycle): it cannot name a run folder")
    assert.is_false(require("m3.fs").exists(dir))
  end)
end)

describe("scripts/sweep_state_tracking.lua", function()
  local script = quote(helper.repo_dir() .. "/scripts/sweep_state_tracking.lua")
  local SMALL = " --quick --tasks parity --models rope --from_length 16 --max_length 16 --eval_every 2 "
    .. "--eval_batches 1 --batch 4 --micro_batch 4 --dir "

  it("refuses --parity_density nan before any point runs", function()
    local dir = tmpdir() .. "/never"
    local out, code = helper.run(M3LUA .. " " .. script .. SMALL .. dir .. " --steps 2 --parity_density nan")
    assert.equal(2, code, out)
    assert.equal("sweep_state_tracking.lua: --parity_density must be a probability in [0, 1] or random, got nan\n", out)
    assert.is_nil(io.open(dir))
  end)

  it("refuses a re-run in the same --dir with other settings instead of showing the old scores", function()
    local dir = tmpdir() .. "/st"
    local out, code = helper.run(M3LUA .. " " .. script .. SMALL .. dir .. " --steps 2 --eval_length 16")
    assert.equal(0, code, out)
    local csv = read(dir .. "/results.csv")
    out, code = helper.run(M3LUA .. " " .. script .. SMALL .. dir .. " --steps 3 --eval_length 20")
    assert.equal(2, code, out)
    assert.matches("sweep_state_tracking.lua: m3.sweep: " .. dir .. "/task=parity,model=rope,d_model=32,lr=0.005 "
      .. "holds results of other settings than this sweep's (eval_length: 16 -> 20, steps: 2 -> 3); nothing ran: "
      .. "use another dir, or remove that folder to run the point again\n", out, 1, true)
    assert.is_nil(out:find("Scaled accuracy", 1, true))
    assert.equal(csv, read(dir .. "/results.csv"))
    out, code = helper.run(M3LUA .. " " .. script .. SMALL .. dir .. " --steps 2 --eval_length 16")
    assert.equal(0, code, out)
    assert.matches("Scaled accuracy", out, 1, true)
    os.execute("rm -rf " .. dir)
  end)

  it("stops on an empty or blank --dir before any point runs", function()
    local pwd = io.popen("cd " .. quote(helper.repo_dir()) .. " && pwd")
    local script = quote(pwd:read("*l") .. "/scripts/sweep_state_tracking.lua")
    pwd:close()
    local dir = tmpdir() -- the script runs here: a blank --dir would be a folder in it
    for _, value in ipairs { "", " ", "\t" } do
      local out, code = helper.run("sh -c " .. quote(string.format("cd %s && %s %s --dir \"%s\" --quick "
        .. "--tasks parity --models rope --steps 2 --from_length 16 --max_length 16 --eval_length 16 --eval_every 2 "
        .. "--eval_batches 1 --batch 4 --micro_batch 4", dir, M3LUA, script, value)))
      assert.equal(2, code, out)
      assert.equal(string.format("sweep_state_tracking.lua: --dir must name the sweep folder, got %q\n", value), out)
      assert.equal("", helper.run("ls -A " .. dir))
    end
    os.execute("rm -rf " .. dir)
  end)
end)

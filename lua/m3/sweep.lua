-- m3.sweep — grid and random search with one run folder per point.
--
--   local rows = m3.sweep{
--     grid = {lr = {1e-3, 3e-3}, d_model = {32, 64}},   -- or random = {...}, trials = n
--     defaults = {lr = 1e-3, d_model = 32, steps = 500}, -- merged under every point
--     dir = "runs/sweep",
--     run = function(point, run_dir) ... return {val_acc = 0.98, ...} end,
--     metric = "val_acc", mode = "max",                -- sort key (default: loss, else the
--                                                      -- first metric by name, of all the
--                                                      -- rows; mode: "min" for names with
--                                                      -- "loss", else "max")
--     parallel = 1,                                    -- N: N m3lua processes at once
--   }
--
-- Points: grid = the cartesian product (keys in sorted order, or in the given order when
-- grid is a list {{"lr", {...}}, {"d_model", {...}}}; keys are text other than "run", each
-- given once, and value lists have no holes: {1, nil, 3} is an error); random = `trials`
-- points drawn with m3.data.rng from `seed` (default 0), keys as for grid: a key's spec is a
-- list of choices, or {"log", lo, hi} (log-uniform), {"uniform", lo, hi} (finite lo <= hi),
-- {"int", lo, hi} (integers lo <= hi in [-2^53, 2^53], hi - lo < 2^53, each equally likely); drawn reals keep
-- 3 significant digits and stay inside [lo, hi].
-- Rows whose metric is missing or not finite (NaN, +-inf: done.json keeps them as null, the
-- rows as NaN, on a re-run too) come last, by name; a metric that no run returned is an error
-- once the runs are done.
-- Folders: dir/<name>, name = the swept options whose value differs from `defaults`,
-- "key=value" joined by "," (e.g. "d_model=64,lr=0.003"; "defaults" when none differs).
-- Names are exact, so distinct points never share a folder: numbers have the digits that
-- read back as the same number, lists are written [a,b] (betas = {0.9, 0.99} ->
-- "betas=[0.9,0.99]"; nested alike), and "%", "/", ",", "=", "\", "[", "]", blanks and
-- control characters in text are written %XX ("a/b" -> "a%2Fb"). Other values (functions,
-- tables with other keys than 1..n) and text that is not UTF-8 (done.json could not record
-- it) are an error. A point listed twice runs once (NaN is the same value as NaN); points that
-- still would share a name (1 and "1"), and a name longer than a folder's can be (255 bytes), are
-- an error before anything runs.
-- A finished point leaves <run_dir>/done.json ({name, point, metrics}; point: all its settings,
-- defaults included, so defaults must be values json can write); a re-run reads it instead of
-- running the point again. Where a done.json's point differs from the point the sweep would run
-- now (a changed default; a setting it lacks counts as changed), the sweep raises before anything
-- runs, naming the folders and the settings (old -> new): use another dir or remove them.
-- Metrics are named by text; a metric named like a column of the results (run, a swept key; the
-- defaults are no columns) must hold that column's value, and adds no column; one that does
-- not, or whose name or value json cannot write (a function, a cycle, text that is not UTF-8),
-- makes its point fail. After every point dir/results.csv and dir/results.json (rows: run, the
-- swept keys, the metrics; sorted by the metric) and dir/summary.svg (the metric per run) are
-- rewritten; results.csv is RFC 4180 (a cell, header or data, that holds a comma, a quote or
-- a line break is quoted); its numbers, like results.json's, read back exactly. A point whose
-- run raises an error is reported on stderr and left unfinished (a re-run tries it again)
-- while the others go on; once they are done, m3.sweep raises an error naming the failed
-- points. An interrupt ("interrupted" in the message) stops the sweep.
-- parallel = N > 1: each point runs as `<m3lua> <script> <args>` (the running script
-- again, found through arg) with M3_SWEEP_DIR / M3_SWEEP_POINT naming the point and
-- CUDA_VISIBLE_DEVICES = one of `gpus` (a list of GPU indices or device names; default: the
-- machine's GPUs; unset without a GPU) in turn, several points sharing one when N exceeds
-- them, output in <run_dir>/log.txt. An interrupt (SIGINT, SIGTERM, SIGHUP) or an error in the
-- sweep passes the signal (SIGTERM after an error) to the running children, each in a
-- process group of its own, and waits for them before it ends the sweep; a sweep that dies
-- without doing so (SIGKILL) leaves its children a SIGTERM too (Linux; from their m3.sweep
-- call on).
-- In that child the same m3.sweep call runs only its point and exits; a sweep inside that
-- point's run is a sweep of its own, one of another dir that the script runs before it reads
-- only its finished points; the two variables set alone or naming no point are an error. A
-- parallel sweep inside the run of any point, of a sequential or a parallel sweep at any depth,
-- gives its children M3_SWEEP_OUTER too (json, the {dir, point} pairs of the enclosing points,
-- outermost first): the script runs there through those points' runs to its point. A child whose
-- script ends without running its point says so and exits with status 1; a child that exits 0
-- without done.json fails its point alike.
-- The executable is opts.command, else $M3LUA (unless empty), else the interpreter that runs
-- the script (arg's lowest index): a path, which may hold blanks, not a shell command line; the
-- host's options before the script (-joff, -l mod, -e chunk, --) go along.

local ffi = require "ffi"
local bit = require "bit"
local fs = require "m3.fs"
local json = require "m3.json"
local exact = require("m3.number_text").exact
local rng = require "m3.data.rng"
local svg = require "m3.log.svg"
local plural = require("m3.log").plural
local lib = require "m3.lib"
local options = require "m3.options"

for _, decl in ipairs {
  "int posix_spawnp(int *pid, const char *file, const void *file_actions, const void *attrp, char *const argv[], char *const envp[]);",
  "int waitpid(int pid, int *status, int options);",
  "extern char **environ;",
  "char *strsignal(int sig);",
  "int kill(int pid, int sig);",
  "int posix_spawnattr_init(void *attr);",
  "int posix_spawnattr_destroy(void *attr);",
  "int posix_spawnattr_setflags(void *attr, short flags);",
  "int posix_spawnattr_setpgroup(void *attr, int pgroup);",
  "int prctl(int option, unsigned long arg2, unsigned long arg3, unsigned long arg4, unsigned long arg5);",
} do pcall(ffi.cdef, decl) end

lib.internal_file(debug.getinfo(1, "S").source)

local raise, show = lib.raise, options.show

local sweep = {}

-- ---- points and names ------------------------------------------------------------------

-- A key or value in a folder name: numbers exactly; lists as "[a,b]", their values named
-- alike; text and booleans with "%", "/", ",", "=", "\\", "[", "]", blanks and control
-- characters written as %XX (reversible, so distinct values never share a name). Other
-- values, and a list that holds itself (at any depth), are an error naming key (the option) and value;
-- seen: the lists being written around v.
local function format_value(v, key, seen)
  local t = type(v)
  if t == "number" then return exact(v) end -- distinct numbers never share a name
  if t == "string" or t == "boolean" then
    return (tostring(v):gsub("[%%/,=\\%[%]%s%c]", function(c) return string.format("%%%02X", c:byte()) end))
  end
  local why = t ~= "table" and "a " .. t .. " value"
  if not why then
    local problem = options.not_a_list(v)
    why = problem and "a table with " .. problem
  end
  if why then
    raise(string.format("m3.sweep: %s = %s: %s cannot name a run folder; use numbers, text, booleans or lists of them",
      key, show(v), why))
  end
  seen = seen or {}
  if seen[v] then
    raise(string.format("m3.sweep: %s is a list it is inside of (a cycle): it cannot name a run folder", key))
  end
  seen[v] = true
  local parts = {}
  for i = 1, #v do parts[i] = format_value(v[i], key .. "[" .. i .. "]", seen) end
  seen[v] = nil
  return "[" .. table.concat(parts, ",") .. "]"
end

function sweep.format_value(v, key)
  if type(key) ~= "nil" and type(key) ~= "string" then
    raise("m3.sweep.format_value: key = " .. show(key) .. ": expected the option's name (a string) or nil")
  end
  return format_value(v, key or "value")
end

-- a == b, tables compared key by key; NaN is the same value as NaN (both name a folder "nan").
local function same_value(a, b)
  if type(a) ~= "table" or type(b) ~= "table" then return a == b or (a ~= a and b ~= b) end
  for k, x in pairs(a) do
    if not same_value(x, b[k]) then return false end
  end
  for k in pairs(b) do
    if a[k] == nil then return false end
  end
  return true
end

-- The folder name of point: keys (in order) whose value differs from defaults.
function sweep.name(point, defaults, keys)
  if type(point) ~= "table" then raise("m3.sweep.name: point = " .. show(point) .. ": expected a table of settings") end
  if type(defaults) ~= "nil" and type(defaults) ~= "table" then
    raise("m3.sweep.name: defaults = " .. show(defaults) .. ": expected a table of settings or nil")
  end
  if type(keys) ~= "nil" and not options.is_list(keys) then
    raise("m3.sweep.name: keys = " .. show(keys) .. ": expected a list of the point's keys or nil")
  end
  defaults = defaults or {}
  if not keys then
    keys = {}
    for k in pairs(point) do
      if type(k) ~= "string" then
        raise("m3.sweep.name: point has the key " .. show(k) .. ": expected names (text) as keys, or give keys")
      end
      keys[#keys + 1] = k
    end
    table.sort(keys)
  end
  local parts = {}
  for _, k in ipairs(keys) do
    local v = point[k]
    local text = v ~= nil and format_value(v, tostring(k))
    if text and not same_value(v, defaults[k]) then parts[#parts + 1] = format_value(k, "a key") .. "=" .. text end
  end
  return #parts > 0 and table.concat(parts, ",") or "defaults"
end

-- v for a message, lists as {a, b}.
local function show_value(v)
  if type(v) ~= "table" then return show(v) end
  local parts = {}
  for i, x in ipairs(v) do parts[i] = show_value(x) end
  return "{" .. table.concat(parts, ", ") .. "}"
end

-- The swept values of point, "k = v, ..." (for messages).
local function describe(point, keys)
  local parts = {}
  for i, k in ipairs(keys) do parts[i] = k .. " = " .. show_value(point[k]) end
  return table.concat(parts, ", ")
end

local function same_point(a, b, keys)
  for _, k in ipairs(keys) do
    if not same_value(a[k], b[k]) then return false end
  end
  return true
end

-- The longest name of a folder (NAME_MAX of Linux and macOS file systems, in bytes).
local NAME_MAX = 255

-- The jobs of points (name, full point with the defaults, swept values, run folder); a
-- point listed twice runs once; two distinct points that would share a name, and a name
-- longer than a folder's can be, are an error.
local function jobs_of(points, keys, defaults, dir)
  local jobs, by_name = {}, {}
  for _, p in ipairs(points) do
    local name = sweep.name(p, defaults, keys)
    if #name > NAME_MAX then
      raise(string.format("m3.sweep: the point %s would have a run folder name of %d bytes (%s...), longer than the "
        .. "%d a folder name can have; nothing ran: sweep shorter values (an index into a list of them, say)",
        describe(p, keys), #name, name:sub(1, 40), NAME_MAX))
    end
    local other = by_name[name]
    if not other then
      local full = {}
      for k, v in pairs(defaults) do full[k] = v end
      for k, v in pairs(p) do full[k] = v end
      jobs[#jobs + 1] = { name = name, point = full, swept = p, run_dir = dir .. "/" .. name }
      by_name[name] = jobs[#jobs]
    elseif not same_point(other.swept, p, keys) then
      raise(string.format("m3.sweep: the points %s and %s would share the run folder %s; "
        .. "make their values distinguishable", describe(other.swept, keys), describe(p, keys), other.run_dir))
    end
  end
  return jobs
end

-- Refuses, before anything runs, a swept setting named run (the results' column of run folders)
-- and a swept value that done.json cannot record (text that is not UTF-8); what: "grid" or "random".
local function check_swept(jobs, keys, what)
  for _, k in ipairs(keys) do
    if k == "run" then
      raise(string.format('m3.sweep: %s has the key "run": expected other names, run is the results\' column of '
        .. "run folders", what))
    end
    for _, job in ipairs(jobs) do
      local v = job.swept[k]
      local ok, err = pcall(json.encode, { [k] = v })
      if not ok then
        raise(string.format("m3.sweep: %s.%s = %s: done.json cannot record it (%s)", what, k, show_value(v), err))
      end
    end
  end
end

-- The keys of t (what: its name in the error), sorted; they must be names (text).
local function sorted_keys(t, what)
  local keys = {}
  for k in pairs(t) do
    if type(k) ~= "string" then
      raise(string.format("m3.sweep: %s has the key %s: expected names (text) as keys", what, show(k)))
    end
    keys[#keys + 1] = k
  end
  table.sort(keys)
  return keys
end

-- {keys, values per key} of a grid in either form.
local function grid_axes(grid)
  local keys, values = {}, {}
  if grid[1] ~= nil then
    local problem = options.not_a_list(grid)
    if problem then raise(string.format("m3.sweep: grid is a list of {name, {values...}} but has %s", problem)) end
    for i, kv in ipairs(grid) do
      if type(kv) ~= "table" or type(kv[1]) ~= "string" or type(kv[2]) ~= "table" then
        raise(string.format("m3.sweep: grid[%d] must be {name, {values...}}", i))
      end
      if values[kv[1]] then
        raise(string.format("m3.sweep: grid[%d] names %s again; give each name once", i, show(kv[1])))
      end
      keys[i], values[kv[1]] = kv[1], kv[2]
    end
  else
    keys = sorted_keys(grid, "grid")
    for _, k in ipairs(keys) do values[k] = grid[k] end
  end
  for _, k in ipairs(keys) do
    local v = values[k]
    local problem = type(v) ~= "table" and "a " .. type(v) or options.not_a_list(v)
    if problem then
      raise(string.format("m3.sweep: grid.%s = %s: expected a list of values, found %s", k, show(v), problem))
    end
    if #v == 0 then raise(string.format("m3.sweep: grid.%s is an empty list; give it at least one value", k)) end
  end
  return keys, values
end

local function grid_points(grid)
  local keys, values = grid_axes(grid)
  local points = { {} }
  for _, k in ipairs(keys) do
    local next_points = {}
    for _, p in ipairs(points) do
      for _, v in ipairs(values[k]) do
        local q = {}
        for a, b in pairs(p) do q[a] = b end
        q[k] = v
        next_points[#next_points + 1] = q
      end
    end
    points = next_points
  end
  return points, keys
end

-- x with 3 significant digits, kept inside [lo, hi].
local function three_digits(x, lo, hi)
  return math.min(math.max(tonumber(string.format("%.3g", x)), lo), hi)
end

local function is_finite(x) return type(x) == "number" and x == x and math.abs(x) < math.huge end

local function draw(r, spec, key)
  if type(spec) ~= "table" or #spec == 0 or options.not_a_list(spec) then
    raise(string.format('m3.sweep: random.%s must be a list of choices or {"log"|"uniform"|"int", lo, hi}, got %s',
      key, show(spec)))
  end
  local kind = spec[1]
  if kind == "log" or kind == "uniform" or kind == "int" then
    if #spec ~= 3 then -- a 4th item would be dropped without a word
      raise(string.format("m3.sweep: random.%s = %s: expected {%q, lo, hi}, 3 items", key, show_value(spec), kind))
    end
    local lo, hi = spec[2], spec[3]
    local int = kind == "int"
    -- int: hi - lo + 1 <= 2^53 integers, so that the count is exact and each one can be drawn, and lo, hi
    -- within +-2^53, where every integer is a double, so that lo + (a draw) is exact
    if not (is_finite(lo) and is_finite(hi) and lo <= hi) or (kind == "log" and lo <= 0)
        or (int and (lo ~= math.floor(lo) or hi ~= math.floor(hi) or hi - lo >= 2 ^ 53 or lo < -2 ^ 53
          or hi > 2 ^ 53)) then
      raise(string.format("m3.sweep: random.%s = {%q, lo, hi} needs %s lo <= hi%s, got %s and %s", key, kind,
        int and "integers" or "finite numbers", kind == "log" and " and lo > 0"
          or int and " in [-2^53, 2^53] (where every integer is a double) and hi - lo < 2^53" or "",
        show(lo), show(hi)))
    end
    if int then return lo + r:below(hi - lo + 1) end
    -- between lo and hi without forming hi - lo, which overflows for -1e308, 1e308
    local u = r:uniform()
    if kind == "uniform" then return three_digits(lo * (1 - u) + hi * u, lo, hi) end
    return three_digits(math.exp(math.log(lo) * (1 - u) + math.log(hi) * u), lo, hi)
  end
  return spec[1 + r:below(#spec)]
end

local function random_points(space, trials, seed)
  local keys = sorted_keys(space, "random")
  local points = {} -- a point drawn twice runs once, and distinct points sharing a name are an error (jobs_of)
  for j = 0, trials - 1 do
    local r, p = rng.new(seed, j), {}
    for _, k in ipairs(keys) do p[k] = draw(r, space[k], k) end
    points[#points + 1] = p
  end
  return points, keys
end

-- ---- files -------------------------------------------------------------------------------

-- Text as one results.csv cell, header or data (RFC 4180): in quotes, its quotes doubled, when
-- it holds a comma, a quote or a line break (\n or \r).
local function csv_cell(s)
  if s:find('[,"\r\n]') then return '"' .. s:gsub('"', '""') .. '"' end
  return s
end

-- v in a results.csv column named key; numbers exactly, as the folder names write them (nan, inf, -inf).
local function csv_field(v, key)
  if v == nil or v == json.null then return "" end
  return csv_cell(type(v) == "number" and exact(v) or type(v) == "table" and format_value(v, key) or tostring(v))
end

local function write_results(dir, rows, columns, metric, mode)
  local header = {}
  for i, c in ipairs(columns) do header[i] = csv_cell(tostring(c)) end
  local lines = { table.concat(header, ",") }
  for _, r in ipairs(rows) do
    local fields = {}
    for i, c in ipairs(columns) do fields[i] = csv_field(r[c], c) end
    lines[#lines + 1] = table.concat(fields, ",")
  end
  fs.write(dir .. "/results.csv", table.concat(lines, "\n") .. "\n")
  json.write(dir .. "/results.json", json.array(rows))
  local labels, values = {}, {}
  for i, r in ipairs(rows) do labels[i], values[i] = r.run, r[metric] end
  svg.write(dir .. "/summary.svg", { svg.bars {
    title = string.format("%s (%s, %s is best)", dir:match("([^/]+)/*$") or dir, metric,
      mode == "max" and "highest" or "lowest"),
    xlabel = metric, labels = labels, values = values,
  } })
end

-- ---- running -------------------------------------------------------------------------------

local function shell_quote(s)
  return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end

local function is_interrupt(err)
  return tostring(err):find("interrupted", 1, true) ~= nil
end

-- Why metrics (what job's run returned) cannot be kept: not a table, a name that is not text,
-- another value than the column of that name holds (run, the swept keys), a value done.json
-- cannot record (a name or text that is not UTF-8 too).
local function metrics_problem(metrics, job, keys)
  if type(metrics) ~= "table" then return "run returned " .. type(metrics) .. ", expected a table of metrics" end
  local columns = { run = job.name }
  for _, k in ipairs(keys) do columns[k] = job.swept[k] end
  for k, v in pairs(metrics) do
    if type(k) ~= "string" then return "run returned a metric named " .. show(k) .. ", expected names (text)" end
    if columns[k] ~= nil and not same_value(v, columns[k]) then
      return string.format("run returned the metric %s = %s, but the column %s of the results holds %s; "
        .. "give the metric another name", k, show_value(v), k, show_value(columns[k]))
    end
    local ok, err = pcall(json.encode, { [k] = v }) -- the name too: text that is not UTF-8
    if not ok then
      return string.format("run returned the metric %s = %s, which done.json cannot record (%s); expected numbers, "
        .. "text, booleans or tables of them", k, show(v), err)
    end
  end
end

-- The points whose runs this process is in now ({dir, point}, outermost first), in-process points of
-- sequential sweeps and the enclosing points a child runs through alike: a parallel sweep passes them
-- to its children (M3_SWEEP_OUTER), so that their script reaches that sweep again.
local point_stack = {}

-- Runs job's point's run in this process, on point_stack meanwhile: xpcall's ok and the run's result.
local function run_point(o, job)
  point_stack[#point_stack + 1] = { dir = o.dir, point = job.name }
  local ok, result = xpcall(function()
    fs.mkdir(job.run_dir, "m3.sweep")
    return o.run(job.point, job.run_dir)
  end, debug.traceback)
  point_stack[#point_stack] = nil
  return ok, result
end

-- Runs job's point in this process and records it in done.json; returns metrics or nil and the error.
local function run_here(o, job, keys)
  local ok, metrics = run_point(o, job)
  if not ok then
    if is_interrupt(metrics) then error(metrics, 0) end
    return nil, metrics
  end
  local problem = metrics_problem(metrics, job, keys)
  if problem then return nil, problem end
  json.write(job.run_dir .. "/done.json", { name = job.name, point = job.point, metrics = metrics })
  return metrics
end

-- The command line that runs the script again: the executable, the host's options (arg[first + 1 .. -1],
-- e.g. -joff, -l mod, --), the script and its arguments.
local function script_command(o)
  local first = 0 -- arg[first] is the interpreter (lua.c's convention: the lowest index)
  while arg and arg[first - 1] ~= nil do first = first - 1 end
  local env = os.getenv("M3LUA")
  local exe = o.command or (env ~= "" and env) or (first < 0 and arg[first])
  if not exe or not (arg and arg[0]) then
    raise("m3.sweep: parallel runs need the m3lua executable and the script (set M3LUA or opts.command)")
  end
  local parts = { shell_quote(exe) }
  for i = first + 1, #arg do parts[#parts + 1] = shell_quote(arg[i]) end
  return table.concat(parts, " ")
end

local POSIX_SPAWN_SETPGROUP, SIGTERM, PR_SET_PDEATHSIG = 2, 15, 1

-- Starts `sh -c cmd` in a process group of its own, so that a Ctrl-C at the terminal reaches
-- only the sweep, which passes it on once (a second SIGINT would kill a child at once).
local function spawn(cmd)
  local pid = ffi.new("int[1]")
  local argv = ffi.new("char *[4]")
  local keep = { "sh", "-c", cmd }
  for i = 1, 3 do argv[i - 1] = ffi.cast("char *", keep[i]) end
  local attr = ffi.new("uint64_t[64]") -- room for glibc's posix_spawnattr_t (336 bytes)
  local rc = ffi.C.posix_spawnattr_init(attr)
  if rc == 0 then
    ffi.C.posix_spawnattr_setflags(attr, POSIX_SPAWN_SETPGROUP)
    ffi.C.posix_spawnattr_setpgroup(attr, 0)
    rc = ffi.C.posix_spawnp(pid, "sh", nil, attr, argv, ffi.C.environ)
    ffi.C.posix_spawnattr_destroy(attr)
  end
  if rc ~= 0 then error("m3.sweep: cannot start a process (posix_spawnp error " .. rc .. ")", 0) end
  return pid[0]
end

-- Stops the running children: sends them the signal that interrupted the sweep (the m3lua
-- host's pending signal, else SIGTERM; a child m3lua then ends its point as an interrupt)
-- and waits for them, so that none goes on to finish a point that a new sweep may start.
local function stop_children(running)
  local host = package.loaded["m3.host"]
  local signal = host and host.pending_signal() or SIGTERM
  local status = ffi.new("int[1]")
  for pid, r in pairs(running) do
    io.stderr:write(string.format("m3.sweep: stopping %s (signal %d)\n", r.job.name, signal))
    ffi.C.kill(pid, signal)
  end
  for pid in pairs(running) do ffi.C.waitpid(pid, status, 0) end
end

-- How a child ended, from its waitpid status: "exit status N" or "killed by signal N (name)".
local function describe_status(status)
  local signal = bit.band(status, 0x7f)
  if signal == 0 then return "exit status " .. bit.band(bit.rshift(status, 8), 0xff) end
  return string.format("killed by signal %d (%s)", signal, ffi.string(ffi.C.strsignal(signal)))
end

-- A child of a parallel sweep runs one point: M3_SWEEP_DIR / M3_SWEEP_POINT name it, and
-- M3_SWEEP_OUTER (json: {{dir, point}, ...}, outermost first) the points of enclosing sweeps,
-- sequential or parallel, whose runs lead to it (set where the parallel sweep runs inside another
-- one's point). chain: those points, the target last (false: not a child; nil: not read yet). On
-- the way to the target, point_stack holds the ones reached (sweeps inside the target's run are
-- sweeps of their own); target_started: the target's run began.
local chain, target_started = nil, false
local child_guard -- its finalizer ends a child whose script ended before its target's run began

local CHILD_ENV = "a parallel sweep sets M3_SWEEP_DIR and M3_SWEEP_POINT (and M3_SWEEP_OUTER) for the child that "
  .. "runs a point; unset them to run the sweep"

local function child_chain()
  local dir, point, outer = os.getenv("M3_SWEEP_DIR"), os.getenv("M3_SWEEP_POINT"), os.getenv("M3_SWEEP_OUTER")
  if not (dir or point or outer) then return false end
  if not (dir and point) then
    local set = dir and "M3_SWEEP_DIR" or point and "M3_SWEEP_POINT" or "M3_SWEEP_OUTER"
    raise(string.format("m3.sweep: %s = %s is set without %s: %s", set, show(dir or point or outer),
      dir and "M3_SWEEP_POINT" or point and "M3_SWEEP_DIR" or "M3_SWEEP_DIR and M3_SWEEP_POINT", CHILD_ENV))
  end
  local c = {}
  if outer then
    local ok, list = pcall(json.decode, outer)
    if not ok or type(list) ~= "table" then list = { false } end
    for _, e in ipairs(list) do
      if not (type(e) == "table" and type(e[1]) == "string" and type(e[2]) == "string" and #e == 2) then
        raise(string.format("m3.sweep: M3_SWEEP_OUTER = %s is not a json list of {dir, point}: %s", show(outer),
          CHILD_ENV))
      end
      c[#c + 1] = { dir = e[1], point = e[2] }
    end
  end
  c[#c + 1] = { dir = dir, point = point }
  return c
end

-- Where the Lua state closes (the script's end, an error) in a child that never began its target's
-- run: says so and exits with status 1 (the parent would count a silent exit 0 as a failure with an
-- empty log). The target's own end and os.exit leave the state open.
local function guard_child()
  child_guard = newproxy(true)
  getmetatable(child_guard).__gc = function()
    if target_started then return end
    local target = chain[#chain]
    io.stderr:write(string.format("m3.sweep: the script ended without running the point %s of the sweep in %s "
      .. "that this child of a parallel sweep was started for; it runs the same script as the sweep and must reach "
      .. "that sweep the same way\n", target.point, target.dir))
    os.exit(1)
  end
end

-- In a child of a parallel sweep: SIGTERM (the end of its point as an interrupt) once the sweep's
-- process dies (Linux), so that a sweep killed before it could stop its children (SIGKILL) leaves
-- no point running on its own, as a re-run would start it again.
local function end_with_sweep()
  if ffi.os == "Linux" then ffi.C.prctl(PR_SET_PDEATHSIG, SIGTERM, 0, 0, 0) end
end

-- The environment of a child that runs `job` of the sweep in `dir`: the points this process runs
-- now (point_stack) come first, so that the child's script reaches this sweep again.
local function child_env(dir, job)
  local env = string.format("M3_SWEEP_DIR=%s M3_SWEEP_POINT=%s", shell_quote(dir), shell_quote(job.name))
  if #point_stack > 0 then
    local outer = {}
    for i, e in ipairs(point_stack) do outer[i] = json.array { e.dir, e.point } end
    env = env .. " M3_SWEEP_OUTER=" .. shell_quote(json.encode(json.array(outer)))
  end
  return env
end

-- Runs the pending points as child processes, at most n at once. An interrupt (SIGINT, SIGTERM or
-- SIGHUP to m3lua: the engine's interrupt flag, or the host's "interrupted!" error) or any
-- other error stops the running children before it ends the sweep.
local function run_parallel(o, pending, n, report)
  local base = script_command(o)
  local gpus = o.gpus
  if not gpus then
    local count = require("m3").cuda_device_count()
    gpus = {}
    for i = 1, n do gpus[i] = count > 0 and (i - 1) % count or false end
  end
  local free, running = {}, {}
  for i = n, 1, -1 do
    local gpu = gpus[(i - 1) % #gpus + 1]
    free[#free + 1] = type(gpu) == "number" and string.format("%d", gpu) or gpu -- 0, never "-0"
  end
  local status = ffi.new("int[1]")
  local next_i, active = 1, 0
  local ok, err = pcall(function()
    while next_i <= #pending or active > 0 do
      while next_i <= #pending and #free > 0 do
        local job = pending[next_i]
        next_i = next_i + 1
        fs.mkdir(job.run_dir, "m3.sweep")
        local gpu = table.remove(free)
        local device = gpu and "CUDA_VISIBLE_DEVICES=" .. shell_quote(gpu) .. " " or ""
        local cmd = string.format("%s%s exec %s > %s 2>&1", device, child_env(o.dir, job), base,
          shell_quote(job.run_dir .. "/log.txt"))
        running[spawn(cmd)] = { job = job, gpu = gpu }
        io.write(string.format("m3.sweep: %s started (%slog in %s/log.txt)\n", job.name,
          gpu and "CUDA_VISIBLE_DEVICES=" .. gpu .. ", " or "", job.run_dir))
        io.flush()
        active = active + 1
      end
      local pid = ffi.C.waitpid(-1, status, 0)
      local interrupted = lib.C.m3_interrupted() ~= 0
      if pid < 0 and not interrupted then
        error("m3.sweep: waitpid failed while " .. active .. " runs were active", 0)
      end
      local r = running[pid]
      if r then
        running[pid], active = nil, active - 1
        free[#free + 1] = r.gpu
        local done = json.read(r.job.run_dir .. "/done.json")
        if done then
          io.write(string.format("m3.sweep: %s finished\n", r.job.name))
          report(r.job, done.metrics)
        else
          report(r.job, nil, string.format("%s%s; see %s/log.txt", describe_status(status[0]),
            status[0] == 0 and " without finishing its point" or "", r.job.run_dir))
        end
      end
      if interrupted then error("interrupted: m3.sweep stopped", 0) end
    end
  end)
  if not ok then
    stop_children(running)
    error(err, 0)
  end
end

local OPTS = { grid = true, random = true, trials = true, seed = true, defaults = true, dir = true, run = true,
               metric = true, mode = true, parallel = true, gpus = true, command = true }
local MODES = { min = true, max = true }

-- gpus: a non-empty list of CUDA_VISIBLE_DEVICES values, GPU indices or device names.
local function check_gpus(gpus)
  local expected = 'expected a non-empty list of GPU indices or names, e.g. {0, 1} or {"GPU-<uuid>"}'
  if type(gpus) ~= "table" or #gpus == 0 then raise(string.format("m3.sweep: gpus = %s: %s", show(gpus), expected)) end
  local problem = options.not_a_list(gpus)
  if problem then raise(string.format("m3.sweep: gpus has %s: %s", problem, expected)) end
  for i, gpu in ipairs(gpus) do
    local index = type(gpu) == "number" and gpu == math.floor(gpu) and gpu >= 0 and gpu < 2 ^ 31
    if not (index or (type(gpu) == "string" and gpu ~= "")) then
      raise(string.format("m3.sweep: gpus[%d] = %s: expected a GPU index (an integer from 0 to 2^31 - 1) or a "
        .. "device name", i, show(gpu)))
    end
  end
end

-- defaults: settings by name that done.json can record (it keeps the settings of each point).
local function check_defaults(defaults)
  if type(defaults) ~= "table" then
    raise(string.format("m3.sweep: defaults = %s: expected a table of settings by name", show(defaults)))
  end
  for _, k in ipairs(sorted_keys(defaults, "defaults")) do
    local ok, err = pcall(json.encode, defaults[k])
    if not ok then
      raise(string.format("m3.sweep: defaults.%s = %s: done.json cannot record it (%s); expected numbers, text, "
        .. "booleans or tables of them", k, show(defaults[k]), err))
    end
  end
end

-- Where point (a job's settings) differs from recorded (those in a finished point's done.json):
-- "k: old -> new, ..." as done.json writes the values, "(none)" for a missing one; nil when none.
local function changed_settings(recorded, point)
  local names = {}
  for k in pairs(recorded) do names[k] = true end
  for k in pairs(point) do names[k] = true end
  local parts = {}
  for _, k in ipairs(sorted_keys(names, "done.json's point")) do
    local old = recorded[k] == nil and "(none)" or json.encode(recorded[k])
    local new = point[k] == nil and "(none)" or json.encode(point[k])
    if old ~= new then parts[#parts + 1] = k .. ": " .. old .. " -> " .. new end
  end
  return parts[1] and table.concat(parts, ", ")
end

local function check_opts(o)
  options.check_table(o, OPTS, "m3.sweep")
  if type(o.run) ~= "function" then raise("m3.sweep: run must be a function(point, run_dir) -> metrics") end
  if type(o.dir) ~= "string" or o.dir == "" then raise("m3.sweep: dir must be a folder path") end
  if (o.grid == nil) == (o.random == nil) then raise("m3.sweep: give exactly one of grid and random") end
  if type(o.grid or o.random) ~= "table" then
    raise(string.format("m3.sweep: %s = %s: expected a table", o.grid and "grid" or "random", show(o.grid or o.random)))
  end
  if o.random and o.trials == nil then raise("m3.sweep: random search needs trials = the number of points (>= 1)") end
  if o.trials ~= nil then options.want_int(o.trials, "m3.sweep: trials", 1) end
  if o.parallel ~= nil then options.want_int(o.parallel, "m3.sweep: parallel", 1) end
  if o.mode ~= nil and not MODES[o.mode] then
    raise(string.format('m3.sweep: mode = %s: expected "min" or "max"', show(o.mode)))
  end
  if o.metric ~= nil and type(o.metric) ~= "string" then
    raise(string.format("m3.sweep: metric = %s: expected the name of a metric", show(o.metric)))
  end
  if o.command ~= nil and (type(o.command) ~= "string" or o.command == "") then
    raise(string.format("m3.sweep: command = %s: expected the path of the m3lua executable", show(o.command)))
  end
  if o.gpus ~= nil then check_gpus(o.gpus) end
  if o.defaults ~= nil then check_defaults(o.defaults) end
end

-- In a child, a sweep whose dir is the next one of the chain runs that point here: the target's
-- result to done.json and the process ends; an enclosing point's run goes on to the next sweep of
-- the chain, which ends the process in its turn. Any other sweep there only reads its finished
-- points (true: run nothing), so that until the target's run point_stack holds just the points of
-- the chain reached (depth: how many).
local function child_part(o, jobs, keys)
  if chain == nil then
    chain = child_chain()
    if chain then
      guard_child()
      end_with_sweep()
    end
  end
  local depth = #point_stack
  if not chain or depth >= #chain then return false end
  local want = chain[depth + 1]
  if want.dir == o.dir then
    local job
    for _, j in ipairs(jobs) do
      if j.name == want.point then job = j end
    end
    if not job then
      raise(string.format("m3.sweep: M3_SWEEP_POINT = %s names no point of the sweep in %s: %s", show(want.point),
        o.dir, CHILD_ENV))
    end
    if depth + 1 == #chain then
      target_started = true
      local _, err = run_here(o, job, keys)
      if err then
        io.stderr:write("m3.sweep: ", job.name, ": ", tostring(err), "\n")
        os.exit(1)
      end
      os.exit(0)
    end
    local ok, err = run_point(o, job)
    local next_sweep = chain[depth + 2]
    io.stderr:write(string.format("m3.sweep: %s: %s\n", job.name, ok
      and string.format("its run returned without running the sweep in %s (point %s) that this child was started for",
        next_sweep.dir, next_sweep.point) or tostring(err)))
    os.exit(1)
  end
  if not fs.is_dir(want.dir .. "/" .. want.point) then
    raise(string.format("m3.sweep: M3_SWEEP_DIR = %s and M3_SWEEP_POINT = %s name no run folder: %s",
      show(want.dir), show(want.point), CHILD_ENV))
  end
  return true
end

function sweep.run(o)
  check_opts(o)
  local points, keys
  if o.grid then
    points, keys = grid_points(o.grid)
  else
    points, keys = random_points(o.random, o.trials, options.check_seed(o.seed, "m3.sweep"))
  end
  local jobs = jobs_of(points, keys, o.defaults or {}, o.dir)
  check_swept(jobs, keys, o.grid and "grid" or "random")
  local in_child = child_part(o, jobs, keys)

  local rows, metric_keys, pending = {}, {}, {}
  local function add_row(job, metrics)
    local row = {}
    for k, v in pairs(metrics) do
      -- not finite: NaN, as a re-run reads it from done.json (null)
      if v == json.null or type(v) == "number" and not is_finite(v) then v = 0 / 0 end
      if type(v) == "number" or type(v) == "string" or type(v) == "boolean" then
        row[k] = v
        metric_keys[k] = true
      end
    end
    row.run = job.name -- the columns of the point, which a metric of the same name never changes
    for _, k in ipairs(keys) do row[k] = job.swept[k] end
    rows[#rows + 1] = row
  end
  local function finish_table()
    -- the default metric from every row so far, so that the end result does not depend on
    -- which point finished first (a re-run reads them all at once)
    local mkeys = sorted_keys(metric_keys, "the metrics")
    local metric = o.metric or (metric_keys.loss and "loss") or mkeys[1] or "run"
    local mode = o.mode or (metric:find("loss", 1, true) and "min" or "max")
    -- only finite values rank: the others (NaN in the rows, null in done.json) go last with the
    -- missing ones (by run name) in both modes, the same on every re-run
    table.sort(rows, function(a, b)
      local x, y = a[metric], b[metric]
      x, y = is_finite(x) and x or nil, is_finite(y) and y or nil
      if x and y and x ~= y then
        if mode == "min" then return x < y end
        return x > y
      end
      if (x == nil) ~= (y == nil) then return x ~= nil end
      return a.run < b.run
    end)
    local columns, is_column = { "run" }, { run = true }
    for _, k in ipairs(keys) do columns[#columns + 1], is_column[k] = k, true end
    for _, k in ipairs(mkeys) do
      if not is_column[k] then columns[#columns + 1] = k end -- a metric equal to a column adds none
    end
    write_results(o.dir, rows, columns, metric, mode)
  end
  local failed = {}
  local function report(job, metrics, err)
    if metrics then
      add_row(job, metrics)
      finish_table()
    else
      io.stderr:write("m3.sweep: ", job.name, " failed: ", tostring(err), "\n")
      failed[#failed + 1] = job.name
    end
  end

  -- finished points, unless done.json records other settings: nothing runs then, nothing is lost
  local stale, changed = {}, nil
  for _, job in ipairs(jobs) do
    local done = json.read(job.run_dir .. "/done.json")
    if done and type(done.metrics) == "table" then
      local differ = changed_settings(type(done.point) == "table" and done.point or {}, job.point)
      if differ then stale[#stale + 1], changed = job.name, changed or differ end
      add_row(job, done.metrics)
    else
      pending[#pending + 1] = job
    end
  end
  if #stale > 0 then
    local more = #stale > 1
    raise(string.format("m3.sweep: %s/%s holds results of other settings than this sweep's (%s)%s; nothing ran: "
      .. "use another dir, or remove %s to run %s again", o.dir, stale[1], changed,
      more and string.format("; so do%s %s", #stale > 2 and "" or "es", table.concat(stale, ", ", 2)) or "",
      more and "those folders" or "that folder", more and "those points" or "the point"))
  end
  fs.mkdir(o.dir, "m3.sweep")
  if in_child then pending = {} end
  local n = o.parallel or 1
  if n > 1 and #pending > 0 then
    run_parallel(o, pending, math.min(n, #pending), report)
  else
    for _, job in ipairs(pending) do
      report(job, run_here(o, job, keys))
    end
  end
  finish_table()
  if #failed > 0 then
    raise(string.format("m3.sweep: %d of %s failed (%s; the errors are above, a re-run tries them again); "
      .. "the results of the others are in %s/results.csv", #failed, plural(#jobs, "point"), table.concat(failed, ", "),
      o.dir))
  end
  if o.metric and #rows > 0 and not metric_keys[o.metric] then -- a metric asked for by name
    raise(string.format("m3.sweep: no run returned the metric %s (they returned: %s); %s/results.csv is unsorted",
      show(o.metric), table.concat(sorted_keys(metric_keys, "the metrics"), ", "), o.dir))
  end
  return rows
end

return setmetatable(sweep, { __call = function(_, o) return sweep.run(o) end })

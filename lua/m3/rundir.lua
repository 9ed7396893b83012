-- m3.rundir — the folder of one run of a training script (scripts/train.lua, lm.lua):
-- runs/<name> under the current folder, with the run's options in options.json, its
-- checkpoints in checkpoints/ and its claim in lock; o holds the script's flags, among them
-- --run, --resume (continue the run from its newest checkpoint) and --overwrite (start it
-- afresh).
--
--   local o, _, given = flags.parse(arg, spec, banner)
--   local dir, why = rundir.path(o, given, spec, base, skip) -- "runs/<name>"; why: see below
--   rundir.setup(dir, function()
--     rundir.open(dir, o, given, spec)                    -- before anything is built from o
--     ... build everything from o (nothing written yet) ...
--     rundir.create(dir, o)                               -- o in options.json
--   end)
--
-- A process claims the folder of its run for as long as it lives: an flock(2) on the file
-- lock in it (which says the pid of the process that holds it), taken by path when it numbers
-- a new run and by open otherwise, released by the kernel when the process ends, however it
-- ends, so a crash leaves no claim behind. A folder another live process has claimed is
-- skipped by the numbering below, and open refuses it (--run, --resume, --overwrite), so that
-- two runs never write checkpoints into one folder (where keep would prune each other's).
-- The claim makes the folder (runs/ too) when it is not there; setup runs the script's setup
-- and, when that raises, gives the claim up and removes the lock file and the folders the
-- claim made (empty ones only), so a setup that fails leaves nothing behind; a claim that
-- fails (the lock file cannot be opened or locked) removes what it made before it raises.
-- open refuses a folder that holds checkpoints (one named by --run: an automatic name
-- numbers itself past them, below) unless o.resume or o.overwrite says what to do with
-- them (and both at once); with o.overwrite, create deletes them (the run's own
-- setup has then succeeded), so a new run never deletes checkpoints it was not told to.
-- A run that resumes takes its options.json: a flag not given on the command line gets
-- the run's value (--steps too: the run goes on to its own end), a flag given changes it,
-- but one marked fixed = true in the spec (the model, the data) that differs from the
-- run's value is an error listing each of them (a path = true flag differs when it names
-- another file: fs.realpath); --run keeps the run's value, the name it was started with
-- ("" for an automatic name, which --resume without --run may choose again, below).
-- options.json leaves out resume and overwrite, which say what to do with the folder, not how
-- the run trains. A folder that holds checkpoints but whose options.json is missing, cannot be
-- read, is not JSON, or holds no object of flags or a value its flag does not take (of another
-- type than the spec's, or one m3.flags refuses on the command line: not among its choices, not
-- whole, past its min or max), is an error on --resume that names the file, the flag and what
-- is wrong, before anything is written (the run would otherwise go on with other flags and
-- record those, or fail on a value no flag lets through).
-- <name> is o.run when it is not "", else base and the flags of `spec` whose value differs
-- from their default and that are not in `skip`, named as m3.sweep names a point
-- ("parity-d_model=64,lr=0.01"; just base when there are none), numbered so that running the
-- same command again keeps the earlier run: a new run takes the first of <name>, <name>-2,
-- <name>-3, ... that holds no checkpoints and that no live process has claimed; --resume, of
-- <name> and the <name>-N (N >= 2) that hold checkpoints of a run it may choose, the one whose
-- newest checkpoint is the newest, by the modification time of the step-N.ckpt files (each
-- written once, renamed into place when saved: the numbers say nothing of age once <name> is
-- restarted with --overwrite, or a deleted <name>-2 is taken again; on a tie, the one numbered
-- highest, the later run); --overwrite <name> itself. A run --resume may choose was named
-- automatically (options.json's run is "": one named with --run is resumed by that --run)
-- and its options.json agrees with o on every flag of the name and on every flag fixed for a
-- run, also one left out of the name, such as the data file lm.lua's base is made from
-- (runs/lm-wiki-2, a run of wiki-2.txt, is no run of runs/lm-wiki, one of wiki.txt). Where
-- --resume chose among several folders, path's second result says why ("its newest
-- checkpoint, saved 2026-12-02 22:14:03, is newer than those of runs/a-2"; on a tie "is as new
-- as those of runs/a (it has the highest number)"), which the scripts print in their
-- "resuming ..." line.
-- o.run must be a single folder name: one with a "/", only
-- blanks, or "." or ".." (blanks around them aside) is an error (a path would put the run
-- outside runs/, or into runs/ itself).
-- options.json is JSON, which holds UTF-8 text only; a flag's text that is not UTF-8 (a file
-- name or a --prompt of lm.lua, whose tokens are bytes) is saved as {"bytes_hex": "<its bytes
-- in hex>"} and read back as the same bytes.
-- A flag given with --resume to change the run (in `given`, not fixed = true) also changes
-- the automatic name. Where <name> holds no run --resume may choose, it takes the run in
-- runs/<base> or runs/<base>-* that holds checkpoints, was named automatically and whose
-- options.json agrees with o on every other flag of the name and on every flag fixed for a
-- run (`--resume --steps 4000` continues runs/parity, `--resume
-- --steps 5` runs/parity-steps=3; of numbered folders the one with the newest checkpoint, as
-- above); several such runs are an error that lists them (name one with --run); none, <name>
-- (a run from scratch, or, where it holds checkpoints of a run --resume may not choose, that
-- run, which open resumes as it resumes a --run). A folder there with checkpoints but a bad
-- options.json is an error.

local bit = require "bit"
local checkpoint = require "m3.checkpoint"
local ffi = require "ffi"
local flags = require "m3.flags"
local fs = require "m3.fs"
local json = require "m3.json"
local lib = require "m3.lib"
local exact = require("m3.number_text").exact
local options = require "m3.options"
local sweep = require "m3.sweep"

lib.internal_file(debug.getinfo(1, "S").source)

-- one declaration per cdef, so that one already made elsewhere does not hide the others
for _, decl in ipairs {
  "int open(const char *path, int flags, ...);",
  "int close(int fd);",
  "int flock(int fd, int operation);",
  "int ftruncate(int fd, int64_t length);",
  "ssize_t write(int fd, const void *buf, size_t count);",
  "int getpid(void);",
  "char *strerror(int errnum);",
} do pcall(ffi.cdef, decl) end

local C = ffi.C
local O_RDWR, O_CREAT, O_CLOEXEC, LOCK_EX, LOCK_NB, EWOULDBLOCK = 2, 0x40, 0x80000, 2, 4, 11
local MODE = ffi.cast("unsigned int", 420) -- 0644 (a Lua number would reach open's variadic mode as a double)

local rundir = {}

-- The claim's file in a run folder.
local LOCK = "lock"

local function checkpoints(dir)
  return checkpoint.new { dir = dir .. "/checkpoints" }:list()
end

-- The flags that say what to do with the folder: never taken from options.json.
local ACTIONS = { resume = true, overwrite = true }

-- ---- claims ------------------------------------------------------------------------------

-- The folders this process has claimed: claims[dir] = {fd = the open lock file, made = the folders the claim made}.
local claims = {}

-- dir's claim file, opened as fd, when it is the file now at its path (not one its last holder removed: see release).
local function still_there(fd, path)
  local held, now = fs.stat("", fd), fs.stat(path)
  return held ~= nil and now ~= nil and held.ino == now.ino
end

-- Removes the folders a claim made (made: the outermost first) that are empty (os.remove removes no other folder).
local function unmake(made)
  for i = #made, 1, -1 do os.remove(made[i]) end
end

-- Claims dir for this process (see the header), making it when it is not there: true, or false and who holds it
-- ("process 1234") when another live process does.
local function claim(dir)
  if claims[dir] then return true end
  local made = {}
  for at in (dir .. "/"):gmatch("()/") do
    local folder = dir:sub(1, at - 1)
    if folder ~= "" and not fs.exists(folder) then made[#made + 1] = folder end
  end
  fs.mkdir(dir)
  local path = dir .. "/" .. LOCK
  -- an error: what this claim made (the lock file too, in a folder it made) removed again, then raised
  local function fail(what, errno)
    if made[#made] == dir then os.remove(path) end
    unmake(made)
    lib.raise(string.format("cannot claim the run folder %s: cannot %s %s: %s", dir, what, path,
      ffi.string(C.strerror(errno))))
  end
  while true do
    local fd = C.open(path, bit.bor(O_RDWR, O_CREAT, O_CLOEXEC), MODE)
    if fd < 0 then fail("open", ffi.errno()) end
    if C.flock(fd, bit.bor(LOCK_EX, LOCK_NB)) ~= 0 then
      local errno = ffi.errno()
      C.close(fd)
      if errno ~= EWOULDBLOCK then fail("lock", errno) end
      local pid = (fs.read(path) or ""):match("^%d+")
      return false, pid and "process " .. pid or "another process"
    end
    if still_there(fd, path) then
      local pid = tostring(C.getpid())
      -- unchecked: the pid only names the holder in take's message ("another process" when it is not there)
      C.ftruncate(fd, 0)
      C.write(fd, pid, #pid)
      claims[dir] = { fd = fd, made = made }
      return true
    end
    C.close(fd)
  end
end

-- Gives up this process's claim on dir (after a failed setup): removes the lock file (while it still holds it, so
-- that a process that opened it meanwhile sees it gone: still_there) and the folders the claim made, if empty.
local function release(dir)
  local c = claims[dir]
  if not c then return end
  claims[dir] = nil
  os.remove(dir .. "/" .. LOCK)
  C.close(c.fd)
  unmake(c.made)
end

-- Claims dir (claim), or raises: another live process holds it.
local function take(dir)
  local ok, holder = claim(dir)
  if not ok then
    lib.raise(string.format("%s is in use: %s has claimed it for a run that writes there (started the same "
      .. "command twice?); wait until it ends, or choose another --run", dir, holder))
  end
end

-- ---- choosing among numbered folders ----------------------------------------------------

-- Whether the time t ({seconds, nanoseconds}) is not before the time than (nil: no time yet).
local function not_before(t, than)
  return not than or t[1] > than[1] or t[1] == than[1] and t[2] >= than[2]
end

-- The modification time of dir's newest checkpoint file: {seconds, nanoseconds} (nil: none can be looked at).
local function newest_save(dir)
  local best
  for _, c in ipairs(checkpoints(dir)) do
    local st = fs.stat(c.path)
    local t = st and st.mtime
    if t and not_before(t, best) then best = t end
  end
  return best
end

-- name and N for a numbered folder name-N (N an integer >= 2, as the numbering writes it), else folder itself and 1.
local function unnumbered(folder)
  local name, n = folder:match("^(.-)%-([1-9]%d*)$")
  if name and tonumber(n) >= 2 then return name, tonumber(n) end
  return folder, 1
end

-- The number of folder as one of run name's: 1 for name itself, N for name-N (name nil: of unnumbered's name).
local function number(folder, name)
  if folder == name then return 1 end
  return (select(2, unnumbered(folder)))
end

-- Of the folders of the run name (each holding checkpoints), the one whose newest checkpoint is the newest (on a
-- tie, the one numbered highest: the later run), and, when there are several, why: "its newest checkpoint, saved
-- <date>, is newer than those of runs/a-2" ("is as new as those of runs/a (it has the highest number) and newer
-- than ..." on a tie).
local function newest(folders, name)
  local order, times = {}, {}
  for i, folder in ipairs(folders) do order[i], times[folder] = folder, newest_save(folder) end
  table.sort(order, function(a, b) return number(a, name) < number(b, name) end)
  local pick, at
  for _, folder in ipairs(order) do
    local t = times[folder]
    if t and not_before(t, at) then pick, at = folder, t end
  end
  pick = pick or order[#order]
  if #order < 2 or not at then return pick end
  local ties, older = {}, {}
  for _, folder in ipairs(order) do
    local t = times[folder]
    local list = t and t[1] == at[1] and t[2] == at[2] and ties or older
    if folder ~= pick then list[#list + 1] = folder end
  end
  local said = {}
  if #ties > 0 then said[1] = "as new as those of " .. table.concat(ties, ", ") .. " (it has the highest number)" end
  if #older > 0 then said[#said + 1] = "newer than those of " .. table.concat(older, ", ") end
  return pick, string.format("its newest checkpoint, saved %s, is %s", os.date("%Y-%m-%d %H:%M:%S", at[1]),
    table.concat(said, " and "))
end

-- options.json's value of flag value v: v, or a text that is not UTF-8 as {bytes_hex = ...} (see the header).
local function saved_value(v)
  if type(v) ~= "string" or not json.utf8_error(v) then return v end
  return { bytes_hex = (v:gsub(".", function(c) return string.format("%02x", c:byte()) end)) }
end

-- The flag value of options.json's value v (saved_value undone).
local function flag_value(v)
  if type(v) == "table" and type(v.bytes_hex) == "string" and next(v, next(v)) == nil and #v.bytes_hex % 2 == 0
    and not v.bytes_hex:find("%X") then
    return (v.bytes_hex:gsub("%x%x", function(h) return string.char(tonumber(h, 16)) end))
  end
  return v
end

-- What is wrong with v as options.json's value of flag f (nil: nothing): another type than the spec's, or what
-- m3.flags says of --<f>=<v> on the command line (a number written so that it reads back as the same number).
local function refusal(f, v)
  if type(v) ~= type(f[2]) then return string.format("expected a %s, as --%s takes", type(f[2]), f[1]) end
  local text = type(v) == "number" and exact(v) or tostring(v)
  local ok, err = pcall(flags.values, { "--" .. f[1] .. "=" .. text }, { f })
  return not ok and tostring(err) or nil
end

-- The flag values the run in dir (which holds checkpoints) saved in dir/options.json, flags newer than the run at
-- their default; an error names the file and what is wrong with it (see the header).
local function read_options(dir, spec)
  local path = dir .. "/options.json"
  local saved, why = json.read(path)
  local any = false
  for _, f in ipairs(type(saved) == "table" and spec or {}) do
    local k, v = f[1], flag_value(saved[f[1]])
    saved[k] = v
    if v ~= nil and not ACTIONS[k] then
      any = true
      local wrong = not why and refusal(f, v)
      if wrong then why = string.format("%s: %s = %s: %s", path, k, json.encode(saved_value(v)), wrong) end
    end
  end
  if saved ~= nil and not any then why = path .. ": holds none of the run's flags (expected a JSON object of them)" end
  if why then
    lib.raise(string.format("--resume: %s holds checkpoints, but its options.json cannot be used (%s); --resume "
      .. "takes the run's flags from it: restore the file, or start afresh (--overwrite)", dir, why))
  end
  for _, f in ipairs(spec) do
    if saved[f[1]] == nil then saved[f[1]] = f[2] end -- a flag newer than the run: its default
  end
  return saved
end

-- Whether flag f's saved value v and value w name the same thing: equal, or (path = true) the same file.
local function same(f, v, w)
  if v == w then return true end
  if not f.path then return false end
  local rv = fs.realpath(v)
  return rv ~= nil and rv == fs.realpath(w)
end

-- The automatic name of a run with flag values o: base and the flags of spec whose value
-- differs from their default (flags.changed), those in skip aside.
local function auto_name(o, spec, base, skip)
  local keys = {}
  for _, k in ipairs(flags.changed(o, spec)) do
    if not skip[k] then keys[#keys + 1] = k end
  end
  return "runs/" .. base .. (#keys > 0 and "-" .. sweep.name(o, {}, keys) or "")
end

-- Whether the run whose saved flag values are `saved` is one that o's flags given to change a
-- run (not fixed for a run) change: every other flag of the name, and every flag fixed for a
-- run (also one left out of the name, such as the data a base name is made from), agrees.
local function changed_by(o, given, spec, skip, saved)
  for _, f in ipairs(spec) do
    local k = f[1]
    if not (skip[k] and not f.fixed) and not ACTIONS[k] and not (given[k] and not f.fixed)
      and not same(f, saved[k], o[k]) then
      return false
    end
  end
  return true
end

-- The saved flag values of the run in folder (which holds checkpoints) when --resume may choose it for o's flags
-- given: a run named automatically (one named with --run is resumed by that --run) that they change (changed_by).
local function resumable(folder, o, given, spec, skip)
  local saved = read_options(folder, spec)
  if saved.run == "" and changed_by(o, given, spec, skip, saved) then return saved end
end

-- The folders runs/<name> and runs/<name>-N (N >= 2) of o's automatic name that hold checkpoints and that --resume
-- may choose for o itself (resumable: named automatically, agreeing with o on the flags of the name and those fixed).
local function numbered(name, o, spec, skip)
  local out = {}
  for _, entry in ipairs(fs.list("runs")) do
    local folder = "runs/" .. entry
    if (folder == name or unnumbered(folder) == name) and #checkpoints(folder) > 0
      and resumable(folder, o, {}, spec, skip) then
      out[#out + 1] = folder
    end
  end
  return out
end

-- The runs --resume may mean where o's automatic name holds no checkpoints: the folders
-- runs/<base> and runs/<base>-* that hold checkpoints and that the flags given change
-- (resumable, on their options.json), as lists of the numbered folders of one run name
-- (<name>, <name>-2, ...: their flags of the name agree; newest picks among them).
local function changed_runs(o, given, spec, base, skip)
  local runs = {}
  for _, entry in ipairs(fs.list("runs")) do
    local folder = "runs/" .. entry
    if (entry == base or entry:sub(1, #base + 1) == base .. "-") and #checkpoints(folder) > 0 then
      local saved = resumable(folder, o, given, spec, skip)
      if saved then
        local group
        for _, g in ipairs(runs) do
          if unnumbered(g[1]) == unnumbered(folder) and changed_by(g.saved, {}, spec, skip, saved) then group = g end
        end
        if not group then
          group = { saved = saved }
          runs[#runs + 1] = group
        end
        group[#group + 1] = folder
      end
    end
  end
  return runs
end

function rundir.path(o, given, spec, base, skip)
  local name = o.run:match("^%s*(.-)%s*$")
  if o.run ~= "" and (name == "" or name == "." or name == ".." or name:find("/", 1, true)) then
    lib.raise(string.format('--run %s: a run name is a single folder name under runs/ (no "/", not "." or "..", '
      .. "not blank)", options.show(o.run)))
  end
  if o.run ~= "" then return "runs/" .. o.run end
  local dir = auto_name(o, spec, base, skip)
  if o.overwrite then return dir end
  if not o.resume then
    local i, at = 1, dir
    while #checkpoints(at) > 0 or not claim(at) do
      i = i + 1
      at = dir .. "-" .. i
    end
    return at
  end
  local own = numbered(dir, o, spec, skip)
  if #own > 0 then return newest(own, dir) end
  local runs = changed_runs(o, given, spec, base, skip)
  if #runs > 1 then
    local each = {}
    for i, folders in ipairs(runs) do each[i] = (newest(folders)) end
    table.sort(each)
    lib.raise(string.format("--resume: %s holds no checkpoints, and the flags given could change any of %s: name the "
      .. "run to resume with --run", dir, table.concat(each, ", ")))
  end
  if runs[1] then return newest(runs[1]) end
  return dir
end

-- o with the saved options of the run it resumes (see the header); o.run too keeps the run's own (the name it was
-- started with: "" for an automatic one, which --resume without --run may then choose again).
local function resume_options(dir, o, given, spec)
  local saved = read_options(dir, spec)
  local differ, theirs = {}, {}
  for _, f in ipairs(spec) do
    local k, v = f[1], saved[f[1]]
    if not ACTIONS[k] and not same(f, v, o[k]) then
      if not given[k] or k == "run" then
        o[k] = v
      elseif f.fixed then
        differ[#differ + 1] = "--" .. k .. " " .. tostring(o[k])
        theirs[#theirs + 1] = "--" .. k .. " " .. tostring(v)
      end
    end
  end
  if #differ > 0 then
    local many = #differ > 1
    lib.raise(string.format("%s: %s %s from the run's own %s; a resumed run keeps the flags fixed for a run (see "
      .. "--help): leave %s out, or start a new run (another --run, or --overwrite)", dir, table.concat(differ, " "),
      many and "differ" or "differs", table.concat(theirs, " "), many and "them" or "it"))
  end
end

function rundir.open(dir, o, given, spec)
  if o.resume and o.overwrite then
    lib.raise("--resume continues the run in " .. dir .. ", --overwrite starts it afresh: give one of them")
  end
  take(dir)
  local found = checkpoints(dir)
  if #found > 0 and not o.resume and not o.overwrite then
    lib.raise(string.format("%s holds the checkpoints of an earlier run (the newest: step %d); pass --resume to "
      .. "continue it, --overwrite to start afresh (deleting them), or choose another --run", dir, found[#found].step))
  end
  if #found > 0 and o.resume then resume_options(dir, o, given, spec) end
end

-- fn(), the script's setup of the run in dir; an error in it gives up the claim on dir (see the header) and goes on.
function rundir.setup(dir, fn)
  local ok, err = pcall(fn)
  if not ok then
    release(dir)
    error(err, 0)
  end
end

function rundir.create(dir, o)
  if o.overwrite then
    for _, c in ipairs(checkpoints(dir)) do os.remove(c.path) end
  end
  local saved = {}
  for k, v in pairs(o) do
    if not ACTIONS[k] then saved[k] = saved_value(v) end
  end
  fs.mkdir(dir)
  fs.write(dir .. "/options.json", json.encode(saved) .. "\n")
end

return rundir

-- m3.rundir — the folder of one run of a training script (scripts/train.lua, lm.lua):
-- runs/<name> under the current folder, with the run's options in options.json and its
-- checkpoints in checkpoints/; o holds the script's flags, among them --run, --resume
-- (continue the run from its newest checkpoint) and --overwrite (start it afresh).
--
--   local o, _, given = flags.parse(arg, spec, banner)
--   local dir = rundir.path(o, given, spec, base, skip) -- "runs/<name>"
--   rundir.open(dir, o, given, spec)                    -- before anything is built from o
--   ... build everything from o (nothing written yet) ...
--   rundir.create(dir, o)                               -- the folder, o in options.json
--
-- open refuses a folder that holds checkpoints (one named by --run: an automatic name
-- numbers itself past them, below) unless o.resume or o.overwrite says what to do with
-- them (and both at once); with o.overwrite, create deletes them (the run's own
-- setup has then succeeded), so a new run never deletes checkpoints it was not told to.
-- A run that resumes takes its options.json: a flag not given on the command line gets
-- the run's value (--steps too: the run goes on to its own end), a flag given changes it,
-- but one marked fixed = true in the spec (the model, the data) that differs from the
-- run's value is an error listing each of them (a path = true flag differs when it names
-- another file: fs.realpath). options.json leaves out resume and overwrite, which say what
-- to do with the folder, not how the run trains.
-- <name> is o.run when it is not "", else base and the flags of `spec` whose value differs
-- from their default and that are not in `skip`, named as m3.sweep names a point
-- ("parity-d_model=64,lr=0.01"; just base when there are none), numbered so that running the
-- same command again keeps the earlier run: a new run takes the first of <name>, <name>-2,
-- <name>-3, ... that holds no checkpoints, --resume the last before it that holds some,
-- --overwrite <name> itself. o.run must be a single folder name: one with a "/", only
-- blanks, or "." or ".." (blanks around them aside) is an error (a path would put the run
-- outside runs/, or into runs/ itself).
-- A flag given with --resume to change the run (in `given`, not fixed = true) also changes
-- the automatic name. Where <name> holds no checkpoints, --resume takes the run in
-- runs/<base> or runs/<base>-* that holds checkpoints and whose options.json agrees with o on
-- every other flag of the name (`--resume --steps 4000` continues runs/parity, `--resume
-- --steps 5` runs/parity-steps=3; of numbered folders the newest); several such runs are an
-- error that lists them (name one with --run); none, <name> (a run from scratch).

local checkpoint = require "m3.checkpoint"
local flags = require "m3.flags"
local fs = require "m3.fs"
local json = require "m3.json"
local lib = require "m3.lib"
local options = require "m3.options"
local sweep = require "m3.sweep"

lib.internal_file(debug.getinfo(1, "S").source)

local rundir = {}

local function checkpoints(dir)
  return checkpoint.new { dir = dir .. "/checkpoints" }:list()
end

-- Of the folders dir, dir-2, dir-3, ... (up to the first that holds no checkpoints): the
-- last that holds some (nil: none does), and the first that holds none.
local function numbered(dir)
  local function at(i) return i == 1 and dir or dir .. "-" .. i end
  local i = 1
  while #checkpoints(at(i)) > 0 do i = i + 1 end
  return i > 1 and at(i - 1) or nil, at(i)
end

-- The flags that say what to do with the folder: never taken from options.json.
local ACTIONS = { resume = true, overwrite = true }

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
-- run (not fixed for a run) change: every other flag of the name agrees.
local function changed_by(o, given, spec, skip, saved)
  for _, f in ipairs(spec) do
    local k = f[1]
    if not skip[k] and not ACTIONS[k] and not (given[k] and not f.fixed) and not same(f, saved[k], o[k]) then
      return false
    end
  end
  return true
end

-- The runs --resume may mean where o's automatic name holds no checkpoints: the folders
-- runs/<base> and runs/<base>-* that hold checkpoints and that the flags given change
-- (changed_by, on their options.json); of numbered folders (<name>, <name>-2, ...), the newest.
local function changed_runs(o, given, spec, base, skip)
  local found, runs = {}, {}
  for _, entry in ipairs(fs.list("runs")) do
    local folder = "runs/" .. entry
    local saved = (entry == base or entry:sub(1, #base + 1) == base .. "-") and #checkpoints(folder) > 0
      and json.read(folder .. "/options.json")
    if type(saved) == "table" then
      for _, f in ipairs(spec) do
        if saved[f[1]] == nil then saved[f[1]] = f[2] end -- a flag newer than the run: its default
      end
      if changed_by(o, given, spec, skip, saved) then found[folder] = true end
    end
  end
  for folder in pairs(found) do
    local first = folder:match("^(.*)%-%d+$")
    local name = found[first] and first or folder
    if name == folder then runs[#runs + 1] = numbered(name) end
  end
  table.sort(runs)
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
  local newest, free = numbered(dir)
  if not o.resume then return free end
  if newest then return newest end
  local runs = changed_runs(o, given, spec, base, skip)
  if #runs > 1 then
    lib.raise(string.format("--resume: %s holds no checkpoints, and the flags given could change any of %s: name the "
      .. "run to resume with --run", dir, table.concat(runs, ", ")))
  end
  return runs[1] or dir
end

-- o with the saved options of the run it resumes (see the header).
local function resume_options(dir, o, given, spec)
  local saved = json.read(dir .. "/options.json")
  if type(saved) ~= "table" then return end
  local differ, theirs = {}, {}
  for _, f in ipairs(spec) do
    local k, v = f[1], saved[f[1]]
    if not ACTIONS[k] and type(v) == type(o[k]) and not same(f, v, o[k]) then
      if not given[k] then
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
  local found = checkpoints(dir)
  if #found > 0 and not o.resume and not o.overwrite then
    lib.raise(string.format("%s holds the checkpoints of an earlier run (the newest: step %d); pass --resume to "
      .. "continue it, --overwrite to start afresh (deleting them), or choose another --run", dir, found[#found].step))
  end
  if #found > 0 and o.resume then resume_options(dir, o, given, spec) end
end

function rundir.create(dir, o)
  if o.overwrite then
    for _, c in ipairs(checkpoints(dir)) do os.remove(c.path) end
  end
  local saved = {}
  for k, v in pairs(o) do
    if not ACTIONS[k] then saved[k] = v end
  end
  fs.mkdir(dir)
  fs.write(dir .. "/options.json", json.encode(saved) .. "\n")
end

return rundir

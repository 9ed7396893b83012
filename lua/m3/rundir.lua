-- m3.rundir — the folder of one run of a training script (scripts/train.lua, lm.lua):
-- runs/<name> under the current folder, with the run's options in options.json and its
-- checkpoints in checkpoints/; o holds the script's flags, among them --run, --resume
-- (continue the run from its newest checkpoint) and --overwrite (start it afresh).
--
--   local dir = rundir.path(o, changed, base, skip)   -- "runs/<name>"
--   rundir.open(dir, o)                               -- before anything is built from o
--   ... build everything from o (nothing written yet) ...
--   rundir.create(dir, o)                             -- the folder, o in options.json
--
-- open refuses a folder that holds checkpoints unless o.resume or o.overwrite says what to
-- do with them (and both at once); with o.overwrite, create deletes them (the run's own
-- setup has then succeeded), so a new run never deletes checkpoints it was not told to.
-- <name> is o.run when it is not "", else base and the flags in `changed` (flags.parse's
-- second value) that are not in `skip`, named as m3.sweep names a point
-- ("parity-d_model=64,lr=0.01"; just base when there are none). o.run must be a single
-- folder name: one with a "/", only blanks, or "." or ".." (blanks around them aside) is
-- an error (a path would put the run outside runs/, or into runs/ itself).

local checkpoint = require "m3.checkpoint"
local fs = require "m3.fs"
local json = require "m3.json"
local lib = require "m3.lib"
local options = require "m3.options"
local sweep = require "m3.sweep"

lib.internal_file(debug.getinfo(1, "S").source)

local rundir = {}

function rundir.path(o, changed, base, skip)
  local name = o.run:match("^%s*(.-)%s*$")
  if o.run ~= "" and (name == "" or name == "." or name == ".." or name:find("/", 1, true)) then
    lib.raise(string.format('--run %s: a run name is a single folder name under runs/ (no "/", not "." or "..", '
      .. "not blank)", options.show(o.run)))
  end
  local named = {}
  for _, k in ipairs(changed) do
    if not skip[k] then named[#named + 1] = k end
  end
  return "runs/" .. (o.run ~= "" and o.run or base .. (#named > 0 and "-" .. sweep.name(o, {}, named) or ""))
end

local function checkpoints(dir)
  return checkpoint.new { dir = dir .. "/checkpoints" }:list()
end

function rundir.open(dir, o)
  if o.resume and o.overwrite then
    lib.raise("--resume continues the run in " .. dir .. ", --overwrite starts it afresh: give one of them")
  end
  local found = checkpoints(dir)
  if #found > 0 and not o.resume and not o.overwrite then
    lib.raise(string.format("%s holds the checkpoints of an earlier run (the newest: step %d); pass --resume to "
      .. "continue it, --overwrite to start afresh (deleting them), or choose another --run", dir, found[#found].step))
  end
end

function rundir.create(dir, o)
  if o.overwrite then
    for _, c in ipairs(checkpoints(dir)) do os.remove(c.path) end
  end
  fs.mkdir(dir)
  fs.write(dir .. "/options.json", json.encode(o) .. "\n")
end

return rundir

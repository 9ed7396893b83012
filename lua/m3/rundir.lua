-- m3.rundir — the folder of one run of a training script (scripts/train.lua, lm.lua):
-- runs/<name> under the current folder, with the run's options in options.json.
--
--   local dir = rundir.path(o, changed, base, skip)   -- "runs/<name>"
--   ... build everything from o (nothing written yet) ...
--   rundir.create(dir, o)                             -- the folder, o in options.json
--
-- <name> is o.run when it is not "", else base and the flags in `changed` (flags.parse's
-- second value) that are not in `skip`, named as m3.sweep names a point
-- ("parity-d_model=64,lr=0.01"; just base when there are none). o.run must be a single
-- folder name: one with a "/", only blanks, or "." or ".." (blanks around them aside) is
-- an error (a path would put the run outside runs/, or into runs/ itself).

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

function rundir.create(dir, o)
  fs.mkdir(dir)
  fs.write(dir .. "/options.json", json.encode(o) .. "\n")
end

return rundir

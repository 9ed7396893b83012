-- m3.checkpoint — periodic checkpoints of a training run, the last k kept, and resume.
--
--   local ck = checkpoint.new{dir = "runs/x/checkpoints", every = 100, keep = 3}
--   ck:maybe_save(tr, step, extra)   saves when step is a multiple of `every`
--   ck:save(tr, step, extra)         dir/step-00000100.ckpt; then, with keep = k > 0,
--                                    removes all but that file and the k - 1 highest-step
--                                    others (the file just written always survives, even
--                                    when its step is lower than theirs; 0: keep all)
--   ck:list()                        {{step =, path =}, ...} oldest first ({} when dir does not
--                                    exist; an error when it is a file)
--   ck:resume(opts) / checkpoint.resume(dir, opts)
--                                    -> tr, extra, step of the newest checkpoint that loads
--                                    (a damaged one is reported on stderr and skipped);
--                                    nil when there is none. opts: m3.trainer.load's
--   ck:save_interrupted(tr, step, extra)
--                                    after an "interrupted" error (or another that stops a
--                                    run): clears the engine's
--                                    interrupt flag (the host keeps its pending signal, so
--                                    the script still exits with 128 + signo) and saves;
--                                    returns the path, or nil and why not
--
-- A checkpoint is the trainer's full state (m3 tr:save: weights, Adam moments, step, lr,
-- loss scale, RNG, recurrent state, configs, under a checksum that loading verifies; written
-- to a temporary file, fsynced and renamed, so a crash never leaves a half-written
-- step-N.ckpt) plus the Lua table {step = step, extra = extra}: the loop's step and the
-- caller's state (data cursor, schedule position, curriculum phase, RNG states). Restoring
-- all of them continues the run bit-identically on the same device and dtype. Held one level
-- down, extra may nest tables 99 deep (m3.serialize takes 100); a deeper one is refused
-- before anything is written.
--
-- A process killed while it writes leaves its temporary file behind (libm3 names it
-- step-N.ckpt.tmp.<pid>.<count>). list() never takes one for a checkpoint, and save()
-- first removes those of its folder whose writer is gone (no process has that pid, or it
-- is this one, whose own writes have ended); nothing else in the folder is touched.

local ffi = require "ffi"
local trainer = require "m3.trainer"
local lib = require "m3.lib"
local fs = require "m3.fs"
local options = require "m3.options"

pcall(ffi.cdef, "int kill(int pid, int sig);")
pcall(ffi.cdef, "int getpid(void);")

lib.internal_file(debug.getinfo(1, "S").source)

local checkpoint = {}
local K = {}
K.__index = K

-- Raises unless self is a checkpoint manager (a method called with '.' gets its first argument instead).
local ITSELF = { [K] = true }
local function check_self(self, method, args)
  options.check_self(self, ITSELF, "m3.checkpoint", "a checkpoint manager (m3.checkpoint.new)", "ck", method, args)
end

-- A finite integer >= lo (math.huge and NaN are not).
local function is_count(v, lo)
  return type(v) == "number" and v >= lo and v < math.huge and v == math.floor(v)
end

local OPTS = { dir = true, every = true, keep = true }

function checkpoint.new(o)
  if type(o) == "table" then options.check_keys(o, OPTS, "m3.checkpoint.new") end
  if type(o) ~= "table" or type(o.dir) ~= "string" or o.dir == "" then
    lib.raise("m3.checkpoint.new: expected {dir = <folder>, every = <steps>, keep = <count>}")
  end
  local every, keep = o.every or 0, o.keep or 3
  if not is_count(every, 0) then
    lib.raise("m3.checkpoint.new: every must be an integer >= 0 (0: only explicit saves), got "
      .. options.show(o.every))
  end
  if not is_count(keep, 0) then
    lib.raise("m3.checkpoint.new: keep must be an integer >= 0 (0: keep all), got " .. options.show(o.keep))
  end
  return setmetatable({ dir = o.dir, every = every, keep = keep }, K)
end

-- Steps below 10^15 print exactly with %d and tostring, so a file's name gives back its step.
local MAX_STEP = 1e15

-- step, once it is one whose file name gives it back (method: the caller, for the message).
local function want_step(step, method)
  if not is_count(step, 0) or step >= MAX_STEP then
    lib.raise("m3.checkpoint: " .. method .. " expects a step (an integer in [0, 10^15)), got " .. options.show(step))
  end
  return step
end

function K:path(step)
  check_self(self, "path", "step")
  want_step(step, "path")
  return string.format("%s/step-%08d.ckpt", self.dir, step)
end

-- A checkpoint's file name (its step captured), and libm3's temporary name for it (the
-- writer's pid captured).
local CHECKPOINT_NAME = "^step%-(%d+)%.ckpt$"
local TEMPORARY_NAME = "^step%-%d+%.ckpt%.tmp%.(%d+)%.%d+$"

function K:list()
  check_self(self, "list", "")
  if fs.exists(self.dir) and not fs.is_dir(self.dir) then -- (fs.list: {} for what it cannot open)
    lib.raise(string.format("m3.checkpoint: %s is %s, not a folder of checkpoints", self.dir,
      fs.kind(self.dir) or "a file"))
  end
  local out = {}
  for _, name in ipairs(fs.list(self.dir)) do
    local step = name:match(CHECKPOINT_NAME)
    if step then out[#out + 1] = { step = tonumber(step), path = self.dir .. "/" .. name } end
  end
  table.sort(out, function(a, b) return a.step < b.step end)
  return out
end

local MAX_PID = 2 ^ 31 - 1 -- a larger number in a name was not a pid: libm3 did not write it
local ESRCH = 3            -- kill(pid, 0): no such process

-- Whether the process that wrote a temporary file can no longer finish (rename) it.
local function writer_gone(pid)
  if pid == ffi.C.getpid() then return true end
  return ffi.C.kill(pid, 0) ~= 0 and ffi.errno() == ESRCH
end

-- Removes the temporary files of interrupted checkpoint writes from the folder.
local function remove_stale_temporaries(dir)
  for _, name in ipairs(fs.list(dir)) do
    local pid = tonumber(name:match(TEMPORARY_NAME))
    if pid and pid <= MAX_PID and writer_gone(pid) then os.remove(dir .. "/" .. name) end
  end
end

-- tr, once it is a trainer (method: the caller, for the message).
local function want_trainer(tr, method)
  if type(tr) ~= "table" or type(tr.save) ~= "function" then
    lib.raise("m3.checkpoint: " .. method .. " expects a trainer (m3.trainer), got " .. options.describe(tr))
  end
  return tr
end

function K:save(tr, step, extra)
  check_self(self, "save", "tr, step, extra")
  want_trainer(tr, "save")
  want_step(step, "save")
  fs.mkdir(self.dir, "m3.checkpoint: save")
  remove_stale_temporaries(self.dir)
  local written = self:path(step)
  local path = tr:save(written, { step = step, extra = extra })
  if self.keep > 0 then
    local others = {}
    for _, c in ipairs(self:list()) do
      if c.path ~= written then others[#others + 1] = c end
    end
    for i = 1, #others - (self.keep - 1) do os.remove(others[i].path) end
  end
  return path
end

function K:maybe_save(tr, step, extra)
  check_self(self, "maybe_save", "tr, step, extra")
  want_trainer(tr, "maybe_save")
  want_step(step, "maybe_save")
  if self.every > 0 and step % self.every == 0 then return self:save(tr, step, extra) end
end

-- The engine's refusals that are not the file's: every checkpoint would meet them (a device or
-- dtype this machine cannot run, memory), so resume raises them instead of trying older files.
local NOT_THE_FILE = { [lib.C.M3_ERR_MEMORY] = true, [lib.C.M3_ERR_UNSUPPORTED] = true, [lib.C.M3_ERR_CUDA] = true }

function K:resume(opts)
  check_self(self, "resume", "opts")
  options.load_opts(opts, "m3.checkpoint: resume") -- bad options are the caller's, not a reason to skip every file
  local all = self:list()
  for i = #all, 1, -1 do
    lib.last_status = nil
    local ok, tr, saved = pcall(trainer.load, all[i].path, opts)
    if not ok and NOT_THE_FILE[lib.last_status] then error(tr, 0) end
    if ok then
      if type(saved) ~= "table" or type(saved.step) ~= "number" then
        lib.raise("m3.checkpoint: " .. all[i].path .. " was not written by m3.checkpoint (no step in its extra)")
      end
      return tr, saved.extra, saved.step
    end
    io.stderr:write("m3.checkpoint: skipping ", all[i].path, ": ", tostring(tr), "\n")
  end
  return nil
end

function checkpoint.resume(dir, opts)
  if type(dir) ~= "string" or dir == "" then
    lib.raise("m3.checkpoint.resume: expected the checkpoint folder (a path), got " .. options.show(dir))
  end
  return checkpoint.new { dir = dir }:resume(opts)
end

function K:save_interrupted(tr, step, extra)
  check_self(self, "save_interrupted", "tr, step, extra")
  want_trainer(tr, "save_interrupted")
  lib.C.m3_interrupt_clear()
  local info = tr:info()
  if info.window_open or info.pending_forward then
    return nil, "the run stopped inside an accumulation window"
  end
  local ok, path = pcall(self.save, self, tr, step, extra)
  if not ok then return nil, tostring(path) end
  return path
end

-- Whether an error is an interrupt (Ctrl-C / SIGTERM through the engine or the host).
function checkpoint.is_interrupt(err)
  return tostring(err):find("interrupted", 1, true) ~= nil
end

return checkpoint

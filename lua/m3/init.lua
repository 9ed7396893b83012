-- m3 — the Lua interface of libm3 (API.md): host tensors, safetensors I/O, configs and
-- presets, weights, the trainer, and machine facts. Other m3.* modules (infer, schedule,
-- data, ...) load on first use: m3.schedule is require("m3.schedule").

local ffi = require "ffi"
local lib = require "m3.lib"
local tensor = require "m3.tensor"
local tensors_io = require "m3.tensors_io"
local config = require "m3.config"
local weights = require "m3.weights"
local trainer = require "m3.trainer"

lib.internal_file(debug.getinfo(1, "S").source)

local C = lib.C

local m3 = {
  tensor = tensor,
  load_tensors = tensors_io.load,
  save_tensors = tensors_io.save,
  config = config.validate,
  config_from_json = config.from_json,
  preset = config.preset,
  weights = weights,
  trainer = trainer,
  version = ffi.string(C.m3_version()),
}

function m3.cuda_device_count()
  return tonumber(C.m3_cuda_device_count())
end

function m3.has_cuda_build()
  return C.m3_has_cuda_build() ~= 0
end

-- Threads of the CPU backend: sets them when n is given (n <= 0: all cores), returns the count.
function m3.cpu_threads(n)
  if n ~= nil then
    if type(n) ~= "number" or n ~= math.floor(n) or math.abs(n) > 2147483647 then
      lib.raise("m3.cpu_threads: n must be an int32 integer, got " .. tostring(n))
    end
    lib.check(C.m3_cpu_set_threads(n))
  end
  return tonumber(C.m3_cpu_threads())
end

return setmetatable(m3, {
  -- the documented names __index gives, for the REPL's completion (it cannot list a function's)
  __fields = { "accumulate", "checkpoint", "curriculum", "data", "fit", "infer", "log", "presets", "pytorch",
               "sampling", "schedule", "sweep" },
  __index = function(t, name)
    if name == "presets" then return config.presets end -- new copies at each access, never kept
    if type(name) ~= "string" or not package.searchpath("m3." .. name, package.path) then return nil end
    local mod = require("m3." .. name)
    rawset(t, name, mod)
    return mod
  end,
})

-- scripts/bench_device.lua — the device a benchmark runs on, shared by bench.lua and bench_decode.lua:
--   local device = dofile(<scripts>/bench_device.lua)(script, flags_device, dtypes, dtypes_text)
-- flags_device is "cuda", "cpu" or nil (auto: cuda when there is a GPU); dtypes the listed dtypes or nil.
-- A device or dtype that cannot run here (--device cuda without a GPU; bf16 or f16 on the CPU, which
-- computes in f32 only) stops the script with exit status 2 before it times anything.

local m3 = require "m3"

return function(script, device, dtypes, dtypes_text)
  local function refuse(message)
    io.stderr:write(script, ": ", message, "\n")
    os.exit(2)
  end
  if device == "cuda" and m3.cuda_device_count() == 0 then
    refuse("--device cuda: no CUDA device here" .. (m3.has_cuda_build() and "" or " (this libm3 has no CUDA backend)"))
  end
  device = device or (m3.cuda_device_count() > 0 and "cuda" or "cpu")
  if device == "cpu" then
    for _, dtype in ipairs(dtypes or {}) do
      if dtype ~= "f32" then refuse("--dtypes " .. dtypes_text .. ": the CPU backend computes in f32 only") end
    end
  end
  return device
end

-- spec/smoke.lua — a plain-luajit smoke test of the m3 binding (not busted: busted memoizes
-- ffi.cdef and would hide a declaration made twice). Loads m3 through ffi.load (the
-- library named by <build>/lua/m3/cdef.lua, or $M3_LIB), takes two CPU steps on a tiny
-- model and checks the losses are finite. Prints "smoke ok" and exits 0; exits 1 on failure.
-- Usage: luajit spec/smoke.lua   (from anywhere; paths are relative to this file; the build
-- folder is $BUILD_DIR, relative to the repository unless absolute, default build)

local here = (debug.getinfo(1, "S").source:gsub("^@", ""):match("^(.*)/[^/]*$")) or "."
local repo = here .. "/.."
local build = os.getenv("BUILD_DIR") or "build"
if build:sub(1, 1) ~= "/" then build = repo .. "/" .. build end
package.path = table.concat({ repo .. "/lua/?.lua", repo .. "/lua/?/init.lua", build .. "/lua/?.lua",
                              package.path }, ";")

local function main()
  local ffi = require "ffi"
  assert(not pcall(function() return ffi.C.m3_abi_version end),
    "libm3 is already linked into this process; run the smoke test with plain luajit")
  local m3 = require "m3"
  local tr = m3.trainer({ d_model = 16, n_layers = 2, d_state = 8, headdim = 8, input = "tokens", vocab_size = 11,
                          head = "lm" }, { device = "cpu", batch = 2, seq_len = 8, seed = 1 })
  local tokens, targets = m3.tensor({ 2, 8 }, "i32"), m3.tensor({ 2, 8 }, "i32")
  for i = 0, 15 do
    tokens[i] = i % 11
    targets[i] = (i + 1) % 11
  end
  for step = 1, 2 do
    local m = tr:step({ tokens = tokens, targets = targets })
    assert(m.step == step, "step count " .. tostring(m.step))
    assert(m.loss == m.loss and math.abs(m.loss) < math.huge, "loss is not finite: " .. tostring(m.loss))
  end
  tr:close()
end

local ok, err = xpcall(main, debug.traceback)
if not ok then
  io.stderr:write("smoke FAILED: ", tostring(err), "\n")
  os.exit(1)
end
print("smoke ok")
os.exit(0)

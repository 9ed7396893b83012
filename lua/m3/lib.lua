-- m3.lib — loads libm3 through the FFI: declares the generated cdef once, binds the
-- library (ffi.C inside the m3lua host, which links libm3; else ffi.load), refuses a
-- library whose ABI differs from the header, and turns status codes into Lua errors
-- that point at the user's call site.

local ffi = require "ffi"
local cdef = require "m3.cdef"

ffi.cdef(cdef.cdef)

local function linked_in()
  return pcall(function() return ffi.C.m3_abi_version end)
end

local path, C
if linked_in() then
  path, C = "(linked into this process)", ffi.C
else
  path = os.getenv("M3_LIB") or cdef.library
  local ok, lib = pcall(ffi.load, path)
  if not ok then
    error(string.format("m3: cannot load libm3 from %s (%s); build it with `ninja -C build` "
      .. "or point M3_LIB at it", path, tostring(lib)), 0)
  end
  C = lib
end

-- The ABI these Lua sources are written for: a build folder older than the sources (its
-- cdef and libm3 agreeing with each other) is refused too, instead of misreading structs.
local REQUIRED_ABI = 9
if cdef.abi ~= REQUIRED_ABI then
  error(string.format("m3: the build's cdef (%s) is for ABI version %d but these Lua sources need %d; "
    .. "rebuild (ninja -C build)", path, cdef.abi, REQUIRED_ABI), 0)
end

local abi = tonumber(C.m3_abi_version())
if abi ~= cdef.abi then
  error(string.format("m3: libm3 at %s has ABI version %d but the binding was generated "
    .. "for ABI version %d; rebuild (ninja -C build) so that both match", path, abi, cdef.abi), 0)
end

local lib = { C = C, path = path, abi = abi }

-- Sources of the binding's own files: frames from them are skipped when an error is
-- raised, so the message carries the file:line of the code that called the binding.
local internal = {}

function lib.internal_file(source)
  internal[source] = true
end
lib.internal_file(debug.getinfo(1, "S").source)

-- The error() level of the first frame outside the binding, seen from the caller of
-- user_level's caller (level 1 there is the function that calls error).
local function user_level()
  local level = 3
  while true do
    local info = debug.getinfo(level, "S")
    if not info or not internal[info.source] then return level - 1 end
    level = level + 1
  end
end

-- Raises msg at the user's call site (or at an explicit level, as for error()).
function lib.raise(msg, level)
  error(msg, level and level + 1 or user_level())
end

-- The box type of a C handle: ffi struct `<handle>_box { <handle> *p; }` whose __gc calls
-- destroy(p) once (a __gc metatype never fires for a pointer C returned, so handles live
-- in boxes made with ffi.new; close() is destroy + p = nil).
function lib.box(handle, destroy)
  local name = handle .. "_box"
  ffi.cdef(string.format("typedef struct %s { %s *p; } %s;", name, handle, name))
  return ffi.metatype(name, {
    __gc = function(b)
      if b.p ~= nil then
        destroy(b.p)
        b.p = nil
      end
    end,
  })
end

local INTERRUPTED = C.M3_ERR_INTERRUPTED

-- Raises the library's last error when status is not M3_OK: "m3: <message>" at the given
-- level (as for error(), seen from check's caller; by default the first frame outside the
-- binding), or "interrupted: <message>" without a position for M3_ERR_INTERRUPTED, so
-- that callers (the REPL) can recognise an interrupt by its first word. lib.last_status keeps
-- the status of the last call it raised for (callers reset it to tell the engine's refusals
-- from their own errors).
function lib.check(status, level)
  if status == 0 then return end
  lib.last_status = tonumber(status)
  local msg = ffi.string(C.m3_last_error())
  if status == INTERRUPTED then
    local host = package.loaded["m3.host"] -- the m3lua host: its signal hook must not raise this again
    if host then host.drop_interrupt_hook() end
    error("interrupted: " .. msg, 0)
  end
  error("m3: " .. msg, level and level + 1 or user_level())
end

return lib

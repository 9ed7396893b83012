-- m3.fs — the few file-system helpers the training library needs (POSIX, via the FFI and
-- the shell's ls): make folders, list a folder, read a file, replace a file atomically.

local ffi = require "ffi"

pcall(ffi.cdef, "int mkdir(const char *path, unsigned int mode);")

local fs = {}

-- mkdir -p: creates path and its missing parents (existing ones are fine).
function fs.mkdir(path)
  for i in path:gmatch("()/") do
    if i > 1 then ffi.C.mkdir(path:sub(1, i - 1), 493) end -- 0755
  end
  ffi.C.mkdir(path, 493)
  if not fs.exists(path .. "/.") then error("m3.fs: cannot create the folder " .. path, 2) end
end

function fs.exists(path)
  local f = io.open(path, "r")
  if f then f:close() end
  return f ~= nil
end

-- The names in a folder, sorted (an empty list when it does not exist).
function fs.list(dir)
  local out = {}
  local p = io.popen("ls -1A -- '" .. dir:gsub("'", "'\\''") .. "' 2>/dev/null")
  for name in p:lines() do out[#out + 1] = name end
  p:close()
  table.sort(out)
  return out
end

-- The whole file, or nil and a message.
function fs.read(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s = f:read("*a")
  f:close()
  return s
end

-- Writes text to a temporary file beside path and renames it over path, so a reader
-- never sees a half-written file.
function fs.write(path, text)
  local tmp = path .. ".tmp"
  local f, err = io.open(tmp, "wb")
  if not f then error("m3.fs: cannot write " .. tostring(err), 2) end
  f:write(text)
  f:close()
  local ok, rerr = os.rename(tmp, path)
  if not ok then error("m3.fs: cannot rename onto " .. path .. ": " .. tostring(rerr), 2) end
end

return fs

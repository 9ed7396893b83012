-- m3.fs — the few file-system helpers the training library needs (POSIX, via the FFI):
-- make folders, list a folder, read a file, replace a file atomically, resolve a path.

local ffi = require "ffi"
local lib = require "m3.lib"

lib.internal_file(debug.getinfo(1, "S").source)

pcall(ffi.cdef, "int mkdir(const char *path, unsigned int mode);")
pcall(ffi.cdef, "char *strerror(int errnum);")
pcall(ffi.cdef, "int getpid(void);")
pcall(ffi.cdef, "char *realpath(const char *path, char *resolved);")
pcall(ffi.cdef, "void free(void *p);")
-- opendir/readdir/closedir under private names (asm labels), with struct dirent as glibc
-- lays it out on 64-bit Linux (x86_64, aarch64).
pcall(ffi.cdef, [[
typedef struct m3fs_dir m3fs_dir;
typedef struct {
  uint64_t d_ino;
  int64_t d_off;
  unsigned short d_reclen;
  unsigned char d_type;
  char d_name[256];
} m3fs_dirent;
m3fs_dir *m3fs_opendir(const char *path) __asm__("opendir");
m3fs_dirent *m3fs_readdir(m3fs_dir *dir) __asm__("readdir");
int m3fs_closedir(m3fs_dir *dir) __asm__("closedir");
]])

local fs = {}

function fs.exists(path)
  local f = io.open(path, "r")
  if f then f:close() end
  return f ~= nil
end

function fs.is_dir(path)
  return fs.exists(path .. "/.")
end

-- The absolute path of an existing file or folder, without symbolic links, "." or ".." (nil when it
-- does not exist or cannot be resolved).
function fs.realpath(path)
  local p = ffi.C.realpath(path, nil)
  if p == nil then return nil end
  local s = ffi.string(p)
  ffi.C.free(p)
  return s
end

-- mkdir -p: creates path and its missing parents (existing ones are fine); an error says
-- why not (e.g. path is a file).
function fs.mkdir(path)
  for i in path:gmatch("()/") do
    if i > 1 then ffi.C.mkdir(path:sub(1, i - 1), 493) end -- 0755
  end
  local made = ffi.C.mkdir(path, 493) == 0
  local errno = ffi.errno()
  if not made and not fs.is_dir(path) then
    local why = fs.exists(path) and "it exists and is not a folder" or ffi.string(ffi.C.strerror(errno))
    lib.raise("m3.fs: cannot create the folder " .. path .. ": " .. why)
  end
end

-- The names in a folder but . and .., sorted (an empty list when it does not exist or
-- cannot be opened); an error when reading it fails part way.
function fs.list(dir)
  local out = {}
  local d = ffi.C.m3fs_opendir(dir)
  if d == nil then return out end
  d = ffi.gc(d, ffi.C.m3fs_closedir) -- closed even when an interrupt cuts the loop short
  local errno
  repeat
    ffi.errno(0)
    local entry = ffi.C.m3fs_readdir(d)
    if entry == nil then
      errno = ffi.errno()
    else
      local name = ffi.string(entry.d_name)
      if name ~= "." and name ~= ".." then out[#out + 1] = name end
    end
  until entry == nil
  ffi.C.m3fs_closedir(ffi.gc(d, nil))
  if errno ~= 0 then
    lib.raise("m3.fs.list: cannot read the folder " .. dir .. ": " .. ffi.string(ffi.C.strerror(errno)))
  end
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
-- never sees a half-written file and a failed write (a full disk) leaves path as it was.
-- The temporary name keeps at most 200 bytes of path's own, so that a name the file
-- system takes does not grow past its limit. An error on the way (the interrupt that
-- m3lua raises for Ctrl-C or SIGTERM) removes the temporary file before it goes on.
function fs.write(path, text)
  local dir, base = path:match("^(.*/)([^/]*)$")
  local tmp = (dir or "") .. (base or path):sub(1, 200) .. ".tmp." .. ffi.C.getpid()
  local f, err = io.open(tmp, "wb")
  if not f then lib.raise("m3.fs: cannot write " .. tostring(err)) end
  local ok, failure = pcall(function()
    local wrote, werr = f:write(text)
    local flushed, ferr = f:flush()
    local closed, cerr = f:close()
    if not (wrote and flushed and closed) then
      return "m3.fs: cannot write " .. path .. ": " .. tostring(werr or ferr or cerr)
    end
    local renamed, rerr = os.rename(tmp, path)
    if not renamed then return "m3.fs: cannot rename onto " .. path .. ": " .. tostring(rerr) end
  end)
  if ok and not failure then return end
  if io.type(f) == "file" then f:close() end
  os.remove(tmp)
  if ok then lib.raise(failure) end
  error(failure, 0)
end

return fs

-- m3.fs — the few file-system helpers the training library needs (POSIX, via the FFI):
-- make folders, list a folder, read a regular file (anything else there, a folder or a FIFO, is
-- nil and a message that says what it is, and is not opened), replace a file atomically, replace
-- several files as one set (write_together: all the new files or all the old ones), resolve
-- a path, tell what is at a path from its metadata (exists, is_dir, is_file, kind, stat: nothing is
-- opened, so a FIFO does not wait for a writer), and check a path before it reaches C (check_path: a string
-- without a NUL byte, which C would cut the name at, reaching another file).
--
-- write replaces a regular file, or, through a symbolic link, the regular file the link resolves
-- to (the link stays a link, as when a program opens it for writing). Anything else there is
-- refused before a byte is written, saying what it is: a folder, a FIFO, a device, a socket, or
-- a link to one of those or to nothing (the rename would put a regular file in place of a FIFO
-- or a device node, and the engine's readers take regular files only). libm3's writer
-- (safetensors.c: checkpoints, weights, m3.save_tensors) does the same.

local bit = require "bit"
local ffi = require "ffi"
local lib = require "m3.lib"

lib.internal_file(debug.getinfo(1, "S").source)

pcall(ffi.cdef, "int mkdir(const char *path, unsigned int mode);")
pcall(ffi.cdef, "char *strerror(int errnum);")
pcall(ffi.cdef, "int getpid(void);")
pcall(ffi.cdef, "char *realpath(const char *path, char *resolved);")
pcall(ffi.cdef, "void free(void *p);")
pcall(ffi.cdef, "ssize_t readlink(const char *path, char *buf, size_t size);")
-- statx under a private name: unlike struct stat, struct statx is laid out alike on every Linux
-- architecture (its fields up to the modification time here, the rest padding to its 256 bytes).
pcall(ffi.cdef, [[
typedef struct {
  uint32_t mask, blksize;
  uint64_t attributes;
  uint32_t nlink, uid, gid;
  uint16_t mode, spare;
  uint64_t ino, size;
  uint8_t between[64];
  int64_t mtime_sec;
  uint32_t mtime_nsec;
  uint8_t rest[132];
} m3fs_statx_buf;
int m3fs_statx(int dirfd, const char *path, int flags, unsigned int mask, m3fs_statx_buf *out) __asm__("statx");
]])
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

-- Raises "<what>: path must be a string, got <type>", or that path holds a NUL byte: C (the engine,
-- the C library's file calls) would take the name to end there, another file.
function fs.check_path(path, what)
  if type(path) ~= "string" then lib.raise(what .. ": path must be a string, got " .. type(path)) end
  if path:find("\0", 1, true) then
    lib.raise(string.format("%s: path %q holds a NUL byte, which no file name can hold", what, path))
  end
end

local AT_FDCWD, AT_SYMLINK_NOFOLLOW, AT_EMPTY_PATH, STATX_TYPE, STATX_MTIME, STATX_INO = -100, 0x100, 0x1000, 1,
  0x40, 0x100
local S_IFMT, S_IFREG, S_IFLNK, S_IFDIR = 0xF000, 0x8000, 0xA000, 0x4000
local KIND = { [S_IFDIR] = "a folder", [0x1000] = "a FIFO (named pipe)", [0x2000] = "a character device",
               [0x6000] = "a block device", [0xC000] = "a socket" }

-- The type bits (S_IFMT) of path's mode, of a symbolic link itself with nofollow; nil when path cannot be
-- looked at (it does not exist).
local function file_type(path, nofollow)
  local st = ffi.new("m3fs_statx_buf")
  if ffi.C.m3fs_statx(AT_FDCWD, path, nofollow and AT_SYMLINK_NOFOLLOW or 0, STATX_TYPE, st) ~= 0 then return nil end
  return bit.band(st.mode, S_IFMT)
end

-- Whether something is at path (through symbolic links), by its metadata: nothing is opened, so a FIFO
-- there does not wait for a writer.
function fs.exists(path)
  fs.check_path(path, "m3.fs.exists")
  return file_type(path) ~= nil
end

function fs.is_dir(path)
  fs.check_path(path, "m3.fs.is_dir")
  return file_type(path) == S_IFDIR
end

-- Whether path is a regular file (through symbolic links).
function fs.is_file(path)
  fs.check_path(path, "m3.fs.is_file")
  return file_type(path) == S_IFREG
end

-- What is at path (through symbolic links) when it is there and no regular file: "a folder", "a FIFO
-- (named pipe)", "a character device", "a block device", "a socket" (else "not a regular file"); nil for
-- a regular file or nothing. Told from the metadata: nothing is opened.
function fs.kind(path)
  fs.check_path(path, "m3.fs.kind")
  local t = file_type(path)
  if t == nil or t == S_IFREG then return nil end
  return KIND[t] or "not a regular file"
end

-- The identity and age of what is at path (through symbolic links), or of the open file fd when
-- path is "": {ino = inode number, mtime = {seconds, nanoseconds}}; nil when nothing is there.
-- An empty path without fd is an error (statx would take it for the current folder).
function fs.stat(path, fd)
  fs.check_path(path, "m3.fs.stat")
  if path == "" and not fd then
    lib.raise('m3.fs.stat: path is "", which names the open file fd, and no fd was given')
  end
  local st = ffi.new("m3fs_statx_buf")
  if ffi.C.m3fs_statx(fd or AT_FDCWD, path, path == "" and AT_EMPTY_PATH or 0, bit.bor(STATX_MTIME, STATX_INO), st)
    ~= 0 then
    return nil
  end
  return { ino = st.ino, mtime = { tonumber(st.mtime_sec), tonumber(st.mtime_nsec) } }
end

-- The absolute path of an existing file or folder, without symbolic links, "." or ".." (nil when it
-- does not exist or cannot be resolved).
function fs.realpath(path)
  fs.check_path(path, "m3.fs.realpath")
  local p = ffi.C.realpath(path, nil)
  if p == nil then return nil end
  local s = ffi.string(p)
  ffi.C.free(p)
  return s
end

-- mkdir -p: creates path and its missing parents (existing ones are fine); an error says
-- why not (e.g. path is a file), begun by what (the public call that needs the folder; default "m3.fs").
function fs.mkdir(path, what)
  fs.check_path(path, what or "m3.fs.mkdir")
  for i in path:gmatch("()/") do
    if i > 1 then ffi.C.mkdir(path:sub(1, i - 1), 493) end -- 0755
  end
  local made = ffi.C.mkdir(path, 493) == 0
  local errno = ffi.errno()
  if not made and not fs.is_dir(path) then
    local why = fs.exists(path) and "it exists and is not a folder" or ffi.string(ffi.C.strerror(errno))
    lib.raise((what or "m3.fs") .. ": cannot create the folder " .. path .. ": " .. why)
  end
end

-- The names in a folder but . and .., sorted (an empty list when it does not exist or
-- cannot be opened); an error when reading it fails part way.
function fs.list(dir)
  fs.check_path(dir, "m3.fs.list")
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

-- The whole file (through symbolic links), or nil and a message: "<path>: No such file or
-- directory" (io.open's), "<path> is a folder, not a regular file" (a FIFO, a device, a socket
-- alike: told from the metadata, so a FIFO is not opened and does not wait for a writer).
function fs.read(path)
  fs.check_path(path, "m3.fs.read")
  local t = file_type(path)
  if t and t ~= S_IFREG then
    return nil, path .. " is " .. (KIND[t] and KIND[t] .. ", not" or "not") .. " a regular file"
  end
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s, rerr = f:read("*a")
  f:close()
  if not s then return nil, path .. ": " .. tostring(rerr) end
  return s
end

-- The file that write(path) replaces: path when nothing is there or a regular file is, else the regular
-- file a symbolic link resolves to. Anything else is an error that says what is there.
local function write_target(path)
  local t = file_type(path, true)
  if t == nil or t == S_IFREG then return path end
  local why
  if t ~= S_IFLNK then
    why = "it exists and is " .. (KIND[t] or "not a regular file")
  else
    local real = fs.realpath(path)
    local errno = ffi.errno()
    local rt = real and file_type(real)
    if rt == S_IFREG then return real end
    if real then
      why = "it is a symbolic link to " .. real .. ", which is " .. (KIND[rt] or "not a regular file")
    else
      local buf = ffi.new("char[4096]")
      local n = tonumber(ffi.C.readlink(path, buf, 4096))
      why = "it is a symbolic link to " .. (n > 0 and ffi.string(buf, n) or "?") .. ", which does not resolve ("
        .. ffi.string(ffi.C.strerror(errno)) .. ")"
    end
  end
  lib.raise("m3.fs: cannot write " .. path .. ": " .. why .. "; only a regular file, or a symbolic link to one, "
    .. "is replaced")
end

-- The temporary name beside target that a write renames over it: it keeps at most 200 bytes of
-- target's own name, so that a name the file system takes does not grow past its limit.
local function temporary_beside(target)
  local dir, base = target:match("^(.*/)([^/]*)$")
  return (dir or "") .. (base or target):sub(1, 200) .. ".tmp." .. ffi.C.getpid()
end

-- Writes text to a temporary file beside path and renames it over path, so a reader
-- never sees a half-written file and a failed write (a full disk) leaves path as it was
-- (path a symbolic link: beside and over the file it resolves to; see the header).
-- An error on the way (the interrupt that m3lua raises for Ctrl-C or SIGTERM) removes
-- the temporary file before it goes on.
function fs.write(path, text)
  fs.check_path(path, "m3.fs.write")
  local target = write_target(path)
  local tmp = temporary_beside(target)
  local f, err = io.open(tmp, "wb")
  if not f then lib.raise("m3.fs: cannot write " .. tostring(err)) end
  local ok, failure = pcall(function()
    local wrote, werr = f:write(text)
    local flushed, ferr = f:flush()
    local closed, cerr = f:close()
    if not (wrote and flushed and closed) then
      return "m3.fs: cannot write " .. path .. ": " .. tostring(werr or ferr or cerr)
    end
    local renamed, rerr = os.rename(tmp, target)
    if not renamed then return "m3.fs: cannot rename onto " .. path .. ": " .. tostring(rerr) end
  end)
  if ok and not failure then return end
  if io.type(f) == "file" then f:close() end
  os.remove(tmp)
  if ok then lib.raise(failure) end
  error(failure, 0)
end

-- Writes several files as one set: files = {{path, write}, ...}, where write(tmp) writes that file
-- at tmp, a temporary name beside the file path resolves to (as for fs.write). Every path is
-- checked first as fs.write checks it (a folder there refuses the set before a byte is written);
-- every file is written; only then is each renamed over its path, its old file first moved aside
-- (to <tmp>.old, removed once every new file is in place). An error on the way (a write's, a
-- rename's, an interrupt) removes the new files, puts every old file back, removes the temporaries
-- and goes on: the paths hold either all the new files or all the old ones.
function fs.write_together(files)
  local targets, temps = {}, {}
  for i, file in ipairs(files) do
    fs.check_path(file[1], "m3.fs.write_together")
    targets[i] = write_target(file[1])
    temps[i] = temporary_beside(targets[i])
  end
  local aside, placed = {}, {} -- [i]: where the old file of targets[i] waits; whether its new file is in place
  local ok, failure = pcall(function()
    for i, file in ipairs(files) do file[2](temps[i]) end
    for i, target in ipairs(targets) do
      local t = file_type(target, true)
      if t == S_IFREG then
        local moved, merr = os.rename(target, temps[i] .. ".old")
        if not moved then return "m3.fs: cannot move " .. files[i][1] .. " aside: " .. tostring(merr) end
        aside[i] = temps[i] .. ".old"
      elseif t ~= nil then
        return "m3.fs: cannot rename onto " .. files[i][1] .. ": it is now " .. (KIND[t] or "not a regular file")
          .. " (it appeared while the files were written)"
      end
      local renamed, rerr = os.rename(temps[i], target)
      if not renamed then return "m3.fs: cannot rename onto " .. files[i][1] .. ": " .. tostring(rerr) end
      placed[i] = true
    end
  end)
  if ok and not failure then
    for i = 1, #targets do
      if aside[i] then os.remove(aside[i]) end
    end
    return
  end
  for i = #targets, 1, -1 do
    if placed[i] then os.remove(targets[i]) end
    if aside[i] then os.rename(aside[i], targets[i]) end
    if file_type(temps[i], true) == S_IFREG then os.remove(temps[i]) end -- not a folder found at its name
  end
  if ok then lib.raise(failure) end
  error(failure, 0)
end

return fs

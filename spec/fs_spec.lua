-- m3.fs: listing a folder whose names hold newlines, quotes, spaces and leading dashes or dots;
-- a folder that does not exist and a file list as empty; realpath; read saying what is there when
-- it is no regular file (a FIFO not opened); write's atomic replace, which
-- an error on the way (an interrupt) leaves without a temporary file; write refusing a FIFO, a
-- folder and a link to one or to nothing, and writing through a link into its file; every helper
-- refusing a path that holds a NUL byte; exists / is_dir / is_file by metadata (a FIFO is not opened);
-- stat, which refuses an empty path without an fd.

local fs = require "m3.fs"
local helper = require "spec.helper"

describe("m3.fs.list", function()
  it("gives every name as it is, sorted, without . and ..", function()
    local dir = helper.tmpdir()
    local names = { "a\nb", "b", "it's", "-n", ".hidden", "with space", "x\\y", "\"q\"" }
    for _, name in ipairs(names) do fs.write(dir .. "/" .. name, name) end
    fs.mkdir(dir .. "/sub\ndir")
    names[#names + 1] = "sub\ndir"
    table.sort(names)
    local listed = fs.list(dir)
    os.execute("rm -rf '" .. dir .. "'")
    assert.same(names, listed)
  end)

  it("lists a missing folder and a file as empty", function()
    local dir = helper.tmpdir()
    fs.write(dir .. "/file", "x")
    local missing, file = fs.list(dir .. "/missing"), fs.list(dir .. "/file")
    os.execute("rm -rf '" .. dir .. "'")
    assert.same({}, missing)
    assert.same({}, file)
  end)
end)

describe("m3.fs.realpath", function()
  it("resolves . and .. and symbolic links to one absolute path, nil for a missing file", function()
    local dir = helper.tmpdir()
    fs.mkdir(dir .. "/sub")
    fs.write(dir .. "/sub/file", "x")
    os.execute("ln -s '" .. dir .. "/sub' '" .. dir .. "/link'")
    local real = fs.realpath(dir .. "/sub/file")
    local dotted, linked = fs.realpath(dir .. "/./sub/../sub/file"), fs.realpath(dir .. "/link/file")
    local missing = fs.realpath(dir .. "/sub/none")
    os.execute("rm -rf '" .. dir .. "'")
    assert.equal("/", real:sub(1, 1))
    assert.equal("/sub/file", real:sub(-9))
    assert.equal(real, dotted)
    assert.equal(real, linked)
    assert.is_nil(missing)
  end)
end)

describe("m3.fs.write", function()
  it("replaces a file; an error on the way (an interrupt) leaves the old file and no temporary one", function()
    local dir = helper.tmpdir()
    local path = dir .. "/file"
    fs.write(path, "old")
    fs.write(path, "new")
    assert.equal("new", fs.read(path))
    local real_open = io.open
    io.open = function(name, mode)
      local f = assert(real_open(name, mode))
      return setmetatable({}, { __index = function(_, k)
        if k == "write" then return function() error("interrupted!", 0) end end
        return function(_, ...) return f[k](f, ...) end
      end })
    end
    local ok, err = pcall(fs.write, path, "newer")
    io.open = real_open
    local names = fs.list(dir)
    os.execute("rm -rf '" .. dir .. "'")
    assert.is_false(ok)
    assert.equal("interrupted!", err)
    assert.same({ "file" }, names)
  end)
end)

describe("m3.fs.exists, is_dir and is_file", function()
  it("tell a FIFO, a folder, a file and links apart without opening them (a FIFO would wait)", function()
    local dir = helper.tmpdir()
    local q = "'" .. dir .. "'"
    os.execute("cd " .. q .. " && mkfifo fifo && mkdir folder && touch file && ln -s file to_file && ln -s missing "
      .. "dangling && ln -s folder to_folder")
    -- in a child under a time limit: a probe that opened the FIFO would wait for a writer for ever
    local probe = "local fs = require 'm3.fs' for _, n in ipairs { 'fifo', 'folder', 'file', 'to_file', 'dangling', "
      .. "'to_folder', 'none' } do local p = '" .. dir .. "/' .. n io.write(n, ' ', tostring(fs.exists(p)), ' ', "
      .. "tostring(fs.is_dir(p)), ' ', tostring(fs.is_file(p)), ';') end"
    local out, code = helper.run("timeout 20 " .. helper.quote(helper.m3lua()) .. " -e \"" .. probe .. "\"")
    os.execute("rm -rf " .. q)
    assert.equal(0, code, out)
    assert.equal("fifo true false false;folder true true false;file true false true;to_file true false true;"
      .. "dangling false false false;to_folder true true false;none false false false;", out)
  end)
end)

describe("m3.fs.read", function()
  it("reads a file, and says what is there instead for a folder, a FIFO (not opened), a device or nothing", function()
    local dir = helper.tmpdir()
    local q = "'" .. dir .. "'"
    os.execute("cd " .. q .. " && mkfifo fifo && mkdir folder && printf 'x\\0y' > file && ln -s folder to_folder")
    -- in a child under a time limit: a read that opened the FIFO would wait for a writer for ever
    local probe = "local fs = require 'm3.fs' for _, p in ipairs { 'fifo', 'folder', 'to_folder', 'file', 'none', "
      .. "'/dev/null' } do p = p:sub(1, 1) == '/' and p or '" .. dir .. "/' .. p local s, err = fs.read(p) "
      .. "io.write(string.format('%q %s;', tostring(s), tostring(err):gsub('^' .. p:gsub('%p', '%%%0'), '<p>'))) end"
    local out, code = helper.run("timeout 20 " .. helper.quote(helper.m3lua()) .. " -e \"" .. probe .. "\"")
    os.execute("rm -rf " .. q)
    assert.equal(0, code, out)
    assert.equal('"nil" <p> is a FIFO (named pipe), not a regular file;"nil" <p> is a folder, not a regular file;'
      .. '"nil" <p> is a folder, not a regular file;"x\\0y" nil;"nil" <p>: No such file or directory;'
      .. '"nil" <p> is a character device, not a regular file;', out)
  end)
end)

describe("m3.fs.write onto what is not a regular file", function()
  local REPLACED = "; only a regular file, or a symbolic link to one, is replaced$"

  it("refuses a FIFO, a folder and a link to one of them or to nothing, leaving each as it was", function()
    local dir = helper.tmpdir()
    local q = "'" .. dir .. "'"
    os.execute("cd " .. q .. " && mkfifo fifo && mkdir folder && ln -s missing dangling && ln -s fifo to_fifo")
    local says = {
      fifo = "it exists and is a FIFO %(named pipe%)",
      folder = "it exists and is a folder",
      dangling = "it is a symbolic link to missing, which does not resolve %(No such file or directory%)",
      to_fifo = "it is a symbolic link to [^,]*/fifo, which is a FIFO %(named pipe%)",
    }
    local errors = {}
    for name in pairs(says) do errors[name] = helper.error_of(function() fs.write(dir .. "/" .. name, "text") end) end
    local kept = os.execute("cd " .. q .. " && test -p fifo && test -d folder && test -L dangling && test ! -e missing"
      .. " && test -L to_fifo")
    local names = fs.list(dir)
    os.execute("rm -rf " .. q)
    for name, want in pairs(says) do
      assert.matches("^[^:]*fs_spec%.lua:%d+: m3%.fs: cannot write " .. (dir .. "/" .. name):gsub("%p", "%%%0")
        .. ": " .. want .. REPLACED, errors[name])
    end
    assert.equal(0, kept)
    assert.same({ "dangling", "fifo", "folder", "to_fifo" }, names) -- no temporary file either
  end)

  it("writes through a symbolic link (a chain of them) into the file it resolves to, keeping the links", function()
    local dir = helper.tmpdir()
    local q = "'" .. dir .. "'"
    fs.mkdir(dir .. "/real")
    fs.write(dir .. "/real/file", "old")
    os.execute("cd " .. q .. " && ln -s real/file link && ln -s link chain")
    fs.write(dir .. "/chain", "new")
    local links = os.execute("cd " .. q .. " && test -L chain && test -L link && test -f real/file")
    local text, names, real_names = fs.read(dir .. "/real/file"), fs.list(dir), fs.list(dir .. "/real")
    os.execute("rm -rf " .. q)
    assert.equal(0, links)
    assert.equal("new", text)
    assert.same({ "chain", "link", "real" }, names)
    assert.same({ "file" }, real_names) -- the temporary file went beside the file, and is gone
  end)
end)

describe("m3.fs.stat", function()
  it("gives a file's inode and modification time, nil for nothing, and refuses \"\" without an fd", function()
    local dir = helper.tmpdir()
    fs.write(dir .. "/f", "x")
    assert(os.execute("touch -d '2026-01-01 00:00:05' '" .. dir .. "/f'") == 0)
    local st, missing = fs.stat(dir .. "/f"), fs.stat(dir .. "/missing")
    os.execute("rm -rf '" .. dir .. "'")
    assert.same({ os.time { year = 2026, month = 1, day = 1, hour = 0, min = 0, sec = 5 }, 0 }, st.mtime)
    assert.is_true(st.ino > 0)
    assert.is_nil(missing)
    -- statx took "" for the current folder: a table for a path that names nothing
    assert.equal('m3.fs.stat: path is "", which names the open file fd, and no fd was given',
      helper.error_of(fs.stat, ""))
  end)
end)

describe("m3.fs paths", function()
  it("refuses a path that holds a NUL byte (C would take a shorter name) before touching any file", function()
    local dir = helper.tmpdir()
    local path = dir .. "/with\0nul"
    for name, call in pairs {
      write = function() fs.write(path, "x") end, mkdir = function() fs.mkdir(path) end,
      read = function() fs.read(path) end, list = function() fs.list(path) end,
      exists = function() fs.exists(path) end, is_dir = function() fs.is_dir(path) end,
      realpath = function() fs.realpath(path) end,
    } do
      assert.matches("^[^:]*fs_spec%.lua:%d+: m3%.fs%." .. name .. ": path \"[^\"]*/with\\0nul\" holds a NUL byte, "
        .. "which no file name can hold$", helper.error_of(call))
    end
    assert.equal("m3.fs.write: path must be a string, got nil", helper.error_of(fs.write, nil, "x"))
    local names = fs.list(dir)
    os.execute("rm -rf '" .. dir .. "'")
    assert.same({}, names)
  end)
  -- write_together gives all the new files or all the old ones: a new file placed where no old file was is removed
  -- again when a later file cannot be renamed into place
  it("write_together removes a new file it placed where nothing was when a later rename fails", function()
    local dir = helper.tmpdir()
    local first, second = dir .. "/first", dir .. "/second"
    local err = helper.error_of(fs.write_together, {
      { first, function(tmp) fs.write(tmp, "new first") end },
      -- a folder appears at the second path after the check: its rename fails once the first file is in place
      { second, function(tmp) fs.write(tmp, "new second"); fs.mkdir(second) end },
    })
    assert.matches("it is now a folder", err, 1, true)
    assert.is_false(fs.exists(first))
    assert.same({ "second" }, fs.list(dir))
    os.execute("rm -rf '" .. dir .. "'")
  end)

  -- the temporary name beside a file keeps at most 200 bytes of its name, so a name of 255 bytes (the usual limit)
  -- can be written, alone and in a set
  it("writes files whose names have 255 bytes, with write and write_together", function()
    local dir = helper.tmpdir()
    local long = dir .. "/" .. string.rep("a", 254) .. "b"
    local other = dir .. "/" .. string.rep("c", 255)
    fs.write(long, "one")
    assert.equal("one", fs.read(long))
    fs.write_together { { long, function(tmp) fs.write(tmp, "two") end }, { other, function(tmp) fs.write(tmp, "three") end } }
    assert.same({ "two", "three" }, { fs.read(long), fs.read(other) })
    assert.same({ string.rep("a", 254) .. "b", string.rep("c", 255) }, fs.list(dir))
    os.execute("rm -rf '" .. dir .. "'")
  end)
end)

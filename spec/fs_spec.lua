-- m3.fs: listing a folder whose names hold newlines, quotes, spaces and leading dashes or dots;
-- a folder that does not exist and a file list as empty; realpath; write's atomic replace, which
-- an error on the way (an interrupt) leaves without a temporary file.

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

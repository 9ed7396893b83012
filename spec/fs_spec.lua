-- m3.fs: listing a folder whose names hold newlines, quotes, spaces and leading dashes or dots;
-- a folder that does not exist and a file list as empty.

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

-- spec/install_spec.lua — `meson install` of the build folder in use (the one the m3lua under test,
-- helper.m3lua(), was built in):
-- `meson introspect --installed` puts every .lua file under lua/m3 (a folder installed whole
-- covers the files in it) and the generated cdef.lua at <lua_dir>/m3/..., lua_dir being the
-- install location compiled into that folder's m3lua (m3.host.lua_dir), and m3.h under include/;
-- then a staged install (meson install --destdir, well under a second) holds the same bytes,
-- a cdef that names the installed libm3, and every module loads from its Lua folder alone.

local fs = require "m3.fs"
local json = require "m3.json"
local helper = require "spec.helper"

local quote = helper.quote
local M3LUA = helper.m3lua()

-- What the m3lua under test says about itself (source_dir, build_dir, lua_dir).
local function host_field(name)
  local out, code = helper.run(quote(M3LUA) .. " -e " .. quote("io.write(require('m3.host')." .. name .. ")"))
  assert(code == 0, out)
  return out
end

-- The .lua files under dir, as paths relative to it (subfolders too), sorted.
local function lua_files(dir, prefix, out)
  out = out or {}
  for _, name in ipairs(fs.list(dir)) do
    local path, rel = dir .. "/" .. name, (prefix or "") .. name
    if fs.is_dir(path) then
      lua_files(path, rel .. "/", out)
    elseif name:match("%.lua$") then
      out[#out + 1] = rel
    end
  end
  table.sort(out)
  return out
end

-- The module name of a file relative to lua/m3 ("init.lua" -> "m3", "data/file.lua" -> "m3.data.file").
local function module_name(rel)
  return ("m3/" .. rel):gsub("%.lua$", ""):gsub("/init$", ""):gsub("/", ".")
end

describe("meson install", function()
  local source_dir, build_dir, lua_dir, installed, files

  setup(function()
    source_dir, build_dir, lua_dir = host_field("source_dir"), host_field("build_dir"), host_field("lua_dir")
    local out, code = helper.run("meson introspect --installed " .. quote(build_dir))
    assert(code == 0, out)
    installed = json.decode(out)
    files = lua_files(source_dir .. "/lua/m3")
  end)

  -- Where introspect says the file at path goes: its own entry or that of a folder above it.
  local function destination(path)
    if installed[path] then return installed[path] end
    local dir = path:match("^(.*)/[^/]*$")
    while dir and dir ~= "" do
      if installed[dir] then return installed[dir] .. path:sub(#dir + 1) end
      dir = dir:match("^(.*)/[^/]*$")
    end
  end

  it("puts every module under lua/m3 and the generated cdef.lua where the host looks", function()
    assert.truthy(#files > 30, "few modules found under " .. source_dir .. "/lua/m3")
    assert.truthy(fs.is_dir(source_dir .. "/lua/m3/data") and fs.is_dir(source_dir .. "/lua/m3/log"))
    for _, rel in ipairs(files) do
      assert.equal(lua_dir .. "/m3/" .. rel, destination(source_dir .. "/lua/m3/" .. rel), rel)
    end
    local cdef
    for from, to in pairs(installed) do
      if to == lua_dir .. "/m3/cdef.lua" then cdef = from end
    end
    assert.truthy(cdef, "no cdef.lua installed at " .. lua_dir .. "/m3")
    assert.equal(build_dir .. "/", cdef:sub(1, #build_dir + 1)) -- generated, not a source file
  end)

  it("installs the public header m3.h with libm3", function()
    local to = installed[source_dir .. "/engine/include/m3.h"]
    assert.truthy(to and to:match("/include/m3%.h$"), tostring(to))
    assert.truthy(installed[build_dir .. "/engine/src/libm3.so"])
  end)

  it("stages a tree (DESTDIR) from whose Lua folder alone every module loads", function()
    local dest = helper.tmpdir()
    local out, code = helper.run("meson install --no-rebuild -C " .. quote(build_dir) .. " --destdir " .. quote(dest))
    local staged = dest .. lua_dir
    local ok, err = pcall(function()
      assert(code == 0, out)
      for _, rel in ipairs(files) do
        assert.truthy(fs.is_file(staged .. "/m3/" .. rel), rel .. " not installed")
        assert.equal(fs.read(source_dir .. "/lua/m3/" .. rel), fs.read(staged .. "/m3/" .. rel), rel)
      end
      assert.is_false(fs.exists(staged .. "/m3/meson.build"))
      -- plain luajit reaches libm3 through the cdef's library path: the installed one
      local cdef = assert(loadstring(fs.read(staged .. "/m3/cdef.lua")))()
      assert.equal(installed[build_dir .. "/engine/src/libm3.so"], cdef.library)
      local names = {}
      for _, rel in ipairs(files) do names[#names + 1] = ("%q"):format(module_name(rel)) end
      local chunk = table.concat({
        ("local root = %q"):format(staged),
        "package.path = root .. '/?.lua;' .. root .. '/?/init.lua'",
        "local n = 0",
        "for _, name in ipairs{" .. table.concat(names, ", ") .. ", 'm3.cdef'} do",
        "  require(name)",
        "  assert(package.searchpath(name, package.path):sub(1, #root) == root, name)",
        "  n = n + 1",
        "end",
        "io.write('loaded ', n)",
      }, "\n")
      local run_out, run_code = helper.run(quote(M3LUA) .. " -e " .. quote(chunk))
      assert.equal(0, run_code, run_out)
      assert.equal("loaded " .. (#files + 1), run_out)
    end)
    os.execute("rm -rf " .. quote(dest))
    assert(ok, err)
  end)
end)

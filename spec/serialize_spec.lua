-- m3.serialize: checkpoint extras written as a Lua literal and read back: non-finite numbers, key order,
-- cycles and shared tables, what cannot be saved, strings with quotes and backslashes, and the loader taking
-- only `return <literal>`.

local serialize = require "m3.serialize"
local helper = require "spec.helper"

describe("m3.serialize", function()
  it("writes inf, -inf and nan as 1/0, -1/0 and 0/0, and loads them back", function()
    assert.equal("return {1/0, -1/0, 0/0}", (serialize.dump({ 1 / 0, -1 / 0, 0 / 0 }):gsub("%[%d%] = ", "")))
    local back = serialize.load(serialize.dump { a = 1 / 0, b = -1 / 0, c = 0 / 0 })
    assert.equal(math.huge, back.a)
    assert.equal(-math.huge, back.b)
    assert.is_true(back.c ~= back.c)
  end)

  it("writes number keys before string keys, each in ascending order", function()
    assert.equal('return {[-1] = true, [2] = false, [10] = "x", ["a"] = 1, ["b"] = {}}',
      serialize.dump { b = {}, [10] = "x", a = 1, [2] = false, [-1] = true })
  end)

  it("round-trips strings holding quotes and backslashes", function()
    for _, s in ipairs { 'a"b', "a'b", "a\\", '\\"', "x\n\0y" } do
      assert.equal(s, serialize.load(serialize.dump(s)))
      assert.same({ [s] = s }, serialize.load(serialize.dump { [s] = s }))
    end
  end)

  it("refuses a cycle as a cycle, and writes a table reached twice twice", function()
    local t = { a = {} }
    t.a.back = t
    assert.matches("serialize: extra%.a%.back is a cycle %(a table that contains itself%)",
      helper.error_of(serialize.dump, t, "extra"))
    local s = { 1 }
    assert.equal('return {["x"] = {[1] = 1}, ["y"] = {[1] = 1}}', serialize.dump({ x = s, y = s }))
  end)

  it("refuses a table with a metatable and a function, naming the path (\"value\" by default)", function()
    assert.matches("serialize: value%.m has a metatable %(only plain tables can be saved%)",
      helper.error_of(serialize.dump, { m = setmetatable({}, {}) }))
    assert.matches("serialize: value%[2%] is a function", helper.error_of(serialize.dump, { 1, print }))
  end)

  it("loads only `return <literal>`: no names, calls, parentheses or comments", function()
    assert.equal(-1, serialize.load("return-1"))
    assert.equal(-1, serialize.load("return -1"))
    assert.matches("serialize.load: unexpected name `x`", helper.error_of(serialize.load, "return {x = 1}"))
    assert.matches("serialize.load: unexpected name `math`", helper.error_of(serialize.load, "return {[1] = math}"))
    assert.matches("serialize.load: unexpected character `%(`", helper.error_of(serialize.load, "return (1)"))
    assert.matches("serialize.load: long strings and comments are not accepted",
      helper.error_of(serialize.load, "return {1} -- note"))
    -- a comment that would hide a call from the scan behind a quote it holds
    assert.matches("serialize.load: long strings and comments are not accepted",
      helper.error_of(serialize.load, 'return { -- "\n (function() while true do end end)(), -- "\n}'))
  end)
end)

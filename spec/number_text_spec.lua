-- m3.number_text: the exact text of a number, and the writers that share it (m3.json,
-- m3.serialize, safetensors metadata, m3.sweep folder names) all write the same text.

local m3 = require "m3"
local number_text = require "m3.number_text"
local json = require "m3.json"
local serialize = require "m3.serialize"
local sweep = require "m3.sweep"
local helper = require "spec.helper"

local exact = number_text.exact

describe("m3.number_text", function()
  after_each(helper.cleanup)

  it("writes the fewest digits that read back as the same double", function()
    local cases = {
      { 0, "0" }, { -0.0, "-0" }, { 3, "3" }, { -42, "-42" }, { 1e15, "1000000000000000" },
      { 2 ^ 53 - 1, "9007199254740991" }, { 0.1, "0.1" }, { 3e-4, "0.0003" }, { 1e-5, "1e-05" },
      { 1 / 3, "0.3333333333333333" }, { 0.1 + 0.2, "0.30000000000000004" }, { 1e300, "1e+300" },
      { 2 ^ 60, "1.152921504606847e+18" }, { 1 / 0, "inf" }, { -1 / 0, "-inf" },
      -- 15 digits name these (and read back), 16 would not be the fewest: 1e23 is 9.999999999999999e+22,
      -- the least subnormal 4.940656458412465e-324; 14 would be fewer than the documented 15
      { 1e23, "1e+23" }, { 5e-324, "4.94065645841247e-324" }, { -1e23, "-1e+23" },
    }
    for _, c in ipairs(cases) do assert.equal(c[2], exact(c[1])) end
    local r = helper.rng(7)
    for _ = 1, 2000 do
      local v = (r:uniform() - 0.5) * 10 ^ (r:int(40) - 20)
      assert.equal(v, tonumber(exact(v)))
    end
    assert.equal(math.huge, 1 / tonumber(exact(0.0)))
    assert.equal(-math.huge, 1 / tonumber(exact(-0.0)))
  end)

  it("is the text of JSON, m3.serialize, safetensors metadata and sweep folder names", function()
    local path = helper.tmpname(".safetensors")
    for _, v in ipairs { 0.1, 1 / 3, -0.0, 2 ^ 60, 1e15, 12345, 5e-324 } do
      local text = exact(v)
      assert.equal(text, json.encode(v))
      assert.equal("return " .. text, serialize.dump(v, "x"))
      m3.save_tensors(path, { a = { 1 } }, { v = v })
      local _, meta = m3.load_tensors(path)
      assert.equal(text, meta.v)
      assert.equal("v=" .. text, sweep.name({ v = v }, {}))
    end
  end)
end)

-- m3.serialize's own rules (its header comment): the literal it writes, what it refuses and what
-- load takes; checkpoints' extras are in spec/checkpoint_spec.lua.

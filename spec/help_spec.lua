-- m3.help: topic lookup under the spellings the REPL passes, completion, values.

local help = require "m3.help"
local schedule = require "m3.schedule"

describe("m3.help", function()
  it("finds topics under forgiving spellings", function()
    local step = help.text("trainer:step")
    assert.truthy(step:find("tr:step(batch)", 1, true))
    for _, q in ipairs { "tr:step", "trainer.step", "step", "?step", "  ?tr:step() " } do
      assert.equal(step, help.text(q), q)
    end
    assert.equal(help.text("m3.schedule"), help.text("schedule"))
    assert.equal(help.text("schedule.cosine"), help.text("m3.schedule.cosine"))
    assert.equal(help.text("schedule.cosine"), help.text("cosine"))
    assert.truthy(help.text("trainer"):find("m3.trainer(weights_or_config", 1, true))
  end)

  it("suggests topics for unknown names and completes prefixes", function()
    local text, near = help.text("warmup")
    assert.is_nil(text)
    assert.same({ "schedule.linear_warmup", "schedule.warmup_cosine" }, near)
    assert.same({ "data.arithmetic" }, help.complete("data.ar"))
    local all = help.topics()
    assert.truthy(#all > 40)
    for i = 2, #all do assert.is_true(all[i - 1] < all[i]) end
  end)

  it("describes values: m3 functions by name, modules", function()
    assert.equal(help.text("schedule.wsd"), help.text(schedule.wsd))
    assert.equal(help.text("m3.schedule"), help.text(schedule))
  end)

  it("prints", function()
    local real, out = _G.print, {}
    _G.print = function(s) out[#out + 1] = s end
    help.show("?tr:set_lr")
    help.show("nonsense_xyz")
    _G.print = real
    assert.truthy(out[1]:find("tr:set_lr(x)", 1, true))
    assert.truthy(out[2]:find("^no help for nonsense_xyz"))
  end)
end)

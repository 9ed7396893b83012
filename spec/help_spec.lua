-- m3.help: topic lookup under the spellings the REPL passes (a qualified name as a whole, the
-- candidates of an ambiguous short one), completion, values, and a topic for every public name
-- (walked from the live module tables and objects' methods: data sources and generators too).

local help = require "m3.help"
local schedule = require "m3.schedule"
local m3 = require "m3"
local helper = require "spec.helper"

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

  it("has a topic for every public function and method, under the spellings users type", function()
    local missing = {}
    local function need(...)
      for _, q in ipairs { ... } do
        if not help.text(q) then missing[#missing + 1] = q end
      end
    end
    -- m3's exports as init.lua builds them (the live table also holds modules loaded on first use)
    local TENSOR_USER = { new = true, from = true, is = true }
    local exports = dofile((debug.getinfo(m3.cpu_threads, "S").source:gsub("^@", "")))
    for k in pairs(exports) do need("m3." .. k, k) end
    local modules = { "log", "log.svg", "pytorch", "schedule", "accumulate", "checkpoint", "fit", "curriculum", "data",
      "data.rng", "sampling", "sweep", "tensor", "infer", "trainer" }
    for _, name in ipairs(modules) do
      local mod = m3
      for part in name:gmatch("[^.]+") do mod = mod[part] end
      need("m3." .. name, name)
      for k, v in pairs(mod) do
        if type(v) == "function" and (name ~= "tensor" or TENSOR_USER[k]) then
          need(name .. "." .. k, "m3." .. name .. "." .. k)
        end
      end
    end
    -- m3.tensor's and m3.weights' functions for users were walked or are here (tensor.wrap, view, coerce,
    -- cast, ... and weights.wrap, ptr, ... serve the binding and are not walked)
    need("weights.init", "m3.weights.init", "weights.load", "m3.weights.load", "weights.is")
    local w = m3.weights.init(m3.config(helper.tokens_lm()), { seed = 1 })
    local text = helper.tmpname(".txt")
    local f = assert(io.open(text, "wb"))
    f:write(string.rep("fables ", 20))
    f:close()
    local objects = { -- kind, the usual variable name, an object
      { "trainer", "tr", m3.trainer(w, { device = "cpu", batch = 1, seq_len = 4 }) },
      { "infer", "inf", m3.infer(w, { device = "cpu" }) },
      { "weights", "w", w },
      { "source", "src", m3.data.parity {} },
      { "source", "src", m3.data.mixture { m3.data.parity {}, m3.data.mqar {} } },
      { "source", "src", m3.data.text(text, { length = 8 }) },
      { "rng", "r", m3.data.rng.new(1) },
    }
    for _, o in ipairs(objects) do
      local kind = o[1]
      need(kind)
      local about = help.text(kind) or ""
      local listed = about:match("methods: (.-)\n%S") or about:match("methods: (.*)") or ""
      for k, v in pairs(getmetatable(o[3]).__index) do
        if type(v) == "function" and not k:match("^_") then
          need(kind .. ":" .. k, o[2] .. ":" .. k, kind .. "." .. k)
          if not (" " .. listed:gsub("%s+", " ") .. " "):find(" " .. k .. " ", 1, true) then
            missing[#missing + 1] = "?" .. kind .. " lists no " .. k
          end
        end
      end
      if o[3].close then o[3]:close() end
    end
    -- objects whose module topic lists their methods: each method has a topic under the usual variable name
    local others = {
      { "tensor", "t", { "shape", "numel", "dtype", "to_table", "clone" } },
      { "checkpoint", "ck", m3.checkpoint.new { dir = helper.tmpname("") } },
      { "curriculum", "cur", m3.curriculum.new { { length = 4 } } },
      { "sampling", "s", m3.sampling.new(1) },
    }
    for _, o in ipairs(others) do
      local list = o[3]
      if getmetatable(list) then
        local mt = getmetatable(list).__index
        list = {}
        for k, v in pairs(mt) do
          if type(v) == "function" and not k:match("^_") then list[#list + 1] = k end
        end
      end
      for _, k in ipairs(list) do need(o[1] .. ":" .. k, o[2] .. ":" .. k) end
    end
    helper.cleanup()
    table.sort(missing)
    assert.same({}, missing)
  end)

  it("matches a qualified name as a whole, and lists the topics a short name could mean", function()
    -- the last name alone would find another module's function: log.svg.write, m3.trainer.load
    for _, q in ipairs { "fs.write", "json.write", "m3.fs.write", "?fs.write", "serialize.load", "data.next" } do
      local text, near = help.text(q)
      assert.is_nil(text, q)
      assert.same({}, near, q)
    end
    assert.equal(help.text("log.svg.write"), help.text("svg.write"))
    assert.equal(help.text("log.svg.write"), help.text("m3.log.svg.write"))
    assert.equal(help.text("trainer:load"), help.text("trainer.load"))
    assert.equal(help.text("trainer:load"), help.text("m3.trainer.load"))
    assert.equal(help.text("data.rng.new"), help.text("rng.new"))
    local text, near = help.text("new")
    assert.is_nil(text)
    assert.same({ "checkpoint.new", "curriculum.new", "data.rng.new", "infer.new", "sampling.new", "tensor.new",
      "trainer.new" }, near)
    assert.same({ "checkpoint.resume", "checkpoint:resume", "fit.resume" }, select(2, help.text("resume")))
    assert.equal(help.text("trainer:step"), help.text("step")) -- a trainer method's name: the trainer's
  end)

  it("describes data sources and their generator: topics, methods and values", function()
    local src, r = m3.data.parity {}, m3.data.rng.new(1)
    assert.truthy(help.text("src:next"):find("src:next(rows, opts)", 1, true))
    for _, q in ipairs { "source:next", "source.next", "next", "?src:next()" } do
      assert.equal(help.text("src:next"), help.text(q), q)
    end
    assert.equal(help.text("source:count"), help.text("count"))
    assert.equal(help.text("source:slice"), help.text("slice"))
    assert.equal(help.text("rng:below"), help.text("r:below"))
    assert.equal(help.text("data.rng"), help.text("rng"))
    assert.equal(help.text("data.rng"), help.text("m3.data.rng"))
    assert.equal(help.text("source"), help.text(src))
    assert.equal(help.text("data.rng"), help.text(r))
    assert.equal(help.text("data.rng"), help.text(m3.data.rng))
    assert.equal(help.text("data.rng.new"), help.text(m3.data.rng.new))
  end)

  it("finds no topic for a function a known module lacks", function()
    assert.is_nil((help.text("checkpoint.nope")))
    assert.truthy(help.text("?weights:get"):find("w:get(name)", 1, true))
    assert.equal(help.text("weights:get"), help.text("w:get"))
    assert.equal(help.text("log.jsonl"), help.text("m3.log.jsonl"))
    assert.equal(help.text("weights"), help.text("m3.weights"))
    assert.equal(help.text("log.svg.write"), help.text(m3.log.svg.write))
    assert.equal(help.text("m3.cpu_threads"), help.text(m3.cpu_threads))
  end)

  it("has no stale topic: each names a function, method or value the loaded modules have", function()
    local w = m3.weights.init(m3.config(helper.tokens_lm()), { seed = 1 })
    local text = helper.tmpname(".txt")
    local f = assert(io.open(text, "wb"))
    f:write(string.rep("fables ", 20))
    f:close()
    local objects = { -- a topic's kind before ":" -> an object whose methods it describes
      trainer = m3.trainer(w, { device = "cpu", batch = 1, seq_len = 4 }),
      infer = m3.infer(w, { device = "cpu" }),
      weights = w,
      source = m3.data.parity {},
      file_source = m3.data.text(text, { length = 8 }), -- count, offset, slice: the file sources'
      rng = m3.data.rng.new(1),
      tensor = m3.tensor({ 2 }),
      checkpoint = m3.checkpoint.new { dir = helper.tmpname("") },
      curriculum = m3.curriculum.new { { length = 4 } },
      sampling = m3.sampling.new(1),
    }
    local kinds = { source = true } -- topics about a kind of object, not a value of m3
    local stale = {}
    for _, topic in ipairs(help.topics()) do
      local kind, method = topic:match("^([%w_]+):([%w_]+)$")
      local found
      if kind then
        local o = objects[kind]
        found = o ~= nil and type(o[method]) == "function"
          or kind == "source" and type(objects.file_source[method]) == "function"
          or kind == "trainer" and type(m3.trainer[method]) == "function" -- trainer:load is m3.trainer.load
      elseif kinds[topic] or topic == "m3" then
        found = true
      else
        local v = m3
        for part in topic:gsub("^m3%.", ""):gmatch("[^.]+") do
          v = type(v) == "table" and v[part] or nil
        end
        found = v ~= nil
      end
      if not found then stale[#stale + 1] = topic end
    end
    objects.trainer:close()
    objects.infer:close()
    helper.cleanup()
    assert.same({}, stale)
  end)
end)

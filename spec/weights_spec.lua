-- m3.weights: deterministic init, views that share memory, set with checks, names in
-- layout order, bit-exact save/load, save refusing what load refuses (NaN, infinities), paths
-- holding a NUL byte refused, clone, close.

local ffi = require "ffi"
local m3 = require "m3"
local helper = require "spec.helper"

describe("m3.weights", function()
  after_each(helper.cleanup)

  local cfg = helper.features_none()

  it("initialises deterministically from the seed", function()
    local a = m3.weights.init(cfg, { seed = 7 })
    local b = m3.weights.init(cfg, { seed = 7 })
    local c = m3.weights.init(cfg, { seed = 8 })
    assert.is_true(helper.same_weights(a, b))
    assert.is_false(helper.same_weights(a, c))
    assert.is_true(helper.same_weights(m3.weights.init(cfg), m3.weights.init(cfg, { seed = 0 })))
    assert.matches("seed = %-1", helper.error_of(m3.weights.init, cfg, { seed = -1 }))
    assert.matches("unknown option", helper.error_of(m3.weights.init, cfg, { sed = 1 }))
  end)

  it("shares one seed rule with the trainer, the sampler, the data sources and sweeps", function()
    local inf = m3.infer(m3.weights.init(helper.tokens_lm()), { device = "cpu" })
    local takers = {
      -- no tail calls: the message carries this file's line
      ["m3.weights.init"] = function(seed) m3.weights.init(cfg, { seed = seed }) end,
      ["m3.trainer"] = function(seed) m3.trainer(cfg, { device = "cpu", batch = 1, seq_len = 4, seed = seed }) end,
      ["generate"] = function(seed) inf:generate({ 1 }, 1, { seed = seed }) end,
      ["m3.data.parity"] = function(seed) m3.data.parity { seed = seed } end,
      ["m3.sweep"] = function(seed)
        require("m3.sweep") { random = { a = { 1 } }, trials = 1, seed = seed, dir = helper.tmpdir(),
          run = function() return { loss = 0 } end }
      end,
    }
    for what, take in pairs(takers) do
      for _, seed in ipairs { false, "1", -1, 1.5, 2 ^ 53, 0 / 0, ffi.new("uint64_t", 1) } do
        local err = helper.error_of(take, seed)
        assert.matches("weights_spec%.lua:%d+: [^:]*" .. what:gsub("%.", "%%.") .. ": seed = ", err)
        assert.matches(": seed = [^:]*: expected an integer in %[0, 2%^53%)$", err)
      end
      take(2 ^ 53 - 1)
    end
  end)

  it("follows SPEC.md §2 init rules for the constant tensors", function()
    local w = m3.weights.init(cfg, { seed = 1 })
    local ones = w:get("layers.0.norm.weight")
    for i = 0, ones:numel() - 1 do assert.equal(1, ones[i]) end
    local bias = w:get("input_proj.bias")
    for i = 0, bias:numel() - 1 do assert.equal(0, bias[i]) end
    local b = w:get("layers.1.mixer.B_bias")
    assert.same({ 4, 1, 8 }, b:shape())
    local inp = w:get("layers.0.mixer.in_proj.weight")
    local bound = 1 / math.sqrt(16)
    for i = 0, inp:numel() - 1 do assert.is_true(math.abs(inp[i]) <= bound) end
  end)

  it("creates zeros and lists names in layout order", function()
    local w = m3.weights.create(cfg)
    local names = w:names()
    assert.equal("input_proj.weight", names[1])
    assert.equal("input_proj.bias", names[2])
    assert.equal("layers.0.norm.weight", names[3])
    assert.equal("norm_f.weight", names[#names])
    local total = 0
    for _, n in ipairs(names) do
      local t = w:get(n)
      total = total + t:numel()
      for i = 0, t:numel() - 1 do assert.equal(0, t[i]) end
    end
    assert.equal(w.config.n_params, total)
    assert.equal(total, w:numel())
    assert.equal(5, w.config.input_dim)
  end)

  it("keeps its own config: changing w.config changes nothing numel, tostring or an export reports", function()
    local w = m3.weights.init(helper.tokens_lm(), { seed = 2 })
    local n, text, layers = w:numel(), tostring(w), w.config.n_layers
    w.config.n_params, w.config.d_model, w.config.n_layers, w.config.vocab_size = 7, 999, 40, 3
    assert.equal(n, w:numel())
    assert.equal(text, tostring(w))
    local dir = helper.tmpname("-export")
    m3.pytorch.export(w, dir)
    local conf = m3.json.decode(m3.fs.read(dir .. "/config.json"))
    os.execute("rm -rf '" .. dir .. "'")
    assert.equal(layers, conf.n_layer)
    assert.equal(w:get("embedding.weight"):shape()[1], conf.vocab_size)
    assert.equal(7, w.config.n_params) -- the user's copy keeps what was written into it
    assert.equal(n, w:clone().config.n_params)
  end)

  it("gives views that share memory and keep the weights alive", function()
    local w = m3.weights.init(cfg, { seed = 1 })
    local v = w:get("norm_f.weight")
    v[3] = 42
    assert.equal(42, w:get("norm_f.weight")[3])
    w = nil -- luacheck: ignore
    collectgarbage()
    collectgarbage()
    assert.equal(42, v[3])
    v[0] = 1
  end)

  it("sets tensors with shape and dtype checks", function()
    local w = m3.weights.create(cfg)
    w:set("norm_f.weight", m3.tensor.from({ 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16 }))
    assert.equal(16, w:get("norm_f.weight")[15])
    local d = m3.tensor({ 4 }, "f64")
    d[2] = 0.1
    w:set("layers.0.mixer.D", d)
    assert.equal(ffi.cast("float", 0.1), ffi.cast("float", w:get("layers.0.mixer.D")[2]))
    local flat = {}
    for i = 1, 32 do flat[i] = i end
    w:set("layers.0.mixer.B_bias", flat)
    assert.equal(32, w:get("layers.0.mixer.B_bias")[31])
    w:set("layers.1.mixer.D", ffi.new("float[4]", 1, 2, 3, 4))
    assert.equal(4, w:get("layers.1.mixer.D")[3])
    w:set("layers.1.mixer.D", { data = ffi.new("double[4]", 5, 6, 7, 8), shape = { 4 } })
    assert.equal(8, w:get("layers.1.mixer.D")[3])
    assert.matches("expected f32 %[4%], got ctype<float %[3%]>",
      helper.error_of(function() w:set("layers.1.mixer.D", ffi.new("float[3]")) end))
    local err = helper.error_of(function() w:set("norm_f.weight", m3.tensor({ 15 })) end)
    assert.matches('weights:set%("norm_f.weight"%): expected f32 %[16%], got f32 %[15%]', err)
    assert.matches("weights_spec.lua:%d+:", err)
    assert.matches("got i32", helper.error_of(function() w:set("norm_f.weight", m3.tensor({ 16 }, "i32")) end))
    assert.matches('no tensor named "norm_f.weigth"', helper.error_of(function() w:get("norm_f.weigth") end))
    assert.matches('did you mean "norm_f.weight"', helper.error_of(function() w:get("norm_f.weigth") end))
  end)

  it("refuses pointers, whose size the FFI cannot tell, and names the tensor of an f64 value float32 cannot hold",
    function()
    local w = m3.weights.create(cfg)
    local four = ffi.new("float[4]", 1, 2, 3, 4)
    assert.matches('weights:set%("layers.1.mixer.D"%): data is a pointer %(ctype<float %*>%), whose size the FFI '
      .. "cannot tell: pass an FFI array", helper.error_of(function()
        w:set("layers.1.mixer.D", { data = ffi.cast("float *", four), shape = { 4 } })
      end))
    assert.matches('weights:set%("layers.1.mixer.D"%): got a pointer %(ctype<float %*>%)',
      helper.error_of(function() w:set("layers.1.mixer.D", ffi.cast("float *", four)) end))
    local d = m3.tensor({ 4 }, "f64")
    d[3] = 1e300
    assert.matches('weights:set%("layers.1.mixer.D"%): converting to f32: element 3 = 1e%+300 is outside '
      .. "float32's range",
      helper.error_of(function() w:set("layers.1.mixer.D", d) end))
    assert.equal(0, w:get("layers.1.mixer.D")[0])
  end)

  it("saves and loads bit-exactly, with and without a config", function()
    local w = m3.weights.init(cfg, { seed = 3 })
    local path = helper.tmpname(".safetensors")
    w:save(path)
    local a = m3.weights.load(path)
    local b = m3.weights.load(path, cfg)
    assert.is_true(helper.same_weights(w, a))
    assert.is_true(helper.same_weights(w, b))
    assert.same(w.config, a.config)
    local tensors = m3.load_tensors(path)
    assert.equal(helper.bytes(w:get("layers.1.mixer.in_proj.weight")),
      helper.bytes(tensors["layers.1.mixer.in_proj.weight"]))
    assert.matches("m3: ", helper.error_of(m3.weights.load, path, helper.features_none({ d_state = 16 })))
    assert.matches("m3: ", helper.error_of(m3.weights.load, "/nonexistent.safetensors"))
  end)

  it("refuses a weights file of its own format whose config lacks a member (a damaged name)", function()
    local tied = m3.config(helper.tokens_lm({ tie_embeddings = true }))
    local path = helper.tmpname(".safetensors")
    m3.weights.init(tied, { seed = 4 }):save(path)
    local tensors, meta = m3.load_tensors(path)
    meta.config = meta.config:gsub('"head"', '"jead"')
    m3.save_tensors(path, tensors, meta)
    assert.matches('the "config" metadata lacks "head" %(a file of format m3lua%-weights%-1 states every member%)',
      helper.error_of(m3.weights.load, path))
    assert.is_true(m3.weights.load(path, tied) ~= nil) -- the caller's config still loads it
    meta.format = nil -- another writer's file: members it leaves out take their defaults
    m3.save_tensors(path, tensors, meta)
    assert.equal("none", m3.weights.load(path).config.head)
  end)

  it("names a trainer checkpoint given as a weights file, and a file without a config", function()
    local tr = m3.trainer(cfg, { device = "cpu", batch = 1, seq_len = 4 })
    local ckpt = helper.tmpname(".ckpt")
    tr:save(ckpt)
    local want = "is a trainer checkpoint %(format m3lua%-checkpoint%-1%), not a weights file"
    assert.matches(want, helper.error_of(m3.weights.load, ckpt))
    assert.is_true(helper.same_weights(tr:snapshot(), m3.infer.load_weights(ckpt))) -- m3.infer(path) takes one
    local path = helper.tmpname(".safetensors")
    local tensors = m3.load_tensors(ckpt)
    m3.save_tensors(path, { ["norm_f.weight"] = tensors["param.norm_f.weight"] })
    assert.matches('has no "config" metadata: pass the model config along with the path',
      helper.error_of(m3.weights.load, path))
  end)

  it("refuses a file that lacks the tensors of its config's model before allocating that model", function()
    -- a few bytes whose config names a model of about 2^47 parameters: more than any address space holds
    local big = { d_model = 2 ^ 22, n_layers = 1, d_state = 16, headdim = 64, input = "tokens",
                  vocab_size = 2 ^ 24, head = "lm" }
    local path = helper.tmpname(".safetensors")
    m3.save_tensors(path, {}, { config = require("m3.json").encode(big) })
    local want = "missing tensor embedding.weight %(shape %[16777216, 4194304%]%)"
    assert.matches(want, helper.error_of(m3.weights.load, path))
    assert.matches(want, helper.error_of(m3.weights.load, path, m3.config(big)))
    assert.matches(want, helper.error_of(m3.infer, path))
  end)

  -- a tensor is found under its SPEC.md name or with the "backbone." prefix of the PyTorch model: the message
  -- says that both were looked for
  it("names both names it looked for a missing tensor under", function()
    local w = m3.weights.init(cfg)
    local path = helper.tmpname(".safetensors")
    w:save(path)
    local tensors, metadata = m3.load_tensors(path)
    tensors["norm_f.weight"] = nil
    m3.save_tensors(path, tensors, metadata)
    assert.matches("missing tensor norm_f%.weight %(shape %[16%]%): the file has neither norm_f%.weight nor "
      .. "backbone%.norm_f%.weight", helper.error_of(m3.weights.load, path))
  end)

  it("names m3.weights.load and its cfg when that is not a config table", function()
    local path = helper.tmpname(".safetensors")
    m3.weights.init(cfg):save(path)
    assert.equal('m3.weights.load: cfg = "x": expected a config (a table), or nil for the file\'s own',
      helper.error_of(m3.weights.load, path, "x"))
    assert.equal("m3.weights.load: cfg = weights (w.config is theirs): expected a config (a table), or nil for the "
      .. "file's own", helper.error_of(m3.weights.load, path, m3.weights.load(path)))
  end)

  it("names a weights object passed for a config, and a seed given as a string", function()
    local w = m3.weights.init(cfg)
    assert.matches("m3.weights: expected a config, got weights", helper.error_of(m3.weights.init, w))
    assert.matches("m3.weights: expected a config, got weights", helper.error_of(m3.weights.create, w))
    assert.matches('seed = "1": expected an integer', helper.error_of(m3.weights.init, cfg, { seed = "1" }))
  end)

  it("converts F64 files and values as F32 ones: NaN is refused, a finite value beyond float32 is an error", function()
    local w = m3.weights.init(cfg, { seed = 3 })
    local tensors, meta = m3.load_tensors((w:save(helper.tmpname(".safetensors"))))
    local wide = m3.tensor.cast(tensors["norm_f.weight"], "f64")
    wide[2] = 0 / 0
    tensors["norm_f.weight"] = wide
    local path = helper.tmpname(".safetensors")
    m3.save_tensors(path, tensors, meta)
    assert.matches("weights_spec.lua:%d+: m3: [^\n]+%.safetensors: weights: norm_f.weight %[2%] = nan: "
      .. "expected a finite value", helper.error_of(function() m3.weights.load(path) end))
    wide[2] = 1
    wide[0] = 1e300
    m3.save_tensors(path, tensors, meta)
    assert.matches("norm_f.weight: element 0 is 1e%+300, outside float32's range", helper.error_of(m3.weights.load, path))
    assert.matches("element 0 = 1e%+300 is outside float32's range",
      helper.error_of(function() w:set("norm_f.weight", wide) end))
  end)

  it("refuses to save a NaN or an infinity, in the words load refuses them in, writing nothing", function()
    local w = m3.weights.init(cfg, { seed = 3 })
    local path = helper.tmpname(".safetensors")
    for _, case in ipairs { { 0 / 0, "nan" }, { 1 / 0, "inf" }, { -1 / 0, "%-inf" } } do
      w:get("norm_f.weight")[2] = case[1]
      assert.matches("^[^:]*weights_spec%.lua:%d+: m3: saving " .. path:gsub("%p", "%%%0") .. ": weights: "
        .. "norm_f%.weight %[2%] = " .. case[2] .. ": expected a finite value",
        helper.error_of(function() w:save(path) end))
      assert.is_nil(io.open(path))
    end
  end)

  it("refuses a path holding a NUL byte, to save and to load (C would take the name before it)", function()
    local w = m3.weights.init(cfg)
    local path = helper.tmpname()
    w:save(path) -- the file the cut name reaches
    local cut = path .. "\0.safetensors"
    for what, call in pairs { ["weights:save"] = function() w:save(cut) end,
                              ["m3.weights.load"] = function() m3.weights.load(cut) end } do
      assert.matches("^[^:]*weights_spec%.lua:%d+: " .. what:gsub("%p", "%%%0") .. ': path "'
        .. path:gsub("%p", "%%%0") .. '\\0%.safetensors" holds a NUL byte, which no file name can hold$',
        helper.error_of(call))
    end
  end)

  it("loads the backbone. prefix", function()
    local w = m3.weights.init(cfg, { seed = 4 })
    local tensors = {}
    for _, n in ipairs(w:names()) do tensors["backbone." .. n] = w:get(n) end
    local path = helper.tmpname(".safetensors")
    m3.save_tensors(path, tensors)
    assert.is_true(helper.same_weights(w, m3.weights.load(path, cfg)))
  end)

  it("clones into independent memory", function()
    local w = m3.weights.init(cfg, { seed = 5 })
    local c = w:clone()
    assert.is_true(helper.same_weights(w, c))
    c:get("norm_f.weight")[0] = -1
    assert.equal(1, w:get("norm_f.weight")[0])
  end)

  it("set refuses a value whose metamethod closes the weights while it is read, writing nothing", function()
    local ffi = require "ffi"
    local w = m3.weights.init(cfg)
    local values = ffi.new("float[?]", w:get("norm_f.weight"):numel())
    local v = setmetatable({ data = values }, { __index = function(_, k)
      if k == "shape" then
        w:close()
        return { ffi.sizeof(values) / 4 }
      end
    end })
    assert.matches("weights are closed", helper.error_of(w.set, w, "norm_f.weight", v))
  end)

  it("closes idempotently and refuses later calls", function()
    local w = m3.weights.init(cfg)
    assert.matches("m3.weights: %d+ tensors", tostring(w))
    w:close()
    w:close()
    assert.matches("closed", tostring(w))
    for _, call in ipairs({
      function() w:get("norm_f.weight") end, function() w:names() end, function() w:clone() end,
      function() w:save(helper.tmpname()) end, function() w:set("norm_f.weight", {}) end, function() w:numel() end,
    }) do
      assert.matches("weights are closed", helper.error_of(call))
    end
    assert.matches("weights are closed", helper.error_of(m3.trainer, w, { device = "cpu" }))
    for _, name in ipairs { "close", "names" } do -- close raised "attempt to index local 'box'"
      assert.matches("^[^:]*weights_spec%.lua:%d+: m3%.weights: expected a weights object %(call methods with ':'%), "
          .. "got {}$",
        helper.error_of(function() w[name]({}) end), name)
    end
  end)

  -- close frees the arena at once only when no view is alive (header of m3.weights): a view taken before close keeps
  -- its values after close and collection. Run as a program under glibc's MALLOC_PERTURB_, which fills freed memory
  -- with a byte pattern, so a view into a freed arena reads that pattern instead of passing by chance.
  it("keeps a view's values after close and collection (freed memory poisoned)", function()
    local script = helper.tmpname(".lua")
    local f = assert(io.open(script, "w"))
    f:write([[
local m3 = require "m3"
local w = m3.weights.init({ d_model = 16, n_layers = 2, d_state = 8, headdim = 8, input = "features", input_dim = 5,
  head = "none" }, { seed = 1 })
local v = w:get("norm_f.weight")
for i = 0, 15 do v[i] = i + 0.5 end
w:close()
w = nil
collectgarbage()
collectgarbage()
for i = 0, 15 do assert(v[i] == i + 0.5, "view element " .. i .. " = " .. tostring(v[i])) end
print("view kept")
]])
    f:close()
    local out, code = helper.run("MALLOC_PERTURB_=165 timeout 20 " .. helper.quote(helper.m3lua()) .. " "
      .. helper.quote(script))
    assert.equal(0, code, out)
    assert.equal("view kept\n", out)
  end)

  -- d_model and n_layers are required (m3.config, SPEC.md §1): the Lua check names the field before the engine sees it
  it("names a missing n_layers or d_model as required", function()
    assert.matches("m3.config: n_layers is required", helper.error_of(m3.weights.create, { d_model = 16 }), 1, true)
    assert.matches("m3.config: d_model is required", helper.error_of(m3.weights.create, { n_layers = 1 }), 1, true)
  end)

  -- d_state and headdim differ here, so each is read from its own field
  it("reports d_state and headdim in tostring", function()
    local w = m3.weights.create(helper.features_none({ d_state = 16, headdim = 8 }))
    assert.matches("d_state 16, headdim 8,", tostring(w), 1, true)
  end)

  -- a flat Lua list is taken as the tensor's values only when it holds exactly numel of them
  it("refuses a flat list with another count of values for a tensor of two or more dimensions", function()
    local w = m3.weights.create(cfg)
    local shape = w:get("layers.0.mixer.B_bias"):shape()
    assert.is_true(#shape >= 2)
    local flat = {}
    for i = 1, 31 do flat[i] = i end
    assert.matches('weights:set%("layers.0.mixer.B_bias"%): expected f32 %[',
      helper.error_of(function() w:set("layers.0.mixer.B_bias", flat) end))
    for i = 0, 31 do assert.equal(0, w:get("layers.0.mixer.B_bias")[i]) end
  end)

  it("keeps a view usable after close", function()
    local w = m3.weights.init(cfg)
    local v = w:get("norm_f.weight")
    w:close()
    collectgarbage()
    assert.equal(1, v[0])
  end)
end)

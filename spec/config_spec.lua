-- m3.config, m3.presets, m3.preset, m3.config_from_json: defaults, derived sizes (n_params
-- against the weights), JSON round trips, the error text of unknown fields, type errors and
-- every SPEC.md §1 rule; the C API's config and info calls given NULL outputs.

local m3 = require "m3"
local helper = require "spec.helper"

local function base(over)
  local t = { d_model = 16, n_layers = 2, headdim = 8, input = "identity" }
  for k, v in pairs(over or {}) do t[k] = v end
  return t
end

describe("m3.config", function()
  it("fills defaults and derived sizes into a new table", function()
    local src = { d_model = 64, n_layers = 2, input = "identity" }
    local c = m3.config(src)
    assert.are_not.equal(src, c)
    assert.is_nil(src.d_state)
    assert.equal(128, c.d_state)
    assert.equal(2, c.expand)
    assert.equal(64, c.headdim)
    assert.equal(1, c.ngroups)
    assert.equal(0.5, c.rope_fraction)
    assert.equal(1e-4, c.a_floor)
    assert.is_false(c.outproj_norm)
    assert.equal("none", c.head)
    assert.is_true(c.tie_embeddings)
    assert.equal(128, c.d_inner)
    assert.equal(2, c.nheads)
    assert.equal("features", m3.config({ d_model = 64, n_layers = 2, input_dim = 3 }).input)
  end)

  it("counts n_params as the weights hold them and survives JSON unchanged, for every input, head and tie", function()
    local config = require "m3.config"
    for _, input in ipairs({ "features", "identity", "tokens" }) do
      for _, head in ipairs({ "none", "lm", "mse" }) do
        for _, tie in ipairs({ true, false }) do
          for _, rope_fraction in ipairs({ 0, 0.5, 1 }) do
            local c = m3.config({ d_model = 12, n_layers = 2, d_state = 10, expand = 3, headdim = 6, ngroups = 2,
              rope_fraction = rope_fraction, a_floor = 1e-4 / 3, outproj_norm = tie, input = input, head = head,
              input_dim = input == "features" and 5 or nil, out_dim = head == "mse" and 7 or nil,
              vocab_size = (input == "tokens" or head == "lm") and 11 or nil,
              tie_embeddings = tie and (head ~= "lm" or input == "tokens") })
            local w, total = m3.weights.init(c, { seed = 1 }), 0
            for _, name in ipairs(w:names()) do total = total + w:get(name):numel() end
            assert.equal(total, c.n_params)
            assert.same(c, m3.config_from_json(config.to_json(c)))
          end
        end
      end
    end
  end)

  it("derives d_inner, nheads, num_rope_angles, in_proj_dim and n_params (SPEC.md §1)", function()
    local c = m3.config({ d_model = 16, n_layers = 2, d_state = 16, headdim = 8, input = "identity" })
    assert.equal(32, c.d_inner)
    assert.equal(4, c.nheads)
    assert.equal(4, c.num_rope_angles)
    assert.equal(2 * 32 + 2 * 16 + 3 * 4 + 4, c.in_proj_dim)
    -- per layer: norm, in_proj, dt_bias, B_bias, C_bias, B_norm, C_norm, D, out_proj; then norm_f
    local layer = 16 + c.in_proj_dim * 16 + 4 + 4 * 16 * 2 + 16 * 2 + 4 + 16 * 32
    assert.equal(2 * layer + 16, c.n_params)
    assert.equal(3, m3.config(base({ d_state = 12, headdim = 8 })).num_rope_angles)
    assert.equal(0, m3.config(base({ d_state = 16, headdim = 8, rope_fraction = 0 })).num_rope_angles)
    assert.equal(8, m3.config(base({ d_state = 16, headdim = 8, rope_fraction = 1.0 })).num_rope_angles)
  end)

  it("accepts its own output back, and rejects derived fields that do not match", function()
    local c = m3.config(base({ headdim = 8 }))
    assert.same(c, m3.config(c))
    local wrong = {}
    for k, v in pairs(c) do wrong[k] = v end
    wrong.d_model = 32
    local err = helper.error_of(m3.config, wrong)
    assert.matches("d_inner = 32 does not match", err)
  end)

  it("names an unknown field, suggests the closest name and lists the valid ones", function()
    local err = helper.error_of(function() local _ = m3.config(base({ d_modle = 3 })) end)
    assert.matches('unknown field "d_modle"', err)
    assert.matches('did you mean "d_model"%?', err)
    assert.matches("valid fields: d_model, n_layers, d_state", err)
    assert.matches("config_spec.lua:%d+:", err)
  end)

  it("names field, value and expected type on type errors", function()
    assert.matches("n_layers = 1.5: expected an integer", helper.error_of(m3.config, base({ n_layers = 1.5 })))
    assert.matches('d_state = "8": expected an integer', helper.error_of(m3.config, base({ d_state = "8" })))
    assert.matches("outproj_norm = 1: expected a boolean", helper.error_of(m3.config, base({ outproj_norm = 1 })))
    assert.matches('rope_fraction = "half": expected a number',
      helper.error_of(m3.config, base({ rope_fraction = "half" })))
    assert.matches('input = "feature": expected one of "features", "identity", "tokens"',
      helper.error_of(m3.config, base({ input = "feature" })))
    assert.matches('head = "ce": expected one of "none", "lm", "mse"', helper.error_of(m3.config, base({ head = "ce" })))
    assert.matches("d_model is required", helper.error_of(m3.config, { n_layers = 1, input = "identity" }))
    -- int32's range is [-2^31, 2^31 - 1]: -2^31 is one, and breaks the rule >= 1 (the engine names it)
    assert.matches("d_model = 2147483648: expected an integer %(int32%)",
      helper.error_of(m3.config, base({ d_model = 2 ^ 31 })))
    assert.matches("m3: d_model = %-2147483648: must be an integer in %[1, 16777216%]",
      helper.error_of(m3.config, base({ d_model = -2 ^ 31 })))
    assert.matches("d_model = %-2147483649: expected an integer %(int32%)",
      helper.error_of(m3.config, base({ d_model = -2 ^ 31 - 1 })))
    assert.matches("expected a table", helper.error_of(m3.config, 3))
    -- every digit of the value: a computed 8.000000000000002 is not shown as the integer 8
    assert.matches("headdim = 8.000000000000002: expected an integer",
      helper.error_of(m3.config, base({ headdim = 0.1 * 3 * 10 * 8 / 3 })))
  end)

  it("reports each rule with the field, the value and the rule", function()
    local cases = {
      { { d_model = 0 }, "d_model = 0" },
      { { n_layers = 0 }, "n_layers = 0" },
      { { d_state = 0 }, "d_state = 0: must be an integer in %[1, 16777216%]" },
      { { d_state = 2 ^ 24 + 1 }, "d_state = 16777217: must be an integer in %[1, 16777216%]" },
      { { d_model = 2 ^ 24 + 1 }, "d_model = 16777217: must be an integer in %[1, 16777216%]" },
      { { n_layers = 4097 }, "n_layers = 4097: must be an integer in %[1, 4096%]" },
      { { expand = 65 }, "expand = 65: must be an integer in %[1, 64%]" },
      { { expand = 0 }, "expand = 0" },
      { { headdim = 0 }, "headdim = 0" },
      { { headdim = 5 }, "headdim = 5: must divide d_inner" },
      { { headdim = 8, ngroups = 3 }, "ngroups = 3: must divide nheads" },
      { { ngroups = 0 }, "ngroups = 0" },
      { { rope_fraction = 0.3 }, "rope_fraction = 0.3: must be one of 0, 0.5, 1" },
      { { a_floor = 0 }, "a_floor = 0: must be" },
      { { a_floor = -1 }, "a_floor = %-1" },
      { { input = "features" }, "input_dim = 0: input \"features\" needs" },
      { { input = "tokens" }, "vocab_size = 0" },
      { { head = "lm", vocab_size = 10 }, "tie_embeddings = true" },
      { { head = "mse" }, "out_dim = 0: head \"mse\" needs" },
    }
    for _, case in ipairs(cases) do
      local err = helper.error_of(function() local _ = m3.config(base(case[1])) end)
      assert.matches(case[2], err)
      assert.matches("^.-config_spec.lua:%d+: m3: ", err)
    end
  end)

  it("refuses a model with more than 2^53 parameters instead of wrapping n_params", function()
    local huge = { input = "identity", d_model = 2 ^ 24, expand = 1, headdim = 1, d_state = 2 ^ 14, ngroups = 2 ^ 14 }
    for _, n_layers in ipairs({ 1024, 4096 }) do
      huge.n_layers = n_layers
      local err = helper.error_of(m3.config, huge)
      assert.matches("the model has about %d[%.%d]*e%+19 parameters %(d_model = 16777216, n_layers = " .. n_layers, err)
      assert.matches("at most 2%^53 = 9007199254740992", err)
    end
    -- the engine's other doors: config JSON and weights from a C struct
    local json = '{"input": "identity", "d_model": 16777216, "expand": 1, "headdim": 1, "n_layers": 1024, '
      .. '"d_state": 16384, "ngroups": 16384}'
    assert.matches("the model has about", helper.error_of(m3.config_from_json, json))
    local ffi = require "ffi"
    local C = require("m3.lib").C
    local c = ffi.new("m3_config")
    C.m3_config_defaults(c)
    c.input, c.d_model, c.expand, c.headdim, c.n_layers, c.d_state, c.ngroups = 1, 2 ^ 24, 1, 1, 1024, 2 ^ 14, 2 ^ 14
    assert.equal(C.M3_ERR_CONFIG, C.m3_weights_create(c, ffi.new("m3_weights *[1]")))
    assert.matches("the model has about", ffi.string(C.m3_last_error()))
  end)

  it("accepts each kind of input and head", function()
    assert.equal("features", m3.config(base({ input = "features", input_dim = 3 })).input)
    local lm = m3.config(base({ input = "tokens", vocab_size = 10, head = "lm" }))
    assert.equal(10, lm.vocab_size)
    local untied = m3.config(base({ head = "lm", vocab_size = 10, tie_embeddings = false }))
    assert.is_false(untied.tie_embeddings)
    assert.equal(4, m3.config(base({ head = "mse", out_dim = 4 })).out_dim)
  end)
end)

describe("m3.presets / m3.preset", function()
  it("holds rl, mid and lm130", function()
    local rl = m3.presets.rl
    assert.same({ 128, 4, 16, 16, "identity", "none" },
      { rl.d_model, rl.n_layers, rl.d_state, rl.headdim, rl.input, rl.head })
    local mid = m3.presets.mid
    assert.same({ 256, 8, 64, 32, "identity", "none" },
      { mid.d_model, mid.n_layers, mid.d_state, mid.headdim, mid.input, mid.head })
    local lm = m3.presets.lm130
    assert.same({ 768, 24, 128, 64, "tokens", "lm", 50280, true },
      { lm.d_model, lm.n_layers, lm.d_state, lm.headdim, lm.input, lm.head, lm.vocab_size, lm.tie_embeddings })
    assert.is_true(lm.n_params > 100e6 and lm.n_params < 200e6)
  end)

  it("applies overrides and validates", function()
    local c = m3.preset("rl", { n_layers = 2, d_state = 32 })
    assert.equal(2, c.n_layers)
    assert.equal(32, c.d_state)
    assert.equal(128, c.d_model)
    assert.equal(m3.presets.rl.n_params, m3.preset("rl").n_params)
    assert.matches('unknown preset "lm13"', helper.error_of(m3.preset, "lm13"))
    assert.matches('did you mean "lm130"', helper.error_of(m3.preset, "lm13"))
    assert.matches("headdim = 7", helper.error_of(m3.preset, "rl", { headdim = 7 }))
  end)

  it("hands out copies: changing what a lookup gave changes no later lookup", function()
    local rl = m3.presets.rl
    rl.d_model = 7
    m3.presets.rl.n_layers = 99
    m3.presets.mid = nil
    m3.presets.extra = { d_model = 8, n_layers = 1 }
    require("m3.config").presets.rl.d_state = 3
    assert.same({ 128, 4, 16 }, { m3.presets.rl.d_model, m3.presets.rl.n_layers, m3.presets.rl.d_state })
    assert.same({ 128, 4, 16 }, { m3.preset("rl").d_model, m3.preset("rl").n_layers, m3.preset("rl").d_state })
    assert.equal(128, require("m3.config").presets.rl.d_model)
    assert.is_nil(m3.presets.extra)
    assert.matches('unknown preset "extra"', helper.error_of(m3.preset, "extra"))
    local names = {}
    for name, c in pairs(m3.presets) do
      names[#names + 1] = name
      assert.same(m3.preset(name), c)
    end
    table.sort(names)
    assert.same({ "lm130", "mid", "rl" }, names)
  end)
end)

describe("m3.config_from_json", function()
  it("reads SPEC.md names and ignores unknown keys", function()
    local c = m3.config_from_json('{"d_model": 16, "n_layers": 1, "d_state": 8, "headdim": 8, "input": "tokens", '
      .. '"vocab_size": 7, "head": "lm", "outproj_norm": true, "batch": 2, "seq_len": 5}')
    assert.equal(16, c.d_model)
    assert.is_true(c.outproj_norm)
    assert.equal("lm", c.head)
    assert.equal(7, c.vocab_size)
    assert.equal(m3.config(c).n_params, c.n_params)
  end)

  it("reports malformed JSON and broken rules", function()
    assert.matches("m3: ", helper.error_of(m3.config_from_json, "{"))
    -- text after the object (a near miss of a name in it would otherwise go unchecked)
    assert.matches("config JSON does not parse as an object",
      helper.error_of(m3.config_from_json, '{"d_model": 16, "n_layers": 1, "headdim": 8, "d_stat": 8} junk'))
    assert.equal(16, m3.config_from_json('{"d_model": 16, "n_layers": 1, "headdim": 8, "input": "identity"} \n').d_model)
    assert.matches("headdim = 5", helper.error_of(m3.config_from_json, '{"d_model": 16, "n_layers": 1, "headdim": 5}'))
    assert.matches('m3.config_from_json: json.decode: a key given twice: "d_model"', helper.error_of(m3.config_from_json,
      '{"d_model": 16, "n_layers": 1, "headdim": 8, "input": "identity", "d_model": 32}'), 1, true)
    assert.equal(16, m3.config_from_json('\239\187\191{"d_model": 16, "n_layers": 1, "headdim": 8, "input": "identity"}')
      .d_model)
    assert.matches("d_model = 3000000000: must be an integer in %[%-2147483647, 2147483647%]",
      helper.error_of(m3.config_from_json, '{"d_model": 3e9, "n_layers": 1}'))
  end)

  it("refuses a near miss of a field's name, a derived size that does not match and booleans for integers", function()
    local base = '{"d_model": 16, "n_layers": 1, "input": "identity", "headdim": 8, '
    assert.matches('unknown member "d_stat" %(did you mean "d_state"%?%)',
      helper.error_of(m3.config_from_json, base .. '"d_stat": 8}'))
    assert.matches("d_inner = 999 does not match the value the fields give %(32%)",
      helper.error_of(m3.config_from_json, base .. '"d_inner": 999}'))
    assert.matches("d_model must be an integer", helper.error_of(m3.config_from_json,
      '{"d_model": true, "n_layers": 1, "input": "identity", "expand": 16, "headdim": 8, "d_state": 4}'))
    assert.matches("outproj_norm must be true or false", helper.error_of(m3.config_from_json, base .. '"outproj_norm": 2}'))
    local c = m3.config_from_json(base .. '"d_inner": 32, "outproj_norm": 1}')
    assert.is_true(c.outproj_norm)
  end)
end)

describe("the C API's configuration and info calls", function()
  it("refuse or ignore NULL outputs instead of writing through them", function()
    local ffi = require "ffi"
    local C = require("m3.lib").C
    local c = ffi.new("m3_config")
    C.m3_config_defaults(c)
    c.d_model, c.n_layers, c.headdim, c.input = 16, 1, 8, 1
    assert.equal(1, C.m3_config_derive(c, nil)) -- M3_ERR_ARGUMENT
    assert.matches("out is NULL", ffi.string(C.m3_last_error()))
    local d = ffi.new("m3_config_derived")
    assert.equal(0, C.m3_config_derive(c, d))
    assert.equal(32, d.d_inner)
    C.m3_config_defaults(nil)
    C.m3_trainer_cfg_defaults(nil)
    C.m3_infer_cfg_defaults(nil)
    local cfg = m3.config { d_model = 16, n_layers = 1, d_state = 8, headdim = 8, input = "tokens", vocab_size = 11,
      head = "lm" }
    local tr = m3.trainer(cfg, { device = "cpu", batch = 1, seq_len = 4 })
    local inf = m3.infer(tr:snapshot(), { device = "cpu" })
    C.m3_trainer_get_info(tr._box.p, nil)
    C.m3_infer_get_info(inf._box.p, nil)
    assert.equal(1, tr:batch())
    C.m3_sampler_seed(1, 0, nil)
  end)

  it("give no JSON for a config that breaks a rule (not the JSON of another model)", function()
    local ffi = require "ffi"
    local C = require("m3.lib").C
    local c = ffi.new("m3_config")
    C.m3_config_defaults(c)
    c.d_model, c.n_layers, c.headdim, c.input = 16, 1, 8, 1
    assert.matches('"input": "identity"', ffi.string(C.m3_config_to_json(c)))
    c.input, c.head = 7, -3
    assert.equal("", ffi.string(C.m3_config_to_json(c)))
    assert.matches("input = 7", ffi.string(C.m3_last_error()))
    assert.equal("", ffi.string(C.m3_config_to_json(nil)))
  end)
end)

describe("m3.options", function()
  local options = require "m3.options"

  it("shows a plain table by its first four items, and ... for anything more", function()
    assert.equal("{1, 2, 3, 4}", options.show { 1, 2, 3, 4 })
    assert.equal("{1, 2, 3, 4, ...}", options.show { 1, 2, 3, 4, 5 })
    assert.equal('{1, "x", {...}, ...}', options.show { 1, "x", { 2 }, name = 3 })
    assert.equal("{...}", options.show { a = 1 })
  end)

  it("names what keeps a table from being a list, a key 0 too", function()
    assert.equal("the key 0", options.not_a_list { [0] = 1, 2 })
    assert.equal("nil at [2]", options.not_a_list { 1, [3] = 3 })
    assert.is_nil(options.not_a_list { 1, 2 })
  end)

  it("takes cuda:N for any N of an int32, and no more", function()
    assert.same({ options.DEVICE_CUDA, 2147483647 }, { options.parse_device("cuda:2147483647", "t") })
    local ok, err = pcall(options.parse_device, "cuda:2147483648", "t")
    assert.is_false(ok)
    assert.matches('t: device = "cuda:2147483648": the index must be below 2%^31', err)
  end)
end)

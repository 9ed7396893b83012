-- m3.states: the per-layer state tables of trainers and inference objects (angle [B,H,S], ssm [B,H,P,N],
-- k [B,H,N], v [B,H,P]) checked and converted, with P and N distinct so that a swapped shape shows.

local m3 = require "m3"

describe("m3.states", function()
  local states = require "m3.states"
  local cfg = { n_layers = 2, nheads = 2, headdim = 3, d_state = 5, num_rope_angles = 4 }

  local function layer(fill)
    local function t(shape)
      local x = m3.tensor(shape)
      for i = 0, x:numel() - 1 do x.data[i] = fill end
      return x
    end
    return { angle = t { 1, 2, 4 }, ssm = t { 1, 2, 3, 5 }, k = t { 1, 2, 5 }, v = t { 1, 2, 3 } }
  end

  local function err_of(f, ...)
    local ok, err = pcall(f, ...)
    assert.is_false(ok)
    return tostring(err)
  end

  it("reads one table per layer: angle [B, H, S], ssm [B, H, P, N], k [B, H, N], v [B, H, P]", function()
    local layers = {}
    local got = states.read(cfg, 1, function(l) layers[#layers + 1] = l end)
    assert.same({ 0, 1 }, layers)
    assert.equal(2, #got)
    assert.same({ 1, 2, 4 }, got[1].angle:shape())
    assert.same({ 1, 2, 3, 5 }, got[1].ssm:shape())
    assert.same({ 1, 2, 5 }, got[1].k:shape())
    assert.same({ 1, 2, 3 }, got[2].v:shape())
  end)

  it("writes every layer once all are checked, and refuses a wrong count, rank or a non-finite value", function()
    local set = {}
    states.write(cfg, 1, { layer(1), layer(2) }, function(l, _, _, _, v) set[#set + 1] = { l, v[0] } end)
    assert.same({ { 0, 1 }, { 1, 2 } }, set)
    set = {}
    local record = function(l) set[#set + 1] = l end
    assert.matches("expected a list of 2 layer tables", err_of(states.write, cfg, 1, { layer(1), layer(1), layer(1) },
      record))
    local bad = layer(1)
    bad.angle = m3.tensor { 1, 2, 4, 1 }
    assert.matches("set_states: states%[2%]%.angle: expected f32 %[1, 2, 4%]", err_of(states.write, cfg, 1,
      { layer(1), bad }, record))
    bad = layer(1)
    bad.v.data[2] = -1 / 0
    assert.matches("set_states: states%[2%]%.v%[2%] = %-inf: not finite %(no layer was set%)",
      err_of(states.write, cfg, 1, { layer(1), bad }, record))
    assert.same({}, set)
  end)

  it("takes reset rows as a list of 0-based indices", function()
    assert.same({ nil, 0 }, { states.rows(nil, "reset") })
    local arr, n = states.rows({ 0, 2 }, "reset")
    assert.same({ 2, 0, 2 }, { n, arr[0], arr[1] })
    assert.matches("reset: rows%[1%] = %-1: expected an integer >= 0", err_of(states.rows, { -1 }, "reset"))
    assert.matches("reset: rows must be a list of 0%-based row indices, got a table with key \"a\"",
      err_of(states.rows, { a = 1 }, "reset"))
  end)
end)

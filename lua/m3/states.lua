-- m3.states — the recurrent state as Lua sees it (API.md, SPEC.md §4), shared by the trainer
-- and the inference object: a list with one {angle=, ssm=, k=, v=} table of float32 tensors
-- per layer, batch first: [B, H, S], [B, H, P, N], [B, H, N], [B, H, P].
--
--   states.read(cfg, B, get)          get(layer0, angle, ssm, k, v) fills one layer (pointers)
--   states.write(cfg, B, s, set)      checks every layer's shapes and values first, then set(layer0, ...)
--   states.rows(rows, what)           a reset's rows (nil: all) as C arguments: int32_t array, count

local ffi = require "ffi"
local lib = require "m3.lib"
local tensor = require "m3.tensor"
local options = require "m3.options"

lib.internal_file(debug.getinfo(1, "S").source)

local raise = lib.raise

local states = {}

local KEYS = { "angle", "ssm", "k", "v" }

local function shapes(cfg, B)
  local H, P, N, S = cfg.nheads, cfg.headdim, cfg.d_state, cfg.num_rope_angles
  return { angle = { B, H, S }, ssm = { B, H, P, N }, k = { B, H, N }, v = { B, H, P } }
end

-- A list with one {angle=, ssm=, k=, v=} table of new tensors per layer.
function states.read(cfg, B, get)
  local sh, out = shapes(cfg, B), {}
  for l = 1, cfg.n_layers do
    local s = {}
    for _, k in ipairs(KEYS) do s[k] = tensor(sh[k]) end
    get(l - 1, s.angle.data, s.ssm.data, s.k.data, s.v.data)
    out[l] = s
  end
  return out
end

-- Sets every layer from a list as read() returns (f64 tensors and nested tables accepted); a bad
-- shape or a non-finite value anywhere raises before any layer is set.
function states.write(cfg, B, list, set)
  local L = cfg.n_layers
  if type(list) ~= "table" or #list ~= L then
    raise(string.format("set_states: expected a list of %d layer tables {angle=, ssm=, k=, v=}, got %s", L,
      type(list) == "table" and "a list of " .. #list or type(list)))
  end
  local sh, ready = shapes(cfg, B), {}
  for l = 1, L do
    local s = list[l]
    if type(s) ~= "table" then raise(string.format("set_states: states[%d]: expected a table {angle=, ssm=, k=, v=}", l)) end
    for k in pairs(s) do
      if not sh[k] then raise(string.format("set_states: states[%d].%s: unknown field (valid: angle, ssm, k, v)", l, tostring(k))) end
    end
    local r = {}
    for _, k in ipairs(KEYS) do
      local what = string.format("set_states: states[%d].%s", l, k)
      local want = "f32 " .. tensor.format_shape(sh[k])
      if s[k] == nil then raise(what .. ": missing (" .. want .. ")") end
      local t = tensor.coerce(s[k], what, "f32", sh[k], want)
      local have, same = t:shape(), t:dtype() == "f32" or t:dtype() == "f64"
      same = same and #have == #sh[k]
      for d = 1, #sh[k] do same = same and have[d] == sh[k][d] end
      if not same then raise(string.format("%s: expected %s, got %s", what, want, options.describe(t))) end
      r[k] = t:dtype() == "f64" and tensor.cast(t, "f32", what) or t
      for i = 0, r[k]:numel() - 1 do
        local v = r[k].data[i]
        if v ~= v or v == math.huge or v == -math.huge then
          raise(string.format("%s[%d] = %s: not finite (no layer was set)", what, i, tostring(v)))
        end
      end
    end
    ready[l] = r
  end
  for l = 1, L do
    local r = ready[l]
    set(l - 1, r.angle.data, r.ssm.data, r.k.data, r.v.data)
  end
end

-- The rows a reset names: nil (all rows) -> nil, 0; a list of 0-based row indices -> an int32_t
-- array and its length. `what` names the call in errors (the C side checks the range).
function states.rows(rows, what)
  if rows == nil then return nil, 0 end
  if type(rows) ~= "table" then raise(what .. ": rows must be a list of 0-based row indices, got " .. type(rows)) end
  for k in pairs(rows) do
    if type(k) ~= "number" or k < 1 or k > #rows or k ~= math.floor(k) then
      raise(string.format("%s: rows must be a list of 0-based row indices, got a table with key %s", what,
        options.show(k)))
    end
  end
  local arr = ffi.new("int32_t[?]", math.max(#rows, 1))
  for i = 1, #rows do arr[i - 1] = options.want_int(rows[i], what .. ": rows[" .. i .. "]", 0) end
  return arr, #rows
end

return states

-- m3.config — the model configuration of SPEC.md §1 as a Lua table.
--
-- config.validate(t) checks names and Lua types here (unknown fields, with the closest
-- valid name; integers, booleans, the input/head kinds), then lets the engine check the
-- rules (m3_config_validate names field, value and rule) and derive the sizes. The result
-- is a new table with every field (defaults filled) plus d_inner, nheads, num_rope_angles,
-- in_proj_dim and n_params; feeding it back in is accepted (derived fields must match).
-- Also: copies, conversion to and from the C struct, JSON, and the named presets.

local ffi = require "ffi"
local lib = require "m3.lib"
local json = require "m3.json"
local number_text = require "m3.number_text"

lib.internal_file(debug.getinfo(1, "S").source)

local C, check, raise = lib.C, lib.check, lib.raise

local config = {}

local input_kinds = { "features", "identity", "tokens" }
local head_kinds = { "none", "lm", "mse" }

-- name, kind ("int" | "number" | "bool" | "enum"), enum names
local FIELDS = {
  { "d_model", "int" }, { "n_layers", "int" }, { "d_state", "int" }, { "expand", "int" },
  { "headdim", "int" }, { "ngroups", "int" }, { "rope_fraction", "number" },
  { "a_floor", "number" }, { "outproj_norm", "bool" }, { "input", "enum", input_kinds },
  { "head", "enum", head_kinds }, { "tie_embeddings", "bool" }, { "input_dim", "int" },
  { "vocab_size", "int" }, { "out_dim", "int" },
}
local DERIVED = { "d_inner", "nheads", "num_rope_angles", "in_proj_dim", "n_params" }
local REQUIRED = { "d_model", "n_layers" }

local field_kind, derived_set, all_names = {}, {}, {}
for _, f in ipairs(FIELDS) do
  field_kind[f[1]] = f
  all_names[#all_names + 1] = f[1]
end
for _, name in ipairs(DERIVED) do
  derived_set[name] = true
  all_names[#all_names + 1] = name
end

config.fields = FIELDS
config.derived_fields = DERIVED

-- ---- messages --------------------------------------------------------------------------------

local show = number_text.shown -- text quoted, numbers with every digit

local function distance(a, b)
  local prev = {}
  for j = 0, #b do prev[j] = j end
  for i = 1, #a do
    local cur = { [0] = i }
    for j = 1, #b do
      local cost = a:byte(i) == b:byte(j) and 0 or 1
      cur[j] = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
    end
    prev = cur
  end
  return prev[#b]
end

-- " (did you mean "x"?)" for the closest of names, when it is close enough.
function config.suggest(name, names)
  local best, best_d
  for _, n in ipairs(names) do
    local d = distance(name:lower(), n:lower())
    if not best_d or d < best_d then best, best_d = n, d end
  end
  if best and best_d <= math.max(2, math.floor(#name / 3)) then
    return string.format(" (did you mean %q?)", best)
  end
  return ""
end

-- ---- Lua-side checks -------------------------------------------------------------------------

local function check_value(name, v)
  local f = field_kind[name]
  local kind = f[2]
  if kind == "int" then
    if type(v) ~= "number" or v ~= math.floor(v) or v < -2147483648 or v > 2147483647 then
      raise(string.format("m3.config: %s = %s: expected an integer (int32)", name, show(v)))
    end
  elseif kind == "number" then
    if type(v) ~= "number" then raise(string.format("m3.config: %s = %s: expected a number", name, show(v))) end
  elseif kind == "bool" then
    if type(v) ~= "boolean" then
      raise(string.format("m3.config: %s = %s: expected a boolean (true or false)", name, show(v)))
    end
  else
    for _, n in ipairs(f[3]) do
      if v == n then return end
    end
    raise(string.format("m3.config: %s = %s: expected one of \"%s\"", name, show(v), table.concat(f[3], "\", \"")))
  end
end

local function index_of(list, v)
  for i, x in ipairs(list) do
    if x == v then return i end
  end
end

-- ---- C struct ----------------------------------------------------------------------------------

local function fill_c(t)
  local c = ffi.new("m3_config")
  C.m3_config_defaults(c)
  for _, f in ipairs(FIELDS) do
    local name, kind, v = f[1], f[2], t[f[1]]
    if v ~= nil then
      if kind == "bool" then
        c[name] = v and 1 or 0
      elseif kind == "enum" then
        c[name] = index_of(f[3], v) - 1
      else
        c[name] = v
      end
    end
  end
  return c
end

-- The validated Lua table of a C config (a pointer or a struct).
function config.from_c(c)
  check(C.m3_config_validate(c))
  local d = ffi.new("m3_config_derived")
  check(C.m3_config_derive(c, d))
  local t = {}
  for _, f in ipairs(FIELDS) do
    local name, kind = f[1], f[2]
    if kind == "bool" then
      t[name] = c[name] ~= 0
    elseif kind == "enum" then
      t[name] = f[3][c[name] + 1]
    else
      t[name] = tonumber(c[name])
    end
  end
  t.d_inner, t.nheads = tonumber(d.d_inner), tonumber(d.nheads)
  t.num_rope_angles, t.in_proj_dim = tonumber(d.num_rope_angles), tonumber(d.in_proj_dim)
  t.n_params = tonumber(d.n_params)
  return t
end

-- ---- public ------------------------------------------------------------------------------------

-- m3.config(t): a new, validated table with defaults and derived sizes.
function config.validate(t)
  if type(t) ~= "table" then raise("m3.config: expected a table, got " .. type(t)) end
  for k, v in pairs(t) do
    if type(k) ~= "string" then
      raise(string.format("m3.config: unexpected key %s (fields are named: %s)", show(k), table.concat(all_names, ", ")))
    end
    if field_kind[k] then
      check_value(k, v)
    elseif not derived_set[k] then
      raise(string.format("m3.config: unknown field %q%s; valid fields: %s", k, config.suggest(k, all_names),
        table.concat(all_names, ", ")))
    end
  end
  for _, name in ipairs(REQUIRED) do
    if t[name] == nil then raise(string.format("m3.config: %s is required (an integer >= 1)", name)) end
  end
  local c = fill_c(t)
  local out = config.from_c(c)
  for _, name in ipairs(DERIVED) do
    local v = t[name]
    if v ~= nil and v ~= out[name] then
      raise(string.format("m3.config: %s = %s does not match the value derived from the other fields (%s); "
        .. "derived fields are computed, drop it when changing the config", name, show(v), show(out[name])))
    end
  end
  return out
end

-- A new table with the fields of config t (a config is flat: the copy shares nothing with t).
function config.copy(t)
  local c = {}
  for k, v in pairs(t) do c[k] = v end
  return c
end

-- The m3_config struct of a Lua config table (validated on the way).
function config.to_c(t)
  return fill_c(config.validate(t))
end

-- m3.config_from_json(text): the engine's reader, which passes over members it does not know (files carry
-- more than the config); one that is a near miss of a field's name is a typo, not extra information. A text
-- the engine reads but m3.json refuses (a key given twice, of which the engine would take one; bytes that are
-- not UTF-8) is an error with m3.json's message.
function config.from_json(str)
  if type(str) ~= "string" then raise("m3.config_from_json: expected a JSON string, got " .. type(str)) end
  local ok, members = pcall(json.decode, str)
  if ok and type(members) == "table" then
    for k in pairs(members) do
      if type(k) == "string" and not field_kind[k] and not derived_set[k] then
        local hint = config.suggest(k, all_names)
        if hint ~= "" then raise(string.format("m3.config_from_json: unknown member %q%s", k, hint)) end
      end
    end
  end
  local c = ffi.new("m3_config")
  check(C.m3_config_from_json(str, c))
  if not ok then raise("m3.config_from_json: " .. tostring(members)) end
  return config.from_c(c)
end

function config.to_json(t)
  return ffi.string(C.m3_config_to_json(config.to_c(t)))
end

-- ---- presets -------------------------------------------------------------------------------------

-- The definitions stay private: every lookup builds new tables from them, so that a script
-- changing what it got changes no later lookup.
local PRESETS = {
  rl = { d_model = 128, n_layers = 4, d_state = 16, headdim = 16, input = "identity", head = "none" },
  mid = { d_model = 256, n_layers = 8, d_state = 64, headdim = 32, input = "identity", head = "none" },
  lm130 = { d_model = 768, n_layers = 24, d_state = 128, headdim = 64, input = "tokens", head = "lm",
            vocab_size = 50280 },
}

-- m3.preset(name, overrides): the named preset with overrides applied, validated.
function config.preset(name, overrides)
  local base = PRESETS[name]
  if not base then
    local names = {}
    for k in pairs(PRESETS) do names[#names + 1] = k end
    table.sort(names)
    raise(string.format("m3.preset: unknown preset %s%s; presets: %s", show(name),
      type(name) == "string" and config.suggest(name, names) or "", table.concat(names, ", ")))
  end
  if type(overrides) ~= "nil" and type(overrides) ~= "table" then
    raise("m3.preset: overrides must be a table, got " .. type(overrides))
  end
  local t = {}
  for k, v in pairs(base) do t[k] = v end
  for k, v in pairs(overrides or {}) do t[k] = v end
  return config.validate(t)
end

-- config.presets (m3.presets): name -> validated config, a new table of new configs at each
-- access.
setmetatable(config, {
  __index = function(_, key)
    if key ~= "presets" then return nil end
    local all = {}
    for name in pairs(PRESETS) do all[name] = config.preset(name) end
    return all
  end,
})

return config

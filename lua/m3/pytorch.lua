-- m3.pytorch — interchange with the public PyTorch Mamba-3 language model (mamba_ssm's
-- MambaLMHeadModel with ssm_cfg.layer = "Mamba3"): a folder holding config.json and
-- model.safetensors.
--
--   m3.pytorch.export(weights, dir)   writes the folder ("tokens" input, "lm" head only)
--                                     → dir, the number of tensors model.safetensors holds
--   m3.pytorch.import(dir)            → weights (float32; F16/BF16/F64 files are converted)
--   m3.pytorch.config_json(cfg)       → the config.json table of an m3 config
--   m3.pytorch.config_from_json(t, dir) → the m3 config of a config.json table
-- Bad arguments (a dir that is a file, a missing folder, a model the public LM cannot hold,
-- weights holding a NaN or an infinity, which import would refuse: export then writes nothing)
-- raise at the caller's line, naming the function and what is wrong. export replaces the two
-- files as one set (m3.fs.write_together): when either cannot be written (a folder named
-- config.json, a full disk, an interrupt) the folder keeps its old pair, never a new
-- model.safetensors beside an old config.json. import names
-- <dir>/config.json in the errors of its fields: d_model, n_layer and vocab_size are
-- required; a field left out takes the public model's default, and an error about the
-- config or model.safetensors lists the defaults taken. Every error of import begins with
-- "m3.pytorch.import: " (an interrupt excepted, raised as the engine raises it); a folder with
-- the public save_pretrained's pytorch_model.bin (a pickle) instead of model.safetensors is told
-- how to write one.
--
-- model.safetensors holds float32 tensors under the public names: SPEC.md §2 names with the
-- "backbone." prefix (backbone.embedding.weight, backbone.layers.{i}.norm.weight,
-- backbone.layers.{i}.mixer.*, backbone.norm_f.weight) and lm_head.weight, written even when
-- tied (the public state_dict lists the tied tensor under both names; the importer ignores
-- it when it equals the embedding). Metadata: format = "pt" and m3's own config JSON.
-- config.json has the MambaConfig fields (d_model, d_intermediate = 0, n_layer, vocab_size,
-- ssm_cfg, rms_norm, residual_in_fp32, fused_add_norm, pad_vocab_size_multiple = 1 so the
-- vocabulary keeps its size, tie_embeddings) with ssm_cfg = {layer = "Mamba3", d_state,
-- expand, headdim, ngroups, rope_fraction, A_floor, is_outproj_norm, is_mimo = false}.
-- An export followed by an import gives the same bits.

local lib = require "m3.lib"
local config = require "m3.config"
local weights = require "m3.weights"
local tensors_io = require "m3.tensors_io"
local json = require "m3.json"
local fs = require "m3.fs"
local options = require "m3.options"

lib.internal_file(debug.getinfo(1, "S").source)

local raise, show = lib.raise, options.show

local pytorch = {}

-- cfg validated (m3.config), once its model is one the public LM holds.
local function lm_config(cfg, what)
  cfg = config.validate(cfg)
  if cfg.input ~= "tokens" or cfg.head ~= "lm" then
    raise(string.format('%s: the public LM needs input "tokens" and head "lm"; this model has input %q and head %q',
      what, cfg.input, cfg.head))
  end
  return cfg
end

-- The config.json table of an m3 config.
function pytorch.config_json(cfg)
  cfg = lm_config(cfg, "m3.pytorch.config_json")
  return {
    d_model = cfg.d_model,
    d_intermediate = 0,
    n_layer = cfg.n_layers,
    vocab_size = cfg.vocab_size,
    ssm_cfg = {
      layer = "Mamba3",
      d_state = cfg.d_state,
      expand = cfg.expand,
      headdim = cfg.headdim,
      ngroups = cfg.ngroups,
      rope_fraction = cfg.rope_fraction,
      A_floor = cfg.a_floor,
      is_outproj_norm = cfg.outproj_norm,
      is_mimo = false,
    },
    attn_layer_idx = json.array(),
    attn_cfg = {},
    rms_norm = true,
    residual_in_fp32 = true,
    fused_add_norm = true,
    pad_vocab_size_multiple = 1,
    tie_embeddings = cfg.tie_embeddings,
  }
end

-- where: the prefix of config_from_json's messages (the file import read, or the function's own name).
local function want(cond, where, msg)
  if not cond then raise(where .. ": " .. msg) end
end

-- v is absent: nil, or JSON's null.
local function absent(v) return v == nil or v == json.null end

-- The config.json fields without a default that fits a given file (the public ones are a 2.8B model's).
local REQUIRED = { "d_model", "n_layer", "vocab_size" }

-- "; <whose> leaves out <fields>" for the fields that took the public model's defaults, "" when none did.
local function left_out(defaulted, whose)
  if #defaulted == 0 then return "" end
  return string.format("; %s leaves out %s", whose, table.concat(defaulted, ", "))
end

-- The m3 config of a config.json table (fields the LM loader needs; the rest must agree), and the fields the
-- table leaves out with the public model's default each took (for the message when the weights do not fit).
local function from_json(t, dir)
  if dir ~= nil and type(dir) ~= "string" then
    raise("m3.pytorch.config_from_json: dir = " .. show(dir) .. ": expected the folder's path (for messages)")
  end
  local where = dir and string.format("m3.pytorch.import: %s/config.json", dir) or "m3.pytorch.config_from_json"
  local array = type(t) == "table" and getmetatable(t) == getmetatable(json.array()) -- as json.decode gives one
  want(type(t) == "table" and t ~= json.null and not array, where,
    "expected a JSON object, got " .. (array and "an array" or show(t)))
  local s = t.ssm_cfg
  want(type(s) == "table" and s.layer == "Mamba3", where, 'ssm_cfg.layer must be "Mamba3" (a Mamba-3 model)')
  want(absent(s.is_mimo) or s.is_mimo == false, where,
    "ssm_cfg.is_mimo = " .. show(s.is_mimo) .. ": m3lua trains the SISO layer only (false or absent)")
  want(absent(t.d_intermediate) or t.d_intermediate == 0, where,
    "d_intermediate = " .. show(t.d_intermediate) .. ": must be 0 (no MLP blocks)")
  local attn = t.attn_layer_idx
  want(absent(attn) or (type(attn) == "table" and next(attn) == nil), where,
    "attn_layer_idx = " .. (type(attn) == "table" and "a non-empty table" or show(attn))
    .. ": must be an empty list (no attention layers)")
  want(absent(t.rms_norm) or t.rms_norm == true, where, "rms_norm = " .. show(t.rms_norm) .. ": must be true")
  for _, key in ipairs(REQUIRED) do want(t[key] ~= nil, where, key .. " is required") end
  local defaulted = {}
  local mult = t.pad_vocab_size_multiple
  if absent(mult) then mult = 8 end
  want(type(mult) == "number" and mult >= 1 and mult == math.floor(mult) and mult < 2 ^ 31, where,
    "pad_vocab_size_multiple = " .. show(mult) .. ": must be an integer >= 1")
  local vocab = t.vocab_size
  if type(vocab) == "number" and vocab % mult ~= 0 then
    vocab = vocab + mult - vocab % mult -- the public model pads the vocabulary the same way
    if absent(t.pad_vocab_size_multiple) then
      defaulted[#defaulted + 1] = string.format(
        "pad_vocab_size_multiple (the public default 8 pads vocab_size %s to %s)", show(t.vocab_size), show(vocab))
    end
  end
  local function opt(owner, key, default)
    if owner[key] ~= nil then return owner[key] end
    defaulted[#defaulted + 1] = string.format("%s%s (the public default %s)", owner == s and "ssm_cfg." or "", key,
      show(default))
    return default
  end
  local ok, cfg = pcall(config.validate, {
    d_model = t.d_model, n_layers = t.n_layer, vocab_size = vocab, input = "tokens", head = "lm",
    tie_embeddings = opt(t, "tie_embeddings", true),
    d_state = opt(s, "d_state", 128), expand = opt(s, "expand", 2), headdim = opt(s, "headdim", 64),
    ngroups = opt(s, "ngroups", 1), rope_fraction = opt(s, "rope_fraction", 0.5), a_floor = opt(s, "A_floor", 1e-4),
    outproj_norm = opt(s, "is_outproj_norm", false),
  })
  if not ok then raise(where .. ": " .. cfg .. left_out(defaulted, dir and "it" or "the table")) end
  return cfg, defaulted
end

function pytorch.config_from_json(t, dir)
  return (from_json(t, dir))
end

-- "name [i] = value" for the first NaN or infinity of the weights (in the words m3.weights.load refuses it in), or
-- nil when every value is finite.
local function first_nonfinite(w)
  for _, name in ipairs(w:names()) do
    local t = w:get(name)
    local p = t.data
    for i = 0, t:numel() - 1 do
      if p[i] - p[i] ~= 0 then return string.format("%s [%d] = %s", name, i, tostring(p[i])) end
    end
  end
end

function pytorch.export(w, dir)
  if not weights.is(w) then raise("m3.pytorch.export: expected weights (m3.weights), got " .. type(w)) end
  if type(dir) ~= "string" or dir == "" then raise("m3.pytorch.export: expected a folder path, got " .. show(dir)) end
  fs.check_path(dir, "m3.pytorch.export")
  local cfg = lm_config(w._cfg, "m3.pytorch.export") -- the weights' own config, not the user's copy
  local bad = first_nonfinite(w)
  if bad then
    raise(string.format("m3.pytorch.export: weights: %s: expected a finite value (m3.pytorch.import would refuse "
      .. "the folder); nothing was written", bad))
  end
  if fs.exists(dir) and not fs.is_dir(dir) then
    raise(string.format("m3.pytorch.export: cannot write into %s: it exists and is not a folder", dir))
  end
  fs.mkdir(dir, "m3.pytorch.export")
  local tensors = {}
  for _, name in ipairs(w:names()) do
    tensors[name == "lm_head.weight" and name or "backbone." .. name] = w:get(name)
  end
  if cfg.tie_embeddings then tensors["lm_head.weight"] = w:get("embedding.weight") end
  local config_text = json.encode(pytorch.config_json(cfg)) .. "\n"
  fs.write_together {
    { dir .. "/model.safetensors",
      function(tmp) tensors_io.save(tmp, tensors, { format = "pt", config = config.to_json(cfg) }) end },
    { dir .. "/config.json", function(tmp) fs.write(tmp, config_text) end },
  }
  return dir, #w:names() + (cfg.tie_embeddings and 1 or 0)
end

-- How the engine's message on a lm_head.weight that differs from a tied embedding says to keep both, in the
-- words of a m3.weights.load caller (weights_io.c); import says where its config comes from instead.
local ENGINE_UNTIE = "load with tie_embeddings = false"

-- The engine's message w on loading dir's model.safetensors, in the words of an import.
local function import_words(w, dir)
  local at = w:find(ENGINE_UNTIE, 1, true)
  if not at then return w end
  return w:sub(1, at - 1) .. string.format('set "tie_embeddings": false in %s/config.json', dir)
    .. w:sub(at + #ENGINE_UNTIE)
end

function pytorch.import(dir)
  if type(dir) ~= "string" or dir == "" then raise("m3.pytorch.import: expected a folder path, got " .. show(dir)) end
  fs.check_path(dir, "m3.pytorch.import")
  if not fs.is_dir(dir) then raise("m3.pytorch.import: there is no folder " .. dir) end
  local text, err = fs.read(dir .. "/config.json")
  if not text then raise("m3.pytorch.import: " .. tostring(err)) end -- m3.fs.read's message names the file
  local ok, t = pcall(json.decode, text)
  if not ok then raise("m3.pytorch.import: " .. dir .. "/config.json: " .. tostring(t)) end
  local cfg, defaulted = from_json(t, dir)
  local model = dir .. "/model.safetensors"
  if not fs.exists(model) and fs.exists(dir .. "/pytorch_model.bin") then
    raise(string.format("m3.pytorch.import: %s holds no model.safetensors but a pytorch_model.bin (what the public "
      .. "save_pretrained writes: a torch.save pickle, which m3lua does not read); write %s from PyTorch with "
      .. "safetensors.torch.save_model(model, path), which also drops the tied lm_head.weight", dir, model))
  end
  lib.last_status = nil
  local loaded, w = pcall(weights.load, model, cfg)
  if loaded then return w end
  if lib.last_status == lib.C.M3_ERR_INTERRUPTED then error(w, 0) end -- as lib.check raises it: no position
  raise("m3.pytorch.import: " .. import_words(w, dir) .. (lib.last_status == lib.C.M3_ERR_FORMAT
    and left_out(defaulted, dir .. "/config.json") or ""))
end

return pytorch

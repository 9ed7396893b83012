-- scripts/export_pytorch.lua — writes a folder the public PyTorch Mamba-3 LM code loads
-- (config.json + model.safetensors with "backbone." names; see lua/m3/pytorch.lua). In Python:
-- MambaLMHeadModel(MambaConfig(**json.load(config.json))), then load_state_dict of
-- safetensors.torch.load_file(model.safetensors) (from_pretrained reads pytorch_model.bin instead).
--
--   m3lua scripts/export_pytorch.lua <weights.safetensors | trainer checkpoint> <out_dir>
--
-- The input is a weights file (w:save) or a full trainer checkpoint (tr:save; its float32
-- master weights are exported, whatever device and dtype it was trained on), read as
-- m3.infer.load_weights reads it. The model must have input "tokens" and head "lm".
-- A bad input or output is reported by its message alone ("export_pytorch.lua: <why>", no
-- traceback), exit status 2.

local m3 = require "m3"
local flags = require "m3.flags"

local src, dir = flags.positional({ ... }, 2, "usage: m3lua scripts/export_pytorch.lua <weights or checkpoint> <out_dir>")

local w = flags.check("export_pytorch.lua", m3.infer.load_weights, src)
local _, n_tensors = flags.check("export_pytorch.lua", m3.pytorch.export, w, dir)
print(string.format("%s: config.json and model.safetensors (%d tensors, %d parameters, d_model %d, %s, vocab %d)",
  dir, n_tensors, w.config.n_params, w.config.d_model, m3.log.plural(w.config.n_layers, "layer"), w.config.vocab_size))

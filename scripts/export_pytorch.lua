-- scripts/export_pytorch.lua — writes a folder the public PyTorch Mamba-3 LM code loads
-- (config.json + model.safetensors with "backbone." names; see lua/m3/pytorch.lua).
--
--   m3lua scripts/export_pytorch.lua <weights.safetensors | trainer checkpoint> <out_dir>
--
-- The input is a weights file (w:save) or a full trainer checkpoint (tr:save; its float32
-- master weights are exported). The model must have input "tokens" and head "lm".
-- A bad input or output is reported by its message alone (no library file:line), status 1.

local m3 = require "m3"

local src, dir = ...
if not src or not dir then
  io.stderr:write("usage: m3lua scripts/export_pytorch.lua <weights or checkpoint> <out_dir>\n")
  os.exit(2)
end

local ok, w = pcall(m3.weights.load, src)
if not ok then
  local ok2, tr = pcall(m3.trainer.load, src, { device = "cpu" })
  if not ok2 then
    error(string.format("%s is neither a weights file (%s) nor a trainer checkpoint (%s)", src, w, tr), 0)
  end
  w = tr:snapshot()
  tr:close()
end
local exported, err = pcall(m3.pytorch.export, w, dir)
if not exported then error(err, 0) end
print(string.format("%s: config.json and model.safetensors (%d tensors, %d parameters, d_model %d, %d layers, vocab %d)",
  dir, #w:names(), w.config.n_params, w.config.d_model, w.config.n_layers, w.config.vocab_size))

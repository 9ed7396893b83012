-- scripts/import_pytorch.lua — reads a public PyTorch Mamba-3 LM folder (config.json and
-- model.safetensors, as scripts/export_pytorch.lua writes it or the public code saves it)
-- into an m3 weights file (float32, config in its metadata: m3.weights.load reads it back).
--
--   m3lua scripts/import_pytorch.lua <dir> <weights.safetensors>
--
-- In a script: local w = m3.pytorch.import(dir); m3.infer(w, {...}) or m3.trainer(w, {...}).
-- A bad input or output is reported by its message alone ("import_pytorch.lua: <why>", no
-- traceback), exit status 2.

local m3 = require "m3"
local flags = require "m3.flags"

local dir, out = flags.positional({ ... }, 2, "usage: m3lua scripts/import_pytorch.lua <dir> <weights.safetensors>")
local w = flags.check("import_pytorch.lua", m3.pytorch.import, dir)
flags.check("import_pytorch.lua", w.save, w, out)
print(string.format("%s: %d parameters (d_model %d, %s, vocab %d, tie_embeddings %s)", out, w.config.n_params,
  w.config.d_model, m3.log.plural(w.config.n_layers, "layer"), w.config.vocab_size, tostring(w.config.tie_embeddings)))

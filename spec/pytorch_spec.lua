-- m3.pytorch and its scripts, beyond the round trips of infer_spec.lua: export refuses weights
-- that import would refuse (a NaN or an infinity) before writing anything, and returns the
-- number of tensors it wrote; every error of import begins with its name, a missing
-- model.safetensors (with a hint when the public save_pretrained's pytorch_model.bin is there
-- instead) and a config.json holding an array included; export_pytorch.lua exports
-- a checkpoint trained in bf16 (loaded on the CPU in f32) bit for bit and reports the tensor
-- count of the file it wrote.

local m3 = require "m3"
local json = require "m3.json"
local helper = require "spec.helper"

describe("m3.pytorch", function()
  after_each(helper.cleanup)

  local function lm(over)
    return m3.config(helper.tokens_lm(over))
  end

  -- The number of tensors in a safetensors file.
  local function count(path)
    local n = 0
    for _ in pairs((m3.load_tensors(path))) do n = n + 1 end
    return n
  end

  it("refuses to export weights holding a NaN or an infinity, in the words import refuses them in, writing nothing",
    function()
    local w = m3.weights.init(lm(), { seed = 1 })
    for _, case in ipairs { { 0 / 0, "nan" }, { 1 / 0, "inf" }, { -1 / 0, "%-inf" } } do
      w:get("layers.1.mixer.D")[2] = case[1]
      local dir = helper.tmpname("-export")
      local err = helper.error_of(function() m3.pytorch.export(w, dir) end)
      assert.matches("^[^:]*pytorch_spec%.lua:%d+: m3%.pytorch%.export: weights: layers%.1%.mixer%.D %[2%] = "
        .. case[2] .. ": expected a finite value %(m3%.pytorch%.import would refuse the folder%); nothing was written$",
        err)
      assert.is_false(m3.fs.exists(dir))
    end
  end)

  for _, tied in ipairs { true, false } do
    it("export returns the folder and the number of tensors model.safetensors holds (tie_embeddings "
      .. tostring(tied) .. ")", function()
      local w = m3.weights.init(lm({ tie_embeddings = tied }), { seed = 2 })
      local dir = helper.tmpname("-export")
      local got_dir, n = m3.pytorch.export(w, dir)
      assert.equal(dir, got_dir)
      assert.equal(count(dir .. "/model.safetensors"), n)
      assert.equal(#w:names() + (tied and 1 or 0), n) -- the tied lm_head.weight is written too
      os.execute("rm -rf " .. helper.quote(dir))
    end)
  end

  it("names itself in every error of import: a missing or unreadable model.safetensors, a config.json array",
    function()
    local w = m3.weights.init(lm(), { seed = 3 })
    local dir = helper.tmpname("-export")
    m3.pytorch.export(w, dir)
    local model = dir .. "/model.safetensors"
    os.remove(model)
    assert.matches("^[^:]*pytorch_spec%.lua:%d+: m3%.pytorch%.import: m3: " .. model:gsub("%p", "%%%0")
      .. ": cannot open: No such file or directory", helper.error_of(function() m3.pytorch.import(dir) end))
    m3.fs.mkdir(model)
    assert.matches("^[^:]*pytorch_spec%.lua:%d+: m3%.pytorch%.import: m3: " .. model:gsub("%p", "%%%0")
      .. ": not a regular file", helper.error_of(function() m3.pytorch.import(dir) end))
    os.remove(model)
    m3.fs.write(dir .. "/pytorch_model.bin", "a torch.save pickle")
    assert.matches("^[^:]*pytorch_spec%.lua:%d+: m3%.pytorch%.import: " .. dir:gsub("%p", "%%%0") .. " holds no "
      .. "model%.safetensors but a pytorch_model%.bin %(what the public save_pretrained writes: a torch%.save pickle, "
      .. "which m3lua does not read%); write " .. model:gsub("%p", "%%%0") .. " from PyTorch with "
      .. "safetensors%.torch%.save_model%(model, path%)", helper.error_of(function() m3.pytorch.import(dir) end))
    os.remove(dir .. "/pytorch_model.bin")
    m3.fs.write(dir .. "/config.json", "[1, 2]")
    assert.equal("m3.pytorch.import: " .. dir .. "/config.json: expected a JSON object, got an array",
      helper.error_of(m3.pytorch.import, dir))
    assert.equal("m3.pytorch.config_from_json: expected a JSON object, got an array",
      helper.error_of(m3.pytorch.config_from_json, json.decode("[]")))
    os.execute("rm -rf " .. helper.quote(dir))
  end)

  -- the engine tells a m3.weights.load caller to load with tie_embeddings = false; an import's config is config.json
  it("tells where to untie a lm_head.weight that differs from the tied embedding: config.json", function()
    local dir = helper.tmpname("-export")
    m3.pytorch.export(m3.weights.init(lm({ tie_embeddings = true }), { seed = 4 }), dir)
    local model = dir .. "/model.safetensors"
    local tensors, metadata = m3.load_tensors(model)
    local head = tensors["lm_head.weight"]
    local changed = m3.tensor(head:shape())
    for i = 0, head:numel() - 1 do changed[i] = head[i] end
    changed[0] = changed[0] + 1
    tensors["lm_head.weight"] = changed
    m3.save_tensors(model, tensors, metadata)
    local err = helper.error_of(m3.pytorch.import, dir)
    assert.truthy(err:find("lm_head.weight differs from embedding.weight, but the config ties them (tie_embeddings = "
      .. 'true); set "tie_embeddings": false in ' .. dir .. "/config.json to keep a separate lm_head", 1, true), err)
    assert.falsy(err:find("load with", 1, true), err)
    os.execute("rm -rf " .. helper.quote(dir))
  end)

  it("export_pytorch.lua exports a checkpoint trained in bf16 bit for bit, reporting the tensors it wrote",
    function()
    local tr = m3.trainer(lm(), { device = "cpu", batch = 2, seq_len = 4, seed = 4 })
    tr:step(helper.batch(tr.config, 2, 4, helper.rng(5)))
    local f32 = helper.tmpname(".ckpt")
    tr:save(f32)
    -- the same checkpoint as a CUDA bf16 run writes it (its checksum left out, as in a file written before
    -- checksums): the CPU computes in f32 only, so it cannot be loaded as it was trained
    local tensors, meta = m3.load_tensors(f32)
    local trainer = json.decode(meta.trainer)
    trainer.device, trainer.precision = 2, 1
    meta.trainer, meta.checksum = json.encode(trainer), nil
    local bf16 = helper.tmpname(".ckpt")
    m3.save_tensors(bf16, tensors, meta)
    local dir = helper.tmpname("-export")
    local out, code = helper.run(table.concat({ helper.quote(helper.m3lua()),
      helper.quote(helper.repo_dir() .. "/scripts/export_pytorch.lua"), helper.quote(bf16), helper.quote(dir) }, " "))
    assert.equal(0, code, out)
    local n = count(dir .. "/model.safetensors")
    assert.matches(" %(" .. n .. " tensors, ", out)
    local back = m3.pytorch.import(dir)
    for _, name in ipairs(back:names()) do
      assert.equal(helper.bytes(tensors["param." .. name]), helper.bytes(back:get(name)), name)
    end
    os.execute("rm -rf " .. helper.quote(dir))
  end)
end)

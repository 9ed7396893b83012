-- m3.pytorch and its scripts, beyond the round trips of infer_spec.lua: export refuses weights
-- that import would refuse (a NaN or an infinity) before writing anything, and returns the
-- number of tensors it wrote; every error of import begins with its name, a missing
-- model.safetensors (with a hint when the public save_pretrained's pytorch_model.bin is there
-- instead) and a config.json holding an array included; export_pytorch.lua exports
-- a checkpoint trained in bf16 (loaded on the CPU in f32) bit for bit and reports the tensor
-- count of the file it wrote; export replaces config.json and model.safetensors as one set (a
-- failure on the way keeps the old pair: m3.fs.write_together).

local ffi = require "ffi"
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

  -- The names in a folder, and model.safetensors's bytes (the old pair's, or a new export's).
  local function folder_state(dir)
    return { names = m3.fs.list(dir), model = m3.fs.read(dir .. "/model.safetensors") }
  end

  it("export keeps the old pair when config.json cannot be replaced (a folder there): nothing is written", function()
    local dir = helper.tmpdir()
    m3.fs.write(dir .. "/model.safetensors", "the old model")
    m3.fs.mkdir(dir .. "/config.json")
    local err = helper.error_of(function() m3.pytorch.export(m3.weights.init(lm(), { seed = 5 }), dir) end)
    assert.matches("^[^:]*pytorch_spec%.lua:%d+: m3%.fs: cannot write " .. dir:gsub("%p", "%%%0")
      .. "/config%.json: it exists and is a folder", err)
    assert.same({ names = { "config.json", "model.safetensors" }, model = "the old model" }, folder_state(dir))
    os.execute("rm -rf " .. helper.quote(dir))
  end)

  it("export keeps the old pair when writing config.json fails after model.safetensors was written", function()
    local dir = helper.tmpdir()
    local w = m3.weights.init(lm(), { seed = 6 })
    m3.fs.write(dir .. "/model.safetensors", "the old model")
    m3.fs.write(dir .. "/config.json", "the old config")
    -- a folder where config.json's temporary file goes: its write fails once the model's file is written
    local blocker = dir .. "/config.json.tmp." .. ffi.C.getpid()
    m3.fs.mkdir(blocker)
    assert.matches("m3%.fs: cannot write [^\n]*config%.json%.tmp%.%d+: it exists and is a folder",
      helper.error_of(m3.pytorch.export, w, dir))
    local kept = folder_state(dir)
    assert.same({ names = { "config.json", "config.json.tmp." .. ffi.C.getpid(), "model.safetensors" },
      model = "the old model" }, kept)
    assert.equal("the old config", m3.fs.read(dir .. "/config.json"))
    os.remove(blocker)
    -- the next export replaces both
    m3.pytorch.export(w, dir)
    assert.same({ "config.json", "model.safetensors" }, m3.fs.list(dir))
    assert.is_true(helper.same_weights(m3.pytorch.import(dir), w))
    os.execute("rm -rf " .. helper.quote(dir))
  end)

  it("m3.fs.write_together puts every old file back when a later file cannot be renamed into place", function()
    local dir = helper.tmpdir()
    local first, second = dir .. "/first", dir .. "/second"
    m3.fs.write(first, "old first")
    local err = helper.error_of(m3.fs.write_together, {
      { first, function(tmp) m3.fs.write(tmp, "new first") end },
      -- a folder appears at the second path after the check: its rename fails once the first file is in place
      { second, function(tmp) m3.fs.write(tmp, "new second"); m3.fs.mkdir(second .. "/inside") end },
    })
    assert.matches("m3%.fs: cannot rename onto " .. second:gsub("%p", "%%%0") .. ": it is now a folder", err)
    assert.equal("old first", m3.fs.read(first))
    assert.same({ "first", "second" }, m3.fs.list(dir))
    assert.same({ "inside" }, m3.fs.list(second))
    -- the rename itself fails: the second file's folder (and its temporary file) is gone
    local sub = dir .. "/sub"
    m3.fs.mkdir(sub)
    err = helper.error_of(m3.fs.write_together, {
      { first, function(tmp) m3.fs.write(tmp, "new first") end },
      { sub .. "/file", function(tmp) m3.fs.write(tmp, "new"); os.execute("rm -r " .. helper.quote(sub)) end },
    })
    assert.matches("m3%.fs: cannot rename onto " .. sub:gsub("%p", "%%%0") .. "/file: [^\n]*No such file", err)
    assert.equal("old first", m3.fs.read(first))
    assert.same({ "first", "second" }, m3.fs.list(dir))
    -- a write that fails (an interrupt alike) replaces nothing and leaves no temporary file
    err = helper.error_of(m3.fs.write_together, {
      { first, function(tmp) m3.fs.write(tmp, "new first") end },
      { dir .. "/third", function() error("interrupted: stop", 0) end },
    })
    assert.equal("interrupted: stop", err)
    assert.equal("old first", m3.fs.read(first))
    assert.same({ "first", "second" }, m3.fs.list(dir))
    -- and when all goes well, both are replaced and nothing else is left
    m3.fs.write_together {
      { first, function(tmp) m3.fs.write(tmp, "new first") end },
      { dir .. "/third", function(tmp) m3.fs.write(tmp, "new third") end },
    }
    assert.same({ "new first", "new third" }, { m3.fs.read(first), m3.fs.read(dir .. "/third") })
    assert.same({ "first", "second", "third" }, m3.fs.list(dir))
    os.execute("rm -rf " .. helper.quote(dir))
  end)

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

  it("names itself when a folder path holds a NUL byte, which no file name can hold", function()
    local w = m3.weights.init(lm(), { seed = 7 })
    assert.matches('^[^:]*pytorch_spec%.lua:%d+: m3%.pytorch%.import: path "a\\0b" holds a NUL byte',
      helper.error_of(function() m3.pytorch.import("a\0b") end))
    assert.matches('^[^:]*pytorch_spec%.lua:%d+: m3%.pytorch%.export: path "a\\0b" holds a NUL byte',
      helper.error_of(function() m3.pytorch.export(w, "a\0b") end))
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
  -- d_state (N) and headdim (P) differ here, so each ssm_cfg field is read from its own config field; an export then
  -- import keeps both and the bits
  it("writes ssm_cfg.d_state and ssm_cfg.headdim from their own fields (P != N)", function()
    local cfg = lm({ d_state = 16, headdim = 8 })
    local c = m3.pytorch.config_json(cfg)
    assert.equal(16, c.ssm_cfg.d_state)
    assert.equal(8, c.ssm_cfg.headdim)
    local w = m3.weights.init(cfg, { seed = 9 })
    local dir = helper.tmpname("-export")
    m3.pytorch.export(w, dir)
    local back = m3.pytorch.import(dir)
    assert.equal(16, back.config.d_state)
    assert.equal(8, back.config.headdim)
    assert.is_true(helper.same_weights(w, back))
    os.execute("rm -rf " .. helper.quote(dir))
  end)

  -- the header: the public model has no MLP blocks here, so d_intermediate must be 0 (or absent)
  it("refuses a config.json with MLP blocks (d_intermediate other than 0)", function()
    local t = m3.pytorch.config_json(lm())
    t.d_intermediate = 64
    assert.matches("m3.pytorch.config_from_json: d_intermediate = 64: must be 0 %(no MLP blocks%)",
      helper.error_of(m3.pytorch.config_from_json, t))
    t.d_intermediate = nil
    assert.equal(16, m3.pytorch.config_from_json(t).d_model)
  end)

  -- ssm_cfg fields left out take the public defaults, which are SPEC.md §1's: d_state 128, expand 2, headdim 64,
  -- ngroups 1, rope_fraction 0.5, a_floor 1e-4, outproj_norm false (tie_embeddings true)
  it("takes SPEC.md's defaults for the ssm_cfg fields a config.json leaves out", function()
    local cfg = m3.pytorch.config_from_json({ d_model = 64, n_layer = 1, vocab_size = 16,
      ssm_cfg = { layer = "Mamba3" } })
    assert.equal(128, cfg.d_state)
    assert.equal(2, cfg.expand)
    assert.equal(64, cfg.headdim)
    assert.equal(1, cfg.ngroups)
    assert.equal(0.5, cfg.rope_fraction)
    assert.equal(1e-4, cfg.a_floor)
    assert.is_false(cfg.outproj_norm)
    assert.is_true(cfg.tie_embeddings)
  end)
end)

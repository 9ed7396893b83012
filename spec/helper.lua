-- spec/helper.lua — shared utilities of the m3 busted specs: error measures, raw-byte
-- comparisons, small configs, a seeded generator and random batches, temporary paths and
-- the location of ../shared, the m3lua binary, shell quoting and running commands, checks
-- through the C API.

local ffi = require "ffi"
local m3 = require "m3"

local helper = {}

-- ---- measures ------------------------------------------------------------------------------------

local function values(x)
  if m3.tensor.is(x) then return x.data, x:numel() end
  local t = m3.tensor.from(x, "f64")
  return t.data, t:numel()
end

-- Relative L2 error ‖a − b‖ / ‖b‖ (‖a − b‖ when b is zero), in double precision.
function helper.rel_l2(a, b)
  local pa, na = values(a)
  local pb, nb = values(b)
  assert(na == nb, string.format("rel_l2: %d vs %d elements", na, nb))
  local num, den = 0, 0
  for i = 0, na - 1 do
    local d = pa[i] - pb[i]
    num, den = num + d * d, den + pb[i] * pb[i]
  end
  if den == 0 then return math.sqrt(num) end
  return math.sqrt(num / den)
end

function helper.cosine(a, b)
  local pa, na = values(a)
  local pb = values(b)
  local ab, aa, bb = 0, 0, 0
  for i = 0, na - 1 do
    ab, aa, bb = ab + pa[i] * pb[i], aa + pa[i] * pa[i], bb + pb[i] * pb[i]
  end
  if aa == 0 and bb == 0 then return 1 end
  return ab / math.sqrt(aa * bb)
end

local ESIZE = { f32 = 4, f64 = 8, i32 = 4, u8 = 1 }

function helper.bytes(t)
  return ffi.string(t.data, t:numel() * ESIZE[t:dtype()])
end

-- True when two weights objects hold the same bits in every tensor (else false, name).
function helper.same_weights(a, b)
  for _, name in ipairs(a:names()) do
    if helper.bytes(a:get(name)) ~= helper.bytes(b:get(name)) then return false, name end
  end
  return true
end

-- True when two states() lists hold the same bits (else false, "layer.field").
function helper.same_states(a, b)
  if #a ~= #b then return false, "layer count" end
  for l = 1, #a do
    for _, k in ipairs({ "angle", "ssm", "k", "v" }) do
      if helper.bytes(a[l][k]) ~= helper.bytes(b[l][k]) then return false, l .. "." .. k end
    end
  end
  return true
end

-- Largest relative L2 error over the tensors of two weights objects (and its name).
function helper.weights_rel(a, b)
  local worst, at = 0, nil
  for _, name in ipairs(a:names()) do
    local e = helper.rel_l2(a:get(name), b:get(name))
    if e > worst then worst, at = e, name end
  end
  return worst, at
end

-- ---- configs -------------------------------------------------------------------------------------

local function merge(base, over)
  local t = {}
  for k, v in pairs(base) do t[k] = v end
  for k, v in pairs(over or {}) do t[k] = v end
  return t
end

-- Small models of each input/head kind (a few thousand parameters).
function helper.features_none(over)
  return merge({ d_model = 16, n_layers = 2, d_state = 8, headdim = 8, input = "features", input_dim = 5,
                 head = "none" }, over)
end

function helper.tokens_lm(over)
  return merge({ d_model = 16, n_layers = 2, d_state = 8, headdim = 8, input = "tokens", vocab_size = 13,
                 head = "lm" }, over)
end

function helper.identity_mse(over)
  return merge({ d_model = 16, n_layers = 2, d_state = 8, headdim = 8, input = "identity", head = "mse",
                 out_dim = 3 }, over)
end

-- ---- seeded generator and batches ----------------------------------------------------------------

local Rng = {}
Rng.__index = Rng

-- A small deterministic generator (splitmix64 on uint64 cdata).
function helper.rng(seed)
  return setmetatable({ s = ffi.new("uint64_t", seed or 1) }, Rng)
end

function Rng:u32()
  self.s = self.s + 0x9E3779B97F4A7C15ULL
  local z = self.s
  z = (bit.bxor(z, bit.rshift(z, 30))) * 0xBF58476D1CE4E5B9ULL
  z = (bit.bxor(z, bit.rshift(z, 27))) * 0x94D049BB133111EBULL
  z = bit.bxor(z, bit.rshift(z, 31))
  return tonumber(bit.rshift(z, 32))
end

function Rng:uniform()
  return (self:u32() + 0.5) / 4294967296
end

function Rng:normal()
  return math.sqrt(-2 * math.log(self:uniform())) * math.cos(2 * math.pi * self:uniform())
end

function Rng:int(n)
  return self:u32() % n
end

-- A tensor of shape with N(0, scale²) values (dtype default f32).
function helper.randn(rng, shape, scale, dtype)
  local t = m3.tensor(shape, dtype or "f32")
  scale = scale or 1
  for i = 0, t:numel() - 1 do t[i] = rng:normal() * scale end
  return t
end

function helper.randint(rng, shape, n)
  local t = m3.tensor(shape, "i32")
  for i = 0, t:numel() - 1 do t[i] = rng:int(n) end
  return t
end

-- A random batch of B rows x T tokens for a validated config (inputs and targets/d_out).
-- opts: resets = {{row, t}, ...} (0-based), ignore = fraction of lm targets set to -1.
function helper.batch(cfg, B, T, rng, opts)
  opts = opts or {}
  local b = {}
  if cfg.input == "tokens" then
    b.tokens = helper.randint(rng, { B, T }, cfg.vocab_size)
  else
    b.input = helper.randn(rng, { B, T, cfg.input == "features" and cfg.input_dim or cfg.d_model })
  end
  if cfg.head == "lm" then
    b.targets = helper.randint(rng, { B, T }, cfg.vocab_size)
    if opts.ignore then
      for i = 0, B * T - 1 do
        if rng:uniform() < opts.ignore then b.targets[i] = -1 end
      end
    end
  elseif cfg.head == "mse" then
    b.targets = helper.randn(rng, { B, T, cfg.out_dim })
  else
    b.d_out = helper.randn(rng, { B, T, cfg.d_model }, 0.1)
  end
  if opts.resets then
    b.resets = m3.tensor({ B, T }, "u8")
    for _, rt in ipairs(opts.resets) do b.resets[rt[1] * T + rt[2]] = 1 end
  end
  return b
end

-- Rows [r0, r0 + n) of a batch (a copy of each field).
function helper.rows(b, r0, n)
  local out = {}
  for k, t in pairs(b) do
    local s = t:shape()
    local per = t:numel() / s[1]
    s[1] = n
    local c = m3.tensor(s, t:dtype())
    ffi.copy(c.data, t.data + r0 * per, n * per * ESIZE[t:dtype()])
    out[k] = c
  end
  return out
end

-- Positions [t0, t0 + n) of every row of a batch (a copy of each field).
function helper.window(b, t0, n)
  local out = {}
  for k, t in pairs(b) do
    local s = t:shape()
    local B, T = s[1], s[2]
    local per = t:numel() / (B * T)
    s[2] = n
    local c = m3.tensor(s, t:dtype())
    local esz = ESIZE[t:dtype()]
    for r = 0, B - 1 do
      ffi.copy(c.data + r * n * per, t.data + (r * T + t0) * per, n * per * esz)
    end
    out[k] = c
  end
  return out
end

-- ---- files ---------------------------------------------------------------------------------------

local temp = {}

-- A fresh temporary path (removed by helper.cleanup()).
function helper.tmpname(suffix)
  local p = os.tmpname()
  os.remove(p)
  p = p .. (suffix or "")
  temp[#temp + 1] = p
  return p
end

-- A new empty folder (left in place: specs that make one remove it themselves or leave it to /tmp).
function helper.tmpdir()
  local d = os.tmpname()
  os.remove(d)
  assert(os.execute("mkdir -p " .. d) == 0)
  return d
end

function helper.cleanup()
  for i = #temp, 1, -1 do
    os.remove(temp[i])
    temp[i] = nil
  end
end

local function dir_of(path)
  return path:match("^(.*)/[^/]*$") or "."
end

-- The repository root (the folder above spec/).
function helper.repo_dir()
  local src = debug.getinfo(1, "S").source:gsub("^@", "")
  return dir_of(dir_of(src))
end

-- The m3lua binary that specs run as a program: $M3LUA (default $BUILD_DIR/m3lua, else build/m3lua),
-- as an absolute path. Put it into a shell command through helper.quote.
function helper.m3lua()
  local path = os.getenv("M3LUA") or (os.getenv("BUILD_DIR") or "build") .. "/m3lua"
  if path:sub(1, 1) == "/" then return path end
  local pwd = io.popen("pwd")
  local cwd = pwd:read("*l")
  pwd:close()
  return cwd .. "/" .. path
end

-- s as one word of a shell command line (in single quotes), whatever it holds: paths may hold spaces.
function helper.quote(s)
  return "'" .. s:gsub("'", "'\\''") .. "'"
end

-- Runs a shell command line with M3LUA unset (the children of a parallel sweep then run with
-- their parent's interpreter); returns its stdout and stderr together and its exit status.
function helper.run(line)
  local p = io.popen("env -u M3LUA " .. line .. " 2>&1; echo \"exit $?\"")
  local out = p:read("*a")
  p:close()
  local text, code = out:match("^(.-)exit (%d+)\n$")
  return text, tonumber(code)
end

-- ../shared: $M3_SHARED, else <repo>/../shared.
function helper.shared_dir()
  return os.getenv("M3_SHARED") or helper.repo_dir() .. "/../shared"
end

-- In a #gpu spec: true when a CUDA device is there, else marks the test pending (CI has none).
-- Pass busted's `pending` (a global of spec files only).
function helper.need_gpu(pending)
  if m3.cuda_device_count() == 0 then
    pending("no CUDA device")
    return false
  end
  return true
end

-- Calls fn and returns its error message (fails the caller's test when it does not raise).
function helper.error_of(fn, ...)
  local ok, err = pcall(fn, ...)
  assert(not ok, "expected an error, got none")
  return tostring(err)
end

-- A table that reads as t, but closes obj (a trainer, inference object, weights) whenever a field is read:
-- the caller's code running inside a call that reads its input (a metamethod) closes the call's own object.
function helper.closing(obj, t)
  return setmetatable({}, { __index = function(_, k)
    obj:close()
    return t[k]
  end })
end

-- ---- the C API -----------------------------------------------------------------------------------

-- m3_<kind>_create ("trainer" | "infer") from the defaults plus fill(cfg) refuses 2 in each of the on /
-- off `fields` (M3_ERR_CONFIG, the field named, no object) and takes 0.
function helper.c_flags_checked(kind, fields, fill)
  local C, check = require("m3.lib").C, require "luassert"
  local out = ffi.new("m3_" .. kind .. " *[1]")
  for _, field in ipairs(fields) do
    local c = ffi.new("m3_" .. kind .. "_cfg")
    C["m3_" .. kind .. "_cfg_defaults"](c)
    fill(c)
    c[field] = 2
    check.equal(2, tonumber(C["m3_" .. kind .. "_create"](c, out)), field) -- M3_ERR_CONFIG
    check.matches("^" .. field .. " = 2: must be 0 or 1", ffi.string(C.m3_last_error()))
    check.is_true(out[0] == nil)
    c[field] = 0
    check.equal(0, tonumber(C["m3_" .. kind .. "_create"](c, out)), field)
    C["m3_" .. kind .. "_destroy"](out[0])
  end
end

return helper

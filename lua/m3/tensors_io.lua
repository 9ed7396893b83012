-- m3.tensors_io — safetensors files as Lua tables of tensors, through the engine's reader
-- (m3_tensor_file_*, which validates the whole file) and atomic writer (m3_tensor_writer_*).
--
-- load: F32, F64, I32, U8 are copied as they are; F16 and BF16 become f32; I64, I16, I8,
-- U16, U32, U64 become i32 (values outside int32 are an error naming the tensor); BOOL
-- becomes u8. save: f32, f64, i32, u8 tensors ({data = <FFI array>, shape = ...} tables keep the array's
-- type, nested tables become f32, a bare FFI array, whose shape is unknown, is an error); metadata
-- strings, booleans and numbers (as text that reads back exactly).

local ffi = require "ffi"
local lib = require "m3.lib"
local tensor = require "m3.tensor"
local exact = require("m3.number_text").exact
local fs = require "m3.fs"

lib.internal_file(debug.getinfo(1, "S").source)

local C, check, raise = lib.C, lib.check, lib.raise

local io_ = {}

local DT = { F32 = 0, F64 = 1, I32 = 2, U8 = 3, F16 = 4, BF16 = 5, I64 = 6, I16 = 7, I8 = 8,
             BOOL = 9, U16 = 10, U32 = 11, U64 = 12 }
local DT_NAME = {}
for k, v in pairs(DT) do DT_NAME[v] = k end

-- file dtype → (tensor dtype, source element ctype or nil for a byte copy)
local plan = {
  [DT.F32] = { "f32" }, [DT.F64] = { "f64" }, [DT.I32] = { "i32" }, [DT.U8] = { "u8" },
  [DT.BOOL] = { "u8" },
  [DT.I64] = { "i32", "const int64_t *" }, [DT.I16] = { "i32", "const int16_t *" },
  [DT.I8] = { "i32", "const int8_t *" }, [DT.U16] = { "i32", "const uint16_t *" },
  [DT.U32] = { "i32", "const uint32_t *" }, [DT.U64] = { "i32", "const uint64_t *" },
}
local wide = { [DT.I64] = true, [DT.U32] = true, [DT.U64] = true }

local function half_to_float(dst, src, n)
  local ldexp = math.ldexp
  for i = 0, n - 1 do
    local h = src[i]
    local e, m = bit.band(bit.rshift(h, 10), 0x1f), bit.band(h, 0x3ff)
    local v
    if e == 0 then
      v = ldexp(m, -24)
    elseif e == 31 then
      v = m == 0 and math.huge or 0 / 0
    else
      v = ldexp(m + 1024, e - 25)
    end
    dst[i] = h >= 0x8000 and -v or v
  end
end

local function bf16_to_float(dst, src, n)
  local bits = ffi.cast("int32_t *", dst)
  for i = 0, n - 1 do bits[i] = bit.lshift(src[i], 16) end
end

local function convert(ft, name)
  local dtype_code = ft.dtype
  local shape = {}
  for i = 0, ft.ndim - 1 do shape[i + 1] = tonumber(ft.shape[i]) end
  local n = tonumber(ft.numel)
  if dtype_code == DT.F16 or dtype_code == DT.BF16 then
    local t = tensor(shape, "f32")
    local src = ffi.cast("const uint16_t *", ft.data)
    if dtype_code == DT.F16 then half_to_float(t.data, src, n) else bf16_to_float(t.data, src, n) end
    return t
  end
  local p = plan[dtype_code]
  if not p then raise(string.format("m3.load_tensors: tensor %q has an unsupported dtype (%d)", name, dtype_code)) end
  local t = tensor(shape, p[1])
  if not p[2] then
    ffi.copy(t.data, ft.data, ft.nbytes)
    return t
  end
  local src, dst = ffi.cast(p[2], ft.data), t.data
  if wide[dtype_code] then
    for i = 0, n - 1 do
      local v = src[i]
      if v > 2147483647 or (dtype_code == DT.I64 and v < -2147483648) then
        raise(string.format("m3.load_tensors: tensor %q (%s) element %d = %s does not fit in int32",
          name, DT_NAME[dtype_code], i, (tostring(v):gsub("U?LL$", ""))))
      end
      dst[i] = v
    end
  else
    for i = 0, n - 1 do dst[i] = src[i] end
  end
  return t
end

-- m3.load_tensors(path) → name → tensor, metadata (key → string)
function io_.load(path)
  fs.check_path(path, "m3.load_tensors")
  local fp = ffi.new("m3_tensor_file *[1]")
  check(C.m3_tensor_file_open(path, fp))
  local f = ffi.gc(fp[0], C.m3_tensor_file_close)
  local tensors, meta = {}, {}
  local ft = ffi.new("m3_file_tensor")
  for i = 0, C.m3_tensor_file_count(f) - 1 do
    check(C.m3_tensor_file_get(f, i, ft))
    local name = ffi.string(ft.name)
    tensors[name] = convert(ft, name)
  end
  for i = 0, C.m3_tensor_file_metadata_count(f) - 1 do
    local key = ffi.string(C.m3_tensor_file_metadata_key(f, i))
    meta[key] = ffi.string(C.m3_tensor_file_metadata(f, key))
  end
  C.m3_tensor_file_close(ffi.gc(f, nil))
  return tensors, meta
end

local save_code = { f32 = DT.F32, f64 = DT.F64, i32 = DT.I32, u8 = DT.U8 }

-- Names and metadata reach the file as C strings: a NUL byte would cut them short.
local function no_nul(s, what)
  if s:find("\0", 1, true) then raise(string.format("m3.save_tensors: %s %q holds a NUL byte", what, s)) end
end

-- m3.save_tensors(path, name → tensor, metadata?) — atomic (temporary file + rename).
function io_.save(path, tensors, metadata)
  fs.check_path(path, "m3.save_tensors")
  if type(tensors) ~= "table" then raise("m3.save_tensors: tensors must be a table name → tensor") end
  if type(metadata) ~= "nil" and type(metadata) ~= "table" then raise("m3.save_tensors: metadata must be a table") end
  local names = {}
  for k in pairs(tensors) do
    if type(k) ~= "string" then raise("m3.save_tensors: tensor names must be strings, got " .. tostring(k)) end
    no_nul(k, "tensor name")
    names[#names + 1] = k
  end
  table.sort(names)
  local wp = ffi.new("m3_tensor_writer *[1]")
  check(C.m3_tensor_writer_create(wp))
  local w = ffi.gc(wp[0], C.m3_tensor_writer_destroy)
  local keep = {} -- converted tensors stay alive until the write below
  for _, name in ipairs(names) do
    local what, expected = string.format("m3.save_tensors: tensor %q", name),
      "a tensor, a {data = <FFI array>, shape = {...}} table or a nested table of numbers"
    local t = tensor.coerce(tensors[name], what, "f32", nil, expected)
    if not t then -- a bare FFI array: its shape is not known
      raise(string.format("%s: expected %s, got %s without a shape (pass {data = array, shape = {...}})", what,
        expected, tensor.describe(tensors[name])))
    end
    keep[#keep + 1] = t
    local shape = t:shape()
    local dims = ffi.new("int64_t[?]", math.max(#shape, 1), shape)
    check(C.m3_tensor_writer_add(w, name, save_code[t:dtype()], #shape, dims, t.data))
  end
  local keys = {} -- in sorted order, so the same tensors and metadata give the same bytes
  local text = {}
  for k, v in pairs(metadata or {}) do
    if type(k) ~= "string" then
      raise(string.format("m3.save_tensors: metadata keys must be strings, got %s %s", type(k), tostring(k)))
    end
    if type(v) == "number" then
      text[k] = exact(v)
    elseif type(v) == "string" or type(v) == "boolean" then
      text[k] = tostring(v)
    else
      raise(string.format("m3.save_tensors: metadata[%q] must be a string, number or boolean, got %s", k, type(v)))
    end
    no_nul(k, "metadata key")
    no_nul(text[k], string.format("metadata[%q]", k))
    keys[#keys + 1] = k
  end
  table.sort(keys)
  for _, k in ipairs(keys) do check(C.m3_tensor_writer_add_metadata(w, k, text[k])) end
  check(C.m3_tensor_writer_write(w, path))
  C.m3_tensor_writer_destroy(ffi.gc(w, nil))
  return path
end

return io_

-- m3.tensor — dense host tensors (f32, f64, i32, u8) with a shape.
--
-- A tensor is an FFI struct (one type per dtype, its fields read-only) holding a typed `data` pointer, the
-- element count and up to 8 dims; `t[i]` is bounds-checked 0-based flat access (a store
-- takes only values the element holds) and `#t` the element count. The memory belongs to an
-- anchor (an ffi.new array, calloc'd memory from 2 GiB up, page-locked memory for
-- m3.tensor(shape, dtype, {pinned = true}), a weights object for views, a user's FFI array
-- for wraps) kept alive in a registry until the tensor is collected. Nothing here copies or
-- loops over elements unless asked (from, to_table, clone, cast). A name that is neither a
-- method nor a number (t.foo, t["1"]) is an error, as an index out of range is, and so is a
-- method called with a dot (t.shape()). A shape is a list of at most 8 integers in [0, 2^53]
-- whose product is below 2^53.
--
-- User data (coerce, from) is taken as a tensor, a nested table or an FFI array, whose size the FFI
-- knows; a pointer is refused. tensor.wrap also views a pointer: that its memory holds the shape's
-- elements is then the caller's responsibility.

local ffi = require "ffi"
local lib = require "m3.lib"
local number_text = require "m3.number_text"

lib.internal_file(debug.getinfo(1, "S").source)

local raise = lib.raise
local floor = math.floor
local MAXDIM = 8

local ctype_of = { f32 = "float", f64 = "double", i32 = "int32_t", u8 = "uint8_t" }
local DTYPES = { "f32", "f64", "i32", "u8" } -- by the struct's code_
local CODE = {}
for i, d in ipairs(DTYPES) do CODE[d] = i end
local aliases = {
  f32 = "f32", float32 = "f32", float = "f32",
  f64 = "f64", float64 = "f64", double = "f64",
  i32 = "i32", int32 = "i32",
  u8 = "u8", uint8 = "u8",
}
-- Element type names as ffi's tostring(ctype) spells them.
local dtype_of_cname = { float = "f32", double = "f64", int = "i32", ["unsigned char"] = "u8" }

local tensor = {}

-- ---- registry of anchors ----------------------------------------------------------------

local anchors, free_ids, next_id = {}, {}, 1

local function anchor(owner)
  local id = free_ids[#free_ids]
  if id then
    free_ids[#free_ids] = nil
  else
    id, next_id = next_id, next_id + 1
  end
  anchors[id] = owner
  return id
end

local function release(t)
  local id = t.anchor_
  if id ~= 0 then
    anchors[id] = nil
    free_ids[#free_ids + 1] = id
  end
end

-- ---- struct types and metatables ---------------------------------------------------------

local ctypes, fill_ct, array_ct, ptr_ct = {}, {}, {}, {}
local methods = {}

local show = number_text.shown -- text quoted, numbers with every digit

-- The values an element of an integer dtype holds; a Lua number outside them (or not whole) would be
-- truncated or wrapped by the FFI's conversion, so storing one is an error.
local INT_RANGE = { i32 = { -2147483648, 2147483647 }, u8 = { 0, 255 } }

-- The magnitude from which a finite number rounds to infinity in float32 (FLT_MAX plus half an ulp).
local F32_OVERFLOW = 2 ^ 128 - 2 ^ 103

-- A finite n that float32 would turn into an infinity.
local function f32_overflows(n)
  return n ~= math.huge and n ~= -math.huge and (n >= F32_OVERFLOW or n <= -F32_OVERFLOW)
end

-- v as the number an element of dtype stores, or nil and why not: a Lua number or an FFI number cdata
-- (tonumber: 5LL, a double), for i32 and u8 a whole one in range, for f32 one that does not overflow.
local function storable(dtype, v)
  local n = type(v) == "number" and v or type(v) == "cdata" and tonumber(v) or nil
  if n == nil then return nil, "expected a number" end
  local r = INT_RANGE[dtype]
  if r and (n ~= floor(n) or n < r[1] or n > r[2]) then
    return nil, string.format("expected an integer in [%d, %d] (%s)", r[1], r[2], dtype)
  end
  if dtype == "f32" and f32_overflows(n) then return nil, "outside float32's range (it would become inf)" end
  return n
end

local function bad_index(t, k)
  if type(k) == "number" then
    if k ~= floor(k) then raise("tensor index " .. show(k) .. " is not an integer") end
    raise(string.format("tensor index %s out of range [0, %d)", show(k), t.n_))
  end
  raise("tensor: no method or field " .. show(k))
end

-- An index given as a 64-bit integer cdata (0LL) as the number it holds; other keys unchanged.
local function as_number(k)
  if type(k) == "cdata" and (ffi.istype("int64_t", k) or ffi.istype("uint64_t", k)) then return tonumber(k) end
  return k
end

local mt = {
  __index = function(t, k)
    if type(k) ~= "number" then
      k = as_number(k)
      if type(k) ~= "number" then return methods[k] or bad_index(t, k) end
    end
    if k >= 0 and k < t.n_ and k == floor(k) then return t.data[k] end
    bad_index(t, k)
  end,
  __newindex = function(t, k, v)
    k = as_number(k)
    if type(k) == "number" and k >= 0 and k < t.n_ and k == floor(k) then
      local n, why = storable(DTYPES[t.code_], v)
      if not n then raise(string.format("tensor[%d] = %s: %s", k, show(v), why)) end
      t.data[k] = n
      return
    end
    if type(k) ~= "number" then raise("tensor: cannot set field " .. tostring(k)) end
    bad_index(t, k)
  end,
  __len = function(t) return t.n_ end,
  __gc = release,
}

for _, dtype in ipairs(DTYPES) do
  local cname = ctype_of[dtype]
  local sname = "m3_lua_tensor_" .. dtype
  -- The fields are const (t.data = nil or t.n_ = 1e9 would let t[i] read any address); make sets them once
  -- through a pointer to the same layout without const (a constructor's initialisers are not compiled).
  ffi.cdef(string.format("typedef struct %s { %s *const data; const double n_; const int32_t ndim_; "
    .. "const int32_t anchor_; const int32_t code_; const double dims_[%d]; } %s;", sname, cname, MAXDIM, sname))
  ffi.cdef(string.format("typedef struct { %s *data; double n_; int32_t ndim_; int32_t anchor_; int32_t code_; "
    .. "double dims_[%d]; } %s_fill;", cname, MAXDIM, sname))
  local m = {}
  for k, v in pairs(mt) do m[k] = v end
  m.__tostring = function(t) return tensor.tostring(t) end
  ctypes[dtype] = ffi.metatype(sname, m)
  fill_ct[dtype] = ffi.typeof(sname .. "_fill *")
  array_ct[dtype] = ffi.typeof(cname .. "[?]")
  ptr_ct[dtype] = ffi.typeof(cname .. "*")
end

local CT_F32, CT_F64, CT_I32, CT_U8 = ctypes.f32, ctypes.f64, ctypes.i32, ctypes.u8
local istype = ffi.istype

local function dtype_of(t)
  return DTYPES[t.code_]
end

function tensor.is(x)
  return type(x) == "cdata" and (istype(CT_F32, x) or istype(CT_F64, x) or istype(CT_I32, x) or istype(CT_U8, x))
end

-- ---- construction ------------------------------------------------------------------------

function tensor.dtype_name(dtype, what)
  local d = aliases[dtype == nil and "f32" or dtype]
  if not d then
    raise(string.format("%s: unknown dtype %s (use f32, f64, i32 or u8)", what or "m3.tensor",
      tostring(dtype)))
  end
  return d
end

-- A key of t that no list has (not an integer >= 1: {1, 2, dtype = "i32"} would lose its field), or nil.
local function key_outside_list(t)
  for k in pairs(t) do
    if type(k) ~= "number" or k ~= floor(k) or k < 1 then return k end
  end
end

local function check_shape(shape, what)
  if type(shape) == "number" then shape = { shape } end
  if type(shape) ~= "table" then
    raise(string.format("%s: shape must be a table of integers, got %s", what, type(shape)))
  end
  local key = key_outside_list(shape)
  if key ~= nil then raise(string.format("%s: shape has the key %s: expected a list of integers", what, show(key))) end
  if table.maxn(shape) ~= #shape then -- a nil inside the list: # may stop at it
    raise(string.format("%s: shape has a nil among its dims (dims up to [%d]): expected a list of integers",
      what, table.maxn(shape)))
  end
  if #shape > MAXDIM then raise(string.format("%s: at most %d dims, got %d", what, MAXDIM, #shape)) end
  local n = 1
  for i = 1, #shape do
    local d = shape[i]
    if type(d) ~= "number" or d < 0 or d ~= floor(d) or d > 2 ^ 53 then -- (with a 0 beside it, n would not say so)
      raise(string.format("%s: shape[%d] = %s: expected an integer in [0, 2^53]", what, i, show(d)))
    end
    n = n * d
  end
  if n >= 2 ^ 53 then
    raise(string.format("%s: shape %s holds %s elements, expected fewer than 2^53", what, tensor.format_shape(shape),
      show(n)))
  end
  return shape, n
end

-- A tensor over data (a pointer of the dtype's element type) owned by owner.
local function make(dtype, shape, n, data, owner)
  local t = ctypes[dtype]()
  local f = ffi.cast(fill_ct[dtype], t)
  f.code_ = CODE[dtype]
  f.data = data
  f.n_ = n
  f.ndim_ = #shape
  for i = 1, #shape do f.dims_[i - 1] = shape[i] end
  f.anchor_ = anchor(owner)
  return t
end

-- An ffi.new array holds less than 2 GiB; a larger tensor's zeros come from calloc, freed when it is collected.
local ARRAY_MAX_BYTES = 2 ^ 31 - 1
pcall(ffi.cdef, "void *calloc(size_t count, size_t size); void free(void *p);")

local function zeros(dtype, shape, n)
  local size = ffi.sizeof(ctype_of[dtype])
  if n * size <= ARRAY_MAX_BYTES then
    local buf = array_ct[dtype](n > 0 and n or 1)
    return make(dtype, shape, n, buf, buf)
  end
  local p = ffi.C.calloc(n, size)
  if p == nil then
    raise(string.format("m3.tensor: cannot allocate %s %s (%.1f GiB)", dtype, tensor.format_shape(shape),
      n * size / 2 ^ 30))
  end
  p = ffi.gc(p, ffi.C.free)
  return make(dtype, shape, n, ffi.cast(ptr_ct[dtype], p), p)
end

-- Zeros in page-locked memory where a CUDA device is present (a batch's large arrays there upload
-- to the GPU without a staging copy), else in ordinary memory.
local function pinned_zeros(dtype, shape, n)
  local p = lib.C.m3_host_pinned_alloc(math.max(n, 1) * ffi.sizeof(ctype_of[dtype]))
  if p == nil then return zeros(dtype, shape, n) end
  return make(dtype, shape, n, ffi.cast(ptr_ct[dtype], p), ffi.gc(p, lib.C.m3_host_pinned_free))
end

function tensor.new(shape, dtype, opts)
  local n
  shape, n = check_shape(shape, "m3.tensor")
  if opts ~= nil then
    if type(opts) ~= "table" then
      raise(string.format("m3.tensor: options must be a table ({pinned = true}), got %s", type(opts)))
    end
    for k, v in pairs(opts) do
      if k ~= "pinned" then
        raise(string.format("m3.tensor: unknown option %s (the one option is pinned)", tostring(k)))
      end
      if type(v) ~= "boolean" then raise(string.format("m3.tensor: pinned must be a boolean, got %s", type(v))) end
    end
    if opts.pinned then return pinned_zeros(tensor.dtype_name(dtype), shape, n) end
  end
  return zeros(tensor.dtype_name(dtype), shape, n)
end

-- The dtype and kind ("array" with a byte size, or "pointer") of a plain FFI cdata.
local function cdata_kind(x)
  local name = tostring(ffi.typeof(x)):match("^ctype<(.*)>$")
  name = name:gsub("const ", ""):gsub("volatile ", "")
  local elem = name:match("^(.-)%s*%[[%d%?]*%]$")
  if elem then return dtype_of_cname[elem], "array" end
  elem = name:match("^(.-)%s*%*$")
  if elem then return dtype_of_cname[elem], "pointer" end
  return nil, name
end

-- Raises when cdata x (named what; part: "data" for the data of a {data =, shape =} table) is a
-- pointer: the FFI cannot tell how many elements a pointer's memory holds. dtype (default f32):
-- the element type the message suggests an array of.
local function refuse_pointer(x, what, part, dtype)
  local _, kind = cdata_kind(x)
  if kind == "pointer" then
    raise(string.format("%s: %s a pointer (%s), whose size the FFI cannot tell: pass an FFI array "
      .. "(ffi.new(\"%s[?]\", n)) or an m3.tensor", what, part and part .. " is" or "got",
      tostring(ffi.typeof(x)), ctype_of[dtype or "f32"]))
  end
end

-- Views a plain FFI array as a tensor; the array is kept alive by the view. A pointer is taken too,
-- unchecked: that it points at the shape's elements is the caller's responsibility.
function tensor.wrap(x, shape, dtype, what)
  what = what or "m3.tensor.wrap"
  if type(x) ~= "cdata" then raise(string.format("%s: expected an FFI array, got %s", what, type(x))) end
  local n
  shape, n = check_shape(shape, what)
  local have, kind = cdata_kind(x)
  if not have then
    raise(string.format("%s: expected an array of float, double, int32_t or uint8_t, got %s",
      what, tostring(ffi.typeof(x))))
  end
  if dtype ~= nil and tensor.dtype_name(dtype, what) ~= have then
    raise(string.format("%s: dtype %s does not match the array's element type (%s)", what, dtype, have))
  end
  if kind == "array" then
    local have_n = ffi.sizeof(x) / ffi.sizeof(ctype_of[have])
    if have_n < n then
      raise(string.format("%s: the array holds %d elements, the shape needs %d", what, have_n, n))
    end
  end
  return make(have, shape, n, ffi.cast(ptr_ct[have], x), x)
end

-- A view of n elements at ptr (typed or not) that keeps owner alive (used for weights).
function tensor.view(ptr, shape, dtype, owner)
  local n = 1
  for i = 1, #shape do n = n * shape[i] end
  return make(dtype, shape, n, ffi.cast(ptr_ct[dtype], ptr), owner)
end

-- A tensor for anything accepted where a tensor is: a tensor; {data = <FFI array>, shape =
-- {...}}; a nested Lua table (made as dtype); a raw FFI array whose size is exactly that of
-- shape (nil when no shape is given, so the caller can size it later). A pointer, bare or as
-- data, is an error; so is anything else: "<what>: expected <expect>, got ...".
function tensor.coerce(v, what, dtype, shape, expect)
  if tensor.is(v) then return v end
  if type(v) == "table" and type(v.data) == "cdata" then
    refuse_pointer(v.data, what, "data", dtype)
    return tensor.wrap(v.data, v.shape, nil, what)
  end
  if type(v) == "table" then return tensor.from(v, dtype, what) end
  if type(v) == "cdata" then
    refuse_pointer(v, what, nil, dtype)
    if not shape then return nil end
    local have, kind = cdata_kind(v)
    local n = 1
    for i = 1, #shape do n = n * shape[i] end
    if kind == "array" and have and ffi.sizeof(v) == n * ffi.sizeof(ctype_of[have]) then
      return make(have, shape, n, ffi.cast(ptr_ct[have], v), v)
    end
  end
  raise(string.format("%s: expected %s, got %s", what,
    expect or (shape and (dtype or "f32") .. " " .. tensor.format_shape(shape) or "a tensor"), tensor.describe(v)))
end

local function type_name(v)
  if tensor.is(v) then return "a tensor" end
  return type(v) == "nil" and "nil" or "a " .. type(v)
end

local function fill_from(dst, dtype, v, shape, depth, pos, path, what)
  local want = shape[depth]
  if type(v) ~= "table" or tensor.is(v) then
    raise(string.format("%s: element %s is %s, expected a table of %d entries "
      .. "(nested tables must be rectangular)", what, path, type_name(v), want))
  end
  local where = path == "" and "the table" or "element " .. path
  local key = key_outside_list(v)
  if key ~= nil then
    raise(string.format("%s: %s has the key %s: expected a list (keys 1 to n and no others; a dtype is an "
      .. "argument of its own)", what, where, show(key)))
  end
  if table.maxn(v) ~= #v then -- a nil inside the list: # may stop at it
    raise(string.format("%s: %s has a nil among its entries (entries up to [%d]): expected a list without holes",
      what, where, table.maxn(v)))
  end
  if #v ~= want then
    raise(string.format("%s: element %s has %d entries, expected %d (nested tables "
      .. "must be rectangular)", what, path, #v, want))
  end
  if depth == #shape then
    for i = 1, want do
      local x = v[i]
      if type(x) ~= "number" and type(x) ~= "cdata" then
        raise(string.format("%s: element %s[%d] is %s, expected a number", what, path, i, type_name(x)))
      end
      local n, why = storable(dtype, x)
      if not n then raise(string.format("%s: element %s[%d] = %s: %s", what, path, i, show(x), why)) end
      dst[pos] = n
      pos = pos + 1
    end
    return pos
  end
  for i = 1, want do pos = fill_from(dst, dtype, v[i], shape, depth + 1, pos, path .. "[" .. i .. "]", what) end
  return pos
end

-- A new tensor of dtype holding a copy of src (a tensor), converted element by element (into i32 or u8:
-- truncated toward zero, as C converts). what (default "m3.tensor") names src in messages.
function tensor.cast(src, dtype, what)
  what = what or "m3.tensor"
  if not tensor.is(src) then raise(string.format("%s: expected a tensor to convert, got %s", what, type_name(src))) end
  dtype = tensor.dtype_name(dtype, what)
  local t = zeros(dtype, src:shape(), src.n_)
  if dtype_of(src) == dtype then
    ffi.copy(t.data, src.data, src.n_ * ffi.sizeof(ctype_of[dtype]))
  elseif INT_RANGE[dtype] then -- into an integer dtype: truncated toward zero, so NaN or out of range is an error
    local s, d = src.data, t.data
    local lo, hi = INT_RANGE[dtype][1], INT_RANGE[dtype][2]
    for i = 0, src.n_ - 1 do
      local v = s[i]
      if not (v > lo - 1 and v < hi + 1) then
        raise(string.format("%s: converting to %s: element %d = %s is outside [%d, %d]", what, dtype, i, show(v),
          lo, hi))
      end
      d[i] = v
    end
  else
    local s, d = src.data, t.data
    local narrowing = dtype == "f32" and dtype_of(src) == "f64"
    for i = 0, src.n_ - 1 do
      local v = s[i]
      if narrowing and f32_overflows(v) then
        raise(string.format("%s: converting to f32: element %d = %s is outside float32's range", what, i, show(v)))
      end
      d[i] = v
    end
  end
  return t
end

-- A new tensor from a (nested, rectangular) table of numbers, or a converted copy of a tensor or of
-- {data = <FFI array>, shape = {...}}. what (default "m3.tensor.from") names the value in messages: the
-- library passes the caller's name for it.
function tensor.from(v, dtype, what)
  what = what or "m3.tensor.from"
  dtype = tensor.dtype_name(dtype, what)
  if tensor.is(v) then return tensor.cast(v, dtype, what) end
  if type(v) == "table" and type(v.data) == "cdata" then
    refuse_pointer(v.data, what, "data", dtype)
    return tensor.cast(tensor.wrap(v.data, v.shape, nil, what), dtype, what)
  end
  if type(v) ~= "table" then
    raise(what .. ": expected a (nested) table of numbers or a tensor, got " .. type(v))
  end
  local shape, x = {}, v
  while type(x) == "table" and #shape <= MAXDIM do -- a table nested in itself stops here (check_shape names it)
    shape[#shape + 1] = #x
    if #x == 0 then
      if next(x) ~= nil then -- keys but no list: not an empty tensor
        raise(string.format("%s: expected a (nested) list of numbers, got a table with key %s", what, show(next(x))))
      end
      break
    end
    x = x[1]
  end
  local n
  shape, n = check_shape(shape, what)
  local t = zeros(dtype, shape, n)
  fill_from(t.data, dtype, v, shape, 1, 0, "", what)
  return t
end

-- ---- methods -------------------------------------------------------------------------------

function methods.shape(t)
  local s = {}
  for i = 1, t.ndim_ do s[i] = t.dims_[i - 1] end
  return s
end

function methods.numel(t) return t.n_ end

function methods.dtype(t) return dtype_of(t) end

function methods.clone(t) return tensor.cast(t, dtype_of(t)) end

local function build(data, shape, depth, pos)
  local out, d = {}, shape[depth]
  if depth == #shape then
    for i = 1, d do out[i] = data[pos + i - 1] end
    return out, pos + d
  end
  for i = 1, d do out[i], pos = build(data, shape, depth + 1, pos) end
  return out, pos
end

function methods.to_table(t)
  local shape = t:shape()
  if #shape == 0 then return { t.data[0] } end
  return (build(t.data, shape, 1, 0))
end

-- A method called with a dot (t.shape()) gets no tensor: that is said, instead of an error inside it.
for name, method in pairs(methods) do
  methods[name] = function(t, ...)
    if not tensor.is(t) then
      raise(string.format("tensor:%s: expected a tensor as self, got %s: call it with a colon, t:%s()", name,
        type_name(t), name))
    end
    return method(t, ...)
  end
end

local SHOW = 8

function tensor.format_shape(shape)
  local dims = {}
  for i = 1, #shape do dims[i] = show(shape[i]) end
  return "[" .. table.concat(dims, ", ") .. "]"
end

-- "m3.tensor(f32 [2, 2]: 1, 2, 3, 4)": dtype, shape and the first SHOW values (what tostring(t) gives).
function tensor.tostring(t)
  if not tensor.is(t) then raise("m3.tensor.tostring: expected a tensor, got " .. type_name(t)) end
  local dtype = dtype_of(t)
  local vals, n = {}, math.min(t.n_, SHOW)
  local fmt = (dtype == "f32" or dtype == "f64") and "%.6g" or "%d"
  for i = 0, n - 1 do vals[#vals + 1] = string.format(fmt, t.data[i]) end
  if t.n_ > SHOW then vals[#vals + 1] = "..." end
  return string.format("m3.tensor(%s %s: %s)", dtype, tensor.format_shape(t:shape()), table.concat(vals, ", "))
end

-- "f32 [4, 32]" for a tensor; a short description of anything else (for error messages).
function tensor.describe(v)
  if tensor.is(v) then return dtype_of(v) .. " " .. tensor.format_shape(v:shape()) end
  if type(v) == "cdata" then return tostring(ffi.typeof(v)) end
  return type_name(v)
end

return setmetatable(tensor, { __call = function(_, shape, dtype, opts) return tensor.new(shape, dtype, opts) end })

-- m3.tensor and m3.load_tensors / m3.save_tensors: constructors, shapes, dtypes, bounds checks,
-- messages (every digit of a value; methods called with a dot), printing, nested tables, FFI
-- wraps (pointers refused where a value's data is copied), and safetensors round trips and
-- conversions (names and metadata that are not UTF-8 refused when saving).

local ffi = require "ffi"
local m3 = require "m3"
local helper = require "spec.helper"

describe("m3.lib", function()
  it("refuses a build whose ABI differs from the sources', naming both numbers and the path", function()
    local lib = require "m3.lib"
    local code = [[
      local cdef = require "m3.cdef"
      package.loaded["m3.cdef"] = { abi = cdef.abi + 1000, library = cdef.library, cdef = cdef.cdef }
      local ok, err = pcall(require, "m3.lib")
      io.write(ok and "loaded" or err)
    ]]
    local cmd = string.format("cd %q && LUA_PATH=%q luajit -e %q 2>&1", helper.repo_dir(), package.path, code)
    local p = io.popen(cmd)
    local out = p:read("*a")
    p:close()
    assert.matches("is for ABI version " .. (lib.abi + 1000) .. " but these Lua sources need " .. lib.abi, out)
    assert.matches("libm3", out)
  end)
end)

describe("m3.tensor", function()
  it("makes zero tensors of each dtype and alias", function()
    for dtype, want in pairs({ f32 = "f32", float32 = "f32", float = "f32", f64 = "f64", float64 = "f64",
                               double = "f64", i32 = "i32", int32 = "i32", u8 = "u8", uint8 = "u8" }) do
      local t = m3.tensor({ 2, 3 }, dtype)
      assert.equal(want, t:dtype())
      assert.same({ 2, 3 }, t:shape())
      assert.equal(6, t:numel())
      assert.equal(6, #t)
      for i = 0, 5 do assert.equal(0, t[i]) end
    end
    assert.equal("f32", m3.tensor({ 4 }):dtype())
    assert.same({ 0, 3 }, m3.tensor({ 0, 3 }):shape())
  end)

  it("makes pinned zero tensors (page-locked with a CUDA device, else ordinary memory)", function()
    for _, dtype in ipairs({ "f32", "i32", "u8" }) do
      local t = m3.tensor({ 3, 5 }, dtype, { pinned = true })
      assert.equal(dtype, t:dtype())
      assert.same({ 3, 5 }, t:shape())
      for i = 0, 14 do assert.equal(0, t[i]) end
      t[14] = 7
      assert.equal(7, t[14])
      assert.same(t:to_table(), t:clone():to_table())
    end
    assert.same({ 0 }, m3.tensor({ 0 }, "f32", { pinned = true }):shape())
    assert.equal(0, m3.tensor({ 2 }, "f32", { pinned = false })[1])
    assert.matches("unknown option pined", helper.error_of(m3.tensor, { 2 }, "f32", { pined = true }))
    assert.matches("pinned must be a boolean", helper.error_of(m3.tensor, { 2 }, "f32", { pinned = 1 }))
    assert.matches("options must be a table", helper.error_of(m3.tensor, { 2 }, "f32", "pinned"))
  end)

  it("rejects bad shapes and dtypes with a clear error", function()
    assert.matches("shape%[2%] = %-1", helper.error_of(m3.tensor, { 2, -1 }))
    assert.matches("shape%[1%] = 1.5", helper.error_of(m3.tensor, { 1.5 }))
    assert.matches('shape%[1%] = "2"', helper.error_of(m3.tensor, { "2" }))
    assert.matches("unknown dtype f16", helper.error_of(m3.tensor, { 2 }, "f16"))
    -- a nil among the dims, where # may stop at it: refused, not a tensor of fewer dims
    assert.matches("m3.tensor: shape has a nil among its dims %(dims up to %[3%]%)",
      helper.error_of(m3.tensor, { 2, nil, 3 }))
    -- a dim above 2^53 is refused even where another dim is 0 (no exact double, no safetensors dim)
    assert.matches("m3.tensor: shape%[2%] = 1.152921504606847e%+18: expected an integer in %[0, 2%^53%]",
      helper.error_of(m3.tensor, { 0, 2 ^ 60 }))
    assert.same({ 2 ^ 53, 0 }, m3.tensor({ 2 ^ 53, 0 }):shape())
    assert.matches("m3.tensor: shape %[9007199254740992, 1%] holds 9007199254740992 elements",
      helper.error_of(m3.tensor, { 2 ^ 53, 1 }))
    assert.matches("shape%[1%] = nan: expected an integer", helper.error_of(m3.tensor, { 0 / 0 }))
    assert.matches("m3.tensor: shape %[1073741824, 1073741824, 1073741824%] holds 1.2379400392853803e%+27 elements, "
      .. "expected fewer than 2%^53", helper.error_of(m3.tensor, { 2 ^ 30, 2 ^ 30, 2 ^ 30 }))
    -- shapes in messages carry every digit
    assert.matches("cannot allocate f32 %[4503599627370497%]", helper.error_of(m3.tensor, { 2 ^ 52 + 1 }))
  end)

  it("says so when a method is called with a dot, and when cast gets no tensor", function()
    local t = m3.tensor({ 2 })
    for _, name in ipairs({ "shape", "numel", "dtype", "clone", "to_table" }) do
      assert.matches("tensor:" .. name .. ": expected a tensor as self, got nil: call it with a colon, t:" .. name
        .. "%(%)", helper.error_of(function() return t[name]() end))
    end
    assert.matches("^[^\n]-tensor_spec.lua:%d+: tensor:shape: expected a tensor as self, got a table",
      helper.error_of(function() local shape = t.shape({}) return shape end))
    assert.matches("m3.tensor: expected a tensor to convert, got a table",
      helper.error_of(m3.tensor.cast, { 1, 2 }, "f32"))
  end)

  it("checks bounds on 0-based flat access", function()
    local t = m3.tensor({ 2, 2 })
    t[3] = 4.5
    assert.equal(4.5, t[3])
    assert.matches("index 4 out of range %[0, 4%)", helper.error_of(function() return t[4] end))
    assert.matches("index %-1 out of range", helper.error_of(function() t[-1] = 1 end))
    assert.matches("not an integer", helper.error_of(function() return t[0.5] end))
    assert.matches("cannot set field", helper.error_of(function() t.foo = 1 end))
    -- a name that is not a method reads as an error too, not as nil
    assert.matches('tensor: no method or field "foo"', helper.error_of(function() return t.foo end))
    assert.matches('tensor: no method or field "1"', helper.error_of(function() return t["1"] end))
    assert.matches("tensor: no method or field true", helper.error_of(function() return t[true] end))
    -- the struct's own fields are set once: a NULL data or a larger count would let t[i] read any address
    assert.matches("constant location", helper.error_of(function() t.data = nil end))
    assert.matches("constant location", helper.error_of(function() t.n_ = 1e9 end))
    assert.matches("constant location", helper.error_of(function() t.dims_[0] = 9 end))
    assert.same({ 2, 2 }, t:shape())
    assert.matches("m3.tensor: shape has the key 0: expected a list of integers",
      helper.error_of(m3.tensor, { [0] = 5, 2, 2 }))
    assert.matches('shape has the key "dtype"', helper.error_of(m3.tensor, { 2, 2, dtype = "i32" }))
    -- 64-bit integer cdata index like the numbers they hold
    t[2LL] = 1.5
    assert.same({ 1.5, 4.5 }, { t[2ULL], t[3LL] })
    assert.matches("index 4 out of range %[0, 4%)", helper.error_of(function() return t[4LL] end))
  end)

  it("points errors at the caller's line", function()
    local t = m3.tensor({ 1 })
    local err = helper.error_of(function() return t[7] end)
    assert.matches("tensor_spec.lua:%d+: ", err)
  end)

  it("builds from nested tables and converts back", function()
    local src = { { { 1, 2 }, { 3, 4 }, { 5, 6 } }, { { 7, 8 }, { 9, 10 }, { 11, 12 } } }
    local t = m3.tensor.from(src, "i32")
    assert.same({ 2, 3, 2 }, t:shape())
    assert.equal("i32", t:dtype())
    assert.equal(6, t[5])
    assert.same(src, t:to_table())
    local flat = m3.tensor.from({ 0.5, -1.25 })
    assert.equal("f32", flat:dtype())
    assert.same({ 0.5, -1.25 }, flat:to_table())
    assert.same({ 0 }, m3.tensor.from({}):shape())
  end)

  it("rejects ragged and non-numeric nested tables", function()
    assert.matches("element %[2%] has 1 entries, expected 2", helper.error_of(m3.tensor.from, { { 1, 2 }, { 3 } }))
    assert.matches("element %[1%]%[2%] is a string", helper.error_of(m3.tensor.from, { { 1, "x" } }))
    assert.matches("element %[2%] is a number, expected a table",
      helper.error_of(m3.tensor.from, { { 1, 2 }, 3 }))
    -- a nil inside a list, where # may stop at it: refused, not a shorter tensor
    assert.matches("m3.tensor.from: the table has a nil among its entries %(entries up to %[3%]%)",
      helper.error_of(m3.tensor.from, { 1, nil, 3 }))
    local row = { 1 }
    row[3] = 3 -- # is 1 here
    assert.matches("element %[2%] has a nil among its entries",
      helper.error_of(m3.tensor.from, { { 1, 2, 3 }, row }))
    -- a named or non-integer key would be dropped: refused (a dtype given inside the table above all)
    assert.matches("m3.tensor.from: the table has the key \"dtype\": expected a list %(keys 1 to n and no others; a "
      .. "dtype is an argument of its own%)", helper.error_of(m3.tensor.from, { 1, 2, dtype = "i32" }))
    assert.matches("element %[2%] has the key \"x\"", helper.error_of(m3.tensor.from, { { 1, 2 }, { 3, 4, x = 5 } }))
    assert.matches("the table has the key 2.5", helper.error_of(m3.tensor.from, { 1, 2, [2.5] = 3 }))
    assert.matches("the table has the key 0", helper.error_of(m3.tensor.from, { 1, 2, [0] = 3 }))
    local loop = {}
    loop[1] = loop -- nested without end: refused at the ninth level, not followed forever
    assert.matches("m3.tensor.from: at most 8 dims, got 9", helper.error_of(m3.tensor.from, loop))
  end)

  it("clones into independent memory and converts dtypes", function()
    local t = m3.tensor.from({ 1.5, 2.5 })
    local c = t:clone()
    c[0] = 9
    assert.equal(1.5, t[0])
    local i = m3.tensor.from(t, "i32")
    assert.same({ 1, 2 }, i:to_table())
    assert.same({ 255, 0 }, m3.tensor.from(m3.tensor.from({ 255.9, -0.9 }), "u8"):to_table())
    for _, bad in ipairs({ 0 / 0, 256, -1, math.huge }) do
      assert.matches("converting to u8: element 1 = .* is outside %[0, 255%]",
        helper.error_of(m3.tensor.from, m3.tensor.from({ 1, bad }, "f64"), "u8"))
    end
    assert.matches("converting to i32: element 0 = 2147483648 is outside",
      helper.error_of(m3.tensor.from, m3.tensor.from({ 2 ^ 31 }, "f64"), "i32"))
    assert.matches("converting to u8: element 0 = 300 is outside",
      helper.error_of(m3.tensor.from, m3.tensor.from({ 300 }, "i32"), "u8"))
  end)

  it("stores only values an element holds: whole numbers in range for i32 and u8, numbers for f32", function()
    local i, u, f = m3.tensor({ 2 }, "i32"), m3.tensor({ 2 }, "u8"), m3.tensor({ 2 })
    i[0], i[1], u[0], u[1], f[0] = -2147483648, 2147483647, 0, 255, 0 / 0
    assert.same({ -2147483648, 2147483647 }, i:to_table())
    assert.same({ 0, 255 }, u:to_table())
    for _, bad in ipairs({ 1.7, 0 / 0, 2 ^ 31, -2 ^ 31 - 1, math.huge }) do
      assert.matches("tensor%[1%] = .*: expected an integer in %[%-2147483648, 2147483647%] %(i32%)",
        helper.error_of(function() i[1] = bad end))
    end
    assert.equal(2147483647, i[1])
    assert.matches("tensor%[0%] = 256: expected an integer in %[0, 255%] %(u8%)", helper.error_of(function() u[0] = 256 end))
    assert.matches('tensor%[1%] = "x": expected a number', helper.error_of(function() f[1] = "x" end))
    assert.matches("tensor%[1%] = true: expected a number", helper.error_of(function() i[1] = true end))
    -- FFI number cdata are checked as the numbers they hold; other cdata are no numbers
    u[1] = ffi.new("int64_t", 7)
    i[0] = 3LL
    assert.same({ 3, 7 }, { i[0], u[1] })
    assert.matches("tensor%[0%] = 300LL: expected an integer in %[0, 255%]", helper.error_of(function() u[0] = 300LL end))
    assert.matches("tensor%[0%] = 1099511627781LL: expected an integer",
      helper.error_of(function() i[0] = 2 ^ 40 + 5LL end))
    assert.matches("tensor%[0%] = .*: expected an integer", helper.error_of(function() i[0] = ffi.new("double", 1.7) end))
    assert.matches("tensor%[0%] = .*: expected a number", helper.error_of(function() f[0] = ffi.new("int[1]") end))
    assert.matches("tensor_spec.lua:%d+: ", helper.error_of(function() f[0] = ffi.new("int[1]") end))
    assert.matches("tensor_spec.lua:%d+: ", helper.error_of(function() i[1] = 0.5 end))
    assert.matches("element %[1%]%[2%] = 1.5: expected an integer",
      helper.error_of(m3.tensor.from, { { 1, 1.5 } }, "i32"))
    assert.matches("element %[1%] = %-1: expected an integer in %[0, 255%]", helper.error_of(m3.tensor.from, { -1 }, "u8"))
    -- values and indices in messages carry every digit: 3.0000000000000004 is not shown as the integer 3
    assert.matches("element %[1%] = 3.0000000000000004: expected an integer",
      helper.error_of(m3.tensor.from, { 0.1 * 3 * 10 }, "i32"))
    assert.matches("tensor index 1000000000000000.5 is not an integer",
      helper.error_of(function() return i[1e15 + 0.5] end))
    assert.matches("tensor index 4503599627370497 out of range", helper.error_of(function() return i[2 ^ 52 + 1] end))
    -- f32: a finite number that would round to an infinity is refused; NaN and inf stay what they are
    f[1] = 3.4028234663852886e38
    assert.matches("tensor%[1%] = .*: outside float32's range", helper.error_of(function() f[1] = 3.4028235677973366e38 end))
    assert.matches("element %[1%] = 1e%+300: outside float32's range", helper.error_of(m3.tensor.from, { 1e300 }))
    assert.matches("converting to f32: element 1 = %-1e%+39 is outside float32's range",
      helper.error_of(m3.tensor.cast, m3.tensor.from({ 1, -1e39 }, "f64"), "f32"))
    local kept = m3.tensor.cast(m3.tensor.from({ 0 / 0, -math.huge }, "f64"), "f32")
    assert.is_true(kept[0] ~= kept[0])
    assert.equal(-math.huge, kept[1])
  end)

  it("holds tensors of 2 GiB and more (beyond one ffi.new array)", function()
    local big = m3.tensor({ 2 ^ 29 + 1 })
    assert.equal(2 ^ 29 + 1, #big)
    assert.equal(0, big[2 ^ 29])
    big[2 ^ 29] = 3.5
    assert.equal(3.5, big[2 ^ 29])
    assert.matches("cannot allocate f32 %[1099511627776%]", helper.error_of(m3.tensor, { 2 ^ 40 }))
  end)

  it("wraps plain FFI arrays as views and checks their size", function()
    local a = ffi.new("double[6]", 1, 2, 3, 4, 5, 6)
    local t = m3.tensor.wrap(a, { 3, 2 })
    assert.equal("f64", t:dtype())
    t[0] = 10
    assert.equal(10, a[0])
    local v = m3.tensor.wrap(ffi.new("uint8_t[?]", 4), { 4 })
    collectgarbage()
    collectgarbage()
    v[3] = 7
    assert.equal(7, v[3])
    assert.matches("holds 6 elements, the shape needs 8", helper.error_of(m3.tensor.wrap, a, { 8 }))
    assert.matches("does not match", helper.error_of(m3.tensor.wrap, a, { 6 }, "f32"))
    -- a pointer too, unchecked: its memory is the caller's to size
    local p = m3.tensor.wrap(ffi.cast("double *", a), { 2 })
    assert.equal(2, p[1])
  end)

  it("copies no pointer, whose size the FFI cannot tell, where it takes a value's data", function()
    local a = ffi.new("float[4]", 1, 2, 3, 4)
    assert.matches("m3.tensor.from: data is a pointer %(ctype<float %*>%), whose size the FFI cannot tell: pass an "
      .. "FFI array", helper.error_of(m3.tensor.from, { data = ffi.cast("float *", a), shape = { 4 } }))
    assert.matches("m3.tensor.from: data is a pointer %(ctype<void %*>%)",
      helper.error_of(m3.tensor.from, { data = ffi.cast("void *", a), shape = { 4 } }))
    assert.same({ 1, 2, 3, 4 }, m3.tensor.from({ data = a, shape = { 4 } }):to_table())
  end)

  it("prints dtype, shape and a few values", function()
    local s = tostring(m3.tensor.from({ { 1, 2 }, { 3, 4 } }))
    assert.matches("f32", s)
    assert.matches("%[2, 2%]", s)
    assert.matches("1, 2, 3, 4", s)
    -- m3.tensor.tostring(t) is tostring(t), with the tensor's own dtype and values
    local f = m3.tensor.from({ 1.5, -2 }, "f64")
    assert.equal("m3.tensor(f64 [2]: 1.5, -2)", m3.tensor.tostring(f))
    assert.equal(tostring(f), m3.tensor.tostring(f))
    assert.equal("m3.tensor(u8 [0, 3]: )", tostring(m3.tensor({ 0, 3 }, "u8")))
    local big = tostring(m3.tensor.from({ { 1, 2, 3, 4, 5 }, { 6, 7, 8, 9, 10 } }, "i32"))
    assert.equal("m3.tensor(i32 [2, 5]: 1, 2, 3, 4, 5, 6, 7, 8, ...)", big)
    -- eight values are all shown, without "..."; floats in %g's default six digits
    assert.equal("m3.tensor(i32 [8]: 1, 2, 3, 4, 5, 6, 7, 8)", tostring(m3.tensor.from({ 1, 2, 3, 4, 5, 6, 7, 8 }, "i32")))
    assert.equal("m3.tensor(f64 [2]: 0.333333, 1e+20)", tostring(m3.tensor.from({ 1 / 3, 1e20 }, "f64")))
    assert.matches("m3.tensor.tostring: expected a tensor, got a table", helper.error_of(m3.tensor.tostring, { 1 }))
  end)
end)

-- A safetensors file written byte by byte (dtype names and raw little-endian values).
local function write_safetensors(path, entries)
  local header, data, offset = {}, {}, 0
  for i, e in ipairs(entries) do
    header[i] = string.format('"%s":{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}', e.name, e.dtype,
      table.concat(e.shape, ","), offset, offset + #e.bytes)
    data[i] = e.bytes
    offset = offset + #e.bytes
  end
  local h = "{" .. table.concat(header, ",") .. "}"
  h = h .. string.rep(" ", (8 - #h % 8) % 8)
  local len = ffi.new("uint64_t[1]", #h)
  local f = assert(io.open(path, "wb"))
  f:write(ffi.string(len, 8), h, table.concat(data))
  f:close()
end

local function raw(ctype, values)
  local a = ffi.new(ctype .. "[?]", #values, values)
  return ffi.string(a, ffi.sizeof(a))
end

describe("m3.load_tensors / m3.save_tensors", function()
  after_each(helper.cleanup)

  it("round-trips every dtype and the metadata exactly", function()
    local path = helper.tmpname(".safetensors")
    local src = {
      a = m3.tensor.from({ { 1.5, -2 }, { 3.25, 1e-30 } }),
      b = m3.tensor.from({ 1 / 3, -1e300 }, "f64"),
      c = m3.tensor.from({ -7, 2147483647 }, "i32"),
      d = m3.tensor.from({ 0, 255, 3 }, "u8"),
    }
    m3.save_tensors(path, src, { note = "hello", n = 3 })
    local got, meta = m3.load_tensors(path)
    for k, t in pairs(src) do
      assert.equal(t:dtype(), got[k]:dtype())
      assert.same(t:shape(), got[k]:shape())
      assert.equal(helper.bytes(t), helper.bytes(got[k]))
    end
    assert.equal("hello", meta.note)
    assert.equal("3", meta.n)
  end)

  it("saves {data = <FFI array>, shape = ...} tables as their arrays, and metadata numbers exactly", function()
    local path = helper.tmpname(".safetensors")
    m3.save_tensors(path, { a = { data = ffi.new("float[4]", { 1, 2, 3, 4 }), shape = { 2, 2 } },
      b = { data = ffi.new("double[2]", { 5, 6 }), shape = { 2 } } },
      { x = 0.1 + 0.2, big = 2 ^ 60 + 2 ^ 10, lr = 0.1, flag = true })
    local got, meta = m3.load_tensors(path)
    assert.same({ 2, 2 }, got.a:shape())
    assert.same({ { 1, 2 }, { 3, 4 } }, got.a:to_table())
    assert.equal("f64", got.b:dtype())
    assert.same({ 5, 6 }, got.b:to_table())
    assert.equal(0.1 + 0.2, tonumber(meta.x))
    assert.equal(2 ^ 60 + 2 ^ 10, tonumber(meta.big))
    assert.equal("0.1", meta.lr)
    assert.equal("true", meta.flag)
  end)

  it("refuses names and metadata with NUL bytes and values that are no tensor, naming them", function()
    local path = helper.tmpname(".safetensors")
    assert.matches('tensor name "a\\0b" holds a NUL byte', helper.error_of(m3.save_tensors, path, { ["a\0b"] = { 1 } }))
    assert.matches('metadata%["k"%] "v\\0" holds a NUL byte',
      helper.error_of(m3.save_tensors, path, { a = { 1 } }, { k = "v\0" }))
    assert.matches('tensor "bad": expected a tensor', helper.error_of(m3.save_tensors, path, { good = { 1 }, bad = "oops" }))
    assert.matches("metadata keys must be strings, got number 1", helper.error_of(m3.save_tensors, path, { a = { 1 } }, { "x" }))
    assert.matches('m3.save_tensors: tensor "a": expected a tensor, .* got ctype<float %[3%]> without a shape',
      helper.error_of(m3.save_tensors, path, { a = ffi.new("float[3]") }))
    assert.matches("expected a %(nested%) list of numbers, got a table with key",
      helper.error_of(m3.tensor.from, { data = 1 }))
    assert.is_false(io.open(path) ~= nil)
  end)

  it("refuses names and metadata that are not UTF-8 (other readers refuse such a header) and an empty path, "
    .. "writing nothing", function()
    local path = helper.tmpname(".safetensors")
    local latin1 = "caf\233" -- a Latin-1 name: UTF-8 has no lone 0xE9
    for _, case in ipairs {
      { { [latin1] = { 1 } }, nil, 'tensor name "caf\\xe9" is not UTF%-8 %(byte 3 is 0xe9%)' },
      { { a = { 1 } }, { [latin1] = "v" }, 'metadata key "caf\\xe9" is not UTF%-8 %(byte 3 is 0xe9%)' },
      { { a = { 1 } }, { k = "\237\160\128" }, 'metadata "k": the value "\\xed\\xa0\\x80" is not UTF%-8 %(byte 0' },
    } do
      local err = helper.error_of(m3.save_tensors, path, case[1], case[2])
      assert.matches("^m3: " .. case[3] .. "[^:]*: a safetensors header is JSON text, which must be UTF%-8", err)
      assert.is_nil(io.open(path))
    end
    assert.matches("m3_tensor_writer_write: the path is empty: expected a file name",
      helper.error_of(m3.save_tensors, "", { a = { 1 } }))
    local utf8 = "caf\195\169 \226\130\172"
    m3.save_tensors(path, { [utf8] = { 1 } }, { [utf8] = utf8 })
    local got, meta = m3.load_tensors(path)
    assert.same({ 1 }, got[utf8]:to_table())
    assert.equal(utf8, meta[utf8])
  end)

  it("converts F16, BF16, BOOL and the integer types", function()
    local path = helper.tmpname(".safetensors")
    write_safetensors(path, {
      { name = "h", dtype = "F16", shape = { 5 }, bytes = raw("uint16_t", { 0x3C00, 0xC000, 0x0001, 0x7C00, 0x3555 }) },
      { name = "bf", dtype = "BF16", shape = { 2 }, bytes = raw("uint16_t", { 0x3F80, 0xC0A0 }) },
      { name = "l", dtype = "I64", shape = { 2 }, bytes = raw("int64_t", { -5, 2147483647 }) },
      { name = "s", dtype = "I16", shape = { 2 }, bytes = raw("int16_t", { -300, 300 }) },
      { name = "q", dtype = "I8", shape = { 1 }, bytes = raw("int8_t", { -128 }) },
      { name = "us", dtype = "U16", shape = { 1 }, bytes = raw("uint16_t", { 65535 }) },
      { name = "ui", dtype = "U32", shape = { 1 }, bytes = raw("uint32_t", { 4000000 }) },
      { name = "flag", dtype = "BOOL", shape = { 2 }, bytes = raw("uint8_t", { 1, 0 }) },
    })
    local t = m3.load_tensors(path)
    assert.equal("f32", t.h:dtype())
    assert.same({ 1, -2, 2 ^ -24, math.huge }, { t.h[0], t.h[1], t.h[2], t.h[3] })
    assert.near(0.33325195, t.h[4], 1e-8)
    assert.same({ 1, -5 }, t.bf:to_table())
    assert.equal("i32", t.l:dtype())
    assert.same({ -5, 2147483647 }, t.l:to_table())
    assert.same({ -300, 300 }, t.s:to_table())
    assert.same({ -128 }, t.q:to_table())
    assert.same({ 65535 }, t.us:to_table())
    assert.same({ 4000000 }, t.ui:to_table())
    assert.equal("u8", t.flag:dtype())
    assert.same({ 1, 0 }, t.flag:to_table())
  end)

  it("converts F16's -0, NaN and subnormals, and the int32 ends of wider integers", function()
    local path = helper.tmpname(".safetensors")
    write_safetensors(path, {
      { name = "h", dtype = "F16", shape = { 4 }, bytes = raw("uint16_t", { 0x8000, 0x7E00, 0xFC00, 0x8001 }) },
      { name = "l", dtype = "I64", shape = { 2 }, bytes = raw("int64_t", { -2147483648, 2147483647 }) },
    })
    local t = m3.load_tensors(path)
    assert.equal(-math.huge, 1 / t.h[0])          -- -0
    assert.is_true(t.h[1] ~= t.h[1])              -- NaN
    assert.same({ -math.huge, -2 ^ -24 }, { t.h[2], t.h[3] })
    assert.same({ -2147483648, 2147483647 }, t.l:to_table())
    for _, case in ipairs {
      { "I64", "int64_t", -2147483649, "-2147483649" }, { "U32", "uint32_t", 4294967295, "4294967295" },
      { "U64", "uint64_t", 2147483648, "2147483648" },
    } do
      write_safetensors(path, { { name = "w", dtype = case[1], shape = { 1 }, bytes = raw(case[2], { case[3] }) } })
      local err = helper.error_of(m3.load_tensors, path)
      assert.truthy(err:find('m3.load_tensors: tensor "w" (' .. case[1] .. ") element 0 = " .. case[4]
        .. " does not fit in int32", 1, true), err)
    end
  end)

  it("writes tensors in the order of their names, whatever the table's order", function()
    local path = helper.tmpname(".safetensors")
    local names = { "zeta", "b", "a", "mm", "c", "x1", "x0", "delta", "k" }
    local ts = {}
    for i, name in ipairs(names) do ts[name] = { i } end
    m3.save_tensors(path, ts)
    local f = assert(io.open(path, "rb"))
    local bytes = f:read("*a")
    f:close()
    local n = 0
    for i = 1, 8 do n = n + bytes:byte(i) * 256 ^ (i - 1) end
    local header = require("m3.json").decode(bytes:sub(9, 8 + n))
    table.sort(names)
    for i, name in ipairs(names) do
      assert.same({ (i - 1) * 4, i * 4 }, header[name].data_offsets, name)
    end
  end)

  it("refuses integers that do not fit in int32, naming the tensor", function()
    local path = helper.tmpname(".safetensors")
    write_safetensors(path, { { name = "big", dtype = "I64", shape = { 2 }, bytes = raw("int64_t", { 1, 2 ^ 40 }) } })
    local err = helper.error_of(m3.load_tensors, path)
    assert.matches('"big"', err)
    assert.matches("int32", err)
  end)

  it("reports missing and malformed files", function()
    assert.matches("^.-m3: ", helper.error_of(m3.load_tensors, "/nonexistent/x.safetensors"))
    local path = helper.tmpname(".safetensors")
    local f = assert(io.open(path, "wb"))
    f:write("garbage")
    f:close()
    assert.matches("m3: ", helper.error_of(m3.load_tensors, path))
  end)
end)

-- m3.states on its own (SPEC.md §4 shapes, batch first): a config whose headdim P and d_state N
-- differ, so that k [B, H, N] and v [B, H, P] cannot be mistaken for each other.
describe("m3.tensor of no dims", function()
  it("holds one element, which to_table gives as a list of one", function()
    local t = m3.tensor({})
    assert.equal(1, t:numel())
    t[0] = 5
    assert.same({ 5 }, t:to_table())
    assert.same({}, t:shape())
  end)
end)

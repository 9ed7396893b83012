-- m3.json — a small JSON encoder and decoder for metrics, results and run markers.
--
-- encode: tables with keys 1..n (and nothing else) become arrays, other tables objects
-- with their keys sorted (so files are stable and diffable; two keys with one name, 1 and
-- "1", are an error); numbers as m3.number_text.exact writes them (they read back
-- exactly); NaN and ±inf become null; an empty table is an object ({}) unless it carries
-- json.array's marker.
-- decode: the full JSON grammar; null becomes json.null (a sentinel), so arrays keep
-- their length. Errors name the position and what was expected.

local fs = require "m3.fs"
local lib = require "m3.lib"
local exact = require("m3.number_text").exact

lib.internal_file(debug.getinfo(1, "S").source)

local json = {}

json.null = setmetatable({}, { __tostring = function() return "null" end })
local array_mark = {}

-- Marks t (possibly empty) as an array for encode.
function json.array(t)
  return setmetatable(t or {}, array_mark)
end

local escapes = {
  ['"'] = '\\"', ["\\"] = "\\\\", ["\b"] = "\\b", ["\f"] = "\\f",
  ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t",
}

local function encode_string(s)
  return '"' .. s:gsub('[%c"\\]', function(c)
    return escapes[c] or string.format("\\u%04x", c:byte())
  end) .. '"'
end

local function encode_number(x)
  if x ~= x or x == math.huge or x == -math.huge then return "null" end
  return exact(x)
end

local function is_array(t)
  local n = #t
  if n == 0 then return getmetatable(t) == array_mark end
  local count = 0
  for _ in pairs(t) do count = count + 1 end
  return count == n
end

local encode_value

local function encode_table(t, out, seen)
  if seen[t] then error("json.encode: cannot encode a table that contains itself", 0) end
  seen[t] = true
  if is_array(t) then
    out[#out + 1] = "["
    for i = 1, #t do
      if i > 1 then out[#out + 1] = "," end
      encode_value(t[i], out, seen)
    end
    out[#out + 1] = "]"
  else
    local keys, key_of = {}, {}
    for k in pairs(t) do
      if type(k) ~= "string" and type(k) ~= "number" then
        error("json.encode: object keys must be strings or numbers, got " .. type(k), 0)
      end
      local text = tostring(k)
      if key_of[text] ~= nil then -- 1 and "1": the object would hold the name twice and lose a value
        local function show(key) return type(key) == "string" and string.format("%q", key) or tostring(key) end
        error(string.format("json.encode: keys %s and %s are both the object name %q", show(key_of[text]), show(k),
          text), 0)
      end
      key_of[text] = k
      keys[#keys + 1] = text
    end
    table.sort(keys)
    out[#out + 1] = "{"
    for i, text in ipairs(keys) do
      local k = key_of[text]
      if i > 1 then out[#out + 1] = "," end
      out[#out + 1] = encode_string(text)
      out[#out + 1] = ":"
      encode_value(t[k], out, seen)
    end
    out[#out + 1] = "}"
  end
  seen[t] = nil
end

function encode_value(v, out, seen)
  local ty = type(v)
  if v == nil or v == json.null then
    out[#out + 1] = "null"
  elseif ty == "boolean" then
    out[#out + 1] = tostring(v)
  elseif ty == "number" then
    out[#out + 1] = encode_number(v)
  elseif ty == "string" then
    out[#out + 1] = encode_string(v)
  elseif ty == "table" then
    encode_table(v, out, seen)
  elseif ty == "cdata" and tonumber(v) then
    out[#out + 1] = encode_number(tonumber(v))
  else
    error("json.encode: cannot encode a " .. ty, 0)
  end
end

function json.encode(v)
  local out = {}
  encode_value(v, out, {})
  return table.concat(out)
end

-- ---- decoding ------------------------------------------------------------------------------

local function fail(s, pos, what)
  error(string.format("json.decode: expected %s at position %d (near %q)", what, pos,
    s:sub(pos, pos + 10)), 0)
end

local function skip(s, pos)
  return s:find("[^ \t\r\n]", pos) or #s + 1
end

local decode_value

local function utf8_char(code)
  if code < 0x80 then return string.char(code) end
  if code < 0x800 then
    return string.char(0xC0 + math.floor(code / 64), 0x80 + code % 64)
  end
  if code < 0x10000 then
    return string.char(0xE0 + math.floor(code / 4096), 0x80 + math.floor(code / 64) % 64,
      0x80 + code % 64)
  end
  return string.char(0xF0 + math.floor(code / 262144), 0x80 + math.floor(code / 4096) % 64,
    0x80 + math.floor(code / 64) % 64, 0x80 + code % 64)
end

local unescapes = { b = "\b", f = "\f", n = "\n", r = "\r", t = "\t", ['"'] = '"', ["\\"] = "\\", ["/"] = "/" }

local function decode_string(s, pos)
  local out, i = {}, pos + 1
  while true do
    local j = s:find('["\\]', i)
    if not j then fail(s, pos, "a closing quote") end
    out[#out + 1] = s:sub(i, j - 1)
    if s:sub(j, j) == '"' then return table.concat(out), j + 1 end
    local e = s:sub(j + 1, j + 1)
    if e == "u" then
      local hex = s:sub(j + 2, j + 5)
      if not hex:match("^%x%x%x%x$") then fail(s, j, "four hex digits after \\u") end
      local code = tonumber(hex, 16)
      i = j + 6
      if code >= 0xD800 and code < 0xDC00 and s:sub(i, i + 1) == "\\u" then
        local low = tonumber(s:sub(i + 2, i + 5), 16)
        if low and low >= 0xDC00 and low < 0xE000 then
          code = 0x10000 + (code - 0xD800) * 1024 + (low - 0xDC00)
          i = i + 6
        end
      end
      out[#out + 1] = utf8_char(code)
    elseif unescapes[e] then
      out[#out + 1] = unescapes[e]
      i = j + 2
    else
      fail(s, j, "a valid escape")
    end
  end
end

local function decode_array(s, pos)
  local out = json.array()
  pos = skip(s, pos + 1)
  if s:sub(pos, pos) == "]" then return out, pos + 1 end
  while true do
    local v
    v, pos = decode_value(s, pos)
    out[#out + 1] = v
    pos = skip(s, pos)
    local c = s:sub(pos, pos)
    if c == "]" then return out, pos + 1 end
    if c ~= "," then fail(s, pos, "',' or ']'") end
    pos = skip(s, pos + 1)
  end
end

local function decode_object(s, pos)
  local out = {}
  pos = skip(s, pos + 1)
  if s:sub(pos, pos) == "}" then return out, pos + 1 end
  while true do
    if s:sub(pos, pos) ~= '"' then fail(s, pos, "a string key") end
    local k
    k, pos = decode_string(s, pos)
    pos = skip(s, pos)
    if s:sub(pos, pos) ~= ":" then fail(s, pos, "':'") end
    local v
    v, pos = decode_value(s, skip(s, pos + 1))
    out[k] = v
    pos = skip(s, pos)
    local c = s:sub(pos, pos)
    if c == "}" then return out, pos + 1 end
    if c ~= "," then fail(s, pos, "',' or '}'") end
    pos = skip(s, pos + 1)
  end
end

local literals = { ["true"] = true, ["false"] = false }

function decode_value(s, pos)
  pos = skip(s, pos)
  local c = s:sub(pos, pos)
  if c == "{" then return decode_object(s, pos) end
  if c == "[" then return decode_array(s, pos) end
  if c == '"' then return decode_string(s, pos) end
  local word = s:match("^%a+", pos)
  if word == "null" then return json.null, pos + 4 end
  if literals[word] ~= nil then return literals[word], pos + #word end
  local num = s:match("^-?%d+%.?%d*[eE]?[-+]?%d*", pos)
  if num and tonumber(num) then return tonumber(num), pos + #num end
  fail(s, pos, "a JSON value")
end

function json.decode(s)
  if type(s) ~= "string" then error("json.decode: expected a string, got " .. type(s), 0) end
  local v, pos = decode_value(s, 1)
  pos = skip(s, pos)
  if pos <= #s then fail(s, pos, "the end of the input") end
  return v
end

-- Reads and decodes a whole file; nil and a message when it cannot be read or parsed.
function json.read(path)
  local s, err = fs.read(path)
  if not s then return nil, err end
  local ok, v = pcall(json.decode, s)
  if not ok then return nil, path .. ": " .. v end
  return v
end

-- Writes v as JSON to path through a temporary file and a rename (never half-written).
function json.write(path, v)
  fs.write(path, json.encode(v) .. "\n")
end

return json

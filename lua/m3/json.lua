-- m3.json — a small JSON encoder and decoder for metrics, results and run markers.
--
-- encode: tables with keys 1..n (and nothing else) become arrays, other tables objects
-- with their keys sorted (so files are stable and diffable; two keys with one name, 1 and
-- "1", are an error); numbers, number keys too, as m3.number_text.exact writes them (they
-- read back exactly); NaN and ±inf become null; an empty table is an object ({}) unless it
-- carries json.array's marker.
-- decode: JSON as RFC 8259 defines it, strictly: no leading zeros, "1." or ".5", no raw
-- control characters in strings, no lone surrogate escapes (an error rather than U+FFFD: a
-- text that holds one was not written as JSON, and a name or path that changes quietly would
-- reach another file), no number past a double's range (1e400; 1e-400 rounds to 0); null
-- becomes json.null (a sentinel), so arrays keep their length. Bytes of strings are taken as
-- they are (encode writes a Lua string's bytes, UTF-8 or not). Errors name the position and
-- what was expected.
-- Both refuse arrays and objects nested more than 1000 deep with a message (deeper, the Lua
-- stack would run out: a bare "stack overflow").

local fs = require "m3.fs"
local lib = require "m3.lib"
local exact = require("m3.number_text").exact

lib.internal_file(debug.getinfo(1, "S").source)

local json = {}

json.null = setmetatable({}, { __tostring = function() return "null" end })
local array_mark = {}
local MAX_DEPTH = 1000 -- arrays and objects inside one another, in what encode and decode take

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

local function encode_table(t, out, seen, depth)
  if seen[t] then error("json.encode: cannot encode a table that contains itself", 0) end
  if depth > MAX_DEPTH then
    error(string.format("json.encode: tables nested more than %d deep; a JSON text here holds at most %d arrays "
      .. "and objects inside one another", MAX_DEPTH, MAX_DEPTH), 0)
  end
  seen[t] = true
  if is_array(t) then
    out[#out + 1] = "["
    for i = 1, #t do
      if i > 1 then out[#out + 1] = "," end
      encode_value(t[i], out, seen, depth)
    end
    out[#out + 1] = "]"
  else
    local keys, key_of = {}, {}
    for k in pairs(t) do
      if type(k) ~= "string" and type(k) ~= "number" then
        error("json.encode: object keys must be strings or numbers, got " .. type(k), 0)
      end
      local text = type(k) == "number" and exact(k) or k
      if key_of[text] ~= nil then -- 1 and "1": the object would hold the name twice and lose a value
        local function show(key) return type(key) == "string" and string.format("%q", key) or exact(key) end
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
      encode_value(t[k], out, seen, depth)
    end
    out[#out + 1] = "}"
  end
  seen[t] = nil
end

function encode_value(v, out, seen, depth)
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
    encode_table(v, out, seen, depth + 1)
  elseif ty == "cdata" and tonumber(v) then
    out[#out + 1] = encode_number(tonumber(v))
  else
    error("json.encode: cannot encode a " .. ty, 0)
  end
end

function json.encode(v)
  local out = {}
  encode_value(v, out, {}, 0)
  return table.concat(out)
end

-- ---- decoding ------------------------------------------------------------------------------

-- Raises "json.decode: <message> at position <pos> (near "<the text there>")".
local function fail(s, pos, message)
  error(string.format("json.decode: %s at position %d (near %q)", message, pos, s:sub(pos, pos + 10)), 0)
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

-- The code unit of the \uXXXX escape at j (the backslash).
local function code_unit(s, j)
  local hex = s:sub(j + 2, j + 5)
  if not hex:match("^%x%x%x%x$") then fail(s, j, "expected four hex digits after \\u") end
  return tonumber(hex, 16)
end

-- The character of the \u escape at j and the position after it: a surrogate pair (two
-- escapes) makes one character; a surrogate without its other half is an error.
local function decode_escape_u(s, j)
  local code = code_unit(s, j)
  if code >= 0xDC00 and code < 0xE000 then
    fail(s, j, string.format("a low surrogate \\u%04x without a high one (\\ud800 to \\udbff) before it", code))
  end
  if code < 0xD800 or code >= 0xE000 then return utf8_char(code), j + 6 end
  local low = s:sub(j + 6, j + 7) == "\\u" and code_unit(s, j + 6)
  if not (low and low >= 0xDC00 and low < 0xE000) then
    fail(s, j, string.format("a high surrogate \\u%04x without a low one (\\udc00 to \\udfff) after it", code))
  end
  return utf8_char(0x10000 + (code - 0xD800) * 1024 + (low - 0xDC00)), j + 12
end

local function decode_string(s, pos)
  local out, i = {}, pos + 1
  while true do
    local j = s:find('["\\%z\1-\31]', i)
    if not j then fail(s, pos, "expected a closing quote") end
    out[#out + 1] = s:sub(i, j - 1)
    local c = s:sub(j, j)
    if c == '"' then return table.concat(out), j + 1 end
    if c ~= "\\" then
      fail(s, j, string.format("expected an escape (\\u%04x) for the control character %d in a string", c:byte(),
        c:byte()))
    end
    local e = s:sub(j + 1, j + 1)
    if e == "u" then
      out[#out + 1], i = decode_escape_u(s, j)
    elseif unescapes[e] then
      out[#out + 1] = unescapes[e]
      i = j + 2
    else
      fail(s, j, "expected a valid escape")
    end
  end
end

-- The number at pos (RFC 8259: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][-+]?[0-9]+)?) and the position after it.
local function decode_number(s, pos)
  local e = s:match("^-?[1-9]%d*()", pos) or s:match("^-?0()", pos)
  if not e then fail(s, pos, "expected a JSON value") end
  if s:find("^%d", e) then fail(s, pos, "expected a number without leading zeros") end
  if s:sub(e, e) == "." then e = s:match("^%.%d+()", e) or fail(s, e + 1, "expected a digit after the point") end
  if s:find("^[eE]", e) then e = s:match("^[eE][-+]?%d+()", e) or fail(s, e + 1, "expected the exponent's digits") end
  local v = tonumber(s:sub(pos, e - 1))
  if math.abs(v) == math.huge then fail(s, pos, "expected a number within a double's range (below 1.8e308)") end
  return v, e
end

-- Raises when the array or object at pos is nested more than MAX_DEPTH deep.
local function check_depth(s, pos, depth)
  if depth > MAX_DEPTH then
    fail(s, pos, string.format("expected at most %d arrays and objects inside one another", MAX_DEPTH))
  end
end

local function decode_array(s, pos, depth)
  check_depth(s, pos, depth)
  local out = json.array()
  pos = skip(s, pos + 1)
  if s:sub(pos, pos) == "]" then return out, pos + 1 end
  while true do
    local v
    v, pos = decode_value(s, pos, depth)
    out[#out + 1] = v
    pos = skip(s, pos)
    local c = s:sub(pos, pos)
    if c == "]" then return out, pos + 1 end
    if c ~= "," then fail(s, pos, "expected ',' or ']'") end
    pos = skip(s, pos + 1)
  end
end

local function decode_object(s, pos, depth)
  check_depth(s, pos, depth)
  local out = {}
  pos = skip(s, pos + 1)
  if s:sub(pos, pos) == "}" then return out, pos + 1 end
  while true do
    if s:sub(pos, pos) ~= '"' then fail(s, pos, "expected a string key") end
    local k
    k, pos = decode_string(s, pos)
    pos = skip(s, pos)
    if s:sub(pos, pos) ~= ":" then fail(s, pos, "expected ':'") end
    local v
    v, pos = decode_value(s, skip(s, pos + 1), depth)
    out[k] = v
    pos = skip(s, pos)
    local c = s:sub(pos, pos)
    if c == "}" then return out, pos + 1 end
    if c ~= "," then fail(s, pos, "expected ',' or '}'") end
    pos = skip(s, pos + 1)
  end
end

local literals = { ["true"] = true, ["false"] = false }

-- The value at pos (inside depth arrays and objects) and the position after it.
function decode_value(s, pos, depth)
  pos = skip(s, pos)
  local c = s:sub(pos, pos)
  if c == "{" then return decode_object(s, pos, depth + 1) end
  if c == "[" then return decode_array(s, pos, depth + 1) end
  if c == '"' then return decode_string(s, pos) end
  local word = s:match("^%a+", pos)
  if word == "null" then return json.null, pos + 4 end
  if literals[word] ~= nil then return literals[word], pos + #word end
  return decode_number(s, pos)
end

function json.decode(s)
  if type(s) ~= "string" then error("json.decode: expected a string, got " .. type(s), 0) end
  local v, pos = decode_value(s, 1, 0)
  pos = skip(s, pos)
  if pos <= #s then fail(s, pos, "expected the end of the input") end
  return v
end

-- Reads and decodes a whole file: its value, or nil, a message and why, one of "missing" (nothing
-- at path: for callers, not written yet), "unreadable" (a folder, a FIFO, no permission: the
-- message from m3.fs.read) and "invalid" (not JSON: "<path>: json.decode: ... at position N").
function json.read(path)
  local s, err = fs.read(path)
  if not s then return nil, err, fs.exists(path) and "unreadable" or "missing" end
  local ok, v = pcall(json.decode, s)
  if not ok then return nil, path .. ": " .. v, "invalid" end
  return v
end

-- Writes v as JSON to path through a temporary file and a rename (never half-written).
function json.write(path, v)
  fs.write(path, json.encode(v) .. "\n")
end

return json

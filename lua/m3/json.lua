-- m3.json — a small JSON encoder and decoder for metrics, results and run markers.
--
-- encode: tables with keys 1..n (and nothing else) become arrays, other tables objects
-- with their keys sorted (so files are stable and diffable; two keys with one name, 1 and
-- "1", are an error); numbers, number keys too, as m3.number_text.exact writes them (they
-- read back exactly); NaN and ±inf become null; an empty table is an object ({}) unless it
-- carries json.array's marker. A string (or key) that is not UTF-8 is an error naming where it
-- is (".options.prompt", "[3]") and its first bad byte: a JSON text is UTF-8 (RFC 8259 §8.1),
-- other readers refuse one that is not, and U+FFFD in its place would be a quietly wrong value.
-- Lua strings are bytes: a caller that may hold others (a file name, a byte-level model's text)
-- says how it records them (m3.rundir: options.json); json.utf8_error(s) finds them, and
-- json.quote_bytes(s) writes s as a Lua string literal (%q) with its bytes past ASCII as \ddd.
-- decode: JSON as RFC 8259 defines it, strictly: UTF-8 only (no stray, overlong, surrogate or
-- past-U+10FFFF bytes, no cut sequence), no leading zeros, "1." or ".5", no raw control
-- characters in strings, no lone surrogate escapes (an error rather than U+FFFD: a text that
-- holds one was not written as JSON, and a name or path that changes quietly would reach
-- another file), no key twice in one object ("a" and "\u0061" too: one of the two values
-- would win without a word), no number past a double's range (1e400; 1e-400 rounds to 0);
-- null becomes json.null (a sentinel), so arrays keep their length. A UTF-8 byte order mark
-- (EF BB BF) at the very start is passed over (some editors write one; RFC 8259 §8.1 allows
-- ignoring it), anywhere else it is an error; encode never writes one. Errors name the
-- position (a byte offset from 1, a BOM counted) and what was expected.
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

-- Where s, from byte i (1), is not UTF-8 (RFC 3629): the position of the first bad sequence's
-- first byte and what is wrong there; nil when it is UTF-8. Runs of ASCII are skipped by find.
local function utf8_error(s, i)
  i = i or 1
  while true do
    i = s:find("[\128-\255]", i)
    if not i then return nil end
    local c = s:byte(i)
    local n, lo, hi -- continuation bytes, the range the first of them must be in
    if c < 0xC0 then
      return i, string.format("a continuation byte 0x%02x without a lead byte before it", c)
    elseif c < 0xC2 then
      return i, string.format("byte 0x%02x, never used in UTF-8 (it only starts overlong forms)", c)
    elseif c < 0xE0 then
      n, lo, hi = 1, 0x80, 0xBF
    elseif c < 0xF0 then
      n, lo, hi = 2, c == 0xE0 and 0xA0 or 0x80, c == 0xED and 0x9F or 0xBF
    elseif c < 0xF5 then
      n, lo, hi = 3, c == 0xF0 and 0x90 or 0x80, c == 0xF4 and 0x8F or 0xBF
    else
      return i, string.format("byte 0x%02x, never used in UTF-8", c)
    end
    local c2 = s:byte(i + 1)
    if c2 and c2 >= 0x80 and c2 < 0xC0 and (c2 < lo or c2 > hi) then
      local what = c == 0xED and "a surrogate (U+D800 to U+DFFF) encoded as UTF-8"
        or c == 0xF4 and "a code point past U+10FFFF" or "an overlong form (a shorter sequence exists)"
      return i, string.format("%s: 0x%02x 0x%02x", what, c, c2)
    end
    for k = 1, n do
      local b = s:byte(i + k)
      if not (b and b >= 0x80 and b < 0xC0) then
        return i, string.format("a %d-byte sequence (lead byte 0x%02x) cut short after %d byte%s", n + 1, c, k,
          k > 1 and "s" or "")
      end
    end
    i = i + n + 1
  end
end
json.utf8_error = utf8_error

-- The text of a string for messages: %q, bytes past ASCII as \ddd (the string may not be UTF-8).
local function quote_bytes(s)
  return (string.format("%q", s):gsub("[\128-\255]", function(c) return "\\" .. c:byte() end))
end
json.quote_bytes = quote_bytes

-- Where path[1..depth] (keys and indices) leads from the top: ".a[2]['b c']", or "the top level".
local function path_text(path, depth)
  local parts = {}
  for d = 1, depth do
    local k = path[d]
    if type(k) == "string" and k:find("^[%a_][%w_]*$") then
      parts[d] = "." .. k
    else
      parts[d] = "[" .. (type(k) == "number" and exact(k) or quote_bytes(k)) .. "]"
    end
  end
  return depth == 0 and "the top level" or table.concat(parts)
end

local escapes = {
  ['"'] = '\\"', ["\\"] = "\\\\", ["\b"] = "\\b", ["\f"] = "\\f",
  ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t",
}

-- s as a JSON string; s a value, or a key (key = true), at path[1..depth]; not UTF-8 is an error.
local function encode_string(s, path, depth, key)
  if s:find("[\128-\255]") then
    local at, why = utf8_error(s)
    if at then
      error(string.format("json.encode: cannot encode the %s at %s: not UTF-8 at its byte %d (near %s: %s), which a "
        .. "JSON text must be (RFC 8259 §8.1)", key and "key" or "string", path_text(path, depth), at,
        quote_bytes(s:sub(at, at + 10)), why), 0)
    end
  end
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

local function encode_table(t, out, seen, depth, path)
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
      path[depth] = i
      encode_value(t[i], out, seen, depth, path)
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
      path[depth] = k
      out[#out + 1] = encode_string(text, path, depth, true)
      out[#out + 1] = ":"
      encode_value(t[k], out, seen, depth, path)
    end
    out[#out + 1] = "}"
  end
  seen[t] = nil
end

-- Appends v's text to out; v is at path[1..depth] (tables being encoded: seen).
function encode_value(v, out, seen, depth, path)
  local ty = type(v)
  if v == nil or v == json.null then
    out[#out + 1] = "null"
  elseif ty == "boolean" then
    out[#out + 1] = tostring(v)
  elseif ty == "number" then
    out[#out + 1] = encode_number(v)
  elseif ty == "string" then
    out[#out + 1] = encode_string(v, path, depth)
  elseif ty == "table" then
    encode_table(v, out, seen, depth + 1, path)
  elseif ty == "cdata" and tonumber(v) then
    out[#out + 1] = encode_number(tonumber(v))
  else
    error("json.encode: cannot encode a " .. ty, 0)
  end
end

function json.encode(v)
  local out = {}
  encode_value(v, out, {}, 0, {})
  return table.concat(out)
end

-- ---- decoding ------------------------------------------------------------------------------

-- Raises "json.decode: <message> at position <pos> (near "<the text there>")"; bytes = true: the
-- text there is not UTF-8, and bytes past ASCII show as \ddd.
local function fail(s, pos, message, bytes)
  local near = s:sub(pos, pos + 10)
  error(string.format("json.decode: %s at position %d (near %s)", message, pos,
    bytes and quote_bytes(near) or string.format("%q", near)), 0)
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
  local out, start = {}, pos
  pos = skip(s, pos + 1)
  if s:sub(pos, pos) == "}" then return out, pos + 1 end
  while true do
    if s:sub(pos, pos) ~= '"' then fail(s, pos, "expected a string key") end
    local k, at = nil, pos
    k, pos = decode_string(s, pos)
    if out[k] ~= nil then -- json.null is a value too
      fail(s, at, string.format("a key given twice: %q (the object at position %d has it already)", k, start))
    end
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
  local start = s:byte(1) == 0xEF and s:sub(1, 3) == "\239\187\191" and 4 or 1 -- a byte order mark: at the start only
  if s:find("[\128-\255]", start) then
    local bad, why = utf8_error(s, start)
    if bad then fail(s, bad, "expected UTF-8, found " .. why, true) end
  end
  local v, pos = decode_value(s, start, 0)
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

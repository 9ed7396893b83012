-- m3.serialize — an exact text form for plain Lua values (a checkpoint's `extra` table).
--
-- dump(value, name) writes `return <literal>`: nil, booleans, numbers (m3.number_text.exact,
-- so every double round-trips; 1/0, -1/0, 0/0 for inf, -inf, nan), strings (%q; one that is not
-- UTF-8, such as a Latin-1 file name, with its bytes past ASCII as \ddd, so the text is always
-- UTF-8, as the safetensors metadata holding a checkpoint's extra must be) and nested
-- tables whose keys are strings or numbers. Cycles, functions, userdata, cdata, threads and
-- tables nested more than MAX_DEPTH (100) deep are errors that name the path (`extra.data.fn`),
-- raised before any text is returned: load() cannot read back what LuaJIT's parser refuses
-- (about 196 levels of tables), so dump never writes it; nor a literal past the parser's 65536 constants
-- (about 65000 tables), which dump compiles to find. Tables reached twice are written twice.
-- load(text) accepts only that literal form (checked lexically: no names other than
-- return/true/false/nil, no calls) and evaluates it with load() in an empty environment.

local exact = require("m3.number_text").exact
local json = require "m3.json"

local serialize = {}

local function fail(msg)
  error({ serialize_error = msg })
end

local function is_identifier(s)
  return s:match("^[%a_][%w_]*$") ~= nil and not ({
    ["and"] = 1, ["break"] = 1, ["do"] = 1, ["else"] = 1, ["elseif"] = 1, ["end"] = 1,
    ["false"] = 1, ["for"] = 1, ["function"] = 1, ["goto"] = 1, ["if"] = 1, ["in"] = 1,
    ["local"] = 1, ["nil"] = 1, ["not"] = 1, ["or"] = 1, ["repeat"] = 1, ["return"] = 1,
    ["then"] = 1, ["true"] = 1, ["until"] = 1, ["while"] = 1 })[s]
end

local function number(v)
  if v ~= v then return "0/0" end
  if v == math.huge then return "1/0" end
  if v == -math.huge then return "-1/0" end
  return exact(v)
end

-- s as a string literal that is UTF-8 text whatever bytes s holds.
local function quote(s)
  if json.utf8_error(s) then return json.quote_bytes(s) end
  return string.format("%q", s)
end

local function sub_path(path, k)
  if type(k) == "string" and is_identifier(k) then return path .. "." .. k end
  if type(k) == "string" then return path .. "[" .. quote(k) .. "]" end
  return path .. "[" .. number(k) .. "]"
end

-- The most levels of nested tables dump writes (the value itself is level 1): half of what LuaJIT's
-- parser takes ("chunk has too many syntax levels"), whatever the keys and leaves.
local MAX_DEPTH = 100

local function key_order(a, b)
  local ta, tb = type(a), type(b)
  if ta ~= tb then return ta == "number" end
  if ta == "number" and (a ~= a or b ~= b) then return b ~= b and a == a end
  return a < b
end

local function write(out, v, path, open, depth)
  local t = type(v)
  if t == "nil" then
    out[#out + 1] = "nil"
  elseif t == "boolean" then
    out[#out + 1] = tostring(v)
  elseif t == "number" then
    out[#out + 1] = number(v)
  elseif t == "string" then
    out[#out + 1] = quote(v)
  elseif t == "table" then
    if open[v] then fail(path .. " is a cycle (a table that contains itself)") end
    if depth > MAX_DEPTH then
      fail(string.format("%s is a table nested %d deep (at most %d levels of tables can be saved and loaded back)",
        path, depth, MAX_DEPTH))
    end
    if getmetatable(v) ~= nil then fail(path .. " has a metatable (only plain tables can be saved)") end
    open[v] = true
    local keys = {}
    for k in pairs(v) do
      local kt = type(k)
      if kt ~= "string" and kt ~= "number" then
        fail(string.format("%s has a %s key (only string and number keys can be saved)", path, kt))
      end
      if k ~= k then fail(path .. " has a nan key") end
      keys[#keys + 1] = k
    end
    table.sort(keys, key_order)
    out[#out + 1] = "{"
    for i, k in ipairs(keys) do
      if i > 1 then out[#out + 1] = ", " end
      out[#out + 1] = "["
      out[#out + 1] = type(k) == "string" and quote(k) or number(k)
      out[#out + 1] = "] = "
      write(out, v[k], sub_path(path, k), open, depth + 1)
    end
    out[#out + 1] = "}"
    open[v] = nil
  else
    fail(string.format("%s is a %s (only nil, booleans, numbers, strings and tables can be saved)", path, t))
  end
end

-- The text `return <value>`. name (default "value") starts the paths in error messages.
function serialize.dump(value, name)
  local out = { "return " }
  local ok, err = pcall(write, out, value, name or "value", {}, 1)
  if not ok then
    if type(err) == "table" and err.serialize_error then error("serialize: " .. err.serialize_error, 2) end
    error(err, 0)
  end
  local text = table.concat(out)
  -- LuaJIT's parser also caps a chunk's constants at 65536 (each non-empty table, each key of a table that
  -- holds tables, ...: about 65000 tables in all): compiled here as load compiles it, so that what is
  -- written always loads
  local compiled, perr = load(text, "=serialized", "t", {})
  if not compiled then
    error(string.format("serialize: %s is too large to load back (LuaJIT: %s); keep fewer tables in it, e.g. "
      .. "flat lists of numbers or strings", name or "value", (perr:gsub("^serialized:%d+: ", ""))), 2)
  end
  return text
end

local allowed_words = { ["return"] = true, ["true"] = true, ["false"] = true, ["nil"] = true }

-- A long string or comment opener in code outside quoted strings (it would hide quotes from the scan).
local function long_opener(code)
  return code:find("%[=*%[") or code:find("--", 1, true)
end

-- Everything outside quoted strings, or nil and a message when a string does not end or a long string
-- or comment starts.
local function outside_strings(text)
  local parts, i, n = {}, 1, #text
  while i <= n do
    local q = text:find("[\"']", i)
    local code = text:sub(i, q and q - 1 or n)
    if long_opener(code) then return nil, "long strings and comments are not accepted" end
    parts[#parts + 1] = code
    if not q then break end
    local quote, j = text:sub(q, q), q + 1
    while true do
      local c = text:sub(j, j)
      if c == "" then return nil, "unterminated string" end
      if c == "\\" then
        j = j + 2
      elseif c == quote then
        break
      else
        j = j + 1
      end
    end
    parts[#parts + 1] = " 0 "
    i = j + 1
  end
  return table.concat(parts)
end

local function check_literal(text)
  if not text:match("^%s*return[%s{%[\"'%-%d]") and not text:match("^%s*return%s*$") then
    return "expected text of the form `return <literal>`"
  end
  local rest, err = outside_strings(text)
  if not rest then return err end
  rest = rest:gsub("%d+%.?%d*[eE][%+%-]?%d+", " "):gsub("%d+%.?%d*", " ")
  for word in rest:gmatch("[%a_][%w_]*") do
    if not allowed_words[word] then return "unexpected name `" .. word .. "`" end
  end
  local bad = rest:match("[^%s%a_{}%[%]=,%-/]")
  if bad then return "unexpected character `" .. bad .. "`" end
end

-- The value of a text made by dump.
function serialize.load(text)
  if type(text) ~= "string" then error("serialize.load: expected a string, got " .. type(text), 2) end
  local err = check_literal(text)
  if err then error("serialize.load: " .. err, 2) end
  local chunk, perr = load(text, "=serialized", "t", {})
  if not chunk then error("serialize.load: " .. perr, 2) end
  local ok, value = pcall(chunk)
  if not ok then error("serialize.load: " .. tostring(value), 2) end
  return value
end

return serialize

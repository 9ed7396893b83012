-- m3.repl — the interactive prompt of m3lua (`m3lua` on a terminal, or `m3lua -i`).
--
-- On a terminal, lines come from libedit through the FFI: editing, history in
-- ~/.m3lua_history (or $M3LUA_HISTORY; empty disables it, as does a HOME unset or empty;
-- M.history_file() names it; sessions at once share it: each line saved joins the lines the
-- others saved since, and a file that cannot be written is named once), Tab completion of
-- globals and of the fields and methods after `.` or `:`. Otherwise lines are read plainly
-- from stdin, without prompts. A chunk is first tried as an expression list (its values are shown),
-- then as a statement (`=expr` is the expression list alone, as in Lua 5.1's prompt); an incomplete chunk (its load error ends in <eof>) continues on the
-- next line, and if the input ends first its error is shown.
-- Results print with a shallow pretty printer unless the chunk ends with `;`; commands
-- taking 0.1 s or more show their wall time; errors print with a traceback and the session
-- goes on. `?topic` asks m3.help. The global `m3` requires the m3 module on first use.
--
-- Interrupts come from the host (package.loaded["m3.host"], see engine/host/m3lua.c):
-- Ctrl-C at the prompt drops the line being edited, Ctrl-C during a command stops it and
-- returns to the prompt (except in a JIT-compiled loop that calls nothing of m3: it never
-- looks, so the host's watchdog ends the session), SIGTERM ends the session with status 143.
-- Ctrl-Z stops the session; after `fg` the line being edited is drawn again, still editable.
-- Keys are read as characters of the locale's encoding (UTF-8 under a plain C locale).
-- Ctrl-D or os.exit() ends it cleanly.

local ffi = require "ffi"

local C = ffi.C

-- libedit's readline API; libc functions under private names (asm labels), so that other
-- declarations of them, with other types, cannot clash with these.
ffi.cdef [[
char *readline(const char *prompt);
int add_history(const char *line);
int read_history(const char *file);
int write_history(const char *file);
void clear_history(void);
void stifle_history(int max);
typedef char **m3repl_completer(const char *text, int start, int end);
extern m3repl_completer *rl_attempted_completion_function;
extern int rl_attempted_completion_over;
extern int rl_completion_append_character;
extern const char *rl_basic_word_break_characters;
extern const char *rl_readline_name;
void *m3repl_malloc(size_t size) __asm__("malloc");
void m3repl_free(void *ptr) __asm__("free");
int m3repl_isatty(int fd) __asm__("isatty");
char *m3repl_strerror(int errnum) __asm__("strerror");
typedef struct { long sec, nsec; } m3repl_timespec;
int m3repl_clock_gettime(int clock, m3repl_timespec *ts) __asm__("clock_gettime");
]]

local M = {}

local SIGINT = 2
local CLOCK_MONOTONIC = 1
local HISTORY_SIZE = 1000
local MAX_FIELDS = 50      -- entries shown per table
local WIDTH = 78           -- longer tables print one entry per line
local SLOW = 0.1           -- seconds; slower commands show their wall time
-- Completion words break at these; `.` and `:` stay inside a word.
local WORD_BREAKS = " \t\n\"\\'`@$><=;|&{(,)+-*/%^#~[]"
local PROGRAM_NAME = "m3lua"

-- Under plain luajit (no host): no interrupt handling, same calls.
local host = package.loaded["m3.host"] or {
  pcall = xpcall,
  clear_interrupt = function() end,
  pending_signal = function() end,
}

local keywords = {}
for word in ([[and break do else elseif end false for function goto if in local nil not or
               repeat return then true until while]]):gmatch("%a+") do
  keywords[word] = true
end

local function is_name(s)
  return type(s) == "string" and s:match("^[%a_][%w_]*$") ~= nil and not keywords[s]
end

local function pack(...)
  return { n = select("#", ...), ... }
end

local function now()
  local ts = ffi.new("m3repl_timespec")
  C.m3repl_clock_gettime(CLOCK_MONOTONIC, ts)
  return tonumber(ts.sec) + tonumber(ts.nsec) * 1e-9
end

-- ---- pretty printer ---------------------------------------------------------------------

local escapes = { ["\n"] = "\\n", ["\t"] = "\\t", ["\r"] = "\\r", ['"'] = '\\"', ["\\"] = "\\\\" }

local function quote(s)
  return '"' .. s:gsub('[%c"\\]', function(c)
    return escapes[c] or ("\\%03d"):format(c:byte())
  end) .. '"'
end

local function key_before(a, b)
  local ta, tb = type(a), type(b)
  if ta ~= tb then return ta < tb end
  if ta == "number" or ta == "string" then return a < b end
  return tostring(a) < tostring(b)
end

local function has_tostring(v)
  local mt = getmetatable(v)
  return type(mt) == "table" and rawget(mt, "__tostring") ~= nil
end

local render

-- The entries of t (array part first, then the other keys sorted), rendered; the names its
-- metatable's __fields lists that t does not hold yet (m3's modules before their first use) as
-- "<on first use>", without calling __index.
local function entries(t, depth, seen)
  local items, n = {}, #t
  for i = 1, math.min(n, MAX_FIELDS) do
    items[i] = render(rawget(t, i), depth - 1, seen)
  end
  local keys, later = {}, {}
  for k in next, t do
    if not (type(k) == "number" and k >= 1 and k <= n and k % 1 == 0) then
      keys[#keys + 1] = k
    end
  end
  local mt = getmetatable(t)
  local fields = type(mt) == "table" and rawget(mt, "__fields")
  for _, k in ipairs(type(fields) == "table" and fields or {}) do
    if rawget(t, k) == nil and not later[k] then keys[#keys + 1], later[k] = k, true end
  end
  table.sort(keys, key_before)
  for _, k in ipairs(keys) do
    if #items >= MAX_FIELDS then break end
    local key = is_name(k) and k or "[" .. render(k, depth - 1, seen) .. "]"
    items[#items + 1] = key .. " = " .. (later[k] and "<on first use>" or render(rawget(t, k), depth - 1, seen))
  end
  local total = n + #keys
  if total > #items then
    items[#items + 1] = ("... (%d more)"):format(total - #items)
  end
  return items
end

function render(v, depth, seen)
  local kind = type(v)
  if kind == "string" then return quote(v) end
  if kind ~= "table" or has_tostring(v) then
    local ok, s = pcall(tostring, v)
    return ok and tostring(s) or ("<%s: __tostring failed>"):format(kind)
  end
  if seen[v] then return "<cycle>" end
  if next(v) == nil then return "{}" end
  if depth <= 0 then return "{...}" end
  seen[v] = true
  local items = entries(v, depth, seen)
  seen[v] = nil
  return "{ " .. table.concat(items, ", ") .. " }"
end

-- One value as the REPL shows it: tables with their entries and those of nested tables
-- (deeper ones as {...}), one entry per line when long; __tostring is honoured.
function M.pretty(v)
  local line = render(v, 2, {})
  if #line <= WIDTH or type(v) ~= "table" or has_tostring(v) then return line end
  return "{\n  " .. table.concat(entries(v, 2, { [v] = true }), ",\n  ") .. ",\n}"
end

-- ---- completion -------------------------------------------------------------------------

-- Adds the string keys of v, of its metatables' __index tables and their __fields lists (the
-- names an __index function gives, e.g. m3's modules before their first use), to names.
local function add_fields(v, names, seen)
  if type(v) == "table" then
    if seen[v] then return end
    seen[v] = true
    for k in next, v do
      if type(k) == "string" then names[k] = true end
    end
  end
  local mt = getmetatable(v)
  if type(mt) ~= "table" then return end
  local index, fields = rawget(mt, "__index"), rawget(mt, "__fields")
  if type(fields) == "table" then
    for _, k in ipairs(fields) do names[k] = true end
  end
  if type(index) == "table" then add_fields(index, names, seen) end
end

local function get(v, k)
  return v[k]
end

-- The value of a dotted name ("m3.schedule") in the globals, or nil.
local function resolve(path)
  local v = _G
  for name in (path .. "."):gmatch("([^.]*)%.") do
    if not is_name(name) then return nil end
    local ok, x = pcall(get, v, name)
    if not ok or x == nil then return nil end
    v = x
  end
  return v
end

-- The completions of text: globals and keywords, or `a.b.<field>` / `a.b:<method>`.
function M.completions(text)
  local head, sep, partial = text:match("^(.*)([.:])([%w_]*)$")
  local names, prefix, owner = {}, "", nil
  if head then
    owner = resolve(head)
    if owner == nil then return {} end
    add_fields(owner, names, {})
    prefix = head .. sep
  elseif text:match("^[%a_]?[%w_]*$") then
    partial = text
    add_fields(_G, names, {})
    names.m3 = true
    for word in pairs(keywords) do names[word] = true end
  else
    return {}
  end
  local out = {}
  for name in pairs(names) do
    if name:sub(1, #partial) == partial and (is_name(name) or (not head and keywords[name])) then
      local ok, x = true, nil
      if sep == ":" then ok, x = pcall(get, owner, name) end
      if ok and (sep ~= ":" or type(x) == "function") then
        out[#out + 1] = prefix .. name
      end
    end
  end
  table.sort(out)
  return out
end

local function common_prefix(list)
  local p = list[1]
  for i = 2, #list do
    while list[i]:sub(1, #p) ~= p do p = p:sub(1, -2) end
  end
  return p
end

local function c_string(s)
  local p = ffi.cast("char *", C.m3repl_malloc(#s + 1))
  if p ~= nil then ffi.copy(p, s) end
  return p
end

-- readline's convention: a malloc'd NULL-terminated array, [0] = what replaces the word
-- (the only match, or the common prefix of several), then the matches.
local function c_matches(list)
  local arr = ffi.cast("char **", C.m3repl_malloc((#list + 2) * ffi.sizeof("char *")))
  if arr == nil then return nil end
  arr[0] = c_string(#list == 1 and list[1] or common_prefix(list))
  local n = #list == 1 and 0 or #list
  for i = 1, n do arr[i] = c_string(list[i]) end
  arr[n + 1] = nil
  return arr
end

local completer -- the FFI callback, made once and kept

local function complete(text)
  C.rl_attempted_completion_over = 1 -- no file name completion as a fallback
  C.rl_completion_append_character = 0
  local ok, list = pcall(M.completions, ffi.string(text))
  if not ok or #list == 0 then return nil end
  return c_matches(list)
end

-- ---- line sources -------------------------------------------------------------------------

-- The history file: $M3LUA_HISTORY (empty: none), else ~/.m3lua_history; none without a home
-- (HOME unset or empty: not /.m3lua_history).
function M.history_file()
  local path = os.getenv("M3LUA_HISTORY")
  if path then return path ~= "" and path or nil end
  local home = os.getenv("HOME")
  return home and home ~= "" and home .. "/.m3lua_history" or nil
end

local function have_libedit()
  return (pcall(get, C, "readline"))
end

-- A reader(prompt) → line or nil at the end, plus remember(line) for the history.
local function edit_reader()
  local history = M.history_file()
  completer = completer or ffi.cast("m3repl_completer *", complete)
  C.rl_readline_name = PROGRAM_NAME
  C.rl_basic_word_break_characters = WORD_BREAKS
  C.rl_attempted_completion_function = completer
  C.stifle_history(HISTORY_SIZE)
  if history then C.read_history(history) end
  local last
  local function read(prompt)
    local p = C.readline(prompt)
    if p == nil then return nil end
    local line = ffi.string(p)
    C.m3repl_free(p)
    return line
  end
  jit.off(read) -- completion calls back into Lua from inside readline: never compile this
  local warned
  -- Adds line to the file as it is now, with the lines other sessions saved since this one read
  -- it (they join this session's history too); says once when the file cannot be written.
  local function save(line)
    local file = io.open(history, "r")
    if file then
      file:close()
      C.clear_history()
      C.read_history(history)
    end
    C.add_history(line)
    local err = C.write_history(history)
    if err ~= 0 and not warned then
      warned = true
      io.stderr:write(("m3lua: cannot save the history to %s: %s\n"):format(history,
        ffi.string(C.m3repl_strerror(err))))
    end
  end
  local function remember(line)
    if line:match("%S") and line ~= last then
      last = line
      if history then save(line) else C.add_history(line) end
    end
  end
  return read, remember
end

local function plain_reader(prompts)
  local function read(prompt)
    if prompts then
      io.stdout:write(prompt)
      io.stdout:flush()
    end
    return io.stdin:read("*l")
  end
  return read, function() end
end

-- ---- evaluation -----------------------------------------------------------------------------

-- Stack levels of the caller and below.
local function stack_depth()
  local level = 2
  while debug.getinfo(level, "l") do level = level + 1 end
  return level - 2
end

local function error_text(err)
  if type(err) == "string" or type(err) == "number" then return tostring(err) end
  if has_tostring(err) then
    local ok, s = pcall(tostring, err)
    if ok then return s end
  end
  return ("(error object is a %s value)"):format(type(err))
end

-- A message handler whose traceback leaves out the `depth` levels of the REPL below
-- host.pcall (and host.pcall itself).
local function traceback_above(depth)
  return function(err)
    local lines = {}
    for line in (debug.traceback(error_text(err), 2) .. "\n"):gmatch("(.-)\n") do
      lines[#lines + 1] = line
    end
    for _ = 1, depth + 1 do lines[#lines] = nil end
    return table.concat(lines, "\n")
  end
end

-- Runs f interruptibly, without arguments; prints its results (unless quiet; `packed`: f
-- returns them as one pack()ed table), its error, its wall time.
local function execute(f, quiet, packed)
  local t0 = now()
  local r = pack(host.pcall(f, traceback_above(stack_depth())))
  local elapsed = now() - t0
  if not r[1] then
    io.stdout:flush()
    io.stderr:write(tostring(r[2]), "\n")
  elseif not quiet then
    local values, first = r, 2
    if packed then values, first = r[2], 1 end
    local shown = {}
    for i = first, values.n do shown[#shown + 1] = M.pretty(values[i]) end
    if #shown > 0 then io.stdout:write(table.concat(shown, "\t"), "\n") end
  end
  if elapsed >= SLOW then io.stdout:write(("(%.2f s)\n"):format(elapsed)) end
  io.stdout:flush()
end

local function at_eof(err) return err:match("<eof>'?$") ~= nil end

-- The chunk as an expression list (it returns its values packed: no tail call, so errors
-- keep their position), else as a statement; the second result says which. The expression
-- list runs in a vararg function of its own, called without arguments: `...` in it is
-- empty, as in a statement chunk, and pack reaches it as an upvalue. Where neither compiles:
-- an error, and whether the chunk is unfinished, i.e. that error ends at <eof> (the
-- statement's, or the expression's where only it does: `1 +`, cut after an operator).
local function compile(src)
  local shown = src:match("^%s*=(.*)$") -- `=expr`, as Lua 5.1's prompt takes it: an expression list only
  local expr = (shown or src):gsub(";%s*$", "")
  local f = loadstring("local m3repl_pack = ...; return function(...) return m3repl_pack(" .. expr
    .. "\n) end", "=stdin")
  if f then return f(pack), true end
  local err
  if shown then
    err = select(2, loadstring("return " .. expr, "=stdin"))
    return err, false, at_eof(err)
  end
  f, err = loadstring(src, "=stdin")
  if f then return f, false end
  local _, expr_err = loadstring("return " .. expr, "=stdin")
  if not at_eof(err) and at_eof(expr_err) then return expr_err, false, true end
  return err, false, at_eof(err)
end

local function help(topic)
  if topic == "" then topic = nil end
  local found = package.loaded["m3.help"] or package.preload["m3.help"]
    or package.searchpath("m3.help", package.path)
  if not found then
    print(topic and "no help available for " .. topic or "no help available")
    return
  end
  execute(function() require("m3.help").show(topic) end, true, false)
end

-- Handles one line; returns the unfinished chunk to continue, or nil.
local function feed(pending, line)
  if not pending then
    if not line:match("%S") then return nil end
    local topic = line:match("^%s*%?%s*(.-)%s*$")
    if topic then
      help(topic)
      return nil
    end
  end
  local src = pending and pending .. "\n" .. line or line
  local f, expression, unfinished = compile(src)
  if type(f) == "function" then
    execute(f, src:match(";%s*$") ~= nil, expression)
  elseif unfinished then
    return src
  else
    io.stdout:flush()
    io.stderr:write(f, "\n")
  end
  return nil
end

-- The global m3 requires the module on first use (the REPL starts without it).
local function expose_m3()
  local mt = getmetatable(_G)
  if mt == nil then
    mt = {}
    setmetatable(_G, mt)
  elseif type(mt) ~= "table" then
    return
  end
  local fallback = mt.__index
  mt.__index = function(t, k)
    if k == "m3" then
      local m3 = require "m3"
      rawset(t, "m3", m3)
      return m3
    end
    if type(fallback) == "function" then return fallback(t, k) end
    if fallback ~= nil then return fallback[k] end
  end
end

local function banner()
  local h = package.loaded["m3.host"]
  print(("%s %s (%s%s) -- ?topic for help, Ctrl-D to exit"):format(
    h and h.name or "m3.repl", h and h.version or "", jit.version,
    h and (h.cuda_build and ", CUDA backend built" or ", CPU only") or ""))
end

-- Runs the session; returns the exit status (0, or 128 + signal for SIGTERM and the like).
function M.run()
  local tty = C.m3repl_isatty(0) == 1
  local read, remember
  if tty and have_libedit() then
    read, remember = edit_reader()
  else
    read, remember = plain_reader(tty)
  end
  expose_m3()
  if tty then banner() end
  local pending
  while true do
    host.clear_interrupt()
    local line = read(pending and "..> " or "m3> ")
    local sig = host.pending_signal()
    if sig then
      pending = nil -- the line being edited is dropped
    elseif line == nil then
      if tty then io.stdout:write("\n") end
      if pending then -- input ended inside a chunk: say why it never ran
        io.stdout:flush()
        io.stderr:write((compile(pending)), "\n")
      end
      return 0
    else
      remember(line)
      pending = feed(pending, line)
      sig = host.pending_signal()
    end
    if sig and sig ~= SIGINT then return 128 + sig end
  end
end

return M

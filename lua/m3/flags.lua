-- m3.flags — command-line flags for scripts: `--name value`, `--name=value`, `--switch`.
--
--   local o, changed, given = flags.parse(arg, {
--     {"steps", 600, "optimizer steps"},
--     {"device", "auto", "auto | cpu | cuda | cuda:N"},
--     {"resume", false, "continue from the latest checkpoint"},
--   }, "m3lua scripts/train.lua [flags]")
--
-- A flag's type is its default's: numbers are decimal and finite (an optional sign, digits
-- with an optional fraction, an optional exponent: "-1", "0.5", ".5", "3e-4"; not "0x10",
-- "inf", " 5"), booleans are switches (`--resume`, or `--resume=false`), strings take any
-- value. `--name value` takes no value that starts with "--" (`--run --resume` is a missing
-- value, not the run "--resume"): `--name=value` takes any. Optional fields of a
-- flag narrow its values: int = true (whole numbers), min = x (numbers >= x), max = x
-- (numbers <= x: flags.INT32 for a count the library holds in an int32), choices = {...}
-- (strings from the list), e.g. {"batch", 32, "rows per step", int = true, min = 1}.
-- list = true: the value is a comma-separated list (a text, read with flags.list) whose
-- items are checked the same way, numbers when int or min is given, each item once, e.g.
-- {"widths", "64,128", "d_model values", list = true, int = true, min = 1}. A list whose
-- default is "" (the script's own choice, which its help text names) takes "" too (`--configs ''`
-- asks for that default); any other list takes at least one item.
-- fixed = true marks a flag that defines a training run (its model, its data): --help says
-- so, and m3.rundir keeps the run's own value when it resumes. path = true: the value names a
-- file, which m3.rundir compares by the file it resolves to (./data/x.txt is data/x.txt).
-- `--help` (or -h) where a flag is expected prints the flags and exits (`--prompt -h` gives the
-- value "-h"). flags.positional(arg, n, usage) takes a script's n positional arguments (no
-- flags), with the same --help and exit statuses.
-- Unknown flags and stray arguments are errors that list the valid flags. A flag given twice
-- takes its last value, as getopt does (a wrapper passes defaults, then the user's "$@").
-- Returns the
-- values, the list of names set to something other than their default (in the order of
-- the spec), for run names, and the set of names given on the command line (given[name] =
-- true, also when the value given is the default; flags.changed(values, spec) gives the
-- second list for any values). flags.list splits a comma-separated value.
-- flags.check(script, fn, ...) runs the part of a script that builds things from the
-- values (data, model, trainer): a value the parser let through but the library refuses
-- (`--lr 0`, `--d_model 30`) stops the script like a bad flag, with "<script>: <message>"
-- on stderr and exit status 2 instead of a traceback. flags.interruptible(script, fn, ...)
-- runs the part that trains: Ctrl-C or SIGTERM (fit.run's "interrupted at step N; saved ...
-- (resume from it)") ends the script with "<script>: <message>" and exit status 128 + the
-- signal (130, 143), as m3lua gives, without a traceback; so does an error object with a
-- status and a message (tostring), such as fit.run's stop after non-finite gradients, with its
-- status; other errors go up as they are.
-- An interrupt during flags.check ends the script the same way.

local number_text = require "m3.number_text"

local flags = {}

flags.INT32 = 2147483647 -- the largest value of the library's int32 options (steps, rows, ...)

local function usage(spec, banner)
  local lines = { banner or "flags:" }
  for _, f in ipairs(spec) do
    local default = f[2]
    local shown = type(default) == "boolean" and (default and "on" or "off") or default == "" and '""'
      or tostring(default)
    lines[#lines + 1] = string.format("  --%-16s %s (default %s%s)", f[1], f[3] or "", shown,
      f.fixed and "; fixed for a run" or "")
  end
  return table.concat(lines, "\n")
end
flags.usage = usage

-- "an integer >= 1", "an integer from 1 to 2147483647", "a number >= 0", "a finite number": what a number
-- flag takes (plural: "integers >= 1", ..., for the items of a list).
local function number_kind(f, plural)
  local noun = plural and (f.int and "integers" or (f.min or f.max) and "numbers" or "finite numbers")
    or (f.int and "an integer" or (f.min or f.max) and "a number" or "a finite number")
  local min, max = f.min and number_text.exact(f.min), f.max and number_text.exact(f.max)
  if min and max then return noun .. " from " .. min .. " to " .. max end
  return noun .. (min and " >= " .. min or max and " <= " .. max or "")
end

-- Whether text is a decimal number: an optional sign, digits with an optional fraction ("5",
-- "5.25", ".5", "5."), an optional exponent ("e-4", "E+2"); tonumber also reads hex, "inf",
-- "nan" and blanks around the digits, which a flag does not take.
local function is_decimal(text)
  local mantissa = text:match("^[-+]?([%d.]+)[eE][-+]?%d+$") or text:match("^[-+]?([%d.]+)$")
  return mantissa ~= nil and mantissa:find("^%d*%.?%d*$") ~= nil and mantissa:find("%d") ~= nil
end

-- The number text stands for, when it is one that f takes.
local function flag_number(f, text)
  local v = is_decimal(text) and tonumber(text)
  if v and math.abs(v) ~= math.huge and not (f.int and v ~= math.floor(v)) and not (f.min and v < f.min)
    and not (f.max and v > f.max) then
    return v
  end
end

-- Whether f's choices (if any) hold text.
local function chosen(f, text)
  if not f.choices then return true end
  for _, c in ipairs(f.choices) do
    if text == c then return true end
  end
  return false
end

-- A list flag's text, once it holds items and f takes every one ("" where that is f's default).
local function convert_list(f, text)
  if text == "" and f[2] == "" then return text end
  local numbers = f.int or f.min or f.max
  local items = flags.list(text)
  local ok, seen = #items > 0, {}
  for _, item in ipairs(items) do
    local value = numbers and flag_number(f, item) or not numbers and chosen(f, item) and item
    if not value then ok = false end
    if value and seen[value] then
      error(string.format("--%s repeats an item (%q and %q) in %q: give each once", f[1], seen[value], item, text), 0)
    end
    if value then seen[value] = item end
  end
  if not ok then
    local kind = numbers and number_kind(f, true) or f.choices and table.concat(f.choices, " | ") or "items"
    error(string.format("--%s expects a comma-separated list of %s, got %q", f[1], kind, text), 0)
  end
  return text
end

local function convert(f, text)
  local default = f[2]
  if f.list then return convert_list(f, text) end
  if type(default) == "number" then
    local v = flag_number(f, text)
    if not v then error(string.format("--%s expects %s, got %q", f[1], number_kind(f), text), 0) end
    return v
  elseif type(default) == "boolean" then
    if text == "true" or text == "1" or text == "on" then return true end
    if text == "false" or text == "0" or text == "off" then return false end
    error(string.format("--%s expects true or false, got %q", f[1], text), 0)
  end
  if not chosen(f, text) then
    error(string.format("--%s expects one of %s, got %q", f[1], table.concat(f.choices, " | "), text), 0)
  end
  return text
end

-- Parses args (a list of strings) into values; raises an error naming the bad flag.
function flags.values(args, spec)
  local by_name, values, given = {}, {}, {}
  for _, f in ipairs(spec) do
    by_name[f[1]] = f
    values[f[1]] = f[2]
  end
  local i = 1
  while i <= #args do
    local a = args[i]
    local name, inline = a:match("^%-%-([%w_%-]+)=(.*)$")
    name = name or a:match("^%-%-([%w_%-]+)$")
    if not name then error(string.format("unexpected argument %q (flags start with --)", a), 0) end
    name = name:gsub("%-", "_")
    local f = by_name[name]
    if not f then error(string.format("unknown flag --%s", name), 0) end
    given[name] = true
    if inline then
      values[name] = convert(f, inline)
    elseif type(f[2]) == "boolean" then
      values[name] = true
    else
      i = i + 1
      if args[i] == nil then error(string.format("--%s needs a value", name), 0) end
      if args[i]:sub(1, 2) == "--" then
        error(string.format("--%s expects a value; got the flag %s: use --%s=%s for a value that starts with --",
          name, args[i], name, args[i]), 0)
      end
      values[name] = convert(f, args[i])
    end
    i = i + 1
  end
  return values, flags.changed(values, spec), given
end

-- The names of spec's flags whose value in values differs from their default, in spec order.
function flags.changed(values, spec)
  local changed = {}
  for _, f in ipairs(spec) do
    if values[f[1]] ~= f[2] then changed[#changed + 1] = f[1] end
  end
  return changed
end

-- The items of a comma-separated value ("64,128" -> {"64", "128"}; convert, e.g. tonumber,
-- applies to each), for flags that take a list.
function flags.list(text, convert)
  local out = {}
  for item in tostring(text):gmatch("[^,%s]+") do out[#out + 1] = convert and convert(item) or item end
  return out
end

-- The n arguments of a script that takes n positional ones and no flags (usage: its usage
-- line): --help or -h first prints the usage and exits (0); another count of arguments
-- prints it on stderr with what was wrong and exits (2).
function flags.positional(args, n, usage_line)
  if args[1] == "--help" or args[1] == "-h" then
    print(usage_line)
    os.exit(0)
  end
  if #args ~= n then
    io.stderr:write(string.format("expected %d arguments, got %d\n%s\n", n, #args, usage_line))
    os.exit(2)
  end
  return unpack(args, 1, n)
end

-- Whether args ask for the usage: --help or -h where a flag is expected, not as the value of the
-- flag before it (`--prompt -h` is the prompt "-h"; `--run --help` asks, as --run takes no value
-- that starts with --), whatever else args hold.
local function asks_help(args, spec)
  local takes_value = {}
  for _, f in ipairs(spec) do takes_value[f[1]] = type(f[2]) ~= "boolean" end
  local i = 1
  while i <= #args do
    local a = args[i]
    if a == "--help" or a == "-h" then return true end
    local name = a:match("^%-%-([%w_%-]+)$")
    local value = args[i + 1]
    if name and takes_value[(name:gsub("%-", "_"))] and value and value:sub(1, 2) ~= "--" then i = i + 1 end
    i = i + 1
  end
  return false
end

-- values, changed, given; prints the usage and exits on --help (0) or a bad flag (2).
function flags.parse(args, spec, banner)
  local list = {}
  for i = 1, #(args or {}) do list[i] = args[i] end
  if asks_help(list, spec) then
    print(usage(spec, banner))
    os.exit(0)
  end
  local ok, values, changed, given = pcall(flags.values, list, spec)
  if not ok then
    io.stderr:write(values, "\n", usage(spec, banner), "\n")
    os.exit(2)
  end
  return values, changed, given
end

-- A library error without the position of the script line that called the library.
local function without_position(err)
  return (tostring(err):gsub("^[^:\n]*:%d+: ", ""))
end

-- The signal (2: SIGINT, 15: SIGTERM) behind err when it is an interrupt the m3lua host saw.
local function interrupt_signal(err)
  local host = package.loaded["m3.host"]
  return host and require("m3.checkpoint").is_interrupt(err) and host.pending_signal() or nil
end

-- Ends the script: "<script>: <message>" on stderr, then the exit status.
local function stop(script, message, status)
  io.stderr:write(script, ": ", message, "\n")
  os.exit(status)
end

-- An interrupt ends the script with its message's first line (a handler may have added a
-- traceback below it) and 128 + the signal, the status the host would give.
local function stop_if_interrupted(script, err)
  local sig = interrupt_signal(err)
  if sig then stop(script, tostring(err):match("^[^\n]*"), 128 + sig) end
end

local function checked(script, ok, ...)
  if ok then return ... end
  local err = ...
  stop_if_interrupted(script, err)
  stop(script, without_position(err), 2)
end

local function interruptible(script, ok, ...)
  if ok then return ... end
  local err = ...
  stop_if_interrupted(script, err)
  if type(err) == "table" and type(err.status) == "number" and getmetatable(err) and getmetatable(err).__tostring then
    stop(script, tostring(err), err.status) -- a stop the library explains itself (fit.run's non-finite gradients)
  end
  if type(err) == "string" and err:find("\nstack traceback:\n", 1, true) then
    stop(script, err, 1) -- its traceback once (fit.run's, with where it stopped), not the host's below it
  end
  error(err, 0)
end

-- fn(...)'s values; an error it raises ends the script: "<script>: <message>", exit status 2.
function flags.check(script, fn, ...)
  return checked(script, pcall(fn, ...))
end

-- fn(...)'s values; an interrupt ends the script: "<script>: <message>", 128 + the signal (an
-- error object with a status: that status; a message that carries its traceback: 1).
function flags.interruptible(script, fn, ...)
  return interruptible(script, pcall(fn, ...))
end

return flags

-- m3.log — progress output, metrics as JSONL, SVG plots of a run.
--
--   log.progress{total =, ...}     a progress bar on a terminal, plain lines otherwise
--                                  (m3.log.progress)
--   log.jsonl(path, {truncate =})  a metrics writer: w:write(record) appends one JSON
--                                  object per line and flushes (a list, or a value m3.json
--                                  refuses, is an error); w:close(). Appending to
--                                  a file whose last line was cut short (a crash) first
--                                  ends that line, so the new records stay whole
--   log.read_jsonl(path)           the records of a JSONL file (a list), and the numbers
--                                  of the lines skipped because they hold no JSON object
--                                  (a line cut short by a crash, an array, a number)
--   log.plot(records, path, opts)  an SVG of the curves in records: a panel of the keys
--                                  with "loss" in their name (not loss_scale) and one of
--                                  the keys with "acc" (x = opts.x or "step"; title =
--                                  opts.title); a null value (NaN or +-inf written by
--                                  m3.json) breaks the curve at its step
--   log.plot_run(dir)              dir/metrics.jsonl -> dir/plot.svg
--   log.svg                        the chart writer (m3.log.svg)
--   log.now(), log.duration(s)     a monotonic clock in seconds, "3m05s"
--   log.plural(n, noun, nouns)     "1 point", "3 points": n and the noun, plural (nouns, default
--                                  noun .. "s") unless n is 1
--
-- Bad arguments raise at the caller's line, naming the function and what was expected.

local fs = require "m3.fs"
local json = require "m3.json"
local lib = require "m3.lib"
local exact = require("m3.number_text").exact
local options = require "m3.options"
local progress = require "m3.log.progress"
local svg = require "m3.log.svg"

lib.internal_file(debug.getinfo(1, "S").source)

local check_keys, show, raise = options.check_keys, options.show, lib.raise

local log = {
  svg = svg,
  now = progress.now,
  duration = progress.duration,
  is_terminal = progress.is_terminal,
}

local PROGRESS_OPTS = { total = true, out = true, every = true, first = true, width = true, tty = true,
  interval = true }
local JSONL_OPTS = { truncate = true }
local PLOT_OPTS = { x = true, title = true }

function log.plural(n, noun, nouns)
  if type(n) ~= "number" then raise("m3.log.plural: expected a number, got " .. show(n)) end
  if type(noun) ~= "string" then raise("m3.log.plural: expected a noun (a string), got " .. show(noun)) end
  if type(nouns) ~= "nil" and type(nouns) ~= "string" then
    raise("m3.log.plural: nouns = " .. show(nouns) .. ": expected the plural (a string) or nil")
  end
  return exact(n) .. " " .. (n == 1 and noun or nouns or noun .. "s")
end

function log.progress(o)
  if type(o) == "table" then check_keys(o, PROGRESS_OPTS, "m3.log.progress") end
  return progress.new(o)
end

local W = {}
W.__index = W

-- True when path is a regular file that does not end with a newline (a FIFO is not probed: opening it to
-- read would wait for a writer, and the records it takes are another process's to read).
local function ends_mid_line(path)
  if not fs.is_file(path) then return false end
  local f = io.open(path, "rb")
  if not f then return false end
  local size = f:seek("end")
  local last = size > 0 and f:seek("end", -1) and f:read(1)
  f:close()
  return size > 0 and last ~= "\n"
end

function log.jsonl(path, opts)
  if type(path) ~= "string" then raise("m3.log.jsonl: expected a file path, got " .. show(path)) end
  check_keys(opts or {}, JSONL_OPTS, "m3.log.jsonl")
  local append = not (opts and opts.truncate)
  local torn = append and ends_mid_line(path)
  local f, err = io.open(path, append and "a" or "w")
  if not f then raise("m3.log.jsonl: cannot open " .. tostring(err)) end
  if torn then
    f:write("\n")
    f:flush()
  end
  return setmetatable({ f = f, path = path }, W)
end

function W:write(record)
  if not self.f then raise("m3.log.jsonl: " .. self.path .. " is closed") end
  if type(record) ~= "table" then raise("m3.log.jsonl: write expects a record (a table), got " .. show(record)) end
  local encoded, line = pcall(json.encode, record)
  if not encoded then raise("m3.log.jsonl: write: " .. tostring(line)) end
  if line:sub(1, 1) ~= "{" then -- a list: read_jsonl would skip the line
    raise("m3.log.jsonl: write expects a record (a table of named fields), got the list " .. show(record))
  end
  local wrote, werr = self.f:write(line, "\n")
  local flushed, ferr = self.f:flush()
  if not (wrote and flushed) then raise("m3.log.jsonl: cannot write " .. self.path .. ": " .. tostring(werr or ferr)) end
end

function W:close()
  if self.f then self.f:close() end
  self.f = nil
end

function log.read_jsonl(path)
  if type(path) ~= "string" then raise("m3.log.read_jsonl: expected a file path, got " .. show(path)) end
  fs.check_path(path, "m3.log.read_jsonl")
  local kind = fs.kind(path)
  if kind then raise("m3.log.read_jsonl: " .. path .. " is " .. kind .. ", not a JSONL file") end
  local f, err = io.open(path, "r")
  if not f then raise("m3.log.read_jsonl: cannot open " .. tostring(err)) end
  local out, skipped, n = {}, {}, 0
  for line in f:lines() do
    n = n + 1
    if line:find("%S") then
      local ok, v = pcall(json.decode, line)
      -- a line cut short by a crash is skipped: the records after it (a resumed run) count; so is a value
      -- that is not an object (json.decode gives arrays and null a metatable, objects none)
      if ok and type(v) == "table" and getmetatable(v) == nil then
        out[#out + 1] = v
      else
        skipped[#skipped + 1] = n
      end
    end
  end
  f:close()
  return out, skipped
end

-- Series {name, x, y} for the string keys of records that pass keep(key), in sorted key order (a key
-- of another type names no metric: a list record's 1, 2, ...). A JSON null
-- (how m3.json writes NaN and +-inf) becomes a NaN point, which breaks the line there.
local function series_of(records, xkey, keep)
  local keys, seen = {}, {}
  for _, r in ipairs(records) do
    for k, v in pairs(r) do
      if type(k) == "string" and k ~= xkey and type(v) == "number" and keep(k) and not seen[k] then
        seen[k] = true
        keys[#keys + 1] = k
      end
    end
  end
  table.sort(keys)
  local out = {}
  for _, k in ipairs(keys) do
    local xs, ys = {}, {}
    for _, r in ipairs(records) do
      local y = r[k] == json.null and 0 / 0 or r[k]
      if type(y) == "number" and type(r[xkey]) == "number" then
        xs[#xs + 1], ys[#ys + 1] = r[xkey], y
      end
    end
    out[#out + 1] = { name = k, x = xs, y = ys }
  end
  return out
end

-- Log scale when every finite value is positive and they span more than a factor of 20 (NaN and
-- +-inf are not drawn, so they have no say).
local function wants_log(series)
  local lo, hi = math.huge, 0
  for _, s in ipairs(series) do
    for _, y in ipairs(s.y) do
      if y - y == 0 then -- finite
        if y <= 0 then return false end
        lo, hi = math.min(lo, y), math.max(hi, y)
      end
    end
  end
  return hi > 20 * lo
end

-- opts, once it is nil or a table of the plot options x and title (strings); {} for nil.
local function plot_opts(opts, what)
  if opts == nil then return {} end
  options.check_table(opts, PLOT_OPTS, what)
  if opts.x ~= nil and type(opts.x) ~= "string" then
    raise(string.format("%s: x = %s: expected the name of a record field", what, show(opts.x)))
  end
  if opts.title ~= nil and type(opts.title) ~= "string" then
    raise(string.format("%s: title = %s: expected a string", what, show(opts.title)))
  end
  return opts
end

function log.plot(records, path, opts)
  if type(records) ~= "table" then raise("m3.log.plot: expected a list of records (tables), got " .. show(records)) end
  for i, r in ipairs(records) do
    if type(r) ~= "table" then raise(string.format("m3.log.plot: records[%d] = %s: expected a table", i, show(r))) end
  end
  if type(path) ~= "string" then raise("m3.log.plot: expected the path of the SVG file, got " .. show(path)) end
  opts = plot_opts(opts, "m3.log.plot")
  local xkey = opts.x or "step"
  local losses = series_of(records, xkey, function(k)
    return k:find("loss", 1, true) ~= nil and k ~= "loss_scale"
  end)
  local accs = series_of(records, xkey, function(k) return k:find("acc", 1, true) ~= nil end)
  local charts = { svg.lines {
    title = (opts.title and opts.title .. ": " or "") .. "loss", xlabel = xkey, ylabel = "loss",
    series = losses, logy = wants_log(losses),
  } }
  if #accs > 0 then
    charts[2] = svg.lines { title = "accuracy", xlabel = xkey, ylabel = "accuracy", series = accs }
  end
  svg.write(path, charts)
  return path
end

function log.plot_run(dir, opts)
  if type(dir) ~= "string" then raise("m3.log.plot_run: expected a run folder, got " .. show(dir)) end
  opts = plot_opts(opts, "m3.log.plot_run")
  local records = log.read_jsonl(dir .. "/metrics.jsonl")
  return log.plot(records, dir .. "/plot.svg", { title = opts.title or dir:match("([^/]+)/*$"), x = opts.x })
end

return log

-- m3.log — progress output, metrics as JSONL, SVG plots of a run.
--
--   log.progress{total =, ...}     a progress bar on a terminal, plain lines otherwise
--                                  (m3.log.progress)
--   log.jsonl(path, {truncate =})  a metrics writer: w:write(record) appends one JSON
--                                  object per line and flushes; w:close(). Appending to
--                                  a file whose last line was cut short (a crash) first
--                                  ends that line, so the new records stay whole
--   log.read_jsonl(path)           the records of a JSONL file (a list), and the numbers
--                                  of the lines skipped because they hold no JSON object
--                                  (a line cut short by a crash)
--   log.plot(records, path, opts)  an SVG of the curves in records: a panel of the keys
--                                  with "loss" in their name (not loss_scale) and one of
--                                  the keys with "acc" (x = opts.x or "step"; title =
--                                  opts.title)
--   log.plot_run(dir)              dir/metrics.jsonl -> dir/plot.svg
--   log.svg                        the chart writer (m3.log.svg)
--   log.now(), log.duration(s)     a monotonic clock in seconds, "3m05s"

local json = require "m3.json"
local lib = require "m3.lib"
local options = require "m3.options"
local progress = require "m3.log.progress"
local svg = require "m3.log.svg"

lib.internal_file(debug.getinfo(1, "S").source)

local check_keys = options.check_keys

local log = {
  svg = svg,
  now = progress.now,
  duration = progress.duration,
  is_terminal = progress.is_terminal,
}

local PROGRESS_OPTS = { total = true, out = true, every = true, first = true, width = true, tty = true }
local JSONL_OPTS = { truncate = true }
local PLOT_OPTS = { x = true, title = true }

function log.progress(o)
  check_keys(o or {}, PROGRESS_OPTS, "m3.log.progress")
  return progress.new(o)
end

local W = {}
W.__index = W

-- True when the file at path exists and does not end with a newline.
local function ends_mid_line(path)
  local f = io.open(path, "rb")
  if not f then return false end
  local size = f:seek("end")
  local last = size > 0 and f:seek("end", -1) and f:read(1)
  f:close()
  return size > 0 and last ~= "\n"
end

function log.jsonl(path, opts)
  if type(path) ~= "string" then lib.raise("m3.log.jsonl: expected a file path, got " .. type(path)) end
  check_keys(opts or {}, JSONL_OPTS, "m3.log.jsonl")
  local append = not (opts and opts.truncate)
  local torn = append and ends_mid_line(path)
  local f, err = io.open(path, append and "a" or "w")
  if not f then lib.raise("m3.log.jsonl: cannot open " .. tostring(err)) end
  if torn then
    f:write("\n")
    f:flush()
  end
  return setmetatable({ f = f, path = path }, W)
end

function W:write(record)
  if not self.f then lib.raise("m3.log.jsonl: " .. self.path .. " is closed") end
  self.f:write(json.encode(record), "\n")
  self.f:flush()
end

function W:close()
  if self.f then self.f:close() end
  self.f = nil
end

function log.read_jsonl(path)
  local f, err = io.open(path, "r")
  if not f then lib.raise("m3.log.read_jsonl: cannot open " .. tostring(err)) end
  local out, skipped, n = {}, {}, 0
  for line in f:lines() do
    n = n + 1
    if line:find("%S") then
      local ok, v = pcall(json.decode, line)
      -- a line cut short by a crash is skipped: the records after it (a resumed run) count
      if ok and type(v) == "table" and v ~= json.null then
        out[#out + 1] = v
      else
        skipped[#skipped + 1] = n
      end
    end
  end
  f:close()
  return out, skipped
end

-- Series {name, x, y} for the keys of records that pass keep(key), in sorted key order.
local function series_of(records, xkey, keep)
  local keys, seen = {}, {}
  for _, r in ipairs(records) do
    for k, v in pairs(r) do
      if k ~= xkey and type(v) == "number" and keep(k) and not seen[k] then
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
      if type(r[k]) == "number" and type(r[xkey]) == "number" then
        xs[#xs + 1], ys[#ys + 1] = r[xkey], r[k]
      end
    end
    out[#out + 1] = { name = k, x = xs, y = ys }
  end
  return out
end

-- Log scale when every value is positive and they span more than a factor of 20.
local function wants_log(series)
  local lo, hi = math.huge, 0
  for _, s in ipairs(series) do
    for _, y in ipairs(s.y) do
      if y <= 0 then return false end
      lo, hi = math.min(lo, y), math.max(hi, y)
    end
  end
  return hi > 20 * lo
end

function log.plot(records, path, opts)
  opts = opts or {}
  check_keys(opts, PLOT_OPTS, "m3.log.plot")
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
  opts = opts or {}
  check_keys(opts, PLOT_OPTS, "m3.log.plot_run")
  local records = log.read_jsonl(dir .. "/metrics.jsonl")
  return log.plot(records, dir .. "/plot.svg", { title = opts.title or dir:match("([^/]+)/*$"), x = opts.x })
end

return log

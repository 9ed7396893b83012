-- m3.log.progress — training progress: a live bar on a terminal, plain lines otherwise.
--
--   local p = progress.new{total = 1000, out = io.stdout, every = 50, first = 0, interval = 30}
--                                              out: an open file, or a table with write and flush
--   p:update(step, {loss =, lr =, tokens =})   tokens: processed by this step
--   p:message("val_loss 0.12")                 a line that does not break the bar
--   p:finish()
--
-- On a terminal (out is io.stdout or io.stderr and isatty says so, or tty = true) one
-- line is redrawn at most every 0.1 s: step/total, a bar, loss, lr, tokens/s, ETA.
-- Otherwise (a file, a pipe, a test) a plain line is written at every step that is a
-- multiple of `every` (default: total/20), at the last step, and at the first step that comes
-- `interval` seconds (default 30; math.huge: never) or more after the last line (or the start),
-- so that a slow run shows it is alive. `first` is the step the run starts after (a
-- resumed run), so the rates and the ETA count only this session's steps. The clock is
-- progress.now, looked up at each call (a spec may replace it).
-- The step is an integer in [0, 2^53); loss, lr and tokens are numbers when given (a NaN or inf loss is
-- shown as it is). Bad options or arguments raise at the caller's line.

local ffi = require "ffi"
local lib = require "m3.lib"
local options = require "m3.options"

lib.internal_file(debug.getinfo(1, "S").source)

local raise, show, want_int, want_bool = lib.raise, options.show, options.want_int, options.want_bool
local want_number = options.want_number

pcall(ffi.cdef, "int isatty(int fd);")
pcall(ffi.cdef, [[
typedef struct m3_log_timespec { int64_t tv_sec; long tv_nsec; } m3_log_timespec;
int clock_gettime(int clk_id, m3_log_timespec *tp);
]])

local progress = {}

local CLOCK_MONOTONIC = 1
local ts = ffi.new("m3_log_timespec")

-- Seconds from an arbitrary origin, monotonic, with sub-millisecond resolution.
function progress.now()
  ffi.C.clock_gettime(CLOCK_MONOTONIC, ts)
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end

function progress.is_terminal(out)
  local fd = (out == io.stdout and 1) or (out == io.stderr and 2) or nil
  return fd ~= nil and ffi.C.isatty(fd) == 1
end

-- "42s", "3m05s", "2h07m", "-5s", "1.2e+06h" (past a million hours), "?" (not finite)
function progress.duration(s)
  if type(s) ~= "number" then raise("m3.log.duration: expected seconds (a number), got " .. show(s)) end
  if s ~= s or s == math.huge or s == -math.huge then return "?" end
  if s < 0 then return "-" .. progress.duration(-s) end
  if s >= 3600e6 then return string.format("%.2gh", s / 3600) end
  s = math.floor(s + 0.5)
  if s < 60 then return s .. "s" end
  if s < 3600 then return string.format("%dm%02ds", math.floor(s / 60), s % 60) end
  return string.format("%dh%02dm", math.floor(s / 3600), math.floor(s / 60) % 60)
end

local SI = { { 1e12, "T" }, { 1e9, "G" }, { 1e6, "M" }, { 1e3, "k" } }

-- 950, 12.3k, 4.56M, -2k, 0.5, 0, nan, inf: three significant digits, the unit chosen after
-- rounding (999.6 is "1k", 999999 "1M"); below 1000 and past 999T plain %.3g ("0.000123", "1e+15").
function progress.si(x)
  if type(x) ~= "number" then raise("m3.log.progress.si: expected a number, got " .. show(x)) end
  if x ~= x then return "nan" end
  if x == 0 then return "0" end
  if x < 0 then return "-" .. progress.si(-x) end
  if x == math.huge then return "inf" end
  local r = tonumber(string.format("%.3g", x))
  for _, u in ipairs(SI) do
    if r >= u[1] and r < 1e3 * u[1] then return string.format("%.3g%s", r / u[1], u[2]) end
  end
  return string.format("%.3g", r)
end

-- 0.1234, 1234.5678; 1.2346e+06 from a million on (or below a ten-thousandth), not 300 digits.
function progress.fixed(x)
  local a = math.abs(x)
  if a >= 1e6 or (a < 1e-4 and a > 0) then return string.format("%.4e", x) end
  return string.format("%.4f", x)
end

local P = {}
P.__index = P

local METRICS = { "loss", "lr", "tokens" } -- update's fields that must be numbers when given

-- v when it is a number of seconds > 0 (math.huge included), else an error naming it.
local function want_seconds(v, name)
  if type(v) ~= "number" or not (v > 0) then raise(name .. " = " .. show(v) .. ": expected seconds (a number > 0)") end
  return v
end

function progress.new(o)
  if type(o) ~= "table" then raise("m3.log.progress: expected {total = <steps>, ...}, got " .. show(o)) end
  local total = want_int(o.total, "m3.log.progress: total", 1)
  local out = o.out
  if type(out) == "nil" then out = io.stdout end -- (type: a NULL pointer == nil, and is no file)
  if io.type(out) == "closed file" then raise("m3.log.progress: out = " .. show(out) .. ": the file is closed") end
  if io.type(out) ~= "file" and (type(out) ~= "table" or type(out.write) ~= "function"
    or type(out.flush) ~= "function") then
    raise("m3.log.progress: out = " .. show(o.out) .. ": expected an open file (or a table with write and flush "
      .. "methods)")
  end
  local function given(k) return type(o[k]) ~= "nil" end
  local self = setmetatable({
    total = total, out = out, first = given("first") and want_int(o.first, "m3.log.progress: first", 0) or 0,
    every = given("every") and want_int(o.every, "m3.log.progress: every", 1) or math.max(1, math.floor(total / 20)),
    width = given("width") and want_int(o.width, "m3.log.progress: width", 1) or 24,
    interval = given("interval") and want_seconds(o.interval, "m3.log.progress: interval") or 30,
    tokens = 0, drawn = -math.huge, line_open = false,
  }, P)
  if given("tty") then self.tty = want_bool(o.tty, "m3.log.progress: tty") else self.tty = progress.is_terminal(out) end
  self.start = progress.now()
  self.written = self.start
  return self
end

-- The fields of a status line for step at time now (after this session's steps and tokens).
function P:fields(step, m, now)
  local elapsed = now - self.start
  local done = step - self.first
  local parts = { string.format("step %d/%d", step, self.total) }
  if m.loss then parts[#parts + 1] = "loss " .. progress.fixed(m.loss) end
  if m.lr then parts[#parts + 1] = string.format("lr %.2e", m.lr) end
  if self.tokens > 0 and elapsed > 0 then
    parts[#parts + 1] = progress.si(self.tokens / elapsed) .. " tok/s"
  end
  local eta = done > 0 and (self.total - step) * elapsed / done or math.huge
  return parts, elapsed, eta
end

function P:update(step, m)
  if type(step) ~= "number" or step < 0 or step >= 2 ^ 53 or step ~= math.floor(step) then
    raise("m3.log.progress: update expects a step (an integer in [0, 2^53)), got " .. show(step))
  end
  if type(m) ~= "nil" and type(m) ~= "table" then
    raise("m3.log.progress: update expects {loss =, lr =, tokens =} after the step, got " .. show(m))
  end
  m = m or {}
  for _, k in ipairs(METRICS) do -- (type: a NULL pointer == nil)
    if type(m[k]) ~= "nil" then want_number(m[k], "m3.log.progress: update: " .. k) end
  end
  self.tokens = self.tokens + (m.tokens or 0)
  self.step, self.last = step, m
  local final, now = step >= self.total, progress.now()
  if self.tty then
    if not final and now - self.drawn < 0.1 then return end
    self.drawn = now
    self:draw(step, m, now)
  elseif final or step % self.every == 0 or now - self.written >= self.interval then
    self.written = now
    self:line(step, m, now, final)
  end
end

-- A plain line (not a terminal): the fields, the time so far and, before the last step, the ETA.
function P:line(step, m, now, final)
  local parts, elapsed, eta = self:fields(step, m, now)
  parts[#parts + 1] = "elapsed " .. progress.duration(elapsed)
  if not final then parts[#parts + 1] = "eta " .. progress.duration(eta) end
  self.out:write(table.concat(parts, "  "), "\n")
  self.out:flush()
end

function P:draw(step, m, now)
  local parts, _, eta = self:fields(step, m, now or progress.now())
  local frac = math.min(math.max(step / self.total, 0), 1)
  local fill = math.floor(frac * self.width + 0.5)
  table.insert(parts, 2, "[" .. string.rep("#", fill) .. string.rep("-", self.width - fill) .. "]"
    .. string.format(" %3d%%", math.floor(frac * 100)))
  parts[#parts + 1] = "ETA " .. progress.duration(eta)
  self.out:write("\r", table.concat(parts, "  "), "\027[K")
  self.out:flush()
  self.line_open = true
end

function P:message(text)
  if type(text) ~= "string" then raise("m3.log.progress: message expects a string, got " .. show(text)) end
  if self.tty and self.line_open then
    self.out:write("\r\027[K", text, "\n")
    if self.step then self:draw(self.step, self.last) end
  else
    self.out:write(text, "\n")
  end
  self.out:flush()
end

function P:finish()
  if self.tty and self.line_open then
    if self.step then self:draw(self.step, self.last) end
    self.out:write("\n")
    self.line_open = false
  end
  self.out:flush()
  return progress.now() - self.start
end

return progress

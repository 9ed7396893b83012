-- m3.log.svg — line and bar charts as standalone SVG, written by hand (no dependency).
--
--   svg.lines{title =, xlabel =, ylabel =, logy =, series = {{name =, x = {...}, y = {...}}}}
--       -> a chart (a table with width, height and body); x and y of a series have one length
--   svg.bars{title =, xlabel =, labels = {...}, values = {...}} -> a horizontal bar chart (values[i]: labels[i]'s)
--   svg.document(charts) -> SVG text with the charts stacked vertically
--   svg.write(path, charts) -> writes the document (atomically; the folder must exist)
--   svg.nice_ticks(lo, hi, n = 5) -> ticks, axis_lo, axis_hi  (n at most 100)
--
-- Axes get "nice" ticks (1, 2, 5 times a power of ten; powers of ten on a log axis, every
-- decade up to ten of them, else at a step of 2, 5, 10, ... decades);
-- series longer than 1500 points are averaged in buckets; non-finite points break a line.
-- Any finite values give finite coordinates (an axis stops at the largest float). Text (titles,
-- labels, names) is escaped; the control characters XML forbids and bytes that are not UTF-8
-- become U+FFFD, so the document stays well-formed.
-- Bad arguments raise at the caller's line, naming the function and what was expected.

local fs = require "m3.fs"
local lib = require "m3.lib"
local options = require "m3.options"

lib.internal_file(debug.getinfo(1, "S").source)

local raise, show = lib.raise, options.show

local svg = {}

local floor, ceil, log10, abs, min, max = math.floor, math.ceil, math.log10, math.abs, math.min, math.max

local PALETTE = { "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf" }
local W, H = 720, 360
local LEFT, RIGHT, TOP, BOTTOM = 70, 170, 34, 46
local MAX_POINTS = 1500
local MAX_TICKS = 100
local LOG_DECADES = 10 -- a log axis over more decades ticks at a nice step of decades
-- Values closer to zero than this count as zero on an axis (so that steps stay normal floats).
local TINY = 1e-280
local HUGE = 1.7976931348623157e308 -- the largest float

local REPLACEMENT = "\239\191\189" -- U+FFFD in UTF-8
-- The UTF-8 sequences of the code points above U+007F, surrogates excluded (RFC 3629).
local UTF8 = {
  "^[\194-\223][\128-\191]",
  "^\224[\160-\191][\128-\191]", "^[\225-\236\238\239][\128-\191][\128-\191]", "^\237[\128-\159][\128-\191]",
  "^\240[\144-\191][\128-\191][\128-\191]", "^[\241-\243][\128-\191][\128-\191][\128-\191]",
  "^\244[\128-\143][\128-\191][\128-\191]",
}
local NONCHARACTER = { ["\239\191\190"] = true, ["\239\191\191"] = true } -- U+FFFE, U+FFFF: not XML

-- s with each byte that starts no valid UTF-8 sequence (Latin-1 text, a torn sequence), and each
-- U+FFFE or U+FFFF, as U+FFFD.
local function valid_utf8(s)
  local out, i = {}, 1
  while true do
    local j = s:find("[\128-\255]", i)
    out[#out + 1] = s:sub(i, (j or 0) - 1)
    if not j then return table.concat(out) end
    local seq
    for _, p in ipairs(UTF8) do
      seq = s:match(p, j)
      if seq then break end
    end
    out[#out + 1] = (seq == nil or NONCHARACTER[seq]) and REPLACEMENT or seq
    i = j + (seq and #seq or 1)
  end
end

-- tostring(s) as XML 1.0 text or attribute value: markup characters escaped, the control characters
-- XML forbids and bytes that are not UTF-8 as U+FFFD (valid UTF-8 passes through).
local function esc(s)
  s = valid_utf8((tostring(s):gsub("[%z\1-\8\11\12\14-\31]", REPLACEMENT)))
  return (s:gsub("&", "&amp;"):gsub("<", "&lt;"):gsub(">", "&gt;"):gsub('"', "&quot;"))
end

local function finite(v)
  return type(v) == "number" and v == v and v ~= math.huge and v ~= -math.huge
end

local LINES_OPTS = { title = true, xlabel = true, ylabel = true, logy = true, series = true }
local SERIES_OPTS = { name = true, x = true, y = true, color = true }
local BARS_OPTS = { title = true, xlabel = true, labels = true, values = true }


-- v, once it is nil (then {}) or a table.
local function want_list(v, name, what)
  if v == nil then return {} end
  if type(v) ~= "table" then raise(string.format("%s: %s = %s: expected a list", what, name, show(v))) end
  return v
end

local function label(v)
  if v == 0 then return "0" end
  local a = abs(v)
  if a >= 1e5 or a < 1e-3 then return (string.format("%.2g", v):gsub("e%+?(%-?)0*(%d)", "e%1%2")) end
  return (string.format("%.5g", v))
end

-- Ticks covering [lo, hi]: about n (at most MAX_TICKS) values at a step of 1, 2 or 5
-- times a power of ten, and the axis range (the outer ticks).
function svg.nice_ticks(lo, hi, n)
  if not finite(lo) or not finite(hi) then
    raise(string.format("m3.log.svg.nice_ticks: expected finite lo and hi, got %s and %s", show(lo), show(hi)))
  end
  n = n == nil and 5 or options.want_int(n, "m3.log.svg.nice_ticks: n", 1)
  if n > MAX_TICKS then raise(string.format("m3.log.svg.nice_ticks: n = %d: expected at most %d", n, MAX_TICKS)) end
  -- half the span, and ticks as integers times a power of ten p: nothing overflows
  local half = hi * 0.5 - lo * 0.5
  if half <= max(abs(lo), abs(hi)) * 0.5e-12 or half < TINY then
    -- constant (or a few ulps wide): padded by a tenth of the value (below it near the
    -- largest float), to 1 around zero
    local pad = abs(lo) < TINY and 1 or abs(lo) * 0.1
    if lo + pad < HUGE then hi = lo + pad else lo, hi = lo - pad, lo end
    half = hi * 0.5 - lo * 0.5
  end
  local raw = half / n -- half the step wanted
  local p = 10 ^ floor(log10(raw) + log10(2))
  local m
  for _, f in ipairs { 1, 2, 5, 10 } do
    m = f
    if m * p * 0.5 >= raw then break end
  end
  local ka, kb = floor(lo / p / m + 1e-9), ceil(hi / p / m - 1e-9)
  local ticks = {}
  for k = ka, kb do
    if finite(k * m * p) then ticks[#ticks + 1] = k * m * p end
  end
  return ticks, max(ka * m * p, -HUGE), min(kb * m * p, HUGE)
end

-- Where v lies from a to b, 0 to 1 (computed on halves, so that b - a cannot overflow).
local function frac(v, a, b)
  return (v * 0.5 - a * 0.5) / (b * 0.5 - a * 0.5)
end

-- The label of the tick 10^k on a log axis.
local function power_label(k)
  if k < -307 or k > 308 then return "1e" .. k end
  return label(10 ^ k)
end

-- Whether (x, y) is drawn: finite, and positive on a log axis.
local function drawn(x, y, logy)
  return finite(x) and finite(y) and (not logy or y > 0)
end

-- Averages (x, y) into at most MAX_POINTS buckets, a bucket's runs of drawn points each
-- to one point; a point not drawn becomes a break (a NaN), so a gap stays a gap.
local function decimate(xs, ys, logy)
  local n = #xs
  if n <= MAX_POINTS then return xs, ys end
  local bx, by, size = {}, {}, n / MAX_POINTS
  for b = 0, MAX_POINTS - 1 do
    local i, i1 = floor(b * size) + 1, floor((b + 1) * size)
    while i <= i1 do
      local j = i
      while j <= i1 and drawn(xs[j], ys[j], logy) do j = j + 1 end
      if j > i then
        local sx, sy, c = 0, 0, j - i
        for k = i, j - 1 do sx, sy = sx + xs[k] / c, sy + ys[k] / c end
        bx[#bx + 1], by[#by + 1] = sx, sy
      elseif by[#by] == by[#by] then -- one break for a run of points not drawn
        bx[#bx + 1], by[#by + 1] = 0 / 0, 0 / 0
      end
      i = max(j, i + 1)
    end
  end
  return bx, by
end

local function frame(out, title, xlabel, ylabel)
  out[#out + 1] = string.format('<rect x="0" y="0" width="%d" height="%d" fill="white"/>', W, H)
  out[#out + 1] = string.format(
    '<text x="%d" y="20" text-anchor="middle" font-size="15" font-weight="bold">%s</text>',
    LEFT + (W - LEFT - RIGHT) / 2, esc(title or ""))
  if xlabel then
    out[#out + 1] = string.format('<text x="%d" y="%d" text-anchor="middle" font-size="12">%s</text>',
      LEFT + (W - LEFT - RIGHT) / 2, H - 8, esc(xlabel))
  end
  if ylabel then
    out[#out + 1] = string.format(
      '<text x="16" y="%d" text-anchor="middle" font-size="12" transform="rotate(-90 16 %d)">%s</text>',
      TOP + (H - TOP - BOTTOM) / 2, TOP + (H - TOP - BOTTOM) / 2, esc(ylabel))
  end
end

function svg.lines(o)
  options.check_table(o, LINES_OPTS, "m3.log.svg.lines")
  local series = want_list(o.series, "series", "m3.log.svg.lines")
  for i, s in ipairs(series) do
    local what = string.format("m3.log.svg.lines: series[%d]", i)
    options.check_table(s, SERIES_OPTS, what)
    if type(s.x) ~= "table" or type(s.y) ~= "table" then
      raise(string.format("%s: expected lists x and y, got %s and %s", what, show(s.x), show(s.y)))
    end
    if #s.x ~= #s.y then -- the points past the shorter list would be dropped without a word
      raise(string.format("%s: expected lists x and y of one length, got %d and %d values", what, #s.x, #s.y))
    end
    -- written into attributes as it is: a name or #hex only, never markup
    if s.color ~= nil and not (type(s.color) == "string" and s.color:match("^#?[%w]+$")) then
      raise(string.format('%s: color = %s: expected a color name or "#rrggbb"', what, show(s.color)))
    end
  end
  local x0, x1, y0, y1 = math.huge, -math.huge, math.huge, -math.huge
  local logy = o.logy
  local data = {}
  for i, s in ipairs(series) do
    local xs, ys = decimate(s.x, s.y, logy)
    data[i] = { xs, ys }
    for j = 1, #xs do
      local y = ys[j]
      if drawn(xs[j], y, logy) then
        x0, x1 = min(x0, xs[j]), max(x1, xs[j])
        y0, y1 = min(y0, y), max(y1, y)
      end
    end
  end
  local out = {}
  frame(out, o.title, o.xlabel, o.ylabel)
  local pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM
  if x0 > x1 then
    out[#out + 1] = string.format('<text x="%d" y="%d" text-anchor="middle" font-size="12" fill="#888">no data</text>',
      LEFT + pw / 2, TOP + ph / 2)
    return { width = W, height = H, body = table.concat(out, "\n") }
  end
  local xt, xa, xb = svg.nice_ticks(x0, x1, 6)
  -- the y axis in its own units: the value, or its log10 (ticks at the powers of ten)
  local yt, ya, yb
  local ty, ylabel = function(v) return v end, label
  if logy then
    ty, ylabel = log10, power_label
    ya, yb = floor(log10(y0)), ceil(log10(y1))
    if yb == ya then yb = ya + 1 end
    if yb - ya > LOG_DECADES then
      yt, ya, yb = svg.nice_ticks(ya, yb, LOG_DECADES) -- every 2nd, 5th, 10th, ... decade
    else
      yt = {}
      for k = ya, yb do yt[#yt + 1] = k end
    end
  else
    yt, ya, yb = svg.nice_ticks(y0, y1, 5)
  end
  local function px(x) return LEFT + frac(x, xa, xb) * pw end
  local function py(u) return TOP + ph - frac(u, ya, yb) * ph end
  -- grid, ticks and labels
  for _, t in ipairs(xt) do
    local x = px(t)
    out[#out + 1] = string.format('<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#e5e5e5"/>', x, TOP, x, TOP + ph)
    out[#out + 1] = string.format('<text x="%.1f" y="%d" text-anchor="middle" font-size="11">%s</text>',
      x, TOP + ph + 16, label(t))
  end
  for _, t in ipairs(yt) do
    local y = py(t)
    out[#out + 1] = string.format('<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#e5e5e5"/>', LEFT, y, LEFT + pw, y)
    out[#out + 1] = string.format('<text x="%d" y="%.1f" text-anchor="end" font-size="11">%s</text>',
      LEFT - 6, y + 4, ylabel(t))
  end
  out[#out + 1] = string.format('<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#333"/>',
    LEFT, TOP, pw, ph)
  -- curves (a point outside a log axis' domain or non-finite breaks the line)
  for i, s in ipairs(series) do
    local color = s.color or PALETTE[(i - 1) % #PALETTE + 1]
    local xs, ys = data[i][1], data[i][2]
    local runs, cur = {}, {}
    for j = 1, #xs do
      local y = ys[j]
      if drawn(xs[j], y, logy) then
        cur[#cur + 1] = string.format("%.1f,%.1f", px(xs[j]), py(ty(y)))
      elseif #cur > 0 then
        runs[#runs + 1], cur = cur, {}
      end
    end
    if #cur > 0 then runs[#runs + 1] = cur end
    for _, r in ipairs(runs) do
      if #r == 1 then
        local cx, cy = r[1]:match("([^,]+),(.+)")
        out[#out + 1] = string.format('<circle cx="%s" cy="%s" r="2.5" fill="%s"/>', cx, cy, color)
      else
        out[#out + 1] = string.format('<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>',
          color, table.concat(r, " "))
      end
    end
    local ly = TOP + 10 + (i - 1) * 18
    out[#out + 1] = string.format('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="3"/>',
      LEFT + pw + 12, ly, LEFT + pw + 32, ly, color)
    out[#out + 1] = string.format('<text x="%d" y="%d" font-size="12">%s</text>', LEFT + pw + 38, ly + 4,
      esc(s.name or ("series " .. i)))
  end
  return { width = W, height = H, body = table.concat(out, "\n") }
end

function svg.bars(o)
  options.check_table(o, BARS_OPTS, "m3.log.svg.bars")
  local labels = want_list(o.labels, "labels", "m3.log.svg.bars")
  local values = want_list(o.values, "values", "m3.log.svg.bars")
  if table.maxn(values) > #labels then -- (a label without a value, nil or not finite, is drawn without a bar)
    lib.raise(string.format("m3.log.svg.bars: %d labels but values up to values[%d]: expected at most one value per "
      .. "label", #labels, table.maxn(values)))
  end
  local n = #labels
  local bar_h, gap = 18, 6
  local left, top = 260, 34
  local pw = W - left - 40
  local height = top + n * (bar_h + gap) + BOTTOM
  local out = {}
  out[#out + 1] = string.format('<rect x="0" y="0" width="%d" height="%d" fill="white"/>', W, height)
  out[#out + 1] = string.format('<text x="%d" y="20" text-anchor="middle" font-size="15" font-weight="bold">%s</text>',
    W / 2, esc(o.title or ""))
  local lo, hi = 0, 0
  for i = 1, n do
    if finite(values[i]) then lo, hi = min(lo, values[i]), max(hi, values[i]) end
  end
  local ticks, a, b = svg.nice_ticks(lo, hi, 5)
  local function px(v) return left + frac(v, a, b) * pw end
  local axis_y = top + n * (bar_h + gap)
  for _, t in ipairs(ticks) do
    out[#out + 1] = string.format('<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#e5e5e5"/>', px(t), top - 4, px(t), axis_y)
    out[#out + 1] = string.format('<text x="%.1f" y="%d" text-anchor="middle" font-size="11">%s</text>',
      px(t), axis_y + 16, label(t))
  end
  for i = 1, n do
    local y, v = top + (i - 1) * (bar_h + gap), values[i]
    out[#out + 1] = string.format('<text x="%d" y="%d" text-anchor="end" font-size="11">%s</text>',
      left - 6, y + bar_h - 5, esc(labels[i]))
    if finite(v) then
      local x0, x1 = px(min(0, v)), px(max(0, v))
      out[#out + 1] = string.format('<rect x="%.1f" y="%d" width="%.1f" height="%d" fill="%s"/>',
        x0, y, max(x1 - x0, 0.5), bar_h, PALETTE[1])
      out[#out + 1] = string.format('<text x="%.1f" y="%d" font-size="11">%s</text>', x1 + 4, y + bar_h - 5, label(v))
    end
  end
  if o.xlabel then
    out[#out + 1] = string.format('<text x="%d" y="%d" text-anchor="middle" font-size="12">%s</text>',
      left + pw / 2, axis_y + 34, esc(o.xlabel))
  end
  return { width = W, height = height, body = table.concat(out, "\n") }
end

-- charts, once it is a list of charts (tables with a height and a body, as lines and bars make).
local function want_charts(charts, what)
  if type(charts) ~= "table" then raise(string.format("%s: expected a list of charts, got %s", what, show(charts))) end
  for i, c in ipairs(charts) do
    if type(c) ~= "table" or type(c.height) ~= "number" or type(c.body) ~= "string" then
      raise(string.format("%s: charts[%d] = %s: expected a chart (from m3.log.svg.lines or .bars)", what, i,
        show(c)))
    end
  end
  return charts
end

function svg.document(charts)
  want_charts(charts, "m3.log.svg.document")
  local height = 0
  for _, c in ipairs(charts) do height = height + c.height end
  local out = { string.format(
    '<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif">',
    W, height, W, height) }
  local y = 0
  for _, c in ipairs(charts) do
    out[#out + 1] = string.format('<g transform="translate(0 %d)">', y)
    out[#out + 1] = c.body
    out[#out + 1] = "</g>"
    y = y + c.height
  end
  out[#out + 1] = "</svg>\n"
  return table.concat(out, "\n")
end

function svg.write(path, charts)
  if type(path) ~= "string" or path == "" then
    raise("m3.log.svg.write: expected the path of the SVG file, got " .. show(path))
  end
  want_charts(charts, "m3.log.svg.write")
  local folder = path:match("^(.*)/[^/]*$")
  if folder and not fs.is_dir(folder == "" and "/" or folder) then
    raise(string.format("m3.log.svg.write: cannot write %s: there is no folder %s", path, folder))
  end
  if fs.is_dir(path) then raise(string.format("m3.log.svg.write: cannot write %s: it is a folder", path)) end
  fs.write(path, svg.document(charts))
end

return svg

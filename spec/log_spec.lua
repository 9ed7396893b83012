-- m3.log and m3.json: progress output when not a terminal, JSONL round trips, SVG plots;
-- JSON's exact number keys, strict decoding, bounded nesting and json.read's reasons for nil.

local log = require "m3.log"
local json = require "m3.json"
local helper = require "spec.helper"

-- A file-like sink that keeps what is written.
local function sink()
  local s = { text = {} }
  function s.write(self, ...)
    for i = 1, select("#", ...) do self.text[#self.text + 1] = tostring(select(i, ...)) end
    return self
  end
  function s.flush() end
  function s.lines(self)
    local out = {}
    for line in table.concat(self.text):gmatch("[^\n]*\n") do out[#out + 1] = line:sub(1, -2) end
    return out
  end
  return s
end

local tmpdir = helper.tmpdir

-- f(...)'s results, or an error once it has run ten million instructions (the JIT is off
-- meanwhile, so that the hook sees every loop): a loop that never ends fails, not hangs.
local function bounded(f, ...)
  jit.off()
  debug.sethook(function() error("ran past ten million instructions", 2) end, "", 1e7)
  local r = { pcall(f, ...) }
  debug.sethook()
  jit.on()
  assert(r[1], r[2])
  return unpack(r, 2)
end

describe("m3.log.progress", function()
  it("writes plain lines every `every` steps and at the end when not a terminal", function()
    local out = sink()
    local p = log.progress { total = 10, every = 4, out = out }
    assert.is_false(p.tty)
    for s = 1, 10 do p:update(s, { loss = 1 / s, lr = 1e-3, tokens = 100 }) end
    p:message("val_loss 0.5")
    p:finish()
    local lines = out:lines()
    assert.equal(4, #lines)
    assert.truthy(lines[1]:match("^step 4/10  loss 0%.2500  lr 1%.00e%-03  .* tok/s  elapsed %d+s  eta %S+$"))
    assert.truthy(lines[2]:match("^step 8/10 "))
    assert.truthy(lines[3]:match("^step 10/10  loss 0%.1000 "))
    assert.is_nil(lines[3]:find("eta"))
    assert.equal("val_loss 0.5", lines[4])
    assert.is_nil(table.concat(out.text):find("\r", 1, true))
  end)

  it("redraws one line with a bar on a terminal", function()
    local out = sink()
    local p = log.progress { total = 4, out = out, tty = true, width = 8 }
    p:update(1, { loss = 0.7 })
    p:update(4, { loss = 0.1 })
    p:finish()
    local text = table.concat(out.text)
    assert.truthy(text:find("\rstep 1/4  [##------]  25%  loss 0.7000", 1, true))
    assert.truthy(text:find("step 4/4  [########] 100%", 1, true))
    assert.equal("\n", text:sub(-1))
  end)

  it("is not a terminal under busted's captured output or for files", function()
    local f = io.tmpfile()
    assert.is_false(log.is_terminal(f))
    f:close()
  end)

  it("formats durations", function()
    assert.equal("42s", log.duration(42.2))
    assert.equal("3m05s", log.duration(185))
    assert.equal("2h07m", log.duration(2 * 3600 + 7 * 60 + 3))
    assert.equal("-3m05s", log.duration(-185))
    assert.same({ "?", "?", "?" }, { log.duration(1 / 0), log.duration(-1 / 0), log.duration(0 / 0) })
    assert.equal("2.8e+296h", log.duration(1e300))
  end)

  it("also writes a line when `interval` seconds passed since the last one, when not a terminal", function()
    local progress, now, t = require "m3.log.progress", nil, 0
    now, progress.now = progress.now, function() return t end
    finally(function() progress.now = now end)
    local out = sink()
    local p = log.progress { total = 1000, out = out } -- every 50 steps, and after 30 s without a line
    t = 29
    p:update(1, { loss = 1 })   -- 29 s after the start: nothing
    t = 30
    p:update(2, { loss = 0.5 }) -- 30 s: a line
    t = 59
    p:update(3)                 -- 29 s after that line: nothing
    t = 62
    p:update(50)                -- a multiple of every: a line, which restarts the 30 s
    t = 91
    p:update(51)
    t = 92
    p:update(52)
    local lines = out:lines()
    assert.equal(3, #lines)
    assert.truthy(lines[1]:match("^step 2/1000  loss 0%.5000  elapsed 30s  eta %S+$"), lines[1])
    assert.truthy(lines[2]:match("^step 50/1000  elapsed 1m02s  eta "), lines[2])
    assert.truthy(lines[3]:match("^step 52/1000  elapsed 1m32s  eta "), lines[3])
    -- interval = math.huge: by steps only; a terminal keeps its 0.1 s redraw, whatever the interval
    out = sink()
    p = log.progress { total = 1000, out = out, interval = math.huge }
    t = 1e6
    p:update(1)
    assert.same({}, out:lines())
    out = sink()
    p = log.progress { total = 1000, out = out, tty = true, interval = 1000 }
    p:update(1)
    t = t + 0.05
    p:update(2)
    t = t + 0.1
    p:update(3)
    local text = table.concat(out.text)
    assert.truthy(text:find("\rstep 1/1000", 1, true))
    assert.is_nil(text:find("step 2/1000", 1, true))
    assert.truthy(text:find("\rstep 3/1000", 1, true))
  end)

  it("writes rates with an SI unit chosen after rounding to three digits", function()
    local si = require("m3.log.progress").si
    for _, case in ipairs {
      { 950, "950" }, { 12345, "12.3k" }, { 4.56e6, "4.56M" }, { 999.6, "1k" }, { 999.4, "999" },
      { 999999, "1M" }, { 999.95e3, "1M" }, { 999.4e3, "999k" }, { 0.9995, "1" }, { 0.5, "0.5" },
      { 1e9, "1G" }, { 999.5e9, "1T" }, { 2.5e12, "2.5T" }, { 1e15, "1e+15" }, { 1000, "1k" },
      { -999.6, "-1k" }, { -12345, "-12.3k" }, { 0, "0" }, { -0.0, "0" }, { 0 / 0, "nan" },
      { 1 / 0, "inf" }, { -1 / 0, "-inf" }, { 1.234e-4, "0.000123" },
    } do
      assert.equal(case[2], si(case[1]), tostring(case[1]))
    end
    assert.equal("m3.log.progress.si: expected a number, got nil", (helper.error_of(si, nil):gsub("^[^:]*:%d+: ", "")))
  end)

  it("counts a noun: singular for 1 only", function()
    assert.same({ "0 points", "1 point", "2 points", "1.5 points", "1 batch", "3 batches" },
      { log.plural(0, "point"), log.plural(1, "point"), log.plural(2, "point"), log.plural(1.5, "point"),
        log.plural(1, "batch", "batches"), log.plural(3, "batch", "batches") })
  end)

  it("writes a huge or tiny loss in a few digits", function()
    local out = sink()
    local p = log.progress { total = 3, every = 1, out = out }
    p:update(1, { loss = 1e300 })
    p:update(2, { loss = -1 / 0 })
    p:update(3, { loss = 2e-6 })
    local lines = out:lines()
    assert.truthy(lines[1]:match("^step 1/3  loss 1%.0000e%+300  elapsed"))
    assert.truthy(lines[2]:match("^step 2/3  loss %-inf  elapsed"))
    assert.truthy(lines[3]:match("^step 3/3  loss 2%.0000e%-06  elapsed"))
  end)

  it("refuses a step that is not an integer in [0, 2^53) and metrics that are not numbers, at the caller's line",
    function()
    local out = sink()
    local p = log.progress { total = 3, every = 1, out = out }
    for _, case in ipairs {
      { 0 / 0, nil, "update expects a step (an integer in [0, 2^53)), got nan" },
      { 1 / 0, nil, "got inf" }, { -1, nil, "got -1" }, { 1.5, nil, "got 1.5" }, { "1", nil, 'got "1"' },
      { 1, { loss = "x" }, 'm3.log.progress: update: loss = "x": expected a number' },
      { 1, { lr = true }, "m3.log.progress: update: lr = true: expected a number" },
      { 1, { tokens = {} }, "m3.log.progress: update: tokens = {}: expected a number" },
    } do
      local ok, err = pcall(function() p:update(case[1], case[2]) end)
      assert.is_false(ok)
      assert.matches("^[^:]*log_spec%.lua:%d+: ", err)
      assert.truthy(err:find(case[3], 1, true), err)
    end
    assert.same({}, out:lines())
    p:update(3, { loss = 0 / 0, lr = 1 / 0, tokens = 0 })
    assert.truthy(out:lines()[1]:match("^step 3/3  loss %-?nan  lr inf  elapsed"), out:lines()[1])
  end)
end)

describe("m3.json", function()
  it("round-trips numbers exactly, strings, arrays and objects", function()
    local v = { a = 0.1, b = { 1, 2, 3 }, c = "x\"y\n\1", d = true, e = { f = -1.5e-300 },
      g = 2 ^ 53 - 1, h = 1 / 3, empty = json.array() }
    local back = json.decode(json.encode(v))
    assert.equal(0.1, back.a)
    assert.equal(1 / 3, back.h)
    assert.equal(-1.5e-300, back.e.f)
    assert.equal(2 ^ 53 - 1, back.g)
    assert.same({ 1, 2, 3 }, back.b)
    assert.equal("x\"y\n\1", back.c)
    assert.is_true(back.d)
    assert.equal("[]", json.encode(back.empty))
    assert.equal('{"a":1,"b":[true,null]}', json.encode { b = { true, json.null }, a = 1 })
    assert.equal("null", json.encode(0 / 0))
    assert.equal(-math.huge, 1 / json.decode(json.encode(-0.0)))
  end)

  it("refuses two keys that name the same member (1 and \"1\")", function()
    local ok, err = pcall(json.encode, { [1] = "a", ["1"] = "b", x = 1 })
    assert.is_false(ok)
    assert.truthy(err:find('keys 1 and "1" are both the object name "1"', 1, true)
      or err:find('keys "1" and 1 are both the object name "1"', 1, true))
  end)

  it("decodes escapes and reports errors with a position", function()
    assert.equal("é\t", json.decode('"\\u00e9\\t"'))
    assert.same({ x = { 1, { y = json.null } } }, json.decode(' { "x" : [ 1 , { "y" : null } ] } '))
    local ok, err = pcall(json.decode, '{"a": }')
    assert.is_false(ok)
    assert.truthy(err:find("expected a JSON value at position 7", 1, true))
  end)

  it("writes number keys exactly, as number values", function()
    assert.equal('{"9007199254740992":1}', json.encode { [2 ^ 53] = 1 })
    assert.equal('{"0.3":2,"0.30000000000000004":1}', json.encode { [0.1 + 0.2] = 1, [0.3] = 2 })
    assert.equal('{"0.3333333333333333":1,"1000000000000000":2}', json.encode { [1 / 3] = 1, [1e15] = 2 })
    local ok, err = pcall(json.encode, { [0.1 + 0.2] = 1, ["0.30000000000000004"] = 2 })
    assert.is_false(ok)
    assert.truthy(err:find('0.30000000000000004 and "0.30000000000000004" are both the object name', 1, true)
      or err:find('"0.30000000000000004" and 0.30000000000000004 are both the object name', 1, true), err)
  end)

  it("decodes strictly (RFC 8259), naming the position of what it refuses", function()
    local refused = {
      ["01"] = "expected a number without leading zeros at position 1",
      ["[-00]"] = "expected a number without leading zeros at position 2",
      ["1."] = "expected a digit after the point at position 3",
      ["[2.e1]"] = "expected a digit after the point at position 4",
      [".5"] = "expected a JSON value at position 1",
      ["1e"] = "expected the exponent's digits at position 3",
      ["1e+"] = "expected the exponent's digits at position 3",
      ["-"] = "expected a JSON value at position 1",
      ["+1"] = "expected a JSON value at position 1",
      ["0x10"] = "expected the end of the input at position 2",
      ["1e400"] = "expected a number within a double's range (below 1.8e308) at position 1",
      ["[0, -1e400]"] = "expected a number within a double's range (below 1.8e308) at position 5",
      ['"a\nb"'] = "expected an escape (\\u000a) for the control character 10 in a string at position 3",
      ['{"k\t":1}'] = "expected an escape (\\u0009) for the control character 9 in a string at position 4",
      ['"\0"'] = "expected an escape (\\u0000) for the control character 0 in a string at position 2",
      ['"x\\ud800"'] = "a high surrogate \\ud800 without a low one (\\udc00 to \\udfff) after it at position 3",
      ['"\\ud800\\u0041"'] = "a high surrogate \\ud800 without a low one (\\udc00 to \\udfff) after it at position 2",
      ['"\\udc00\\ud800"'] = "a low surrogate \\udc00 without a high one (\\ud800 to \\udbff) before it at position 2",
    }
    for text, want in pairs(refused) do
      local ok, err = pcall(json.decode, text)
      assert.is_false(ok, text)
      assert.equal("json.decode: " .. want, err:match("^(.-) %(near"), text)
    end
    assert.same({ 0, 100, -0.5, 1e-3, 10 }, json.decode("[0, 1E+2, -0.5, 1e-3, 1.0e1]"))
    assert.equal(-math.huge, 1 / json.decode("-0"))
    assert.equal(0, json.decode("1e-400")) -- below a double's range: rounds to 0, as any decimal does
    assert.equal("\240\157\132\158\0\127/", json.decode('"\\ud834\\udd1e\\u0000\127\\/"'))
  end)

  it("bounds the nesting of arrays and objects at 1000, with a message instead of a stack overflow", function()
    local function nested(n) return string.rep('[{"a":', n / 2) .. "1" .. string.rep("}]", n / 2) end
    local deep = json.decode(nested(1000))
    assert.equal(nested(1000), json.encode(deep))
    for _, n in ipairs { 1002, 200000 } do -- the 1001st opens at 3001: each pair [{"a": takes 6 bytes
      local ok, err = pcall(json.decode, nested(n))
      assert.is_false(ok)
      assert.equal("json.decode: expected at most 1000 arrays and objects inside one another at position 3001",
        err:match("^(.-) %(near"))
    end
    local t = json.decode("[1]")
    for _ = 1, 99999 do t = { t } end
    local ok, err = pcall(json.encode, t)
    assert.is_false(ok)
    assert.equal("json.encode: tables nested more than 1000 deep; a JSON text here holds at most 1000 arrays and "
      .. "objects inside one another", err)
  end)

  it("reads a file, or says why not: missing, unreadable (a folder) or invalid", function()
    local dir = tmpdir()
    json.write(dir .. "/good.json", { a = { 1 } })
    local f = io.open(dir .. "/bad.json", "w")
    f:write('{"a": 01}')
    f:close()
    os.execute("mkdir '" .. dir .. "/folder.json'")
    local good = json.read(dir .. "/good.json")
    local results = {}
    for _, name in ipairs { "none.json", "folder.json", "bad.json" } do
      results[name] = { json.read(dir .. "/" .. name) }
    end
    os.execute("rm -rf '" .. dir .. "'")
    assert.same({ a = { 1 } }, good)
    assert.same({ nil, dir .. "/none.json: No such file or directory", "missing" }, results["none.json"])
    assert.same({ nil, dir .. "/folder.json is a folder, not a regular file", "unreadable" }, results["folder.json"])
    assert.same({ nil, dir .. '/bad.json: json.decode: expected a number without leading zeros at position 7 '
      .. '(near "01}")', "invalid" }, results["bad.json"])
  end)
end)

describe("m3.log.jsonl and plots", function()
  it("appends records and reads them back, ignoring a torn last line", function()
    local dir = tmpdir()
    local w = log.jsonl(dir .. "/metrics.jsonl")
    for s = 1, 50 do w:write { step = s, loss = 2 / s, lr = 1e-3 } end
    w:write { step = 50, val_loss = 0.1, val_acc = 0.9 }
    w:close()
    local f = io.open(dir .. "/metrics.jsonl", "a")
    f:write('{"step": 51, "lo')
    f:close()
    local recs = log.read_jsonl(dir .. "/metrics.jsonl")
    assert.equal(51, #recs)
    assert.equal(2 / 7, recs[7].loss)
    assert.equal(0.9, recs[51].val_acc)
    local path = log.plot_run(dir)
    assert.equal(dir .. "/plot.svg", path)
    local text = io.open(path):read("*a")
    assert.truthy(text:match("^<svg xmlns"))
    assert.truthy(text:match("</svg>\n$"))
    local polylines = select(2, text:gsub("<polyline", ""))
    assert.equal(1, polylines)                -- loss (val_loss and val_acc are single points)
    assert.equal(2, select(2, text:gsub("<circle", "")))
    assert.truthy(text:find(">val_acc<", 1, true))
    os.execute("rm -rf " .. dir)
  end)

  it("appends to a FIFO that another process reads, without probing it first", function()
    local dir = tmpdir()
    local f = io.open(dir .. "/run.sh", "w")
    f:write("cd '", dir, "' && mkfifo fifo || exit 1\n",
      "timeout 20 cat fifo > got &\n",
      "timeout 20 '", helper.m3lua(), "' -e \"require('m3.log').jsonl('fifo'):write { step = 1 }\" || exit 1\n",
      "wait && cat got\n")
    f:close()
    local out, code = helper.run("sh '" .. dir .. "/run.sh'")
    os.execute("rm -rf '" .. dir .. "'")
    assert.equal(0, code, out)
    assert.equal('{"step":1}\n', out)
  end)

  it("keeps the records after a line cut short by a crash, and a resumed writer ends that line first", function()
    local dir = tmpdir()
    local path = dir .. "/metrics.jsonl"
    local f = io.open(path, "w")
    f:write('{"step":1,"loss":2}\n{"step":2,"lo')
    f:close()
    local w = log.jsonl(path)
    for s = 3, 5 do w:write { step = s, loss = 1 / s } end
    w:close()
    local recs, skipped = log.read_jsonl(path)
    assert.same({ 1, 3, 4, 5 }, (function()
      local steps = {}
      for i, r in ipairs(recs) do steps[i] = r.step end
      return steps
    end)())
    assert.same({ 2 }, skipped)
    local text = io.open(path):read("*a")
    assert.truthy(text:find('{"step":2,"lo\n{', 1, true))
    -- a file that ends with a newline gets no empty line; a line that is not an object is skipped
    w = log.jsonl(path)
    w:write { step = 6, loss = 0.1 }
    w:close()
    f = io.open(path, "a")
    f:write("42\n")
    f:close()
    recs, skipped = log.read_jsonl(path)
    assert.equal(5, #recs)
    assert.same({ 2, 7 }, skipped)
    assert.is_nil(io.open(path):read("*a"):find("\n\n", 1, true))
    os.execute("rm -rf " .. dir)
  end)

  -- an array line used to come back as a record, whose keys 1, 2, ... then stopped log.plot with a Lua error
  it("skips a line holding an array, and plots records whose other keys are not strings", function()
    local dir = tmpdir()
    local f = io.open(dir .. "/metrics.jsonl", "w")
    f:write('{"step":1,"loss":2}\n[3,4]\nnull\n{"step":2,"loss":1}\n')
    f:close()
    local recs, skipped = log.read_jsonl(dir .. "/metrics.jsonl")
    assert.same({ { step = 1, loss = 2 }, { step = 2, loss = 1 } }, recs)
    assert.same({ 2, 3 }, skipped)
    local text = io.open(log.plot_run(dir)):read("*a")
    assert.equal(1, select(2, text:gsub("<polyline", "")))
    log.plot({ { step = 1, loss = 2, [1] = 5, [true] = 6 }, { step = 2, loss = 1 } }, dir .. "/keys.svg")
    text = io.open(dir .. "/keys.svg"):read("*a")
    assert.equal(1, select(2, text:gsub("<polyline", ""))) -- the loss curve, nothing of the other keys
    assert.truthy(text:find(">loss<", 1, true))
    os.execute("rm -rf " .. dir)
  end)

  it("breaks a curve at the steps whose loss metrics.jsonl holds as null (NaN, +-inf), on a log axis still", function()
    local dir = tmpdir()
    local w = log.jsonl(dir .. "/metrics.jsonl")
    local loss = { 100, 50, 0 / 0, 1 / 0, 1, 0.5 }
    for i = 1, 6 do w:write { step = i, loss = loss[i] } end
    w:close()
    assert.equal(json.null, log.read_jsonl(dir .. "/metrics.jsonl")[3].loss)
    local text = io.open(log.plot_run(dir)):read("*a")
    assert.equal(2, select(2, text:gsub("<polyline", ""))) -- steps 1-2 and 5-6
    local labels = {}
    for t in text:gmatch('text%-anchor="end" font%-size="11">([^<]*)<') do labels[#labels + 1] = t end
    assert.same({ "0.1", "1", "10", "100" }, labels) -- 0.5 to 100: a log axis, whatever the gap holds
    os.execute("rm -rf " .. dir)
  end)

  it("picks nice ticks", function()
    local t, a, b = log.svg.nice_ticks(0.13, 0.92, 5)
    assert.same({ 0, 0.2, 0.4, 0.6, 0.8, 1 }, (function()
      local r = {}
      for i, v in ipairs(t) do r[i] = math.floor(v * 10 + 0.5) / 10 end
      return r
    end)())
    assert.equal(0, a)
    assert.is_true(math.abs(b - 1) < 1e-12)
  end)

  it("pads a range of zero or a few ulps like a constant series, and bounds the ticks", function()
    for _, r in ipairs { { 1e16, 1e16 + 2 }, { 0.3, 0.1 * 3 }, { 0, 5e-324 }, { 5e-324, 5e-324 }, { -7, -7 } } do
      local t, a, b = bounded(log.svg.nice_ticks, r[1], r[2], 6)
      assert.is_true(#t >= 2 and #t <= 8 and a <= r[1] and b >= r[2] and a < b)
    end
    assert.same({ 1, 1.1 }, { select(2, log.svg.nice_ticks(1, 1)) })
    assert.error_matches(function() log.svg.nice_ticks(0, 1, 101) end, "n = 101: expected at most 100")
    local dir = tmpdir()
    local w = log.jsonl(dir .. "/metrics.jsonl")
    w:write { step = 1, loss = 0.9, val_acc = 0.3 }
    w:write { step = 2, loss = 0.8, val_acc = 0.1 * 3 }
    w:close()
    assert.equal(dir .. "/plot.svg", bounded(log.plot_run, dir))
    os.execute("rm -rf " .. dir)
  end)

  it("keeps a gap of non-finite points in a series long enough to be averaged", function()
    local x, y = {}, {}
    for i = 1, 3000 do x[i], y[i] = i, (i > 1000 and i < 2000) and 0 / 0 or i end
    y[2500] = 1 / 0
    local body = log.svg.lines { series = { { x = x, y = y } } }.body
    assert.equal(3, select(2, body:gsub("<polyline", "")))
  end)

  it("draws any finite values at finite coordinates", function()
    local big = 1.7976931348623157e308
    local charts = {
      log.svg.lines { series = { { x = { -1e308, 0, 1e308 }, y = { 1, 2, 3 } } } },
      log.svg.lines { series = { { x = { 1, 2, 3 }, y = { -big, 0, big } } } },
      log.svg.lines { series = { { x = { 1, 2 }, y = { 0, 5e-324 } } } },
      log.svg.lines { series = { { x = { 1, 2 }, y = { big, big } } } },
      log.svg.lines { logy = true, series = { { x = { 1, 2 }, y = { 5e-324, big } } } },
      log.svg.bars { labels = { "a", "b" }, values = { -1e308, 1e308 } },
    }
    for _, c in ipairs(charts) do
      assert.is_nil(c.body:find("nan", 1, true))
      assert.is_nil(c.body:find("inf", 1, true))
    end
    for i = 1, 5 do assert.equal(1, select(2, charts[i].body:gsub("<polyline", ""))) end
    assert.equal(2, select(2, charts[6].body:gsub('height="18" fill=', "")))
    local t, a, b = log.svg.nice_ticks(-big, big, 1)
    assert.same({ { 0 }, -big, big }, { t, a, b })
  end)

  it("ticks a log axis over many decades at a step of decades", function()
    local function y_labels(lo, hi)
      local body = log.svg.lines { logy = true, series = { { x = { 1, 2 }, y = { lo, hi } } } }.body
      local labels = {}
      for t in body:gmatch('text%-anchor="end" font%-size="11">([^<]*)<') do labels[#labels + 1] = t end
      return labels
    end
    assert.same({ "0.001", "0.01", "0.1", "1", "10", "100" }, y_labels(2e-3, 50))
    assert.same({ "1e-300", "1e-200", "1e-100", "1", "1e100", "1e200", "1e300" }, y_labels(1e-300, 1e300))
    assert.same({ "1e-400", "1e-300", "1e-200", "1e-100", "1", "1e100", "1e200", "1e300", "1e400" },
      y_labels(5e-324, 1.7976931348623157e308))
    assert.equal(8, #y_labels(1e-3, 1e9)) -- 12 decades: every second one, 1e-4 to 1e10
  end)

  it("writes well-formed XML for any title or key: control characters and bytes that are not UTF-8 become U+FFFD",
    function()
    local dir = tmpdir()
    -- controls, then Latin-1 bytes, an overlong NUL, a surrogate, U+FFFE and a torn sequence
    local bad = "loss\0\27\8\31x\255\254\192\128\237\160\128\239\191\190\226\130"
    log.plot({ { step = 1, [bad] = 3 }, { step = 2, [bad] = 2 } }, dir .. "/odd.svg", { title = "caf\233 <&>" })
    local text = io.open(dir .. "/odd.svg"):read("*a")
    local r = "\239\191\189"
    assert.truthy(text:find(">loss" .. r:rep(4) .. "x" .. r:rep(4 + 3 + 1 + 2) .. "<", 1, true), text)
    assert.truthy(text:find(">caf" .. r .. " &lt;&amp;&gt;: loss<", 1, true))
    local ok = "h\195\169 \226\130\172 \240\159\152\128 \244\143\191\189 \t" -- valid UTF-8 passes through
    local doc = log.svg.document { log.svg.bars { title = ok, labels = {}, values = {} } }
    assert.truthy(doc:find(">" .. ok .. "<", 1, true))
    local out, code = helper.run("python3 -c 'import xml.dom.minidom,sys; xml.dom.minidom.parse(sys.argv[1])' "
      .. dir .. "/odd.svg")
    if code ~= 127 then assert.equal(0, code, out) end -- 127: no python3 to parse it with
    os.execute("rm -rf " .. dir)
  end)

  it("takes a series color only as a name or #hex (it is written into attributes as it is)", function()
    local doc = log.svg.document { log.svg.lines { series = { { x = { 1, 2 }, y = { 1, 2 }, color = "#1f77b4" },
      { x = { 1, 2 }, y = { 2, 1 }, color = "teal" } } } }
    assert.truthy(doc:find('stroke="#1f77b4"', 1, true) and doc:find('stroke="teal"', 1, true))
    for _, bad in ipairs { '"/><script/>', "red blue", 5 } do
      assert.matches('m3%.log%.svg%.lines: series%[1%]: color = .*: expected a color name or "#rrggbb"',
        helper.error_of(log.svg.lines, { series = { { x = { 1 }, y = { 1 }, color = bad } } }))
    end
  end)

  it("draws bars and escapes labels", function()
    local c = log.svg.bars { title = "a<b", labels = { "x=1", "y&z" }, values = { 0.5, -0.25 } }
    local doc = log.svg.document { c }
    assert.truthy(doc:find("a&lt;b", 1, true))
    assert.truthy(doc:find("y&amp;z", 1, true))
    assert.equal(2, select(2, doc:gsub('height="18" fill=', "")))
  end)
end)

describe("m3.log argument errors", function()
  -- The error of fn(), which must be raised at this spec file's line (not inside the library).
  local function here(fn)
    local ok, err = pcall(fn)
    assert.is_false(ok, "expected an error")
    assert.matches("^[^:]*log_spec%.lua:%d+: ", tostring(err))
    return err
  end

  it("names a bad plural, progress output, NULL metric, folder to read or bars without labels", function()
    local ffi = require "ffi"
    -- each failed inside before: a concatenation, "attempt to index", math.abs of a pointer, "Is a directory"
    assert.matches("m3%.log%.plural: nouns = {}: expected the plural %(a string%) or nil$",
      here(function() log.plural(2, "x", {}) end))
    assert.equal("2 mice", log.plural(2, "mouse", "mice"))
    assert.matches("m3%.log%.progress: out = userdata: 0x%x+: expected an open file %(or a table with write and "
      .. "flush methods%)$", here(function() log.progress { total = 3, out = newproxy() } end))
    assert.matches("m3%.log%.progress: out = .*: expected an open file",
      here(function() log.progress { total = 3, out = { write = function() end } } end))
    local f = io.open(tmpdir() .. "/closed.txt", "w")
    f:close()
    assert.matches("m3%.log%.progress: out = file %(closed%): the file is closed$",
      here(function() log.progress { total = 3, out = f } end))
    local p = log.progress { total = 3, out = { write = function() end, flush = function() end } }
    assert.matches("m3%.log%.progress: update: loss = cdata<float %*>: NULL: expected a number$",
      here(function() p:update(1, { loss = ffi.new("float *") }) end))
    local dir = tmpdir()
    assert.matches("m3%.log%.read_jsonl: " .. dir:gsub("%p", "%%%0") .. " is a folder, not a JSONL file$",
      here(function() log.read_jsonl(dir) end))
    assert.matches("m3%.log%.svg%.bars: 1 labels but values up to values%[2%]: expected at most one value per label$",
      here(function() log.svg.bars { labels = { "a" }, values = { 1, 2 } } end))
    assert.is_table(log.svg.bars { labels = { "a", "b" }, values = { 1 } }) -- b has no value: no bar
  end)

  it("names the argument and what was expected, at the caller's line", function()
    local dir = tmpdir()
    local chart = log.svg.lines { series = { { x = { 1 }, y = { 1 } } } }
    for _, case in ipairs {
      { function() log.plot(nil, dir .. "/a.svg") end, "m3.log.plot: expected a list of records (tables), got nil" },
      { function() log.plot({ 5 }, dir .. "/a.svg") end, "m3.log.plot: records[1] = 5: expected a table" },
      { function() log.plot({}, nil) end, "m3.log.plot: expected the path of the SVG file, got nil" },
      { function() log.plot({}, dir .. "/a.svg", { x = 1 }) end,
        "m3.log.plot: x = 1: expected the name of a record field" },
      { function() log.plot({}, dir .. "/missing/a.svg") end,
        "m3.log.svg.write: cannot write " .. dir .. "/missing/a.svg: there is no folder " .. dir .. "/missing" },
      { function() log.plot({}, dir) end, "m3.log.svg.write: cannot write " .. dir .. ": it is a folder" },
      { function() log.plot_run(nil) end, "m3.log.plot_run: expected a run folder, got nil" },
      { function() log.plot_run(dir, { title = {} }) end, "m3.log.plot_run: title = {}: expected a string" },
      { function() log.read_jsonl(nil) end, "m3.log.read_jsonl: expected a file path, got nil" },
      { function() log.read_jsonl(dir .. "/none.jsonl") end, "m3.log.read_jsonl: cannot open " },
      { function() log.jsonl(dir .. "/m.jsonl"):write(5) end, "m3.log.jsonl: write expects a record (a table), got 5" },
      { function() log.jsonl(dir .. "/m.jsonl"):write { 1, 2 } end,
        "m3.log.jsonl: write expects a record (a table of named fields), got the list {1, 2}" },
      { function() log.jsonl(dir .. "/m.jsonl"):write { file = "caf\233" } end,
        "m3.log.jsonl: write: json.encode: cannot encode the string at .file: not UTF-8" },
      { function() log.svg.lines { series = { { x = { 1, 2, 3 }, y = { 1, 2 } } } } end,
        "m3.log.svg.lines: series[1]: expected lists x and y of one length, got 3 and 2 values" },
      { function() log.progress() end, "m3.log.progress: expected {total = <steps>, ...}, got nil" },
      { function() log.progress { total = 0 } end, "m3.log.progress: total = 0: expected an integer >= 1" },
      { function() log.progress { total = 5, every = 0 } end, "m3.log.progress: every = 0: expected an integer >= 1" },
      { function() log.progress { total = 5, interval = 0 } end,
        "m3.log.progress: interval = 0: expected seconds (a number > 0)" },
      { function() log.progress { total = 5, interval = 0 / 0 } end, "m3.log.progress: interval = nan: expected" },
      { function() log.plural("1", "point") end, 'm3.log.plural: expected a number, got "1"' },
      { function() log.progress { total = 5, out = "x" } end, 'm3.log.progress: out = "x": expected an open file' },
      { function() log.progress { total = 5, out = sink() }:update(nil) end, "m3.log.progress: update expects a step" },
      { function() log.progress { total = 5, out = sink() }:message(nil) end,
        "m3.log.progress: message expects a string" },
      { function() log.duration(nil) end, "m3.log.duration: expected seconds (a number), got nil" },
      { function() log.svg.lines(nil) end, "m3.log.svg.lines: expected an options table, got nil" },
      { function() log.svg.lines { series = { { x = { 1 } } } } end,
        "m3.log.svg.lines: series[1]: expected lists x and y, got {1} and nil" },
      { function() log.svg.lines { seris = {} } end, 'm3.log.svg.lines: unknown option "seris"' },
      { function() log.svg.bars { labels = 3 } end, "m3.log.svg.bars: labels = 3: expected a list" },
      { function() log.svg.document { 1 } end, "m3.log.svg.document: charts[1] = 1: expected a chart" },
      { function() log.svg.write(dir .. "/b.svg", nil) end, "m3.log.svg.write: expected a list of charts, got nil" },
      { function() log.svg.write(nil, { chart }) end, "m3.log.svg.write: expected the path of the SVG file, got nil" },
      { function() log.svg.nice_ticks(0, 0 / 0) end, "m3.log.svg.nice_ticks: expected finite lo and hi" },
    } do
      local err = here(case[1])
      assert.truthy(err:find(case[2], 1, true), err)
    end
    assert.equal("", io.open(dir .. "/m.jsonl"):read("*a")) -- the refused records wrote nothing
    log.svg.write(dir .. "/b.svg", { chart })
    assert.truthy(io.open(dir .. "/b.svg"):read("*a"):match("^<svg"))
    os.execute("rm -rf " .. dir)
  end)

  it("writes files under any name the file system takes, 255 bytes included", function()
    local dir = tmpdir()
    local path = dir .. "/" .. string.rep("r", 255)
    json.write(path, { 1, 2 })
    assert.same({ 1, 2 }, json.decode(io.open(path):read("*a")))
    os.execute("rm -rf " .. dir)
  end)

  it("raises when the disk takes no more and keeps the file a write would have replaced", function()
    -- a file-size limit of 16 KiB stands in for a full disk (SIGXFSZ ignored: the write fails instead)
    local dir = tmpdir()
    local function limited(chunk)
      local script = dir .. "/w.lua"
      local f = assert(io.open(script, "w"))
      f:write(chunk)
      f:close()
      return helper.run("sh -c " .. helper.quote(string.format("trap '' XFSZ; ulimit -f 16; cd %s && %s %s", dir,
        helper.quote(helper.m3lua()), script)))
    end
    local good = '["small good content"]\n'
    local f = assert(io.open(dir .. "/res.json", "w"))
    f:write(good)
    f:close()
    local out, code = limited([[
      local t = {}
      for i = 1, 3000 do t[i] = "record number " .. i end
      require("m3.json").write("res.json", t)]])
    assert.equal(1, code)
    assert.matches("w.lua:3: m3.fs: cannot write res.json: File too large", out)
    assert.equal(good, io.open(dir .. "/res.json"):read("*a"))
    out, code = limited([[
      local w = require("m3.log").jsonl("m.jsonl")
      for i = 1, 2000 do w:write({ step = i, text = string.rep("x", 50) }) end]])
    assert.equal(1, code)
    assert.matches("w.lua:2: m3.log.jsonl: cannot write m.jsonl: File too large", out)
    local records = log.read_jsonl(dir .. "/m.jsonl")
    assert.is_true(#records > 100 and #records < 2000)
    os.execute("rm -rf " .. dir)
  end)
end)

describe("m3.log edges", function()
  -- the y-axis labels of a chart's SVG text, bottom to top
  local function y_labels(text)
    local labels = {}
    for t in text:gmatch('text%-anchor="end" font%-size="11">([^<]*)<') do labels[#labels + 1] = t end
    return labels
  end

  -- progress with its clock stopped at t[1]
  local function with_clock(f)
    local progress = require "m3.log.progress"
    local now, t = progress.now, { 0 }
    progress.now = function() return t[1] end
    local ok, err = pcall(f, t)
    progress.now = now
    assert(ok, err)
  end

  it("writes a line every total/20 steps by default", function()
    with_clock(function()
      local out = sink()
      local p = log.progress { total = 40, out = out }
      for s = 1, 40 do p:update(s) end
      local lines = out:lines()
      assert.equal(20, #lines)
      assert.truthy(lines[1]:match("^step 2/40 "), lines[1])
    end)
  end)

  it("counts rates and the ETA of a resumed run from its first step", function()
    with_clock(function(t)
      local out = sink()
      local p = log.progress { total = 200, first = 100, every = 10, out = out }
      t[1] = 10
      p:update(110, { tokens = 1000 })
      -- 10 steps in 10 s, 90 left: 90 s
      assert.same({ "step 110/200  100 tok/s  elapsed 10s  eta 1m30s" }, out:lines())
    end)
  end)

  it("writes a loss of a million on in exponent form, durations rounded to the second", function()
    with_clock(function()
      local out = sink()
      local p = log.progress { total = 2, every = 1, out = out }
      p:update(1, { loss = 1e6 })
      p:update(2, { loss = 1e-4 })
      assert.truthy(out:lines()[1]:match("^step 1/2  loss 1%.0000e%+06  "), out:lines()[1])
      assert.truthy(out:lines()[2]:match("^step 2/2  loss 0%.0001  "), out:lines()[2])
    end)
    assert.same({ "1m00s", "1h00m", "59s" }, { log.duration(59.5), log.duration(3599.5), log.duration(59.49) })
  end)

  it("draws the bar at step/total on a terminal, never 100% before the last step", function()
    with_clock(function(t)
      local out = sink()
      local p = log.progress { total = 4, first = 2, width = 8, out = out, tty = true }
      p:update(3)
      assert.truthy(table.concat(out.text):find("\rstep 3/4  [######--]  75%", 1, true), table.concat(out.text))
      out = sink()
      p = log.progress { total = 1000, width = 10, out = out, tty = true }
      p:update(999)
      assert.truthy(table.concat(out.text):find("\rstep 999/1000  [##########]  99%", 1, true), table.concat(out.text))
      t[1] = 1
    end)
  end)

  it("writes a message on a terminal above the bar, and redraws the bar after it", function()
    with_clock(function(t)
      local out = sink()
      local p = log.progress { total = 4, out = out, tty = true, width = 4 }
      p:message("before")
      assert.equal("before\n", table.concat(out.text))
      p:update(1, { loss = 0.7 })
      out.text = {}
      p:message("val 1")
      local text = table.concat(out.text)
      assert.equal(1, text:find("\r\027[Kval 1\n\rstep 1/4  [#---]  25%  loss 0.7000  ETA ", 1, true), text)
      t[1] = 1
    end)
  end)

  it("truncates a metrics file when asked, and passes over blank lines without counting them skipped", function()
    local dir = tmpdir()
    local path = dir .. "/metrics.jsonl"
    local w = log.jsonl(path)
    w:write { step = 1 }
    w:close()
    w = log.jsonl(path, { truncate = true })
    w:write { step = 2 }
    w:close()
    assert.equal('{"step":2}\n', io.open(path):read("*a"))
    local f = io.open(path, "a")
    f:write("\n   \n", '{"step":3}\n')
    f:close()
    local recs, skipped = log.read_jsonl(path)
    assert.same({ { step = 2 }, { step = 3 } }, recs)
    assert.same({}, skipped)
    os.execute("rm -rf " .. dir)
  end)

  it("refuses a write after close, naming the file", function()
    local dir = tmpdir()
    local w = log.jsonl(dir .. "/m.jsonl")
    w:close()
    assert.matches("m3%.log%.jsonl: .*/m%.jsonl is closed", helper.error_of(function() w:write { step = 1 } end))
    os.execute("rm -rf " .. dir)
  end)

  it("puts loss on a log axis only when every value is positive and they span more than a factor of 20", function()
    local dir = tmpdir()
    local function labels_for(values)
      local recs = {}
      for i, v in ipairs(values) do recs[i] = { step = i, loss = v } end
      return y_labels(io.open(bounded(log.plot, recs, dir .. "/p.svg")):read("*a"))
    end
    assert.same({ "0", "20", "40", "60", "80", "100" }, labels_for { 0, 50, 100 }) -- a zero: linear
    assert.same({ "0", "2", "4", "6", "8", "10" }, labels_for { 1, 10 })
    assert.same({ "0", "5", "10", "15", "20" }, labels_for { 1, 20 })           -- a factor of 20: linear still
    assert.same({ "1", "10", "100" }, labels_for { 1, 21 })
    os.execute("rm -rf " .. dir)
  end)

  it("leaves loss_scale and the x field out of the curves, and titles plot_run's plot after the folder", function()
    local dir = tmpdir()
    local w = log.jsonl(dir .. "/metrics.jsonl")
    for s = 1, 3 do w:write { step = s, loss = 1 / s, loss_scale = 2 ^ s, acc_x = s, acc = s / 4 } end
    w:close()
    local text = io.open(log.plot_run(dir)):read("*a")
    assert.equal(3, select(2, text:gsub("<polyline", ""))) -- loss; acc and acc_x (x is step)
    assert.is_nil(text:find(">loss_scale<", 1, true))
    assert.truthy(text:find(">" .. dir:match("([^/]+)/*$") .. ": loss<", 1, true))
    text = io.open(log.plot(log.read_jsonl(dir .. "/metrics.jsonl"), dir .. "/x.svg", { x = "acc_x" })):read("*a")
    assert.equal(2, select(2, text:gsub("<polyline", ""))) -- loss and acc again, acc_x is the x axis
    os.execute("rm -rf " .. dir)
  end)
end)

describe("m3.log.svg edges", function()
  local svg = log.svg

  local function y_labels(body)
    local labels = {}
    for t in body:gmatch('text%-anchor="end" font%-size="11">([^<]*)<') do labels[#labels + 1] = t end
    return labels
  end

  it("ticks a range at the step it asks for, its ends included despite rounding", function()
    local t, a, b = svg.nice_ticks(0.3, 0.7, 4) -- a step of 0.1: 0.3 / 0.1 is 2.9999999999999996
    assert.equal(5, #t)
    assert.is_true(math.abs(a - 0.3) < 1e-12 and math.abs(b - 0.7) < 1e-12, a .. " " .. b)
  end)

  it("counts a range closer to zero than 1e-280 as zero, padded to 1", function()
    local t, a, b = svg.nice_ticks(0, 1e-300)
    assert.equal(0, a)
    assert.is_true(math.abs(b - 1) < 1e-12, tostring(b))
    assert.is_true(#t >= 2 and #t <= 8)
  end)

  it("ticks every decade up to ten of them on a log axis, and pads a single power of ten", function()
    local body = svg.lines { logy = true, series = { { x = { 1, 2 }, y = { 1, 1e10 } } } }.body
    assert.equal(11, #y_labels(body))
    body = svg.lines { logy = true, series = { { x = { 1, 2 }, y = { 10, 10 } } } }.body
    assert.same({ "10", "100" }, y_labels(body))
    assert.is_nil(body:find("nan", 1, true))
  end)

  it("leaves out the points a log axis cannot show (zero, negative)", function()
    local body = svg.lines { logy = true, series = { { x = { 1, 2, 3, 4 }, y = { 1, 0, -1, 100 } } } }.body
    assert.is_nil(body:find("nan", 1, true))
    assert.is_nil(body:find("inf", 1, true))
    assert.equal(0, select(2, body:gsub("<polyline", "")))
    assert.equal(2, select(2, body:gsub("<circle", "")))
    assert.same({ "1", "10", "100" }, y_labels(body))
  end)

  it("writes labels from 1e5 on with a short exponent, like the log axis' 1e100", function()
    local doc = svg.document { svg.bars { labels = { "a" }, values = { 1e5 } } }
    assert.truthy(doc:find(">1e5<", 1, true))
    assert.is_nil(doc:find("e+05", 1, true))
    -- below 1e5 in plain digits: the ticks of 0 .. 1e5 and a bar of 99999 (they read "2e+04", "1e+05")
    doc = svg.document { svg.bars { labels = { "a", "b" }, values = { 1e5, 99999 } } }
    assert.truthy(doc:find(">20000<", 1, true))
    assert.truthy(doc:find(">99999<", 1, true))
    assert.is_nil(doc:find("e+0", 1, true))
  end)
end)

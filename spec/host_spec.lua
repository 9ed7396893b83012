-- spec/host_spec.lua — the m3lua host as a program: options and `arg`, the module path,
-- errors and exit codes, piped REPL sessions, SIGINT and SIGTERM, REPL sessions on a terminal
-- (a pseudo-terminal driven by python3's pty module: job control, terminal modes, characters);
-- and the REPL's pretty printer and completion in-process. The binary is $M3LUA (default
-- build/m3lua); each run goes through /bin/sh with files for stdin, stdout and stderr. A signal
-- goes to m3lua alone once its script has started (a file it creates first says so): a fixed
-- delay could land while the dynamic loader is still mapping libm3's CUDA libraries from a cold
-- disk, before m3lua has installed its handlers.

local repl = require "m3.repl"
local helper = require "spec.helper"

local M3LUA = helper.m3lua()
local base = os.tmpname()
local quote = helper.quote

local function slurp(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

local function spit(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

-- The shell command of m3lua args... with stdin text (from the .in file), stdout and stderr to the
-- .out and .err files; results() reads them back with the exit status the command left in .rc.
local function command(args, stdin)
  local words = { quote(M3LUA) }
  for _, a in ipairs(args) do words[#words + 1] = quote(a) end
  spit(base .. ".in", stdin or "")
  return ("M3LUA_HISTORY= %s < %s > %s 2> %s"):format(table.concat(words, " "), quote(base .. ".in"),
    quote(base .. ".out"), quote(base .. ".err"))
end

local function results()
  return slurp(base .. ".out"), slurp(base .. ".err"), tonumber(slurp(base .. ".rc"))
end

-- Runs `prefix m3lua args...` with stdin text; returns stdout, stderr, exit status.
local function run(args, stdin, prefix)
  os.execute(("%s %s; echo $? > %s"):format(prefix or "", command(args, stdin), quote(base .. ".rc")))
  return results()
end

-- Runs m3lua args... (which end in an endless loop) in the background, with SIGINT back at its
-- default (sh starts background jobs with it ignored), sends it signal sig 0.2 s after its first
-- chunk has run (sig: names gap seconds apart, default 0.3, e.g. "INT TERM"), and returns stdout,
-- stderr, exit status (SIGKILL after 5 s more).
local function run_signalled(args, sig, gap)
  local ready = base .. ".ready"
  os.remove(ready)
  local all = { "-e", ("io.open(%q, 'w'):close()"):format(ready) }
  for _, a in ipairs(args) do all[#all + 1] = a end
  os.execute(([[
env --default-signal=INT %s &
pid=$!
n=0
while [ ! -e %s ] && [ $n -lt 600 ]; do sleep 0.05; n=$((n + 1)); done
sleep 0.2
for s in %s; do kill -s $s $pid 2> /dev/null; sleep %s; done
( sleep 5; kill -s KILL $pid 2> /dev/null ) &
guard=$!
wait $pid
echo $? > %s
kill $guard 2> /dev/null
]]):format(command(all), quote(ready), sig, gap or 0.3, quote(base .. ".rc")))
  os.remove(ready)
  return results()
end

-- The pseudo-terminal driver: runs the program after `--` on a new 24x80 terminal and plays the steps before
-- it (hex-encoded: s = send these bytes, e = wait for them in the output since the last match, w = wait for the
-- terminal to leave line mode: a line editor that has drawn its prompt reads keys only once it has, and text
-- sent before is echoed twice; k = send the program this signal); then waits for the program to end. Stdout: everything the terminal showed, then
-- "[terminal: cooked]" or "[terminal: raw]" (ICANON and ECHO both on, or not, as it ended); exit status: the
-- program's (128 + signal when one ended it). Output awaited in vain for 10 s ends the run with the transcript,
-- "[timed out waiting for ...]" and status 124.
local PTY_DRIVER = [==[
import fcntl, os, pty, select, signal, struct, sys, termios, time
split = sys.argv.index("--")
steps, program = sys.argv[1:split], sys.argv[split + 1:]
pid, fd = pty.fork()
if pid == 0:
    os.execvp(program[0], program)
fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
shown, matched = b"", 0

def read_for(seconds):
    global shown
    ready, _, _ = select.select([fd], [], [], seconds)
    if not ready:
        return True
    try:
        data = os.read(fd, 4096)
    except OSError:
        data = b""
    shown += data
    return len(data) > 0

def finish(status):
    lflag = termios.tcgetattr(fd)[3]
    cooked = lflag & termios.ICANON and lflag & termios.ECHO
    sys.stdout.buffer.write(shown + (b"\n[terminal: cooked]" if cooked else b"\n[terminal: raw]"))
    sys.exit(status)

def give_up(why):
    global shown
    shown += b"\n[timed out waiting for " + why + b"]"
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    finish(124)

for step in steps:
    kind, arg = step[0], bytes.fromhex(step[1:])
    if kind == "s":
        os.write(fd, arg)
    elif kind == "k":
        os.kill(pid, int(arg))
    elif kind == "w":
        deadline = time.time() + 10
        while termios.tcgetattr(fd)[3] & termios.ICANON:
            if time.time() > deadline:
                give_up(b"line editing")
            read_for(0.01)
    else:
        deadline = time.time() + 10
        while shown.find(arg, matched) < 0:
            if time.time() > deadline or not read_for(0.05):
                give_up(arg)
        matched = shown.find(arg, matched) + len(arg)
deadline = time.time() + 10
while read_for(0.05):
    if time.time() > deadline:
        give_up(b"the end")
_, status = os.waitpid(pid, 0)
finish(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
]==]

local function hex(s)
  return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end))
end

-- Runs argv on a pseudo-terminal, playing steps ({ send = bytes } | { expect = text } | { prompt = text }: expect
-- it, then wait for keys to be read | { signal = number }); returns what the terminal showed, ending with its
-- modes (see PTY_DRIVER), and the exit status.
local function on_terminal(argv, steps)
  spit(base .. ".py", PTY_DRIVER)
  local words = { "python3", quote(base .. ".py") }
  for _, step in ipairs(steps) do
    if step.prompt then
      words[#words + 1] = "e" .. hex(step.prompt)
      words[#words + 1] = "w"
    else
      words[#words + 1] = step.send and "s" .. hex(step.send) or step.expect and "e" .. hex(step.expect)
        or "k" .. hex(tostring(step.signal))
    end
  end
  words[#words + 1] = "--"
  for _, a in ipairs(argv) do words[#words + 1] = quote(a) end
  os.execute(("%s > %s 2> %s; echo $? > %s"):format(table.concat(words, " "), quote(base .. ".out"),
    quote(base .. ".err"), quote(base .. ".rc")))
  local shown, err, rc = results()
  assert.equal("", err)
  return shown, rc
end

-- A REPL session on a terminal, without history, with the environment variable setting `setting` if given:
-- m3lua alone (its prompt first), with steps to play after it. SIGHUP at its default (under nohup, which ignores
-- it, m3lua leaves it ignored and a hangup would not end the session).
local function repl_on_terminal(steps, setting)
  local all = { { prompt = "m3> " } }
  for _, step in ipairs(steps) do all[#all + 1] = step end
  return on_terminal({ "env", "--default-signal=HUP", "M3LUA_HISTORY=", setting or "M3LUA_HISTORY=", M3LUA }, all)
end

teardown(function()
  for _, ext in ipairs { "", ".in", ".out", ".err", ".rc", ".lua", ".ready", ".py" } do os.remove(base .. ext) end
end)

describe("m3lua", function()
  it("runs a script with arg and ...", function()
    spit(base .. ".lua", [[
      print(arg[0], arg[1], arg[2], arg[-1] ~= nil, select("#", ...), ...)]])
    local out, err, rc = run { base .. ".lua", "a", "b c" }
    assert.equal("", err)
    assert.equal(0, rc)
    assert.equal(base .. ".lua\ta\tb c\ttrue\t2\ta\tb c\n", out)
  end)

  it("gives a script more arguments than Lua's stack holds in arg alone", function()
    spit(base .. ".lua", "print(select('#', ...), #arg, arg[9000])")
    local args = { base .. ".lua" }
    for i = 1, 9000 do args[#args + 1] = tostring(i) end
    local out, err, rc = run(args) -- was "stack overflow (too many arguments to script)"
    assert.equal("", err)
    assert.equal(0, rc)
    assert.equal("0\t9000\t9000\n", out)
  end)

  it("fails when its standard output cannot be written (a full disk), also after os.exit", function()
    if not io.open("/dev/full", "w") then return pending("no /dev/full here") end
    local failed = "m3lua: writing the standard output failed: No space left on device\n"
    local wants = { -- os.exit(0) gave 0; a failure status stays as it is
      ["print(1)"] = { failed, 1 },
      ["print(1) os.exit(0)"] = { failed, 1 },
      ["print(1) os.exit(true, true)"] = { failed, 1 },
      ["print(1) os.exit(3)"] = { "", 3 },
    }
    for chunk, want in pairs(wants) do
      os.execute(("%s -e %s > /dev/full 2> %s; echo $? > %s"):format(quote(M3LUA), quote(chunk),
        quote(base .. ".err"), quote(base .. ".rc")))
      assert.equal(want[1], slurp(base .. ".err"), chunk)
      assert.equal(want[2], tonumber(slurp(base .. ".rc")), chunk)
    end
  end)

  it("runs -e chunks in order, and stdin with -", function()
    local out, _, rc = run { "-e", "x = 20", "-e", "print(x + 22)" }
    assert.equal("42\n", out)
    assert.equal(0, rc)
    out = run({ "-", "p", "q" }, "print(...)")
    assert.equal("p\tq\n", out)
  end)

  it("requires -l libraries from M3LUA_PATH and sets their globals", function()
    local dir = base:match("^(.*)/")
    local name = base:match("([^/]*)$"):gsub("%W", "_")
    spit(dir .. "/" .. name .. ".lua", "return { answer = 42 }")
    local out, err, rc = run({ "-l", name, "-e", "print(" .. name .. ".answer)" }, nil,
      "M3LUA_PATH=" .. quote(dir .. "/?.lua"))
    os.remove(dir .. "/" .. name .. ".lua")
    assert.equal("", err)
    assert.equal("42\n", out)
    assert.equal(0, rc)
    local _, err2, rc2 = run { "-l", "no_such_module_here" }
    assert.equal(1, rc2)
    assert.matches("module 'no_such_module_here' not found", err2, 1, true)
  end)

  it("finds the project's modules from any directory and describes itself", function()
    local out, err, rc = run({ "-e", [[
      local host = require "m3.host"
      print(host.name, type(require("m3.repl").run), host.source_dir ~= nil)]] }, nil, "cd / &&")
    assert.equal("", err)
    assert.equal("m3lua\tfunction\ttrue\n", out)
    assert.equal(0, rc)
  end)

  it("performs -j commands", function()
    local out, _, rc = run { "-joff", "-e", "print((jit.status()))" }
    assert.equal("false\n", out)
    assert.equal(0, rc)
    local _, err
    _, err, rc = run { "-jnonsense" }
    assert.equal(1, rc)
    assert.matches("unknown LuaJIT command", err, 1, true)
    _, err, rc = run { "-Ononsense" } -- a bad value, reported without a traceback (as luajit does)
    assert.equal("m3lua: unknown or malformed optimization flag 'nonsense'\n", err)
    assert.equal(1, rc)
  end)

  it("prints --version, --help, and the usage for a bad option", function()
    local out, _, rc = run { "--version" }
    assert.matches("^m3lua %S+ %(LuaJIT 2%.1[^,]*, CUDA backend [a-z ]+%)\n$", out)
    assert.equal(0, rc)
    out, _, rc = run { "--help" }
    assert.matches("^usage: m3lua", out)
    assert.equal(0, rc)
    assert.equal(out, (run { "-h" }))
    local err
    out, err, rc = run { "-x" }
    assert.equal("", out)
    assert.equal("m3lua: unknown option -x", err:match("^[^\n]*"))
    assert.matches("^[^\n]*\nusage: m3lua", err)
    assert.equal(1, rc)
    out, err, rc = run { "--bogus", "script.lua" }
    assert.equal("", out)
    assert.equal("m3lua: unknown option --bogus", err:match("^[^\n]*"))
    assert.equal(1, rc)
    _, err, rc = run { "-e" }
    assert.equal("m3lua: option -e needs an argument", err:match("^[^\n]*"))
    assert.equal(1, rc)
  end)

  it("reports an error in a script with a traceback and status 1", function()
    spit(base .. ".lua", "local function f() error('boom') end\nf()\n")
    local out, err, rc = run { base .. ".lua" }
    assert.equal("", out)
    assert.equal(1, rc)
    assert.matches("^m3lua: [^\n]*%.lua:1: boom\nstack traceback:\n", err)
    assert.matches("in function 'f'", err, 1, true)
  end)

  -- Runs scripts/<script> with args in a fresh folder; checks the exit status, that nothing was
  -- printed on stdout, the first line of stderr (and that no traceback follows), and that no run
  -- folder was made.
  local function refuses(script, args, rc_want, first_line)
    local pwd = io.popen("pwd")
    local all = { pwd:read("*l") .. "/scripts/" .. script }
    pwd:close()
    for _, a in ipairs(args) do all[#all + 1] = a end
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir " .. dir) == 0)
    local out, err, rc = run(all, nil, "cd " .. quote(dir) .. " &&")
    local left = io.open(dir .. "/runs")
    os.execute("rm -rf " .. quote(dir))
    assert.equal(rc_want, rc, err)
    assert.equal("", out)
    assert.matches(first_line, err:match("^[^\n]*"))
    assert.is_nil(err:find("traceback", 1, true), err)
    assert.is_nil(left, "a run folder was left behind")
  end

  it("train.lua refuses bad flag values before making its run folder", function()
    local function try(...) refuses("train.lua", ...) end
    try({ "--eval_batches", "0" }, 2, '^%-%-eval_batches expects an integer from 1 to 2147483647, got "0"$')
    try({ "--batch", "0" }, 2, '^%-%-batch expects an integer from 1 to 2147483647, got "0"$')
    try({ "--steps", "2.5" }, 2, '^%-%-steps expects an integer from 1 to 2147483647, got "2.5"$')
    -- counts the library holds in an int32, which fit.run and fit.evaluate would refuse only once the run had begun
    for _, flag in ipairs { "steps", "batch", "eval_every", "eval_batches" } do
      try({ "--" .. flag, "1e10" }, 2, '^%-%-' .. flag .. ' expects an integer from 1 to 2147483647, got "1e10"$')
    end
    try({ "--lr", "nan" }, 2, '^%-%-lr expects a number >= 0, got "nan"$')
    try({ "--task", "sorting" }, 2, '^%-%-task expects one of parity | arithmetic | brackets | mqar, got "sorting"$')
    -- values that only the library refuses: its message after the script's name, status 2
    try({ "--lr", "0" }, 2, "^train%.lua: m3%.schedule%.warmup_cosine: expected peak > 0, got 0$")
    try({ "--floor", "2" }, 2, "^train%.lua: m3%.schedule%.warmup_cosine: expected floor <= peak")
    try({ "--warmup", "5000", "--steps", "10" }, 2, "^train%.lua: m3%.schedule%.warmup_cosine: expected total > warmup")
    try({ "--rope_fraction", "2" }, 2, "^train%.lua: m3: rope_fraction = 2")
    try({ "--d_model", "30" }, 2, "^train%.lua: m3: headdim = 16: must divide d_inner")
    try({ "--headdim", "7" }, 2, "^train%.lua: m3: headdim = 7: must divide d_inner")
    try({ "--min_length", "50" }, 2, "^train%.lua: m3%.curriculum%.lengths: min_length must be an integer")
    try({ "--from_length", "100" }, 2, "^train%.lua: m3%.curriculum%.lengths: expected integers 1 <= from <= to")
    try({ "--steps", "2" }, 2, "^train%.lua: m3%.curriculum%.lengths: 3 stages")
    -- 2^53 and past: the flag's max (the library's bound, [0, 2^53)), not the library's message
    try({ "--seed", "1e300" }, 2, '^%-%-seed expects an integer from 0 to 9007199254740991, got "1e300"$')
    for _, device in ipairs { "nowhere", "gpu", "CPU", "" } do
      try({ "--device", device }, 2, '^train%.lua: m3%.trainer: device = "' .. device .. '": expected')
    end
    if require("m3").cuda_device_count() == 0 then
      try({ "--dtype", "bf16" }, 2, "^train%.lua: m3: dtype bf16: the CPU backend computes in f32 only")
    end
    -- a run name is one folder under runs/, never a path out of it or runs/ itself
    for _, name in ipairs { "../esc", ".", " .. ", "/tmp/x", "a/b", " " } do
      try({ "--run", name, "--steps", "3", "--eval_batches", "1" }, 2, '^train%.lua: %-%-run "' .. name:gsub("%p", "%%%0")
        .. '": a run name is a single folder name under runs/ %(no "/", not "%." or "%.%.", not blank%)$')
    end
  end)

  it("lm.lua refuses bad flag values before making its run folder", function()
    local function try(...) refuses("lm.lua", ...) end
    try({ "--carry", "--batch", "8" }, 2,
      "^lm%.lua: %-%-carry reads %-%-batch streams, one per state row of the trainer: %-%-micro_batch %(16%) must equal "
      .. "%-%-batch %(8%)$")
    try({ "--micro_batch", "0" }, 2, '^%-%-micro_batch expects an integer >= 1, got "0"$')
    try({ "--steps", "-5" }, 2, '^%-%-steps expects an integer from 1 to 2147483647, got "%-5"$')
    try({ "--keep", "-1" }, 2, '^%-%-keep expects an integer >= 0, got "%-1"$')
    try({ "--temperature", "-1" }, 2, '^%-%-temperature expects a number >= 0, got "%-1"$')
    try({ "--sample_len", "-1" }, 2, '^%-%-sample_len expects an integer from 0 to 2147483647, got "%-1"$')
    try({ "--eval_batches", "0" }, 2, '^%-%-eval_batches expects an integer from 1 to 2147483647, got "0"$')
    -- counts the library holds in an int32, refused otherwise once the run had begun (--sample_len: after it)
    for _, flag in ipairs { "steps", "batch", "eval_every", "eval_batches", "sample_len" } do
      local min = flag == "sample_len" and 0 or 1
      try({ "--" .. flag, "1e10" }, 2, '^%-%-' .. flag .. ' expects an integer from ' .. min .. ' to 2147483647, got "1e10"$')
    end
    try({ "--warmup", "-3" }, 2, '^%-%-warmup expects a number >= 0, got "%-3"$')
    try({ "--dtype", "f64" }, 2, '^%-%-dtype expects one of f32 | bf16 | f16, got "f64"$')
    try({ "--lr", "0" }, 2, "^lm%.lua: m3%.schedule%.warmup_cosine: expected peak > 0, got 0$")
    try({ "--headdim", "5" }, 2, "^lm%.lua: m3: ")
    try({ "--device", "nowhere" }, 2, "^lm%.lua: m3%.trainer: device")
    try({ "--data", "missing.txt" }, 2, "^lm%.lua: m3%.data%.text: cannot open missing%.txt")
    try({ "--data", "/dev/null" }, 2,
      "^lm%.lua: m3%.data%.text: /dev/null is a character device, not a regular file: expected a file of ids$")
    try({ "--data", "/" }, 2, "^lm%.lua: m3%.data%.text: / is a folder, not a regular file: expected a file of ids$")
    try({ "--seq_len", "100000" }, 2, "^lm%.lua: m3%.data: .* has %d+ ids in this split, a window of 100000")
    try({ "--run", "..", "--steps", "1", "--sample_len", "1" }, 2, '^lm%.lua: %-%-run "%.%.": a run name is a single')
  end)

  it("honours os.exit", function()
    local _, _, rc = run { "-e", "os.exit(3)" }
    assert.equal(3, rc)
  end)

  it("keeps a piped REPL session going past errors", function()
    local out, err, rc = run({ "-i" },
      '1+1\nx = 5;\nx\nfor i=1,2 do\nprint(i)\nend\nerror("boom")\nprint("still alive")\n')
    assert.equal("2\n5\n1\n2\nstill alive\n", out)
    assert.matches("^stdin:1: boom\nstack traceback:\n", err)
    assert.not_matches("repl%.lua", err)
    assert.equal(0, rc)
  end)

  it("REPL: results, ';', =expr, syntax errors, help, the lazy m3 global, os.exit", function()
    local out, err, rc = run({ "-i" }, table.concat({
      "1, nil, 'a'",
      "{ b = 1, a = { 1, 2 } }",
      "2 + 2;",
      "=3 * 2, 'b'",
      "= 4 +",
      "1",
      "x = = 1",
      "saved_path, package.path = package.path, ''",
      "?trainer",
      "package.path = saved_path",
      "package.preload['m3.help'] = function() return { show = print } end",
      "? m3.schedule ",
      "package.preload.m3 = function() return { presets = 'P' } end",
      "rawget(_G, 'm3'), m3.presets, rawget(_G, 'm3') ~= nil",
      "os.exit(4)",
      "print('not reached')",
    }, "\n") .. "\n")
    assert.equal(table.concat({
      '1\tnil\t"a"',
      "{ a = { 1, 2 }, b = 1 }",
      '6\t"b"',
      "5",
      "no help available for trainer",
      "m3.schedule",
      'nil\t"P"\ttrue',
    }, "\n") .. "\n", out)
    assert.matches("^stdin:1: unexpected symbol near '='\n$", err)
    assert.equal(4, rc)
  end)

  it("REPL: an expression cut after an operator continues; input ending inside a chunk says why it never ran",
    function()
    local out, err, rc = run({ "-i" }, "1 +\n2\nx = 1 + + 2\nfor i = 1, 2 do\nprint(i)\n")
    assert.equal("3\n", out)
    assert.equal("stdin:1: unexpected symbol near '+'\nstdin:2: 'end' expected (to close 'for' at line 1) near "
      .. "'<eof>'\n", err)
    assert.equal(0, rc)
  end)

  it("REPL: `...` is empty in expressions and statements", function()
    local out, err, rc = run({ "-i" }, table.concat({
      "...",
      "select('#', ...)",
      "print(select('#', ...))",
      "(...)",
    }, "\n") .. "\n")
    assert.equal("0\n0\nnil\n", out)
    assert.equal("", err)
    assert.equal(0, rc)
  end)

  it("stops interpreted code on SIGINT with status 128 + 2", function()
    local _, err, rc = run_signalled({ "-joff", "-e", "while true do end" }, "INT")
    assert.equal(130, rc)
    assert.matches("interrupted!\nstack traceback:", err, 1, true)
  end)

  it("ends a program that caught the first interrupt on a second signal of either kind", function()
    -- the first signal's error is caught and the loop goes on; the second (the other kind) used to be caught too
    local swallow = { "-joff", "-e", "while true do pcall(function() for _ = 1, 1e6 do end end) end" }
    local _, _, rc = run_signalled(swallow, "INT TERM")
    assert.equal(143, rc)
    _, _, rc = run_signalled(swallow, "TERM INT")
    assert.equal(130, rc)
  end)

  it("takes the same signal twice within milliseconds as one (GNU timeout signals the child, then its group)",
    function()
      -- the program catches the interrupt and takes 0.5 s to finish (a checkpoint); a duplicate used to kill it
      local finish = { "-joff", "-e", "pcall(function() while true do end end) io.write('caught\\n') "
        .. "local t = os.clock() while os.clock() - t < 0.5 do end os.exit(3)" }
      local out, _, rc = run_signalled(finish, "TERM TERM", 0)
      assert.equal(3, rc)
      assert.equal("caught\n", out)
    end)

  it("takes SIGPIPE as an interrupt, so that a run piped into head can save its work", function()
    spit(base .. ".lua", [[
      local ok, err = pcall(function() while true do io.write("line\n") end end)
      io.stderr:write("caught: ", tostring(err), "\n")
      io.write("more\n") -- later writes fail with EPIPE; they do not kill
      io.stderr:write("saved\n")]])
    os.execute(("{ %s -joff %s 2> %s; echo $? > %s; } | head -c 5 > /dev/null"):format(quote(M3LUA),
      quote(base .. ".lua"), quote(base .. ".err"), quote(base .. ".rc")))
    assert.equal("caught: interrupted!\nsaved\n", slurp(base .. ".err"))
    assert.equal("141\n", slurp(base .. ".rc"))
  end)

  it("ends silently with 141 when the reader of its output goes away and the program does not catch it",
    function()
      for _, jit in ipairs { "-joff", "-jon" } do -- the hook's error; the watchdog in a compiled loop
        os.execute(("{ %s %s -e %s 2> %s; echo $? > %s; } | head -c 5 > /dev/null"):format(quote(M3LUA), jit,
          quote('while true do io.write("line\\n") end'), quote(base .. ".err"), quote(base .. ".rc")))
        assert.equal("", slurp(base .. ".err"), jit)
        assert.equal("141\n", slurp(base .. ".rc"), jit)
      end
    end)

  it("reports an interrupt inside the library's calls without a library line", function()
    local _, err, rc = run_signalled({ "-joff", "-e", [[
      local m3 = require "m3"
      local cfg = m3.config { d_model = 16, n_layers = 1, d_state = 8, headdim = 8, input = "tokens", vocab_size = 9,
        head = "lm" }
      local inf, tok = m3.infer(m3.weights.init(cfg), { device = "cpu" }), m3.tensor.from({ { 1 } }, "i32")
      while true do inf:step(tok) end]] }, "INT")
    assert.equal(130, rc)
    assert.matches("^m3lua: interrupted!\nstack traceback:", err)
  end)

  it("ends a JIT-compiled loop that cannot see the interrupt", function()
    local _, err, rc = run_signalled({ "-e", "while true do end" }, "INT")
    assert.equal(130, rc)
    assert.matches("JIT-compiled", err, 1, true)
  end)

  it("lm.lua prompts its sample with the validation text it has, when shorter than 64 bytes", function()
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir " .. dir) == 0)
    local text = ("the quick brown fox jumps over the lazy dog. "):rep(9) -- 405 bytes: 41 for validation
    spit(dir .. "/t.txt", text)
    local pwd = io.popen("pwd")
    local lm = pwd:read("*l") .. "/scripts/lm.lua"
    pwd:close()
    local _, err, rc = run({ lm, "--data", "t.txt", "--steps", "1", "--d_model", "8", "--n_layers", "1",
      "--d_state", "8", "--headdim", "8", "--batch", "2", "--micro_batch", "2", "--seq_len", "16",
      "--eval_batches", "1", "--sample_len", "3", "--device", "cpu", "--run", "small" }, nil,
      "cd " .. quote(dir) .. " &&")
    local prompt, sample = rc == 0 and slurp(dir .. "/runs/small/prompt.txt"), rc == 0 and slurp(dir .. "/runs/small/sample.txt")
    os.execute("rm -rf " .. quote(dir))
    assert.equal(0, rc, err)
    assert.equal(text:sub(-41), prompt)
    assert.equal(3, #sample)
  end)

  -- A SIGINT that arrives while the engine runs a call that then takes effect: the host's hook
  -- raises "interrupted!" as the call returns. The step's record keeps its metrics.
  for _, batch in ipairs { 4, 2 } do
    it("keeps the metrics of a step that took effect as SIGINT came (" .. batch .. " rows, 2 a call)", function()
      local dir = os.tmpname()
      os.remove(dir)
      spit(base .. ".lua", ([[
        local ffi = require "ffi"
        ffi.cdef "int getpid(void); int kill(int pid, int sig);"
        local m3 = require "m3"
        local cfg = m3.config { d_model = 8, n_layers = 1, d_state = 8, headdim = 8, input = "tokens",
          head = "lm", vocab_size = 2 }
        local function run(dir, signal_at)
          local tr = m3.trainer(cfg, { device = "cpu", batch = 2, seq_len = 8, seed = 1 })
          local calls = 0
          local function signalling(name)
            tr[name] = function(self, ...)
              local m = getmetatable(self)[name](self, ...)
              calls = calls + 1
              if calls == signal_at then ffi.C.kill(ffi.C.getpid(), 2) end
              return m
            end
          end
          signalling("step")
          signalling("backward_step")
          return m3.fit.run { trainer = tr, data = m3.data.parity { seed = 1, length = 8 }, steps = 4,
            batch = %d, dir = dir, progress = false, checkpoint = m3.checkpoint.new { dir = dir .. "/ck" } }
        end
        run(%q)
        run(%q, 3)]]):format(batch, dir .. "/whole", dir .. "/cut"))
      local _, err, rc = run { base .. ".lua" }
      assert.equal(130, rc, err)
      local step = batch == 4 and 2 or 3 -- call 3: the first half of step 2, or step 3
      assert.matches("interrupted at step " .. step .. "; saved", err, 1, true)
      local log = require "m3.log"
      local whole, cut = log.read_jsonl(dir .. "/whole/metrics.jsonl"), log.read_jsonl(dir .. "/cut/metrics.jsonl")
      assert.equal(step, #cut)
      for i = 1, step do
        for _, k in ipairs { "step", "loss", "accuracy", "tokens", "rows" } do
          assert.equal(whole[i][k], cut[i][k], k)
        end
      end
      os.execute("rm -rf " .. quote(dir))
    end)
  end

  it("lets a script stopped (Ctrl-Z) in a read go on reading after it continues (fg)", function()
    -- the host's SIGTSTP handler restarts the read, as the default stop does (it failed: Interrupted system call)
    local out, _, rc = run_signalled({ "-e", "local p = io.popen('sleep 1.2; echo hello') print(p:read('l'))" },
      "TSTP CONT")
    assert.equal("hello\n", out)
    assert.equal(0, rc)
  end)

  it("lets a script catch SIGTERM and read the pending signal", function()
    local out, _, rc = run_signalled({ "-joff", "-e", [[
      local ok, err = pcall(function() while true do end end)
      print(ok, err, require("m3.host").pending_signal())]] }, "TERM")
    assert.equal("false\tinterrupted!\t15\n", out)
    assert.equal(0, rc)
  end)
end)

describe("m3lua's REPL on a terminal", function()
  local function send(bytes) return { send = bytes } end
  local function expect(text) return { expect = text } end
  local prompt = { prompt = "m3> " }

  it("comes back from Ctrl-Z and fg (bash's job control) editing the line it was stopped in", function()
    -- fg put m3lua back with the terminal in line mode: the first line after it was echoed by the terminal
    -- ("12^[[D3"), keys were read only at Enter, and the prompt was not drawn again. Stopped while a key was
    -- being handled (here Tab, completing through a slow __index that writes "<" first), it drew the line
    -- again only after the next key; a Ctrl-C that came while it drew the line was seen only after the next key.
    -- (env: PS1 does not reach bash through a non-interactive shell in between, such as a python3 wrapper)
    local shell_prompt = { prompt = "$ " }
    local shown, rc = on_terminal({ "env", "PS1=$ ", "HISTFILE=", "bash", "--norc", "--noprofile", "-i" }, {
      shell_prompt, send("M3LUA_HISTORY= " .. quote(M3LUA) .. "\r"), prompt,
      send("slow = setmetatable({}, { __index = function() io.write('<') io.flush() "
        .. "local t = os.clock() while os.clock() - t < 0.5 do end end })\r"), prompt,
      send("12"), expect("12"), send("\26"), expect("Stopped"), shell_prompt,
      send("fg\r"), { prompt = "m3> 12" }, send("\27[D3\r"), expect("132"), prompt,
      send("slow.a.b"), expect("slow.a.b"), send("\t"), expect("<"), send("\26"), expect("Stopped"), shell_prompt,
      send("fg\r"), { prompt = "m3> slow.a.b" }, send("\3"), prompt,
      send("2 + 3\r"), expect("5"), prompt, send("\4"), shell_prompt, send("exit\r"),
    })
    shown = shown:gsub("\27%[%?2004[hl]", "") -- bash's bracketed-paste switches
    assert.equal(0, rc, shown)
    local after_fg, after_second_fg = shown:match("%$ fg\r\n(.*)%$ fg\r\n(.*)$")
    assert.is_not_nil(after_fg, shown)
    assert.matches("^[^\n]*m3lua'?\r\nm3> 12", after_fg) -- the prompt and the line, drawn again
    assert.is_nil(after_fg:find("^[", 1, true), after_fg) -- the arrow key echoed as text
    assert.matches("\r\n132\r\n", after_fg)
    assert.matches("^[^\n]*m3lua'?\r\nm3> slow%.a%.b", after_second_fg)
    assert.matches("\r\nm3> 2 %+ 3\r\n5\r\n", after_second_fg)
  end)

  it("reads characters in the locale's encoding (UTF-8 where the locale is C), invalid bytes as U+FFFD", function()
    -- "é" came to libedit as two meaningless characters (dropped with a bell: #"é" was 0) and \255 as Meta-Delete
    for _, locale in ipairs { "LC_ALL=C", "LC_ALL=C.UTF-8" } do
      local shown, rc = repl_on_terminal({ send("#'\195\169', '\226\134\146'\r"), prompt,
        send("'a\255b', 'x\195y'\r"), prompt, send("\4") }, locale)
      assert.equal(0, rc, shown)
      assert.matches('\r\n2\t"→"\r\n', shown, 1, true)
      assert.matches('\r\n"a\239\191\189b"\t"x\239\191\189y"\r\n', shown, 1, true)
    end
  end)

  it("leaves the terminal in line mode when SIGTERM or SIGHUP ends the session at the prompt (143, 129)", function()
    for sig, want in pairs { [15] = 143, [1] = 129 } do
      local shown, rc = repl_on_terminal({ send("x = 1"), expect("x = 1"), { signal = sig } })
      assert.equal(want, rc, shown)
      assert.matches("%[terminal: cooked%]$", shown)
    end
  end)

  it("shares its history file with other sessions, and says once when the file cannot be written", function()
    -- each line saved wrote this session's lines alone over the file, dropping those another session had saved
    local file = base .. ".hist"
    os.remove(file)
    local shown, rc = repl_on_terminal({
      send("f = io.open(os.getenv('M3LUA_HISTORY'), 'w') f:write('_HiStOrY_V2_\\nother_session\\n') f:close()\r"),
      prompt, send("x = 1\r"), prompt, send("\4") }, "M3LUA_HISTORY=" .. file)
    assert.equal(0, rc, shown)
    local saved = slurp(file)
    os.remove(file)
    assert.equal("_HiStOrY_V2_\nother_session\nx\\040=\\0401\n", saved)
    -- an unwritable file was not saved without a word
    local missing = base .. ".no_such_folder/hist"
    shown, rc = repl_on_terminal({ send("1\r"), prompt, send("2\r"), prompt, send("\4") },
      "M3LUA_HISTORY=" .. missing)
    assert.equal(0, rc, shown)
    local said = "m3lua: cannot save the history to " .. missing .. ": No such file or directory"
    local first = shown:find(said, 1, true)
    assert.is_not_nil(first, shown)
    assert.is_nil(shown:find(said, first + 1, true), shown)
  end)

  it("drops the line being edited on Ctrl-C and goes on", function()
    local shown, rc = repl_on_terminal({ send("for i = 1, 2 do"), expect("do"), send("\3"), prompt,
      send("7 * 6\r"), expect("42"), prompt, send("\4") })
    assert.equal(0, rc, shown)
    assert.matches("%[terminal: cooked%]$", shown)
  end)
end)

describe("m3.repl", function()
  it("pretty-prints values shallowly, sorted, cycle-safe, names given on first use unloaded", function()
    local t = { 1, 2, z = true, [10] = "ten", n = { deep = { deeper = {} } } }
    t.self = t
    assert.equal('{ 1, 2, [10] = "ten", n = { deep = {...} }, self = <cycle>, z = true }',
      repl.pretty(t))
    assert.equal('"a\\nb\\"c"', repl.pretty('a\nb"c'))
    assert.equal("{}", repl.pretty({}))
    assert.equal("obj!", repl.pretty(setmetatable({}, { __tostring = function() return "obj!" end })))
    -- names __fields lists that __index would give (m3's modules) show without being loaded
    local asked = 0
    local lazy = setmetatable({ b = 1 }, { __fields = { "a", "b", "c" },
      __index = function() asked = asked + 1 return 7 end })
    assert.equal("{ a = <on first use>, b = 1, c = <on first use> }", repl.pretty(lazy))
    assert.equal(0, asked)
    local long = {}
    for i = 1, 30 do long["key" .. i] = i end
    assert.matches("^{\n  key1 = 1,\n  key10 = 10,\n", repl.pretty(long))
  end)

  it("keeps the history in $M3LUA_HISTORY, else in $HOME, and nowhere without a home", function()
    local ffi = require "ffi"
    ffi.cdef [[
      int m3spec_setenv(const char *name, const char *value, int overwrite) __asm__("setenv");
      int m3spec_unsetenv(const char *name) __asm__("unsetenv");
    ]]
    local saved = { M3LUA_HISTORY = os.getenv("M3LUA_HISTORY"), HOME = os.getenv("HOME") }
    local function set(name, value)
      if value then ffi.C.m3spec_setenv(name, value, 1) else ffi.C.m3spec_unsetenv(name) end
    end
    local found = {}
    local envs = { { "/h/file", "/home/u" }, { "", "/home/u" }, { nil, "/home/u" }, { nil, "" }, { nil, nil } }
    for i, env in ipairs(envs) do
      set("M3LUA_HISTORY", env[1])
      set("HOME", env[2])
      found[i] = repl.history_file() or false
    end
    set("M3LUA_HISTORY", saved.M3LUA_HISTORY)
    set("HOME", saved.HOME)
    -- HOME="" gave /.m3lua_history
    assert.same({ "/h/file", false, "/home/u/.m3lua_history", false, false }, found)
  end)

  it("completes globals, fields and methods", function()
    assert.same({ "string.format" }, repl.completions("string.fo"))
    assert.same({ "os.execute", "os.exit" }, repl.completions("os.ex"))
    assert.same({ "s:upper" }, (function()
      _G.s = "text"
      local c = repl.completions("s:up")
      _G.s = nil
      return c
    end)())
    local obj = setmetatable({ field = 1 }, { __index = { method = function() end } })
    _G.completion_probe = obj
    assert.same({ "completion_probe.field", "completion_probe.method" },
      repl.completions("completion_probe."))
    assert.same({ "completion_probe:method" }, repl.completions("completion_probe:"))
    _G.completion_probe = nil
    assert.same({ "while" }, repl.completions("whil"))
    assert.same({}, repl.completions("nosuchthing.x"))
  end)

  it("completes the names an __index function gives that its metatable lists in __fields", function()
    _G.completion_probe = setmetatable({}, { __fields = { "later" },
      __index = function(_, k) if k == "later" then return { inner = 1 } end end })
    assert.same({ "completion_probe.later" }, repl.completions("completion_probe.la"))
    assert.same({ "completion_probe.later.inner" }, repl.completions("completion_probe.later.in"))
    _G.completion_probe = nil
    local m3 = require "m3"
    _G.m3 = m3
    assert.same({ "m3.schedule" }, repl.completions("m3.sch"))
    assert.same({ "m3.preset", "m3.presets" }, repl.completions("m3.pres"))
    _G.m3 = nil
  end)
end)

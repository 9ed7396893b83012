-- m3.data — training data: synthetic tasks, text files and token files.
--
-- Every source is deterministic given its seed and resumable from a cursor:
--   local src = m3.data.parity{seed = 1, length = 32}
--   local batch = src:next(rows, {length = 16})   -- {tokens =, targets =} int32 [rows, T]
--   local c = src:cursor()                         -- {seed =, index =} (a stream: rows =, position =) ...
--   src:seek(c)                                    -- ... and continue with the same batches
--   src.vocab, src.classes                         -- for m3.config{vocab_size = ...}
--
--   data.parity{...}, data.arithmetic{brackets =, ...}, data.mqar{...}   (m3.data.tasks)
--   data.mixture({src1, src2, ...}, {seed =, weights =})                 (m3.data.source)
--   data.text(path, {split =, order =, length =, ...})  bytes, vocab 256 (m3.data.file)
--   data.tokens(path, {dtype = "u16" | "u32", vocab = <required>, ...})   (m3.data.file)
--   data.evaluate(ids, modulus, first, last)  exact value of the arithmetic expression
--                                    ids[first..last] (a Lua list, without the '=')
--   data.rng                         the generator behind all of them
--   data.scaled_accuracy(acc, classes)  (acc - 1/classes) / (1 - 1/classes): 0 for a uniform
--                                    guess among the classes, 1 when every answer is right; not
--                                    0 for every answer without skill where the answers are not
--                                    uniform (brackets: always 0 scores 12.5%, m3.data.tasks);
--                                    acc a number, classes an integer >= 2

local tasks = require "m3.data.tasks"
local source = require "m3.data.source"
local file = require "m3.data.file"
local lib = require "m3.lib"
local options = require "m3.options"

lib.internal_file(debug.getinfo(1, "S").source)

local data = {
  tasks = tasks,
  rng = require "m3.data.rng",
  mixture = source.mixture,
  evaluate = tasks.evaluate,
}

for _, name in ipairs { "parity", "arithmetic", "mqar" } do
  data[name] = function(opts)
    if type(opts) ~= "nil" and type(opts) ~= "table" then
      error(string.format("m3.data.%s: expected an options table, got %s", name, type(opts)), 2)
    end
    return source.new(tasks[name], opts)
  end
end

function data.tokens(path, opts)
  if type(path) ~= "string" then error("m3.data.tokens: expected a file path, got " .. type(path), 2) end
  return file.open(path, opts, "tokens")
end

function data.text(path, opts)
  if type(path) ~= "string" then error("m3.data.text: expected a file path, got " .. type(path), 2) end
  return file.open(path, opts, "text")
end

function data.scaled_accuracy(acc, classes)
  options.want_number(acc, "m3.data.scaled_accuracy: acc")
  options.want_int(classes, "m3.data.scaled_accuracy: classes", 2)
  return (acc - 1 / classes) / (1 - 1 / classes)
end

return data

-- m3.data.file — language-model windows from a token file or a text file.
--
-- A token file is a raw little-endian array of uint8 / uint16 / uint32 ids (no header). The
-- source keeps it open and reads each window's ids with pread through the FFI (no mapping), so
-- a file larger than memory costs nothing until read, and a file cut short under a run can
-- only give an error, never kill the process (a read of a mapped page past the end of a
-- truncated file is a SIGBUS). A text file is a uint8 token file with vocab 256 (bytes). The
-- path must name a regular file (a folder, FIFO, device or socket is refused before it is
-- opened: opening a FIFO would wait for a writer). Offsets are exact to 2^53 ids.
-- While a source reads a file, replace the file by writing the new one elsewhere and renaming
-- it over the old (mv: the source goes on reading the old one); never truncate or rewrite it in
-- place. Every next, sample and slice first checks the file's size (one lseek) and raises an
-- error naming the file when it holds fewer bytes than when the source was made, and a read
-- that meets the end of the file (a truncation after that check) raises the same error. A file
-- rewritten in place to its old size or more is not seen: the windows read the new bytes.
-- A token file's vocab (the model's vocab_size) is an integer from 1 to 2^24, required for "u16" and
-- "u32" ids (256 for "u8" when not given). Ids >= vocab in the file are not looked for
-- here: the trainer refuses a batch that holds one, naming the field and the id; a u32 id past
-- 2^31 - 1, which no int32 token holds, is an error here (it would wrap to another id, -1 too).
-- A batch of windows holds at most 2^31 - 1 ids (source.MAX_POSITIONS); sample and slice give Lua
-- lists of at most 2^27 ids (tasks.MAX_LENGTH). Windows are read 2^20 ids at a time.
--
-- A window of length L at offset o gives tokens = ids[o .. o+L-1] and targets =
-- ids[o+1 .. o+L] (next-token prediction). The file splits into "train" (the first
-- 1 - val_fraction of it), "val" (the rest) or "all". Window `index` of a source is
--   order "random":     at an offset drawn from rng.new(seed, index) (default);
--   order "sequential": the index-th of the non-overlapping windows, wrapping around;
--   order "stream":     row r of each batch reads the r-th of `rows` contiguous stretches
--                       of the split from where its last window ended, whatever the
--                       lengths, so consecutive batches continue each row's text (for
--                       carry_state training); a window that would run past the end of
--                       its stretch starts it over. A stream serves one row count:
--                       opts.rows, else its first next's; a next for any other count is
--                       an error (its rows would read other text).
-- src:next(rows, {length =}) takes the window length of the call (checked as the
-- constructor's) and the names m3.fit passes along; any other name is an error.
-- The cursor is {seed =, index =} (windows consumed), checked as for the synthetic tasks
-- (a stream's index is also a multiple of its rows). A stream's adds rows = (its row count,
-- once known: a stream resumed from it serves that count) and position = (the ids each row
-- has read of its stretch since it last started over: where the next window begins), so
-- that its index only counts windows; the other orders refuse a cursor with them. A cursor
-- of earlier versions, without them, leaves the count as it was and places the next window
-- at window index / rows of the call's length.

local bit = require "bit"
local ffi = require "ffi"
local fs = require "m3.fs"
local lib = require "m3.lib"
local options = require "m3.options"
local rng = require "m3.data.rng"
local source = require "m3.data.source"
local tasks = require "m3.data.tasks"
local tensor = require "m3.tensor"

lib.internal_file(debug.getinfo(1, "S").source)

local raise, check_keys, want_int, show = lib.raise, options.check_keys, options.want_int, options.show

-- one declaration per cdef, so that one already made elsewhere does not hide the others
for _, decl in ipairs {
  "int open(const char *path, int flags, ...);",
  "int close(int fd);",
  "int64_t lseek(int fd, int64_t offset, int whence);",
  "int64_t pread(int fd, void *buf, size_t count, int64_t offset);",
  "char *strerror(int errnum);",
} do pcall(ffi.cdef, decl) end

local C = ffi.C
-- O_NONBLOCK: a FIFO put at the path after fs.kind looked opens at once (its reads then fail);
-- O_CLOEXEC: the file stays open as long as its source, and no child inherits it
local O_RDONLY, O_NONBLOCK, O_CLOEXEC, SEEK_END, EINTR = 0, 0x800, 0x80000, 2, 4

local array = { u8 = "uint8_t[?]", u16 = "uint16_t[?]", u32 = "uint32_t[?]" }
local width = { u8 = 1, u16 = 2, u32 = 4 }

local file = {}

-- Opens path (a regular file of dtype ids) for reading; returns its id count and a handle holding the
-- descriptor (closed when the handle is collected). Errors begin with what (the caller's function).
local function open_ids(path, dtype, what)
  local kind = fs.kind(path)
  if kind then raise(string.format("%s: %s is %s, not a regular file: expected a file of ids", what, path, kind)) end
  local fd = C.open(path, bit.bor(O_RDONLY, O_NONBLOCK, O_CLOEXEC))
  if fd < 0 then
    raise(string.format("%s: cannot open %s: %s", what, path, ffi.string(C.strerror(ffi.errno()))))
  end
  local handle = ffi.gc(ffi.new("int[1]", fd), function(h) C.close(h[0]) end)
  local bytes = tonumber(C.lseek(fd, 0, SEEK_END))
  if bytes < 0 then
    raise(string.format("%s: cannot read %s: %s", what, path, ffi.string(C.strerror(ffi.errno()))))
  end
  if bytes == 0 then raise(string.format("%s: %s is empty", what, path)) end
  if bytes % width[dtype] ~= 0 then
    raise(string.format("%s: %s has %d bytes, not a whole number of %s ids", what, path, bytes, dtype))
  end
  return bytes / width[dtype], handle
end

local F = {}
F.__index = F
source.ITSELF[F] = true
local check_self = source.check_self

local ORDERS = { random = true, sequential = true, stream = true }
local SPLITS = { train = true, val = true, all = true }
local TEXT_OPTS = { split = true, val_fraction = true, order = true, length = true, rows = true, seed = true,
                    cursor = true }
local TOKEN_OPTS = { dtype = true, vocab = true, split = true, val_fraction = true, order = true, length = true,
                     rows = true, seed = true, cursor = true }
-- next's options: length, and the names m3.fit passes along (source.FIT).
F.next_options = source.overlay(source.FIT, { length = true })

-- A window source over path. kind "tokens": opts are dtype ("u8", "u16", "u32"), vocab,
-- split, val_fraction (0.1), order, length (default window length), rows (order "stream":
-- rows per call), seed, cursor; kind "text": the same but dtype and vocab, which are "u8"
-- and 256.
function file.open(path, opts, kind)
  opts = opts or {}
  local what = "m3.data." .. kind
  check_keys(opts, kind == "text" and TEXT_OPTS or TOKEN_OPTS, what)
  local dtype = kind == "text" and "u8" or opts.dtype or "u16"
  if not array[dtype] then
    raise(string.format('%s: dtype = %s: expected "u8", "u16" or "u32"', what, show(dtype)))
  end
  local split, frac = opts.split or "train", opts.val_fraction or 0.1
  if not SPLITS[split] then
    raise(string.format('%s: split = %s: expected "train", "val" or "all"', what, show(split)))
  end
  if type(frac) ~= "number" or not (frac >= 0 and frac < 1) then
    raise(string.format("%s: val_fraction = %s: expected a number in [0, 1)", what, show(frac)))
  end
  local order = opts.order or "random"
  if not ORDERS[order] then
    raise(string.format('%s: order = %s: expected "random", "sequential" or "stream"', what, show(order)))
  end
  local vocab = kind == "text" and 256 or opts.vocab or (dtype == "u8" and 256 or nil)
  if vocab == nil then
    raise(string.format('%s: vocab: required for dtype "%s" ids (an integer >= 1: the model\'s vocab_size)',
      what, dtype))
  end
  want_int(vocab, what .. ": vocab", 1)
  if vocab > tasks.MAX_VOCAB then
    raise(string.format("%s: vocab = %d: expected at most %d, the largest vocab_size of a model", what, vocab,
      tasks.MAX_VOCAB))
  end
  local length = want_int(opts.length or 256, what .. ": length", 1)
  if opts.rows ~= nil then
    if order ~= "stream" then
      raise(string.format('%s: rows = %s: only for order = "stream" (got order %q)', what, show(opts.rows), order))
    end
    want_int(opts.rows, what .. ": rows", 1)
  end
  local seed = options.check_seed(opts.seed, what)
  local n, handle = open_ids(path, dtype, what)
  local cut = math.floor(n * (1 - frac))
  local lo, hi = 0, n
  if split == "train" then
    hi = cut
  elseif split == "val" then
    lo = cut
  end
  local self = setmetatable({
    path = path, dtype = dtype, handle = handle, fd = handle[0], buf = ffi.new(array[dtype], 1), buf_len = 1,
    n = n, lo = lo, span = hi - lo, bytes = n * width[dtype],
    split = split, val_fraction = frac, order = order, vocab = vocab,
    seed = seed, index = 0, length = length, rows = opts.rows, position = order == "stream" and 0 or nil,
  }, F)
  self.classes = self.vocab
  if opts.cursor then
    self:seek(opts.cursor)
    if opts.rows and self.rows ~= opts.rows then
      raise(string.format("%s: rows = %d, but the cursor's stream serves %d rows a call", what, opts.rows, self.rows))
    end
  end
  return self
end

-- '(split = "val": the last val_fraction = 0.1 of the file's 10 ids)': which ids the source
-- reads, and the knob that sizes them.
local function split_of(self)
  if self.split == "all" then return '(split = "all": the whole file)' end
  return string.format("(split = %s: %s val_fraction = %s of the file's %d ids)", show(self.split),
    self.split == "val" and "the last" or "all but the last", show(self.val_fraction), self.n)
end

-- Raises unless the file still holds the bytes it held when the source was made (see the header).
local function check_size(self)
  local now = tonumber(C.lseek(self.fd, 0, SEEK_END))
  if now < self.bytes then
    raise(string.format("m3.data: %s now has %d bytes, fewer than the %d it had when this source was made: it was "
      .. "truncated in place while being read; replace a data file by writing the new one elsewhere and renaming it "
      .. "over the old (mv)", self.path, now, self.bytes))
  end
end

-- The most ids read at once: the read buffer (an ffi.new array, below 2 GiB) holds this many of any dtype.
local READ_CHUNK = 1048576

-- The ids [first, first + count) of the file (count <= READ_CHUNK), read into the source's buffer (valid until
-- its next read; indexed from 0). A read that meets the end of the file raises check_size's error.
local function read_ids(self, first, count)
  if count > self.buf_len then self.buf, self.buf_len = ffi.new(array[self.dtype], count), count end
  local w = width[self.dtype]
  local dst, want, got = ffi.cast("uint8_t *", self.buf), count * w, 0
  while got < want do
    local n = tonumber(C.pread(self.fd, dst + got, want - got, first * w + got))
    if n > 0 then
      got = got + n
    elseif n == 0 then
      check_size(self)
      raise(string.format("m3.data: %s: ids [%d, %d) run past the end of the file", self.path, first, first + count))
    elseif ffi.errno() ~= EINTR then
      raise(string.format("m3.data: cannot read %s: %s", self.path, ffi.string(C.strerror(ffi.errno()))))
    end
  end
  return self.buf
end

-- Raises unless the split holds a window of length L (and its last target).
local function check_fits(self, L)
  if self.span < L + 1 then
    raise(string.format("m3.data: %s has %d ids in this split, a window of %d needs %d %s",
      self.path, self.span, L, L + 1, split_of(self)))
  end
end

-- Offset of window `index` (a checked index) for windows of length L (a checked length; orders
-- "random" and "sequential").
local function window_offset(self, index, L)
  check_fits(self, L)
  if self.order == "random" then
    return self.lo + rng.new(self.seed, index):below(self.span - L)
  end
  return self.lo + (index % math.floor((self.span - 1) / L)) * L
end

-- window_offset for a caller's index and L, checked.
function F:offset(index, L)
  check_self(self, "offset", "index, L")
  source.check_index(index, "m3.data: offset")
  return window_offset(self, index, want_int(L, "m3.data: offset: L", 1))
end

-- A stream's next windows of length L in `rows` rows: the position in each row's stretch
-- where they begin, and the stretch's length.
local function stream_position(self, L, rows)
  check_fits(self, L)
  local per = math.floor(self.span / rows)
  if per < L + 1 then
    raise(string.format("m3.data: %d rows of windows of %d do not fit in the %d ids of this split %s", rows, L,
      self.span, split_of(self)))
  end
  local pos = self.position or (math.floor(self.index / rows) % math.floor((per - 1) / L)) * L
  if pos + L + 1 > per then pos = 0 end
  return pos, per
end

-- The window length of a call with options o: o.length (checked; what: for the message), else
-- the source's.
local function window_length(self, o, what)
  if o == nil or o.length == nil then return self.length end
  return want_int(o.length, what .. ": length", 1)
end

-- The window length of a call with options o (checked): what a batch of its windows may need.
function F:_longest(o)
  check_self(self, "_longest", "o")
  return window_length(self, o, "m3.data: next")
end

-- Raises unless the count ids (read from offset first) fit the int32 of a token id: a u32 file may hold
-- ids past 2^31 - 1, which would wrap to other ids (-1 too, an ignored target).
local function check_int32_ids(self, ids, count, first)
  for i = 0, count - 1 do
    if ids[i] > 2147483647 then
      raise(string.format("m3.data: %s: id %d at offset %d does not fit an int32 token id: expected ids below "
        .. "vocab = %d", self.path, ids[i], first + i, self.vocab))
    end
  end
end

-- Copies the window of length L at offset off (in pieces of at most READ_CHUNK ids): its ids [0, L) to
-- tokens[tokens_at + t], its ids [1, L] to targets[targets_at + t] (FFI arrays or Lua lists alike).
local function copy_window(self, off, L, tokens, tokens_at, targets, targets_at)
  for first = 0, L - 1, READ_CHUNK - 1 do -- a piece of n tokens reads n + 1 ids (its last target)
    local n = math.min(READ_CHUNK - 1, L - first)
    local ids = read_ids(self, off + first, n + 1)
    if self.dtype == "u32" then check_int32_ids(self, ids, n + 1, off + first) end
    local tk, tg = tokens_at + first, targets_at + first
    for t = 0, n - 1 do
      tokens[tk + t] = ids[t]
      targets[tg + t] = ids[t + 1]
    end
  end
end

-- Window `index` of length o.length (default: the source's) as Lua arrays tokens, targets
-- (what a mixture draws; a stream has no window of an index alone).
function F:sample(index, o)
  check_self(self, "sample", "index, o")
  if self.order == "stream" then
    raise('m3.data: sample: an order = "stream" source reads windows by row and batch, not by index')
  end
  source.check_index(index, "m3.data: sample")
  local L = window_length(self, o, "m3.data: sample")
  if L > tasks.MAX_LENGTH then
    raise(string.format("m3.data: sample: length = %d: must be at most %d (a sample is drawn as Lua lists, which "
      .. "hold at most 2^27 items)", L, tasks.MAX_LENGTH))
  end
  check_size(self)
  local toks, tgts = {}, {}
  copy_window(self, window_offset(self, index, L), L, toks, 1, tgts, 1)
  return toks, tgts
end

-- The number of distinct windows of length L in the split (order "sequential").
function F:count(L)
  check_self(self, "count", "L")
  return math.floor((self.span - 1) / (L and want_int(L, "m3.data: count: L", 1) or self.length))
end

-- rows windows of length o.length (default: the source's) as int32 tensors [rows, L].
function F:next(rows, o)
  check_self(self, "next", "rows, o")
  want_int(rows, "m3.data: next: rows", 1)
  if o ~= nil then options.check_table(o, self.next_options, "m3.data: next") end
  local L = window_length(self, o, "m3.data: next")
  source.check_batch(rows, L, "windows of length = %d", "m3.data: next")
  if self.order == "stream" then
    if self.rows and rows ~= self.rows then
      raise(string.format('m3.data: next: rows = %d, but this order = "stream" source serves %d rows a call '
        .. "(row r continues row r's text)", rows, self.rows))
    end
    if self.index % rows ~= 0 then
      raise(string.format("m3.data: next: the cursor's index %d is not a multiple of the stream's %d rows",
        self.index, rows))
    end
  end
  check_size(self)
  local stream = self.order == "stream"
  local pos, per
  if stream then pos, per = stream_position(self, L, rows) end
  local tokens, targets = tensor({ rows, L }, "i32"), tensor({ rows, L }, "i32")
  local tk, tg = tokens.data, targets.data
  for r = 0, rows - 1 do
    local off = stream and self.lo + r * per + pos or window_offset(self, self.index + r, L)
    copy_window(self, off, L, tk, r * L, tg, r * L)
  end
  self.index = self.index + rows
  if stream then self.rows, self.position = rows, pos + L end
  return { tokens = tokens, targets = targets }
end

-- The ids [first, first + count) of the whole file as a Lua list (first below 2^53, as the windows' offsets); ids
-- past its end are an error.
function F:slice(first, count)
  check_self(self, "slice", "first, count")
  if not source.is_id(first) then
    local past = type(first) == "number" and first >= 2 ^ 53
    raise(string.format("m3.data: slice: first = %s: expected an integer %s", show(first),
      past and "below 2^53 (offsets are exact up to there)" or ">= 0"))
  end
  want_int(count, "m3.data: slice: count", 0)
  if count > tasks.MAX_LENGTH then
    raise(string.format("m3.data: slice: count = %d: must be at most %d (the slice is a Lua list, which holds at "
      .. "most 2^27 items)", count, tasks.MAX_LENGTH))
  end
  if first + count > self.n then
    raise(string.format("m3.data: slice(%d, %d): ids [%d, %d) run past the end of %s (%d ids)", first, count,
      first, first + count, self.path, self.n))
  end
  check_size(self)
  local out = {}
  for done = 0, count - 1, READ_CHUNK do
    local n = math.min(READ_CHUNK, count - done)
    local ids = read_ids(self, first + done, n)
    for i = 0, n - 1 do out[done + i + 1] = ids[i] end
  end
  return out
end

function F:cursor()
  check_self(self, "cursor", "")
  return { seed = self.seed, index = self.index, rows = self.order == "stream" and self.rows or nil,
    position = self.position }
end

function F:seek(c)
  check_self(self, "seek", "c")
  source.check_cursor(c, "m3.data: seek", self.order == "stream")
  if c.rows ~= nil then want_int(c.rows, "m3.data: seek: cursor.rows", 1) end
  if c.position ~= nil and not source.is_id(c.position) then
    raise(string.format("m3.data: seek: cursor.position = %s: expected an integer in [0, 2^53)", show(c.position)))
  end
  self.seed, self.index = c.seed, c.index
  if self.order == "stream" then self.rows, self.position = c.rows or self.rows, c.position end
end

return file

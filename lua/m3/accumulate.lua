-- m3.accumulate — one optimizer step over k micro-batches (gradient accumulation).
--
--   local m = accumulate.step(tr, {b1, b2, ..., bk}, {clip = 1.0})
--
-- Runs tr:forward / tr:backward_step{accumulate = true} on b1..b(k-1) and closes the
-- window on bk (clipping applies there, to the summed gradient). For the "lm" and "mse"
-- heads each micro-batch's loss is scaled by its share of the counted positions,
-- c_i / sum(c): for "lm" the targets that are not -1, for "mse" the masked-in positions (all
-- rows x len without a mask). For head "none" d_out is already the gradient of the big
-- batch's loss with respect to its rows' out, so every micro-batch goes in at scale 1. The
-- summed gradient is then the gradient of the loss of the concatenated batch: the same
-- update as one big batch, up to float rounding.
-- A trainer with carry_state carries each row's state from one micro-batch into the next, so
-- there the micro-batches must be consecutive windows of the same rows (row r of each one
-- continues row r's stream: one update over k windows in time), not the parts of one batch's
-- rows (accumulate.split), which would each start from the state the part before left.
-- Returns the closing call's metrics with loss and accuracy = those of the big batch (the
-- counted-weighted means), tokens, counted (what tr:step reports for the big batch: none for
-- head "none") and ms summed over the micro-batches, and micro = k.
--
-- Interrupts (Ctrl-C / SIGTERM) before the first forward are raised as they come; inside
-- the window they do not leave it open: the engine's flag
-- is cleared, the window is finished (the trainer's pending forward tells exactly which
-- calls took effect; a backward_step that took effect before the host's hook raised gives
-- its metrics from the trainer's last call) and then the interrupt is raised again as an
-- error whose tostring contains "interrupted" and whose .metrics are the completed step's.
--
--   accumulate.split(batch, k) -> k batches of consecutive rows (views, no copies); every
--     field must be an m3 tensor, all with the same rows (dimension 1) and, where they have
--     one, the same length (dimension 2); k must divide the rows
--   accumulate.counted(tr, batch) -> c for one micro-batch (checked as a step would check it)
--
-- Every micro-batch and option is checked before the first forward, so a bad one raises
-- without leaving a forward pending or a window open; so is the list (a hole in it, or a key
-- other than 1 to k, is an error). So is the trainer: one with a forward
-- pending or an accumulation window open (from the caller's own forward / backward_step) is
-- refused, as is an f16 trainer with k >= 2 (the engine accumulates no f16 gradients).

local lib = require "m3.lib"
local options = require "m3.options"
local tensor = require "m3.tensor"

lib.internal_file(debug.getinfo(1, "S").source)

local accumulate = {}

-- The positions b's loss counts, once the trainer has checked b as a step would.
function accumulate.counted(tr, b)
  if type(tr) ~= "table" or type(tr.check_batch) ~= "function" then
    lib.raise("m3.accumulate.counted: expected a trainer (m3.trainer), got " .. options.describe(tr))
  end
  return tr:check_batch(b)
end

local function is_interrupt(err)
  return tostring(err):find("interrupted", 1, true) ~= nil
end

-- An interrupt that arrived inside a window, raised once the window is closed: the step
-- is complete and its metrics ride along (err.metrics).
local Deferred = { __tostring = function(e) return e.message end }

local STEP_OPTS = { clip = true }

function accumulate.step(tr, batches, opts)
  if type(tr) ~= "table" or type(tr.check_batch) ~= "function" then
    lib.raise("m3.accumulate.step: expected a trainer (m3.trainer), got " .. options.describe(tr))
  end
  if not options.is_list(batches) or #batches == 0 then
    lib.raise("m3.accumulate.step: expected a list of micro-batches (keys 1 to k, no hole), got "
      .. options.show(batches) .. "; nothing was run")
  end
  if opts == nil then opts = {} end
  options.check_table(opts, STEP_OPTS, "m3.accumulate.step")
  if type(opts.clip) ~= "nil" and not (type(opts.clip) == "number" and opts.clip >= 0 and opts.clip < math.huge) then
    lib.raise("m3.accumulate.step: clip = " .. options.show(opts.clip) .. ": expected a finite number >= 0 (0 = off)")
  end
  local k = #batches
  local state = tr:info()
  if state.pending_forward then
    lib.raise("m3.accumulate.step: the trainer has a forward pending (tr:forward was called); finish it with "
      .. "tr:backward_step first; nothing was run")
  end
  if state.window_open then
    lib.raise("m3.accumulate.step: the trainer has an accumulation window open (backward_step with accumulate = "
      .. "true); close it with tr:forward and a tr:backward_step without accumulate first; nothing was run")
  end
  if k >= 2 and state.dtype == "f16" then
    lib.raise(string.format("m3.accumulate.step: %d micro-batches on an f16 trainer: f16 does not accumulate "
      .. "gradients (an overflow skips the whole update); use one batch, or a bf16 or f32 trainer; nothing was run", k))
  end
  -- every micro-batch checked before the first forward: a bad one leaves no window open
  local counts, total = {}, 0
  for i, b in ipairs(batches) do
    local ok, c = pcall(accumulate.counted, tr, b)
    if not ok then lib.raise(string.format("m3.accumulate.step: micro-batch %d: %s", i, tostring(c))) end
    counts[i] = c
    total = total + c
  end
  if total == 0 then
    lib.raise(string.format("m3.accumulate.step: the %d micro-batches count no position (%s in each): there is "
      .. "no loss to take the gradient of; nothing was run", k,
      tr._cfg.head == "lm" and "every target is -1" or "every mask entry is 0"))
  end
  -- a micro-batch's loss weighs its share of the counted positions; one that counts none adds a zero
  -- gradient at any scale (the engine takes no zero scale); head "none"'s d_out is the big batch's own
  local head_none = tr._cfg.head == "none" -- the trainer's own config (tr.config is the user's to change)
  local function share(i) return counts[i] / total end
  local function scale(i) return (head_none or counts[i] == 0) and 1 or share(i) end
  local results = {}
  -- next action: forward or backward of micro-batch i; set before each call so that after
  -- an interrupt the trainer's pending forward tells whether that call took effect
  local i, action = 1, "forward"
  local function run()
    while i <= k do
      local b = batches[i]
      if action == "forward" then
        tr:forward(b)
        action = "backward"
      end
      local last = i == k
      results[i] = tr:backward_step(b, { accumulate = not last, scale = scale(i),
        clip = last and opts.clip or nil })
      i, action = i + 1, "forward"
    end
  end
  local deferred
  while i <= k do
    local ok, err = pcall(run)
    if not ok then
      if not is_interrupt(err) then error(err, 0) end
      local pending = tr:info().pending_forward
      if i == 1 and action == "forward" and not pending then error(err, 0) end -- nothing begun
      lib.C.m3_interrupt_clear()
      deferred = deferred or tostring(err)
      if action == "forward" and pending then
        action = "backward"
      elseif action == "backward" and not pending then
        results[i] = results[i] or tr:_last_metrics() -- it took effect; its metrics were not returned
        i, action = i + 1, "forward"
      end
    end
  end
  local m = results[k]
  local loss, acc, tokens, ms, counted = 0, 0, 0, 0, m.counted and 0
  for j = 1, k do
    local r, w = results[j], share(j)
    if w > 0 then -- a micro-batch that counts nothing has no loss or accuracy to weigh in
      if r.loss and loss then loss = loss + w * r.loss else loss = nil end
      if r.accuracy and acc then acc = acc + w * r.accuracy else acc = nil end
    end
    tokens, ms, counted = tokens + r.tokens, ms + r.ms, counted and counted + r.counted
  end
  m.loss, m.accuracy, m.tokens, m.ms, m.counted, m.micro = loss, acc, tokens, ms, counted, k
  if deferred then
    error(setmetatable({ message = deferred .. " (the accumulation window was closed first)",
      metrics = m }, Deferred), 0)
  end
  return m
end

-- Raises unless field v (named what) agrees with ref = {what, v}, the first field with a
-- dimension d, on that dimension (d = 1: the rows, d = 2: the length); returns the reference.
local function agree(ref, what, v, d, measure)
  if not ref then return { what = what, v = v } end
  local n, n_ref = v:shape()[d], ref.v:shape()[d]
  if n ~= n_ref then
    lib.raise(string.format("m3.accumulate.split: %s (%s) has %s, %s (%s) %d: every field needs the same %s",
      what, options.describe(v), string.format(measure, n), ref.what, options.describe(ref.v), n_ref,
      d == 1 and "rows" or "length (dimension 2)"))
  end
  return ref
end

-- The rows that every field of batch shares, once each field is an m3 tensor with the rows
-- first and all agree on the rows and on the length where they have one. Fields are checked
-- in name order, so a message names the same fields on every run.
local function batch_rows(batch)
  if type(batch) ~= "table" then
    lib.raise("m3.accumulate.split: expected a batch (a table of m3 tensors), got " .. options.describe(batch))
  end
  local names = {}
  for name in pairs(batch) do names[#names + 1] = name end
  if #names == 0 then lib.raise("m3.accumulate.split: a batch needs at least one m3 tensor field to give its shape") end
  table.sort(names, function(x, y) return tostring(x) < tostring(y) end)
  local rows, len
  for _, name in ipairs(names) do
    local v, what = batch[name], "batch." .. tostring(name)
    if not tensor.is(v) or #v:shape() == 0 then
      lib.raise(string.format("m3.accumulate.split: %s is %s: expected an m3 tensor with the rows first"
        .. " (split makes views of its rows)", what, options.describe(v)))
    end
    rows = agree(rows, what, v, 1, "%d rows")
    if #v:shape() >= 2 then len = agree(len, what, v, 2, "length %d") end
  end
  return rows.v:shape()[1]
end

-- A view of rows [r0, r0 + n) of tensor t (first dim = rows).
local function row_view(t, r0, n)
  local s = t:shape()
  local per = t:numel() / s[1]
  s[1] = n
  return tensor.view(t.data + r0 * per, s, t:dtype(), t)
end

function accumulate.split(batch, k)
  local rows = batch_rows(batch)
  if type(k) ~= "number" or k ~= math.floor(k) or k < 1 or k > rows or rows % k ~= 0 then
    lib.raise(string.format("m3.accumulate.split: k must divide the batch's %d rows, got %s", rows, options.show(k)))
  end
  local n, out = rows / k, {}
  for i = 1, k do
    local b = {}
    for name, v in pairs(batch) do b[name] = row_view(v, (i - 1) * n, n) end
    out[i] = b
  end
  return out
end

return accumulate

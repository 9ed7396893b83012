-- m3.accumulate — one optimizer step over k micro-batches (gradient accumulation).
--
--   local m = accumulate.step(tr, {b1, b2, ..., bk}, {clip = 1.0})
--
-- Runs tr:forward / tr:backward_step{accumulate = true} on b1..b(k-1) and closes the
-- window on bk (clipping applies there, to the summed gradient). Each micro-batch's loss
-- is scaled by its share of the counted positions, c_i / sum(c): for the "lm" head the
-- targets that are not -1, for "mse" with a mask the masked-in positions, otherwise all
-- rows x len positions (then the share is 1/k for equal shapes). The summed gradient is
-- then the gradient of the loss of the concatenated batch: the same update as one big
-- batch, up to float rounding.
-- Returns the closing call's metrics with loss and accuracy = those of the big batch (the
-- counted-weighted means), tokens, counted and ms summed over the micro-batches, and
-- micro = k.
--
--   accumulate.split(batch, k) -> k batches of consecutive rows (views, no copies)
--   accumulate.counted(tr, batch) -> c for one micro-batch

local tensor = require "m3.tensor"

local accumulate = {}

local function rows_len(b)
  for _, v in pairs(b) do
    if tensor.is(v) then
      local s = v:shape()
      return s[1], s[2]
    end
  end
  error("m3.accumulate: a batch needs at least one m3 tensor field to give its shape", 3)
end

function accumulate.counted(tr, b)
  local head = tr.config.head
  local field = (head == "lm" and b.targets) or (head == "mse" and b.mask) or nil
  if field then
    local n, p, c = field:numel(), field.data, 0
    if head == "lm" then
      for i = 0, n - 1 do
        if p[i] ~= -1 then c = c + 1 end
      end
    else
      for i = 0, n - 1 do
        if p[i] ~= 0 then c = c + 1 end
      end
    end
    return c
  end
  local rows, len = rows_len(b)
  return rows * len
end

function accumulate.step(tr, batches, opts)
  if type(batches) ~= "table" or #batches == 0 then
    error("m3.accumulate.step: expected a list of micro-batches", 2)
  end
  opts = opts or {}
  local k = #batches
  local counts, total = {}, 0
  for i, b in ipairs(batches) do
    counts[i] = accumulate.counted(tr, b)
    total = total + counts[i]
  end
  local loss, acc, tokens, ms, m = nil, nil, 0, 0, nil
  for i, b in ipairs(batches) do
    local share = total > 0 and counts[i] / total or 1 / k
    tr:forward(b)
    local last = i == k
    m = tr:backward_step(b, { accumulate = not last, scale = share, clip = last and opts.clip or nil })
    if m.loss then loss = (loss or 0) + share * m.loss end
    if m.accuracy then acc = (acc or 0) + share * m.accuracy end
    tokens, ms = tokens + (m.tokens or 0), ms + (m.ms or 0)
  end
  m.loss, m.accuracy, m.tokens, m.ms, m.counted, m.micro = loss, acc, tokens, ms, total, k
  return m
end

-- A view of rows [r0, r0 + n) of tensor t (first dim = rows).
local function row_view(t, r0, n)
  local s = t:shape()
  local per = t:numel() / s[1]
  s[1] = n
  return tensor.view(t.data + r0 * per, s, t:dtype(), t)
end

function accumulate.split(batch, k)
  local rows = rows_len(batch)
  if type(k) ~= "number" or k < 1 or k > rows or rows % k ~= 0 then
    error(string.format("m3.accumulate.split: k must divide the batch's %d rows, got %s", rows, tostring(k)), 2)
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

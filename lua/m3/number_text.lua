-- m3.number_text — the exact text of a number, shared by every writer whose numbers must
-- read back as the same double: m3.json, m3.serialize (a checkpoint's extra), safetensors
-- metadata (m3.save_tensors), m3.sweep's folder names, m3.flags' bounds in its messages,
-- m3.log.plural's counts and m3.rundir's check of the numbers options.json holds.
--
-- exact(v): -0 as "-0", integers below 2^53 in plain digits, other numbers with the fewest
-- significant digits from 15 to 17 that read back as v (from 15: a double that fewer digits
-- name prints the same with 15, %g dropping the trailing zeros). Non-finite numbers come out
-- as %.17g writes them ("inf", "-inf", "nan"); writers with a form of their own for them (JSON
-- null, m3.serialize's 1/0) handle them first.
-- shown(v): a value as m3.tensor's and m3.config's messages show it: text quoted (%q, so "2" is
-- not mistaken for 2), numbers exact (3.0000000000000004 is no integer), anything else tostring.

local number_text = {}

function number_text.exact(v)
  if v == 0 and 1 / v < 0 then return "-0" end
  if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return string.format("%d", v) end
  for digits = 15, 16 do
    local s = string.format("%." .. digits .. "g", v)
    if tonumber(s) == v then return s end
  end
  return string.format("%.17g", v)
end

function number_text.shown(v)
  if type(v) == "string" then return string.format("%q", v) end
  return type(v) == "number" and number_text.exact(v) or tostring(v)
end

return number_text

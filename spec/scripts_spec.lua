-- The shipped scripts as programs (build/m3lua, see helper.m3lua): bad flags and settings stop
-- them before any work with exit status 2, and a failure while they run gives a non-zero one.
-- Also m3.flags' list flags, which the scripts use for their comma-separated values.

local flags = require "m3.flags"
local helper = require "spec.helper"

describe("m3.flags", function()
  it("checks every item of a list flag", function()
    local spec = {
      { "widths", "64", "", list = true, int = true, min = 1 },
      { "rates", "1e-3", "", list = true, min = 1e-9 },
      { "tasks", "a,b", "", list = true, choices = { "a", "b" } },
    }
    local o = flags.values({ "--widths", "32,64", "--rates=1e-3,3e-3", "--tasks", "b" }, spec)
    assert.same({ widths = "32,64", rates = "1e-3,3e-3", tasks = "b" }, o)
    local function err(...) return helper.error_of(flags.values, { ... }, spec) end
    assert.equal('--widths expects a comma-separated list of integers >= 1, got "32,0"', err("--widths", "32,0"))
    assert.equal('--widths expects a comma-separated list of integers >= 1, got "1.5"', err("--widths", "1.5"))
    assert.equal('--widths expects a comma-separated list of integers >= 1, got ""', err("--widths="))
    assert.equal('--rates expects a comma-separated list of numbers >= 1e-09, got "-1"', err("--rates", "-1"))
    assert.equal('--tasks expects a comma-separated list of a | b, got "a,A"', err("--tasks", "a,A"))
  end)
end)

-- m3.json: UTF-8 only in and out (RFC 8259 §8.1: malformed bytes refused with their position,
-- valid 2/3/4-byte characters kept), a key given twice in one object refused, a byte order mark
-- passed over at the very start only. Round trips, numbers and nesting: spec/log_spec.lua.

local json = require "m3.json"
local fs = require "m3.fs"
local helper = require "spec.helper"

local error_of = helper.error_of

-- Asserts that decoding text fails with the substrings of `wants` (plain text) in the message.
local function refused(text, ...)
  local err = error_of(json.decode, text)
  for _, want in ipairs { ... } do
    assert(err:find(want, 1, true), string.format("expected %q in the error, got %q", want, err))
  end
  return err
end

describe("m3.json.decode UTF-8", function()
  it("keeps valid 2-, 3- and 4-byte characters, U+10FFFF and escaped surrogate pairs", function()
    assert.equal("é", json.decode('"\195\169"'))                       -- U+00E9
    assert.equal("\223\191", json.decode('"\223\191"'))                -- U+07FF, the last 2-byte one
    assert.equal("€ \224\160\128 \239\191\191", json.decode('"€ \224\160\128 \239\191\191"')) -- U+20AC, U+0800, U+FFFF
    assert.equal("\237\159\191 \238\128\128", json.decode('"\237\159\191 \238\128\128"'))     -- U+D7FF, U+E000
    assert.equal("😀", json.decode('"\240\159\152\128"'))               -- U+1F600
    assert.equal("\240\144\128\128", json.decode('"\240\144\128\128"')) -- U+10000
    assert.equal("\244\143\191\191", json.decode('"\244\143\191\191"')) -- U+10FFFF
    assert.equal("😀", json.decode('"\\uD83D\\uDE00"'))
    assert.equal("\244\143\191\191", json.decode('"\\udbff\\udfff"'))
    assert.same({ ["clé"] = "狐狸" }, json.decode('{"clé": "狐狸"}'))
  end)

  it("refuses a continuation byte without a lead byte, naming its position", function()
    for _, b in ipairs { 0x80, 0x9F, 0xBF } do
      refused('"ab' .. string.char(b) .. '"', string.format("expected UTF-8, found a continuation byte 0x%02x without "
        .. "a lead byte before it at position 4", b))
    end
    refused('"\195\169\169"', "continuation byte 0xa9 without a lead byte before it at position 4")
    refused('{"k": [1, "\128"]}', "at position 12 (near \"\\128\\\"]}\")")
  end)

  it("refuses bytes never used in UTF-8 (0xC0, 0xC1, 0xF5 to 0xFF)", function()
    for _, b in ipairs { 0xC0, 0xC1, 0xF5, 0xF8, 0xFE, 0xFF } do
      refused('"' .. string.char(b, 0x80, 0x80, 0x80) .. '"', string.format("byte 0x%02x, never used in UTF-8", b),
        "at position 2")
    end
    refused('"\192\175"', "0xc0, never used in UTF-8 (it only starts overlong forms) at position 2") -- overlong "/"
  end)

  it("refuses sequences cut short, at the end of the text too", function()
    refused('"\195"', "a 2-byte sequence (lead byte 0xc3) cut short after 1 byte at position 2")
    refused('"\226\130"', "a 3-byte sequence (lead byte 0xe2) cut short after 2 bytes at position 2")
    refused('"\240\159\152"', "a 4-byte sequence (lead byte 0xf0) cut short after 3 bytes at position 2")
    refused('"x\240\159\152x"', "cut short after 3 bytes at position 3")
    refused('"\226"', "cut short after 1 byte at position 2")
    refused("\226\130", "cut short after 2 bytes at position 1")
  end)

  it("refuses overlong forms, surrogates encoded as UTF-8 and code points past U+10FFFF", function()
    refused('"\224\128\128"', "an overlong form (a shorter sequence exists): 0xe0 0x80 at position 2")
    refused('"\224\159\191"', "overlong form", "0xe0 0x9f")
    refused('"\240\128\128\128"', "overlong form", "0xf0 0x80")
    refused('"\240\143\191\191"', "overlong form", "0xf0 0x8f")
    refused('"\237\160\128"', "a surrogate (U+D800 to U+DFFF) encoded as UTF-8: 0xed 0xa0 at position 2")
    refused('"\237\191\191"', "a surrogate", "0xed 0xbf")
    refused('"\237\160\189\237\184\128"', "a surrogate") -- U+1F600 as CESU-8
    refused('"\244\144\128\128"', "a code point past U+10FFFF: 0xf4 0x90 at position 2")
    refused('"\244\191\191\191"', "past U+10FFFF")
  end)

  it("refuses bytes past ASCII outside strings as UTF-8 first, and keeps the other errors", function()
    refused("[1, \255]", "expected UTF-8, found byte 0xff, never used in UTF-8 at position 5")
    refused("[1, é]", "expected a JSON value at position 5")
  end)

  it("json.read names the file and the position", function()
    local dir = helper.tmpdir()
    fs.write(dir .. "/bad.json", '{"name": "caf\233"}')
    local v, err, why = json.read(dir .. "/bad.json")
    assert.is_nil(v)
    assert.equal("invalid", why)
    assert.truthy(err:find(dir .. "/bad.json: json.decode: expected UTF-8, found a 3-byte sequence (lead byte 0xe9) "
      .. "cut short after 1 byte at position 14", 1, true), err)
    os.execute("rm -rf " .. helper.quote(dir))
  end)
end)

describe("m3.json.utf8_error", function()
  it("says where a string stops being UTF-8, nil when it is", function()
    assert.is_nil(json.utf8_error(""))
    assert.is_nil(json.utf8_error("plain ASCII"))
    assert.is_nil(json.utf8_error("é € 😀 \244\143\191\191"))
    local at, why = json.utf8_error("ab\255")
    assert.equal(3, at)
    assert.equal("byte 0xff, never used in UTF-8", why)
    assert.equal(2, (json.utf8_error("a\237\160\128")))
  end)
end)

describe("m3.json duplicate keys", function()
  it("refuses a key given twice, naming it and where", function()
    refused('{"a": 1, "b": 2, "a": 3}', 'a key given twice: "a" (the object at position 1 has it already) at position 18')
    refused('{"a": null, "a": null}', 'a key given twice: "a"')
    refused('{"a": false, "a": false}', 'a key given twice: "a"')
  end)

  it("refuses one in a nested object, and allows one name in different objects", function()
    refused('{"x": [{"k": 1}, {"k": 2, "k": 3}]}', 'a key given twice: "k" (the object at position 18 has it already) '
      .. "at position 27")
    assert.same({ a = { a = 1 }, b = { a = 2 } }, json.decode('{"a": {"a": 1}, "b": {"a": 2}}'))
  end)

  it("refuses the same key written with other escapes", function()
    refused('{"a": 1, "\\u0061": 2}', 'a key given twice: "a"', "at position 10")
    refused('{"é": 1, "\\u00e9": 2}', 'a key given twice: "é"')
    refused('{"a/b": 1, "a\\/b": 2}', 'a key given twice: "a/b"')
    refused('{"😀": 1, "\\ud83d\\ude00": 2}', "a key given twice")
  end)
end)

describe("m3.json byte order mark", function()
  local BOM = "\239\187\191"

  it("is passed over at the very start of the text, and of a file json.read reads", function()
    assert.same({ a = 1 }, json.decode(BOM .. '{"a": 1}'))
    assert.same({ 1, 2 }, json.decode(BOM .. " [1, 2] "))
    assert.equal("x", json.decode(BOM .. '"x"'))
    local dir = helper.tmpdir()
    fs.write(dir .. "/bom.json", BOM .. '{"steps": 4}\r\n')
    assert.same({ steps = 4 }, json.read(dir .. "/bom.json"))
    os.execute("rm -rf " .. helper.quote(dir))
  end)

  it("is refused anywhere else, and kept as a character inside a string", function()
    refused(" " .. BOM .. "[1]", "expected a JSON value at position 2")
    refused(BOM .. BOM .. "[1]", "expected a JSON value at position 4")
    refused("[1, " .. BOM .. "2]", "expected a JSON value at position 5")
    refused('{"a": 1}' .. BOM, "expected the end of the input at position 9")
    refused(BOM, "expected a JSON value at position 4")
    assert.equal(BOM .. "x", json.decode('"' .. BOM .. 'x"'))
  end)

  it("is never written", function()
    assert.equal('{"a":1}', json.encode { a = 1 })
    assert.equal('"\239\187\191"', json.encode(BOM)) -- a string that holds U+FEFF keeps it
  end)
end)

describe("m3.json.encode UTF-8", function()
  it("writes UTF-8 strings and keys as they are", function()
    assert.equal('{"clé":["狐狸","😀","\244\143\191\191"]}', json.encode { ["clé"] = { "狐狸", "😀", "\244\143\191\191" } })
    assert.same({ ["clé"] = "狐狸 😀" }, json.decode(json.encode { ["clé"] = "狐狸 😀" }))
  end)

  it("refuses a string that is not UTF-8, naming where it is, its byte and why", function()
    assert.equal("json.encode: cannot encode the string at .options.prompt: not UTF-8 at its byte 4 (near "
      .. '"\\233 au lait": a 3-byte sequence (lead byte 0xe9) cut short after 1 byte), which a JSON text must be '
      .. "(RFC 8259 §8.1)", error_of(json.encode, { options = { prompt = "caf\233 au lait" } }))
    assert.matches("cannot encode the string at %.a%[2%]: not UTF%-8 at its byte 2 .*byte 0xff, never used in UTF%-8",
      error_of(json.encode, { a = { "ok", "x\255" } }))
    assert.matches('cannot encode the string at %["my key"%]%[2%.5%]: .*0xc0, never used',
      error_of(json.encode, { ["my key"] = { [2.5] = "\192\175" } }))
    assert.matches("cannot encode the string at the top level: .*a surrogate %(U%+D800 to U%+DFFF%) encoded as UTF%-8",
      error_of(json.encode, "\237\160\128"))
    assert.matches("cannot encode the string at %[3%]: .*overlong form", error_of(json.encode, { 1, 2, "\224\128\128" }))
    assert.matches("past U%+10FFFF", error_of(json.encode, { "\244\144\128\128" }))
    assert.matches("continuation byte 0x80 without a lead byte", error_of(json.encode, { "\128" }))
  end)

  it("refuses a key that is not UTF-8, naming the object it is in", function()
    assert.matches('^json%.encode: cannot encode the key at %.run%["k\\255"%]: not UTF%-8 at its byte 2 %(near "\\255"',
      error_of(json.encode, { run = { ["k\255"] = 1 } }))
  end)

  it("writes nothing for a text that held such a string (json.write leaves the file as it was)", function()
    local dir = helper.tmpdir()
    fs.write(dir .. "/o.json", '{"old":1}\n')
    assert.matches("cannot encode the string at %.name", error_of(json.write, dir .. "/o.json", { name = "\255" }))
    assert.equal('{"old":1}\n', fs.read(dir .. "/o.json"))
    os.execute("rm -rf " .. helper.quote(dir))
  end)
end)

describe("m3.json edges", function()
  it("writes NaN and both infinities as null", function()
    assert.equal("[null,null,null]", json.encode { 0 / 0, 1 / 0, -1 / 0 })
    assert.equal('{"x":null}', json.encode { x = -1 / 0 })
  end)

  it("decodes \\u escapes at the edges of the 1-, 2-, 3- and 4-byte UTF-8 forms (RFC 3629)", function()
    assert.equal("\127", json.decode('"\\u007f"'))                 -- U+007F: 7F
    assert.equal("\194\128", json.decode('"\\u0080"'))             -- U+0080: C2 80
    assert.equal("\223\191", json.decode('"\\u07ff"'))             -- U+07FF: DF BF
    assert.equal("\224\160\128", json.decode('"\\u0800"'))         -- U+0800: E0 A0 80
    assert.equal("\237\159\191", json.decode('"\\ud7ff"'))         -- U+D7FF: ED 9F BF
    assert.equal("\238\128\128", json.decode('"\\ue000"'))         -- U+E000: EE 80 80
    assert.equal("\239\191\191", json.decode('"\\uffff"'))         -- U+FFFF: EF BF BF
    assert.equal("\240\144\128\128", json.decode('"\\ud800\\udc00"')) -- U+10000: F0 90 80 80
  end)

  it("refuses a high surrogate followed by an escape just past the low ones", function()
    refused('"\\ud800\\ue000"', "a high surrogate \\ud800 without a low one (\\udc00 to \\udfff) after it at position 2")
    refused('"\\udbff\\udbff"', "a high surrogate \\udbff without a low one")
  end)

  it("refuses the last control character raw in a string, and anything after the value", function()
    refused('"\31"', "expected an escape (\\u001f) for the control character 31 in a string at position 2")
    refused("[1]x", "expected the end of the input at position 4")
    refused("1 2", "expected the end of the input at position 3")
  end)

  it("escapes backslashes and control characters in what it writes", function()
    assert.equal('"a\\\\b\\"c\\u001f\\n"', json.encode('a\\b"c\31\n'))
    assert.equal('{"\\\\":"\\\\\\\\"}', json.encode { ["\\"] = "\\\\" })
    assert.equal('a\\b', json.decode(json.encode('a\\b')))
  end)

  it("refuses a table that contains itself, and writes one table met twice twice", function()
    local t = { 1 }
    t[2] = t
    assert.equal("json.encode: cannot encode a table that contains itself", error_of(json.encode, t))
    local s = { 1 }
    assert.equal('{"a":[1],"b":[1],"c":[[1],[1]]}', json.encode { a = s, b = s, c = { s, s } })
  end)

  it("names a key that is not an identifier in brackets where it shows a path", function()
    assert.matches('cannot encode the string at %["2x"%]%.y:', error_of(json.encode, { ["2x"] = { y = "\255" } }))
  end)
end)

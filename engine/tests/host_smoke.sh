#!/bin/sh
# host_smoke.sh — a quick check of the m3lua host outside busted (plain luajit semantics,
# no memoized ffi.cdef): options, libm3 and libedit linked into the process, the module
# path from another directory (generated files in the build tree, sources in the source
# tree), a piped REPL session and exit codes.
# usage: host_smoke.sh path/to/m3lua
set -eu
case $1 in
  /*) M3LUA=$1 ;;
  *) M3LUA=$(pwd)/$1 ;;
esac
cd "${TMPDIR:-/tmp}"

fail() {
  echo "host_smoke: $*" >&2
  exit 1
}

"$M3LUA" --version | grep -q '^m3lua .*LuaJIT' || fail "--version"
[ "$("$M3LUA" -e 'io.write(1 + 1)')" = 2 ] || fail "-e"
[ "$(printf 'io.write(select("#", ...), ...)' | "$M3LUA" - a b)" = 2ab ] || fail "script from stdin"
"$M3LUA" -e '
  local ffi = require "ffi"
  ffi.cdef "int32_t m3_abi_version(void); char *readline(const char *prompt);"
  assert(ffi.C.m3_abi_version() > 0, "libm3 is not in the process")
  assert(ffi.C.readline ~= nil, "libedit is not in the process")
  assert(require "m3.cdef", "no generated module from the build tree")
  assert(require "m3.repl", "no module from the source tree")
  assert(package.loaded["m3.host"].name == "m3lua", "no m3.host")
' || fail "libraries in-process or module path"
out=$(printf '1+1\nerror("x")\nprint("ok")\n' | M3LUA_HISTORY= "$M3LUA" -i 2>/dev/null)
[ "$out" = "$(printf '2\nok')" ] || fail "piped REPL session printed: $out"
rc=0
"$M3LUA" -e 'os.exit(3)' || rc=$?
[ "$rc" = 3 ] || fail "os.exit(3) gave $rc"
rc=0
"$M3LUA" -e 'error("expected error")' 2>/dev/null || rc=$?
[ "$rc" = 1 ] || fail "an error gave $rc"
echo "host_smoke: ok"

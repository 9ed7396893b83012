#!/usr/bin/env bash
# scripts/test.sh — every test: sets up and builds (scripts/setup.sh), then runs the C tests
# (meson test), the busted specs under LuaJIT, and a plain-luajit smoke test of the loader,
# and ends with one line "N passed, N failed, N skipped". GPU tests skip on a machine
# without a GPU (exit code 77 in C, the #gpu tag in busted). Exit status 1 on any failure; a
# set-up or build that fails counts as one failure. The specs get the build folder ($BUILD_DIR,
# default build) as BUILD_DIR and its m3lua as M3LUA.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if ! source "$root/scripts/setup.sh"; then
  echo "0 passed, 1 failed"
  exit 1
fi
export BUILD_DIR=$build M3LUA=$build/m3lua
log=$(mktemp -d)
trap 'rm -rf "$log"' EXIT
passed=0 failed=0 skipped=0

count() { # count <name> <passed> <failed> <skipped>
  passed=$((passed + $2)) failed=$((failed + $3)) skipped=$((skipped + $4))
  echo "== $1: $2 passed, $3 failed, $4 skipped"
}

echo "== C tests (meson test)"
meson test -C "$build" --print-errorlogs 2>&1 | tee "$log/meson"
field() { awk -v k="$1" '$1 == k":" { print $2; exit }' "$log/meson"; }
m_ok=$(field Ok) m_fail=$(field Fail) m_skip=$(field Skipped) m_timeout=$(field Timeout)
if [ -z "$m_ok" ]; then
  count "C tests" 0 1 0
else
  count "C tests" "$m_ok" $((m_fail + ${m_timeout:-0})) "$m_skip"
fi

echo "== Lua specs (busted)"
(cd "$root" && busted --lua=luajit spec) 2>&1 | tee "$log/busted"
summary=$(grep -aE '[0-9]+ success(es)? / [0-9]+ failures? / [0-9]+ errors? / [0-9]+ pending' "$log/busted" | tail -1)
if [ -z "$summary" ]; then
  count "Lua specs" 0 1 0
else
  read -r ok _ _ fail _ _ err _ _ pend _ <<<"$summary"
  count "Lua specs" "$ok" $((fail + err)) "$pend"
fi

echo "== plain luajit smoke test"
if (cd "$root" && luajit spec/smoke.lua); then count "smoke" 1 0 0; else count "smoke" 0 1 0; fi

echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]

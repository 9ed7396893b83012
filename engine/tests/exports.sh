#!/bin/sh
# exports.sh — libm3's dynamic symbol table is its API: every function engine/include/m3.h
# declares is exported (the FFI binds them by name), and nothing without the m3_ prefix is
# (the CPU model's and kernels' helpers stay local: engine/src/libm3.map).
# usage: exports.sh path/to/libm3.so path/to/m3.h
set -eu
exported=$(nm -D --defined-only "$1" | awk '{ print $3 }' | sed 's/@.*//' | sort -u)
stray=$(printf '%s\n' "$exported" | grep -v '^m3_' || true)
if [ -n "$stray" ]; then
  echo "exports: $1 exports names without the m3_ prefix:" $stray >&2
  exit 1
fi
declared=$(grep -vE '^[[:space:]]*(/\*|\*)' "$2" | grep -oE '\bm3_[a-z0-9_]+\(' | tr -d '(' | sort -u)
missing=$(printf '%s\n' "$declared" | grep -vxF "$exported" || true)
if [ -n "$missing" ]; then
  echo "exports: $1 does not export functions m3.h declares:" $missing >&2
  exit 1
fi
echo "exports: $(printf '%s\n' "$declared" | wc -l) functions of m3.h exported, nothing unprefixed"

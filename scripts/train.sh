#!/usr/bin/env bash
# scripts/train.sh — the main job: sets up and builds (scripts/setup.sh), then runs
# scripts/train.lua with m3lua, on the GPU when there is one, else on the CPU. Arguments
# go to train.lua (`scripts/train.sh --help` lists them).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/setup.sh" || exit 1
exec "$build/m3lua" "$root/scripts/train.lua" "$@"

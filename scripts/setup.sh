#!/usr/bin/env bash
# scripts/setup.sh — makes this checkout ready to run: installs the Debian packages m3lua
# needs when any is missing (apt-get, as root or through sudo), puts CUDA's nvcc on PATH
# when the toolkit is installed (the CUDA backend is then built too), configures the meson
# build folder and builds it. Idempotent; sourced by scripts/train.sh and scripts/test.sh.
# BUILD_DIR (default: build) names the build folder.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-build}
packages=(gcc g++ pkg-config meson ninja-build luajit libluajit-5.1-dev libopenblas-dev libcjson-dev
          libedit-dev lua-busted)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  if [ "$(id -u)" -eq 0 ]; then sudo=(); elif command -v sudo >/dev/null; then sudo=(sudo); else
    echo "setup: missing packages (${missing[*]}) and neither root nor sudo: install them, then rerun" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

cd "$root"
if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" --buildtype=release >/dev/null || meson setup "$build" --buildtype=release
fi
ninja -C "$build" >/dev/null || ninja -C "$build"

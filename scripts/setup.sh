#!/usr/bin/env bash
# scripts/setup.sh — makes this checkout ready to run: installs the Debian packages of the
# tools and libraries m3lua needs that are missing (apt-get, as root or through sudo), puts
# CUDA's nvcc on PATH when the toolkit is installed (the CUDA backend is then built too),
# configures the meson build folder (afresh when it was made for another checkout; again when
# nvcc appeared since) and builds it; says whether the CUDA backend is built. Idempotent;
# sourced by scripts/train.sh and scripts/test.sh: returns 1 after saying what failed, and
# leaves $root and $build (the build folder's absolute path) set and the current folder as it
# was. BUILD_DIR (default: build, relative to the checkout) names the build folder; meson's
# and ninja's output go to $build/setup.log. Run as a program, it does the same and exits
# with that status.
set -uo pipefail
(return 0 2>/dev/null) || { source "${BASH_SOURCE[0]}"; exit; }

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-build}
[[ $build == /* ]] || build=$root/$build
setup_log=$build/setup.log

# the Debian package of each command, then of each pkg-config module, that the build needs
missing=()
for c in gcc g++ pkg-config meson ninja=ninja-build luajit busted=lua-busted; do
  command -v "${c%%=*}" >/dev/null || missing+=("${c#*=}")
done
for m in luajit=libluajit-5.1-dev openblas=libopenblas-dev libcjson=libcjson-dev libedit=libedit-dev; do
  pkg-config --exists "${m%%=*}" 2>/dev/null || missing+=("${m#*=}")
done
if ((${#missing[@]})); then
  if [ "$(id -u)" -eq 0 ]; then sudo=(); elif command -v sudo >/dev/null; then sudo=(sudo); else
    echo "setup: missing packages (${missing[*]}) and neither root nor sudo: install them, then rerun" >&2
    return 1
  fi
  if ! command -v apt-get >/dev/null; then
    echo "setup: missing packages (${missing[*]}) and no apt-get to install them: install them, then rerun" >&2
    return 1
  fi
  echo "setup: installing ${missing[*]}"
  if ! "${sudo[@]}" apt-get update -qq ||
     ! "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
       "${missing[@]}" >/dev/null; then
    echo "setup: apt-get could not install ${missing[*]} (its errors are above): install them, then rerun" >&2
    return 1
  fi
fi

if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

# step <what> <command...>: runs the command with its output added to $setup_log; on failure prints
# the output's last lines and what failed, and returns 1
step() {
  local what=$1 out rc
  shift
  out=$("$@" 2>&1)
  rc=$?
  mkdir -p "$build" && printf '%s\n' "$out" >>"$setup_log"
  ((rc == 0)) && return 0
  printf '%s\n' "$out" | tail -n 40 >&2
  echo "setup: $what failed (exit status $rc); the whole output is in $setup_log" >&2
  return 1
}

# what meson recorded in the build folder, a line each: the source folder, the gpu option,
# whether it found nvcc (the cuda compiler's options exist), whether the CUDA backend is built
recorded() {
  python3 - "$build/meson-info" <<'EOF'
import json, sys
info = sys.argv[1]
source = json.load(open(info + "/meson-info.json"))["directories"]["source"]
options = {o["name"]: o["value"] for o in json.load(open(info + "/intro-buildoptions.json"))}
deps = {d["name"] for d in json.load(open(info + "/intro-dependencies.json"))}
print(source, options.get("gpu"), "cuda_std" in options, "cuda" in deps, sep="\n")
EOF
}

rm -f "$setup_log"
configure=()
if [ ! -f "$build/meson-private/coredata.dat" ]; then
  configure=(--buildtype=release)
elif ! rec=$(recorded 2>/dev/null); then
  echo "setup: $build holds a build meson cannot describe: configuring it afresh"
  configure=(--wipe)
else
  { IFS= read -r src; read -r gpu; read -r nvcc_seen; } <<<"$rec"
  if [ "$(realpath -m "$src")" != "$(realpath "$root")" ]; then
    echo "setup: $build was configured for $src, not this checkout: configuring it afresh"
    configure=(--wipe)
  elif command -v nvcc >/dev/null && [ "$gpu" != disabled ] && [ "$nvcc_seen" = False ]; then
    echo "setup: nvcc is on PATH now but $build was configured without it: reconfiguring for the CUDA backend"
    configure=(--reconfigure)
  elif [ ! -f "$build/build.ninja" ]; then
    configure=(--reconfigure)
  fi
fi
if ((${#configure[@]})); then
  step "configuring $build (meson setup)" meson setup "${configure[@]}" "$build" "$root" || return 1
fi
if ! rec=$(recorded); then
  echo "setup: cannot read what meson recorded in $build/meson-info" >&2
  return 1
fi
{ read -r _; read -r gpu; read -r nvcc_seen; read -r cuda; } <<<"$rec"
if [ "$cuda" = True ]; then
  echo "setup: CUDA backend: built"
elif [ "$gpu" = disabled ]; then
  echo "setup: CUDA backend: not built (gpu=disabled in $build); m3lua runs on the CPU"
elif [ "$nvcc_seen" = True ]; then
  echo "setup: CUDA backend: not built (nvcc found, but not CUDA >= 12 with cudart and cuBLAS: see" \
    "$build/meson-logs/meson-log.txt); m3lua runs on the CPU"
else
  echo "setup: CUDA backend: not built (no nvcc on PATH or in /usr/local/cuda/bin); m3lua runs on the CPU"
fi
if [[ $(ninja -C "$build" -n 2>&1) != *"no work to do"* ]]; then
  echo "setup: building $build (a first build takes a few minutes)..."
fi
step "building $build (ninja)" ninja -C "$build" || return 1

#!/usr/bin/env bash
# scripts/gpu_check.sh — the one-call recipe for the lent GPU machine (run there from the
# repository root, with .gpu/ carried: ../shared/device copied in, plus .gpu/shared/golden):
#
#   bash scripts/gpu_check.sh [stages]     stages: comma list of setup,build,test,spec,sanitize,bench,
#                                          profile,ncu (default: all but sanitize and ncu; sanitize
#                                          runs anyway when a CUDA test fails)
#
# Full logs go to $OUT (at most 8 files come back); the last lines printed are a short summary:
# test results, the first failing checks, the parity/golden lines and the benchmark table.
# BENCH_ARGS passes arguments to scripts/bench.lua; NCU_SPECS lists kernel:config:launches-to-skip
# for the ncu stage (per-source-line stall samples come back in ncu_source.tgz).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
OUT=${OUT:-/tmp/m3_gpu_out}
mkdir -p "$OUT"
stages=${1:-setup,build,test,spec,bench,profile}
has() { [[ ",$stages," == *",$1,"* ]]; }
export M3_SHARED=$root/.gpu/shared
export PATH=/usr/local/cuda/bin:$PATH
build=build-gpu
summary=$OUT/summary.txt
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
stamp() { date +%s; }
T0=$(stamp)

if has setup; then
  bash .gpu/setup.sh >"$OUT/setup_build.log" 2>&1 || { tail -20 "$OUT/setup_build.log"; exit 1; }
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total --format=csv \
    >>"$OUT/setup_build.log" 2>&1
  say "setup: $(tail -1 "$OUT/setup_build.log")  [$(($(stamp) - T0)) s]"
fi

if has build; then
  t=$(stamp)
  if ! { [ -f $build/build.ninja ] || meson setup $build --buildtype=release; } >>"$OUT/setup_build.log" 2>&1 ||
     ! ninja -C $build >>"$OUT/setup_build.log" 2>&1; then
    grep -E "error|Error|FAILED" "$OUT/setup_build.log" | head -40
    say "build: FAILED"
    exit 1
  fi
  say "build: ok [$(($(stamp) - t)) s]"
fi

cuda_failed=0
if has test; then
  t=$(stamp)
  timeout 400 meson test -C $build --print-errorlogs --num-processes 4 >"$OUT/tests.log" 2>&1
  cp $build/meson-logs/testlog.txt "$OUT/testlog.txt" 2>/dev/null
  say "meson test [$(($(stamp) - t)) s]: $(grep -E '^(Ok|Fail|Skipped|Timeout):' "$OUT/tests.log" | tr -s ' ' | tr '\n' ' ')"
  grep -E "^ *[0-9]+/[0-9]+ " "$OUT/tests.log" | grep -v " OK " | tee -a "$summary"
  if grep -qE "cuda_(parity|golden) +(FAIL|TIMEOUT)" "$OUT/tests.log"; then cuda_failed=1; fi
  for t_ in cuda_golden cuda_parity; do
    exe=$build/engine/tests/test_$t_
    [ -x "$exe" ] || continue
    # the per-case lines and the first failing checks of each GPU test
    awk -v name="$t_" '
      /^=+ [0-9]+\/[0-9]+ =+$/ { inside = 0; next }
      /^test: / { inside = ($2 == name); nfail = 0; next }
      inside && (/: out / || /self checks/ || /f16 overflow/ || /limits:/ || /checks, .* failed/) { print; next }
      inside && /^FAIL/ && nfail++ < 25 { print }' "$OUT/testlog.txt" | tee -a "$summary"
  done
fi

if has spec; then
  t=$(stamp)
  {
    echo "== busted -t gpu (f32)"
    M3_TEST_DEVICE=cuda M3_TEST_DTYPE=f32 M3LUA=$build/m3lua LUA_PATH="$build/lua/?.lua;;" timeout 90 busted \
      --lua=luajit -t gpu spec/
    for dt in bf16 f16; do
      echo "== busted golden_spec ($dt)"
      M3_TEST_DEVICE=cuda M3_TEST_DTYPE=$dt LUA_PATH="$build/lua/?.lua;;" timeout 40 busted --lua=luajit -t gpu \
        spec/golden_spec.lua
    done
  } >"$OUT/busted.log" 2>&1
  say "busted [$(($(stamp) - t)) s]: $(grep -aE '[0-9]+ success' "$OUT/busted.log" | tr '\n' ' ')"
  grep -aE "^(Failure|Error) ->" -A 3 "$OUT/busted.log" | head -30 | tee -a "$summary"
fi

if has sanitize || [ $cuda_failed = 1 ]; then
  t=$(stamp)
  timeout 90 compute-sanitizer --tool memcheck --print-limit 20 $build/engine/tests/test_cuda_golden \
    >"$OUT/sanitizer.log" 2>&1
  say "memcheck (test_cuda_golden) [$(($(stamp) - t)) s]: $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1)"
  grep -E "Invalid|out of bounds|at 0x|by thread|Address" "$OUT/sanitizer.log" | head -16 | tee -a "$summary"
  t=$(stamp) # shared-memory hazards, warnings included (an intra-warp one needs a __syncwarp)
  timeout 90 compute-sanitizer --tool racecheck --print-limit 20 $build/engine/tests/test_cuda_golden \
    >"$OUT/racecheck.log" 2>&1
  say "racecheck (test_cuda_golden) [$(($(stamp) - t)) s]: $(grep -E 'RACECHECK SUMMARY' "$OUT/racecheck.log" | tail -1)"
  grep -oE "Race reported between .* in [a-z_]+\.cu:[0-9]+" "$OUT/racecheck.log" | sort | uniq -c | head -8 | tee -a "$summary"
fi

if has bench; then
  t=$(stamp)
  timeout 150 $build/m3lua scripts/bench.lua ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
  say "bench [$(($(stamp) - t)) s]:"
  sed -n '/^config /,$p' "$OUT/bench.log" | tee -a "$summary"
  grep -E "FAILED" "$OUT/bench.log" | head -5 | tee -a "$summary"
fi
if has profile; then
  t=$(stamp)
  timeout 120 $build/m3lua scripts/bench.lua --profile --steps 3 --dtypes bf16 \
    --configs ${PROFILE_CONFIGS:-rl,rl-batch,mid,lm130} >"$OUT/profile.log" 2>&1
  say "profile (eager, bf16) [$(($(stamp) - t)) s]:"
  grep -E "^== |  profile: |^  [a-z_ ()+]+ +[0-9.]+ ms/step +[0-9.]+%" "$OUT/profile.log" | tee -a "$summary"
fi
if has ncu; then # counters and per-source-line stall samples of one chunked-scan launch each (after warm-up)
  t=$(stamp)
  : >"$OUT/ncu.log"
  mkdir -p "$OUT/ncu"
  specs=${NCU_SPECS:-scan_fwd_chunked_r:lm130:24 scan_bwd_chunked:lm130:24 scan_bwd_chunked:mid:8}
  for spec in $specs; do
    IFS=: read -r kern cfg skip <<<"$spec"
    rep=$OUT/ncu/${kern}_$cfg
    echo "######## $kern on $cfg" >>"$OUT/ncu.log"
    timeout 150 ncu --clock-control none -k "regex:$kern" --launch-skip "$skip" --launch-count 1 --set full \
      --import-source yes -f -o "$rep" $build/m3lua scripts/bench.lua --configs "$cfg" --dtypes bf16 --steps 1 \
      --no_graph >>"$OUT/ncu.log" 2>&1
    ncu --import "$rep.ncu-rep" --page details >>"$OUT/ncu.log" 2>&1
    ncu --import "$rep.ncu-rep" --page source --csv --print-source cuda >"$rep.cuda.csv" 2>>"$OUT/ncu.log"
    ncu --import "$rep.ncu-rep" --page source --csv --print-source sass >"$rep.sass.csv" 2>>"$OUT/ncu.log"
    rm -f "$rep.ncu-rep"
  done
  tar czf "$OUT/ncu_source.tgz" -C "$OUT" ncu && rm -rf "$OUT/ncu"
  say "ncu [$(($(stamp) - t)) s]:"
  grep -E "^######## |Duration|Elapsed Cycles|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issued Ipc|No Eligible|Warp Cycles Per Issued|Eligible Warps|Executed Instructions  |Waves Per SM|Dynamic Shared" \
    "$OUT/ncu.log" | sed -E 's/ +/ /g' | head -80 | tee -a "$summary"
fi
say "total $(($(stamp) - T0)) s"

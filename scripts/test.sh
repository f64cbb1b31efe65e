#!/usr/bin/env bash
# The whole test suite: install what is missing, build, run every doctest suite under meson test.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each phase prints its wall time, so a slow CI run says where its minutes went.
t0=$SECONDS
took() { echo "test.sh: $1 took $((SECONDS - t0)) s"; t0=$SECONDS; }
scripts/deps.sh
took "installing what is missing"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The benchmarks compile here at -O0 (they say so when run): a third of their -O3 time.
[[ -f build/build.ninja ]] || meson setup build --wrap-mode=nodownload -Dbench_optimization=0
ninja -C build
took "the build"
meson test -C build --no-rebuild --print-errorlogs --num-processes 2 "$@"
took "meson test"
# A bounded ASan+UBSan pass over the network-facing code (scripts/asan_quick.sh, about 4 minutes
# on 2 cores); DDP_SANITIZE=0 skips it. The whole suite under sanitizers: scripts/sanitize.sh.
if [[ "${DDP_SANITIZE:-1}" != 0 ]]; then
  # The fuzz pass below replays every corpus under clang's ASan + UBSan: no second replay here.
  DDP_ASAN_FUZZ=$([[ "${DDP_FUZZ_SECONDS:-5}" != 0 ]] && echo 0 || echo 1) scripts/asan_quick.sh
  took "the sanitizer pass"
fi
# Every libFuzzer target (clang, ASan+UBSan) for DDP_FUZZ_SECONDS each, 5 by default; 0 skips.
# Longer runs: scripts/fuzz.sh 600.
if [[ "${DDP_FUZZ_SECONDS:-5}" != 0 ]]; then
  scripts/fuzz.sh "${DDP_FUZZ_SECONDS:-5}"
  took "the fuzz pass"
fi

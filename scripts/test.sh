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
# The sanitizer and fuzz passes build and run beside the suite, at a lower priority: the suite's
# process tests wait on their peers and leave about a third of two cores idle (863 s of wall time,
# 1,085 s of CPU), which the passes' builds take instead. Their output follows the suite's.
side=$(mktemp /tmp/ddp-test-side.XXXXXX)
(
  s0=$SECONDS
  # A bounded ASan+UBSan pass over the network-facing code (scripts/asan_quick.sh); DDP_SANITIZE=0
  # skips it. The whole suite under sanitizers: scripts/sanitize.sh.
  if [[ "${DDP_SANITIZE:-1}" != 0 ]]; then
    # The fuzz pass below replays every corpus under clang's ASan + UBSan: no second replay here.
    DDP_ASAN_FUZZ=$([[ "${DDP_FUZZ_SECONDS:-5}" != 0 ]] && echo 0 || echo 1) nice -n 10 scripts/asan_quick.sh ||
      exit 1
    echo "test.sh: the sanitizer pass took $((SECONDS - s0)) s (beside the suite)"
  fi
  s0=$SECONDS
  # Every libFuzzer target (clang, ASan+UBSan) for DDP_FUZZ_SECONDS each, 5 by default; 0 skips.
  # Longer runs: scripts/fuzz.sh 600.
  if [[ "${DDP_FUZZ_SECONDS:-5}" != 0 ]]; then
    nice -n 10 scripts/fuzz.sh "${DDP_FUZZ_SECONDS:-5}" || exit 1
    echo "test.sh: the fuzz pass took $((SECONDS - s0)) s (beside the suite)"
  fi
) > "$side" 2>&1 &
side_pid=$!
suite=0
meson test -C build --no-rebuild --print-errorlogs --num-processes 2 "$@" || suite=$?
took "meson test"
passes=0
wait "$side_pid" || passes=$?
cat "$side"
rm -f "$side"
took "waiting for the sanitizer and fuzz passes"
((suite == 0 && passes == 0))

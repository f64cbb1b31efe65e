#!/usr/bin/env bash
# Builds the fuzz targets with clang's libFuzzer, AddressSanitizer and UndefinedBehaviorSanitizer
# in their own build directory, and runs each for a fixed time.
#   scripts/fuzz.sh [seconds per target, default 60] [target...]
# Targets: tests/fuzz/fuzz_*.cpp (default: all). Seeds come from tests/fuzz/corpus/<target>/;
# inputs found along the way go to $BUILD_DIR/fuzz-corpus/<target>/ and crashes to
# $BUILD_DIR/fuzz-crashes/, never into the source tree. Exit status 1 when any target crashed.
# Environment: BUILD_DIR (default build-fuzz), CXX (default clang++), JOBS (ninja -j).
# See docs/testing.md.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
[[ $# -gt 0 ]] && shift
targets=("$@")
if ((${#targets[@]} == 0)); then
  for f in tests/fuzz/fuzz_*.cpp; do t=${f#tests/fuzz/fuzz_}; targets+=("${t%.cpp}"); done
fi
dir=${BUILD_DIR:-build-fuzz}
jobs=()
[[ -n "${JOBS:-}" ]] && jobs=(-j "$JOBS")

if [[ ! -f "$dir/build.ninja" ]]; then
  # Only the fuzz targets are built; the optional SDKs would only slow the configure step.
  # -O1 with line tables only (-g1): crash reports name functions, files and lines, and the
  # targets build in half the time of -O2 -g.
  CXX=${CXX:-clang++} meson setup "$dir" --wrap-mode=nodownload --buildtype=plain -Doptimization=1 -Dcpp_args=-g1 \
    -Db_sanitize=address,undefined -Db_lundef=false -Dbench=disabled -Dexamples=disabled \
    -Dtbb=disabled -Dcuda=disabled -Dnccl=disabled -Dmpi=disabled >"$dir.setup.log" 2>&1 ||
    { cat "$dir.setup.log"; exit 1; }
  rm -f "$dir.setup.log"
fi
grep -q '"libFuzzer".*links: YES' "$dir/meson-logs/meson-log.txt" ||
  { echo "fuzz: the compiler of $dir has no libFuzzer (clang and libclang-rt-dev are needed)" >&2; exit 2; }
ninja -C "$dir" "${jobs[@]}" "${targets[@]/#/tests/fuzz/fuzz_}" >/dev/null

# Any sanitizer report is a crash that libFuzzer saves and reports.
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export ASAN_OPTIONS=${ASAN_OPTIONS:-strict_string_checks=1}
mkdir -p "$dir/fuzz-crashes"
failed=()
for t in "${targets[@]}"; do
  log="$dir/fuzz-$t.log"
  rc=0
  # malloc_limit_mb: no single allocation may come near what an input claims beyond the store's
  # 64 MiB frame limit; rss_limit_mb: no growth across inputs.
  "$dir/tests/fuzz/fuzz_$t" "$dir/fuzz-corpus/$t" "tests/fuzz/corpus/$t" -create_missing_dirs=1 \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=1024 -malloc_limit_mb=80 -print_final_stats=1 \
    -artifact_prefix="$dir/fuzz-crashes/$t-" >"$log" 2>&1 || rc=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 || true)
  corpus=$(find "$dir/fuzz-corpus/$t" -type f | wc -l)
  printf 'fuzz %-13s %8s runs %6s/s  %-10s corpus %4s  %s\n' "$t" "${runs:-?}" "${speed:-?}" "${cov:-cov: ?}" \
    "$corpus" "$([[ $rc == 0 ]] && echo ok || echo "CRASH (rc $rc)")"
  if [[ $rc != 0 ]]; then
    failed+=("$t")
    grep -E 'ERROR|runtime error|fuzz property|SUMMARY|Test unit written|^    #[0-9]' "$log" | head -30 | sed 's/^/    /'
    echo "    full log: $log"
  fi
done
if ((${#failed[@]})); then
  echo "fuzz: crashes in ${failed[*]}; reproduce with $dir/tests/fuzz/fuzz_<target> <file in $dir/fuzz-crashes>"
  exit 1
fi

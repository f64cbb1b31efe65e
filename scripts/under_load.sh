#!/usr/bin/env bash
# The suites that start processes, under load: a busy loop on every core beside them, ROUNDS
# times in a row (3 by default); stops at the first failing round. A user's machine is rarely
# quiet: timing assertions must take their margins from what they measure (docs/testing.md).
#   scripts/under_load.sh [ROUNDS] [BUILD_DIR] [SUITES...]   defaults: 3, build, multiproc launcher faults netns
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
build=${2:-build}
shift 2 2>/dev/null || shift $#
suites=("$@")
((${#suites[@]})) || suites=(multiproc launcher faults netns)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
busy=()
stop() { ((${#busy[@]})) && kill "${busy[@]}" 2>/dev/null; wait 2>/dev/null; }
trap stop EXIT
for _ in $(seq "$(nproc)"); do (while :; do :; done) & busy+=($!); done
args=()
for s in "${suites[@]}"; do args+=(--suite "$s"); done
for r in $(seq "$rounds"); do
  t0=$SECONDS
  if ! meson test -C "$build" --no-rebuild --print-errorlogs --num-processes 2 "${args[@]}" > "/tmp/under_load.$r.log" 2>&1; then
    grep -E "^ *[0-9]+/[0-9]+ " "/tmp/under_load.$r.log" | grep -v " OK \| SKIP " || true
    echo "under_load: round $r of $rounds FAILED after $((SECONDS - t0)) s (log: /tmp/under_load.$r.log)"
    exit 1
  fi
  echo "under_load: round $r of $rounds: $(grep -E '^Ok:' "/tmp/under_load.$r.log" | tr -s ' '), $(grep -E '^Skipped:' "/tmp/under_load.$r.log" | tr -s ' ') in $((SECONDS - t0)) s, $(nproc) busy loops beside"
done
echo "under_load: OK ($rounds rounds: ${suites[*]})"

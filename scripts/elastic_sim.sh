#!/bin/bash
# Long runs of the elastic simulation (tests/unit/test_elastic_sim.cpp: the real elastic group
# over a simulated world): ROUNDS rounds of SCHEDULES schedules each, on fresh seeds, with up to
# FAULTS faults per schedule. A failing schedule prints its seed and the line that replays it.
#
#   scripts/elastic_sim.sh [BUILD_DIR] [ROUNDS] [SCHEDULES] [FAULTS]
#   scripts/elastic_sim.sh build 10 5000 12     # 50,000 schedules with up to 12 faults each
set -euo pipefail
build=${1:-build}
rounds=${2:-4}
schedules=${3:-5000}
faults=${4:-6}
exe="$build/tests/unit/unit_elastic_sim"
[ -x "$exe" ] || { echo "elastic_sim.sh: $exe not built (ninja -C $build tests/unit/unit_elastic_sim)" >&2; exit 2; }
for ((r = 0; r < rounds; r++)); do
  first=$((1000000 + r * schedules))
  echo "round $((r + 1))/$rounds: seeds $first..$((first + schedules - 1)), up to $faults faults"
  rc=0
  out=$(DDP_SIM_FIRST=$first DDP_SIM_SCHEDULES=$schedules DDP_SIM_FAULTS=$faults "$exe" 2>&1) || rc=$?
  printf '%s\n' "$out" | grep -E "MESSAGE|ERROR|replay|  process" | sed 's/^[^ ]*: //' || true
  [ "$rc" -eq 0 ] || { echo "elastic_sim.sh: round $((r + 1)) failed (above)"; exit 1; }
done
echo "elastic_sim.sh: $((rounds * schedules)) schedules, no invariant broken"

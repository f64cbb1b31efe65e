#!/usr/bin/env bash
# The soak at full length: 10,000 random collectives (reducer, kind, dtype, op, size, async
# batches) across 4 ranks, every result checked bit for bit against an exact reference and
# across ranks. Prints the seed, the count, the time and the number of mismatches (must be 0).
# Takes about a minute on 2 cores.
#
#   scripts/soak.sh                          # 10,000 collectives, random seed (printed)
#   DDP_SOAK_COUNT=50000 DDP_SOAK_SEED=42 scripts/soak.sh
#
# Extra arguments go to the doctest binary. See docs/reliability.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -f build/build.ninja ]] || meson setup build --wrap-mode=nodownload
ninja -C build tests/soak/soak
export DDP_SOAK_COUNT="${DDP_SOAK_COUNT:-10000}"
exec build/tests/soak/soak "$@"

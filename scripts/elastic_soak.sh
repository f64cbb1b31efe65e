#!/usr/bin/env bash
# The elastic group's soak (docs/elastic.md, "Proof under fire"): examples/05_elastic under
# `ddprun -n 4 --elastic 2:4` while a punisher kills or freezes a random rank (rank 0 too)
# every INTERVAL seconds, FAILURES times (200 by default: about six minutes). Passes when the
# run exits 0 and its final rank 0 says `elastic: OK ...` (bitwise-equal weights, every
# committed step averaged over exactly its ranks, the loss near an uninterrupted run's).
#
#   scripts/elastic_soak.sh [FAILURES [INTERVAL [RANKS]]]
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -f build/build.ninja ]] || meson setup build --wrap-mode=nodownload
ninja -C build tools/ddprun examples/05_elastic
exec tests/launcher/test_elastic.sh build/tools/ddprun build/examples/05_elastic "${1:-200}" "${2:-1.5}" "${3:-4}"

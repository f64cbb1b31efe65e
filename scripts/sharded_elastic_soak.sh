#!/usr/bin/env bash
# The sharded mode's replicas under fire (docs/sharded.md, "Surviving failures"):
# examples/06_sharded --elastic under `ddprun -n 4 --elastic 2:4` while a punisher kills or
# freezes a random rank (rank 0 too) every INTERVAL seconds, FAILURES times (200 by default), each
# once the group re-formed after the last (two holders of a shard lost before the group
# re-replicated it is the loss that 2 replicas do not survive: errc::state_lost).
# Passes when the run exits 0, the group's state was never lost, and the final rank 0 says
# `sharded elastic: OK ...` (the sharded weights and AdamW state bitwise those of the unsharded
# run computed alongside, on every rank).
#
#   scripts/sharded_elastic_soak.sh [FAILURES [INTERVAL [RANKS]]]
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -f build/build.ninja ]] || meson setup build --wrap-mode=nodownload
ninja -C build tools/ddprun examples/06_sharded
ONE_LOSS_AT_A_TIME=1 exec tests/launcher/test_elastic.sh build/tools/ddprun build/examples/06_sharded "${1:-200}" "${2:-1.5}" "${3:-4}" --elastic

#!/usr/bin/env bash
# The fault-injection suite at full length: 50 randomized trials per reducer (ring<tcp>,
# tree<tcp>, ring<shm>, tree<shm>), each killing (SIGKILL) or freezing (SIGSTOP) one rank of a
# 2-4 rank group during rendezvous, mid-allreduce, between buckets or inside finish(). Prints
# one line per failed trial and, per reducer and kind of fault, the trial count and the slowest
# survivor's detection time. Takes about 5 minutes on 2 cores.
#
#   scripts/faults.sh                      # 50 trials per reducer, random seed (printed)
#   DDP_FAULT_TRIALS=200 scripts/faults.sh
#   DDP_FAULT_SEED=11 DDP_FAULT_ONLY=7 DDP_FAULT_VERBOSE=1 scripts/faults.sh -tc='*tree<tcp>*'
#
# Extra arguments go to the doctest binary. See docs/reliability.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -f build/build.ninja ]] || meson setup build --wrap-mode=nodownload
ninja -C build tests/faults/faults
export DDP_FAULT_TRIALS="${DDP_FAULT_TRIALS:-50}"
exec build/tests/faults/faults "$@"

#!/usr/bin/env bash
# The main job: install what is missing, build the launcher and the example (not the tests,
# fuzzers and benchmarks: scripts/test.sh builds those), train the data-parallel MLP example on
# 4 local processes through the ddprun launcher (localhost rendezvous).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
# The same configuration as scripts/test.sh, so that one build directory serves both.
[[ -f build/build.ninja ]] || meson setup build --wrap-mode=nodownload -Dbench_optimization=0
ninja -C build tools/ddprun examples/01_mlp
exec build/tools/ddprun -n "${DDP_NPROC:-4}" build/examples/01_mlp

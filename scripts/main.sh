#!/usr/bin/env bash
# The main job: install what is missing, build everything, train the data-parallel MLP example
# on 4 local processes through the ddprun launcher (localhost rendezvous).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
[[ -f build/build.ninja ]] || meson setup build --wrap-mode=nodownload
ninja -C build
exec build/tools/ddprun -n "${DDP_NPROC:-4}" build/examples/01_mlp

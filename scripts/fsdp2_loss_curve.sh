#!/usr/bin/env bash
# ddp's fully sharded mode beside PyTorch's FSDP2 on the same small causal transformer
# (examples/07_fully_sharded.cpp's LibTorch engine, examples/07_fully_sharded_fsdp2.py): the same
# initial weights and per-rank batches, AdamW, 50 steps at 2 and 4 ranks; each step's loss (the
# mean over the ranks) must agree within TOL relative (default 1e-5). docs/sharded.md has a run.
#   scripts/fsdp2_loss_curve.sh [BUILD_DIR]   (default build; it needs LibTorch found there)
#   DDP_TORCH_VENV=DIR   PyPI's torch for FSDP2 (scripts/torch_venv.sh installs it where missing)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
tol=${TOL:-1e-5}
source scripts/torch_venv.sh  # sets py
exe=$build/examples/07_fully_sharded
ninja -C "$build" examples/07_fully_sharded tools/ddprun >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
for n in 2 4; do
  echo "== $n ranks"
  "$build/tools/ddprun" -n "$n" "$exe" --engine libtorch --steps 50 --init "$work/init.bin" --losses "$work/ddp.txt" | tail -1
  "$py" examples/07_fully_sharded_fsdp2.py --init "$work/init.bin" --ranks "$n" --steps 50 --compare "$work/ddp.txt" \
    --tol "$tol" > "$work/out.txt" || status=1
  sed -n '1p;2,4p;$p' "$work/out.txt" | sed '5i ...' 2>/dev/null || cat "$work/out.txt"
done
exit $status

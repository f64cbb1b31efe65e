#!/usr/bin/env bash
# The whole model (frozen layer, BatchNorm buffers, gradient accumulation) on differently
# initialised ranks under ddp (tests/torch/whole_model.cpp) and under PyTorch's
# DistributedDataParallel (whole_model_ddp.py): every parameter and buffer must agree within 1e-5.
#   whole_model.sh DDPRUN EXE PY_SCRIPT [RANKS:ACCUMULATE:BROADCAST ...]   (default: 2:2:1 4:2:0 4:1:1)
set -euo pipefail
ddprun=$1; exe=$2; script=$3; shift 3
cases=("$@"); ((${#cases[@]})) || cases=(2:2:1 4:2:0 4:1:1)
python=${DDP_TORCH_PYTHON:-/usr/bin/python3}
if ! "$python" -c 'import torch.distributed' 2>/dev/null; then
  echo "PyTorch not importable by $python (apt install python3-torch): skipped"; exit 77
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for c in "${cases[@]}"; do
  IFS=: read -r ranks acc bcast <<<"$c"
  mode=$([[ $bcast == 1 ]] && echo broadcast || echo none)
  rm -f "$tmp"/*
  "$ddprun" -n "$ranks" "$exe" --steps 12 --accumulate "$acc" --buffers "$mode" --init "$tmp/init.bin" --out "$tmp/out"
  "$python" "$script" --init "$tmp/init.bin" --ranks "$ranks" --steps 12 --accumulate "$acc" \
    --broadcast-buffers "$bcast" --compare "$tmp/out" --tol 1e-5
done

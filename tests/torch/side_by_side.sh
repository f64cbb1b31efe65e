#!/usr/bin/env bash
# ddp's LibTorch CNN (examples/03_libtorch.cpp) and PyTorch's own DistributedDataParallel
# (examples/03_libtorch_ddp.py, gloo) train the same model from the same weights on the same
# per-rank batches; their weights after the last step must agree within 1e-5 (relative).
#   side_by_side.sh DDPRUN EXAMPLE PYTHON_SCRIPT [RANKS] [STEPS]
set -euo pipefail
ddprun=$1; example=$2; script=$3; ranks=${4:-4}; steps=${5:-20}
if ! /usr/bin/python3 -c 'import torch.distributed' 2>/dev/null; then
  echo "PyTorch not importable by /usr/bin/python3 (apt install python3-torch): skipped"; exit 77
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$ddprun" -n "$ranks" "$example" --steps "$steps" --init "$tmp/init.bin" --out "$tmp/ddp.bin"
/usr/bin/python3 "$script" --init "$tmp/init.bin" --ranks "$ranks" --steps "$steps" --compare "$tmp/ddp.bin" --tol 1e-5

#!/usr/bin/env bash
# ddp's LibTorch CNN (examples/03_libtorch.cpp) and PyTorch's own DistributedDataParallel
# (examples/03_libtorch_ddp.py, gloo) train the same model from the same weights on the same
# per-rank batches; their weights after the last step must agree within 1e-5 (relative).
#   side_by_side.sh DDPRUN EXAMPLE PYTHON_SCRIPT [RANKS] [STEPS] [EXTRA ARGUMENTS OF BOTH SIDES...]
# (--sharded --lr 0.01: ddp's sharded AdamW against PyTorch's ZeroRedundancyOptimizer over AdamW)
# DDP_TORCH_PYTHON: the interpreter of the PyTorch side (default /usr/bin/python3, Debian's torch;
# scripts/torch_current.sh sets its venv's, whose torch matches the LibTorch the example links).
set -euo pipefail
ddprun=$1; example=$2; script=$3; ranks=${4:-4}; steps=${5:-20}; shift $(( $# < 5 ? $# : 5 ))
python=${DDP_TORCH_PYTHON:-/usr/bin/python3}
if ! "$python" -c 'import torch.distributed' 2>/dev/null; then
  echo "PyTorch not importable by $python (apt install python3-torch): skipped"; exit 77
fi
echo "PyTorch side: $python, torch $("$python" -c 'import torch; print(torch.__version__)')"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$ddprun" -n "$ranks" "$example" --steps "$steps" --init "$tmp/init.bin" --out "$tmp/ddp.bin" "$@"
"$python" "$script" --init "$tmp/init.bin" --ranks "$ranks" --steps "$steps" --compare "$tmp/ddp.bin" --tol "${DDP_SIDE_TOL:-1e-5}" "$@"

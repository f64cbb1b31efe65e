#!/usr/bin/env bash
# ddp::powersgd on the LibTorch CNN (examples/03_libtorch.cpp --powersgd 2): the mean loss of the
# last 10 of 60 steps on 2 ranks must be within 0.05 (cross-entropy; the first step's is 2.33) of
# the uncompressed run's, and of PyTorch's powerSGD_hook's on the same model, weights and batches
# (examples/03_libtorch_ddp.py --powersgd 2) where PyTorch is importable.
#   powersgd_loss.sh DDPRUN EXAMPLE PYTHON_SCRIPT
# Measured: uncompressed 0.0627, ddp PowerSGD 0.0779, PyTorch PowerSGD 0.0705.
set -euo pipefail
ddprun=$1; example=$2; script=$3
python=${DDP_TORCH_PYTHON:-/usr/bin/python3}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
tail_of() { sed -n 's/.*mean \(loss \)\{0,1\}of the last [0-9]* steps \([0-9.]*\).*/\2/p' "$1" | tail -1; }
"$ddprun" -n 2 "$example" --steps 60 --init "$tmp/init.bin" >"$tmp/plain.txt" 2>&1 || { cat "$tmp/plain.txt"; exit 1; }
"$ddprun" -n 2 "$example" --steps 60 --powersgd 2 >"$tmp/psgd.txt" 2>&1 || { cat "$tmp/psgd.txt"; exit 1; }
plain=$(tail_of "$tmp/plain.txt"); psgd=$(tail_of "$tmp/psgd.txt")
[[ -n "$plain" && -n "$psgd" ]] || { echo "no loss found"; cat "$tmp/plain.txt" "$tmp/psgd.txt"; exit 1; }
torch=""
if "$python" -c 'import torch.distributed' 2>/dev/null; then
  "$python" "$script" --init "$tmp/init.bin" --ranks 2 --steps 60 --powersgd 2 >"$tmp/torch.txt" 2>&1 ||
    { cat "$tmp/torch.txt"; exit 1; }
  torch=$(tail_of "$tmp/torch.txt")
  [[ -n "$torch" ]] || { echo "no loss from PyTorch"; cat "$tmp/torch.txt"; exit 1; }
fi
echo "mean loss of the last 10 of 60 steps: uncompressed $plain, ddp::powersgd rank 2 $psgd, PyTorch powerSGD_hook ${torch:-(not run)}"
ok=$(awk -v a="$plain" -v b="$psgd" -v c="$torch" 'BEGIN {
  d = b - a; if (d < 0) d = -d; ok = d <= 0.05
  if (c != "") { e = b - c; if (e < 0) e = -e; ok = ok && e <= 0.05 }
  print ok ? "yes" : "no" }')
[[ "$ok" == yes ]] || { echo "FAILED: ddp::powersgd's loss is more than 0.05 from the others"; exit 1; }
echo OK

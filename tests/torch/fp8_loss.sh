#!/usr/bin/env bash
# ddp::fp8_compress on the LibTorch CNN (examples/03_libtorch.cpp --fp8: e4m3, blocks of 256,
# error feedback): the mean loss of the last 10 of 60 steps on 2 ranks must be within 0.01
# (cross-entropy; the first step's is 2.33) of the uncompressed run's. The run without error
# feedback (--fp8-no-feedback) is printed beside them (docs/tuning.md, "fp8").
#   fp8_loss.sh DDPRUN EXAMPLE
# Measured (2026-12-07): uncompressed 0.0627, fp8 0.0652, fp8 without error feedback 0.0674.
set -euo pipefail
ddprun=$1; example=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
tail_of() { sed -n 's/.*mean \(loss \)\{0,1\}of the last [0-9]* steps \([0-9.]*\).*/\2/p' "$1" | tail -1; }
for run in plain:"" fp8:--fp8 nofb:--fp8-no-feedback; do
  name=${run%%:*}; flag=${run#*:}
  "$ddprun" -n 2 "$example" --steps 60 $flag >"$tmp/$name.txt" 2>&1 || { cat "$tmp/$name.txt"; exit 1; }
done
plain=$(tail_of "$tmp/plain.txt"); fp8=$(tail_of "$tmp/fp8.txt"); nofb=$(tail_of "$tmp/nofb.txt")
[[ -n "$plain" && -n "$fp8" && -n "$nofb" ]] || { echo "no loss found"; cat "$tmp"/*.txt; exit 1; }
echo "mean loss of the last 10 of 60 steps: uncompressed $plain, fp8 $fp8, fp8 without error feedback $nofb"
ok=$(awk -v a="$plain" -v b="$fp8" 'BEGIN { d = b - a; if (d < 0) d = -d; print d <= 0.01 ? "yes" : "no" }')
[[ "$ok" == yes ]] || { echo "FAILED: fp8's loss is more than 0.01 from the uncompressed run's"; exit 1; }
echo OK

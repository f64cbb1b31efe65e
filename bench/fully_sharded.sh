#!/usr/bin/env bash
# The fully sharded mode (ddp::fully_sharded, ZeRO-3) beside the sharded mode (ZeRO-2) and
# PyTorch's FSDP2, in one sitting: bench/sharded_step --touch (ddp_sharded_adamw: dp_options::shard;
# ddp_fully_sharded_adamw: units of about 1/24 of the model gathered around their forward and
# backward; ddp_fully_sharded_keep_adamw: reshard_after_forward off) and bench/peers/torch_fsdp.py
# (fully_shard per unit and on the root, CPU with gloo; --keep: reshard_after_forward=False),
# alternating ROUNDS times, ResNet-50 and BERT-base shapes, each forward reading every parameter.
# Prints every row, then per model and rank count the medians of the step time, the ratios
# (fully sharded / sharded, target 1.3; FSDP2 / ddp fully sharded) and rank 0's peak RSS.
#
#   bench/fully_sharded.sh [ROUNDS] [BUILD_DIR] [RANKS] [STEPS]     defaults: 3, build-rel, 2,4, 8
# FSDP2 needs torch 2.6 or later: DDP_TORCH2_PYTHON (default /work/venv-torch2/bin/python, a
# virtual environment with `pip install torch`); without it the FSDP2 rows are left out.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-3}
build=${2:-$root/build-rel}
ranks=${3:-2,4}
steps=${4:-8}
exe=$build/bench/sharded_step
[[ -x $exe ]] || { echo "fully_sharded.sh: build $exe first (ninja -C $build bench/sharded_step)"; exit 2; }
python=${DDP_TORCH2_PYTHON:-/work/venv-torch2/bin/python}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
models=("$root/tests/data/resnet50.params" "$root/tests/data/bert_base.params")
for ((r = 1; r <= rounds; ++r)); do
  for m in "${models[@]}"; do
    "$exe" --ranks "$ranks" --steps "$steps" --warmup 2 --touch \
      --variants ddp_sharded_adamw,ddp_fully_sharded_adamw,ddp_fully_sharded_keep_adamw "$m" 2>>"$tmp/notes" |
      tail -n +2 >> "$tmp/rows.csv"
    if [[ -x $python ]]; then
      for keep in "" --keep; do
        "$python" "$root/bench/peers/torch_fsdp.py" --ranks "$ranks" --steps "$steps" --warmup 2 $keep "$m" 2>/dev/null |
          tail -n +2 >> "$tmp/rows.csv"
      done
    fi
  done
done
echo "system,model,ranks,params,steps,step_median_ms,step_p10_ms,opt_state_bytes_rank0,opt_state_bytes_max,peak_rss_bytes_rank0[,ddp_grad_bytes_rank0,largest_unit_or_bucket_bytes]"
cat "$tmp/rows.csv"
grep '^#' "$tmp/notes"
python3 - "$tmp/rows.csv" <<'PY'
import statistics, sys
from collections import defaultdict
rows = defaultdict(list)
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) >= 10:
        rows[(f[1], int(f[2]), f[0])].append(f)
def med(key, col):
    v = [float(f[col]) for f in rows.get(key, [])]
    return statistics.median(v) if v else float("nan")
print()
print("| model | ranks | ddp sharded (ZeRO-2) ms | ddp fully sharded ms | ddp fully sharded, kept ms | FSDP2 ms | FSDP2 kept ms "
      "| fully / sharded | kept / sharded | FSDP2 / ddp fully | FSDP2 kept / ddp kept | peak RSS MB: ddp sharded, ddp fully, FSDP2 |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for model, n in sorted({(k[0], k[1]) for k in rows}):
    z2, z3, k3 = (med((model, n, v), 5) for v in ("ddp_sharded_adamw", "ddp_fully_sharded_adamw", "ddp_fully_sharded_keep_adamw"))
    f2, fk = med((model, n, "pytorch_fsdp2_adamw"), 5), med((model, n, "pytorch_fsdp2_keep_adamw"), 5)
    r2, r3, rf = (med((model, n, v), 9) / 1e6 for v in ("ddp_sharded_adamw", "ddp_fully_sharded_adamw", "pytorch_fsdp2_adamw"))
    print(f"| {model} | {n} | {z2:.1f} | {z3:.1f} | {k3:.1f} | {f2:.1f} | {fk:.1f} | {z3 / z2:.2f} | {k3 / z2:.2f} "
          f"| {f2 / z3:.2f} | {fk / k3:.2f} | {r2:.0f}, {r3:.0f}, {rf:.0f} |")
PY

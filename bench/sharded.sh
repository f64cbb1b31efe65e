#!/usr/bin/env bash
# Sharded AdamW beside the allreduce mode and beside PyTorch, in one sitting: bench/sharded_step
# (ddp_adamw: the default wrapper, then ddp::adamw over every parameter on every rank;
# ddp_sharded_adamw: dp_options::shard, dp.step(ddp::adamw)) and bench/peers/torch_zero.py
# (pytorch_ddp_adamw: DistributedDataParallel + torch.optim.AdamW; pytorch_zero_adamw: DDP +
# ZeroRedundancyOptimizer over AdamW; gloo), alternating ROUNDS times, on ResNet-50 and BERT-base
# shapes, at each rank count. Prints every row, then per model and rank count the medians over the
# rounds of the step time (the slowest rank's per step), the optimizer state per rank, ddp's
# gradient memory, rank 0's peak RSS, and the ratios the targets of docs/sharded.md name:
#   sharded / allreduce (ddp)            step time, target <= 1.10
#   PyTorch ZeRO / ddp sharded           must be >= PyTorch DDP / ddp allreduce
#   state + gradient memory per rank     against 1.05 (unsharded state + ddp's buckets) / N + one bucket
#                                        (the largest: BERT's 94 MB embedding is a bucket of its own)
#
#   bench/sharded.sh [ROUNDS] [BUILD_DIR] [RANKS] [STEPS]     defaults: 3, build-rel, 2,4, 10
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-3}
build=${2:-$root/build-rel}
ranks=${3:-2,4}
steps=${4:-10}
exe=$build/bench/sharded_step
python=${DDP_TORCH_PYTHON:-/usr/bin/python3}
[[ -x $exe ]] || { echo "sharded.sh: build $exe first (ninja -C $build bench/sharded_step)"; exit 2; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
models=("$root/tests/data/resnet50.params" "$root/tests/data/bert_base.params")
for ((r = 1; r <= rounds; ++r)); do
  for m in "${models[@]}"; do
    "$exe" --ranks "$ranks" --steps "$steps" --warmup 3 "$m" | tail -n +2 >> "$tmp/rows.csv"
    "$python" "$root/bench/peers/torch_zero.py" --ranks "$ranks" --steps "$steps" --warmup 3 "$m" 2>/dev/null |
      tail -n +2 >> "$tmp/rows.csv"
  done
done
echo "system,model,ranks,params,steps,step_median_ms,step_p10_ms,opt_state_bytes_rank0,opt_state_bytes_max,peak_rss_bytes_rank0[,ddp_grad_bytes_rank0,largest_bucket_bytes]"
cat "$tmp/rows.csv"
python3 - "$tmp/rows.csv" <<'PY'
import statistics, sys
from collections import defaultdict
rows = defaultdict(list)
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) < 10:
        continue
    rows[(f[1], int(f[2]), f[0])].append(f)
def med(key, col):
    v = [float(f[col]) for f in rows.get(key, [])]
    return statistics.median(v) if v else float("nan")
print()
print("| model | ranks | ddp allreduce ms | ddp sharded ms | PyTorch DDP ms | PyTorch ZeRO ms | sharded / allreduce "
      "| PyTorch DDP / ddp | PyTorch ZeRO / ddp sharded | state MB per rank: ddp sharded, unsharded, PyTorch ZeRO "
      "| ddp state + gradient MB: sharded, target | peak RSS MB: ddp sharded, PyTorch ZeRO |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for model, n in sorted({(k[0], k[1]) for k in rows}):
    a, s = med((model, n, "ddp_adamw"), 5), med((model, n, "ddp_sharded_adamw"), 5)
    pd, pz = med((model, n, "pytorch_ddp_adamw"), 5), med((model, n, "pytorch_zero_adamw"), 5)
    st_s, st_u = med((model, n, "ddp_sharded_adamw"), 8), med((model, n, "ddp_adamw"), 8)
    st_z = med((model, n, "pytorch_zero_adamw"), 8)
    g_s, g_u = med((model, n, "ddp_sharded_adamw"), 10), med((model, n, "ddp_adamw"), 10)
    target = 1.05 * (st_u + g_u) / n + med((model, n, "ddp_sharded_adamw"), 11)
    rss_s, rss_z = med((model, n, "ddp_sharded_adamw"), 9), med((model, n, "pytorch_zero_adamw"), 9)
    mb = lambda b: b / 1e6
    print(f"| {model} | {n} | {a:.1f} | {s:.1f} | {pd:.1f} | {pz:.1f} | {s / a:.3f} | {pd / a:.2f} | {pz / s:.2f} "
          f"| {mb(st_s):.0f}, {mb(st_u):.0f}, {mb(st_z):.0f} | {mb(st_s + g_s):.0f}, {mb(target):.0f} "
          f"| {mb(rss_s):.0f}, {mb(rss_z):.0f} |")
PY

#!/usr/bin/env bash
# Across hosts: ddp against PyTorch DDP and against the link bound, on hosts made of network
# namespaces behind a switch (scripts/netns.sh, every host's link limited both ways with tbf).
# For each layout (HOSTSxRANKS) and link rate, one set of namespaces; then ROUNDS times, per model,
# alternating in one sitting:
#   ddp        bench/ddp_step --env under one ddprun per host: the default wrapper in copy and view
#              mode (ddp_default_copy, ddp_default_view), with fp16_compress
#              (ddp_default_fp16_copy), with fp8_compress (ddp_default_fp8_copy) and with powersgd at rank 1 (ddp_default_powersgd_copy);
#              25 MiB buckets, no simulated compute
#   PyTorch    bench/peers/torch_ddp.py --env, one process per rank: DDP (gloo) with no hook, with
#              fp16_compress_hook, and with powerSGD_hook (rank 1 by default; one bucket, see below)
# Each row is the gradient sync per step (step minus a no_sync step, medians of the slowest rank).
# The table gives per layout, rate, model and system the median over rounds, the link bound, the
# ratio to it, PyTorch DDP (no hook) over each row, and PyTorch with the same compression (none,
# fp16, PowerSGD) over each row.
#
# The bound: every host sends and receives at least 2 (H - 1) / H of the gradient bytes B over its
# link in an allreduce over H hosts (a ring between the hosts; ranks within a host meet in memory),
# so B * 2 (H - 1) / H / rate, and half of that for 16-bit compression; fp8_compress's all-gather
# brings every other host's ranks' codes and scales, B / 4 (1 + 4/256) (H - 1) P / rate (P ranks a
# host). Its "same compression" column is PyTorch's fp16 hook (PyTorch has no fp8 hook).
#
# PyTorch's powerSGD_hook chains several collectives per bucket through futures, which gloo runs
# in issue order: with more than one bucket the ranks interleave them differently and gloo aborts
# ("op.preamble.length <= op.nbytes"), so PowerSGD runs with one bucket (cap 10000 MB).
#
#   bench/across_hosts.sh [BUILD_DIR]     (root; build first: ninja -C build-rel tools/ddprun bench/ddp_step)
#   environment: LAYOUTS=2x1,3x1,2x2  RATES=10gbit,1gbit  MODELS=resnet50,bert_base  ROUNDS=1
#                STEPS=8  WARMUP=2  SYSTEMS=ddp,torch,torch_fp16,torch_powersgd  CSV=FILE (all rows)
#                POWERSGD_RANK=1  PYTHON=/usr/bin/python3  DDP_REDUCERS=default,default_fp16,default_fp8,default_powersgd
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(realpath "${1:-$root/build-rel}")
layouts=${LAYOUTS:-2x1,3x1,2x2}
rates=${RATES:-10gbit,1gbit}
models=${MODELS:-resnet50,bert_base}
rounds=${ROUNDS:-1}
steps=${STEPS:-8}
warmup=${WARMUP:-2}
systems=${SYSTEMS:-ddp,torch,torch_fp16,torch_powersgd}
psgd_rank=${POWERSGD_RANK:-1}
python=${PYTHON:-/usr/bin/python3}
ddprun=$build/tools/ddprun
step=$build/bench/ddp_step
for exe in "$ddprun" "$step"; do
  [[ -x "$exe" ]] || { echo "across_hosts: $exe is missing: ninja -C $build tools/ddprun bench/ddp_step" >&2; exit 2; }
done
# shellcheck source=../scripts/netns.sh
source "$root/scripts/netns.sh"
netns_check || exit 77

tmp=$(mktemp -d)
cleanup() { netns_teardown; rm -rf "$tmp"; }
trap cleanup EXIT
trap 'exit 143' TERM INT
: >"$tmp/rows"
port=29600

# run_ddp HOSTS PER_HOST MODEL_FILE: the ddp rows, prefixed "layout,rate,round,".
run_ddp() {
  local hosts=$1 per=$2 model=$3 k
  port=$((port + 1))
  for ((k = hosts - 1; k >= 0; --k)); do
    (netns_exec $k env -u DDP_BACKEND DDP_INSECURE=1 timeout 900 \
       "$ddprun" -n "$per" --nnodes "$hosts" --node-rank $k --master-addr "$(netns_addr 0)" --port $port --timeout 120 -- \
       "$step" --env --reducers ${DDP_REDUCERS:-default,default_fp16,default_fp8,default_powersgd} --caps 25 --modes copy,view --no-compute --no-flat \
       --steps "$steps" --warmup "$warmup" "$model" >"$tmp/out.$k" 2>&1
     echo $? >"$tmp/rc.$k") &
  done
  wait
  for ((k = 0; k < hosts; ++k)); do
    [[ $(cat "$tmp/rc.$k") == 0 ]] || { echo "across_hosts: ddp on host $k failed:" >&2; tail -5 "$tmp/out.$k" >&2; return 1; }
  done
  # The hooks in view mode are not systems of their own (they work on the bucket either way).
  sed -n 's/^\[0\] \(ddp_.*\)/\1/p' "$tmp/out.0" | grep -v -e '^ddp_default_fp16_view' -e '^ddp_default_fp8_view' -e '^ddp_default_powersgd_view'
}

# run_torch HOSTS PER_HOST MODEL_FILE HOOK: PyTorch's row.
run_torch() {
  local hosts=$1 per=$2 model=$3 hook=$4 k i cap=25
  [[ $hook == powersgd ]] && cap=10000
  port=$((port + 1))
  for ((k = hosts - 1; k >= 0; --k)); do
    for ((i = per - 1; i >= 0; --i)); do
      (netns_exec $k env RANK=$((k * per + i)) WORLD_SIZE=$((hosts * per)) MASTER_ADDR="$(netns_addr 0)" \
         MASTER_PORT=$port GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 timeout 900 \
         "$python" "$root/bench/peers/torch_ddp.py" --env --params "$model" --bucket-cap-mb $cap --hook "$hook" \
         --powersgd-rank "$psgd_rank" --steps "$steps" --warmup "$warmup" >"$tmp/tout.$k.$i" 2>&1
       echo $? >"$tmp/trc.$k.$i") &
    done
  done
  wait
  for ((k = 0; k < hosts; ++k)); do
    for ((i = 0; i < per; ++i)); do
      [[ $(cat "$tmp/trc.$k.$i") == 0 ]] ||
        { echo "across_hosts: PyTorch ($hook) rank $((k * per + i)) failed:" >&2; tail -5 "$tmp/tout.$k.$i" >&2; return 1; }
    done
  done
  grep '^pytorch_' "$tmp/tout.0.0"
}

echo "# across_hosts: layouts $layouts, links $rates, models $models, $rounds round(s), $steps steps after $warmup, $(nproc) cores"
for layout in ${layouts//,/ }; do
  hosts=${layout%x*} per=${layout#*x}
  for rate in ${rates//,/ }; do
    netns_setup "$hosts" "$rate" >/dev/null || { echo "across_hosts: netns_setup $hosts $rate failed" >&2; exit 1; }
    for ((round = 1; round <= rounds; ++round)); do
      for m in ${models//,/ }; do
        model=$root/tests/data/$m.params
        for sys in ${systems//,/ }; do
          case $sys in
            ddp) out=$(run_ddp "$hosts" "$per" "$model") ;;
            torch) out=$(run_torch "$hosts" "$per" "$model" none) ;;
            torch_fp16) out=$(run_torch "$hosts" "$per" "$model" fp16) ;;
            torch_powersgd) out=$(run_torch "$hosts" "$per" "$model" powersgd) ;;
            *) echo "across_hosts: unknown system $sys" >&2; exit 2 ;;
          esac || continue
          while IFS= read -r row; do
            [[ -n $row ]] && echo "$layout,$rate,$round,$row" | tee -a "$tmp/rows"
          done <<<"$out"
        done
      done
    done
    netns_teardown
  done
done
[[ -n "${CSV:-}" ]] && cp "$tmp/rows" "$CSV"

# rows: layout,rate,round,system,model,ranks,cap,steps,step_ms,nosync_ms,sync_ms
"$python" - "$tmp/rows" "$root/tests/data" <<'PY'
import math, statistics, sys
from collections import defaultdict
rows, bytes_of = defaultdict(list), {}
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) < 11:
        continue
    layout, rate, system, model = f[0], f[1], f[3], f[4]
    rows[(layout, rate, model, system)].append(float(f[10]))
def model_bytes(m):
    if m not in bytes_of:
        n = 0
        for line in open(f"{sys.argv[2]}/{m}.params"):
            d = line.split()[1:]
            if d and not line.startswith("#"):
                n += math.prod(int(x) for x in d)
        bytes_of[m] = 4 * n
    return bytes_of[m]
def rate_bps(r):
    r = r.lower()
    for suf, mul in (("gbit", 1e9), ("mbit", 1e6)):
        if r.endswith(suf):
            return float(r[: -len(suf)]) * mul
    return float(r)
print("| layout | link | model | system | sync ms | bound ms | / bound | PyTorch DDP / this | PyTorch, same compression / this |")
print("|---|---|---|---|---|---|---|---|---|")
for key in sorted(rows, key=lambda k: (k[0], -rate_bps(k[1]), k[2], k[3])):
    layout, rate, model, system = key
    hosts = int(layout.split("x")[0])
    wire = 2 if ("fp16" in system or "bf16" in system) else 4
    bound = model_bytes(model) / 4 * wire * 2 * (hosts - 1) / hosts * 8 / rate_bps(rate) * 1e3
    if "fp8" in system:  # an all-gather of every other host's ranks' codes and scales (1 + 4/256 bytes an element)
        per = int(layout.split("x")[1])
        bound = model_bytes(model) / 4 * (1 + 4 / 256) * (hosts - 1) * per * 8 / rate_bps(rate) * 1e3
    ms = statistics.median(rows[key])
    rel = f"{ms / bound:.2f}"
    if "powersgd" in system:  # low-rank: its bytes depend on the shapes and the rank, not B
        bound, rel = float("nan"), "-"
    peer = rows.get((layout, rate, model, "pytorch_ddp_gloo"))
    ratio = f"{statistics.median(peer) / ms:.2f}" if peer else "-"
    kind = "_fp16" if ("fp16" in system or "fp8" in system) else "_powersgd" if "powersgd" in system else ""
    same = rows.get((layout, rate, model, "pytorch_ddp_gloo" + kind))
    same_ratio = f"{statistics.median(same) / ms:.2f}" if same else "-"
    print(f"| {layout} | {rate} | {model} | {system} | {ms:.1f} | {bound:.1f} | {rel} | {ratio} | {same_ratio} |")
PY

#!/usr/bin/env bash
# Several hosts on one machine: the default reducer against a flat ring over tcp on the same
# rate-limited links. 3 network namespaces behind a switch (scripts/netns.sh), 2 ranks each,
# one ddprun per host; bench/ddp_step --env times the gradient sync of a data-parallel step
# (ResNet-50's 161 tensors by default) for both reducers in the same group, one after the other:
#   default   ddp::data_parallel's own reducer (run-time choice: hierarchical on several hosts;
#             its choice is printed, from DDP_DEBUG=info)
#   ring_tcp  ring<tcp> over all 6 ranks, as DDP_BACKEND=tcp chooses
# and prints the medians (of the slowest rank per step) and their ratio. Needs root and
# iproute2; build first: ninja -C build tools/ddprun bench/ddp_step
#
#   bench/netns_hier.sh [BUILD_DIR]
#   environment: RATE=10gbit (each host's link, both ways), STEPS=10, WARMUP=2, CAPS=25 (MiB),
#                MODES=copy,view, ROUNDS=1 (whole runs; the table takes the median over rounds),
#                MODEL=tests/data/resnet50.params, HOSTS=3, PER_HOST=2, CSV=FILE (rows of all rounds)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(realpath "${1:-$root/build}")
rate=${RATE:-10gbit}
steps=${STEPS:-10}
warmup=${WARMUP:-2}
caps=${CAPS:-25}
modes=${MODES:-copy,view}
rounds=${ROUNDS:-1}
model=$(realpath "${MODEL:-$root/tests/data/resnet50.params}")
hosts=${HOSTS:-3}
per_host=${PER_HOST:-2}
ddprun=$build/tools/ddprun
step=$build/bench/ddp_step
for exe in "$ddprun" "$step"; do
  [[ -x "$exe" ]] || { echo "netns_hier: $exe is missing: ninja -C $build tools/ddprun bench/ddp_step" >&2; exit 2; }
done
# shellcheck source=../scripts/netns.sh
source "$root/scripts/netns.sh"
netns_check || exit 77

tmp=$(mktemp -d)
cleanup() { netns_teardown; rm -rf "$tmp"; }
trap cleanup EXIT
trap 'exit 143' TERM INT
netns_setup "$hosts" "$rate" || { echo "netns_hier: setting up the namespaces failed" >&2; exit 1; }
master=$(netns_addr 0)
echo "# $hosts hosts x $per_host ranks, links $rate (tbf, both ways), $(basename "$model"), caps $caps MiB," \
     "modes $modes, $steps steps after $warmup, $rounds round(s), $(nproc) cores"

# Rank 0's CSV rows ("[0] ddp_..."), all rounds; the store is on host 0's own namespace, so a
# fixed port is free. ddp_step builds without an authenticator: DDP_INSECURE=1 on this subnet.
: >"$tmp/rows"
for ((round = 1; round <= rounds; ++round)); do
  port=$((29400 + round))
  for ((k = hosts - 1; k >= 0; --k)); do
    (netns_exec $k env -u DDP_BACKEND DDP_DEBUG=info DDP_INSECURE=1 timeout 900 \
       "$ddprun" -n "$per_host" --nnodes "$hosts" --node-rank $k --master-addr "$master" --port $port --timeout 120 -- \
       "$step" --env --reducers default,ring_tcp --caps "$caps" --modes "$modes" --no-compute \
       --steps "$steps" --warmup "$warmup" "$model" >"$tmp/out.$k" 2>&1
     echo $? >"$tmp/rc.$k") &
  done
  wait
  for ((k = 0; k < hosts; ++k)); do
    if [[ $(cat "$tmp/rc.$k") != 0 ]]; then
      echo "netns_hier: round $round, host $k failed (exit $(cat "$tmp/rc.$k")):" >&2
      cat "$tmp/out.$k" >&2
      exit 1
    fi
  done
  ((round > 1)) || grep -h "ddp: backend auto -> " "$tmp"/out.* | sort -u | sed 's/^/# default chose: /' ||
    echo "# default chose: (no 'ddp: backend auto' line: this library's default is a fixed ring<tcp>)"
  sed -n 's/^\[0\] \(ddp_.*\)/\1/p' "$tmp/out.0" >>"$tmp/rows"
done
[[ -n "${CSV:-}" ]] && cp "$tmp/rows" "$CSV"

# rows: system,model,ranks,bucket_cap_mb,steps,step_median_ms,nosync_median_ms,sync_ms,...
# system is ddp_<reducer>_<flat|copy|view>; the table: one line per (kind, cap), both reducers.
awk -F, '
  function median(list,   n, a, i, j, t) {
    n = split(list, a, " ")
    for (i = 2; i <= n; ++i) for (j = i; j > 1 && a[j - 1] + 0 > a[j] + 0; --j) { t = a[j]; a[j] = a[j - 1]; a[j - 1] = t }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
  }
  {
    sys = $1; sub(/^ddp_/, "", sys)
    red = sys ~ /^default_/ ? "default" : sys ~ /^ring_tcp_/ ? "ring_tcp" : ""
    if (red == "") next
    kind = substr(sys, length(red) + 2)
    key = kind (kind == "flat" ? "" : " " $4 " MiB")
    if (!(key in seen)) { seen[key] = 1; order[++nkeys] = key }
    ms[key, red] = ms[key, red] " " $8
  }
  END {
    printf "%-16s %14s %14s %18s\n", "sync per step", "default ms", "ring<tcp> ms", "ring<tcp>/default"
    for (i = 1; i <= nkeys; ++i) {
      k = order[i]
      d = median(ms[k, "default"]); r = median(ms[k, "ring_tcp"])
      printf "%-16s %14.1f %14.1f %18s\n", k, d, r, (d > 0 ? sprintf("%.2fx", r / d) : "-")
    }
  }' "$tmp/rows"

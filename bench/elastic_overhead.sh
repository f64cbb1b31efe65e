#!/usr/bin/env bash
# The steady cost of being elastic: the same training loop (bench/restart_probe, a real model's
# shapes, the default reducer) as a plain group under `ddprun -n N` and as an elastic group under
# `ddprun -n N --elastic 2:N` (the vote in the store every step, the heartbeat's thread, the store
# in the launcher), nobody failing. The two alternate ROUNDS times in one sitting; each run's
# figure is its mean step after the first 3 steps (rank 0's clock from step 3 to the last step,
# over the steps between: a finer figure than one step's millisecond stamps), and the table
# gives each round's ratio (elastic / plain) and the median ratio.
#
# With ETCD=1 a third kind runs in each round: the elastic group with its store on a real
# three-member etcd cluster on loopback (scripts/etcd_cluster.sh, data on /dev/shm), under
# `ddprun --store` (docs/cluster.md).
#
#   bench/elastic_overhead.sh [ROUNDS] [BUILD_DIR] [PARAMS] [RANKS] [STEPS]
#       defaults: 9, build, tests/data/resnet50.params, 4, 40
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-9}
build=${2:-$root/build}
params=${3:-$root/tests/data/resnet50.params}
ranks=${4:-4}
steps=${5:-40}
tmp=$(mktemp -d)
etcd_url=""
if [[ ${ETCD:-0} == 1 ]]; then
  etcd_dir=$(mktemp -d /dev/shm/ddp-bench-etcd-XXXXXX)
  etcd_url=$("$root/scripts/etcd_cluster.sh" start "$etcd_dir") || { echo "elastic_overhead: etcd did not start"; exit 2; }
fi
trap '[[ -n $etcd_url ]] && "$root/scripts/etcd_cluster.sh" stop "$etcd_dir" && rm -rf "$etcd_dir"; rm -rf "$tmp"' EXIT
probe=$build/bench/restart_probe ddprun=$build/tools/ddprun
[[ -x $probe && -x $ddprun ]] || { echo "elastic_overhead: build $probe and $ddprun first (ninja -C $build)"; exit 2; }

# step_ms LOG: the mean step of rank 0's `step <n> run 0 at <ms>` lines after the first 3 steps
# (the first steps warm the buffers and the pages).
step_ms() {
  awk '/step [0-9]+ run 0 at/ { if (++n == 3) first = $NF; last = $NF }
       END { if (n > 4) printf "%.2f\n", (last - first) / (n - 3); else print "failed" }' "$1"
}
median() { printf '%s\n' "$@" | grep -v failed | sort -g | awk '{a[NR] = $1} END {print NR ? (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2) : "failed"}'; }

plain=() elastic=() ratio=() on_etcd=() etcd_ratio=()
for ((r = 1; r <= rounds; ++r)); do
  # Alternate which goes first, so that a drift of the machine weighs on both alike.
  kinds=$( ((r % 2)) && echo "plain elastic" || echo "elastic plain")
  [[ -n $etcd_url ]] && kinds=$( ((r % 2)) && echo "plain elastic etcd" || echo "etcd elastic plain")
  for kind in $kinds; do
    if [[ $kind == etcd ]]; then
      timeout 300 "$ddprun" -n "$ranks" --elastic 2:"$ranks" --store "$etcd_url" "$probe" "$params" --elastic \
        --steps "$steps" --kill-at -1 > "$tmp/etcd.$r" 2>&1
    elif [[ $kind == plain ]]; then
      timeout 300 "$ddprun" -n "$ranks" "$probe" "$params" --steps "$steps" --kill-at -1 > "$tmp/plain.$r" 2>&1
    else
      timeout 300 "$ddprun" -n "$ranks" --elastic 2:"$ranks" "$probe" "$params" --elastic --steps "$steps" --kill-at -1 \
        > "$tmp/elastic.$r" 2>&1
    fi
  done
  p=$(step_ms "$tmp/plain.$r") e=$(step_ms "$tmp/elastic.$r")
  plain+=("$p") elastic+=("$e")
  x=$(awk -v e="$e" -v p="$p" 'BEGIN { if (e > 0 && p > 0) printf "%.3f", e / p; else print "failed" }')
  ratio+=("$x")
  if [[ -n $etcd_url ]]; then
    t=$(step_ms "$tmp/etcd.$r")
    on_etcd+=("$t")
    etcd_ratio+=("$(awk -v e="$t" -v p="$p" 'BEGIN { if (e > 0 && p > 0) printf "%.3f", e / p; else print "failed" }')")
    echo "round $r: plain $p ms, elastic $e ms, elastic on etcd $t ms; / plain $x, ${etcd_ratio[-1]}" >&2
    continue
  fi
  echo "round $r: plain $p ms, elastic $e ms, elastic / plain $x" >&2
done
echo "elastic_overhead: $(basename "$params" .params), $ranks ranks, $steps steps a run, $rounds rounds, $(nproc) cores"
echo
echo '| group | steady step (median of the runs'"'"' means, ms) | runs (ms) |'
echo '|---|---|---|'
echo "| plain (ddprun -n $ranks) | $(median "${plain[@]}") | ${plain[*]} |"
echo "| elastic (ddprun -n $ranks --elastic 2:$ranks) | $(median "${elastic[@]}") | ${elastic[*]} |"
[[ -n $etcd_url ]] && echo "| elastic on etcd (ddprun -n $ranks --elastic 2:$ranks --store etcd://, 3 members) | $(median "${on_etcd[@]}") | ${on_etcd[*]} |"
echo
echo "elastic / plain, each round: ${ratio[*]}"
echo "elastic / plain, median of the rounds: $(median "${ratio[@]}")"
if [[ -n $etcd_url ]]; then
  echo "elastic on etcd / plain, each round: ${etcd_ratio[*]}"
  echo "elastic on etcd / plain, median of the rounds: $(median "${etcd_ratio[@]}")"
fi

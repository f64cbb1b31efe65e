#!/usr/bin/env bash
# The group's store on etcd beside the built-in store, in one sitting (docs/cluster.md):
#   1. rendezvous: N simulated ranks join (bench/etcd_rendezvous: the join_store every rank runs),
#      64 and 256 ranks, built-in store against a three-member etcd cluster on loopback;
#   2. the steady step: bench/elastic_overhead.sh ETCD=1 (plain, elastic, elastic on etcd);
#   3. recovery: bench/restart_time.sh ROWS=kill ETCD=1 (kill -> next committed step, each store).
# Wants a release build (the default BUILD_DIR is build-release: meson setup build-release
# --buildtype=release && ninja -C build-release bench/etcd_rendezvous bench/restart_probe tools/ddprun).
#
#   bench/etcd_store.sh [ROUNDS] [BUILD_DIR] [PARAMS]    defaults: 7, build-release, tests/data/resnet50.params
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-7}
build=${2:-$root/build-release}
params=${3:-$root/tests/data/resnet50.params}
[[ -x $build/bench/etcd_rendezvous ]] || { echo "etcd_store: build $build/bench/etcd_rendezvous first"; exit 2; }
dir=$(mktemp -d /dev/shm/ddp-bench-etcd-XXXXXX)
trap '"$root/scripts/etcd_cluster.sh" stop "$dir"; rm -rf "$dir"' EXIT
url=$("$root/scripts/etcd_cluster.sh" start "$dir") || { echo "etcd_store: etcd did not start"; exit 2; }
echo "## rendezvous (simulated ranks, threads of one process; $(nproc) cores)"
echo
"$build/bench/etcd_rendezvous" "$url" --ranks 64,256 --reps "$rounds" |
  awk -F, 'NR == 1 { print "| store | ranks | join, median of '"$rounds"' (ms) | min | max | failed |"; print "|---|---|---|---|---|---|"; next }
           { printf "| %s | %s | %s | %s | %s | %s |\n", $1, $2, $4, $5, $6, $7 }'
echo
echo "## the steady step"
echo
ETCD=1 "$root/bench/elastic_overhead.sh" "$rounds" "$build" "$params"
echo
echo "## recovery"
echo
ROWS=kill ETCD=1 "$root/bench/restart_time.sh" "$rounds" "$build" "$params"

#!/usr/bin/env bash
# What always-on mismatch detection costs: the 1 MiB allreduce (SIZE) with the collective
# descriptors on the wire and checked (bench/allreduce) against the same sweep without them
# (bench/allreduce_unchecked, built only for this), for 2 and 4 ranks (RANKS) on every tcp and
# shm reducer. Runs alternate ROUNDS times so that machine noise hits both alike; prints, per
# reducer, the median over rounds of each side's median time and the overhead.
#   bench/mismatch_cost.sh
#   ROUNDS=9 SIZE=4194304 RANKS="2 4 8" bench/mismatch_cost.sh
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build}
rounds=${ROUNDS:-7}
size=${SIZE:-1048576}
ranks=${RANKS:-2 4}
algos=${ALGOS:-ring_tcp,tree_tcp,ring_shm,tree_shm,ring_shm_zerocopy}
[[ -f $build/build.ninja ]] || meson setup "$build" --wrap-mode=nodownload
ninja -C "$build" bench/allreduce bench/allreduce_unchecked >/dev/null
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
for n in $ranks; do
  for ((i = 0; i < rounds; ++i)); do
    for v in allreduce allreduce_unchecked; do
      "$build/bench/$v" --ranks "$n" --min-bytes "$size" --max-bytes "$size" --iters 400 --algo "$algos" |
        tail -n +2 | sed "s/^/$v,/" >> "$tmp"
    done
  done
done
python3 - "$tmp" <<'PY'
import csv, statistics, sys
rows = {}
for r in csv.reader(open(sys.argv[1])):
    variant, system, algo, ranks, nbytes, iters, med = r[:7]
    rows.setdefault((algo, int(ranks), int(nbytes)), {}).setdefault(variant, []).append(float(med))
print("| reducer | ranks | bytes | checked (us) | unchecked (us) | overhead |")
print("|---|---|---|---|---|---|")
for (algo, n, b), v in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    c, u = statistics.median(v["allreduce"]), statistics.median(v["allreduce_unchecked"])
    print(f"| {algo} | {n} | {b} | {c:.1f} | {u:.1f} | {100 * (c - u) / u:+.2f}% |")
PY

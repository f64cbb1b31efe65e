#!/usr/bin/env bash
# What always-on mismatch detection costs: the 1 MiB allreduce (SIZE) as shipped (bench/allreduce)
# against the same sweep built with the descriptor comparisons compiled out
# (bench/allreduce_unchecked, -DDDP_DETAIL_SKIP_MISMATCH_CHECKS, built only for this), for 2 and
# 4 ranks (RANKS) on every tcp and shm reducer. The 32-byte descriptors still travel in both:
# on the wire they are 32 bytes per message (0.006 % of a 512 KiB ring chunk), and shm needs
# them anyway for its zero-copy offsets. Runs alternate ROUNDS times so that machine noise hits
# both alike; prints, per reducer, the median over rounds of each side's median and 10th
# percentile times and the overhead of each.
#   bench/mismatch_cost.sh
#   ROUNDS=9 SIZE=4194304 RANKS="2 4 8" bench/mismatch_cost.sh
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build}
rounds=${ROUNDS:-15}
size=${SIZE:-1048576}
ranks=${RANKS:-2 4}
algos=${ALGOS:-ring_tcp,tree_tcp,ring_shm,tree_shm,ring_shm_zerocopy}
[[ -f $build/build.ninja ]] || meson setup "$build" --wrap-mode=nodownload
ninja -C "$build" bench/allreduce bench/allreduce_unchecked bench/mismatch_check >/dev/null
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
check_ns=$("$build/bench/mismatch_check" | cut -d, -f2)
python3 - "$tmp" "$check_ns" <<'PY'
import csv, statistics, sys
rows = {}
for r in csv.reader(open(sys.argv[1])):
    variant, system, algo, ranks, nbytes, iters, med, p10 = r[:8]
    rows.setdefault((algo, int(ranks), int(nbytes)), {}).setdefault(variant, []).append((float(med), float(p10)))
print("| reducer | ranks | bytes | checked median (us) | unchecked median (us) | overhead | checked p10 | unchecked p10 | overhead |")
print("|---|---|---|---|---|---|---|---|---|")
for (algo, n, b), v in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    cm, um = (statistics.median(x[0] for x in v[k]) for k in ("allreduce", "allreduce_unchecked"))
    cp, up = (statistics.median(x[1] for x in v[k]) for k in ("allreduce", "allreduce_unchecked"))
    print(f"| {algo} | {n} | {b} | {cm:.1f} | {um:.1f} | {100 * (cm - um) / um:+.1f}% | {cp:.1f} | {up:.1f} | {100 * (cp - up) / up:+.1f}% |")
# The A/B above is only as exact as the machine is quiet. The check's own CPU time bounds its
# share: a tcp ring makes 2(n-1) checks per allreduce, a tree at most 2 log2(n) + 2, shm at
# most n-1 field comparisons of descriptors it reads anyway; 32 bytes ride along each message.
ns = float(sys.argv[2])
print(f"\none descriptor check: {ns:.1f} ns (bench/mismatch_check)")
print("| reducer | ranks | checks per allreduce | check time (us) | share of the checked median |")
print("|---|---|---|---|---|")
import math
for (algo, n, b), v in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    checks = 2 * (n - 1) if algo == "ring_tcp" else (2 * math.ceil(math.log2(n)) + 2 if algo == "tree_tcp" else n - 1)
    cm = statistics.median(x[0] for x in v["allreduce"])
    print(f"| {algo} | {n} | {checks} | {checks * ns / 1000:.4f} | {100 * checks * ns / 1000 / cm:.4f}% |")
PY

#!/usr/bin/env bash
# What always-on mismatch detection costs, for the 1 MiB allreduce (SIZE) on 2 and 4 ranks (RANKS)
# of every tcp and shm reducer. Every engine that compares descriptors runs one check,
# detail::mismatch (detail/collective.hpp): the ring and tree algorithms on each message, the
# shared-memory engine on each collective. bench/mismatch_check times that function on equal
# descriptors (the path taken when nothing is wrong); this script multiplies it by the checks
# per allreduce and sets the product against bench/allreduce's median over ROUNDS runs. The
# 32-byte descriptors travel whether or not they are compared (32 bytes per message, 0.006 % of
# a 512 KiB ring chunk; shm needs them anyway for its zero-copy offsets).
#
# An end-to-end A/B against a build with the comparisons compiled out is no longer made: it took
# a benchmark-only macro in the library's headers, and on a shared machine its two sides
# differed in both directions by up to 20 % (run-to-run noise, three orders of magnitude above
# the check's share), so it measured the machine, not the check.
#   bench/mismatch_cost.sh
#   ROUNDS=9 SIZE=4194304 RANKS="2 4 8" bench/mismatch_cost.sh
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build}
rounds=${ROUNDS:-5}
size=${SIZE:-1048576}
ranks=${RANKS:-2 4}
algos=${ALGOS:-ring_tcp,tree_tcp,ring_shm,tree_shm,ring_shm_zerocopy}
[[ -f $build/build.ninja ]] || meson setup "$build" --wrap-mode=nodownload
ninja -C "$build" bench/allreduce bench/mismatch_check >/dev/null
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
for n in $ranks; do
  for ((i = 0; i < rounds; ++i)); do
    "$build/bench/allreduce" --ranks "$n" --min-bytes "$size" --max-bytes "$size" --iters 400 --algo "$algos" |
      tail -n +2 >> "$tmp"
  done
done
check_ns=$("$build/bench/mismatch_check" | cut -d, -f2)
python3 - "$tmp" "$check_ns" <<'PY'
import csv, statistics, sys
rows = {}
for r in csv.reader(open(sys.argv[1])):
    system, algo, ranks, nbytes, iters, med, p10 = r[:7]
    rows.setdefault((algo, int(ranks), int(nbytes)), []).append(float(med))
# The check's own CPU time bounds its share: a tcp ring makes 2(n-1) checks per allreduce, a
# tree at most 2 log2(n) + 2, shm n - 1 (rank 0's descriptor against each other rank's).
ns = float(sys.argv[2])
print(f"one descriptor check: {ns:.1f} ns (bench/mismatch_check)")
print("| reducer | ranks | bytes | median (us) | checks per allreduce | check time (us) | share of the median |")
print("|---|---|---|---|---|---|---|")
import math
for (algo, n, b), v in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    checks = 2 * (n - 1) if algo == "ring_tcp" else (2 * math.ceil(math.log2(n)) + 2 if algo == "tree_tcp" else n - 1)
    cm = statistics.median(v)
    print(f"| {algo} | {n} | {b} | {cm:.1f} | {checks} | {checks * ns / 1000:.4f} | {100 * checks * ns / 1000 / cm:.4f}% |")
PY

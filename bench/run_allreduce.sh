#!/usr/bin/env bash
# One allreduce comparison run: the machine's limits, ddp (every reducer and transport), Gloo
# and Open MPI, for 2 and 4 ranks (RANKS), 4 KiB .. MAX_BYTES by 4x; then the table and the plot.
#   bench/run_allreduce.sh                  # build/ must exist (scripts/main.sh makes it)
#   RANKS="2 4 8" MAX_BYTES=67108864 bench/run_allreduce.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh bench
build=${BUILD:-build}
out=${OUT:-bench/results}
ranks=${RANKS:-2 4}
max=${MAX_BYTES:-268435456}
mkdir -p "$out"
[[ -f $build/build.ninja ]] || meson setup "$build" --wrap-mode=nodownload
ninja -C "$build" bench/allreduce bench/gloo_allreduce bench/mpi_allreduce >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
csv=$out/allreduce.csv
"$build/bench/allreduce" --algo machine > "$csv"
for n in $ranks; do
  echo "== $n ranks" >&2
  "$build/bench/allreduce" --ranks "$n" --max-bytes "$max" --algo ring_tcp,tree_tcp,ring_shm,tree_shm,ring_shm_zerocopy | tail -n +2 >> "$csv"
  # Bound a core per rank, as mpirun binds Open MPI's ranks (rows <algo>_bound), where they fit.
  if (( n <= $(nproc) )); then
    DDP_BENCH_BIND=1 "$build/bench/allreduce" --ranks "$n" --max-bytes "$max" --algo ring_shm,tree_shm | tail -n +2 >> "$csv"
  fi
  mpirun --oversubscribe -np "$n" "$build/bench/mpi_allreduce" --max-bytes "$max" | tail -n +2 >> "$csv"
  "$build/bench/gloo_allreduce" --ranks "$n" --max-bytes "$max" --algo ring_chunked,halving_doubling,allreduce_bcube | tail -n +2 >> "$csv"
done
/usr/bin/python3 bench/report.py "$csv" | tee "$out/allreduce.md"
/usr/bin/python3 bench/plot.py -o "$out/allreduce.png" "$csv"
echo "wrote $csv, $out/allreduce.md, $out/allreduce.png" >&2

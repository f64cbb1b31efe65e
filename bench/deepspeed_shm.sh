#!/usr/bin/env bash
# ddp's default reducer next to DeepSpeed's CPU shared-memory allreduce on one host, back to back
# in one sitting: float32 sum, 4 KiB .. MAX_BYTES by 4x, for 2 and 4 ranks (RANKS); then the table.
#   bench/deepspeed_shm.sh
#   WAIT_IDLE=1 SITTINGS=2 bench/deepspeed_shm.sh  # as the results in bench/results were made
#   RANKS="2" MAX_BYTES=67108864 DDP_TORCH_VENV=/path/to/venv bench/deepspeed_shm.sh
# ddp rows (DDP_ALGOS): `default` is ddp::auto_reducer on the caller's heap buffer (what a user
# gets by default), `default_alloc` the same with buffers from ddp::auto_allocator (where
# ddp::data_parallel puts its buckets), plus the named shm engines for comparison.
# DeepSpeed rows (DS_ALGOS): `shm` is deepspeed.comm.inference_all_reduce (its shm op),
# `gloo` deepspeed.comm.all_reduce. Writes $OUT/deepspeed_shm.csv (sitting 1;
# deepspeed_shm.<k>.csv for sitting k > 1) and $OUT/deepspeed_shm.md.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build-rel}   # an optimized build of the benchmarks (see below)
out=${OUT:-bench/results}
ranks=${RANKS:-2 4}
max=${MAX_BYTES:-268435456}
sittings=${SITTINGS:-1}
ddp_algos=${DDP_ALGOS:-default,default_alloc,ring_shm,tree_shm,ring_shm_zerocopy}
ds_algos=${DS_ALGOS:-shm}
# PyPI's torch in a venv (scripts/torch_venv.sh: DDP_TORCH_VENV), and deepspeed in it where missing.
# shellcheck source=../scripts/torch_venv.sh
source scripts/torch_venv.sh
if ! DS_ACCELERATOR=cpu "$py" -c 'import deepspeed, ninja' 2>/dev/null; then
  "$py" -m pip install -q deepspeed ninja
fi
if ! DS_ACCELERATOR=cpu "$py" -c 'import deepspeed, ninja' 2>/dev/null; then
  echo "deepspeed_shm.sh: deepspeed (with ninja, for its JIT-built shm op) is not importable from $py" >&2
  exit 1
fi

mkdir -p "$out"
[[ -f $build/build.ninja ]] || meson setup "$build" --buildtype=release -Dbench_optimization=build \
  -Dtests=disabled -Dexamples=disabled --wrap-mode=nodownload >/dev/null
ninja -C "$build" bench/allreduce >/dev/null
# A test build compiles the benchmarks at -O0 and they say so on stderr: refuse those figures.
if "$build/bench/allreduce" --ranks 2 --algo ring_shm --max-bytes 4096 --iters 1 2>&1 >/dev/null |
    grep -q 'without optimization'; then
  echo "deepspeed_shm.sh: $build/bench/allreduce is built without optimization;" \
    "use BUILD=<a build with -Dbench_optimization=build>" >&2
  exit 1
fi

# Busy share (%) of all cores over the next second, from /proc/stat: what else runs matters here,
# since DeepSpeed's ranks spin on their flags without ever yielding (see the peer's docstring).
busy() {
  local a b
  read -ra a < /proc/stat; sleep 1; read -ra b < /proc/stat
  local t=0 i
  for i in 1 2 3 4 5 6 7 8; do t=$((t + b[i] - a[i])); done
  echo $((100 - 100 * (b[4] + b[5] - a[4] - a[5]) / (t > 0 ? t : 1)))
}
# CPU time (ms) of the whole machine (busy, /proc/stat) and of this shell's waited-for children
# (bash's `times`); their growth over a section, less ours, is what other processes took.
jiffy_ms=$((1000 / $(getconf CLK_TCK)))
machine_ms() {
  local a t=0 i
  read -ra a < /proc/stat
  for i in 1 2 3 6 7 8; do t=$((t + a[i])); done
  echo $((t * jiffy_ms))
}
times_file=$(mktemp)
trap 'rm -f "$times_file" "$times_file".c[01]' EXIT
children_ms() {  # in this shell (a subshell has no children of ours): `children_ms > file`
  times > "$times_file"  # second line "XmY.YYYs XmY.YYYs": children's user and system time
  tail -1 "$times_file" | awk '{ s = 0; for (i = 1; i <= 2; i++) { split($i, p, "m"); s += p[1] * 60000 + p[2] * 1000 } print int(s) }'
}
# WAIT_IDLE=1: before each rank count, wait (up to 10 minutes) for the machine to be idle
# (below 10% busy for 3 seconds running), so another job's compile is less likely to land in the
# figures; each section's CSV notes say how much CPU other processes took while it ran.
settle() {
  [[ ${WAIT_IDLE:-0} == 1 ]] || return 0
  local i
  local quiet=0
  for ((i = 0; i < 600; i++)); do
    if (($(busy) < 10)); then ((++quiet >= 3)) && return 0; else quiet=0; fi
  done
  echo "deepspeed_shm.sh: the machine stayed busy; measuring anyway" >&2
}

csvs=()
for ((s = 1; s <= sittings; s++)); do
  csv=$out/deepspeed_shm.csv
  ((s == 1)) || csv=$out/deepspeed_shm.$s.csv
  echo "system,algo,ranks,bytes,iters,median_us,p10_us,algbw_GBps,busbw_GBps" > "$csv"
  echo "# sitting $s: $(date -u +%FT%TZ), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$csv"
  for n in $ranks; do
    settle
    echo "== sitting $s, $n ranks" >&2
    echo "# $n ranks: $(busy)% busy the second before" >> "$csv"
    children_ms > "$times_file.c0"; m0=$(machine_ms) w0=$SECONDS
    "$build/bench/allreduce" --ranks "$n" --max-bytes "$max" --algo "$ddp_algos" | tail -n +2 >> "$csv"
    "$py" bench/peers/deepspeed_shm_allreduce.py --ranks "$n" --max-bytes "$max" --algo "$ds_algos" \
      2> >(grep -v -e 'No CUDA runtime' -e 'Warning' >&2) | tail -n +2 >> "$csv"
    children_ms > "$times_file.c1"; m1=$(machine_ms) w1=$SECONDS
    c0=$(< "$times_file.c0") c1=$(< "$times_file.c1")
    other=$(((m1 - m0) - (c1 - c0)))
    ((other > 0)) || other=0
    echo "# $n ranks: other processes took $((other / 1000)).$(((other % 1000) / 100)) CPU-s of the" \
      "$((w1 - w0)) s this section ran ($((other / 10 / ((w1 - w0) > 0 ? (w1 - w0) : 1) / $(nproc)))% of the machine)" >> "$csv"
  done
  csvs+=("$csv")
done
/usr/bin/python3 bench/deepspeed_report.py "${csvs[@]}" | tee "$out/deepspeed_shm.md"
echo "wrote ${csvs[*]} and $out/deepspeed_shm.md" >&2

#!/usr/bin/env bash
# Joining at scale, ddp against PyTorch's TCPStore in the same run: N simulated ranks join
# through one store (bench/store_scale.cpp, bench/peers/torch_store_scale.py), then one table
# with the ratios (bench/results/store_scale.{csv,md}). Medians over REPS; the machine's load
# shows in the CSV's min/max. A size that fails costs TIMEOUT_MS.
#   bench/run_store_scale.sh                       # build/ must exist (scripts/main.sh makes it)
#   RANKS=1024,4096,16384 REPS=3 PROCS=8 TIMEOUT_MS=120000 bench/run_store_scale.sh
#   TORCH_RANKS=1024,4096 bench/run_store_scale.sh   # TCPStore on fewer sizes (each failed size
#                                                  # costs TIMEOUT_MS and a busy machine)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build}
out=${OUT:-bench/results}
ranks=${RANKS:-1024,4096,16384}
torch_ranks=${TORCH_RANKS:-$ranks}
reps=${REPS:-3}
procs=${PROCS:-8}
timeout_ms=${TIMEOUT_MS:-120000}
mkdir -p "$out"
[[ -f $build/build.ninja ]] || meson setup "$build" --wrap-mode=nodownload
ninja -C "$build" bench/store_scale >/dev/null
echo "# RLIMIT_NOFILE hard limit $(ulimit -Hn), somaxconn $(cat /proc/sys/net/core/somaxconn)," \
     "ephemeral ports $(tr '\t' - < /proc/sys/net/ipv4/ip_local_port_range), $(nproc) cores" >&2
csv=$out/store_scale.csv
# A failed size still prints its line (failed > 0), so neither exit status stops the run.
# ddp twice: connecting inside the timed part (a real start), and connected first (as TCPStore's
# script must run, its constructor holding the GIL: the like-for-like comparison).
"$build/bench/store_scale" --ranks "$ranks" --procs "$procs" --reps "$reps" --timeout-ms "$timeout_ms" > "$csv" || true
"$build/bench/store_scale" --ranks "$ranks" --procs "$procs" --reps "$reps" --timeout-ms "$timeout_ms" \
  --connect-first --no-header >> "$csv" || true
if /usr/bin/python3 -c 'import torch.distributed' 2>/dev/null; then
  /usr/bin/python3 bench/peers/torch_store_scale.py --ranks "$torch_ranks" --procs "$procs" --reps "$reps" \
    --timeout-ms "$timeout_ms" --no-header >> "$csv" || true
else
  echo "# PyTorch not found under /usr/bin/python3 (scripts/deps.sh bench): ddp only" >&2
fi
# One row per size. join: median; "connected": every rank's connection made before the clock.
# TCPStore/ddp: the ratio of the connected joins. A failed size shows "FAILED (k ranks)" and the
# time by which every rank had returned; its memory and descriptors are from after the failures.
python3 - "$csv" <<'PY' | tee "$out/store_scale.md"
import csv, sys
rows = {(r["system"], int(r["ranks"])): r for r in csv.DictReader(open(sys.argv[1]))}
def join(r):
    if r is None: return "-"
    t = "{:,.0f} ms".format(float(r["join_median_ms"]))
    return t if r["failed"] == "0" else "FAILED ({} ranks) at {}".format(r["failed"], t)
def pair(a, b, col, fmt):
    f = lambda r: "-" if r is None or r["failed"] != "0" else fmt.format(float(r[col]))
    return f(a) + " / " + f(b)
print("| ranks | ddp join | ddp join, connected | TCPStore join, connected | TCPStore/ddp (connected) "
      "| rank 0 RSS growth, ddp / TCPStore | rank 0 fds, ddp / TCPStore | requests per rank, ddp / TCPStore |")
print("|---|---|---|---|---|---|---|---|")
for n in sorted({k[1] for k in rows}):
    d, c, t = rows.get(("ddp", n)), rows.get(("ddp_connected", n)), rows.get(("torch", n))
    ratio = "-"
    if c and t and c["failed"] == "0" and t["failed"] == "0":
        ratio = "{:.1f}x".format(float(t["join_median_ms"]) / float(c["join_median_ms"]))
    print("| {:,} | {} | {} | {} | {} | {} | {} | {} |".format(
        n, join(d), join(c), join(t), ratio, pair(c or d, t, "rank0_rss_mib", "+{:.1f} MiB"),
        pair(c or d, t, "rank0_fds", "{:,.0f}"), pair(c or d, t, "requests_per_rank", "{:.0f}")))
PY
echo "wrote $csv, $out/store_scale.md" >&2

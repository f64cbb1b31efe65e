#!/usr/bin/python3
"""Turn one allreduce run (ddp + peers + machine rows, CSV of bench/peers/sweep.hpp) into the
markdown table of docs/performance.md: per ranks and size, the median of each system's best
algorithm, ratios of Open MPI and Gloo to ddp (above 1: ddp is faster), and the issue's targets.

    /usr/bin/python3 bench/report.py bench/results/allreduce.csv > bench/results/allreduce.md
"""
import csv
import sys
from collections import defaultdict

GROUPS = {
    "ddp tcp": ("ddp", ("ring_tcp", "tree_tcp")),
    "ddp shm": ("ddp", ("ring_shm", "tree_shm")),
    "ddp shm zero-copy": ("ddp", ("ring_shm_zerocopy",)),
    "Open MPI": ("openmpi", None),
    "Gloo": ("gloo", None),
}


def load(paths):
    rows = []
    for p in paths:
        with open(p) as f:
            for r in csv.DictReader(line for line in f if not line.startswith("#")):
                if r.get("system") in (None, "system"):
                    continue
                rows.append(r)
    return rows


def human(b):
    b = int(b)
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= k:
            return f"{b // k} {unit}"
    return f"{b} B"


def main():
    rows = load(sys.argv[1:])
    best = defaultdict(dict)  # (ranks, bytes) -> group -> (median, algo)
    machine = {}
    for r in rows:
        if r["system"] == "machine":
            machine[r["algo"]] = float(r["algbw_GBps"])
            continue
        key = (int(r["ranks"]), int(r["bytes"]))
        med = float(r["median_us"])
        for g, (system, algos) in GROUPS.items():
            if r["system"] == system and (algos is None or r["algo"] in algos):
                if g not in best[key] or med < best[key][g][0]:
                    best[key][g] = (med, r["algo"])
    add_bw = machine.get("add")
    print("Medians in microseconds (best algorithm of each system at that size, its name below the time);")
    print("ratio = peer time / ddp time, so above 1 means ddp is faster.\n")
    cols = list(GROUPS)
    for n in sorted({k[0] for k in best}):
        print(f"\n### {n} ranks\n")
        head = ["size"] + cols + ["MPI/ddp shm", "MPI/ddp zero-copy", "Gloo/ddp tcp"]
        if add_bw:
            head.append("zero-copy / memory limit")
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for (rn, b) in sorted(k for k in best if k[0] == n):
            cell = best[(rn, b)]
            line = [human(b)]
            for g in cols:
                line.append(f"{cell[g][0]:.1f} ({cell[g][1]})" if g in cell else "-")

            def ratio(peer, mine):
                if peer in cell and mine in cell:
                    return f"{cell[peer][0] / cell[mine][0]:.2f}x"
                return "-"

            line += [ratio("Open MPI", "ddp shm"), ratio("Open MPI", "ddp shm zero-copy"), ratio("Gloo", "ddp tcp")]
            if add_bw:
                limit_us = 2 * n * b / (add_bw * 1e3)
                zc = cell.get("ddp shm zero-copy")
                line.append(f"{zc[0] / limit_us:.2f} (limit {limit_us:.0f} us)" if zc else "-")
            print("| " + " | ".join(line) + " |")
    if machine:
        print(f"\nMachine, same run: memcpy {machine.get('memcpy', 0):.1f} GB/s moved, "
              f"a += b {machine.get('add', 0):.1f} GB/s touched (single thread, 64 MiB arrays).")


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""Tables of bench/deepspeed_shm.sh: ddp's default reducer against DeepSpeed's shm allreduce.

    /usr/bin/python3 bench/deepspeed_report.py bench/results/deepspeed_shm.csv [sitting2.csv ...]

Per rank count and size: medians (and 10th percentiles) in microseconds of ddp `default`
(auto_reducer on a heap buffer), ddp `default_alloc` (buffers from auto_allocator, as
data_parallel's buckets) and DeepSpeed `shm`; ratio = DeepSpeed / ddp, so above 1 means ddp is
faster. The first CSV fills the table; with more (further sittings), the last column gives the
DeepSpeed / ddp default ratio of each sitting, to show how much it moves between sittings.
"""
import csv
import sys
from collections import defaultdict


def load(path, notes):
    cells = defaultdict(dict)  # (ranks, bytes) -> "system/algo" -> (median, p10)
    with open(path) as f:
        lines = f.readlines()
        notes += [line[1:].strip() for line in lines if line.startswith("# ")]
        for r in csv.DictReader(line for line in lines if not line.startswith("#")):
            if r.get("system") in (None, "system"):
                continue
            cells[(int(r["ranks"]), int(r["bytes"]))][r["system"] + "/" + r["algo"]] = (
                float(r["median_us"]), float(r["p10_us"]))
    return cells


def human(b):
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= k:
            return f"{b // k} {unit}"
    return f"{b} B"


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    notes = []
    runs = [load(p, notes) for p in sys.argv[1:]]
    first = runs[0]

    def med(cell, key):
        return f"{cell[key][0]:.1f}" if key in cell else "-"

    def p10(cell, key):
        return f"{cell[key][1]:.1f}" if key in cell else "-"

    def ratio(cell, peer, mine):
        return f"{cell[peer][0] / cell[mine][0]:.2f}" if peer in cell and mine in cell else "-"

    DEF, ALLOC, DS = "ddp/default", "ddp/default_alloc", "deepspeed/shm"
    print("Medians (p10) in microseconds, float32 sum; ratio = DeepSpeed shm / ddp, above 1: ddp is faster.")
    print("ddp default: `ddp::auto_reducer` on the caller's heap buffer; ddp alloc: the same with buffers")
    print("from `ddp::auto_allocator` (in the shm segment, as `ddp::data_parallel` places its buckets).")
    for n in sorted({k[0] for k in first}):
        print(f"\n### {n} ranks\n")
        head = ["size", "ddp default", "DeepSpeed shm", "DS/ddp default", "ddp alloc", "DS/ddp alloc"]
        if len(runs) > 1:
            head.append("DS/ddp default, each sitting")
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for key in sorted(k for k in first if k[0] == n):
            c = first[key]
            line = [human(key[1]),
                    f"{med(c, DEF)} ({p10(c, DEF)})", f"{med(c, DS)} ({p10(c, DS)})", ratio(c, DS, DEF),
                    f"{med(c, ALLOC)} ({p10(c, ALLOC)})", ratio(c, DS, ALLOC)]
            if len(runs) > 1:
                line.append(" / ".join(ratio(r.get(key, {}), DS, DEF) for r in runs))
            print("| " + " | ".join(line) + " |")
    if notes:
        print("\nConditions (bench/deepspeed_shm.sh's notes; other processes' CPU time spoils both systems' figures,")
        print("DeepSpeed's most, since its ranks spin without yielding):\n")
        for line in notes:
            print(f"- {line}")
    others = sorted({k for c in first.values() for k in c} - {DEF, ALLOC, DS})
    if others:
        print("\nOther rows in the CSV (same sitting): " + ", ".join(others) + ".")


if __name__ == "__main__":
    main()

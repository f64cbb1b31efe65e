#!/usr/bin/env python3
"""Summarizes ddp_step runs with `--caps ...,auto` (bench/ddp_step.cpp): per run file and per
(model, ranks, reducer), the best fixed cap and its sync time, the cap autotune chose and the
auto row's sync time, and their ratio (auto / best fixed). Then, per configuration, the median
ratio over the runs.

  autotune_summary.py RUN.csv ... > bench/results/autotune.csv   (the medians go to stderr)
"""
import csv
import statistics
import sys

rows = []
for path in sys.argv[1:]:
    with open(path) as f:
        recs = [r for r in csv.DictReader(f) if r.get("system")]
    groups = {}
    for r in recs:
        sysname = r["system"]
        if not sysname.startswith("ddp_") or "_copy" not in sysname:
            continue
        reducer = sysname[len("ddp_"):sysname.index("_copy")]
        key = (r["model"], int(r["ranks"]), reducer)
        g = groups.setdefault(key, {"fixed": {}, "auto": None})
        if sysname.endswith("_copy_autofixed"):
            g["autofixed"] = float(r["sync_ms"])
        elif sysname.endswith("_copy_auto"):
            g["auto"] = (float(r["bucket_cap_mb"]), float(r["sync_ms"]))
        elif sysname.endswith("_copy"):
            g["fixed"][float(r["bucket_cap_mb"])] = float(r["sync_ms"])
    for (model, ranks, reducer), g in sorted(groups.items()):
        if not g["fixed"] or g["auto"] is None:
            continue
        best_cap = min(g["fixed"], key=lambda c: g["fixed"][c])
        auto_cap, auto_ms = g["auto"]
        rows.append({
            "run": path.rsplit("/", 1)[-1].split("_")[0],
            "model": model, "ranks": ranks, "reducer": reducer,
            "best_fixed_cap_mb": best_cap, "best_fixed_sync_ms": g["fixed"][best_cap],
            "auto_cap_mb": auto_cap, "auto_sync_ms": auto_ms,
            "fixed_sync_ms_at_auto_cap": g["fixed"].get(auto_cap, float("nan")),
            "ratio": auto_ms / g["fixed"][best_cap],
            "ratio_chosen_fixed": g["fixed"].get(auto_cap, float("nan")) / g["fixed"][best_cap],
            "autofixed_sync_ms": g.get("autofixed", float("nan")),
            "auto_over_autofixed": auto_ms / g.get("autofixed", float("nan")),
        })

fields = ["run", "model", "ranks", "reducer", "best_fixed_cap_mb", "best_fixed_sync_ms", "auto_cap_mb",
          "auto_sync_ms", "fixed_sync_ms_at_auto_cap", "ratio", "ratio_chosen_fixed", "autofixed_sync_ms",
          "auto_over_autofixed"]
w = csv.DictWriter(sys.stdout, fieldnames=fields, lineterminator="\n")
w.writeheader()
for r in rows:
    w.writerow({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in r.items()})

by = {}
for r in rows:
    by.setdefault((r["model"], r["ranks"], r["reducer"]), []).append(r)
print("| model | ranks | reducer | runs | best fixed cap (MiB): sync ms | auto's cap (MiB): sync ms | "
      "auto / best, median (range) | chosen cap's fixed row / best, median |", file=sys.stderr)
print("|---|---|---|---|---|---|---|---|", file=sys.stderr)
for (model, ranks, reducer), rs in sorted(by.items()):
    ratios = [r["ratio"] for r in rs]
    fixed = [r["ratio_chosen_fixed"] for r in rs]
    best = "; ".join(f"{r['best_fixed_cap_mb']:g}: {r['best_fixed_sync_ms']:.1f}" for r in rs)
    auto = "; ".join(f"{r['auto_cap_mb']:g}: {r['auto_sync_ms']:.1f}" for r in rs)
    print(f"| {model} | {ranks} | {reducer} | {len(rs)} | {best} | {auto} | {statistics.median(ratios):.2f} "
          f"({min(ratios):.2f}-{max(ratios):.2f}) | {statistics.median(fixed):.2f} |", file=sys.stderr)

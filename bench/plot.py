#!/usr/bin/python3
"""Plot ddp's benchmark CSVs next to the peers' (matplotlib, Agg backend).

    /usr/bin/python3 bench/plot.py -o allreduce.png gloo.csv mpi.csv ddp.csv
    /usr/bin/python3 bench/plot.py --kind step -o step.png torch_ddp.csv ddp_step.csv

--kind allreduce (default) reads system,algo,ranks,bytes,...,busbw_GBps rows and draws the
metric against message size (log x), one line per system/algo/ranks.
--kind step reads system,model,ranks,bucket_cap_mb,...,sync_ms rows and draws the metric against
the bucket cap, one line per system/model/ranks.
Lines starting with '#' and repeated header lines (from concatenated runs) are skipped; when
the same point appears more than once the last row wins.
"""

import argparse
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

KINDS = {
    "allreduce": {
        "x": "bytes",
        "series": ("system", "algo", "ranks"),
        "metrics": ("busbw_GBps", "algbw_GBps", "median_us", "p10_us"),
        "default": "busbw_GBps",
    },
    "step": {
        "x": "bucket_cap_mb",
        "series": ("system", "model", "ranks"),
        "metrics": ("sync_ms", "step_median_ms", "nosync_median_ms"),
        "default": "sync_ms",
    },
}

LABELS = {
    "bytes": "message size",
    "bucket_cap_mb": "bucket cap (MiB)",
    "busbw_GBps": "bus bandwidth (GB/s)",
    "algbw_GBps": "algorithm bandwidth (GB/s)",
    "median_us": "median time (us)",
    "p10_us": "10th percentile time (us)",
    "sync_ms": "synchronization per step (ms)",
    "step_median_ms": "step with DDP (ms)",
    "nosync_median_ms": "step without sync (ms)",
}


def read_rows(paths, kind):
    """Rows (dicts) of the requested kind from every file; other CSV shapes are skipped."""
    need = {KINDS[kind]["x"], *KINDS[kind]["series"]}
    rows = []
    for path in paths:
        with open(path) as f:
            lines = [line for line in f if line.strip() and not line.startswith("#")]
        header = None
        for rec in csv.reader(lines):
            if "system" in rec:  # a header, possibly one of several in a concatenated file
                header = rec
                continue
            if header is None or len(rec) != len(header):
                continue
            row = dict(zip(header, rec))
            if need <= row.keys():
                rows.append(row)
    return rows


def human_bytes(n, _pos=None):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:g} {unit}"
        n /= 1024
    return f"{n:g} TiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("-o", "--output", default="bench.png")
    ap.add_argument("--kind", choices=sorted(KINDS), default="allreduce")
    ap.add_argument("--metric", help="column on the y axis (default: busbw_GBps or sync_ms)")
    ap.add_argument("--ranks", type=int, nargs="*", help="only these rank counts")
    ap.add_argument("--title")
    args = ap.parse_args()

    spec = KINDS[args.kind]
    metric = args.metric or spec["default"]
    if metric not in spec["metrics"]:
        ap.error(f"--metric for --kind {args.kind}: one of {', '.join(spec['metrics'])}")

    rows = read_rows(args.csv, args.kind)
    if args.ranks:
        rows = [r for r in rows if int(r["ranks"]) in args.ranks]
    if not rows:
        print(f"plot.py: no {args.kind} rows in {', '.join(args.csv)}", file=sys.stderr)
        return 1

    series = {}
    for r in rows:
        key = tuple(r[c] for c in spec["series"])
        series.setdefault(key, {})[float(r[spec["x"]])] = float(r[metric])

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for key in sorted(series, key=lambda k: (int(k[2]), k[0], k[1])):
        points = sorted(series[key].items())
        label = f"{key[0]} {key[1]} ({key[2]} ranks)"
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3,
                label=label)

    ax.set_xscale("log", base=2)
    if args.kind == "allreduce":
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(human_bytes))
    else:
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    if metric.endswith("_us"):
        ax.set_yscale("log")  # 1 us to 100 ms in one sweep
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel(LABELS[spec["x"]])
    ax.set_ylabel(LABELS[metric])
    default_title = ("allreduce, float32 sum" if args.kind == "allreduce"
                     else "data-parallel step: gradient synchronization")
    ax.set_title(args.title or default_title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output} ({len(series)} lines)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

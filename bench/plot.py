#!/usr/bin/python3
"""Plot ddp's benchmark CSVs next to the peers' (matplotlib, Agg backend).

    /usr/bin/python3 bench/plot.py -o allreduce.png gloo.csv mpi.csv ddp.csv
    /usr/bin/python3 bench/plot.py --kind step -o step.png torch_ddp.csv ddp_step.csv
    /usr/bin/python3 bench/plot.py --kind sweep -o sweep.png bench/results/cap_sweep.csv

--kind allreduce (default) reads system,algo,ranks,bytes,...,busbw_GBps rows and draws the
metric against message size (log x), one line per system/algo/ranks.
--kind step reads system,model,ranks,bucket_cap_mb,...,sync_ms rows and draws the metric against
the bucket cap, one line per system/model/ranks.
--kind sweep reads the same rows (bench/cap_sweep.py's medians) and draws one panel per model and
rank count, one line per system (reducer and mode, PyTorch DDP), each line's minimum marked; the
one flat allreduce of the default reducer (`ddp_default_flat`) is a dashed floor, rows with
simulated compute (`_compute`) are left out.
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
    "sweep": {
        "x": "bucket_cap_mb",
        "series": ("system", "model", "ranks"),
        "metrics": ("sync_ms", "exposed_median_ms", "step_median_ms", "nosync_median_ms"),
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
    "exposed_median_ms": "exposed: last gradient to finish() (ms)",
}

# Fixed colours, so that a reducer has the same colour in every panel and every figure.
SWEEP_STYLE = {
    "pytorch_ddp_gloo": ("black", "PyTorch DDP (gloo)"),
    "ddp_default_copy": ("tab:blue", "ddp default, copy"),
    "ddp_default_view": ("tab:cyan", "ddp default, view"),
    "ddp_ring_tcp_copy": ("tab:red", "ring<tcp>, copy"),
    "ddp_tree_tcp_copy": ("tab:orange", "tree<tcp>, copy"),
    "ddp_ring_shm_copy": ("tab:green", "ring<shm>, copy"),
    "ddp_tree_shm_copy": ("tab:olive", "tree<shm>, copy"),
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


def sweep_series(rows, metric):
    """{(model, ranks): {system: [(cap, value)]}}, flat rows apart as {(model, ranks): value}."""
    panels, flats = {}, {}
    for r in rows:
        value = r.get(metric, "")
        if value in ("", None) or r["system"].endswith("_compute"):
            continue
        key = (r["model"], int(r["ranks"]))
        if r["system"].endswith("_flat"):
            if r["system"] == "ddp_default_flat":
                flats[key] = float(value)
            continue
        panels.setdefault(key, {}).setdefault(r["system"], {})[float(r["bucket_cap_mb"])] = float(value)
    return ({k: {s: sorted(pts.items()) for s, pts in v.items()} for k, v in panels.items()}, flats)


def draw_sweep(rows, output, metric="sync_ms", title=None):
    """One panel per (model, ranks): metric against bucket cap, a line per system, minima marked.

    Returns the number of panels drawn (0: nothing of this metric in rows)."""
    panels, flats = sweep_series(rows, metric)
    if not panels:
        return 0
    models = sorted({k[0] for k in panels})
    ranks = sorted({k[1] for k in panels})
    fig, axes = plt.subplots(len(models), len(ranks), figsize=(5.2 * len(ranks), 4.2 * len(models) + 1.2),
                             squeeze=False)
    handles = {}
    for i, model in enumerate(models):
        for j, n in enumerate(ranks):
            ax = axes[i][j]
            series = panels.get((model, n), {})
            if not series:
                ax.set_axis_off()
                ax.text(0.5, 0.5, f"{model}, {n} ranks: not measured", ha="center", va="center",
                        transform=ax.transAxes)
                continue
            order = sorted(series, key=lambda s: (s != "pytorch_ddp_gloo", s))
            for system in order:
                pts = series[system]
                colour, label = SWEEP_STYLE.get(system, (None, system))
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                style = "--" if system == "pytorch_ddp_gloo" else "-"
                (line,) = ax.plot(xs, ys, style, marker="o", markersize=3, color=colour, label=label)
                handles.setdefault(label, line)
                best = min(pts, key=lambda p: p[1])
                ax.plot([best[0]], [best[1]], marker="*", markersize=13, color=line.get_color(),
                        markeredgecolor="black", markeredgewidth=0.6, linestyle="none")
            if (model, n) in flats:
                flat = ax.axhline(flats[(model, n)], color="grey", linestyle=":", linewidth=1.2,
                                  label="one flat allreduce (default reducer)")
                handles.setdefault(flat.get_label(), flat)
            default = ax.axvline(25, color="grey", linewidth=0.8, alpha=0.5, label="25 MiB: both defaults")
            handles.setdefault(default.get_label(), default)
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
            ax.set_yscale("log")
            ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
                lambda y, _: f"{y:g}" if f"{y:g}"[0] in "25" else ""))
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
            ax.set_title(f"{model}, {n} ranks", fontsize="medium")
            ax.grid(True, which="both", alpha=0.3)
            if i == len(models) - 1:
                ax.set_xlabel(LABELS["bucket_cap_mb"] + "; star: the line's minimum")
            if j == 0:
                ax.set_ylabel(LABELS[metric])
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize="small",
               frameon=False)
    fig.suptitle(title or "gradient synchronization per step against bucket cap")
    # The legend keeps about an inch at the bottom, the title half an inch at the top, whatever
    # the number of panel rows.
    height = fig.get_figheight()
    fig.tight_layout(rect=(0, 1.0 / height, 1, 1 - 0.45 / height))
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return len(panels)


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
    if args.kind == "sweep":
        if not draw_sweep(rows, args.output, metric, args.title):
            print(f"plot.py: no {metric} values in {', '.join(args.csv)}", file=sys.stderr)
            return 1
        print(f"wrote {args.output}", file=sys.stderr)
        return 0

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

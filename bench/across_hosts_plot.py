#!/usr/bin/python3
"""Plot bench/across_hosts.sh's rows: per layout and link, each system's sync time over the link bound.

    /usr/bin/python3 bench/across_hosts_plot.py -o bench/results/across_hosts.png bench/results/across_hosts.csv

Rows: layout,rate,round,system,model,ranks,cap,steps,step_ms,nosync_ms,sync_ms[,...] (the CSV=
file of across_hosts.sh). One panel per model; groups of bars per layout and link; the bar is the
median sync time over the rounds divided by the uncompressed link bound (2 (H - 1) / H of the
gradient bytes over one link), so 1.0 is the bound of an uncompressed allreduce and bars below it
are compression's. Lines starting with '#' are skipped.
"""

import argparse
import math
import os
import statistics
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORDER = ["ddp_default_copy", "ddp_default_view", "ddp_default_fp16_copy", "ddp_default_powersgd_copy", "pytorch_ddp_gloo",
         "pytorch_ddp_gloo_fp16", "pytorch_ddp_gloo_powersgd"]
LABEL = {"ddp_default_copy": "ddp default (copy)", "ddp_default_view": "ddp view",
         "ddp_default_fp16_copy": "ddp fp16_compress",
         "ddp_default_powersgd_copy": "ddp powersgd (rank 1)", "pytorch_ddp_gloo": "PyTorch DDP",
         "pytorch_ddp_gloo_fp16": "PyTorch fp16 hook", "pytorch_ddp_gloo_powersgd": "PyTorch PowerSGD (rank 1)"}


def model_bytes(model):
    n = 0
    with open(os.path.join(ROOT, "tests", "data", model + ".params")) as f:
        for line in f:
            d = line.split()[1:]
            if d and not line.startswith("#"):
                n += math.prod(int(x) for x in d)
    return 4 * n


def rate_bps(r):
    r = r.lower()
    for suf, mul in (("gbit", 1e9), ("mbit", 1e6)):
        if r.endswith(suf):
            return float(r[: -len(suf)]) * mul
    return float(r)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    ms = defaultdict(list)
    for path in a.csv:
        with open(path) as f:
            for line in f:
                p = line.strip().split(",")
                if line.startswith("#") or len(p) < 11:
                    continue
                ms[(p[4], p[0], p[1], p[3])].append(float(p[10]))
    models = sorted({k[0] for k in ms})
    fig, axes = plt.subplots(len(models), 1, figsize=(11, 3.6 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        groups = sorted({(k[1], k[2]) for k in ms if k[0] == model}, key=lambda g: (g[0], -rate_bps(g[1])))
        systems = [s for s in ORDER if any((model, g[0], g[1], s) in ms for g in groups)]
        width = 0.8 / max(1, len(systems))
        for i, s in enumerate(systems):
            xs, ys = [], []
            for j, (layout, rate) in enumerate(groups):
                v = ms.get((model, layout, rate, s))
                if not v:
                    continue
                hosts = int(layout.split("x")[0])
                bound = model_bytes(model) * 2 * (hosts - 1) / hosts * 8 / rate_bps(rate) * 1e3
                xs.append(j + (i - (len(systems) - 1) / 2) * width)
                ys.append(statistics.median(v) / bound)
            ax.bar(xs, ys, width, label=LABEL.get(s, s))
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{layout} hosts x ranks\n{rate}" for layout, rate in groups])
        ax.set_ylabel("sync / link bound")
        ax.set_title(f"{model}: gradient sync per step over the uncompressed link bound (lower is better)")
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()

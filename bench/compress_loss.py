#!/usr/bin/python3
"""Loss curves of examples/01_mlp.cpp with and without gradient compression.

Runs `ddprun -n RANKS 01_mlp --compress C` for C in none, fp16, bf16, collects the loss it
prints per epoch and the largest weight difference from its single-process run, and writes

  bench/results/compress_loss.csv   compress,epoch,loss   (and one row per run: epoch "final",
                                    loss = max |weight - single-process weight|)
  bench/results/compress_loss.png   the three loss curves (log scale), and the relative
                                    difference of each compressed curve from the uncompressed one

  /usr/bin/python3 bench/compress_loss.py [--build build] [--ranks 4] [--out bench/results]
"""
import argparse
import csv
import pathlib
import re
import subprocess
import sys

EPOCH = re.compile(r"^(?:\[\d+\]\s*)?epoch\s+(\d+)\s+loss\s+([0-9.eE+-]+)", re.M)
DIFF = re.compile(r"max \|difference\| of weights ([0-9.eE+-]+)")


def run(build, ranks, compress):
    cmd = [str(build / "tools" / "ddprun"), "-n", str(ranks), str(build / "examples" / "01_mlp")]
    if compress != "none":
        cmd += ["--compress", compress]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    losses = [(int(e), float(v)) for e, v in EPOCH.findall(p.stdout)]
    diff = DIFF.search(p.stdout)
    return losses, float(diff.group(1)) if diff else float("nan"), p.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    build, out = pathlib.Path(a.build), pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for c in ("none", "fp16", "bf16"):
        losses, diff, text = run(build, a.ranks, c)
        runs[c] = (losses, diff)
        print(f"# {c}: final loss {losses[-1][1]:.6f}, max weight difference from one process {diff:.3g}")
    with open(out / "compress_loss.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["compress", "ranks", "epoch", "loss"])
        for c, (losses, diff) in runs.items():
            for e, v in losses:
                w.writerow([c, a.ranks, e, f"{v:.6f}"])
            w.writerow([c, a.ranks, "final_weight_diff", f"{diff:.3g}"])
    base = dict(runs["none"][0])
    print("epoch," + ",".join(f"{c}_loss" for c in runs) + ",fp16_rel,bf16_rel")
    for e in sorted(base):
        row = [dict(runs[c][0])[e] for c in runs]
        rel = [(dict(runs[c][0])[e] - base[e]) / base[e] for c in ("fp16", "bf16")]
        print(f"{e}," + ",".join(f"{v:.6f}" for v in row) + "," + ",".join(f"{r:+.2e}" for r in rel))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib not found: no PNG (run under /usr/bin/python3)")
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    styles = {"none": ("k", "-", "f32 (uncompressed)"), "fp16": ("tab:blue", "--", "fp16_compress"),
              "bf16": ("tab:orange", ":", "bf16_compress")}
    for c, (losses, _) in runs.items():
        col, ls, lab = styles[c]
        ax.plot([e for e, _ in losses], [v for _, v in losses], color=col, linestyle=ls, marker="o", ms=3, label=lab)
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss (MSE)")
    ax.set_title(f"examples/01_mlp, {a.ranks} ranks")
    ax.legend()
    for c in ("fp16", "bf16"):
        col, ls, lab = styles[c]
        losses = runs[c][0]
        bx.plot([e for e, _ in losses], [abs(v - base[e]) / base[e] for e, v in losses], color=col, linestyle=ls,
                marker="o", ms=3, label=lab)
    bx.set_yscale("log")
    bx.set_xlabel("epoch")
    bx.set_ylabel("|loss - f32 loss| / f32 loss")
    bx.set_title("difference from the uncompressed run\n(epochs equal to the printed 6 decimals are not drawn)", fontsize=10)
    bx.legend()
    fig.tight_layout()
    fig.savefig(out / "compress_loss.png", dpi=110)
    print(f"# wrote {out / 'compress_loss.csv'} and {out / 'compress_loss.png'}")


if __name__ == "__main__":
    main()

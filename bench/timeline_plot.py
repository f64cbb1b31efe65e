#!/usr/bin/env python3
"""Draws one step of ddp's timeline files (DDP_TIMELINE; docs/tuning.md) as a PNG, every rank's
tracks under one time axis, the way Perfetto lays them out: per rank its engine thread (the
step, backward, finish() and in it the waits and copies, the launches) and its progress thread
(the collectives). Drawn by this script from the trace files; Perfetto shows the same events.

  timeline_plot.py [--step N] [-o step.png] [--title T] /tmp/t.rank0.json /tmp/t.rank1.json ...

--step: the step to draw (default: the synchronized step of median duration on rank 0's file).
Needs matplotlib (Debian: /usr/bin/python3 with python3-matplotlib).
"""
import argparse
import collections
import json
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

COLORS = {
    "step": "#d9d9d9",
    "backward": "#9ecae1",
    "finish()": "#fdd0a2",
    "launch": "#31a354",
    "allreduce": "#6baed6",
    "wait": "#e6550d",
    "copy": "#756bb1",
}
LEGEND = [
    ("step", "step N"),
    ("backward", "backward (first to last grad_ready)"),
    ("finish()", "finish()"),
    ("launch", "launch bucket b"),
    ("allreduce", "allreduce bucket b (progress thread)"),
    ("wait", "wait bucket b (exposed)"),
    ("copy", "copy back bucket b"),
]


def kind(name):
    if name.startswith("step "):
        return "step"
    for k in ("launch", "allreduce", "wait", "copy"):
        if name.startswith(k):
            return k
    return name


def load(paths):
    events, thread_names = [], {}
    for p in paths:
        with open(p, encoding="utf-8") as f:
            doc = json.load(f)
        for e in doc["traceEvents"]:
            if e.get("ph") == "M" and e.get("name") == "thread_name":
                thread_names[(e["pid"], e["tid"])] = e["args"]["name"]
            elif e.get("ph") in ("X", "i"):
                events.append(e)
    return events, thread_names


def pick_step(events):
    rank0 = min(e["pid"] for e in events)
    spans = [e for e in events if e["pid"] == rank0 and e["ph"] == "X" and re.fullmatch(r"step \d+", e["name"])]
    if not spans:
        sys.exit("no synchronized step in the files")
    spans.sort(key=lambda e: e["dur"])
    return spans[len(spans) // 2]["args"]["step"]


def depths(spans):
    """Nesting depth of each span on one track (spans nest; see check_timeline.py)."""
    out, stack = {}, []  # stack of span ends, in integer nanoseconds
    for e in sorted(spans, key=lambda e: (round(e["ts"] * 1000), -round(e["dur"] * 1000))):
        b = round(e["ts"] * 1000)
        while stack and stack[-1] <= b:
            stack.pop()
        out[id(e)] = len(stack)
        stack.append(b + round(e["dur"] * 1000))
    return out


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--step", type=int)
    ap.add_argument("-o", "--output", default="timeline.png")
    ap.add_argument("--title")
    a = ap.parse_args(argv)
    events, thread_names = load(a.files)
    step = a.step if a.step is not None else pick_step(events)
    mine = [e for e in events if (e.get("args") or {}).get("step") == step]
    if not mine:
        sys.exit(f"no events of step {step}")
    t0 = min(e["ts"] for e in mine)
    tracks = collections.defaultdict(list)
    for e in mine:
        tracks[(e["pid"], e["tid"])].append(e)
    # Per rank: engine threads first, then the progress thread.
    order = sorted(tracks, key=lambda k: (k[0], "progress" in thread_names.get(k, ""), k[1]))
    lane_h, gap = 0.8, 0.5
    rows, y = [], 0.0
    for key in order:
        d = depths([e for e in tracks[key] if e["ph"] == "X"])
        n = max(d.values(), default=0) + 1
        rows.append((key, y, n, d))
        y += n * lane_h + gap
    fig_h = max(2.5, 0.35 * y + 1.4)
    fig, ax = plt.subplots(figsize=(13, fig_h))
    end = 0.0
    for key, y0, n, d in rows:
        for e in tracks[key]:
            x = (e["ts"] - t0) / 1000.0
            if e["ph"] == "i":
                yy = y0 + (n - 0.5) * lane_h
                ax.plot([x], [yy], marker="v", color="black", markersize=5)
                continue
            w = e["dur"] / 1000.0
            end = max(end, x + w)
            k = kind(e["name"])
            yy = y0 + d[id(e)] * lane_h
            ax.broken_barh([(x, max(w, 0.02))], (yy, lane_h * 0.9), facecolors=COLORS.get(k, "#bbbbbb"),
                           edgecolor="black", linewidth=0.3)
            b = (e.get("args") or {}).get("bucket")
            label = e["name"] if k in ("step", "backward", "finish()") else (f"b{b}" if b is not None else "")
            if label and w > 0:
                ax.text(x + w / 2, yy + lane_h * 0.45, label, ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks([y0 + n * lane_h / 2 for _, y0, n, _ in rows])
    ax.set_yticklabels([thread_names.get(key, f"rank {key[0]} thread {key[1]}") for key, _, _, _ in rows], fontsize=8)
    ax.set_ylim(y + 0.2, -0.3)
    ax.set_xlim(0, end * 1.01 if end > 0 else 1)
    ax.set_xlabel(f"ms from the start of step {step}")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    ax.legend(handles=[Patch(facecolor=COLORS[k], edgecolor="black", label=t) for k, t in LEGEND] +
              [plt.Line2D([], [], marker="v", color="black", linestyle="", label="bucket b ready")],
              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, fontsize=8, frameon=False)
    ax.set_title(a.title or f"ddp timeline, step {step}, {len({k[0] for k in order})} ranks", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.output, dpi=110)
    print(f"{a.output}: step {step}, {len(mine)} events, {len(rows)} tracks")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

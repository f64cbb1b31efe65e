#!/usr/bin/python3
"""Bucket-size sweep: gradient synchronization per step against the bucket cap, for every ddp
reducer and for PyTorch DDP (gloo), measured in one run.

    /usr/bin/python3 bench/cap_sweep.py                     # full run, about 15 minutes on 2 cores
    /usr/bin/python3 bench/cap_sweep.py --quick             # 3 caps, 1 round, ResNet-50: a check
    /usr/bin/python3 bench/cap_sweep.py --models tests/data/resnet50.params --ranks 2 \\
        --reducers default,ring_shm --rounds 5 --out /tmp/sweep

For each rank count and model, each round runs, one after the other so that both meet the same
machine: build/bench/ddp_step (every reducer in copy mode and the reducers of --view-reducers in
view mode, at every cap, plus one flat allreduce of all gradient bytes and, with --compute, the
bench's rows with simulated backward compute at its fixed 25 MiB cap), then
bench/peers/torch_ddp.py at the same caps (one process group for all of them). Caps are the
list given plus the model's own size (every gradient in one bucket after the 1 MiB first bucket)
when that exceeds the largest cap.

Writes OUT_rounds.csv (every row of every round, with its round; appended as rows arrive, so a
run cut short keeps what it measured), OUT.csv (per point the median over rounds of each
column, and the smallest and largest sync_ms of the rounds: the noise), OUT.png (sync ms against
cap, a panel per model and rank count, each line's minimum starred) and OUT_exposed.png (ddp's
exposed time: last gradient ready to finish() returning), and prints the table of best caps.

Every child runs in a session of its own and is killed with all its ranks when it overstays
--timeout, so that no orphaned rank keeps spinning under the runs that follow.
"""

import argparse
import csv
import math
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import plot  # noqa: E402  (bench/plot.py: the drawing)

COLUMNS = ["system", "model", "ranks", "bucket_cap_mb", "steps", "step_median_ms", "nosync_median_ms",
           "sync_ms", "exposed_median_ms", "compute_ms"]
VALUES = COLUMNS[5:]
TORCH = "pytorch_ddp_gloo"
FULL_CAPS = [0.5, 1, 2, 4, 8, 16, 25, 50, 100]
QUICK_CAPS = [1, 25, 100]


def model_mib(path):
    """Bytes of float32 gradients of a params file ('name dim dim ...' lines), in MiB."""
    elems = 0
    with open(path) as f:
        for line in f:
            parts = line.split()
            if parts and not parts[0].startswith("#"):
                elems += math.prod(int(d) for d in parts[1:])
    return elems * 4 / (1 << 20)


def bucket_count(path, cap_mib, first_mib=1.0):
    """Buckets ddp's size_planner makes of a params file (reverse registration order; a parameter
    that would push a non-empty bucket past its cap closes it first; a bucket at its cap closes),
    the first capped at min(cap, first_mib) as ddp_step sets it."""
    sizes = []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if parts and not parts[0].startswith("#"):
                sizes.append(math.prod(int(d) for d in parts[1:]) * 4)
    cap, first = cap_mib * (1 << 20), min(cap_mib, first_mib) * (1 << 20)
    count, fill = 0, 0
    for b in reversed(sizes):
        limit = first if count == 0 else cap
        if fill and fill + b > limit:
            count, fill = count + 1, 0
            limit = cap
        fill += b
        if fill >= limit:
            count, fill = count + 1, 0
    return count + (1 if fill else 0)


def run(cmd, timeout, log):
    """Runs cmd in its own session; returns (ok, stdout). Past timeout its whole group is killed,
    and what it printed until then is kept."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=timeout)
        ok = proc.returncode == 0
        why = f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        ok, why = False, f"killed after {timeout} s"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    # ddp_step forks its ranks into the same group: none may outlive a run that failed.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    secs = time.monotonic() - t0
    print(f"  {secs:6.1f} s  {' '.join(cmd)}" + ("" if ok else f"  FAILED ({why})"), file=log, flush=True)
    if not ok:
        print("\n".join(err.strip().splitlines()[-15:]), file=log, flush=True)
    return ok, out


def parse_rows(text):
    """CSV rows of ddp_step / torch_ddp.py output, as dicts over COLUMNS ('' where absent)."""
    rows, header = [], None
    for rec in csv.reader(line for line in text.splitlines() if line.strip() and not line.startswith("#")):
        if rec and rec[0] == "system":
            header = rec
            continue
        if header is None or len(rec) != len(header):
            continue
        row = dict(zip(header, rec))
        rows.append({c: row.get(c, "") for c in COLUMNS})
    return rows


def summarize(raw):
    """Per (system, model, ranks, cap): the median over rounds of every value column."""
    groups = {}
    for r in raw:
        key = (r["system"], r["model"], int(r["ranks"]), float(r["bucket_cap_mb"]))
        groups.setdefault(key, []).append(r)
    out = []
    for (system, model, ranks, cap), rs in sorted(groups.items()):
        row = {"system": system, "model": model, "ranks": ranks, "bucket_cap_mb": f"{cap:g}",
               "rounds": len(rs), "steps": rs[0]["steps"]}
        for c in VALUES:
            vals = [float(r[c]) for r in rs if r[c] not in ("", None)]
            row[c] = f"{statistics.median(vals):.3f}" if vals else ""
        sync = [float(r["sync_ms"]) for r in rs]
        row["sync_min_ms"], row["sync_max_ms"] = f"{min(sync):.3f}", f"{max(sync):.3f}"
        out.append(row)
    return out


SUMMARY_COLUMNS = ["system", "model", "ranks", "bucket_cap_mb", "rounds", "steps", "sync_ms", "sync_min_ms",
                   "sync_max_ms", "step_median_ms", "nosync_median_ms", "exposed_median_ms", "compute_ms"]


def best_table(summary, model_paths):
    """Markdown: per model and ranks, each curve's best cap and PyTorch's at 25 MiB and at its best."""
    paths = {os.path.splitext(os.path.basename(p))[0]: p for p in model_paths}
    curves = {}
    for r in summary:
        s = r["system"]
        if s.endswith("_flat") or s.endswith("_compute"):
            continue
        curves.setdefault((r["model"], r["ranks"]), {}).setdefault(s, []).append(
            (float(r["bucket_cap_mb"]), float(r["sync_ms"]), float(r["sync_min_ms"]), float(r["sync_max_ms"])))
    lines = ["| model | ranks | system | best cap (MiB) | buckets | sync at best (ms, rounds' range) | at 25 MiB (ms) | "
             "best / 25 MiB | PyTorch at 25 MiB / this at best |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (model, ranks) in sorted(curves):
        systems = curves[(model, ranks)]
        torch25 = dict((c, v) for c, v, _, _ in systems.get(TORCH, [])).get(25.0)
        for s in sorted(systems, key=lambda s: (s != TORCH, s)):
            pts = systems[s]
            cap, v, lo, hi = min(pts, key=lambda p: p[1])
            at25 = dict((c, val) for c, val, _, _ in pts).get(25.0)
            nb = bucket_count(paths[model], cap) if model in paths else "-"
            lines.append(f"| {model} | {ranks} | {s} | {cap:g} | {nb} | {v:.1f} ({lo:.1f}-{hi:.1f}) | "
                         + (f"{at25:.1f} | {v / at25:.2f} |" if at25 else "- | - |")
                         + (f" {torch25 / v:.2f}x |" if torch25 else " - |"))
    return "\n".join(lines)


def noise(raw):
    """The spread of rounds: median and largest (max - min) / median of sync_ms over points."""
    groups = {}
    for r in raw:
        groups.setdefault((r["system"], r["model"], r["ranks"], r["bucket_cap_mb"]), []).append(float(r["sync_ms"]))
    spreads = [(max(v) - min(v)) / statistics.median(v) for v in groups.values() if len(v) > 1 and statistics.median(v) > 0]
    if not spreads:
        return "one round: no spread"
    return (f"spread of rounds, (max - min) / median of sync_ms: median {statistics.median(spreads):.0%}, "
            f"90th percentile {sorted(spreads)[int(0.9 * (len(spreads) - 1))]:.0%}, largest {max(spreads):.0%} "
            f"over {len(spreads)} points")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tests/data/resnet50.params,tests/data/bert_base.params",
                    help="params files, comma-separated")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--reducers", default="default,ring_tcp,tree_tcp,ring_shm,tree_shm",
                    help="ddp reducers, copy mode")
    ap.add_argument("--view-reducers", default="default", help="ddp reducers also run in view mode ('' for none)")
    ap.add_argument("--caps", help="bucket caps in MiB, comma-separated (default: "
                    + ",".join(f"{c:g}" for c in FULL_CAPS) + ")")
    ap.add_argument("--model-caps", action="append", default=[], metavar="MODEL=CAPS",
                    help="caps for one model (its file name without .params), e.g. bert_base=1,4,16,25,100; "
                    "repeatable")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per point and round")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--compute", action=argparse.BooleanOptionalAction, default=True,
                    help="also ddp_step's rows with simulated backward compute (its 25 MiB cap)")
    ap.add_argument("--no-torch", action="store_true", help="leave PyTorch DDP out")
    ap.add_argument("--quick", action="store_true",
                    help="caps 1,25,100, one round, 3 steps, ResNet-50 only unless --models is given")
    ap.add_argument("--out", default="bench/results/cap_sweep", help="prefix of the CSVs and PNGs")
    ap.add_argument("--ddp-step", default="build/bench/ddp_step")
    ap.add_argument("--python", default="/usr/bin/python3", help="the interpreter that imports torch")
    ap.add_argument("--timeout", type=int, default=400, help="seconds per child run before it is killed")
    ap.add_argument("--budget", type=int, default=900,
                    help="seconds: no further round starts when the last one would not fit")
    ap.add_argument("--append", action="store_true",
                    help="add rounds to OUT_rounds.csv (numbered after those there) instead of starting it anew")
    ap.add_argument("--plot-only", action="store_true", help="redraw OUT.png from OUT_rounds.csv")
    args = ap.parse_args()

    if args.quick:
        if "--models" not in sys.argv:
            args.models = "tests/data/resnet50.params"
        if "--rounds" not in sys.argv:
            args.rounds = 1
        if "--steps" not in sys.argv:
            args.steps = 3
    caps = [float(c) for c in args.caps.split(",")] if args.caps else (QUICK_CAPS if args.quick else FULL_CAPS)
    models = [os.path.join(ROOT, m) if not os.path.isabs(m) else m for m in args.models.split(",") if m]
    ranks = [int(n) for n in args.ranks.split(",") if n]
    per_model = {}
    for spec in args.model_caps:
        name, _, value = spec.partition("=")
        if not value:
            ap.error(f"--model-caps {spec}: expected MODEL=CAP,CAP,...")
        per_model[name] = [float(c) for c in value.split(",")]
    out = args.out if os.path.isabs(args.out) else os.path.join(ROOT, args.out)
    raw_path = out + "_rounds.csv"
    log = sys.stderr

    if not args.plot_only:
        ddp_step = args.ddp_step if os.path.isabs(args.ddp_step) else os.path.join(ROOT, args.ddp_step)
        if not os.access(ddp_step, os.X_OK):
            sys.exit(f"cap_sweep.py: no {ddp_step}; build it (ninja -C build bench/ddp_step) or pass --ddp-step")
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        t_start = time.monotonic()
        failures = 0
        first = 0
        if args.append and os.path.exists(raw_path):
            with open(raw_path) as f:
                first = max((int(r["round"]) + 1 for r in csv.DictReader(f)), default=0)
        with open(raw_path, "a" if first else "w", newline="") as f:
            w = csv.writer(f)
            if not first:
                w.writerow(["round"] + COLUMNS)
            for rnd in range(args.rounds):
                elapsed = time.monotonic() - t_start
                if rnd > 0 and elapsed / rnd * (rnd + 1) > args.budget:
                    print(f"stopping after {rnd} rounds: {elapsed:.0f} s spent, --budget {args.budget} s", file=log)
                    break
                for n in ranks:
                    for m in models:
                        size = model_mib(m)
                        mcaps = per_model.get(os.path.splitext(os.path.basename(m))[0], caps)
                        mcaps = mcaps + ([math.ceil(size)] if size > max(mcaps) else [])
                        cap_list = ",".join(f"{c:g}" for c in mcaps)
                        print(f"round {rnd + 1}/{args.rounds}, {n} ranks, {os.path.basename(m)} "
                              f"({size:.1f} MiB), caps {cap_list}", file=log, flush=True)
                        common = ["--ranks", str(n), "--caps", cap_list, "--steps", str(args.steps),
                                  "--warmup", str(args.warmup)]
                        cmds = [[ddp_step, *common, "--reducers", args.reducers, "--modes", "copy",
                                 *([] if args.compute else ["--no-compute"]), m]]
                        if args.view_reducers:
                            cmds.append([ddp_step, *common, "--reducers", args.view_reducers, "--modes", "view",
                                         "--no-flat", "--no-compute", m])
                        if not args.no_torch:
                            cmds.append([args.python, os.path.join(HERE, "peers", "torch_ddp.py"), "--ranks", str(n),
                                         "--params", m, "--bucket-cap-mb", *[f"{c:g}" for c in mcaps],
                                         "--steps", str(args.steps), "--warmup", str(args.warmup)])
                        for cmd in cmds:
                            ok, text = run(cmd, args.timeout, log)
                            failures += not ok
                            for r in parse_rows(text):
                                w.writerow([first + rnd] + [r[c] for c in COLUMNS])
                            f.flush()
        print(f"measured in {time.monotonic() - t_start:.0f} s, {failures} failed runs", file=log)

    with open(raw_path) as f:
        raw = [r for r in csv.DictReader(f)]
    if not raw:
        sys.exit(f"cap_sweep.py: no rows in {raw_path}")
    summary = summarize(raw)
    with open(out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, SUMMARY_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(summary)
    rounds = sorted({int(r["rounds"]) for r in summary})
    rounds = f"{rounds[0]}" if len(rounds) == 1 else f"{rounds[0]}-{rounds[-1]}"
    steps = raw[0]["steps"]
    plot.draw_sweep(summary, out + ".png", "sync_ms",
                    f"sync per step against bucket cap (median of {rounds} rounds of {steps} steps; "
                    "star: minimum)")
    plot.draw_sweep([r for r in summary if r["system"] != TORCH], out + "_exposed.png", "exposed_median_ms",
                    "ddp: exposed time (last gradient ready to finish() return) against bucket cap")
    print(f"wrote {out}.csv, {out}_rounds.csv, {out}.png, {out}_exposed.png", file=log)
    print(best_table(summary, models))
    print()
    print(noise(raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())

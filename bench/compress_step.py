#!/usr/bin/python3
"""Gradient synchronization per step with and without compression, over tcp.

Runs build/bench/ddp_step ROUNDS times (ring_tcp, ring_tcp_fp16, ring_tcp_bf16; bucket cap
25 MiB, copy mode, no simulated compute) on ResNet-50 and BERT-base at 2 and 4 ranks, and writes
bench/results/compress_step.csv: one row per (round, model, ranks, reducer) with sync_ms, then
one summary row per (model, ranks, reducer) with the median over rounds and its ratio to
ring_tcp's median (round "median").

  /usr/bin/python3 bench/compress_step.py [--build build] [--rounds 3] [--steps 7] [--data tests/data]
"""
import argparse
import csv
import io
import pathlib
import statistics
import subprocess
import sys

REDUCERS = ["ring_tcp", "ring_tcp_fp16", "ring_tcp_bf16"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--data", default="tests/data")
    ap.add_argument("--out", default="bench/results/compress_step.csv")
    a = ap.parse_args()
    data = pathlib.Path(a.data)
    models = [str(data / "resnet50.params"), str(data / "bert_base.params")]
    rows = []
    for rnd in range(1, a.rounds + 1):
        cmd = [str(pathlib.Path(a.build) / "bench" / "ddp_step"), "--ranks", a.ranks, "--caps", "25", "--modes", "copy",
               "--no-compute", "--no-flat", "--steps", str(a.steps), "--warmup", "2", "--reducers", ",".join(REDUCERS)]
        p = subprocess.run(cmd + models, capture_output=True, text=True, timeout=3600)
        if p.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr}")
        for r in csv.DictReader(io.StringIO(p.stdout)):
            red = r["system"].removeprefix("ddp_").removesuffix("_copy")
            rows.append({"round": rnd, "model": r["model"], "ranks": int(r["ranks"]), "reducer": red,
                         "sync_ms": float(r["sync_ms"])})
        print(f"# round {rnd} done", file=sys.stderr)
    out = []
    for r in rows:
        out.append([r["round"], r["model"], r["ranks"], r["reducer"], f"{r['sync_ms']:.1f}", ""])
    keys = sorted({(r["model"], r["ranks"]) for r in rows})
    print("model,ranks,reducer,median_sync_ms,ratio_to_ring_tcp,rounds")
    for model, ranks in keys:
        med = {}
        for red in REDUCERS:
            v = [r["sync_ms"] for r in rows if r["model"] == model and r["ranks"] == ranks and r["reducer"] == red]
            med[red] = (statistics.median(v), v)
        for red in REDUCERS:
            m, v = med[red]
            ratio = m / med["ring_tcp"][0]
            out.append(["median", model, ranks, red, f"{m:.1f}", f"{ratio:.2f}"])
            print(f"{model},{ranks},{red},{m:.1f},{ratio:.2f}," + "/".join(f"{x:.0f}" for x in v))
    with open(a.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["round", "model", "ranks", "reducer", "sync_ms", "ratio_to_ring_tcp"])
        w.writerows(out)


if __name__ == "__main__":
    main()

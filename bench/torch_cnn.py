#!/usr/bin/python3
"""ddp against PyTorch's DistributedDataParallel on the same LibTorch model, in one run.

    /usr/bin/python3 bench/torch_cnn.py --build build --ranks 2 4 --widths 1 4 --rounds 3

Runs examples/03_libtorch.cpp (ddp::torch_data_parallel, the default reducer) and
examples/03_libtorch_ddp.py (PyTorch DDP, gloo) with --bench: each step is timed twice,
interleaved, under no_sync() (backward alone) and synchronized, on every rank; per step the
slowest rank counts; the difference of the medians is what synchronizing the gradients costs.
The two systems alternate, round after round, so that both see the same machine. Prints one
row per (ranks, width) with the medians over the rounds and the ratio of PyTorch DDP's sync
time to ddp's (target: 3 or more). Raw rows go to --csv. With --bind-cores both pin rank r to
core r (unbound, two ranks on 2 cores are now and then stacked on one core, which makes the
2-rank figures bimodal).
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run(cmd):
    # In a session of its own: a run that overstays is killed with all its ranks, so no orphaned
    # rank keeps a core busy under the runs that follow.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        sys.exit(f"timed out after 300 s: {' '.join(cmd)}")
    out = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if out.returncode != 0:
        sys.exit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")
    lines = [l.split("] ", 1)[1] if l.startswith("[") else l for l in out.stdout.splitlines()]  # ddprun's "[rank] "
    rows = [l for l in lines if l.startswith(("ddp,", "pytorch_ddp_gloo,"))]
    if len(rows) != 1:
        sys.exit(f"no result row from: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")
    f = rows[0].split(",")
    return {"system": f[0], "ranks": int(f[1]), "width": int(f[2]), "elements": int(f[3]),
            "steps": int(f[4]), "step": float(f[5]), "nosync": float(f[6]), "sync": float(f[7])}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--csv", help="write every round's rows here")
    ap.add_argument("--bind-cores", action="store_true",
                    help="both systems pin rank r to the r-th usable core (ddprun --bind-cores)")
    args = ap.parse_args()

    ddprun = os.path.join(args.build, "tools", "ddprun")
    example = os.path.join(args.build, "examples", "03_libtorch")
    peer = os.path.join(ROOT, "examples", "03_libtorch_ddp.py")
    rows = []
    for ranks in args.ranks:
        for width in args.widths:
            for r in range(args.rounds):
                common = ["--bench", str(args.steps), "--width", str(width)]
                bind = ["--bind-cores"] if args.bind_cores else []
                rows.append(run([ddprun, "-n", str(ranks)] + bind + [example] + common) | {"round": r})
                rows.append(run(["/usr/bin/python3", peer, "--ranks", str(ranks)] + bind + common) | {"round": r})
                print(f"# ranks {ranks} width {width} round {r}: ddp sync {rows[-2]['sync']:.3f} ms, "
                      f"PyTorch DDP sync {rows[-1]['sync']:.3f} ms", file=sys.stderr, flush=True)
    if args.csv:
        with open(args.csv, "w") as f:
            keys = ["system", "ranks", "width", "elements", "round", "steps", "step", "nosync", "sync"]
            f.write(",".join(keys) + "\n")
            for row in rows:
                f.write(",".join(str(row[k]) for k in keys) + "\n")

    print("| ranks | parameters | PyTorch DDP step | its sync | ddp step | ddp sync | sync ratio |")
    print("|---|---|---|---|---|---|---|")
    for ranks in args.ranks:
        for width in args.widths:
            def med(system, key):
                return statistics.median(x[key] for x in rows
                                         if x["system"] == system and x["ranks"] == ranks and x["width"] == width)
            elems = next(x["elements"] for x in rows if x["ranks"] == ranks and x["width"] == width)
            t_sync, d_sync = med("pytorch_ddp_gloo", "sync"), med("ddp", "sync")
            ratio = t_sync / d_sync if d_sync > 0 else float("inf")
            print(f"| {ranks} | {elems} | {med('pytorch_ddp_gloo', 'step'):.3f} ms | {t_sync:.3f} ms | "
                  f"{med('ddp', 'step'):.3f} ms | {d_sync:.3f} ms | {ratio:.1f}x |")


if __name__ == "__main__":
    main()

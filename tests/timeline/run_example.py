#!/usr/bin/env python3
"""Runs the MLP example under ddprun with DDP_TIMELINE and checks every rank's file.

  run_example.py DDPRUN EXAMPLE CHECKER [MERGE]

Three runs, in a fresh temporary directory:
  1. 2 ranks, DDP_TIMELINE=DIR/mlp: every step of the example (384) in DIR/mlp.rank<r>.json
     (and, with MERGE, bench/timeline_merge.py's merged file passes the checker too);
  2. 4 ranks, DDP_TIMELINE=DIR/t-{rank}.json, DDP_TIMELINE_STEPS=20: DIR/t-<r>.json, stopped at 20;
  3. 2 ranks, DDP_TIMELINE in a directory that does not exist: the example fails, and its error
     names the file and the reason.
"""
import os
import subprocess
import sys
import tempfile


def run(cmd, env, expect_ok=True):
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    if (p.returncode == 0) != expect_ok:
        print(p.stdout)
        sys.exit(f"{' '.join(cmd)}: exit code {p.returncode}, expected {'0' if expect_ok else 'a failure'}")
    return p.stdout


def main():
    ddprun, example, checker = sys.argv[1:4]
    merge = sys.argv[4] if len(sys.argv) > 4 else None
    with tempfile.TemporaryDirectory(prefix="ddp-timeline-") as d:
        env = dict(os.environ)
        env.pop("DDP_TIMELINE_STEPS", None)

        env["DDP_TIMELINE"] = os.path.join(d, "mlp")
        run([ddprun, "-n", "2", example], env)
        files = [os.path.join(d, f"mlp.rank{r}.json") for r in range(2)]
        print(run([sys.executable, checker, "--steps", "384", *files], env), end="")
        if merge:
            merged = os.path.join(d, "merged.json")
            run([sys.executable, merge, "-o", merged, *files], env)
            print(run([sys.executable, checker, "--steps", "384", merged], env), end="")

        env["DDP_TIMELINE"] = os.path.join(d, "t-{rank}.json")
        env["DDP_TIMELINE_STEPS"] = "20"
        run([ddprun, "-n", "4", example], env)
        files = [os.path.join(d, f"t-{r}.json") for r in range(4)]
        print(run([sys.executable, checker, "--steps", "20", "--stopped", *files], env), end="")

        missing = os.path.join(d, "no-such-dir", "t")
        env["DDP_TIMELINE"] = missing
        env.pop("DDP_TIMELINE_STEPS")
        out = run([ddprun, "-n", "2", example], env, expect_ok=False)
        want = f"the timeline file '{missing}.rank0.json'"
        if want not in out or "No such file or directory" not in out:
            print(out)
            sys.exit(f"the failed run does not say: {want} ...: No such file or directory")
        print("ok: an unwritable DDP_TIMELINE fails construction, naming the file and the reason")


if __name__ == "__main__":
    main()

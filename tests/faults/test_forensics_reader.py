#!/usr/bin/env python3
"""tools/ddp_forensics.py on made-up records: the verdicts the real test cannot easily cause
(nothing stuck, a rank that finished, a queued collective, ranks that issued different
collectives under one number, several reducers) and input that is not a record.

  test_forensics_reader.py TOOL
"""
import json
import pathlib
import subprocess
import sys
import tempfile

tool = sys.argv[1]
failures = []


def entry(seq, state, kind="allreduce", bucket=-1, step=-1, count=256, dtype="f32", error=None, t=0):
    return {"seq": seq, "kind": kind, "state": state, "error": error, "bucket": bucket, "step": step,
            "count": count, "bytes": count * 4, "dtype": dtype, "op": "sum", "root": 0,
            "t_issue": t + 1000, "t_start": t + 2000 if state != "queued" else 0,
            "t_end": t + 3000 if state in ("finished", "failed") else 0}


def record(rank, reducers, reason="signal SIGUSR1"):
    return {"ddp_flight_recorder": 1, "library": "ddp 0.1.0", "rank": rank, "pid": 100 + rank, "host": "h",
            "reason": reason, "steady_ns": 5_000_000_000, "wall_ns": 1_700_000_000_000_000_000,
            "reducers": [{"ordinal": o, "name": "reducer", "rank": rank, "world_size": n, "issued": max(
                [e["seq"] for e in es], default=0), "capacity": 2048, "entries": es} for o, n, es in reducers]}


def run(records, *extra):
    with tempfile.TemporaryDirectory() as d:
        for i, r in enumerate(records):
            pathlib.Path(d, f"fr-{i}.json").write_text(r if isinstance(r, str) else json.dumps(r))
        p = subprocess.run([sys.executable, tool, *extra, d], capture_output=True, text=True)
        return p.returncode, p.stdout + p.stderr


def expect(name, records, status, first_line, *contains, extra=()):
    code, out = run(records, *extra)
    line = out.split("\n", 1)[0]
    if code != status or line != first_line or any(c not in out for c in contains):
        failures.append(f"{name}: exit {code} (want {status})\n{out}\nwant first line: {first_line}\nand: {contains}")


done = [entry(1, "finished"), entry(2, "finished")]
expect("nothing stuck", [record(0, [(0, 2, done)]), record(1, [(0, 2, done)])], 0,
       "reducer 0 (reducer): no collective is stuck: every recorded rank finished all 2 collectives")

# The broadcast's root finished; the other rank waits; a third issued it but has not started it.
b = dict(kind="broadcast", bucket=-1)
expect("finished, waiting, queued",
       [record(0, [(0, 3, done + [entry(3, "finished", **b)])]),
        record(1, [(0, 3, done + [entry(3, "started", **b)])]),
        record(2, [(0, 3, done + [entry(3, "queued", **b)])])], 1,
       "rank 1 waits in broadcast #3; rank 2 has issued it but not started it; rank 0 finished it",
       "  rank 2: broadcast #3 of 256 x f32 from root 0 (1.0 KiB) issued, not started")

# Different collectives under one number: flagged.
expect("mismatch",
       [record(0, [(0, 2, done + [entry(3, "failed", count=256, error="timeout", bucket=0, step=4)])]),
        record(1, [(0, 2, done + [entry(3, "failed", count=512, error="aborted", bucket=0, step=4)])])], 1,
       "ranks 0, 1 wait in allreduce #3 (bucket 0, step 4)",
       "the ranks issued different collectives as #3: rank 0: allreduce #3 of 256 x f32 sum (1.0 KiB); "
       "rank 1: allreduce #3 of 512 x f32 sum (2.0 KiB)",
       "failed (timeout) after 0.00 s")

# Two reducers: each gets its own line, named; a rank with no collective at all.
expect("two reducers",
       [record(0, [(0, 2, done), (1, 2, [entry(1, "started", kind="barrier")])]),
        record(1, [(0, 2, done), (1, 2, [])])], 1,
       "reducer 0 (reducer): no collective is stuck: every recorded rank finished all 2 collectives",
       "reducer 1 (reducer): rank 0 waits in barrier #1; rank 1 never entered it",
       "  rank 1: never issued #1; it recorded no collective before it (issued 0)")

code, out = run(["{not json"])
if code != 2 or "not a flight record" not in out:
    failures.append(f"bad input: exit {code}\n{out}")
code, out = run([json.dumps({"traceEvents": []})])
if code != 2 or "not a flight record" not in out:
    failures.append(f"a timeline instead of a record: exit {code}\n{out}")

for f in failures:
    print("FAIL", f)
print(f"{len(failures)} failures")
sys.exit(1 if failures else 0)

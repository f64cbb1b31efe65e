#!/usr/bin/env python3
"""The timeline checker can fail: a hand-made trace passes, and each way of breaking it fails
with the message that names the break.

  test_checker.py CHECKER
"""
import copy
import json
import os
import subprocess
import sys
import tempfile


def X(name, tid, ts, dur, **args):
    return {"name": name, "cat": "ddp", "ph": "X", "pid": 0, "tid": tid, "ts": ts, "dur": dur, "args": args}


def good():
    """One synchronized step of two buckets, then one no_sync step (times in microseconds)."""
    E, P = 11, 12  # engine thread, progress thread
    names = {0: ["fc2.bias", "fc2.weight"], 1: ["fc1.weight"]}
    ev = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": E, "args": {"name": "rank 0: engine"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": P, "args": {"name": "rank 0: progress thread"}},
        X("step 0", E, 100.0, 100.0, step=0, synchronized=True, buckets=2, bytes=24),
        X("backward", E, 100.0, 30.0, step=0),
        X("finish()", E, 140.0, 60.0, step=0),
    ]
    for b, (ready, launch, ar0, ar1, w0) in enumerate([(110, 111, 112, 150, 141), (120, 121, 151, 170, 161)]):
        basic = {"step": 0, "bucket": b, "bytes": 12, "params": len(names[b])}
        named = dict(basic, names=names[b])
        w1 = max(ar1, w0) + 1
        ev += [
            {"name": f"bucket {b} ready", "cat": "ddp", "ph": "i", "s": "t", "pid": 0, "tid": E, "ts": ready, "args": basic},
            X(f"launch bucket {b}", E, launch, 0.5, **named),
            X(f"allreduce bucket {b}", P, ar0, ar1 - ar0, **named),
            {"name": "launch to allreduce", "cat": "ddp", "ph": "s", "pid": 0, "tid": E, "ts": launch, "id": b},
            {"name": "launch to allreduce", "cat": "ddp", "ph": "f", "bp": "e", "pid": 0, "tid": P, "ts": ar0, "id": b},
            X(f"wait bucket {b}", E, w0, w1 - w0, **basic),
            X(f"copy back bucket {b}", E, w1, 5, **basic),
        ]
    ev.append(X("step 1 (no_sync)", E, 300.0, 10.0, step=1, synchronized=False))
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"rank": 0, "world_size": 1, "steps_recorded": 2, "steps_limit": 1000, "stopped_at_limit": False}}


def find(doc, name):
    return next(e for e in doc["traceEvents"] if e.get("name") == name)


def breaks():
    """(what, mutation, expected message) for each break."""
    def late_allreduce(d):  # starts before its launch
        find(d, "allreduce bucket 0")["ts"] = 110.5
    def wait_outside(d):  # wait outside finish()
        find(d, "wait bucket 1")["dur"] = 60.0
    def swapped_launch(d):  # bucket 1 launched before bucket 0
        find(d, "launch bucket 1")["ts"] = 110.2
        find(d, "bucket 1 ready")["ts"] = 110.1
    def missing_copy(d):
        d["traceEvents"].remove(find(d, "copy back bucket 1"))
    def partial_overlap(d):  # finish() starts inside backward and ends after it, on one thread
        find(d, "backward")["dur"] = 45.0
    def finish_outside(d):
        find(d, "finish()")["dur"] = 200.0
    def no_names(d):
        find(d, "launch bucket 0")["args"].pop("names")
    def wrong_names(d):
        find(d, "allreduce bucket 0")["args"]["names"] = ["fc2.bias"]
    def no_thread_name(d):
        d["traceEvents"].remove(find(d, "thread_name"))
    def not_closed(d):
        d.pop("otherData")
    def copy_before_reduced(d):
        find(d, "allreduce bucket 1")["dur"] = 45.0
    def flow_without_end(d):
        d["traceEvents"] = [e for e in d["traceEvents"] if not (e.get("ph") == "f" and e.get("id") == 1)]
    def count(d):
        d["otherData"]["steps_recorded"] = 3
    def progress_on_engine(d):
        find(d, "allreduce bucket 1")["tid"] = 11
    return [
        ("allreduce before launch", late_allreduce, "bucket 0: launch"),
        ("wait outside finish()", wait_outside, "bucket 1: wait"),
        ("launch order", swapped_launch, "not in plan order"),
        ("missing copy back", missing_copy, "bucket 1: 0 copy events"),
        ("partial overlap", partial_overlap, "without nesting"),
        ("finish() outside the step", finish_outside, "is not inside the step"),
        ("no parameter names", no_names, "does not name its parameters"),
        ("too few names", wrong_names, "names 1 parameters"),
        ("no thread_name", no_thread_name, "has events but no thread_name"),
        ("not closed", not_closed, "no otherData"),
        ("reduced after the copy back", copy_before_reduced, "allreduce end"),
        ("flow without end", flow_without_end, "flow 1 starts"),
        ("step count", count, "steps_recorded is 3"),
        ("allreduce on the engine thread", progress_on_engine, "not the progress thread"),
    ]


def check(checker, path, *extra):
    p = subprocess.run([sys.executable, checker, *extra, path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p.returncode, p.stdout


def main():
    checker = sys.argv[1]
    failures = []
    with tempfile.TemporaryDirectory(prefix="ddp-timeline-check-") as d:
        path = os.path.join(d, "t.json")
        with open(path, "w") as f:
            json.dump(good(), f)
        rc, out = check(checker, path, "--steps", "2")
        if rc != 0:
            failures.append(f"the good trace fails:\n{out}")
        rc, out = check(checker, path, "--steps", "3")
        if rc == 0 or "expected 3" not in out:
            failures.append(f"--steps 3 on a 2-step trace: rc {rc}\n{out}")
        with open(path, "w") as f:
            f.write('{"traceEvents":[{"name":"x"')
        rc, out = check(checker, path)
        if rc == 0 or "not a readable JSON file" not in out:
            failures.append(f"truncated JSON: rc {rc}\n{out}")
        for what, mutate, expected in breaks():
            doc = copy.deepcopy(good())
            mutate(doc)
            with open(path, "w") as f:
                json.dump(doc, f)
            rc, out = check(checker, path)
            if rc == 0 or expected not in out:
                failures.append(f"{what}: rc {rc}, expected a failure saying '{expected}':\n{out}")
            else:
                print(f"ok: {what} -> {out.splitlines()[0]}")
    for f in failures:
        print("FAIL " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

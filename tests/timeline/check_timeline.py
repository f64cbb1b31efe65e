#!/usr/bin/env python3
"""Checks the timeline files of ddp's data-parallel wrapper (DDP_TIMELINE; docs/tuning.md).

  check_timeline.py [--steps N] [--stopped] [--view] FILE.json ...   (one file per rank)

Exit 0 when every check passes; otherwise exit 1 and print each failure. Checks:
  - each file is a JSON object with traceEvents, displayTimeUnit and otherData;
  - a process_name for its pid and a thread_name for every thread that has events;
  - per synchronized step: for each of its buckets exactly one ready, launch, allreduce, wait
    and (unless --view) copy-back event, in the order ready <= launch <= allreduce start <=
    allreduce end <= copy back start; buckets launched in plan order; launch and allreduce
    name the bucket's parameters;
  - the finish() and backward spans inside the step span, wait and copy spans inside finish();
  - spans on one thread never partially overlap; every flow start has its end;
  - steps_recorded (otherData) equals the step spans; --steps N: that is N; --stopped: the
    step limit stopped recording; every rank recorded the same steps with the same buckets.
A merged file (bench/timeline_merge.py) is checked pid by pid, each pid as one rank.
Times are compared in integer nanoseconds (the files print microseconds with 3 decimals).
"""
import argparse
import collections
import json
import re
import sys

STEP = re.compile(r"^step (\d+)( \(no_sync\))?$")
BUCKET = re.compile(r"^(bucket (\d+) ready|launch bucket (\d+)|allreduce bucket (\d+)|wait bucket (\d+)|copy back bucket (\d+))$")
KINDS = ["ready", "launch", "allreduce", "wait", "copy"]


def ns(x):
    return round(float(x) * 1000)


class Checker:
    def __init__(self):
        self.errors = []

    def fail(self, where, msg):
        self.errors.append(f"{where}: {msg}")

    def check_file(self, path, view):
        """Returns {step: (synchronized, buckets)} of this file, or None if unreadable."""
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            self.fail(path, f"not a readable JSON file: {e}")
            return None, None
        if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
            self.fail(path, "not a JSON object with a traceEvents list")
            return None, None
        if doc.get("displayTimeUnit") != "ms":
            self.fail(path, "displayTimeUnit is not \"ms\"")
        other = doc.get("otherData")
        if not isinstance(other, dict):
            self.fail(path, "no otherData (the file was not closed)")
            other = {}
        events = doc["traceEvents"]
        pids = sorted({e.get("pid") for e in events}, key=str)
        if len(pids) > 1:  # a merged file (bench/timeline_merge.py): each pid is checked as a rank
            steps = {}
            for pid in pids:
                steps[pid] = self.check_rank(f"{path} (pid {pid})", [e for e in events if e.get("pid") == pid], view)
            return steps, other
        pid = pids[0] if pids else None
        if other.get("rank") is not None and other.get("rank") != pid:
            self.fail(path, f"otherData says rank {other.get('rank')} but events have pid {pid}")
        steps = self.check_rank(path, events, view)
        if other.get("steps_recorded") is not None and other["steps_recorded"] != len(steps):
            self.fail(path, f"otherData.steps_recorded is {other['steps_recorded']} but there are {len(steps)} step spans")
        return steps, other

    def check_rank(self, path, events, view):

        meta = [e for e in events if e.get("ph") == "M"]
        if not any(e.get("name") == "process_name" and isinstance(e.get("args", {}).get("name"), str) for e in meta):
            self.fail(path, "no process_name metadata")
        named = {e.get("tid") for e in meta if e.get("name") == "thread_name" and e.get("args", {}).get("name")}
        real = [e for e in events if e.get("ph") != "M"]
        for e in real:
            for key in ("name", "ph", "pid", "tid", "ts"):
                if key not in e:
                    self.fail(path, f"event without {key}: {e}")
            if e.get("ph") == "X" and (not isinstance(e.get("dur"), (int, float)) or e["dur"] < 0):
                self.fail(path, f"span {e.get('name')} has no valid dur")
        for tid in sorted({e.get("tid") for e in real}, key=str):
            if tid not in named:
                self.fail(path, f"thread {tid} has events but no thread_name")

        self.check_tracks(path, real)
        self.check_flows(path, real)
        return self.check_steps(path, real, view)

    def check_tracks(self, path, events):
        """Spans of one thread nest: a span that starts inside another ends inside it too."""
        tracks = collections.defaultdict(list)
        for e in events:
            if e.get("ph") == "X":
                b = ns(e["ts"])
                tracks[(e["pid"], e["tid"])].append((b, -(b + ns(e["dur"])), e["name"]))
        for key, spans in tracks.items():
            spans.sort()
            stack = []
            for b, neg_end, name in spans:
                end = -neg_end
                while stack and stack[-1][1] <= b:
                    stack.pop()
                if stack and end > stack[-1][1]:
                    self.fail(path, f"thread {key[1]}: span '{name}' [{b}, {end}] ns overlaps '{stack[-1][2]}' "
                                    f"[{stack[-1][0]}, {stack[-1][1]}] ns without nesting in it")
                stack.append((b, end, name))

    def check_flows(self, path, events):
        starts = collections.Counter(e.get("id") for e in events if e.get("ph") == "s")
        ends = collections.Counter(e.get("id") for e in events if e.get("ph") == "f")
        for i in starts:
            if ends[i] != starts[i]:
                self.fail(path, f"flow {i} starts {starts[i]} times but ends {ends[i]} times")
        for i in ends:
            if i not in starts:
                self.fail(path, f"flow {i} ends but never starts")

    def check_steps(self, path, events, view):
        by_step = collections.defaultdict(list)
        steps = {}
        for e in events:
            a = e.get("args") or {}
            m = STEP.match(e.get("name", ""))
            if m and e.get("ph") == "X":
                n = int(m.group(1))
                if n in steps:
                    self.fail(path, f"step {n} recorded twice")
                sync = m.group(2) is None
                if a.get("step") != n or a.get("synchronized") != sync:
                    self.fail(path, f"step {n}: args {a} do not match its name")
                steps[n] = (sync, a.get("buckets"), e)
            elif "step" in a:
                by_step[a["step"]].append(e)
        for n, evs in by_step.items():
            if n not in steps:
                self.fail(path, f"events of step {n} but no 'step {n}' span")
        summary = {}
        for n, (sync, nb, step_ev) in sorted(steps.items()):
            where = f"{path}: step {n}"
            evs = by_step.get(n, [])
            summary[n] = (sync, nb)
            if not sync:
                if evs:
                    self.fail(where, f"an unsynchronized step has {len(evs)} other events")
                continue
            if not isinstance(nb, int) or nb < 1:
                self.fail(where, f"synchronized step without a bucket count ({nb})")
                continue
            s0, s1 = ns(step_ev["ts"]), ns(step_ev["ts"]) + ns(step_ev["dur"])
            finish = [e for e in evs if e["name"] == "finish()"]
            if len(finish) != 1:
                self.fail(where, f"{len(finish)} finish() spans, expected 1")
                continue
            f0, f1 = ns(finish[0]["ts"]), ns(finish[0]["ts"]) + ns(finish[0]["dur"])
            if not (s0 <= f0 and f1 <= s1):
                self.fail(where, f"finish() [{f0}, {f1}] is not inside the step [{s0}, {s1}]")
            if finish[0]["tid"] != step_ev["tid"]:
                self.fail(where, "finish() is not on the step's thread")
            for e in evs:
                if e["name"] == "backward":
                    b0, b1 = ns(e["ts"]), ns(e["ts"]) + ns(e["dur"])
                    if not (s0 <= b0 and b1 <= f0):
                        self.fail(where, f"backward [{b0}, {b1}] is not inside the step before finish() [{s0}, {f0}]")
            got = collections.defaultdict(list)
            for e in evs:
                m = BUCKET.match(e["name"])
                if not m:
                    continue
                kind = KINDS[[i for i in range(2, 7) if m.group(i) is not None][0] - 2]
                b = int(next(g for g in m.groups()[1:] if g is not None))
                if e.get("args", {}).get("bucket") != b:
                    self.fail(where, f"'{e['name']}' has args.bucket {e.get('args', {}).get('bucket')}")
                got[(b, kind)].append(e)
            for (b, kind), lst in got.items():
                if b >= nb:
                    self.fail(where, f"'{lst[0]['name']}' but the step has {nb} buckets")
            launches = []
            for b in range(nb):
                need = KINDS if not view else KINDS[:4]
                one = {}
                for kind in need:
                    lst = got.get((b, kind), [])
                    if len(lst) != 1:
                        self.fail(where, f"bucket {b}: {len(lst)} {kind} events, expected 1")
                    else:
                        one[kind] = lst[0]
                if view and got.get((b, "copy")):
                    self.fail(where, f"bucket {b}: a copy back in view mode")
                if len(one) != len(need):
                    continue
                ready = ns(one["ready"]["ts"])
                launch = ns(one["launch"]["ts"])
                ar0 = ns(one["allreduce"]["ts"])
                ar1 = ar0 + ns(one["allreduce"]["dur"])
                w0 = ns(one["wait"]["ts"])
                w1 = w0 + ns(one["wait"]["dur"])
                order = [("ready", ready), ("launch", launch), ("allreduce start", ar0), ("allreduce end", ar1)]
                if not view:
                    order.append(("copy back start", ns(one["copy"]["ts"])))
                else:
                    order.append(("wait end", w1))
                for (na, ta), (nb_, tb) in zip(order, order[1:]):
                    if ta > tb:
                        self.fail(where, f"bucket {b}: {na} ({ta} ns) after {nb_} ({tb} ns)")
                inner = [("wait", w0, w1)]
                if not view:
                    c0 = ns(one["copy"]["ts"])
                    inner.append(("copy back", c0, c0 + ns(one["copy"]["dur"])))
                for name, a, z in inner:
                    if not (f0 <= a and z <= f1):
                        self.fail(where, f"bucket {b}: {name} [{a}, {z}] is not inside finish() [{f0}, {f1}]")
                    if one["wait"]["tid"] != finish[0]["tid"]:
                        self.fail(where, f"bucket {b}: {name} is not on finish()'s thread")
                for kind in ("launch", "allreduce"):
                    a = one[kind].get("args", {})
                    names = a.get("names")
                    params = a.get("params")
                    if not isinstance(names, list) or not names or not all(isinstance(x, str) and x for x in names):
                        self.fail(where, f"bucket {b}: {kind} does not name its parameters ({names!r})")
                    elif len(names) + a.get("names_omitted", 0) != params:
                        self.fail(where, f"bucket {b}: {kind} names {len(names)} parameters "
                                         f"(+{a.get('names_omitted', 0)} omitted) of {params}")
                if one["allreduce"]["tid"] == one["launch"]["tid"]:
                    self.fail(where, f"bucket {b}: the allreduce is on the launching thread, not the progress thread")
                launches.append((b, launch))
            for (b, t), (c, u) in zip(launches, launches[1:]):
                if t > u:
                    self.fail(where, f"bucket {c} launched ({u} ns) before bucket {b} ({t} ns): not in plan order")
        return summary


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--steps", type=int, help="the number of steps each file must hold")
    ap.add_argument("--stopped", action="store_true", help="the step limit must have stopped recording")
    ap.add_argument("--view", action="store_true", help="view mode: no copy back")
    a = ap.parse_args(argv)
    c = Checker()
    per_file = []
    for p in a.files:
        steps, other = c.check_file(p, a.view)
        if steps is None:
            continue
        merged = bool(steps) and all(isinstance(v, dict) for v in steps.values())
        ranks = [(f"{p} (pid {pid})", s) for pid, s in steps.items()] if merged else [(p, steps)]
        for name, s in ranks:
            per_file.append((name, s))
            if a.steps is not None and len(s) != a.steps:
                c.fail(name, f"{len(s)} steps recorded, expected {a.steps}")
            if not s:
                c.fail(name, "no step recorded")
        if a.stopped and not merged and other.get("stopped_at_limit") is not True:
            c.fail(p, "otherData.stopped_at_limit is not true")
    for (p, s), (q, t) in zip(per_file, per_file[1:]):
        if s != t:
            c.fail(q, f"its steps (mode, buckets) differ from those of {p}")
    for e in c.errors[:50]:
        print("FAIL " + e)
    if len(c.errors) > 50:
        print(f"... and {len(c.errors) - 50} more failures")
    if c.errors:
        return 1
    print(f"ok: {len(per_file)} ranks, {sum(len(s) for _, s in per_file)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

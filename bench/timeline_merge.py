#!/usr/bin/env python3
"""Merges the timeline files of ddp's ranks (DDP_TIMELINE; docs/tuning.md) into one Chrome trace,
so that Perfetto or chrome://tracing shows every rank in one view.

  timeline_merge.py -o merged.json /tmp/t.rank0.json /tmp/t.rank1.json ...
  timeline_merge.py -o merged.json --step 12 /tmp/t.rank*.json      # only step 12 (and metadata)

Each file is one rank (pid = rank). Ranks on one host share CLOCK_MONOTONIC, so their events
line up as recorded; across hosts the clocks differ by an unknown offset. Two files with the
same pid (two wrappers of one rank) get distinct pids: the second becomes pid + 1000 * k.
"""
import argparse
import json
import sys


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--step", type=int, help="keep only this step's events")
    a = ap.parse_args(argv)
    events, others, seen = [], [], {}
    for path in a.files:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        evs = doc["traceEvents"] if isinstance(doc, dict) else doc
        pids = {e.get("pid") for e in evs}
        remap = {}
        for p in pids:
            k = seen.get(p, 0)
            seen[p] = k + 1
            remap[p] = p if k == 0 else p + 1000 * k
        for e in evs:
            if a.step is not None and e.get("ph") != "M":
                args = e.get("args") or {}
                if "step" in args and args["step"] != a.step:
                    continue
                if e.get("ph") in ("s", "f"):
                    continue  # flows are kept below, only where both ends survive
            e = dict(e)
            if e.get("pid") in remap and remap[e["pid"]] != e["pid"]:
                e["pid"] = remap[e["pid"]]
                if e.get("name") == "process_name":
                    e["args"] = dict(e["args"], name=e["args"]["name"] + f" ({path})")
            events.append(e)
        if a.step is not None:
            # A flow starts where its launch does: keep both ends when the launch was kept.
            kept = {(e.get("pid"), e.get("tid"), e.get("ts")) for e in events if e.get("name", "").startswith("launch bucket")}
            flows = [dict(e, pid=remap.get(e.get("pid"), e.get("pid"))) for e in evs if e.get("ph") in ("s", "f")]
            ids = {e["id"] for e in flows if e["ph"] == "s" and (e["pid"], e["tid"], e["ts"]) in kept}
            events += [e for e in flows if e["id"] in ids]
        if isinstance(doc, dict) and "otherData" in doc:
            others.append(dict(doc["otherData"], file=path))
    out = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"merged_from": others}}
    with open(a.output, "w", encoding="utf-8") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"{a.output}: {len(events)} events from {len(a.files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

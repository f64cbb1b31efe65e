#!/usr/bin/env python3
"""Says who is stuck where, from the flight records of a hung or failed ddp job.

Each rank writes its record (DDP_FLIGHT_RECORDER=PATH: on a timeout, a lost peer, an abort, or
the signal DDP_FLIGHT_RECORDER_SIGNAL names; docs/forensics.md). Given all
ranks' files, this finds, per reducer, the first collective that not every rank finished and
says what each rank did about it:

  ranks 0, 1, 3 wait in allreduce #417 (bucket 3, step 12); rank 2 never entered it; its last was #416 (bucket 2, step 12, finished)

followed by one line per rank with the details (size, how long it waited, how it ended).

  ddp_forensics.py FILE|DIR ... [--world N]

A directory stands for the *.json files in it. A rank without a file (frozen, killed, or its
disk full) is named as leaving no record; --world N names the ranks to expect when no record
says (every record carries its reducers' world size). Exit status: 0 when every rank finished
every collective it recorded, 1 when a collective is stuck, 2 when the input cannot be read.
Python 3 standard library only.
"""
import argparse
import json
import pathlib
import sys

WAITING = ("started", "failed")


def load(paths):
    """{rank: record}; the latest record of a rank wins."""
    files = []
    for p in map(pathlib.Path, paths):
        if p.is_dir():
            files += sorted(q for q in p.iterdir() if q.suffix == ".json" and q.is_file())
        else:
            files.append(p)
    records = {}
    for f in files:
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"ddp_forensics: {f}: not a flight record ({e})")
        if not isinstance(rec, dict) or rec.get("ddp_flight_recorder") != 1:
            raise SystemExit(f"ddp_forensics: {f}: not a flight record (no \"ddp_flight_recorder\": 1)")
        rec["file"] = str(f)
        r = rec["rank"]
        if r not in records or rec["wall_ns"] > records[r]["wall_ns"]:
            records[r] = rec
    return records


def ranks_text(ranks):
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def mib(n):
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


def tag(e, with_state=False):
    parts = []
    if e["bucket"] >= 0:
        parts.append(f"bucket {e['bucket']}")
    if e["step"] >= 0:
        parts.append(f"step {e['step']}")
    if with_state:
        parts.append(e["state"] + (f": {e['error']}" if e["error"] else ""))
    return f" ({', '.join(parts)})" if parts else ""


def what(e):
    s = f"{e['kind']} #{e['seq']}"
    if e["kind"] != "barrier":
        s += f" of {e['count']} x {e['dtype']}"
        if e["kind"] in ("allreduce", "reduce_scatter"):
            s += f" {e['op']}"
        if e["kind"] == "broadcast":
            s += f" from root {e['root']}"
        s += f" ({mib(e['bytes'])})"
    return s


def wall(rec, t):
    """A steady-clock time of `rec`'s rank on the wall clock (ns), by the record's anchor."""
    return rec["wall_ns"] - (rec["steady_ns"] - t)


def shape(e):
    return (e["kind"], e["count"], e["dtype"], e["op"] if e["kind"] in ("allreduce", "reduce_scatter") else "",
            e["root"] if e["kind"] == "broadcast" else 0)


def analyse(records, world):
    """Yields (verdict line, detail lines, stuck) per reducer, in the order ranks built them."""
    ordinals = sorted({red["ordinal"] for rec in records.values() for red in rec["reducers"]})
    for ordinal in ordinals:
        rings = {}
        for r, rec in records.items():
            for red in rec["reducers"]:
                if red["ordinal"] == ordinal:
                    rings[r] = red
        n = world or max(red["world_size"] for red in rings.values())
        name = next(iter(rings.values()))["name"]
        by_seq = {r: {e["seq"]: e for e in red["entries"]} for r, red in rings.items()}
        # The first collective some rank has not finished (or not even issued).
        first = {}
        for r, red in rings.items():
            pending = [s for s, e in by_seq[r].items() if e["state"] != "finished"]
            first[r] = min(pending) if pending else red["issued"] + 1
        stuck = min(first.values()) if first else None
        if stuck is None or all(stuck > red["issued"] for red in rings.values()):
            issued = sorted({red["issued"] for red in rings.values()})
            line = (f"reducer {ordinal} ({name}): no collective is stuck: every recorded rank finished all "
                    f"{issued[0]} collectives" if len(issued) == 1 else
                    f"reducer {ordinal} ({name}): no collective is stuck; the ranks issued "
                    + ", ".join(f"{ranks_text([r])}: {red['issued']}" for r, red in sorted(rings.items())))
            missing = [r for r in range(n) if r not in rings]
            if missing:
                line += f"; {ranks_text(missing)} left no record"
            yield line, [], False
            continue
        groups = {}  # (kind of answer, detail key) -> ranks
        details = []
        ref = None
        for r in range(n):
            if r not in rings:
                groups.setdefault(("none",), []).append(r)
                details.append(f"  rank {r}: no record (frozen, killed, or it could not write its file)")
                continue
            rec = records[r]
            e = by_seq[r].get(stuck)
            if e is not None and ref is None:
                ref = e
            if e is not None and e["state"] in WAITING:
                groups.setdefault(("wait",), []).append(r)
                began = e["t_start"] or e["t_issue"]
                if e["state"] == "failed":
                    how = f"failed ({e['error']}) after {(e['t_end'] - began) / 1e9:.2f} s"
                else:
                    how = f"still running {(rec['steady_ns'] - began) / 1e9:.2f} s after it started"
                details.append(f"  rank {r}: {what(e)}{tag(e)}: {how}; record: {rec['reason']}")
            elif e is not None and e["state"] == "queued":
                groups.setdefault(("queued",), []).append(r)
                details.append(f"  rank {r}: {what(e)}{tag(e)} issued, not started "
                               f"{(rec['steady_ns'] - e['t_issue']) / 1e9:.2f} s later; record: {rec['reason']}")
            elif e is not None:
                groups.setdefault(("finished",), []).append(r)
                details.append(f"  rank {r}: finished {what(e)}{tag(e)}; record: {rec['reason']}")
            else:
                last = max((s for s in by_seq[r] if s < stuck), default=None)
                le = by_seq[r].get(last) if last is not None else None
                groups.setdefault(("never", last, le["state"] if le else None), []).append(r)
                if le is not None:
                    ago = ""
                    if le["t_end"]:
                        ago = f", {(rec['steady_ns'] - le['t_end']) / 1e9:.2f} s before its record"
                    details.append(f"  rank {r}: never issued #{stuck}; its last was {what(le)}{tag(le, True)}{ago}; "
                                   f"record: {rec['reason']}")
                else:
                    details.append(f"  rank {r}: never issued #{stuck}; it recorded no collective before it "
                                   f"(issued {rings[r]['issued']}); record: {rec['reason']}")
        ref = ref or {"kind": "collective", "seq": stuck, "bucket": -1, "step": -1}
        parts = []
        order = {"wait": 0, "queued": 1, "finished": 2, "never": 3, "none": 4}
        for key, rs in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], min(kv[1]))):
            one = len(rs) == 1
            if key[0] == "wait":
                parts.append(f"{ranks_text(rs)} {'waits' if one else 'wait'} in {ref['kind']} #{stuck}{tag(ref)}")
            elif key[0] == "queued":
                parts.append(f"{ranks_text(rs)} {'has' if one else 'have'} issued it but not started it")
            elif key[0] == "finished":
                parts.append(f"{ranks_text(rs)} finished it")
            elif key[0] == "never":
                last = key[1]
                if last is None:
                    parts.append(f"{ranks_text(rs)} never entered it")
                else:
                    le = by_seq[rs[0]][last]
                    parts.append(f"{ranks_text(rs)} never entered it; {'its' if one else 'their'} last was "
                                 f"#{last}{tag(le, True)}")
            else:
                parts.append(f"{ranks_text(rs)} left no record")
        line = "; ".join(parts)
        if len(ordinals) > 1:
            line = f"reducer {ordinal} ({name}): " + line
        shapes = {r: shape(by_seq[r][stuck]) for r in rings if stuck in by_seq[r]}
        if len(set(shapes.values())) > 1:
            details.append(f"  the ranks issued different collectives as #{stuck}: " + "; ".join(
                f"rank {r}: {what(by_seq[r][stuck])}" for r in sorted(shapes)))
        yield line, details, True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="flight records (files, or directories of *.json)")
    ap.add_argument("--world", type=int, default=0, help="ranks to expect (default: as the records say)")
    a = ap.parse_args(argv)
    try:
        records = load(a.paths)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    if not records:
        print("ddp_forensics: no flight records found", file=sys.stderr)
        return 2
    stuck = False
    for line, details, s in analyse(records, a.world):
        print(line)
        for d in details:
            print(d)
        stuck = stuck or s
    return 1 if stuck else 0


if __name__ == "__main__":
    sys.exit(main())

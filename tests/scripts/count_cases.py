#!/usr/bin/env python3
"""Counts the doctest cases and the lines of the C++ tests, per file and in all.

Usage: tests/scripts/count_cases.py [--totals]

For each tests/**/*.cpp and *.hpp (tests/vendor left out): the test cases (TEST_CASE and its
_TEMPLATE, _FIXTURE and _CLASS forms, SCENARIO), the SUBCASEs, the checks written in the parent
(doctest's CHECK, REQUIRE, WARN, FAIL families, and expect_ok: one CHECK that every rank ended
well) and in children (`require(`, `require_raises(`),
and the lines. Run it before and after a change to the tests: no case lost, fewer lines
(docs/testing.md, "Counting the tests").

A macro counts where it begins a statement (only blanks before it on its line), so the names in
comments and strings do not count; a template case counts once, not once per type (one defined
with TEST_CASE_TEMPLATE_DEFINE where it is defined, not where it is invoked).
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
CASE = re.compile(r"^\s*(TEST_CASE(_TEMPLATE(_DEFINE)?|_FIXTURE|_CLASS)?|SCENARIO)\s*\(", re.M)
SUBCASE = re.compile(r"^\s*SUBCASE\s*\(", re.M)
CHECK = re.compile(r"^\s*((CHECK|REQUIRE|WARN|FAIL)(_[A-Z_]+)?|expect_ok)\s*\(", re.M)
CHILD = re.compile(r"^\s*(require|require_raises)\s*\(", re.M)


def main() -> int:
    totals_only = "--totals" in sys.argv[1:]
    files = sorted(p for ext in ("cpp", "hpp") for p in ROOT.rglob(f"*.{ext}")
                   if "vendor" not in p.relative_to(ROOT).parts)
    rows, total = [], [0, 0, 0, 0, 0]
    for p in files:
        text = p.read_text(encoding="utf-8", errors="replace")
        row = [len(CASE.findall(text)), len(SUBCASE.findall(text)), len(CHECK.findall(text)),
               len(CHILD.findall(text)), text.count("\n")]
        total = [a + b for a, b in zip(total, row)]
        rows.append((str(p.relative_to(ROOT.parent)), row))
    head = f"{'cases':>6} {'subcases':>8} {'checks':>7} {'child':>6} {'lines':>7}  file"
    print(head)
    if not totals_only:
        for name, r in rows:
            if any(r[:4]) or name.endswith(".hpp"):
                print(f"{r[0]:>6} {r[1]:>8} {r[2]:>7} {r[3]:>6} {r[4]:>7}  {name}")
    print(f"{total[0]:>6} {total[1]:>8} {total[2]:>7} {total[3]:>6} {total[4]:>7}  in all ({len(files)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

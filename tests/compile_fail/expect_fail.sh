#!/bin/sh
# Usage: expect_fail.sh fail|pass SUBSTRING INCLUDE_DIR FILE COMPILER [COMPILER ARGS...]
# fail: FILE must not compile and the diagnostics must contain SUBSTRING (the unmet requirement).
# pass: FILE must compile (the positive control that proves the harness itself).
set -u
mode=$1 expected=$2 include=$3 file=$4
shift 4
log=$("$@" -std=c++20 -fsyntax-only -I"$include" "$file" 2>&1)
status=$?
case $mode in
  pass)
    if [ $status -ne 0 ]; then
      printf '%s\n' "$log"
      echo "FAIL: $file should compile"
      exit 1
    fi
    echo "ok: $file compiles"
    ;;
  fail)
    if [ $status -eq 0 ]; then
      echo "FAIL: $file compiled but must be rejected"
      exit 1
    fi
    if ! printf '%s\n' "$log" | grep -qF -- "$expected"; then
      printf '%s\n' "$log"
      echo "FAIL: $file was rejected, but the diagnostics do not name '$expected'"
      exit 1
    fi
    echo "ok: $file rejected, naming '$expected'"
    ;;
  *)
    echo "expect_fail.sh: unknown mode '$mode'" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# Runs a command and checks its exit status and that its last line of output (stdout) matches
# an extended regular expression:
#   expect_last_line.sh REGEX COMMAND [ARGS...]
set -uo pipefail
want=$1
shift
out=$("$@")
rc=$?
last=$(printf '%s\n' "$out" | tail -n 1)
printf '%s\n' "$out"
if [[ $rc -ne 0 ]]; then
  echo "expect_last_line: '$*' exited with $rc" >&2
  exit 1
fi
if ! [[ $last =~ $want ]]; then
  echo "expect_last_line: the last line '$last' does not match '$want'" >&2
  exit 1
fi

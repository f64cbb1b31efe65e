#!/bin/bash
# ddprun --elastic's exit status (docs/elastic.md, "The launcher"): a rank that exits with an
# error once the job is done fails the job; no replacement, which would find the job finished
# and exit 0, may hide it. A rank that fails while the job runs, and whose replacement then
# ends normally, is a failure the group survived.
#
#   tests/launcher/test_elastic_status.sh DDPRUN PROGRAM   (PROGRAM: examples/05_elastic)
set -u
ddprun=$1
prog=$2
log=$(mktemp /tmp/ddp-elastic-status.XXXXXX)
trap 'rm -f "$log"' EXIT
failed=0
# Runs ddprun with the arguments given; checks its exit status and, when asked, the OK line.
check() {
  local what=$1 want=$2 want_ok=$3
  shift 3
  timeout -k 5 120 "$ddprun" "$@" >"$log" 2>&1
  local rc=$?
  local ok=no
  grep -q 'elastic: OK steps=' "$log" && ok=yes
  if [ "$rc" -ne "$want" ] || { [ "$want_ok" = yes ] && [ "$ok" != yes ]; }; then
    echo "FAILED: $what: ddprun exited with $rc (want $want), 'elastic: OK' printed: $ok (want $want_ok)"
    grep -v ' epoch ' "$log" | tail -30
    failed=1
  else
    echo "ok: $what: ddprun exited with $rc"
    grep 'ddprun:' "$log"
  fi
}

# 1. No group at all: rank 0 finishes at once (the job is done), rank 1 then fails with 3; its
# replacement would exit 0.
check "an error after a rank finished" 3 no -n 2 --elastic 1:2 --max-restarts 3 -- bash -c '
  [ "${DDP_RESTART_COUNT:-0}" -gt 0 ] && exit 0
  [ "$RANK" = 1 ] && { sleep 1; exit 3; }
  exit 0'

# 2. The real group: every rank trains to the end (the group marks the job done); then rank 1
# exits with 3 while rank 0 lingers, so that no rank has ended normally yet when rank 1's error
# is seen. A replacement would find the job done and exit 0.
check "an error after the group finished" 3 yes -n 2 --elastic 1:2 --max-restarts 3 -- bash -c '
  "$0" --min-seconds 2; rc=$?
  [ "${DDP_RESTART_COUNT:-0}" = 0 ] && [ "$RANK" = 1 ] && exit 3
  [ "$RANK" = 0 ] && sleep 3
  exit $rc' "$prog"

# 3. Survived: rank 2's first process fails with 3 while the group trains; its replacement joins
# the group, which finishes: the job succeeded.
check "an error survived by the group" 0 yes -n 3 --elastic 2:3 --max-restarts 3 -- bash -c '
  if [ "${DDP_RESTART_COUNT:-0}" = 0 ] && [ "$RANK" = 2 ]; then
    "$0" --min-seconds 60 & sleep 3; kill -KILL $!; wait; exit 3
  fi
  exec "$0" --min-seconds 8' "$prog"

[ "$failed" = 0 ] && echo "elastic exit status: OK"
exit "$failed"

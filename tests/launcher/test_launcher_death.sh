#!/bin/bash
# ddprun killed (SIGKILL: no chance to end its ranks itself): within 2 s no process of its job is
# left, neither a rank blocked in a write to an output pipe nobody reads nor a silent one, and
# no keeper (docs/elastic.md, "The launcher").
#
#   tests/launcher/test_launcher_death.sh DDPRUN
set -u
ddprun=$1
failed=0
# Every process of the job carries the marker in its command line: ddprun, its keepers (forks
# of ddprun) and the programs (bash -c ... MARKER).
run() {
  local what=$1 body=$2 n=$3
  local marker="ddp-launcher-death-$$-$RANDOM"
  shift 3
  "$ddprun" -n "$n" "$@" -- bash -c "$body" "$marker" >/dev/null 2>&1 &
  local launcher=$!
  local want=$((1 + 2 * n))  # ddprun, and a keeper and a program per rank
  for _ in $(seq 100); do
    [ "$(pgrep -f -- "$marker" | wc -l)" -ge "$want" ] && break
    sleep 0.05
  done
  sleep 0.5  # the programs write (or sleep) for a while
  local before
  before=$(pgrep -f -- "$marker" | tr '\n' ' ')
  kill -KILL "$launcher"
  wait "$launcher" 2>/dev/null
  local left=""
  for _ in $(seq 20); do
    left=$(pgrep -f -- "$marker" | tr '\n' ' ')
    [ -z "$left" ] && break
    sleep 0.1
  done
  if [ -n "$left" ]; then
    echo "FAILED: $what: 2 s after ddprun was killed, processes of its job are left (of $before):"
    for p in $left; do
      echo "  $p state $(awk '{ print $3 }' "/proc/$p/stat" 2>/dev/null) wchan $(cat "/proc/$p/wchan" 2>/dev/null):" \
        "$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-100)"
    done
    # This job's own processes (its unique marker), ended here so that the test leaves nothing.
    for p in $left; do kill -KILL "$p" 2>/dev/null; done
    failed=1
  else
    echo "ok: $what: every process of the job ended within 2 s of ddprun's death (${before% })"
  fi
}

run "ranks that print without pause" 'while :; do echo "a line of output from rank $RANK"; done' 2
run "silent ranks" 'while :; do sleep 0.1; done' 2
run "silent ranks of an elastic job" 'while :; do sleep 0.1; done' 2 --elastic 1:2 --max-restarts 2

[ "$failed" = 0 ] && echo "launcher death: OK"
exit "$failed"

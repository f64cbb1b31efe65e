#!/bin/bash
# Every rank of an elastic job killed at once (docs/elastic.md, "The launcher"): the group's state
# is gone with them, and ddprun says so at once instead of starting newcomers that would each
# wait a whole timeout for a group that no longer exists. With a restart left it starts every
# rank again, as the first generation of run k ("<job>+restart.k", DDP_RESTART_COUNT=0), which
# then trains to the end; with none left it ends the job with a non-zero status.
#
#   tests/launcher/test_elastic_lost.sh DDPRUN PROGRAM   (PROGRAM: examples/05_elastic)
set -u
ddprun=$1
prog=$2
log=$(mktemp /tmp/ddp-elastic-lost.XXXXXX)
stop=$log.stop
launcher=
cleanup() {
  # On a failure, ddprun (this test's) ends its ranks on SIGTERM.
  [ -n "$launcher" ] && kill -TERM "$launcher" 2>/dev/null && wait "$launcher" 2>/dev/null
  rm -f "$log" "$stop"
}
trap cleanup EXIT
fail() {
  echo "FAILED: $*"
  grep -v ' epoch ' "$log" | tail -40
  exit 1
}
# The programs: each keeper (a child of ddprun) has one child, the program.
programs() {
  local k
  for k in $(pgrep -P "$launcher"); do pgrep -P "$k"; done
}
# Waits until N programs, none of them in OLD, have run for 2 s; prints them.
settled() {
  local n=$1 old=$2 p got
  for _ in $(seq 300); do
    got=()
    for p in $(programs); do
      case " $old " in *" $p "*) continue ;; esac
      [ "$(ps -o etimes= -p "$p" 2>/dev/null | tr -d ' ')" -ge 2 ] 2>/dev/null && got+=("$p")
    done
    if [ "${#got[@]}" -ge "$n" ]; then echo "${got[*]}"; return 0; fi
    sleep 0.1
  done
  return 1
}
env_of() { tr '\0' '\n' <"/proc/$1/environ" 2>/dev/null | sed -n "s/^$2=//p"; }
# Waits up to S seconds for a line matching RE in the log.
said() {
  local re=$1 s=$2
  for _ in $(seq $((s * 10))); do
    grep -qE "$re" "$log" && return 0
    sleep 0.1
  done
  return 1
}

# 1. Killed at once, a restart left: every rank starts again as run 1 and finishes.
"$ddprun" -n 3 --elastic 2:3 --max-restarts 2 "$prog" --min-seconds 1 --stop-file "$stop" >"$log" 2>&1 &
launcher=$!
first=$(settled 3 "") || fail "the first generation's 3 ranks never ran"
kill -KILL $first
said 'ddprun: every rank of the elastic group died within [0-9.]+ s; the group.s state is gone: restarting every rank' 10 ||
  fail "10 s after every rank was killed, ddprun has not restarted the job"
second=$(settled 3 "$first") || fail "run 1's 3 ranks never ran"
for p in $second; do
  rc=$(env_of "$p" DDP_RESTART_COUNT)
  job=$(env_of "$p" DDP_JOB_ID)
  [ "$rc" = 0 ] || fail "a rank of run 1 has DDP_RESTART_COUNT=$rc (a newcomer), not 0 (the first generation)"
  case "$job" in *+restart.1) ;; *) fail "a rank of run 1 has DDP_JOB_ID=$job, not <job>+restart.1" ;; esac
done
touch "$stop"
for _ in $(seq 600); do kill -0 "$launcher" 2>/dev/null || break; sleep 0.1; done
kill -0 "$launcher" 2>/dev/null && fail "run 1 did not end within 60 s of the stop file"
wait "$launcher"
rc=$?
launcher=
grep -q 'elastic: OK steps=' "$log" || fail "run 1 printed no 'elastic: OK' line"
[ "$rc" = 0 ] || fail "ddprun exited with $rc after run 1 finished"
grep 'ddprun:' "$log"
echo "ok: every rank killed at once, the job restarted as run 1 and finished"
rm -f "$stop"

# 2. Killed at once twice, one restart: the second time ends the job, at once and non-zero.
"$ddprun" -n 2 --elastic 1:2 --max-restarts 1 "$prog" --min-seconds 1 --stop-file "$stop" >"$log" 2>&1 &
launcher=$!
first=$(settled 2 "") || fail "the first generation's 2 ranks never ran"
kill -KILL $first
second=$(settled 2 "$first") || fail "run 1's 2 ranks never ran"
kill -KILL $second
for _ in $(seq 100); do kill -0 "$launcher" 2>/dev/null || break; sleep 0.1; done
kill -0 "$launcher" 2>/dev/null && fail "10 s after every rank of run 1 was killed, ddprun still runs"
wait "$launcher"
rc=$?
launcher=
[ "$rc" -ne 0 ] || fail "ddprun exited with 0 after the group's state was lost"
grep -qE 'ddprun: every rank of the elastic group died within [0-9.]+ s; the group.s state is gone: ending the job' "$log" ||
  fail "ddprun did not say why it ended the job"
grep 'ddprun:' "$log"
echo "ok: every rank killed at once with no restart left: ddprun ended the job with $rc"
echo "elastic state lost: OK"

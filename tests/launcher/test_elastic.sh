#!/bin/bash
# The elastic group under fire (docs/elastic.md): examples/05_elastic runs under
# `ddprun -n 4 --elastic 2:4` while a punisher kills (SIGKILL) or freezes (SIGSTOP, thawed a few
# seconds later) a random rank, rank 0 and ranks still joining included, every INTERVAL seconds
# while at least 3 ranks that have run for 3 s are running, FAILURES times. The run must exit 0, and the final rank 0's last line must be
# "elastic: OK steps=... failures=... sizes=..." (its checks: bitwise-equal weights, every
# committed step averaged over exactly its generation, the loss near an uninterrupted run's),
# with at least one failure survived per failure caused, less those that hit a joiner.
#
#   tests/launcher/test_elastic.sh DDPRUN PROGRAM [FAILURES [INTERVAL [RANKS [PROGRAM_ARGS]]]]
#
# meson test 'elastic' runs 20 failures; scripts/elastic_soak.sh runs 200. With PROGRAM_ARGS
# "--elastic" it runs examples/06_sharded, whose line is "sharded elastic: OK steps=..." (its
# checks: the sharded weights and AdamW state bitwise those of the unsharded run beside it), with
# ONE_LOSS_AT_A_TIME=1; a run whose group's state was lost (ddprun restarting every rank) fails:
# meson test 'sharded_elastic' (20 failures), scripts/sharded_elastic_soak.sh (200).
set -u
ddprun=$1
prog=$2
failures=${3:-20}
interval=${4:-1.5}
n=${5:-4}
read -r -a prog_args <<<"${6:-}"
# Training goes on until the punisher is done (its stop file), so that the run ends in peace.
log=$(mktemp /tmp/ddp-elastic.XXXXXX)
stop=$log.stop
# A failed run's whole log stays in /tmp/ddp-elastic-failed.log.
trap 'rc=$?; [ "$rc" -ne 0 ] && cp "$log" /tmp/ddp-elastic-failed.log; rm -f "$log" "$stop"; exit $rc' EXIT

"$ddprun" -n "$n" --elastic 2:"$n" --max-restarts $((failures + 10)) "$prog" "${prog_args[@]}" --min-seconds 5 \
  --stop-file "$stop" \
  >"$log" 2>&1 &
launcher=$!

# The programs: each keeper (a child of ddprun) has one child, the program.
programs() {
  local k p
  for k in $(pgrep -P "$launcher"); do
    for p in $(pgrep -P "$k"); do echo "$p"; done
  done
}
state_of() { awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null; }

# With ONE_LOSS_AT_A_TIME=1 (the sharded mode's replicas: a shard survives the loss of one of its
# two holders, not of both before the group re-formed and replicated it again) the punisher
# strikes again only once a generation has formed since its last blow, a second ago or more.
one_at_a_time=${ONE_LOSS_AT_A_TIME:-0}
generations() { grep -c '\] \[ddp.elastic\] generation [0-9]*:' "$log"; }
gens_at_blow=-1
gens_seen=0
seen_at=0

kills=0
stops=0
frozen=()  # "pid:when" of each frozen program, thawed after 3 s
sleep 2
while [ $((kills + stops)) -lt "$failures" ] && kill -0 "$launcher" 2>/dev/null; do
  sleep "$interval"
  now=$(date +%s)
  still=()
  for f in "${frozen[@]}"; do
    if [ $((now - ${f#*:})) -ge 3 ]; then kill -CONT "${f%%:*}" 2>/dev/null; else still+=("$f"); fi
  done
  frozen=("${still[@]}")
  live=()
  settled=0
  for p in $(programs); do
    [ "$(state_of "$p")" != T ] && [ -n "$(state_of "$p")" ] || continue
    live+=("$p")
    # Running for 3 s or more: a member by now, not a replacement still on its way in.
    [ "$(ps -o etimes= -p "$p" 2>/dev/null | tr -d ' ')" -ge 3 ] 2>/dev/null && settled=$((settled + 1))
  done
  # Keep the group above its minimum of 2: act only while 3 settled ranks run, so that 2
  # members that hold the group's state remain whichever rank is hit (joiners included).
  [ "$settled" -lt 3 ] && continue
  if [ "$one_at_a_time" = 1 ]; then
    g=$(generations)
    [ "$g" -gt "$gens_seen" ] && { gens_seen=$g; seen_at=$now; }
    { [ "$gens_seen" -le "$gens_at_blow" ] || [ $((now - seen_at)) -lt 1 ]; } && continue
    gens_at_blow=$gens_seen
  fi
  victim=${live[$((RANDOM % ${#live[@]}))]}
  if [ $((RANDOM % 3)) -eq 0 ]; then
    kill -STOP "$victim" 2>/dev/null && { stops=$((stops + 1)); frozen+=("$victim:$(date +%s)"); }
  else
    kill -KILL "$victim" 2>/dev/null && kills=$((kills + 1))
  fi
done
sleep 3
for f in "${frozen[@]}"; do kill -CONT "${f%%:*}" 2>/dev/null; done
# Anything still stopped (a program frozen just as it started) is thawed too.
for p in $(programs); do [ "$(state_of "$p")" = T ] && kill -CONT "$p"; done
sleep 2
touch "$stop"

wait "$launcher"
rc=$?
echo "punisher: $kills kills, $stops freezes; ddprun exited with $rc"
grep -v ' epoch ' "$log" | grep -E 'ddprun:|generation|elastic:|OK|FAILED|error|\[ddp\.' | grep -v 'ddp.elastic\] rank' | tail -40
last=$(grep -E '^\[[0-9]+\] ' "$log" | grep -E 'elastic: ' | tail -1)
echo "last: $last"
if [ "$rc" -ne 0 ]; then
  echo "FAILED: ddprun exited with $rc"
  tail -60 "$log"
  exit 1
fi
case "$last" in
  *"elastic: OK steps="*) ;;
  *) echo "FAILED: no 'elastic: OK' line"; tail -60 "$log"; exit 1 ;;
esac
if grep -q 'restarting every rank' "$log"; then
  echo "FAILED: the group's state was lost (ddprun restarted every rank)"
  grep 'restarting every rank' "$log" | head -3
  exit 1
fi
survived=$(echo "$last" | sed -n 's/.*failures=\([0-9]*\).*/\1/p')
if [ "$((kills + stops))" -lt "$failures" ]; then
  echo "FAILED: the run ended after $((kills + stops)) of $failures failures"
  exit 1
fi
if [ "${survived:-0}" -lt $(((kills + stops) / 2)) ]; then
  echo "FAILED: $((kills + stops)) failures caused, only $survived survived by the group"
  exit 1
fi
echo "elastic under fire: OK ($kills kills, $stops freezes, $survived re-formations after a failure)"

#!/usr/bin/env bash
# ddprun's contract: environment per rank, "[rank] " prefixes, a failing rank ends the others
# and ddprun exits with its status; --max-restarts starts the ranks again. Prints "N passed, N failed".
#   test_ddprun.sh DDPRUN [PROCESS_GROUP_EXAMPLE]
set -u
ddprun=$1
example=${2:-}
pass=0; fail=0
check() { if eval "$2"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $1"; fi; }

out=$("$ddprun" -n 3 sh -c 'echo "r=$RANK w=$WORLD_SIZE l=$LOCAL_RANK a=$MASTER_ADDR p=$MASTER_PORT"')
rc=$?
check "exit 0 when all ranks succeed" '[[ $rc -eq 0 ]]'
for r in 0 1 2; do
  check "rank $r prefixed with its environment" '[[ "$out" == *"[$r] r=$r w=3 l=$r a=127.0.0.1 p="* ]]'
done
port=$(sed -n 's/.*p=\([0-9]*\).*/\1/p' <<<"$out" | sort -u)
check "one port, shared by all ranks" '[[ $(wc -l <<<"$port") -eq 1 && $port -gt 0 ]]'

start=$(date +%s)
out=$("$ddprun" -n 3 sh -c 'if [ "$RANK" = 1 ]; then exit 7; fi; sleep 60' 2>&1)
rc=$?
took=$(( $(date +%s) - start ))
check "a failing rank's status is ddprun's" '[[ $rc -eq 7 ]]'
check "the other ranks are ended promptly" '[[ $took -lt 20 ]]'
check "the failure is named" '[[ "$out" == *"rank 1 exited with status 7"* ]]'

# Rank 2 fails first; ranks 0 and 1 fail 30 ms later because of it (as survivors of a lost
# rank do, once they noticed). Rank 2 leaves a child holding its output open, so ddprun learns
# of its exit no sooner than of theirs. The rank that failed first is the one named, every time.
tmp=$(mktemp -d)
right=0
for k in 1 2 3 4 5 6 7 8 9 10; do
  out=$(F="$tmp/failed.$k" "$ddprun" -n 3 sh -c '
    if [ "$RANK" = 2 ]; then sleep 0.3; (sleep 2 &); touch "$F"; exit 3; fi
    while [ ! -e "$F" ]; do sleep 0.005; done; sleep 0.03; exit 1' 2>&1)
  rc=$?
  if [[ $rc -eq 3 && "$out" == *"rank 2 exited with status 3"* && "$out" != *"rank 0 exited"* &&
        "$out" != *"rank 1 exited"* ]]; then right=$((right + 1)); else echo "run $k: rc $rc: $out"; fi
done
rm -rf "$tmp"
check "the rank that failed first is named (10 of 10 runs, got $right)" '[[ $right -eq 10 ]]'

out=$("$ddprun" -n 2 sh -c 'echo "job=$DDP_JOB_ID"')
ids=$(sed -n 's/.*job=\(.*\)/\1/p' <<<"$out" | sort -u)
check "one DDP_JOB_ID, shared by all ranks" '[[ $(wc -l <<<"$ids") -eq 1 && -n "$ids" ]]'
out=$(DDP_JOB_ID=mine "$ddprun" -n 1 sh -c 'echo "job=$DDP_JOB_ID"')
check "a DDP_JOB_ID that is set is kept" '[[ "$out" == *"job=mine"* ]]'

out=$("$ddprun" -n 2 --port 45678 --timeout 9 sh -c 'echo "p=$MASTER_PORT t=$DDP_TIMEOUT"')
check "--port and --timeout are passed on" '[[ "$out" == *"p=45678 t=9"* ]]'

# Several hosts: two ddprun, one per "node", form one world. Global ranks K*n + local,
# WORLD_SIZE nodes*n, LOCAL_RANK the local one, one job id on both nodes without any given.
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port=$(free_port)
out=$({ "$ddprun" -n 2 --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --port $port sh -c \
          'echo "r=$RANK w=$WORLD_SIZE l=$LOCAL_RANK lw=$LOCAL_WORLD_SIZE a=$MASTER_ADDR p=$MASTER_PORT j=$DDP_JOB_ID"' &
        "$ddprun" -n 2 --nnodes 2 --node-rank 0 --master-addr 127.0.0.1 --port $port sh -c \
          'echo "r=$RANK w=$WORLD_SIZE l=$LOCAL_RANK lw=$LOCAL_WORLD_SIZE a=$MASTER_ADDR p=$MASTER_PORT j=$DDP_JOB_ID"'
        wait; } 2>&1)
for r in 0 1 2 3; do
  check "two nodes: global rank $r, prefixed with it" \
    '[[ "$out" == *"[$r] r=$r w=4 l=$((r % 2)) lw=2 a=127.0.0.1 p=$port j="* ]]'
done
jobs_seen=$(sed -n 's/.* j=\(.*\)/\1/p' <<<"$out" | sort -u)
check "two nodes: one job id on both" '[[ $(wc -l <<<"$jobs_seen") -eq 1 && -n "$jobs_seen" ]]'
out=$(DDP_JOB_ID=env "$ddprun" -n 1 --nnodes 2 --node-rank 1 --master-addr h --port 1 --job-id given sh -c 'echo "j=$DDP_JOB_ID"')
check "--job-id wins over DDP_JOB_ID" '[[ "$out" == *"[1] j=given"* ]]'

if [[ -n "$example" ]]; then
  # The process-group example across the two "nodes": one world of 4 that greets and broadcasts.
  port=$(free_port)
  out=$({ timeout 60 "$ddprun" -n 2 --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --port $port --timeout 20 "$example" &
          timeout 60 "$ddprun" -n 2 --nnodes 2 --node-rank 0 --master-addr 127.0.0.1 --port $port --timeout 20 "$example"
          rc0=$?; wait $!; rc1=$?; echo "rcs=$rc0,$rc1"; } 2>&1)
  check "two nodes run the process-group example as one world of 4" '[[ "$out" == *"rcs=0,0"* ]]'
  for r in 0 1 2 3; do
    check "two nodes: rank $r of 4 greeted everyone" '[[ "$out" == *"[$r] rank $r of 4: 4 greetings, broadcast check OK"* ]]'
  done
  [[ $fail -eq 0 ]] || echo "$out"
fi

out=$("$ddprun" -n 2 --nnodes 2 --node-rank 0 true 2>&1)
rc=$?
check "--nnodes 2 without --master-addr and --port is refused, naming them" \
  '[[ $rc -eq 2 && "$out" == *"--nnodes 2 needs --master-addr"*"--port"* ]]'
out=$("$ddprun" -n 2 --nnodes 2 --master-addr h --port 5 true 2>&1)
check "--nnodes 2 without --node-rank is refused" '[[ $? -eq 2 && "$out" == *"needs --node-rank"* ]]'
out=$("$ddprun" -n 2 --nnodes 2 --node-rank 2 --master-addr h --port 5 true 2>&1)
check "--node-rank outside [0, nnodes) is refused" '[[ $? -eq 2 && "$out" == *"--node-rank 2 is not below --nnodes 2"* ]]'
out=$("$ddprun" -n 2 --nnodes x true 2>&1)
check "a --nnodes that is not a number is refused" '[[ $? -eq 2 && "$out" == *"--nnodes takes a number"* ]]'

"$ddprun" -n 0 true 2>/dev/null
check "-n 0 is refused" '[[ $? -eq 2 ]]'
"$ddprun" -n 2 /nonexistent/program 2>/dev/null >/dev/null
check "a program that cannot start fails the run" '[[ $? -ne 0 ]]'

# --max-restarts K: a failed run is started again, every rank of it, up to K times; the cause of
# each restart is said once; DDP_RESTART_COUNT numbers the runs; a fresh port for each run.
out=$("$ddprun" -n 3 --max-restarts 2 sh -c \
  'echo "run=$DDP_RESTART_COUNT p=$MASTER_PORT"; if [ "$RANK" = 1 ] && [ "$DDP_RESTART_COUNT" -lt 2 ]; then exit 5; fi' 2>&1)
rc=$?
check "--max-restarts: a run that succeeds after two restarts exits 0" '[[ $rc -eq 0 ]]'
check "--max-restarts: every rank ran three times, numbered 0, 1, 2" \
  '[[ $(grep -c "run=0 " <<<"$out") -eq 3 && $(grep -c "run=1 " <<<"$out") -eq 3 && $(grep -c "run=2 " <<<"$out") -eq 3 ]]'
check "--max-restarts: each restart's cause said once" \
  '[[ $(grep -c "rank 1 exited with status 5; restarting every rank (restart 1 of 2)" <<<"$out") -eq 1 &&
      $(grep -c "rank 1 exited with status 5; restarting every rank (restart 2 of 2)" <<<"$out") -eq 1 ]]'
check "--max-restarts: each run on a port of its own" \
  '[[ $(sed -n "s/.*run=[0-9] p=\([0-9]*\).*/\1/p" <<<"$out" | sort -u | wc -l) -eq 3 ]]'
out=$("$ddprun" -n 2 --max-restarts 1 sh -c 'if [ "$RANK" = 0 ]; then exit 4; fi; sleep 60' 2>&1)
rc=$?
check "--max-restarts: when the restarts are spent, the failing rank's status is ddprun's" \
  '[[ $rc -eq 4 && "$out" == *"(restart 1 of 1)"* && "$out" == *"rank 0 exited with status 4; ending the other ranks"* ]]'
out=$("$ddprun" -n 1 --max-restarts 3 sh -c 'echo "run=$DDP_RESTART_COUNT"' 2>&1)
check "--max-restarts: a run that succeeds is not restarted" '[[ "$out" == "[0] run=0" ]]'
out=$("$ddprun" -n 2 --max-restarts 1 sh -c 'echo "j=$DDP_JOB_ID"; [ "$DDP_RESTART_COUNT" = 1 ] || exit 3' 2>&1)
jobs_seen=$(sed -n 's/.* j=\(.*\)/\1/p' <<<"$out" | sort -u)
check "--max-restarts: run 1's job id is run 0's with +restart.1" \
  '[[ $(wc -l <<<"$jobs_seen") -eq 2 && $(sed -n 2p <<<"$jobs_seen") == "$(sed -n 1p <<<"$jobs_seen")+restart.1" ]]'

# The group's store: ddprun serves it (DDP_EXTERNAL_STORE=1 for the ranks) unless told not to or
# unable to (a secret, where ddprun was built without libsodium: DDP_TEST_SODIUM=0).
out=$("$ddprun" -n 2 sh -c 'echo "ext=${DDP_EXTERNAL_STORE:-unset}"')
check "ddprun serves the store: DDP_EXTERNAL_STORE=1 for every rank" '[[ $(grep -c "ext=1" <<<"$out") -eq 2 ]]'
out=$(DDP_EXTERNAL_STORE=0 "$ddprun" -n 2 sh -c 'echo "ext=${DDP_EXTERNAL_STORE:-unset}"')
check "DDP_EXTERNAL_STORE=0 leaves the store on rank 0" '[[ $(grep -c "ext=0" <<<"$out") -eq 2 ]]'
out=$(DDP_AUTH_TOKEN=s3cret "$ddprun" -n 2 sh -c 'echo "ext=${DDP_EXTERNAL_STORE:-unset}"')
if [[ ${DDP_TEST_SODIUM:-0} == 1 ]]; then
  check "with a secret ddprun serves the store and proves the secret" '[[ $(grep -c "ext=1" <<<"$out") -eq 2 ]]'
else
  check "with a secret and no libsodium the store stays on rank 0" '[[ $(grep -c "ext=unset" <<<"$out") -eq 2 ]]'
fi
port=$(free_port)
out=$("$ddprun" -n 2 --port "$port" sh -c 'sleep 0.5; ss -Hltn "sport = :$MASTER_PORT" | wc -l' 2>&1)
check "ddprun listens on the master port while its ranks run" '[[ $(grep -c "\] 1$" <<<"$out") -eq 2 ]]'

# --bind-cores: each rank on one core, local rank l on the l-th usable core (modulo their count).
ncpu=$(nproc)
out=$("$ddprun" -n 2 --bind-cores sh -c 'grep Cpus_allowed_list /proc/self/status; nproc')
check "--bind-cores leaves each rank one core" '[[ $(grep -c "^\[[01]\] 1$" <<<"$out") -eq 2 ]]'
if (( ncpu >= 2 )); then
  check "--bind-cores puts two ranks on different cores" \
    '[[ $(sed -n "s/.*Cpus_allowed_list:\t*//p" <<<"$out" | sort -u | wc -l) -eq 2 ]]'
fi
out=$("$ddprun" -n 1 sh -c 'nproc')
check "without --bind-cores a rank keeps every core" '[[ "$out" == "[0] $ncpu" ]]'

echo "$pass passed, $fail failed"
[[ $fail -eq 0 ]]

#!/bin/bash
# An elastic group with a secret under ddprun (docs/elastic.md, docs/security.md): ddprun serves
# the group's store and proves the secret at every connection, so that the loss of rank 0 is
# survived with a secret too; a process without the secret is refused at the store and takes no
# seat. Prints "N passed, N failed".
#   test_elastic_secret.sh DDPRUN ELASTIC_EXAMPLE
set -u
ddprun=$1
prog=$2
pass=0; fail=0
check() { if eval "$2"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $1"; fi; }
tmp=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$tmp"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port=$(free_port)
export DDP_AUTH_TOKEN=elastic-test-secret-0123456789

"$ddprun" -n 3 --port "$port" --elastic 2:3 --max-restarts 2 "$prog" --min-seconds 4 --stop-file "$tmp/stop" \
  >"$tmp/log" 2>&1 &
launcher=$!
# The program of the slot that holds RANK=0: each keeper (a child of ddprun) has one child.
rank0=""
for _ in $(seq 100); do
  for k in $(pgrep -P "$launcher"); do
    for p in $(pgrep -P "$k"); do
      tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx RANK=0 && rank0=$p
    done
  done
  [[ -n $rank0 ]] && grep -q "generation 1" "$tmp/log" 2>/dev/null && break
  sleep 0.1
done
sleep 1
check "ddprun serves the store with a secret (no 'stays on rank 0')" '! grep -q "stays on rank 0" "$tmp/log"'
check "found rank 0's program" '[[ -n $rank0 ]]'
kill -KILL "$rank0" 2>/dev/null

refusal="the group's store requires authentication"
# A stranger without the secret, as a newcomer of the same job: refused at the store.
out=$(env -u DDP_AUTH_TOKEN MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=0 WORLD_SIZE=3 DDP_ELASTIC=2:3 \
  DDP_EXTERNAL_STORE=1 DDP_RESTART_COUNT=1 DDP_TIMEOUT=5 timeout 30 "$prog" --min-seconds 1 2>&1)
rc=$?
check "a process without the secret is refused (exit $rc): $(tail -1 <<<"$out")" \
  '[[ $rc -ne 0 && $rc -ne 124 && "$out" == *"$refusal"* ]]'
sleep 3
touch "$tmp/stop"
wait "$launcher"
rc=$?
last=$(grep -E '^\[[0-9]+\] .*elastic: ' "$tmp/log" | tail -1)
check "ddprun exits 0 after rank 0's loss (exit $rc)" '[[ $rc -eq 0 ]]'
check "the final rank 0 says elastic: OK with rank 0's loss survived ($last)" \
  '[[ "$last" == *"elastic: OK steps="* && "$last" =~ failures=[1-9] ]]'
echo "stranger: $(tail -1 <<<"$out")"; echo "last: $last"
[[ $fail -eq 0 ]] || tail -40 "$tmp/log"
echo "$pass passed, $fail failed"
[[ $fail -eq 0 ]]

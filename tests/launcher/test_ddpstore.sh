#!/usr/bin/env bash
# ddpstore: the group's store as a process of its own, for launchers other than ddprun
# (docs/elastic.md). A fixed group of 2 started by hand joins it (DDP_EXTERNAL_STORE=1) and
# ddpstore ends once they are gone (--until-idle); an elastic group of 3 started by hand loses
# its rank 0 and goes on (the store is not on it); beyond loopback without DDP_INSECURE=1 it
# refuses to start. Prints "N passed, N failed".
#   test_ddpstore.sh DDPSTORE PROCESS_GROUP_EXAMPLE ELASTIC_EXAMPLE
set -u
ddpstore=$1
pg_example=$2
elastic_example=$3
pass=0; fail=0
check() { if eval "$2"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $1"; fi; }
tmp=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$tmp"' EXIT

# start_store ARGS...: starts ddpstore on a free port; sets store_pid and port.
# Each store writes a file of its own: a loaded machine may run this loop before the new
# process truncates a shared one, and the last store's port (closed) was read from it.
stores=0
start_store() {
  stores=$((stores + 1))
  local out="$tmp/store.$stores.out"
  "$ddpstore" --port 0 "$@" >"$out" 2>&1 &
  store_pid=$!
  port=""
  for _ in $(seq 100); do
    port=$(sed -n 's/^ddpstore: serving on 127.0.0.1:\([0-9]*\)$/\1/p' "$out" 2>/dev/null)
    [[ -n $port ]] && break
    sleep 0.05
  done
}

start_store --world 2 --until-idle 3
check "ddpstore says where it serves" '[[ -n $port ]]'
for r in 0 1; do
  RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port DDP_EXTERNAL_STORE=1 "$pg_example" >"$tmp/pg.$r" 2>&1 &
done
ok=0
for r in 0 1; do wait %$((r + 2)) && ok=$((ok + 1)); done
check "a fixed group of 2 joins ddpstore and finishes (got $ok of 2)" '[[ $ok -eq 2 ]]'
for _ in $(seq 200); do kill -0 $store_pid 2>/dev/null || break; sleep 0.05; done
check "ddpstore ends once its clients are gone (--until-idle 3)" '! kill -0 $store_pid 2>/dev/null'
wait $store_pid
check "ddpstore exits 0" '[[ $? -eq 0 ]]'

# A bound on idleness long enough for the ranks' start on a loaded machine (the store counts it
# from its own start); the store is stopped once the ranks are done.
start_store --elastic --until-idle 60
pids=()
for r in 0 1 2; do
  RANK=$r WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port DDP_EXTERNAL_STORE=1 DDP_ELASTIC=2:3 \
    "$elastic_example" --min-seconds 4 --ready-file "$tmp/ready" >"$tmp/el.$r" 2>&1 &
  pids+=($!)
done
# Rank 0 dies once the group trains (before it, the group would start from another rank's
# initial weights, and the final loss be held to a run it did not make).
for _ in $(seq 300); do [[ -f "$tmp/ready" ]] && break; sleep 0.1; done
sleep 1
kill -KILL "${pids[0]}"; wait "${pids[0]}" 2>/dev/null
rcs=""
for r in 1 2; do wait "${pids[$r]}"; rcs+="$? "; done
check "the elastic group goes on without its rank 0, the store outside it (exit codes: $rcs)" '[[ $rcs == "0 0 " ]]'
[[ $rcs == "0 0 " ]] || for r in 1 2; do echo "--- rank $r:"; tail -n 8 "$tmp/el.$r"; done
last=$(cat "$tmp/el.1" "$tmp/el.2" | grep "elastic: OK" | tail -1)
check "the new rank 0 says elastic: OK with one failure ($last)" '[[ "$last" == *"failures=1 sizes=3,2"* ]]'
kill $store_pid 2>/dev/null; wait $store_pid 2>/dev/null

# The store's process killed under a running elastic group: every rank ends with an error that
# names the store and its address, not rank 0 (which is alive).
start_store --elastic
pids=()
for r in 0 1; do
  RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port DDP_EXTERNAL_STORE=1 DDP_ELASTIC=2:2 DDP_TIMEOUT=10 \
    "$elastic_example" --min-seconds 30 --ready-file "$tmp/ready2" >"$tmp/gone.$r" 2>&1 &
  pids+=($!)
done
for _ in $(seq 300); do [[ -f "$tmp/ready2" ]] && break; sleep 0.1; done
kill -KILL $store_pid; wait $store_pid 2>/dev/null
rcs=""
for r in 0 1; do wait "${pids[$r]}"; rcs+="$? "; done
named=$(grep -h "the group's store at 127.0.0.1:$port" "$tmp/gone.0" "$tmp/gone.1" | head -1)
check "a killed store ends every rank (exit codes: $rcs)" '[[ $rcs != *"0 "* ]]'
check "their error names the store and its address, not rank 0 ($named)" \
  '[[ -n "$named" ]] && ! grep -q "connection to rank 0" "$tmp/gone.0" "$tmp/gone.1"'

if [[ ${DDP_TEST_SODIUM:-0} == 1 ]]; then
  # With a secret: a process without it is refused, naming the store as the group's.
  refusal="the group's store requires authentication"
  DDP_AUTH_TOKEN=ddpstore-test-secret start_store --world 1 --until-idle 2
  out=$(RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port DDP_EXTERNAL_STORE=1 DDP_TIMEOUT=5 \
        timeout 30 "$pg_example" 2>&1)
  rc=$?
  check "with DDP_AUTH_TOKEN a process without the secret is refused (exit $rc): $(tail -1 <<<"$out")" \
    '[[ $rc -ne 0 && $rc -ne 124 && "$out" == *"$refusal"* ]]'
  wait $store_pid 2>/dev/null
else
  out=$(DDP_AUTH_TOKEN=x "$ddpstore" --port 0 2>&1)
  check "without libsodium a secret is refused, not ignored" '[[ $? -eq 2 && "$out" == *"without libsodium"* ]]'
fi
out=$(DDP_INSECURE= "$ddpstore" --host 10.255.255.1 --port 1 2>&1)
rc=$?
check "beyond loopback without DDP_INSECURE=1 it refuses (exit $rc)" '[[ $rc -eq 2 && "$out" == *"DDP_INSECURE=1"* ]]'

echo "$pass passed, $fail failed"
[[ $fail -eq 0 ]]

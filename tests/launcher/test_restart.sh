#!/usr/bin/env bash
# ddprun --max-restarts with a program that checkpoints: rank 1 of 4 is SIGKILLed as epoch 5 of
# the MLP example begins; ddprun says so once and starts every rank again; the new run resumes
# from the checkpoint saved after epoch 4 (ddp::load_checkpoint) and trains to the end, where
# the example's own checks hold as for an uninterrupted run: the loss fell, the weights are
# bitwise equal on every rank and match the single-process run within 1e-4. Prints
# "N passed, N failed". Then the same across two launchers, as two hosts.
#   test_restart.sh DDPRUN MLP_EXAMPLE
set -u
ddprun=$1
mlp=$2
pass=0; fail=0
check() { if eval "$2"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $1"; fi; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

out=$(timeout 240 "$ddprun" -n 4 --max-restarts 2 --timeout 60 "$mlp" --checkpoint "$tmp/mlp.ddp" --fail-at-epoch 4 2>&1)
rc=$?
check "the job finishes with exit 0 after one restart (rc $rc)" '[[ $rc -eq 0 ]]'
check "the cause is said once, with the restart" \
  '[[ $(grep -c "rank 1 was killed by signal 9; restarting every rank (restart 1 of 2)" <<<"$out") -eq 1 &&
      $(grep -c "restarting every rank" <<<"$out") -eq 1 ]]'
check "the second run resumes after epoch 4" '[[ "$out" == *"[0] resumed from $tmp/mlp.ddp after epoch 4"* ]]'
check "the first run trained epochs 1-4 and the second 5-12, once each" \
  '[[ $(grep -c "\[0\] epoch  4 " <<<"$out") -eq 1 && $(grep -c "\[0\] epoch  5 " <<<"$out") -eq 1 &&
      $(grep -c "\[0\] epoch 12 " <<<"$out") -eq 1 ]]'
check "the loss fell" '[[ "$out" == *"[0] loss fell from"*": OK"* ]]'
check "the final weights are bitwise equal on every rank" '[[ "$out" == *"[0] final weights bitwise equal on all 4 ranks"*": OK"* ]]'
check "the resumed run matches the single-process run" '[[ "$out" == *"[0] single-process run on the full batch"*": OK"* ]]'
[[ $fail -eq 0 ]] || echo "$out"

# Two launchers as the two hosts of one world of 4 (2 ranks each): rank 3, on host 1, is killed
# as epoch 5 begins. Host 1's ddprun restarts its ranks; host 0's ranks fail naming rank 3, so
# host 0's ddprun restarts its own, saying why; the hosts meet again in run 1 (its job id
# "<job>+restart.1"; a rank that finds run 0's store still on the port waits for it to go), and
# the run resumes from the checkpoint and passes the example's checks.
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port=$(free_port)
rm -f "$tmp/mlp.ddp"
node() {
  timeout 240 "$ddprun" -n 2 --nnodes 2 --node-rank "$1" --master-addr 127.0.0.1 --port "$port" --timeout 60 \
    --max-restarts 2 "$mlp" --checkpoint "$tmp/mlp.ddp" --fail-at-epoch 4 --fail-rank 3 > "$tmp/node$1.log" 2>&1
}
node 1 & pid1=$!
node 0; rc0=$?
wait $pid1; rc1=$?
out0=$(cat "$tmp/node0.log"); out1=$(cat "$tmp/node1.log")
check "two hosts: both launchers finish with exit 0 (rc $rc0, $rc1)" '[[ $rc0 -eq 0 && $rc1 -eq 0 ]]'
check "two hosts: host 1 restarts once, for the rank killed there" \
  '[[ $(grep -c "restarting every rank" <<<"$out1") -eq 1 &&
      "$out1" == *"rank 3 was killed by signal 9; restarting every rank (restart 1 of 2)"* ]]'
check "two hosts: host 0 restarts once, naming rank 3 as the cause" \
  '[[ $(grep -c "restarting every rank" <<<"$out0") -eq 1 &&
      $(grep "restarting every rank (restart 1 of 2)" <<<"$out0") == *"rank 3"* ]]'
check "two hosts: run 1 resumes after epoch 4" '[[ "$out0" == *"[0] resumed from $tmp/mlp.ddp after epoch 4"* ]]'
check "two hosts: the resumed run passes the example's checks" \
  '[[ "$out0" == *"[0] final weights bitwise equal on all 4 ranks"*": OK"* &&
      "$out0" == *"[0] single-process run on the full batch"*": OK"* ]]'
[[ $fail -eq 0 ]] || { echo "--- host 0"; echo "$out0"; echo "--- host 1"; echo "$out1"; }
echo "$pass passed, $fail failed"
[[ $fail -eq 0 ]]

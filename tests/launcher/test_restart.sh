#!/usr/bin/env bash
# ddprun --max-restarts with a program that checkpoints: rank 1 of 4 is SIGKILLed as epoch 5 of
# the MLP example begins; ddprun says so once and starts every rank again; the new run resumes
# from the checkpoint saved after epoch 4 (ddp::load_checkpoint) and trains to the end, where
# the example's own checks hold as for an uninterrupted run: the loss fell, the weights are
# bitwise equal on every rank and match the single-process run within 1e-4. Prints
# "N passed, N failed".
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
echo "$pass passed, $fail failed"
[[ $fail -eq 0 ]]

#!/bin/bash
# Elastic training whose only store is a real three-member etcd cluster on loopback
# (scripts/etcd_cluster.sh), under `ddprun --store` (docs/cluster.md):
#   A. 4 ranks of examples/05_elastic (--elastic 2:4): a rank SIGKILLed, the etcd leader
#      SIGKILLed and started again, then the group's rank 0 SIGKILLed: ddprun exits 0 and the
#      final rank 0 says "elastic: OK";
#   C. a job id reused after its job finished: ddprun refuses it (exit 2) rather than start ranks
#      that would take the old job's end for theirs;
#   B. quorum lost for good (two members SIGKILLed) with a 4 s timeout: every rank ends with an
#      error naming the etcd store, ddprun exits non-zero, all within 60 s, nothing left running.
# Skips (77) where etcd is not installed or ddprun was built without the etcd backend.
#
#   tests/etcd/test_etcd_elastic.sh DDPRUN ELASTIC_EXAMPLE
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
if (($# != 2)); then
  echo "usage: test_etcd_elastic.sh DDPRUN ELASTIC_EXAMPLE" >&2
  exit 2
fi
ddprun=$(realpath "$1")
prog=$(realpath "$2")
why=$("$root/scripts/etcd_cluster.sh" usable "$ddprun") || { echo "SKIP: $why"; exit 77; }
tmp=$(mktemp -d /dev/shm/ddp-etcd-el-XXXXXX 2>/dev/null || mktemp -d)
cluster() { "$root/scripts/etcd_cluster.sh" "$1" "$tmp/etcd" "${@:2}"; }
cleanup() { cluster stop >/dev/null 2>&1; rm -rf "$tmp"; }
trap cleanup EXIT
trap 'exit 143' TERM INT
url=$(cluster start) || { echo "FAIL: the etcd cluster did not start"; exit 1; }
echo "etcd: $url"
pass=0 fail=0
check() { if eval "$2"; then pass=$((pass + 1)); echo "ok: $1"; else fail=$((fail + 1)); echo "FAIL: $1"; fi; }
# The program of local rank L: the child of ddprun's L-th keeper (ddprun: the child of `timeout`).
program_of() {
  local launcher keeper l=$2
  launcher=$(pgrep -x ddprun -P "$1" | head -1)
  [[ -n $launcher ]] || return 0
  keeper=$(pgrep -P "$launcher" | sort -n | sed -n "$((l + 1))p")
  [[ -n $keeper ]] && pgrep -P "$keeper" | head -1
}

# ---- A: faults of ranks and of etcd's leader, training goes on -------------------------------
env -u DDP_BACKEND timeout 150 "$ddprun" -n 4 --elastic 2:4 --max-restarts 6 --timeout 30 --store "$url" \
  -- "$prog" --min-seconds 22 >"$tmp/a.out" 2>&1 &
run=$!
sleep 5
p=$(program_of "$run" 2); echo "A: SIGKILL local rank 2 (pid $p)"; [[ -n $p ]] && kill -KILL "$p"
sleep 4
leader=$(cluster leader) || leader=1
echo "A: SIGKILL etcd's leader (member $leader)"; cluster kill "$leader"
sleep 2
cluster restart "$leader" || echo "A: member $leader did not come back"
sleep 3
p=$(program_of "$run" 0); echo "A: SIGKILL local rank 0 (pid $p)"; [[ -n $p ]] && kill -KILL "$p"
wait "$run"; rc=$?
grep -v ' epoch ' "$tmp/a.out" | tail -25
last=$(grep -h "elastic: OK" "$tmp/a.out" | tail -1)
check "A: ddprun exits 0 (got $rc)" '[[ $rc == 0 ]]'
check "A: the final rank 0 says elastic: OK ($last)" '[[ -n "$last" ]]'
check "A: the group re-formed after the failures" '[[ "$last" =~ failures=([2-9]|[1-9][0-9]) ]]'
check "A: every etcd member healthy after ($(cluster health | tr '\n' ' '))" '[[ $(cluster health) != *down* ]]'

# ---- C: a finished job's id, reused: refused, not a run that "succeeds" without training ------
job="reused-$$-$RANDOM"
env -u DDP_BACKEND timeout 60 "$ddprun" -n 2 --elastic 1:2 --store "$url" --job-id "$job" -- "$prog" --steps 300 \
  --min-seconds 0 >"$tmp/c1.out" 2>&1; rc1=$?
env -u DDP_BACKEND timeout 60 "$ddprun" -n 2 --elastic 1:2 --store "$url" --job-id "$job" -- "$prog" --steps 300 \
  --min-seconds 0 >"$tmp/c2.out" 2>&1; rc2=$?
tail -2 "$tmp/c2.out"
check "C: a job ran to its end (got $rc1)" '[[ $rc1 == 0 ]] && grep -q "elastic: OK" "$tmp/c1.out"'
check "C: a second job with its id is refused (got $rc2)" '[[ $rc2 == 2 ]] && grep -q "already finished" "$tmp/c2.out"'

# ---- B: quorum lost for good: a clear error on every rank, nothing hung ----------------------
t0=$(date +%s)
env -u DDP_BACKEND timeout 90 "$ddprun" -n 3 --elastic 2:3 --max-restarts 1 --timeout 4 --store "$url" \
  -- "$prog" --min-seconds 60 >"$tmp/b.out" 2>&1 &
run=$!
sleep 4
echo "B: SIGKILL etcd members 2 and 3"; cluster kill 2; cluster kill 3
wait "$run"; rc=$?
took=$(($(date +%s) - t0))
grep -v ' epoch ' "$tmp/b.out" | tail -12
check "B: ddprun exits non-zero (got $rc)" '[[ $rc != 0 && $rc != 124 ]]'
check "B: within 60 s (took ${took} s)" '((took < 60))'
check "B: the ranks name the etcd store in their errors" 'grep -q "etcd://127.0.0.1" "$tmp/b.out"'
check "B: no rank of it is left running" '! pgrep -f -- "$prog --min-seconds 60" >/dev/null'
echo "$pass passed, $fail failed"
[[ $fail -eq 0 ]]

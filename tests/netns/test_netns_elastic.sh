#!/bin/bash
# An elastic group across 3 "hosts" (network namespaces behind a switch, scripts/netns.sh), 2
# ranks each, one `ddprun --elastic 3:6` per host, examples/05_elastic training: a rank on host
# 1 is killed (ddprun replaces it), host 2's link is cut for 5 s and restored (its ranks fall out
# of the group and come back as newcomers), and the group's rank 0 is killed (the store, on
# host 0's ddprun, survives it). Every ddprun must exit 0 and the final rank 0 must say
# "elastic: OK ...". Needs root and iproute2; exits 77 (skip) where namespaces cannot be made.
#
#   tests/netns/test_netns_elastic.sh DDPRUN ELASTIC_EXAMPLE
set -u
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../../scripts/netns.sh"
if (($# != 2)); then
  echo "usage: test_netns_elastic.sh DDPRUN ELASTIC_EXAMPLE" >&2
  exit 2
fi
ddprun=$(realpath "$1")
prog=$(realpath "$2")
netns_check || { echo "SKIP: network namespaces cannot be made here (reason above)"; exit 77; }

tmp=$(mktemp -d)
cleanup() { netns_teardown; rm -rf "$tmp"; }
trap cleanup EXIT
trap 'exit 143' TERM INT

hosts=3
port=29500
netns_setup $hosts 10gbit || { echo "FAIL: setting up $hosts namespaces"; exit 1; }
netns_wait_link || { echo "FAIL: the hosts cannot reach each other"; exit 1; }
master=$(netns_addr 0)
for ((k = hosts - 1; k >= 0; --k)); do
  (netns_exec $k env -u DDP_BACKEND DDP_INSECURE=1 timeout 150 \
     "$ddprun" -n 2 --nnodes $hosts --node-rank $k --master-addr "$master" --port $port --timeout 30 \
     --elastic 3:6 --max-restarts 4 -- "$prog" --min-seconds 30 >"$tmp/host.$k" 2>&1
   echo $? >"$tmp/host.$k.rc") &
done
# The program of host K's local rank L: the child of the L-th keeper (a child of that host's ddprun).
program_of() {
  local k=$1 l=$2 p launcher="" keeper=""
  # The host's ddprun: a process named ddprun with that --node-rank whose parent is no ddprun
  # (its keepers are ddprun forks too).
  for p in $(pgrep -x ddprun); do
    tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q -- "--node-rank $k " || continue
    [[ $(ps -o comm= -p "$(ps -o ppid= -p "$p" | tr -d ' ')") == ddprun ]] && continue
    launcher=$p
  done
  [[ -n $launcher ]] && keeper=$(pgrep -P "$launcher" | sort -n | sed -n "$((l + 1))p")
  [[ -n $keeper ]] && pgrep -P "$keeper" | head -1
}
sleep 6
p=$(program_of 1 1); echo "kill host 1's local rank 1 (pid $p)" | tee -a "$tmp/plan"; [[ -n $p ]] && kill -KILL "$p"
sleep 4
echo "cut host 2's link"; netns_cut 2
sleep 5
echo "restore host 2's link"; ip -n "$(netns_switch)" link set h2 up
sleep 5
p=$(program_of 0 0); echo "kill host 0's local rank 0 (pid $p)" | tee -a "$tmp/plan"; [[ -n $p ]] && kill -KILL "$p"
wait
pass=0 fail=0
check() { if eval "$2"; then pass=$((pass + 1)); echo "ok: $1"; else fail=$((fail + 1)); echo "FAIL: $1"; fi; }
for ((k = 0; k < hosts; ++k)); do
  echo "---- host $k:"
  grep -v ' epoch ' "$tmp/host.$k" | tail -40
done
for ((k = 0; k < hosts; ++k)); do
  check "host $k's ddprun exits 0 (got $(cat "$tmp/host.$k.rc"))" '[[ $(cat "$tmp/host.$k.rc") == 0 ]]'
done
last=$(cat "$tmp"/host.* | grep -h "elastic: OK" | tail -1)
check "the final rank 0 says elastic: OK ($last)" '[[ -n "$last" ]]'
check "host 1's rank and host 0's rank 0 were found to kill" '[[ $(grep -c "kill host .* (pid [0-9][0-9]*)" "$tmp/plan") -eq 2 ]]'
check "the group re-formed after the failures" '[[ "$last" =~ failures=([2-9]|[1-9][0-9]) ]]'
echo "$pass passed, $fail failed"
[[ $fail -eq 0 ]]

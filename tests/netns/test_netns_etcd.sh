#!/bin/bash
# The control plane with no single point of failure (docs/cluster.md): 3 "hosts" (network
# namespaces behind a switch, scripts/netns.sh), each running one member of a real etcd cluster
# (scripts/etcd_cluster.sh) and one `ddprun --elastic --store etcd://...` with 2 ranks of
# examples/05_elastic. While it trains:
#   1. the etcd leader is SIGKILLed, and started again 3 s later (it catches up): no failure;
#   2. quorum is lost (two members SIGKILLed) for 3 s and comes back: no failure;
#   3. host 0 dies whole: its ddprun, its ranks and its etcd member, SIGKILL at once; the
#      other hosts train on in a group of 4;
#   4. host 0 comes back (its etcd member on its data, a new ddprun): the group grows to 6.
# Every ddprun still running at the end exits 0, the final rank 0 says "elastic: OK", no rank
# recovered from anything during 1 and 2, and the sizes seen include 4 and 6.
# Needs root, iproute2 and etcd; exits 77 (skip) where namespaces cannot be made or etcd is missing.
#
#   tests/netns/test_netns_etcd.sh DDPRUN ELASTIC_EXAMPLE
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
source "$root/scripts/netns.sh"
if (($# != 2)); then
  echo "usage: test_netns_etcd.sh DDPRUN ELASTIC_EXAMPLE" >&2
  exit 2
fi
ddprun=$(realpath "$1")
prog=$(realpath "$2")
why=$("$root/scripts/etcd_cluster.sh" usable "$ddprun") || { echo "SKIP: $why"; exit 77; }
netns_check || { echo "SKIP: network namespaces cannot be made here (reason above)"; exit 77; }

tmp=$(mktemp -d)
etcd_dir=$tmp/etcd
hosts=3
cleanup() { "$root/scripts/etcd_cluster.sh" stop "$etcd_dir" >/dev/null 2>&1; netns_teardown; rm -rf "$tmp"; }
trap cleanup EXIT
trap 'exit 143' TERM INT

netns_setup $hosts 10gbit || { echo "FAIL: setting up $hosts namespaces"; exit 1; }
netns_wait_link || { echo "FAIL: the hosts cannot reach each other"; exit 1; }
export HOSTS="$(netns_addr 0) $(netns_addr 1) $(netns_addr 2)"
export NETNS="$(netns_name 0) $(netns_name 1) $(netns_name 2)"
cluster() { "$root/scripts/etcd_cluster.sh" "$@" "$etcd_dir"; }
member() { local c=$1; shift; "$root/scripts/etcd_cluster.sh" "$c" "$etcd_dir" "$@"; }
url=$(cluster start) || { echo "FAIL: the etcd cluster did not start"; exit 1; }
echo "etcd: $url"
job="netns-etcd-$$-$RANDOM"

launch() {  # host K: its ddprun, output to host.K (appended: a restarted host writes on)
  local k=$1
  (netns_exec "$k" env -u DDP_BACKEND DDP_INSECURE=1 timeout 170 \
     "$ddprun" -n 2 --nnodes $hosts --node-rank "$k" --store "$url" --job-id "$job" --timeout 30 \
     --elastic 2:6 --max-restarts 4 -- "$prog" --min-seconds 45 >>"$tmp/host.$k" 2>&1
   echo $? >"$tmp/host.$k.rc") &
}
for ((k = hosts - 1; k >= 0; --k)); do launch $k; done
recoveries() { cat "$tmp"/host.[0-9] 2>/dev/null | grep -c '\[ddp.elastic\] rank' ; }
sleep 8
before=$(recoveries)
leader=$(member leader) || leader=1
echo "1. SIGKILL the etcd leader (member $leader)" | tee -a "$tmp/plan"
member kill "$leader"
sleep 3
member restart "$leader" || echo "member $leader did not come back" >>"$tmp/plan"
sleep 2
a=$(member leader) || a=1
b=$(( a % 3 + 1 ))
echo "2. quorum lost: SIGKILL members $a and $b for 3 s" | tee -a "$tmp/plan"
member kill "$a"; member kill "$b"
sleep 3
member restart "$a" & member restart "$b"; wait %%
sleep 3
after=$(recoveries)
echo "recoveries before the etcd faults: $before, after: $after" | tee -a "$tmp/plan"
echo "3. host 0 dies whole (its ddprun, its ranks, its etcd member)" | tee -a "$tmp/plan"
netns_kill_in "$(netns_name 0)"
sleep 6
echo "4. host 0 comes back" | tee -a "$tmp/plan"
member restart 1 || echo "member 1 did not come back" >>"$tmp/plan"
rm -f "$tmp/host.0.rc"
launch 0
wait
health=$(cluster health)
pass=0 fail=0
check() { if eval "$2"; then pass=$((pass + 1)); echo "ok: $1"; else fail=$((fail + 1)); echo "FAIL: $1"; fi; }
cat "$tmp/plan"
for ((k = 0; k < hosts; ++k)); do
  echo "---- host $k:"
  grep -v ' epoch ' "$tmp/host.$k" | tail -30
done
for ((k = 0; k < hosts; ++k)); do
  check "host $k's ddprun exits 0 (got $(cat "$tmp/host.$k.rc" 2>/dev/null))" '[[ $(cat "$tmp/host.$k.rc" 2>/dev/null) == 0 ]]'
done
last=$(cat "$tmp"/host.* | grep -h "elastic: OK" | tail -1)
check "the final rank 0 says elastic: OK ($last)" '[[ -n "$last" ]]'
check "no rank recovered from anything while etcd lost its leader and its quorum ($before -> $after)" '[[ $before == "$after" ]]'
final=$(cat "$tmp"/host.* | grep -h "final weights bitwise equal on all" | tail -1)
check "the group shrank to 4 ($last)" '[[ "$last" =~ sizes=([0-9,]*,)?4(,|\ ) ]]'
check "and grew back to 6 by the end ($final)" '[[ "$final" == *"on all 6 ranks: OK"* ]]'
check "every etcd member is healthy at the end ($(echo $health))" '[[ $health != *down* ]]'
echo "$pass passed, $fail failed"
[[ $fail -eq 0 ]]

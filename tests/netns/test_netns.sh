#!/usr/bin/env bash
# Several hosts on one machine (issue 12, item 4): 3 network namespaces with their own addresses
# behind a switch, each link limited to 10 Gbit/s with tc, 2 ranks per namespace.
#  1. examples/01_mlp trains with the default reducer, started by one ddprun per host
#     (--nnodes 3 --node-rank K); with DDP_DEBUG=info rank 0 must say the default chose the
#     hierarchical reducer over 3 hosts.
#  2. A long training (netns_train) with DDP_TIMEOUT=5; host 2 (ranks 4, 5) is unplugged while
#     steps run: ranks 0-3 must each raise within the timeout + 2 s of the cut, naming rank 4
#     or 5, and ranks 4 and 5 must end with an error too (not hang).
# Prints every check and "N passed, N failed"; exit 77 (skip) where namespaces cannot be made
# (not root, no iproute2, a container without CAP_SYS_ADMIN / CAP_NET_ADMIN).
#   test_netns.sh DDPRUN MLP_EXAMPLE NETNS_TRAIN auth|insecure
# (auth: NETNS_TRAIN installs libsodium's authenticator, so its group runs with a DDP_AUTH_TOKEN.)
set -u
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../../scripts/netns.sh
source "$here/../../scripts/netns.sh"
if (($# != 4)); then
  echo "usage: test_netns.sh DDPRUN MLP_EXAMPLE NETNS_TRAIN auth|insecure" >&2
  exit 2
fi
ddprun=$(realpath "$1")
mlp=$(realpath "$2")
train=$(realpath "$3")
train_auth=$4

netns_check || { echo "SKIP: network namespaces cannot be made here (reason above)"; exit 77; }

pass=0; fail=0
check() { if eval "$2"; then pass=$((pass + 1)); echo "ok: $1"; else fail=$((fail + 1)); echo "FAIL: $1"; fi; }

tmp=$(mktemp -d)
cleanup() { netns_teardown; rm -rf "$tmp"; }
trap cleanup EXIT
trap 'exit 143' TERM INT  # meson's timeout: still tear down (the EXIT trap)

hosts=3
rate=10gbit
timeout_s=5
port=29500  # rank 0's store, in host 0's own namespace: no other job can hold it
netns_setup $hosts $rate || { echo "FAIL: setting up $hosts namespaces"; exit 1; }
master=$(netns_addr 0)
echo "hosts: $(for ((k = 0; k < hosts; ++k)); do printf '%s=%s ' "$(netns_name $k)" "$(netns_addr $k)"; done)links $rate"

# What the hosts share: /dev/shm is one tmpfs for all of them (ip netns exec makes a mount
# namespace of its own, but does not remount /dev/shm); the network namespace tells them apart.
netns_exec 0 sh -c "echo x > /dev/shm/ddpn-probe-$$"
echo "info: a file made in host 0's /dev/shm is $(netns_exec 1 cat /dev/shm/ddpn-probe-$$ >/dev/null 2>&1 &&
  echo visible || echo not visible) in host 1's; /dev/shm device: host 0 $(netns_exec 0 stat -c %d /dev/shm)," \
  "host 1 $(netns_exec 1 stat -c %d /dev/shm); network namespaces: $(netns_exec 0 readlink /proc/self/ns/net)," \
  "$(netns_exec 1 readlink /proc/self/ns/net)"
rm -f "/dev/shm/ddpn-probe-$$"

# ---- 1. The MLP example, default reducer, one ddprun per host ----------------------------------
# The store is reachable beyond loopback. 01_mlp installs no authenticator (a DDP_AUTH_TOKEN
# would be refused, docs/security.md), so its group opts in with DDP_INSECURE=1: the subnet
# exists only inside this test's namespaces.
for ((k = hosts - 1; k >= 0; --k)); do
  (netns_exec $k env -u DDP_BACKEND DDP_DEBUG=info DDP_INSECURE=1 timeout 90 \
     "$ddprun" -n 2 --nnodes $hosts --node-rank $k --master-addr "$master" --port $port --timeout 30 -- "$mlp" \
     >"$tmp/mlp.$k" 2>&1
   echo $? >"$tmp/mlp.$k.rc") &
done
wait
for ((k = 0; k < hosts; ++k)); do
  echo "---- 01_mlp, host $k (ranks $((2 * k)), $((2 * k + 1))):"
  cat "$tmp/mlp.$k"
done
for ((k = 0; k < hosts; ++k)); do
  check "01_mlp: host $k's ddprun exits 0 (got $(cat "$tmp/mlp.$k.rc"))" '[[ $(cat "$tmp/mlp.$k.rc") == 0 ]]'
done
out0=$(cat "$tmp/mlp.0")
check "01_mlp: the loss fell" '[[ "$out0" == *"[0] loss fell from "*"OK"* ]]'
check "01_mlp: the weights are bitwise equal on all 6 ranks" \
  '[[ "$out0" == *"[0] final weights bitwise equal on all 6 ranks"*"OK"* ]]'
check "01_mlp: the weights match a single-process run" '[[ "$out0" == *"[0] single-process run on the full batch"*"OK"* ]]'
choice=$(grep -h "ddp: backend auto -> " "$tmp"/mlp.* || true)
echo "the default's choice (DDP_DEBUG=info): ${choice:-<no 'ddp: backend auto -> ...' line from any rank>}"
if [[ "$choice" != *"[0] ddp: backend auto -> hierarchical: 3 hosts"* ]]; then
  echo "FAIL: with DDP_DEBUG=info rank 0 must print 'ddp: backend auto -> hierarchical: 3 hosts ...' on stderr:" \
       "ranks in 3 network namespaces are 3 hosts, and the default reducer (ddp::auto_reducer," \
       "include/ddp/reducer/auto.hpp) must pick the hierarchical one; $([[ -z "$choice" ]] &&
         echo "no rank printed a choice at all (a library whose default is not chosen at run time, e.g. the fixed ring over tcp)" ||
         echo "it printed: $choice")"
fi
check "01_mlp: the default reducer chose the hierarchical one for 3 hosts" \
  '[[ "$choice" == *"[0] ddp: backend auto -> hierarchical: 3 hosts"* ]]'

# ---- 2. Host 2 is unplugged mid-step -----------------------------------------------------------
# The ranks start one by one (not under ddprun: when a rank fails, ddprun ends its siblings, and
# each rank's own error is what is checked here), each bounded by `timeout`; each rank's exit
# status and the moment it ended are written down by its shell.
if [[ $train_auth == auth ]]; then
  secret="DDP_AUTH_TOKEN=$(head -c 24 /dev/urandom | base64)"
else
  secret="DDP_INSECURE=1"
fi
world=$((2 * hosts))
for ((r = 0; r < world; ++r)); do
  (netns_exec $((r / 2)) env -u DDP_BACKEND RANK=$r WORLD_SIZE=$world LOCAL_RANK=$((r % 2)) LOCAL_WORLD_SIZE=2 \
     MASTER_ADDR="$master" MASTER_PORT=$((port + 1)) DDP_JOB_ID="netns-$$" DDP_TIMEOUT=$timeout_s "$secret" \
     timeout 40 "$train" >"$tmp/train.$r" 2>"$tmp/train.$r.err"
   echo "$? $(date +%s.%N)" >"$tmp/train.$r.end") &
done
# Cut once every rank is stepping (rank 0 reports every 20 steps).
for ((i = 0; i < 300; ++i)); do
  grep -q "step 100$" "$tmp/train.0" 2>/dev/null && grep -q "step 100$" "$tmp/train.5" 2>/dev/null && break
  sleep 0.1
done
check "netns_train: ranks 0 and 5 reached step 100 before the cut" '((i < 300))'
cut=$(date +%s.%N)
netns_cut 2
echo "cut host 2's link (ranks 4, 5) at $cut, after rank 0's '$(tail -n 1 "$tmp/train.0")'"
wait
limit=$((timeout_s + 2))
# A rank raises within the limit; its process may end later by as long as rank 0 keeps its
# store up for ranks that have not read the failure (the cut-off ones never do): at most
# min(5 s, timeout / 4) (group/detail/close_rules.hpp).
exit_limit=$(awk -v t="$timeout_s" 'BEGIN { l = t / 4; if (l > 5) l = 5; printf "%.2f", t + 2 + l }')
for ((r = 0; r < world; ++r)); do
  read -r rc at <"$tmp/train.$r.end"
  took=$(awk -v a="$at" -v c="$cut" 'BEGIN { printf "%.2f", a - c }')
  msg=$(grep -h "failed at" "$tmp/train.$r.err" || true)
  echo "rank $r: exit $rc, $took s after the cut: ${msg:-$(tail -n 3 "$tmp/train.$r.err" "$tmp/train.$r")}"
  # The error itself, without the "rank R: failed at step N, at T:" that this program adds.
  err=${msg#*: failed at step * at *: }
  if ((r < 4)); then
    check "rank $r fails with a ddp error (exit 1)" '[[ $rc == 1 && -n "$msg" ]]'
    raised=$(sed -n 's/.*: failed at step [0-9]*, at \([0-9.]*\): .*/\1/p' <<<"$msg")
    after=$(awk -v a="${raised:-0}" -v c="$cut" 'BEGIN { printf "%.2f", a - c }')
    check "rank $r raises within the timeout + 2 s of the cut (after $after s, limit $limit s)" \
      '[[ -n "$raised" ]] && awk -v t="$after" -v l="$limit" "BEGIN { exit !(t >= 0 && t <= l) }"'
    check "rank $r ends within that and rank 0's store linger (took $took s, limit $exit_limit s)" \
      'awk -v t="$took" -v l="$exit_limit" "BEGIN { exit !(t <= l) }"'
    check "rank $r's error names the lost rank 4 or 5" '[[ "$err" =~ rank\ [45]([^0-9]|$) ]]'
  else
    check "rank $r (unplugged) ends with a ddp error, not a hang (exit $rc, $took s)" '[[ $rc == 1 && -n "$msg" ]]'
  fi
done

echo "$pass passed, $fail failed"
[[ $fail -eq 0 ]]

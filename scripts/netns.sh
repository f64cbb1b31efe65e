# shellcheck shell=bash
# Several "hosts" on one machine, as network namespaces: sourced by tests/netns/test_netns.sh and
# bench/netns_hier.sh (bash, with or without set -euo pipefail; needs root and iproute2's ip and tc).
#
#   source scripts/netns.sh
#   netns_check || exit 77          # says why on stderr when namespaces cannot be made here
#   netns_setup 3 10gbit            # hosts 0..2, addresses $(netns_addr K), links limited to 10 Gbit/s
#   trap netns_teardown EXIT
#   netns_exec 1 ddprun -n 2 --nnodes 3 --node-rank 1 --master-addr "$(netns_addr 0)" --port P -- prog
#   netns_cut 2                     # unplugs host 2's cable at the switch
#
# The layout: one namespace per host (eth0, with 10.213.0.<K+1>/24, and lo), and one more for the
# switch: a bridge with one veth port per host. Nothing is made in the caller's namespace, so runs
# side by side never collide (each has its own switch, and the same subnet in its own namespaces)
# and the machine's own routes are never touched. Each link is limited in both directions with
# tc's token bucket (tbf): on the host's eth0 (what it sends) and on its switch port (what it
# receives). Latency is not modeled (these kernels have no netem).
#
# Names are ddpn-<pid>-<random>-<what>, so that a run whose process was killed leaves names that
# the next run neither reuses nor trips over; netns_setup first removes the leftovers of runs
# whose process is gone (namespaces ddpn-<pid>-* of a pid that no longer exists).
#
# Shared memory: `ip netns exec` gives the command its own mount namespace, but /dev/shm in it
# is the machine's tmpfs (same device): ranks in different namespaces can open each other's
# segments; what makes them different hosts to ddp is the network namespace.

netns_subnet=10.213.0
netns_prefix=""
netns_hosts=0

# Whether namespaces can be made here; prints why not on stderr.
netns_check() {
  if [[ $(id -u) -ne 0 ]]; then
    echo "netns: needs root (ip netns add, tc); running as uid $(id -u)" >&2
    return 1
  fi
  local tool
  for tool in ip tc; do
    if ! command -v "$tool" >/dev/null; then
      echo "netns: '$tool' not found (Debian: apt-get install iproute2)" >&2
      return 1
    fi
  done
  local probe="ddpn-$$-probe$RANDOM" err
  if ! err=$(ip netns add "$probe" 2>&1); then
    echo "netns: 'ip netns add' is not allowed here: $err (a container needs CAP_SYS_ADMIN and CAP_NET_ADMIN," \
         "and a writable /run/netns)" >&2
    return 1
  fi
  if ! err=$(ip -n "$probe" link add p0 type veth peer name p1 2>&1); then
    ip netns del "$probe" 2>/dev/null
    echo "netns: cannot make a veth pair: $err" >&2
    return 1
  fi
  if ! err=$(tc -n "$probe" qdisc add dev p0 root tbf rate 1gbit burst 1mb latency 50ms 2>&1); then
    ip netns del "$probe" 2>/dev/null
    echo "netns: cannot limit a link's rate with tc tbf: $err (kernel module sch_tbf)" >&2
    return 1
  fi
  ip netns del "$probe"
}

# Removes the namespaces of earlier runs whose process is gone, with whatever still runs in them.
netns_reap() {
  local ns pid
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^ddpn-[0-9]*-'); do
    pid=${ns#ddpn-}
    pid=${pid%%-*}
    if ! kill -0 "$pid" 2>/dev/null; then
      netns_kill_in "$ns"
      ip netns del "$ns" 2>/dev/null
    fi
  done
}

# Kills the processes still running in namespace $1 (only this script's children run there).
netns_kill_in() {
  local pids
  pids=$(ip netns pids "$1" 2>/dev/null)
  # shellcheck disable=SC2086 # one pid per word
  [[ -n "$pids" ]] && kill -9 $pids 2>/dev/null
  return 0
}

netns_name() { echo "${netns_prefix}h$1"; }      # host K's namespace
netns_switch() { echo "${netns_prefix}sw"; }     # the switch's namespace
netns_addr() { echo "$netns_subnet.$(($1 + 1))"; }
netns_exec() { local k=$1; shift; ip netns exec "$(netns_name "$k")" "$@"; }

# netns_setup HOSTS RATE [BURST]: makes the hosts, the switch and the links; RATE and BURST in
# tc's units (10gbit, 1mb). Returns non-zero, having removed what it made, on failure.
netns_setup() {
  local hosts=$1 rate=$2 burst=${3:-2mb} k sw ns
  netns_reap
  netns_prefix="ddpn-$$-$(printf '%04x' $((RANDOM % 65536)))-"
  netns_hosts=$hosts
  sw=$(netns_switch)
  {
    ip netns add "$sw" &&
      ip -n "$sw" link add br0 type bridge &&
      ip -n "$sw" link set br0 up &&
      ip -n "$sw" link set lo up
  } || { netns_teardown; return 1; }
  for ((k = 0; k < hosts; ++k)); do
    ns=$(netns_name "$k")
    {
      ip netns add "$ns" &&
        ip -n "$sw" link add "h$k" type veth peer name eth0 netns "$ns" &&
        ip -n "$sw" link set "h$k" master br0 up &&
        ip -n "$ns" addr add "$(netns_addr "$k")/24" dev eth0 &&
        ip -n "$ns" link set eth0 up &&
        ip -n "$ns" link set lo up &&
        tc -n "$ns" qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms &&
        tc -n "$sw" qdisc add dev "h$k" root tbf rate "$rate" burst "$burst" latency 50ms
    } || { echo "netns: setting up host $k failed" >&2; netns_teardown; return 1; }
  done
  # The bridge forwards once its ports are up; wait until every host reaches host 0.
  netns_wait_link || { echo "netns: the hosts cannot reach each other" >&2; netns_teardown; return 1; }
}

# Waits (up to 5 s) until every host can open a TCP connection to every other's address:
# a listener in host 0 answers each host in turn (bash's /dev/tcp, no extra tools).
netns_wait_link() {
  local k i
  for ((k = 1; k < netns_hosts; ++k)); do
    for ((i = 0; i < 50; ++i)); do
      # A refused connection proves the path (an RST came back); silence or no route does not.
      local said
      said=$(netns_exec "$k" timeout 1 bash -c "exec 3<>/dev/tcp/$(netns_addr 0)/9" 2>&1 || true)
      [[ "$said" == *refused* ]] && break
      sleep 0.1
    done
    ((i < 50)) || return 1
  done
}

# Unplugs host K's cable at the switch: its port goes down, nothing passes either way, and
# no peer is told (no RST, no FIN), as when a cable or a switch port fails.
netns_cut() { ip -n "$(netns_switch)" link set "h$1" down; }

# Removes everything netns_setup made (the processes still running in the namespaces first);
# safe to call twice, and after a partial setup.
netns_teardown() {
  [[ -n "$netns_prefix" ]] || return 0
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${netns_prefix}"); do
    netns_kill_in "$ns"
    ip netns del "$ns" 2>/dev/null
  done
  netns_prefix=""
}

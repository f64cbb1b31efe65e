#!/usr/bin/env bash
# A real three-member etcd cluster on loopback, for trying ddp's etcd store and for its tests
# (Debian's etcd-server; scripts/deps.sh installs it). Each member's client and peer ports are
# picked free; its data lives under DIR (on /dev/shm when DIR is there).
#
#   scripts/etcd_cluster.sh start DIR        starts m1 m2 m3, waits until all are healthy, prints
#                                            the DDP_STORE URL (also in DIR/url)
#   scripts/etcd_cluster.sh stop DIR         ends every member (SIGKILL after 5 s)
#   scripts/etcd_cluster.sh kill DIR N       SIGKILL member N (1..3)
#   scripts/etcd_cluster.sh restart DIR N    starts member N again on its data (it catches up)
#   scripts/etcd_cluster.sh leader DIR       prints the leader's number (1..3)
#   scripts/etcd_cluster.sh health DIR       prints each member's health
#   scripts/etcd_cluster.sh usable [DDPRUN]  exit 0 where etcd is installed (and DDPRUN has the etcd
#                                            backend), else 1 saying why (tests skip on it)
#
# ETCD_FLAGS="--auth-token-ttl 1" adds flags to every member's command line.
# In a network namespace (scripts/netns.sh) set HOSTS="10.0.0.1 10.0.0.2 10.0.0.3" to put member
# N on the N-th address instead of 127.0.0.1, and NETNS="ns1 ns2 ns3" to start it inside that
# namespace.
set -euo pipefail
cmd=${1:?usage: etcd_cluster.sh start|stop|kill|restart|leader|health DIR [N], or usable [DDPRUN]}
ETCD_BIN=${ETCD_BIN:-etcd}
if [[ $cmd == usable ]]; then
  command -v "$ETCD_BIN" >/dev/null || { echo "etcd is not installed (scripts/deps.sh installs etcd-server)"; exit 1; }
  # An empty URL fails at once: naming the missing backend, or (with it) the missing endpoint.
  if [[ -n ${2:-} ]] && "$2" --store etcd:// -n 1 true 2>&1 | grep -q "built without the etcd backend"; then
    echo "ddprun was built without the etcd backend"
    exit 1
  fi
  exit 0
fi
dir=${2:?usage: etcd_cluster.sh $cmd DIR}
ETCDCTL=${ETCDCTL:-etcdctl}
read -r -a hosts <<<"${HOSTS:-127.0.0.1 127.0.0.1 127.0.0.1}"
read -r -a nss <<<"${NETNS:-}"

free_ports() {  # N free TCP ports on loopback
  python3 - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

in_ns() {  # runs "$@" in member $1's namespace, if any
  local n=$1; shift
  if ((${#nss[@]})); then ip netns exec "${nss[$((n - 1))]}" "$@"; else "$@"; fi
}

member_pids() {  # the processes of member N (by its data directory, whatever started them)
  pgrep -f -- "--data-dir $dir/m$1.data" || true
}

start_member() {  # N [new|existing]
  local n=$1 state=${2:-new}
  local client peer
  read -r client peer <"$dir/m$n.ports"
  local h=${hosts[$((n - 1))]}
  local flags=(
    --listen-client-urls "http://$h:$client" --advertise-client-urls "http://$h:$client"
    --listen-peer-urls "http://$h:$peer" --initial-advertise-peer-urls "http://$h:$peer"
    --initial-cluster "$(cat "$dir/cluster")" --initial-cluster-state "$state"
    --initial-cluster-token "ddp-$(basename "$dir")"
    --heartbeat-interval 50 --election-timeout 500)
  read -r -a extra <<<"${ETCD_FLAGS:-}"
  flags+=("${extra[@]}")
  (
    if ((${#nss[@]})); then exec ip netns exec "${nss[$((n - 1))]}" "$ETCD_BIN" --name "m$n" --data-dir "$dir/m$n.data" "${flags[@]}"
    else exec "$ETCD_BIN" --name "m$n" --data-dir "$dir/m$n.data" "${flags[@]}"; fi
  ) >>"$dir/m$n.log" 2>&1 </dev/null &
  echo $! >"$dir/m$n.pid"
}

healthy() {  # N: member N answers a linearizable read
  local client peer
  read -r client peer <"$dir/m$1.ports"
  in_ns "$1" "$ETCDCTL" --endpoints "http://${hosts[$(($1 - 1))]}:$client" --command-timeout=1s \
    endpoint health >/dev/null 2>&1
}

case "$cmd" in
  start)
    mkdir -p "$dir"
    read -r -a ports <<<"$(free_ports 6)"
    cluster="" url=""
    for n in 1 2 3; do
      echo "${ports[$((2 * n - 2))]} ${ports[$((2 * n - 1))]}" >"$dir/m$n.ports"
      h=${hosts[$((n - 1))]}
      cluster+="${cluster:+,}m$n=http://$h:${ports[$((2 * n - 1))]}"
      url+="${url:+,}$h:${ports[$((2 * n - 2))]}"
    done
    echo "$cluster" >"$dir/cluster"
    echo "etcd://$url" >"$dir/url"
    for n in 1 2 3; do start_member "$n" new; done
    end=$((SECONDS + 30))
    while ((SECONDS < end)); do
      if healthy 1 && healthy 2 && healthy 3; then cat "$dir/url"; exit 0; fi
      sleep 0.1
    done
    echo "etcd_cluster: the members did not become healthy within 30 s; logs in $dir/m*.log" >&2
    tail -n 5 "$dir"/m*.log >&2 || true
    exit 1
    ;;
  stop)
    for n in 1 2 3; do for p in $(member_pids "$n"); do kill "$p" 2>/dev/null || true; done; done
    for _ in $(seq 1 50); do
      [[ -z "$(member_pids 1)$(member_pids 2)$(member_pids 3)" ]] && exit 0
      sleep 0.1
    done
    for n in 1 2 3; do for p in $(member_pids "$n"); do kill -9 "$p" 2>/dev/null || true; done; done
    ;;
  kill)
    n=${3:?member number}
    for p in $(member_pids "$n"); do kill -9 "$p" 2>/dev/null || true; done
    for _ in $(seq 1 50); do [[ -z "$(member_pids "$n")" ]] && exit 0; sleep 0.1; done
    echo "etcd_cluster: member $n did not end" >&2
    exit 1
    ;;
  restart)
    n=${3:?member number}
    start_member "$n" existing
    end=$((SECONDS + 30))
    while ((SECONDS < end)); do healthy "$n" && exit 0; sleep 0.1; done
    echo "etcd_cluster: member $n did not become healthy again within 30 s" >&2
    exit 1
    ;;
  leader)
    for n in 1 2 3; do
      read -r client peer <"$dir/m$n.ports"
      out=$(in_ns "$n" "$ETCDCTL" --endpoints "http://${hosts[$((n - 1))]}:$client" --command-timeout=1s \
        endpoint status -w json 2>/dev/null) || continue
      python3 -c 'import json,sys; s=json.loads(sys.argv[1])[0]["Status"]; sys.exit(0 if s["leader"]==s["header"]["member_id"] else 1)' "$out" &&
        { echo "$n"; exit 0; }
    done
    echo "etcd_cluster: no leader" >&2
    exit 1
    ;;
  health)
    for n in 1 2 3; do if healthy "$n"; then echo "m$n healthy"; else echo "m$n down"; fi; done
    ;;
  *)
    echo "etcd_cluster: unknown command $cmd" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# Time from a killed rank to the next completed step, ddp in place (an elastic group) and ddp's
# restart against torchrun's, in one sitting: 4 ranks train on a real model's shapes (ResNet-50 by default), checkpoint every C
# steps, and rank 1 SIGKILLs itself as step K begins. ddp: `ddprun --max-restarts 1` with
# build/bench/restart_probe (ddp::save_checkpoint / load_checkpoint). PyTorch: torchrun's agent
# (elastic_launch, max_restarts 1, c10d rendezvous, torchrun's default monitor interval) with
# DDP over gloo and torch.save / torch.load (bench/peers/torch_restart.py). Both run ROUNDS
# times, alternating; the table gives medians of
#   - kill -> next step: from the victim's `kill at` to the first step that the new run
#     completes (detection, ending the others, restart, rendezvous, loading the checkpoint, one
#     step), and
#   - the steps that the new run repeats (those since the last checkpoint: K - K % C),
#   - a steady step (the median step of the first run, for scale).
#
#   bench/restart_time.sh [ROUNDS] [BUILD_DIR] [PARAMS]    defaults: 5, build, tests/data/resnet50.params
# The in-place rows: SIGKILL and SIGSTOP of the victim on one host, and a cut link: 4 hosts as
# network namespaces (scripts/netns.sh, 10 Gbit/s links, one rank each, a ddprun per host), the
# victim's host unplugged at the switch as rank 0 completes step K (needs root; the row is left
# out where namespaces cannot be made).
# TORCH_MONITOR_INTERVAL=S sets the agent's monitor interval (torchrun's default, 5 s, otherwise):
# it polls its workers that often, so a death waits up to S seconds to be seen.
# ROWS=kill runs only the in-place SIGKILL row, ROWS=in-place only the in-place rows (SIGKILL,
# SIGSTOP, link cut); ROWS=all (the default) every row. ROWS=kill with BUILD_DIR a list of build
# directories separated by ':' (`bench/restart_time.sh 9 /tmp/before:build`) runs the SIGKILL row
# of each in turn, round by round (an A/B in one sitting), and gives one row per build.
# ROWS=kill ETCD=1: each build twice, its store built in (in ddprun) and on a real three-member
# etcd cluster on loopback (scripts/etcd_cluster.sh; `ddprun --store`), rows "DIR" and "DIR@etcd".
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-5}
build=${2:-$root/build}
rows=${ROWS:-all}
case $rows in all | in-place | kill) ;; *) echo "restart_time: ROWS=$rows: say all, in-place or kill"; exit 2 ;; esac
if [[ $build == *:* ]]; then
  [[ $rows == kill ]] || { echo "restart_time: several build directories need ROWS=kill"; exit 2; }
  IFS=: read -r -a builds <<< "$build"
  build=${builds[0]}
else
  builds=("$build")
fi
params=${3:-$root/tests/data/resnet50.params}
ranks=4 steps=12 kill_at=7 victim=1 every=5
tmp=$(mktemp -d)
source "$root/scripts/netns.sh"
etcd_url="" store_args=()
if [[ ${ETCD:-0} == 1 ]]; then
  [[ $rows == kill ]] || { echo "restart_time: ETCD=1 needs ROWS=kill"; exit 2; }
  etcd_dir=$(mktemp -d /dev/shm/ddp-restart-etcd-XXXXXX)
  etcd_url=$("$root/scripts/etcd_cluster.sh" start "$etcd_dir") || { echo "restart_time: etcd did not start"; exit 2; }
  both=()
  for b in "${builds[@]}"; do both+=("$b" "$b@etcd"); done
  builds=("${both[@]}")
fi
trap 'netns_teardown; [[ -n $etcd_url ]] && "$root/scripts/etcd_cluster.sh" stop "$etcd_dir" && rm -rf "$etcd_dir"; rm -rf "$tmp"' EXIT
for b in "${builds[@]}"; do
  b=${b%@etcd}
  [[ -x $b/bench/restart_probe && -x $b/tools/ddprun ]] ||
    { echo "restart_time: build $b/bench/restart_probe and $b/tools/ddprun first (ninja -C $b)"; exit 2; }
done
probe=$build/bench/restart_probe ddprun=$build/tools/ddprun
free_port() { /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# measure LOG: "<kill -> next step ms> <steady step ms>" from a run's output (the steady step:
# the median of the first run's step-to-step times).
measure() {
  local next steady
  next=$(awk '
    /kill at/ { for (i = 1; i <= NF; ++i) if ($i == "at") kill = $(i + 1) }
    /step [0-9]+ run 1 at/ && !next_ms { next_ms = $NF }
    END { if (kill && next_ms) print next_ms - kill; else print "failed" }' "$1")
  steady=$(awk '/step [0-9]+ run 0 at/ { if (prev) print $NF - prev; prev = $NF }' "$1" | sort -n |
    awk '{a[NR] = $1} END {print NR ? a[int((NR + 1) / 2)] : 0}')
  echo "$next $steady"
}

# in_place LOG SIGNAL: ddp's in-place recovery (an elastic group under ddprun --elastic 2:4, no
# replacement): the victim kills or stops itself as step K begins; a stopped one is killed once
# the survivors are done.
in_place() {
  local log=$1 sig=$2 pid
  timeout 300 "$ddprun" -n $ranks --elastic 2:$ranks --max-restarts 0 "${store_args[@]}" "$probe" "$params" --elastic --signal "$sig" \
    --steps $steps --kill-at $kill_at --victim $victim > "$log" 2>&1 &
  local launcher=$!
  for ((t = 0; t < 3000; ++t)); do
    grep -q "step $steps run" "$log" && break
    kill -0 $launcher 2>/dev/null || break
    sleep 0.1
  done
  pid=$(sed -n 's/.*kill at [0-9]* pid \([0-9]*\).*/\1/p' "$log" | head -1)
  [[ -n $pid ]] && kill -KILL "$pid" 2>/dev/null
  wait $launcher
}

# link_cut LOG: ddp's in-place recovery from a cut link. The cut's time is written as
# `kill at <ms>` before rank 0's output, so that measure() reads it as the kill's.
link_cut() {
  local log=$1 k t
  netns_setup $ranks 10gbit || return 1
  for ((k = ranks - 1; k >= 0; --k)); do
    netns_exec $k env -u DDP_BACKEND DDP_INSECURE=1 timeout 120 "$ddprun" -n 1 --nnodes $ranks --node-rank $k \
      --master-addr "$(netns_addr 0)" --port 29500 --elastic 2:$ranks --max-restarts 0 -- "$probe" "$params" \
      --elastic --kill-at -1 --steps $steps > "$log.host$k" 2>&1 &
  done
  for ((t = 0; t < 12000; ++t)); do
    grep -q "step $kill_at run 0" "$log.host0" 2>/dev/null && break
    sleep 0.01
  done
  echo "kill at $(date +%s%3N) (host $victim's link cut)" > "$log"
  netns_cut $victim
  for ((t = 0; t < 1200; ++t)); do
    grep -q "step $steps run" "$log.host0" && break
    sleep 0.1
  done
  cat "$log.host0" >> "$log"
  netns_teardown
  wait
}
cut_ok=1
if [[ $rows == kill ]]; then
  cut_ok=""
elif ! netns_check 2>/dev/null; then
  echo "restart_time: network namespaces cannot be made here: the link-cut row is left out" >&2
  cut_ok=""
fi

ddp_res=() torch_res=() cut_res=() ddp_step=() torch_step=() kill_res=() kill_step=() stop_res=() tft_res=() tft_step=()
# torchft (PyPI, with the current torch) where it is installed: TORCHFT_PYTHON, else the venv of
# scripts/torch_current.sh with torchft added (`/opt/ddp-torch-venv/bin/pip install torchft`).
tft=${TORCHFT_PYTHON:-/opt/ddp-torch-venv/bin/python}
if [[ $rows == all ]]; then
  "$tft" -c 'import torchft' 2>/dev/null || { echo "restart_time: no torchft at $tft: its row is left out" >&2; tft=""; }
else
  tft=""
fi
median() { printf '%s\n' "$@" | grep -v failed | sort -n | awk '{a[NR] = $1} END {print NR ? (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2) : "failed"}'; }
if [[ $rows == kill ]]; then
  # The SIGKILL row alone, for each build directory in turn, round by round.
  declare -A res steady
  for ((r = 1; r <= rounds; ++r)); do
    line="round $r:"
    for ((i = 0; i < ${#builds[@]}; ++i)); do
      b=${builds[i]%@etcd}
      probe=$b/bench/restart_probe ddprun=$b/tools/ddprun
      store_args=()
      [[ ${builds[i]} == *@etcd ]] && store_args=(--store "$etcd_url")
      in_place "$tmp/kill.$i.$r" KILL
      read -r a b < <(measure "$tmp/kill.$i.$r")
      res[$i]+="$a " steady[$i]+="$b "
      line+=" ${builds[i]} $a ms (step $b ms);"
    done
    echo "$line" >&2
  done
  echo "restart_time: $(basename "$params" .params), $ranks ranks, kill at step $kill_at, $rounds rounds, $(nproc) cores, SIGKILL row only"
  echo
  echo '| build | kill -> next completed step (median ms) | steady step (ms) | runs (ms) |'
  echo '|---|---|---|---|'
  for ((i = 0; i < ${#builds[@]}; ++i)); do
    # shellcheck disable=SC2086
    echo "| ${builds[i]} | $(median ${res[$i]}) | $(median ${steady[$i]}) | ${res[$i]% } |"
  done
  exit 0
fi
for ((r = 1; r <= rounds; ++r)); do
  in_place "$tmp/kill.$r" KILL
  read -r a b < <(measure "$tmp/kill.$r"); kill_res+=("$a"); kill_step+=("$b")
  in_place "$tmp/stop.$r" STOP
  read -r a b < <(measure "$tmp/stop.$r"); stop_res+=("$a")
  if [[ -n $cut_ok ]]; then
    link_cut "$tmp/cut.$r"
    read -r a b < <(measure "$tmp/cut.$r"); cut_res+=("$a")
    echo "round $r: ddp in place, link cut ${cut_res[-1]} ms (step across namespaces $b ms)" >&2
  fi
  if [[ $rows == in-place ]]; then
    echo "round $r: ddp in place ${kill_res[-1]} ms (SIGKILL), ${stop_res[-1]} ms (SIGSTOP; elastic step ${kill_step[-1]} ms)" >&2
    continue
  fi
  if [[ -n $tft ]]; then
    timeout 300 "$tft" "$root/bench/peers/torchft_recovery.py" "$params" --ranks $ranks --steps 14 --kill-at $kill_at \
      --victim $victim > "$tmp/torchft.$r" 2>&1
    read -r a b < <(measure "$tmp/torchft.$r"); tft_res+=("$a"); tft_step+=("$b")
    echo "round $r: torchft in place ${tft_res[-1]} ms (step ${tft_step[-1]} ms)" >&2
  fi
  rm -f "$tmp/ckpt.ddp" "$tmp/ckpt.pt"
  timeout 300 "$ddprun" -n $ranks --max-restarts 1 "$probe" "$params" --checkpoint "$tmp/ckpt.ddp" --steps $steps \
    --kill-at $kill_at --victim $victim --every $every > "$tmp/ddp.$r" 2>&1
  read -r a b < <(measure "$tmp/ddp.$r"); ddp_res+=("$a"); ddp_step+=("$b")
  timeout 300 /usr/bin/python3 "$root/bench/peers/torch_restart.py" "$params" --ranks $ranks --checkpoint "$tmp/ckpt.pt" \
    --steps $steps --kill-at $kill_at --victim $victim --every $every --port "$(free_port)" \
    --monitor-interval "${TORCH_MONITOR_INTERVAL:-5}" > "$tmp/torch.$r" 2>&1
  read -r a b < <(measure "$tmp/torch.$r"); torch_res+=("$a"); torch_step+=("$b")
  echo "round $r: ddp in place ${kill_res[-1]} ms (SIGKILL), ${stop_res[-1]} ms (SIGSTOP; elastic step ${kill_step[-1]} ms); ddp restart ${ddp_res[-1]} ms (step ${ddp_step[-1]} ms), torchrun ${torch_res[-1]} ms (step ${torch_step[-1]} ms)" >&2
done
dm=$(median "${ddp_res[@]}") tm=$(median "${torch_res[@]}")
repeated=$((kill_at % every))
echo "restart_time: $(basename "$params" .params), $ranks ranks, kill at step $kill_at, checkpoint every $every, $rounds rounds, $(nproc) cores"
echo
echo '| launcher | kill -> next completed step (median ms) | steps repeated | steady step (ms) | runs (ms) |'
echo '|---|---|---|---|---|'
km=$(median "${kill_res[@]}") sm=$(median "${stop_res[@]}")
echo "| ddp in place (elastic_group, ddprun --elastic 2:4), SIGKILL | $km | 0 | $(median "${kill_step[@]}") | ${kill_res[*]} |"
echo "| ddp in place, SIGSTOP (heartbeat lease 1 s) | $sm | 0 | | ${stop_res[*]} |"
[[ -n $cut_ok ]] && echo "| ddp in place, link cut (4 namespaces at 10 Gbit/s, lease 1 s) | $(median "${cut_res[@]}") | 0 | | ${cut_res[*]} |"
[[ $rows == in-place ]] && exit 0
echo "| ddprun --max-restarts 1, ddp default | $dm | $repeated | $(median "${ddp_step[@]}") | ${ddp_res[*]} |"
[[ -n $tft ]] && echo "| torchft 0.2 in place (Manager, gloo, lighthouse heartbeat timeout 1 s) | $(median "${tft_res[@]}") | 0 | $(median "${tft_step[@]}") | ${tft_res[*]} |"
echo "| torchrun agent (max_restarts 1, c10d, monitor ${TORCH_MONITOR_INTERVAL:-5} s), PyTorch DDP gloo | $tm | $repeated | $(median "${torch_step[@]}") | ${torch_res[*]} |"
echo
awk -v d="$dm" -v t="$tm" 'BEGIN { if (d > 0 && t > 0) printf "ddp restarts %.1fx faster than torchrun\n", t / d }'
awk -v k="$km" -v t="$tm" 'BEGIN { if (k > 0 && t > 0) printf "ddp recovers in place (SIGKILL) %.1fx faster than torchrun restarts\n", t / k }'
awk -v e="$(median "${kill_step[@]}")" -v p="$(median "${ddp_step[@]}")" \
  'BEGIN { if (e > 0 && p > 0) printf "steady step, elastic / plain: %.3f\n", e / p }'

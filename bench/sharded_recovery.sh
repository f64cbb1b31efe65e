#!/usr/bin/env bash
# Recovery of sharded training (ZeRO-2, AdamW) from a killed rank, in one sitting: 4 ranks train
# on a real model's shapes; rank 1 kills itself (SIGKILL) as step 7 begins; each row gives the
# median time from the kill to the next step the group completes, and the steps repeated:
#
#   ddp in place      ddprun --elastic 2:4, bench/restart_probe --elastic --sharded: replicated
#                     shards (2 holders each, the elastic default) re-sharded in memory
#   ddp restart       ddprun --max-restarts 1, bench/restart_probe --sharded: every rank restarts
#                     and loads the last checkpoint (every 5 steps: the weights and
#                     sharded_state(), the shards' AdamW state gathered on rank 0)
#   torchrun ZeRO     torchrun's agent (max_restarts 1, c10d, monitor interval 5 s) with PyTorch
#                     DDP (gloo) and ZeroRedundancyOptimizer over AdamW, the same checkpoint
#                     (consolidate_state_dict on rank 0, torch.save), bench/peers/torch_restart.py --zero
#
#   bench/sharded_recovery.sh [ROUNDS] [BUILD_DIR] [PARAMS...]   defaults: 3, build-rel,
#                                                                 ResNet-50 and BERT-base shapes
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-3}
build=${2:-$root/build-rel}
shift 2 2>/dev/null || shift $#
models=("$@")
[[ ${#models[@]} -gt 0 ]] || models=("$root/tests/data/resnet50.params" "$root/tests/data/bert_base.params")
probe=$build/bench/restart_probe ddprun=$build/tools/ddprun
[[ -x $probe && -x $ddprun ]] || { echo "sharded_recovery: build $probe and $ddprun first"; exit 2; }
ranks=4 steps=12 kill_at=7 victim=1 every=5
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
free_port() { /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# measure LOG: "<kill -> next step ms> <steps repeated> <steady step ms>" (the steady step: the
# median of the first run's step-to-step times).
measure() {
  local steady
  steady=$(awk '/step [0-9]+ run 0 at/ { if (prev) print $NF - prev; prev = $NF }' "$1" | sort -n |
    awk '{a[NR] = $1} END {print NR ? a[int((NR + 1) / 2)] : 0}')
  awk -v kill_at=$kill_at -v steady="$steady" '
    /kill at/ { for (i = 1; i <= NF; ++i) if ($i == "at") kill = $(i + 1) }
    /step [0-9]+ run 1 at/ && !next_ms { next_ms = $NF; for (i = 1; i < NF; ++i) if ($i == "step") first = $(i + 1) }
    END { if (kill && next_ms) print next_ms - kill, kill_at + 1 - first, steady; else print "failed", "-", steady }' "$1"
}
median() { printf '%s\n' "$@" | grep -v failed | sort -n | awk '{a[NR] = $1} END {print NR ? (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2) : "failed"}'; }

declare -A res rep stp
for ((r = 1; r <= rounds; ++r)); do
  for m in "${models[@]}"; do
    name=$(basename "$m" .params)
    log=$tmp/inplace.log
    timeout 300 "$ddprun" -n $ranks --elastic 2:$ranks --max-restarts 0 "$probe" "$m" --elastic --sharded \
      --steps $steps --kill-at $kill_at --victim $victim > "$log" 2>&1
    read -r t k s < <(measure "$log")
    res[$name,inplace]+="$t " rep[$name,inplace]=$k stp[$name,inplace]+="$s "
    line="round $r $name: ddp in place $t ms (steady step $s ms)"
    log=$tmp/restart.log
    rm -f "$tmp/ckpt.ddp"
    timeout 300 "$ddprun" -n $ranks --max-restarts 1 "$probe" "$m" --sharded --checkpoint "$tmp/ckpt.ddp" \
      --steps $steps --kill-at $kill_at --victim $victim --every $every > "$log" 2>&1
    read -r t k s < <(measure "$log")
    res[$name,restart]+="$t " rep[$name,restart]=$k stp[$name,restart]+="$s "
    line+=", ddp restart $t ms ($k repeated)"
    log=$tmp/torch.log
    rm -f "$tmp/ckpt.pt"
    timeout 600 /usr/bin/python3 "$root/bench/peers/torch_restart.py" "$m" --zero --ranks $ranks \
      --checkpoint "$tmp/ckpt.pt" --steps $steps --kill-at $kill_at --victim $victim --every $every \
      --port "$(free_port)" > "$log" 2>&1
    read -r t k s < <(measure "$log")
    res[$name,torch]+="$t " rep[$name,torch]=$k stp[$name,torch]+="$s "
    echo "$line, torchrun ZeRO $t ms ($k repeated; steady step $s ms)" >&2
  done
done
echo "| model | recovery | kill -> next step (median ms) | rounds (ms) | steps repeated | steady step (ms) |"
echo "|---|---|---|---|---|---|"
for m in "${models[@]}"; do
  name=$(basename "$m" .params)
  for row in inplace restart torch; do
    case $row in
      inplace) what="ddp in place (replicated shards, re-sharded in memory)" ;;
      restart) what="ddp restart from its checkpoint (ddprun --max-restarts 1)" ;;
      torch) what="torchrun + ZeroRedundancyOptimizer, checkpoint (torch 1.13, gloo)" ;;
    esac
    # shellcheck disable=SC2086
    echo "| $name | $what | $(median ${res[$name,$row]}) | ${res[$name,$row]}| ${rep[$name,$row]} | $(median ${stp[$name,$row]}) |"
  done
done

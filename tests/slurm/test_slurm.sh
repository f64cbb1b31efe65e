#!/usr/bin/env bash
# A one-node Slurm cluster, started here, runs the MLP example as users run it: `srun -n 4`
# with nothing of ddp's in the environment, so init_options::from_env() must find the master
# and its port in Slurm's own variables (docs/process-group.md, "Running under Slurm").
#
#   test_slurm.sh EXAMPLE      EXAMPLE: the built examples/01_mlp
#
# It starts munged, slurmctld and slurmd from Debian's munge and slurm-wlm (scripts/deps.sh)
# with a generated slurm.conf in a temporary directory: the node is this host, its CPUs are
# nproc's, the partition oversubscribes, and every port, pid, state and log file is the
# test's own, so parallel runs do not meet. Then:
#   1. `srun -n 4 EXAMPLE`: exit 0, a world of 4 ranks, every check of the example OK;
#   2. two steps of one allocation, `srun -n 4 EXAMPLE` twice at once: both pass, which needs
#      each step to derive its own port (with one fixed port the second step would meet the
#      first one's store).
# The daemons are stopped and the directory removed on every exit. Exit 77 (skip) when not
# root, when Slurm or MUNGE is not installed, or when the daemons do not come up.
set -uo pipefail

example=${1:?usage: test_slurm.sh EXAMPLE}
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

[[ $(id -u) -eq 0 ]] || skip "needs root to start munged, slurmctld and slurmd"
for p in munged slurmctld slurmd srun salloc sinfo squeue scancel python3; do
  command -v "$p" >/dev/null || skip "$p is not installed (scripts/deps.sh installs munge and slurm-wlm)"
done
[[ -x $example ]] || fail "$example is not an executable"
example=$(realpath "$example")

dir=$(mktemp -d /tmp/ddp-slurm.XXXXXX)
pids=()
cleanup() {
  local rc=$?
  # Jobs first (bounded), so that no task outlives the cluster, then the daemons.
  if ((${#pids[@]} == 3)) && kill -0 "${pids[1]}" 2>/dev/null; then
    timeout 5 scancel --full --user=root >/dev/null 2>&1
    for _ in $(seq 50); do [[ -z $(timeout 2 squeue -h 2>/dev/null) ]] && break; sleep 0.1; done
  fi
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  # Bounded: each daemon gets 10 s to go, then it is killed.
  for p in "${pids[@]}"; do
    for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null
  done
  if ((rc != 0 && rc != 77)); then
    for f in "$dir"/*.log "$dir"/*.out; do [[ -f $f ]] && { echo "--- $f (last 40 lines)"; tail -n 40 "$f"; }; done
  fi
  rm -rf "$dir"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# Free TCP ports, chosen by the kernel. `count` of them, one per line.
free_ports() {
  python3 -c '
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(("", 0))
print("\n".join(str(s.getsockname()[1]) for s in socks))' "$1"
}
port_free() { python3 -c 'import socket, sys; socket.socket().bind(("", int(sys.argv[1])))' "$1" 2>/dev/null; }

mapfile -t ports < <(free_ports 2)
host=$(hostname -s)
cpus=$(nproc)
# The first job's id. Job `id`, step `s` derives the store port 12000 + (16 * id + s) % 20000
# (from_env): choose an id for which steps 0 and 1 of the two jobs below find their ports free.
first_job=
for _ in $(seq 50); do
  id=$((1000 + RANDOM * 8 + RANDOM % 8))
  base=$((12000 + (16 * id) % 20000))
  port_free "$base" && port_free $((base + 1)) && port_free $((base + 16)) && port_free $((base + 17)) &&
    { first_job=$id; break; }
done
[[ -n $first_job ]] || skip "no free ports for the derived store ports"

# MUNGE, with its own key, socket and files.
mkdir -p "$dir/munge" "$dir/state" "$dir/spool"
chmod 700 "$dir/munge"
if command -v mungekey >/dev/null; then
  mungekey --create --keyfile="$dir/munge/munge.key" >/dev/null 2>&1 ||
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
else
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
fi
chmod 400 "$dir/munge/munge.key"
socket="$dir/munge/munge.socket"
munged --foreground --force --socket="$socket" --key-file="$dir/munge/munge.key" \
  --pid-file="$dir/munge/munged.pid" --seed-file="$dir/munge/munged.seed" --log-file="$dir/munged.log" \
  >"$dir/munged.out" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [[ -S $socket ]] && break; sleep 0.1; done
[[ -S $socket ]] || { tail -n 20 "$dir"/munged.*; skip "munged did not start (its log is above)"; }

cat >"$dir/slurm.conf" <<EOF
ClusterName=ddptest
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=${ports[0]}
SlurmdPort=${ports[1]}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
PlugStackConfig=$dir/plugstack.conf
FirstJobId=$first_job
InactiveLimit=0
KillWait=5
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=ddp Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF
: >"$dir/plugstack.conf"
export SLURM_CONF="$dir/slurm.conf"

slurmctld -D -i -f "$SLURM_CONF" >"$dir/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D -f "$SLURM_CONF" -N "$host" >"$dir/slurmd.out" 2>&1 &
pids+=($!)

# Up when sinfo shows the node idle; 30 s at most.
state=
for _ in $(seq 150); do
  state=$(timeout 5 sinfo -h -N -o %t 2>/dev/null | head -n 1)
  [[ $state == idle ]] && break
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || break 2; done
  sleep 0.2
done
if [[ $state != idle ]]; then
  for f in "$dir"/*.log "$dir"/*.out; do echo "--- $f"; tail -n 20 "$f"; done
  skip "the one-node Slurm did not come up (node state '${state:-none}'; the daemons' logs are above)"
fi
echo "slurm: node $host idle with $cpus CPUs, controller port ${ports[0]}, first job $first_job"

# Nothing of ddp's or torchrun's: what from_env needs must come from Slurm.
unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK DDP_JOB_ID DDP_AUTH_TOKEN DDP_INSECURE \
  OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE PMI_RANK PMI_SIZE PMIX_RANK

# 1. srun -n 4, as docs/process-group.md shows it. --overcommit: 4 tasks on nproc CPUs.
out=$(timeout 60 srun -n 4 --overcommit --mpi=none "$example" 2>&1)
rc=$?
echo "$out"
((rc == 0)) || fail "srun -n 4 $example exited with $rc"
grep -q "^ddp: 4 ranks" <<<"$out" || fail "the example did not report a world of 4 ranks"
grep -q "^loss fell from .*: OK$" <<<"$out" || fail "the example's loss check did not pass"
grep -q "^final weights bitwise equal on all 4 ranks .*: OK$" <<<"$out" || fail "the ranks' weights differ"
grep -q "^single-process run .*: OK$" <<<"$out" || fail "the weights differ from the single-process run"

# 2. Two steps of one allocation at once: each derives its own port from SLURM_STEP_ID.
out=$(timeout 90 salloc -n 4 --overcommit bash -c "
  srun -n 4 --overlap --mpi=none '$example' >'$dir/step0.out' 2>&1 & a=\$!
  srun -n 4 --overlap --mpi=none '$example' >'$dir/step1.out' 2>&1 & b=\$!
  wait \$a; ra=\$?; wait \$b; rb=\$?
  echo \"steps: \$ra \$rb\"" 2>&1)
rc=$?
echo "$out"
for s in 0 1; do echo "--- step $s"; cat "$dir/step$s.out" 2>/dev/null; done
((rc == 0)) || fail "salloc with two steps exited with $rc"
grep -q "^steps: 0 0$" <<<"$out" || fail "two steps of one job did not both pass (exit codes: $(grep '^steps:' <<<"$out"))"
for s in 0 1; do
  grep -q "^final weights bitwise equal on all 4 ranks .*: OK$" "$dir/step$s.out" || fail "step $s did not train"
done
echo "PASS: srun -n 4 and two concurrent steps trained with nothing set by hand"

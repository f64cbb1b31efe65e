"""torchft's in-place recovery, for bench/restart_time.sh: RANKS replica groups of one process
each (torchft.Manager over gloo on CPU, torchft.DistributedDataParallel, a LighthouseServer in
this process) train over a real model's parameter shapes (tests/data/*.params). Replica VICTIM
SIGKILLs itself as step K begins; replica 0 prints, for every step it commits,
    step <n> run <0 before the kill, 1 after> at <ms since the epoch>
and the victim prints `kill at <ms>`, as bench/restart_probe.cpp does, so that the script
measures the time from the kill to the next committed step.

    python3 torchft_recovery.py FILE.params [--ranks 4] [--steps 14] [--kill-at 7] [--victim 1]

Needs torch >= 2.7 and torchft (PyPI; bench/restart_time.sh installs them in a venv with
scripts/torch_current.sh's venv). The lighthouse runs with a 100 ms quorum tick, a 100 ms join
timeout and a 1 s heartbeat timeout (a death is declared after 1 s without a heartbeat, as ddp's
lease of 1 s); the manager's own timeout (collectives, should_commit) is 10 s.
"""

import argparse
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from datetime import timedelta


def now_ms() -> int:
    return int(time.time() * 1000)


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def read_shapes(path):
    shapes = []
    for line in open(path):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        shapes.append((parts[0], [int(d) for d in parts[1:]]))
    return shapes


def replica(idx, args, lighthouse, kill_flag):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    torch.set_num_threads(1)
    shapes = read_shapes(args.params)

    class Shapes(nn.Module):
        # One parameter per line of the params file; forward makes every gradient `scale`.
        def __init__(self):
            super().__init__()
            self.ps = nn.ParameterList([nn.Parameter(torch.full(s, 0.01)) for _, s in shapes])

        def forward(self, scale):
            return sum((p * scale).sum() for p in self.ps)

    model = Shapes()
    store_port = free_port()
    store = dist.TCPStore("localhost", store_port, is_master=True, wait_for_workers=False)
    opt = None

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=2,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica_{idx}",
        store_addr="localhost",
        store_port=store_port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        timeout=timedelta(seconds=10),
    )
    ddp_model = DistributedDataParallel(manager, model)
    opt = OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.1))
    killed = False
    scale = torch.tensor(0.001 * (idx + 1))
    while manager.current_step() < args.steps:
        if idx == args.victim and manager.current_step() == args.kill_at and not killed:
            print(f"kill at {now_ms()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        before = manager.current_step()
        opt.zero_grad()
        ddp_model(scale).backward()
        opt.step()  # commits (should_commit) or drops the step; current_step() counts commits
        if idx == 0 and manager.current_step() > before:
            run = 1 if kill_flag.value else 0
            print(f"step {manager.current_step()} run {run} at {now_ms()}", flush=True)
    manager.shutdown(wait=False)
    del store


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("params")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--kill-at", type=int, default=7)
    ap.add_argument("--victim", type=int, default=1)
    args = ap.parse_args()
    from torchft._torchft import LighthouseServer

    lh = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=100, quorum_tick_ms=100,
                          heartbeat_timeout_ms=1000)
    ctx = mp.get_context("spawn")
    kill_flag = ctx.Value("i", 0)
    procs = [ctx.Process(target=replica, args=(i, args, lh.address(), kill_flag)) for i in range(args.ranks)]
    for p in procs:
        p.start()
    # The victim's death marks the run: replica 0 labels the steps it commits after it "run 1".
    victim = procs[args.victim]
    victim.join()
    kill_flag.value = 1
    for i, p in enumerate(procs):
        if i != args.victim:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    lh.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

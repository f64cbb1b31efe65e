#!/usr/bin/python3
"""The PyTorch side of bench/restart_time.sh: torchrun's agent (torch.distributed.launcher's
elastic_launch, the API that `torchrun --max_restarts` runs; Debian's torchrun command line
fails under Python 3.11, see ../shared/PEERS.md) restarting a DDP (gloo) training loop over the
same parameter shapes as bench/restart_probe.cpp, with the same checkpoint every C steps and the
same kill: rank V SIGKILLs itself as step K begins in the first run. Rank 0 prints
`step <n> run <restart count> at <ms>`, the victim `kill at <ms>`.

  /usr/bin/python3 bench/peers/torch_restart.py tests/data/resnet50.params --ranks 4 \
      --checkpoint /tmp/ckpt.pt --steps 12 --kill-at 7 --victim 1 --every 5 --port 29611

--zero: the sharded peer of bench/sharded_recovery.sh: ZeroRedundancyOptimizer over AdamW, its
state consolidated on rank 0 (consolidate_state_dict) and saved with the model at each checkpoint,
loaded by every rank of the restarted run (each takes its shard).
"""
import argparse
import os
import signal
import sys
import time


def now_ms():
    return int(time.time() * 1000)


def read_shapes(path):
    shapes = []
    for line in open(path):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        shapes.append((parts[0], [int(d) for d in parts[1:]]))
    return shapes


def worker(args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    run = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    class Model(torch.nn.Module):
        def __init__(self, shapes):
            super().__init__()
            self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.full(s, 0.01)) for _, s in shapes])

        def forward(self, c):
            return sum((p * c).sum() for p in self.ps)

    model = Model(read_shapes(args.params))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    if args.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3,
                                      weight_decay=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = 0
    if os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint)
        model.load_state_dict(state["model"])
        if args.zero:
            opt.load_state_dict(state["opt"])
        first = state["step"]
    for s in range(first, args.steps):
        if run == 0 and s == args.kill_at and rank == args.victim:
            print(f"kill at {now_ms()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        ddp(0.001 * (rank + 1)).backward()
        opt.step()
        if (s + 1) % args.every == 0:
            if args.zero:
                opt.consolidate_state_dict(to=0)  # collective: every shard's state onto rank 0
            if rank == 0:
                state = {"model": model.state_dict(), "step": s + 1}
                if args.zero:
                    state["opt"] = opt.state_dict()
                torch.save(state, args.checkpoint + ".tmp")
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
            dist.barrier()
        if rank == 0:
            print(f"step {s + 1} run {run} at {now_ms()}", flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("params")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-at", type=int, default=7)
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--port", type=int, default=29611)
    ap.add_argument("--monitor-interval", type=float, default=5.0)  # torchrun's default
    ap.add_argument("--zero", action="store_true")  # ZeroRedundancyOptimizer over AdamW
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # torchrun's defaults, as a new user gets them (monitor_interval 5 s unless --monitor-interval),
    # with the c10d rendezvous that --max_restarts is documented with.
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.ranks, run_id="restart-bench",
                       rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{args.port}", max_restarts=1,
                       monitor_interval=args.monitor_interval)
    argv = [os.path.abspath(__file__), args.params, "--worker", "--checkpoint", args.checkpoint,
            "--steps", str(args.steps), "--kill-at", str(args.kill_at), "--victim", str(args.victim),
            "--every", str(args.every)] + (["--zero"] if args.zero else [])
    elastic_launch(cfg, sys.executable)(*argv)


if __name__ == "__main__":
    sys.exit(main() or 0)

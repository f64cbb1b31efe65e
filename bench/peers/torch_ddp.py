#!/usr/bin/python3
"""PyTorch DistributedDataParallel (gloo backend): gradient synchronization time per step.

    /usr/bin/python3 bench/peers/torch_ddp.py --ranks 2 \
        --params tests/data/resnet50.params --bucket-cap-mb 1 25 100

The model has exactly the parameters listed in each params file and a forward pass that costs
next to nothing (the sum of all parameters times a per-batch scalar), so backward yields a
gradient for every parameter, last registered first, and the step is dominated by what DDP
adds. Each step is timed twice, interleaved: once under DDP and once under model.no_sync();
the difference of the medians is the synchronization cost (bucket copies plus allreduce).

--hook fp16 / powersgd registers PyTorch's fp16_compress_hook / powerSGD_hook (rank
--powersgd-rank, warm-up --powersgd-warmup steps, as PyTorch's defaults otherwise); the
system column then reads pytorch_ddp_gloo_fp16 / _powersgd. --env starts no processes: this
process is one rank of a group that RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT describe (as
torchrun sets them; rank 0 hosts the store), for groups across hosts (bench/across_hosts.sh);
GLOO_SOCKET_IFNAME then names the interface (default: the one that routes to MASTER_ADDR).

CSV on stdout: system,model,ranks,bucket_cap_mb,steps,step_median_ms,nosync_median_ms,sync_ms
Parameter counts and bytes go to stderr as '#' lines.
"""

import argparse
import datetime
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

SYSTEM = "pytorch_ddp_gloo"
HEADER = "system,model,ranks,bucket_cap_mb,steps,step_median_ms,nosync_median_ms,sync_ms"


def read_params(path):
    """Returns [(name, shape)] in registration order from a 'name dim dim ...' file."""
    params = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, *dims = line.split()
            params.append((name, tuple(int(d) for d in dims)))
    if not params:
        raise ValueError(f"{path}: no parameters")
    return params


class ShapeModel(nn.Module):
    """Parameters of the given shapes and a forward pass with negligible compute."""

    def __init__(self, shapes):
        super().__init__()
        # A ParameterList keeps registration order, which DDP reverses to build its buckets,
        # as it would for the real network.
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(s)) for s in shapes)

    def forward(self, scale):
        # A chain of additions: backward reaches the last parameter first, like a real network.
        total = scale.new_zeros(())
        for p in self.weights:
            total = total + p.sum()
        return total * scale


def timed_step(model, scale):
    dist.barrier()
    t0 = time.perf_counter()
    model(scale).backward()
    return (time.perf_counter() - t0) * 1e3


def slowest(times_ms):
    """Per step, the slowest rank's time: a synchronized step ends when its last rank does."""
    t = torch.tensor(times_ms, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def check_gradients(model, rank, world):
    """One synchronized step with scale rank+1: every gradient must be the mean, (n+1)/2."""
    for p in model.parameters():
        p.grad = None
    model(torch.tensor(float(rank + 1))).backward()
    expect = (world + 1) / 2.0
    wrong = sum(int((p.grad != expect).sum()) for p in model.parameters())
    flag = torch.tensor([wrong], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if wrong:
        print(f"rank {rank}: {wrong} gradient elements differ from {expect}", file=sys.stderr)
    return int(flag.item()) == 0


def register_hook(ddp, args):
    """The communication hook --hook names, with its state; returns the system name's suffix."""
    if args.hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return "_fp16"
    if args.hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=args.powersgd_warmup)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return "_powersgd"
    return ""


def worker(rank, args, port, models):
    torch.set_num_threads(1)
    if args.env:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), args.ranks, rank == 0,
                              timeout=datetime.timedelta(seconds=120))
    else:
        # Loopback only: the host name may not resolve to an address peers can reach.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # The parent already listens on `port`, so no rank hits the store client's 1 s retry.
        store = dist.TCPStore("127.0.0.1", port, args.ranks, False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.ranks)
    ok = True
    for model_name, shapes in models:
        for cap in args.bucket_cap_mb:
            module = ShapeModel(shapes)
            ddp = DistributedDataParallel(module, bucket_cap_mb=cap)
            system = SYSTEM + register_hook(ddp, args)
            sync, nosync = [], []
            for i in range(args.warmup + args.steps):
                # Gradients accumulate across steps; both variants accumulate alike.
                scale = torch.tensor(1.0 / (i + 1))
                with ddp.no_sync():
                    t_nosync = timed_step(ddp, scale)
                t_sync = timed_step(ddp, scale)
                if i >= args.warmup:
                    sync.append(t_sync)
                    nosync.append(t_nosync)
            sync, nosync = slowest(sync), slowest(nosync)
            # Compression is approximate (PowerSGD: low-rank); only exact reductions are checked.
            if args.hook == "none":
                ok = check_gradients(ddp, rank, args.ranks) and ok
            if rank == 0:
                step_ms = statistics.median(sync)
                nosync_ms = statistics.median(nosync)
                print(f"{system},{model_name},{args.ranks},{cap:g},{args.steps},"
                      f"{step_ms:.3f},{nosync_ms:.3f},{step_ms - nosync_ms:.3f}", flush=True)
            del ddp, module
    # Every rank is done with gloo before any tears it down; then leave without the interpreter's
    # finalization, in which a gloo process group's destructor now and then never returns.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", nargs="+", required=True, help="params files (name dim dim ...)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--bucket-cap-mb", type=float, nargs="+", default=[1, 25, 100])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed steps; DDP rebuilds its buckets after the first")
    ap.add_argument("--hook", choices=["none", "fp16", "powersgd"], default="none")
    ap.add_argument("--powersgd-rank", type=int, default=1, help="matrix_approximation_rank")
    ap.add_argument("--powersgd-warmup", type=int, default=2,
                    help="start_powerSGD_iter: plain allreduce before it (PyTorch requires >= 2 with error feedback)")
    ap.add_argument("--env", action="store_true", help="one rank of a group from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT")
    args = ap.parse_args()

    models = []
    for path in args.params:
        name = os.path.splitext(os.path.basename(path))[0]
        shapes = [s for _, s in read_params(path)]
        elems = sum(math.prod(s) for s in shapes)
        print(f"# {name}: {len(shapes)} parameters, {elems} float32 elements, {elems * 4} bytes",
              file=sys.stderr, flush=True)
        models.append((name, shapes))

    if args.env:
        args.ranks = int(os.environ["WORLD_SIZE"])
        rank = int(os.environ["RANK"])
        if rank == 0:
            print(HEADER, flush=True)
        worker(rank, args, None, models)
        return
    # The parent hosts the store server on a free port before any rank starts.
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    print(HEADER, flush=True)
    try:
        mp.spawn(worker, args=(args, store.port, models), nprocs=args.ranks, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        print(e, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

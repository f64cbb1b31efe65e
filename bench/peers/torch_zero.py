#!/usr/bin/python3
"""PyTorch DistributedDataParallel (gloo, CPU) with AdamW, whole or sharded: step time and memory.

    /usr/bin/python3 bench/peers/torch_zero.py --ranks 2 --steps 10 --warmup 3 \
        tests/data/resnet50.params tests/data/bert_base.params

The model holds one float32 parameter per line of each params file (`name dim dim ...`, `#`
comments), registered in file order, and a forward pass that costs next to nothing (a chain of
one element of each parameter times a scalar), so backward yields a full dense gradient for every
parameter, last registered first. Variants (--variants):

  pytorch_ddp_adamw   DDP + torch.optim.AdamW over all parameters on every rank
  pytorch_zero_adamw  DDP + ZeroRedundancyOptimizer(optimizer_class=AdamW): each rank steps
                      its shard of the parameters, then broadcasts them

both with lr 1e-3 and weight decay 0.01. A step is zero_grad(set_to_none=False), forward,
backward (DDP's allreduce in buckets of --cap-mb MiB) and optimizer.step(), timed after a
barrier; a step's time is its slowest rank's. Reported: the median and the 10th percentile over
--steps steps after --warmup untimed ones; the bytes of optimizer state on rank 0 and the most
on any rank; the peak RSS of rank 0. Each (variant, file, ranks) runs in a fresh set of processes
with one thread each, so that peak RSS is its own.

CSV on stdout: system,model,ranks,params,steps,step_median_ms,step_p10_ms,opt_state_bytes_rank0,
opt_state_bytes_max,peak_rss_bytes_rank0. Everything else goes to stderr.
Debian's torch imports only under /usr/bin/python3.
"""

import argparse
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

HEADER = ("system,model,ranks,params,steps,step_median_ms,step_p10_ms,opt_state_bytes_rank0,"
          "opt_state_bytes_max,peak_rss_bytes_rank0")
VARIANTS = ("pytorch_ddp_adamw", "pytorch_zero_adamw")


def read_params(path):
    """[(name, shape)] in registration order from a 'name dim dim ...' file."""
    params = []
    with open(path) as f:
        for line in f:
            fields = line.split()
            if fields and not fields[0].startswith("#"):
                params.append((fields[0], tuple(int(d) for d in fields[1:])))
    if not params:
        raise ValueError(f"{path}: no parameters")
    return params


class ShapeModel(nn.Module):
    """Parameters of the given shapes and a forward pass with negligible compute."""

    def __init__(self, shapes):
        super().__init__()
        torch.manual_seed(0)
        self.weights = nn.ParameterList(nn.Parameter(0.01 * torch.randn(s)) for s in shapes)

    def forward(self, scale):
        # One element of each parameter, added in order: backward reaches the last parameter
        # first, as in a real network, and still gives each a full dense gradient.
        total = scale.new_zeros(())
        for p in self.weights:
            total = total + p.view(-1)[0]
        return total * scale


def percentile(values, q):
    """Linear interpolation between the closest ranks (as bench/sharded_step.cpp)."""
    v = sorted(values)
    at = q * (len(v) - 1)
    lo = int(at)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (at - lo)


def state_bytes(opt):
    """Bytes of every tensor in the optimizer state this rank holds."""
    # ZeroRedundancyOptimizer keeps its shard's state in the local optimizer, opt.optim;
    # its own opt.state stays empty unless consolidate_state_dict() fills it.
    inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
    return sum(t.numel() * t.element_size()
               for per_param in inner.state.values()
               for t in per_param.values() if torch.is_tensor(t))


def worker(rank, ranks, port, args, variant, model_name, shapes):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the host name may not resolve to loopback
    store = dist.TCPStore("127.0.0.1", port, ranks, False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks)

    ddp = DistributedDataParallel(ShapeModel(shapes), bucket_cap_mb=args.cap_mb)
    if variant == "pytorch_zero_adamw":
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                      lr=1e-3, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)

    ms = []
    for i in range(args.warmup + args.steps):
        scale = torch.tensor(1.0 / (i + 1 + rank))
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = ddp(scale)
        loss.backward()
        opt.step()
        if i >= args.warmup:
            ms.append((time.perf_counter() - t0) * 1e3)

    times = torch.tensor(ms, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank's does
    mine = state_bytes(opt)
    most = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if rank == 0:
        t = times.tolist()
        elems = sum(math.prod(s) for s in shapes)
        print(f"{variant},{model_name},{ranks},{elems},{args.steps},{percentile(t, 0.5):.3f},"
              f"{percentile(t, 0.1):.3f},{mine},{int(most.item())},{rss}", flush=True)

    # Every rank is done with gloo before any tears it down; then leave without the interpreter's
    # finalization, in which a gloo process group's destructor now and then never returns.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", metavar="FILE.params")
    ap.add_argument("--ranks", default="2", help="process count, or a comma-separated list")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before the timed ones")
    ap.add_argument("--cap-mb", type=float, default=25, help="DDP's bucket_cap_mb")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r} (known: {', '.join(VARIANTS)})")
    if args.steps < 1:
        ap.error("--steps must be at least 1")

    print(HEADER, flush=True)
    failed = False
    for path in args.files:
        model_name = os.path.basename(path)[:-len(".params")] if path.endswith(".params") \
            else os.path.basename(path)
        shapes = [s for _, s in read_params(path)]
        print(f"# {model_name}: {len(shapes)} parameters, {sum(math.prod(s) for s in shapes)} "
              f"float32 elements", file=sys.stderr, flush=True)
        for ranks in (int(r) for r in args.ranks.split(",") if r):
            for variant in variants:
                # A fresh store and fresh processes per run; the store listens before any rank starts.
                store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
                try:
                    mp.spawn(worker, args=(ranks, store.port, args, variant, model_name, shapes),
                             nprocs=ranks, join=True)
                except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
                    print(f"{variant} {model_name} on {ranks} ranks: {e}", file=sys.stderr, flush=True)
                    failed = True
                del store
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""PyTorch FSDP2 (fully_shard, CPU with gloo) with AdamW: step time and memory, the peer of
bench/sharded_step's ddp_fully_sharded_adamw.

    /work/venv-torch2/bin/python bench/peers/torch_fsdp.py --ranks 2 --steps 10 --warmup 3 \
        tests/data/resnet50.params tests/data/bert_base.params

Needs torch 2.6 or later (`torch.distributed.fsdp.fully_shard`), from PyPI in a virtual
environment (Debian's 1.13 has no FSDP2). The model holds one float32 parameter per line of each
params file, grouped into units of consecutive parameters of about 1/24 of the model each (the
same rule as bench/sharded_step.cpp's units_of), each unit a module wrapped by fully_shard, the
root too; a unit's forward reads every element of its parameters (their sum, scaled to next to
nothing), so that FSDP2 gathers it for the forward, frees it after (reshard_after_forward=True,
--keep sets False), gathers it again for the backward and reduce-scatters its dense gradients.
A step is zero_grad, forward, backward and AdamW's step (lr 1e-3, weight decay 0.01), timed
after a barrier; a step's time is its slowest rank's. CSV as torch_zero.py:
system,model,ranks,params,steps,step_median_ms,step_p10_ms,opt_state_bytes_rank0,
opt_state_bytes_max,peak_rss_bytes_rank0.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_zero import HEADER, percentile, read_params  # noqa: E402


def units_of(sizes):
    """Counts of consecutive parameters per unit, each closed once it holds 1/24 of the model."""
    total = sum(sizes)
    units, count, elems = [], 0, 0
    for n in sizes:
        count, elems = count + 1, elems + n
        if elems * 24 >= total:
            units.append(count)
            count, elems = 0, 0
    if count:
        units.append(count)
    return units


class Unit(nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.full(s, 0.01)) for s in shapes)

    def forward(self, x):
        total = x
        for p in self.weights:
            total = total + p.sum() * 1e-9
        return total


class Model(nn.Module):
    def __init__(self, shapes):
        super().__init__()
        sizes = [math.prod(s) for s in shapes]
        first, units = 0, []
        for count in units_of(sizes):
            units.append(Unit(shapes[first:first + count]))
            first += count
        self.units = nn.ModuleList(units)

    def forward(self, x):
        for u in self.units:
            x = u(x)
        return x


def worker(rank, ranks, port, args, model_name, shapes):
    from torch.distributed.fsdp import fully_shard
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, ranks, False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks)
    mesh = dist.device_mesh.init_device_mesh("cpu", (ranks,))
    model = Model(shapes)
    for u in model.units:
        fully_shard(u, mesh=mesh, reshard_after_forward=not args.keep)
    fully_shard(model, mesh=mesh, reshard_after_forward=not args.keep)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ms = []
    for i in range(args.warmup + args.steps):
        x = torch.tensor(1.0 / (i + 1 + rank))
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model(x)
        loss.backward()
        opt.step()
        if i >= args.warmup:
            ms.append((time.perf_counter() - t0) * 1e3)
    times = torch.tensor(ms, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    mine = sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
               for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    most = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if rank == 0:
        t = times.tolist()
        elems = sum(math.prod(s) for s in shapes)
        name = "pytorch_fsdp2_keep_adamw" if args.keep else "pytorch_fsdp2_adamw"
        print(f"{name},{model_name},{ranks},{elems},{args.steps},{percentile(t, 0.5):.3f},"
              f"{percentile(t, 0.1):.3f},{mine},{int(most.item())},{rss}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", metavar="FILE.params")
    ap.add_argument("--ranks", default="2")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="reshard_after_forward=False")
    args = ap.parse_args()
    print(HEADER, flush=True)
    failed = False
    for path in args.files:
        model_name = os.path.basename(path)[:-len(".params")] if path.endswith(".params") else os.path.basename(path)
        shapes = [s for _, s in read_params(path)]
        for ranks in (int(r) for r in args.ranks.split(",") if r):
            store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
            try:
                mp.spawn(worker, args=(ranks, store.port, args, model_name, shapes), nprocs=ranks, join=True)
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
                print(f"fsdp2 {model_name} on {ranks} ranks: {e}", file=sys.stderr, flush=True)
                failed = True
            del store
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

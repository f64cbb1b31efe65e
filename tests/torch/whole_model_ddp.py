#!/usr/bin/python3
"""tests/torch/whole_model.cpp's model and loop under PyTorch's DistributedDataParallel (gloo).

    whole_model_ddp.py --init init.bin --ranks 4 --steps 12 --accumulate 2 --broadcast-buffers 1 \
        --compare out --tol 1e-5

Rank 0 starts from the C++ run's rank-0 state (--init), the other ranks from their own seeds and
their own running statistics (DistributedDataParallel makes them rank 0's at construction). After
training, every rank's parameters (frozen ones too) and buffers are compared with ddp's rank of
the same number (<compare>.rank<r>), except that with broadcast_buffers ddp's buffers are compared
with PyTorch's rank 0 (ddp leaves every rank with rank 0's buffers after each step, where PyTorch
copies them at the start of the next forward). Exit 0 when everything agrees within --tol
(relative to each tensor's largest magnitude; integers exactly).
"""

import argparse
import importlib
import inspect
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
tensors = importlib.import_module("03_libtorch_ddp")  # tensor files, join_group, leave, spawn_ranks


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 3 * 3, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(x.flatten(1))


def state_of(model):
    return list(model.named_parameters()) + list(model.named_buffers())


def buffer_option(broadcast):
    """ddp's buffer_sync::broadcast or ::none in this PyTorch's words. Both make the buffers rank
    0's at construction. PyTorch 1.x's broadcast_buffers=False did too; since PyTorch 2.x it leaves
    them rank-local, and forward_sync_buffers=False (where it exists) is the one that matches."""
    if broadcast:
        return {"broadcast_buffers": True}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def worker(rank, args, port):
    tensors.join_group(rank, args.ranks, port)
    world = args.ranks
    init = tensors.read_tensors(args.init)
    torch.manual_seed(100 + rank)
    model = Net()
    with torch.no_grad():
        if rank == 0:
            for name, t in state_of(model):
                t.copy_(init[name])
        else:
            for bn in (model.bn1, model.bn2):
                bn.running_mean.fill_(-3.0 * rank)
                bn.running_var.fill_(1.0 + rank)
                bn.num_batches_tracked.fill_(10 * rank)
    for p in model.conv1.parameters():
        p.requires_grad_(False)
    x, y = init["data.x"], init["data.y"]
    ddp = DistributedDataParallel(model, **buffer_option(bool(args.broadcast_buffers)))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=args.lr, momentum=args.momentum)
    for step in range(args.steps):
        opt.zero_grad()
        for k in range(args.accumulate):
            micro = step * args.accumulate + k
            first = ((micro % args.batches) * world + rank) * args.batch
            bx, by = x[first:first + args.batch], y[first:first + args.batch]
            if k + 1 < args.accumulate:
                with ddp.no_sync():
                    nn.functional.cross_entropy(ddp(bx), by).backward()
            else:
                nn.functional.cross_entropy(ddp(bx), by).backward()
        opt.step()
    tensors.write_tensors(f"{args.compare}.torch.rank{rank}", state_of(model))
    dist.barrier()
    failed = False
    if rank == 0:
        theirs = [tensors.read_tensors(f"{args.compare}.torch.rank{r}") for r in range(world)]
        ours = [tensors.read_tensors(f"{args.compare}.rank{r}") for r in range(world)]
        buffer_names = {name for name, _ in model.named_buffers()}
        worst = 0.0
        for r in range(world):
            for name, q in ours[r].items():
                anchor = theirs[0 if (name in buffer_names and args.broadcast_buffers) else r][name]
                if q.dtype == torch.int64:
                    rel = 0.0 if torch.equal(q, anchor) else float("inf")
                else:
                    rel = (q - anchor).abs().max().item() / max(anchor.abs().max().item(), 1e-30)
                worst = max(worst, rel)
                if rel > args.tol:
                    print(f"  rank {r} {name}: max |ddp - torch| / max |torch| = {rel:.2e}", flush=True)
            missing = set(theirs[r]) - set(ours[r])
            if missing:
                print(f"  rank {r}: ddp's state lacks {sorted(missing)}", flush=True)
                failed = True
        verdict = "agree" if worst <= args.tol else "DIFFER"
        print(f"whole model on {world} ranks, {args.steps} steps of {args.accumulate} micro-batches, "
              f"broadcast_buffers={bool(args.broadcast_buffers)}: worst relative difference {worst:.2e} "
              f"(tolerance {args.tol:g}): {verdict}", flush=True)
        failed = failed or worst > args.tol
    tensors.leave(failed)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--init", required=True)
    ap.add_argument("--compare", required=True, help="prefix of the C++ ranks' state files")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--broadcast-buffers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--tol", type=float, default=1e-5)
    args = ap.parse_args()
    tensors.spawn_ranks(worker, args)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The small causal transformer of examples/07_fully_sharded.cpp (its LibTorch engine) under
PyTorch's FSDP2 (`fully_shard`, CPU with gloo): the loss curve side by side with ddp's.

    ddprun -n 2 build/examples/07_fully_sharded --steps 50 --init init.bin --losses ddp.txt
    /work/venv-torch2/bin/python examples/07_fully_sharded_fsdp2.py --init init.bin --ranks 2 \
        --steps 50 --compare ddp.txt --tol 1e-3

Starts from the weights and the dataset that the C++ run wrote (--init), shards every block and
the root with fully_shard (reshard_after_forward, as ddp's default), trains with
torch.optim.AdamW (lr 3e-3, weight decay 0.01, the C++ run's ddp::adamw) on the same per-rank
batches, and prints each step's loss (the mean over the ranks) beside ddp's (--compare, one loss
per line) with their relative difference; exit 0 when every step is within --tol relative, 1
otherwise. Needs torch 2.6 or later (FSDP2), from PyPI in a virtual environment
(scripts/fsdp2_loss_curve.sh makes one where it is missing).
"""

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from importlib import import_module  # noqa: E402

_peer = import_module("03_libtorch_ddp")  # read_tensors, join_group, leave, spawn_ranks

VOCAB, SEQ, DIM, HEADS, BLOCKS, ROWS, BATCHES = 64, 32, 128, 4, 2, 8, 25


class Block(nn.Module):
    """07_fully_sharded.cpp's gpt::BlockImpl, the same layers under the same names."""

    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, t = x.shape[0], x.shape[1]
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(DIM // HEADS))
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = torch.softmax(att.masked_fill(mask, float("-inf")), -1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, t, DIM)
        h = x + self.proj(y)
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        h = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln_f(h))


def cpp_name(name):
    """blocks.0.ln1.weight -> block0.ln1.weight (the C++ module's names)."""
    return name.replace("blocks.", "block", 1) if name.startswith("blocks.") else name


def worker(rank, args, port):
    _peer.join_group(rank, args.ranks, port)
    from torch.distributed.fsdp import fully_shard

    init = _peer.read_tensors(args.init)
    model = Net()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init[cpp_name(name)])
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    data = init["data"]
    curve = []
    for s in range(args.steps):
        first = ((s % BATCHES) * args.ranks + rank) * ROWS
        b = data[first:first + ROWS]
        x, y = b[:, :SEQ], b[:, 1:]
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        curve.append(mean.item() / args.ranks)
    failed = False
    if rank == 0:
        ours = []
        if args.compare:
            with open(args.compare) as f:
                ours = [float(line) for line in f if line.strip()]
        worst = 0.0
        print("step,fsdp2_loss,ddp_loss,relative_difference")
        for s, l in enumerate(curve):
            if s < len(ours):
                rel = abs(l - ours[s]) / abs(ours[s])
                worst = max(worst, rel)
                print(f"{s + 1},{l:.7f},{ours[s]:.7f},{rel:.2e}")
            else:
                print(f"{s + 1},{l:.7f},,")
        if args.compare:
            failed = len(ours) < len(curve) or worst > args.tol
            print(f"loss curve beside FSDP2 over {len(curve)} steps: largest relative difference {worst:.2e} "
                  f"(tolerance {args.tol:g}): {'FAILED' if failed else 'OK'}")
    _peer.leave(failed)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init", required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--compare", default="")
    ap.add_argument("--tol", type=float, default=1e-3)
    args = ap.parse_args()
    _peer.spawn_ranks(worker, args)


if __name__ == "__main__":
    main()

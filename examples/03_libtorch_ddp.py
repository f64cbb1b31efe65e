#!/usr/bin/python3
"""The CNN of examples/03_libtorch.cpp under PyTorch's own DistributedDataParallel (gloo).

    ddprun -n 4 build/examples/03_libtorch --steps 20 --init init.bin --out ddp.bin
    /usr/bin/python3 examples/03_libtorch_ddp.py --init init.bin --ranks 4 --steps 20 --compare ddp.bin

Starts from the weights and the dataset that the C++ run wrote (--init), trains the same
layers with the same optimizer on the same per-rank batches, and with --compare checks that
the weights after the last step agree with the C++ run's (--out) within --tol, relative to
each tensor's largest magnitude: exit 0 when they do, 1 when they do not.

    /usr/bin/python3 examples/03_libtorch_ddp.py --ranks 4 --bench 30 --width 1

times steps instead, as the C++ side's --bench does (no_sync and synchronized, interleaved):
CSV system,ranks,width,elements,steps,step_median_ms,nosync_median_ms,sync_ms on stdout.
--sharded trains with AdamW under torch.distributed.optim.ZeroRedundancyOptimizer, beside the
C++ side's --sharded (ddp's sharded AdamW); --sharded --deepspeed under DeepSpeed's ZeRO stage 2
instead (CPU, gloo; an interpreter with deepspeed installed, e.g. the venv of
scripts/torch_current.sh). --powersgd R registers PyTorch's powerSGD_hook (rank R, plain for
the first --powersgd-warmup steps), beside the C++ side's --powersgd R (tests/torch/powersgd_loss.sh).
Debian's torch imports only under /usr/bin/python3.
"""

import argparse
import os
import statistics
import struct
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Cnn(nn.Module):
    """The layers of 03_libtorch.cpp's CnnImpl, registered in the same order."""

    def __init__(self, w):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8 * w, 3)
        self.conv2 = nn.Conv2d(8 * w, 16 * w, 3)
        self.fc1 = nn.Linear(16 * w * 3 * 3, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.relu(self.conv2(x))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def read_tensors(path):
    """The C++ side's tensor file: b"DDPT", count, then name, kind, dims and values each."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"DDPT":
        raise ValueError(f"{path}: not a tensor file")
    (count,), at = struct.unpack_from("<I", data, 4), 8
    out = {}
    for _ in range(count):
        (n,) = struct.unpack_from("<I", data, at)
        name = data[at + 4:at + 4 + n].decode()
        at += 4 + n
        kind, ndim = struct.unpack_from("<II", data, at)
        at += 8
        dims = struct.unpack_from(f"<{ndim}q", data, at)
        at += 8 * ndim
        dtype = torch.int64 if kind == 1 else torch.float32
        numel = 1
        for d in dims:
            numel *= d
        size = numel * (8 if kind == 1 else 4)
        out[name] = torch.frombuffer(bytearray(data[at:at + size]), dtype=dtype).reshape(dims).clone()
        at += size
    return out


def write_tensors(path, named):
    with open(path, "wb") as f:
        f.write(b"DDPT" + struct.pack("<I", len(named)))
        for name, t in named:
            t = t.detach().contiguous()
            f.write(struct.pack("<I", len(name)) + name.encode())
            f.write(struct.pack("<II", 1 if t.dtype == torch.int64 else 0, t.dim()))
            f.write(struct.pack(f"<{t.dim()}q", *t.shape))
            f.write(t.numpy().tobytes())


def batch_of(x, y, step, rank, world, batch, batches):
    first = ((step % batches) * world + rank) * batch
    return x[first:first + batch], y[first:first + batch]


def make_dataset(n):
    """Only for --bench (training takes the C++ run's dataset from --init)."""
    torch.manual_seed(1234)
    patterns = torch.randn(10, 1, 12, 12)
    y = torch.randint(0, 10, (n,))
    return patterns.index_select(0, y) + torch.randn(n, 1, 12, 12), y


def join_group(rank, ranks, port):
    """This process as rank `rank` of a gloo group of `ranks` on the launcher's store at `port`."""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, ranks, False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks)


def leave(failed):
    """Every rank is done with gloo before any tears it down; then leave without the interpreter's
    finalization, in which a gloo process group's destructor now and then never returns."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)


def spawn_ranks(worker, args):
    """`worker(rank, args, port)` in `args.ranks` processes around one store; exit 1 if one fails."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    try:
        mp.spawn(worker, args=(args, store.port), nprocs=args.ranks, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        print(e, file=sys.stderr)
        sys.exit(1)


def worker(rank, args, port):
    if args.bind_cores:  # as ddprun --bind-cores: rank r on the r-th usable core
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    join_group(rank, args.ranks, port)
    world = args.ranks
    if args.bench:
        torch.manual_seed(100 + rank)
        model = Cnn(args.width)
        x, y = make_dataset(args.batch * world * args.batches)
    else:
        init = read_tensors(args.init)
        model = Cnn(args.width)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(init[name])
        x, y = init["data.x"], init["data.y"]
    failed = False
    if args.deepspeed:
        # DeepSpeed's ZeRO stage 2 with AdamW (torch's implementation), over this gloo group.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        deepspeed.init_distributed(dist_backend="gloo")
        cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
               "zero_optimization": {"stage": 2},
               "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": args.weight_decay,
                                                         "torch_adam": True}}}
        ddp, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    elif args.sharded:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        ddp = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr,
                                      weight_decay=args.weight_decay)
    else:
        ddp = DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
        if args.powersgd:
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd,
                                                start_powerSGD_iter=args.powersgd_warmup)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    def loss_at(step):
        bx, by = batch_of(x, y, step, rank, world, args.batch, args.batches)
        return nn.functional.cross_entropy(ddp(bx), by)

    if args.bench:
        def timed(step):
            dist.barrier()
            t0 = time.perf_counter()
            loss_at(step).backward()
            return (time.perf_counter() - t0) * 1e3

        sync, local = [], []
        for i in range(args.warmup + args.bench):
            opt.zero_grad()
            with ddp.no_sync():
                t_local = timed(i)
            opt.zero_grad()
            t_sync = timed(i)
            if i >= args.warmup:
                local.append(t_local)
                sync.append(t_sync)
        times = torch.tensor([sync, local], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank per step
        if rank == 0:
            s, l = statistics.median(times[0].tolist()), statistics.median(times[1].tolist())
            elems = sum(p.numel() for p in model.parameters())
            print(f"pytorch_ddp_gloo,{world},{args.width},{elems},{args.bench},{s:.3f},{l:.3f},{s - l:.3f}", flush=True)
    else:
        tail, tail_steps = 0.0, min(10, args.steps)  # the mean loss over the last (up to) 10 steps
        for step in range(args.steps):
            loss = loss_at(step)
            if args.deepspeed:
                ddp.backward(loss)
                ddp.step()
            else:
                opt.zero_grad()
                loss.backward()
                opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if step >= args.steps - tail_steps:
                tail += mean.item() / world / tail_steps
            if rank == 0 and (step % 5 == 0 or step + 1 == args.steps):
                print(f"step {step:3d}  loss {mean.item() / world:.4f}", flush=True)
        if rank == 0:
            print(f"mean loss of the last {tail_steps} steps {tail:.4f}", flush=True)
        if rank == 0 and args.out:
            write_tensors(args.out, list(model.named_parameters()))
        if rank == 0 and args.compare:
            theirs = read_tensors(args.compare)
            start = read_tensors(args.init)
            worst, moved = 0.0, 0.0
            for name, p in model.named_parameters():
                q = theirs[name]
                rel = (p.detach() - q).abs().max().item() / max(q.abs().max().item(), 1e-30)
                worst = max(worst, rel)
                moved = max(moved, (p.detach() - start[name]).abs().max().item() / max(q.abs().max().item(), 1e-30))
                print(f"  {name:14s} {tuple(p.shape)!s:18s} max |ddp - torch| / max |torch| = {rel:.2e}")
            verdict = "agree" if worst <= args.tol else "DIFFER"
            print(f"parameters after {args.steps} steps on {world} ranks: worst relative difference {worst:.2e} "
                  f"(tolerance {args.tol:g}): {verdict}; training moved them by up to {moved:.2e}", flush=True)
            if worst > args.tol:
                failed = True
            if moved < 100 * args.tol:  # else agreeing would prove nothing
                print("the weights barely moved: train longer for a meaningful comparison", flush=True)
                failed = True
    leave(failed)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--init", help="the C++ run's --init file (weights and dataset)")
    ap.add_argument("--compare", help="the C++ run's --out file: check agreement")
    ap.add_argument("--out", help="write the weights after the last step")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--bench", type=int, default=0, help="timed steps (0: train)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sharded", action="store_true",
                    help="AdamW under ZeroRedundancyOptimizer (the C++ side's --sharded)")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--powersgd", type=int, default=0,
                    help="rank of PyTorch's powerSGD_hook (the C++ side's --powersgd; 0: none)")
    ap.add_argument("--powersgd-warmup", type=int, default=10, help="its start_powerSGD_iter")
    ap.add_argument("--deepspeed", action="store_true",
                    help="AdamW under DeepSpeed's ZeRO stage 2 (CPU, gloo; where deepspeed is installed)")
    ap.add_argument("--bind-cores", action="store_true", help="rank r on the r-th usable core")
    args = ap.parse_args()
    if not args.bench and not args.init:
        ap.error("--init is required to train (or --bench K to time)")
    spawn_ranks(worker, args)


if __name__ == "__main__":
    main()

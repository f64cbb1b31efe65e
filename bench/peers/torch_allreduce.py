#!/usr/bin/python3
"""torch.distributed.all_reduce (gloo backend, float32 sum) in ddp's sweep format.

    /usr/bin/python3 bench/peers/torch_allreduce.py --ranks 2 --max-bytes 67108864

This is Gloo as PyTorch users reach it: gloo::allreduce behind ProcessGroupGloo, its work
queue thread and the Python call, so next to gloo_allreduce it shows what the wrapping costs.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sweep_schedule import HEADER, iters_for, row, sizes, warmup_for  # noqa: E402 (beside this file)


def worker(rank, args, port):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, args.ranks, False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.ranks)
    n = args.ranks
    ok = True
    for nbytes in sizes(args):
        iters, warmup = iters_for(args, nbytes), warmup_for(args, nbytes)
        # Zeros while timing: in-place sums of nonzero inputs would overflow to inf.
        buf = torch.zeros(nbytes // 4, dtype=torch.float32)
        times = []
        for i in range(warmup + iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            t1 = time.perf_counter()
            if i >= warmup:
                times.append((t1 - t0) * 1e6)
        buf.fill_(rank + 1)
        dist.all_reduce(buf)
        wrong = int((buf != n * (n + 1) / 2).sum())
        if wrong:
            print(f"rank {rank}: {wrong} elements wrong at {nbytes} bytes", file=sys.stderr)
            ok = False
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(row("pytorch_gloo", "all_reduce", n, nbytes, iters, t.tolist()), flush=True)
    # Every rank is done with gloo before any tears it down; then leave without the interpreter's
    # finalization, in which a gloo process group's destructor now and then never returns.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--min-bytes", type=int, default=4096)
    ap.add_argument("--max-bytes", type=int, default=256 << 20)
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--iters", type=int, default=0, help="0: fewer for larger sizes")
    ap.add_argument("--warmup", type=int, default=-1, help="-1: a tenth of iters")
    args = ap.parse_args()
    if args.factor < 2 or args.min_bytes < 4 or args.max_bytes < args.min_bytes:
        ap.error("need factor >= 2 and 4 <= min-bytes <= max-bytes")

    # The parent listens before any rank starts, so no rank waits out the client's 1 s retry.
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    print(HEADER, flush=True)
    try:
        mp.spawn(worker, args=(args, store.port), nprocs=args.ranks, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        print(e, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

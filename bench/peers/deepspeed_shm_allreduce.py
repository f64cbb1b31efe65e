#!/usr/bin/env python3
"""DeepSpeed's CPU shared-memory allreduce (float32 sum) in ddp's sweep format.

    $DDP_TORCH_VENV/bin/python bench/peers/deepspeed_shm_allreduce.py --ranks 2 [--algo shm,gloo]

Needs `deepspeed` (and `ninja`, for the JIT build of its op) in the interpreter's environment:
`pip install deepspeed` into a venv that has CPU torch (scripts/torch_venv.sh).

algo `shm` is `deepspeed.comm.inference_all_reduce`, the call DeepSpeed's CPU inference (AutoTP)
makes: with DS_ACCELERATOR=cpu, `init_distributed` JIT-builds `ShareMemCommBuilder`
(csrc/cpu/comm/shm.cpp, shm_interface.cpp) and, when LOCAL_SIZE == WORLD_SIZE, maps one
/dev/shm workspace per rank; the call then runs `torch.ops.deepspeed.inference_all_reduce_`:
below 1 MiB every rank copies its input into its own slot and reduces all slots into its output
(one flag wait); from 1 MiB, in chunks of at most 32 MiB, each rank copies in, reduces its 1/n
slice of every slot in place, and copies all slices out (two flag waits). Flags are spun on
without yielding. float32, bfloat16 and float16 only, sum only, and only when the CPU has AVX2
(float32) or AVX-512BW (16-bit); anything else falls back to gloo.
algo `gloo` is `deepspeed.comm.all_reduce`: plain torch.distributed (gloo) under DeepSpeed.

Each rank runs torch.set_num_threads(1), so the op's OpenMP loops use one thread per rank, as
ddp's ranks do. The conventions are those of bench/peers/README.md: the slowest rank's time per
iteration, a barrier before each (for `shm` a gloo barrier followed by a one-element shm
allreduce, so ranks leave it within the spin-wait's latency as ddp's shm barrier lets them),
zeros while timed, then a check that an allreduce of rank+1 gives n(n+1)/2 everywhere.
"""

import argparse
import glob
import os
import socket
import sys
import time

from sweep_schedule import HEADER, iters_for, row, sizes, warmup_for  # noqa: E402 (beside this file)

ALGOS = ("shm", "gloo")


def worker(rank, args, port):
    # What a launcher (deepspeed / torchrun with LOCAL_SIZE) sets; LOCAL_SIZE == WORLD_SIZE is
    # what makes the op map its shm workspaces (shm_interface.cpp: all_ranks_local_p).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.ranks),
                      LOCAL_SIZE=str(args.ranks), LOCAL_WORLD_SIZE=str(args.ranks),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm as dcomm
    import torch.distributed as dist

    # The JIT build and init_distributed print to stdout ("... built successfully"): keep the
    # CSV clean by pointing fd 1 at stderr meanwhile.
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    cdb = dcomm.comm.cdb
    level = getattr(cdb, "shm_vector_kernel_level", 0)
    n = args.ranks
    if "shm" in args.algo and (cdb.shm_comm_op is None or level < 1
                               or not hasattr(torch.ops.deepspeed, "inference_all_reduce_")):
        print(f"rank {rank}: DeepSpeed's shm op is not in use (op {cdb.shm_comm_op}, ISA level {level}); "
              "inference_all_reduce would fall back to gloo", file=sys.stderr)
        os._exit(1)
    dist.barrier()  # every rank has mapped every workspace before the first shm call
    if rank == 0:
        segs = sorted(glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"))
        print(f"# deepspeed {deepspeed.__version__}, torch {torch.__version__}, shm op "
              f"{getattr(cdb.shm_comm_op, '__file__', None)}, ISA level {level} (1 avx2, 2 avx512bw), "
              f"{len(segs)} workspaces of {os.path.getsize(segs[0]) if segs else 0} bytes, "
              f"torch threads {torch.get_num_threads()}", file=sys.stderr, flush=True)

    one = torch.zeros(1, dtype=torch.float32)
    ok = True
    for algo in args.algo:
        if algo == "shm":
            reduce = dcomm.inference_all_reduce

            def barrier():
                dist.barrier()
                dcomm.inference_all_reduce(one)  # every rank in; leaves within a flag poll
        else:
            reduce = dcomm.all_reduce
            barrier = dist.barrier
        for nbytes in sizes(args):
            iters, warmup = iters_for(args, nbytes), warmup_for(args, nbytes)
            # Zeros while timing: in-place sums of nonzero inputs would overflow to inf.
            buf = torch.zeros(nbytes // 4, dtype=torch.float32)
            times = []
            for i in range(warmup + iters):
                barrier()
                t0 = time.perf_counter()
                reduce(buf)
                t1 = time.perf_counter()
                if i >= warmup:
                    times.append((t1 - t0) * 1e6)
            buf.fill_(rank + 1)
            reduce(buf)
            wrong = int((buf != n * (n + 1) / 2).sum())
            if wrong:
                print(f"rank {rank}: {algo}: {wrong} elements wrong at {nbytes} bytes", file=sys.stderr)
                ok = False
            t = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if rank == 0:
                print(row("deepspeed", algo, n, nbytes, iters, t.tolist()), flush=True)
            del buf
    # As torch_allreduce.py: all done with gloo before teardown, then skip finalization.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--algo", default="shm", help="comma-separated: shm, gloo")
    ap.add_argument("--min-bytes", type=int, default=4096)
    ap.add_argument("--max-bytes", type=int, default=256 << 20)
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--iters", type=int, default=0, help="0: fewer for larger sizes")
    ap.add_argument("--warmup", type=int, default=-1, help="-1: a tenth of iters")
    args = ap.parse_args()
    args.algo = [a for a in args.algo.split(",") if a]
    if any(a not in ALGOS for a in args.algo) or not args.algo:
        ap.error(f"--algo: one or more of {','.join(ALGOS)}")
    if args.factor < 2 or args.min_bytes < 4 or args.max_bytes < args.min_bytes:
        ap.error("need factor >= 2 and 4 <= min-bytes <= max-bytes")
    if args.max_bytes >= 1 << 31:
        ap.error("the op counts bytes in an int: --max-bytes must stay below 2 GiB")

    # The accelerator is chosen at deepspeed's import: CPU, whatever torch's build can see.
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        import deepspeed  # noqa: F401  (fail here, clearly, rather than in every rank)
    except ImportError as e:
        print(f"deepspeed is not importable from {sys.executable}: {e}\n"
              "install it: scripts/torch_venv.sh, or <venv>/bin/pip install deepspeed", file=sys.stderr)
        sys.exit(2)
    import torch.multiprocessing as mp

    port = free_port()
    print(HEADER, flush=True)
    rc = 0
    try:
        mp.spawn(worker, args=(args, port), nprocs=args.ranks, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        print(e, file=sys.stderr)
        rc = 1
    finally:
        # The op never unlinks its workspaces (shm.cpp: shared_close is never called).
        for f in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"):
            os.unlink(f)
    sys.exit(rc)


if __name__ == "__main__":
    main()

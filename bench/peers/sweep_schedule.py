"""The allreduce sweep's schedule and CSV header, shared by the Python peers (torch_allreduce.py,
deepspeed_shm_allreduce.py): the same as bench/peers/sweep.hpp, so rows line up with the C++ peers."""

HEADER = "system,algo,ranks,bytes,iters,median_us,p10_us,algbw_GBps,busbw_GBps"


def iters_for(args, nbytes):
    """Same schedule as bench/peers/sweep.hpp, so rows line up with the C++ peers."""
    if args.iters > 0:
        return args.iters
    mib = 1 << 20
    if nbytes < mib:
        return 100
    if nbytes < 16 * mib:
        return 40
    if nbytes < 64 * mib:
        return 20
    if nbytes < 256 * mib:
        return 10
    return 5


def warmup_for(args, nbytes):
    return args.warmup if args.warmup >= 0 else max(1, iters_for(args, nbytes) // 10)


def sizes(args):
    b = args.min_bytes
    while b <= args.max_bytes:
        yield b // 4 * 4
        b *= args.factor

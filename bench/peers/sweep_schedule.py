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


def row(system, algo, n, nbytes, iters, times_us):
    """One CSV row from every iteration's time (the slowest rank's, microseconds)."""
    s = sorted(times_us)
    k = len(s)
    median = s[k // 2] if k % 2 else (s[k // 2 - 1] + s[k // 2]) / 2
    p10 = s[(k - 1) // 10]
    algbw = nbytes / (median * 1e3)
    busbw = algbw * 2 * (n - 1) / n if n > 1 else algbw
    return f"{system},{algo},{n},{nbytes},{iters},{median:.2f},{p10:.2f},{algbw:.4f},{busbw:.4f}"

#!/usr/bin/python3
"""PyTorch's rendezvous at scale: N simulated ranks join through one TCPStore, as
torch.distributed.init_process_group (env://, PyTorch 1.13) does, for bench/store_scale.cpp's
comparison.

Per rank, what init_process_group does with the store:
  TCPStore(host, port, world_size, is_master=rank == 0, timeout, multi_tenant=True)
      (rendezvous.py's _create_c10d_store; the constructor connects twice, a client and a
      callback client, and adds 1 to the store's init key; the master waits until that key
      reaches world_size, polling it every 10 ms. Here the master's TCPStore is made before the
      clock starts, as ddp's store_server is, without that wait: the barrier waits for the
      same ranks.)
  _store_based_barrier on PrefixStore("default_pg", store): add(key, 1), then add(key, 0)
      every 10 ms until it equals world_size, or RuntimeError after the timeout.
Rank 0 (the master) runs in its own process; `--procs` forked processes drive ranks 1..N-1,
one thread per rank, all released at once. Output: the CSV of bench/store_scale.cpp:
  system,ranks,procs,reps,join_median_ms,join_min_ms,join_max_ms,rank0_rss_mib,rank0_fds,requests_per_rank,failed
join_ms runs from the release to the last rank's barrier return; rank0_rss_mib is the master
process's resident memory growth from before its TCPStore until every rank passed the
barrier; rank0_fds its descriptors then; requests_per_rank the store requests of the rank that
made the most (the constructor's add, the barrier's add and its polls; the two connections
and the master's own polls of the init key are not counted). A failed run prints the first
error of each kind on stderr, and its columns describe the moment every rank had returned.

  /usr/bin/python3 bench/peers/torch_store_scale.py --ranks 1024,4096,16384 --procs 8 --reps 3
"""
import argparse
import os
import pickle
import resource
import socket
import statistics
import struct
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

BARRIER_KEY = "store_based_barrier_key:1"


def raise_nofile():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def open_fds():
    return len(os.listdir("/proc/self/fd")) - 1  # less listdir's own


def rss_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def send_obj(fd, obj):
    b = pickle.dumps(obj)
    os.write(fd, struct.pack("<I", len(b)) + b)


def recv_exact(fd, n):
    buf = b""
    while len(buf) < n:
        c = os.read(fd, n - len(buf))
        if not c:
            raise EOFError
        buf += c
    return buf


def recv_obj(fd):
    (n,) = struct.unpack("<I", recv_exact(fd, 4))
    return pickle.loads(recv_exact(fd, n))


def join(rank, world, timeout, store):
    """One rank's rendezvous after its TCPStore is made; returns the store and the number of
    store requests the rank made (the constructor's add of the init key included)."""
    requests = 1
    store = dist.PrefixStore("default_pg", store)
    store.add(BARRIER_KEY, 1)
    count = store.add(BARRIER_KEY, 0)
    requests += 2
    start = time.time()
    while count != world:
        time.sleep(0.01)
        count = store.add(BARRIER_KEY, 0)
        requests += 1
        if timedelta(seconds=time.time() - start) > timeout:
            raise RuntimeError(
                "Timed out initializing process group in store based barrier on rank: {}, for key: {} "
                "(world_size={}, worker_count={}, timeout={})".format(rank, BARRIER_KEY, world, count, timeout))
    return store, requests


def client_process(lo, hi, world, port, timeout, stack_kb, rd, wr):
    raise_nofile()
    threading.stack_size(stack_kb * 1024)
    go = threading.Event()
    release = threading.Event()
    results = [None] * (hi - lo)
    finished = threading.Semaphore(0)

    # TCPStore's constructor holds the GIL while it connects: made from many threads at once,
    # one slow connection would stop every simulated rank of this process. So each process
    # makes its ranks' stores one after another before the clock starts (8 processes connect
    # at once), and the timed part is the barrier.
    t_connect = time.monotonic_ns()
    stores = [None] * (hi - lo)
    for i in range(hi - lo):
        try:
            stores[i] = dist.TCPStore("127.0.0.1", port, world, False, timeout, multi_tenant=True)
        except Exception as e:  # noqa: BLE001 -- reported to the driver
            results[i] = (time.monotonic_ns(), 0, "{}: {}".format(type(e).__name__, e))
    connect_ms = (time.monotonic_ns() - t_connect) / 1e6

    def run(i):
        go.wait()
        if stores[i] is None:
            finished.release()
            return
        try:
            store, req = join(lo + i, world, timeout, stores[i])
            results[i] = (time.monotonic_ns(), req, None)
            finished.release()
            release.wait()  # hold the connection, as a real rank holds its store
            del store
        except Exception as e:  # noqa: BLE001 -- reported to the driver
            results[i] = (time.monotonic_ns(), 0, "{}: {}".format(type(e).__name__, e))
            finished.release()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(hi - lo)]
    for t in threads:
        t.start()
    os.write(wr, b"r")
    recv_exact(rd, 1)
    go.set()
    for _ in threads:
        finished.acquire()
    errors = {}
    for _, _, e in results:
        if e is not None:
            errors.setdefault(e.split(":")[0] + ":" + e.split(":")[1][:40] if ":" in e else e, e)
    send_obj(wr, {
        "last_ns": max(r[0] for r in results),
        "failed": sum(1 for r in results if r[2] is not None),
        "requests": max(r[1] for r in results),
        "errors": list(errors.values())[:4],
        "connect_ms": connect_ms,
    })
    try:
        recv_exact(rd, 1)
    except EOFError:
        pass
    release.set()
    os._exit(0)


def master_process(world, port, timeout, rd, wr):
    raise_nofile()
    rss0 = rss_kib()
    out = {"failed": 0, "errors": [], "requests": 0}
    # The master listens from before the clock starts, as ddp's store_server does. Its
    # constructor's wait for the workers (one more poller, of the init key, every 10 ms) is left
    # out: TCPStore's binding holds the GIL through it, and the barrier below waits for the same
    # ranks anyway.
    made = {}
    try:
        made["store"] = dist.TCPStore("127.0.0.1", port, world, True, timeout, wait_for_workers=False,
                                      multi_tenant=True)
    except Exception as e:  # noqa: BLE001
        made["error"] = "{}: {}".format(type(e).__name__, e)
    os.write(wr, b"r")
    recv_exact(rd, 1)
    store = None
    if "store" in made:
        try:
            store, out["requests"] = join(0, world, timeout, made["store"])
        except Exception as e:  # noqa: BLE001
            out["failed"] = 1
            out["errors"] = ["{}: {}".format(type(e).__name__, e)]
    else:
        out["failed"] = 1
        out["errors"] = [made.get("error", "TCPStore master: no store")]
    out["joined_ns"] = time.monotonic_ns()
    os.write(wr, b"j")
    try:
        recv_exact(rd, 1)  # every rank returned: measure
    except EOFError:
        os._exit(1)
    out["fds"] = open_fds()
    out["rss_growth_kib"] = rss_kib() - rss0
    send_obj(wr, out)
    try:
        recv_exact(rd, 1)
    except EOFError:
        pass
    del store
    os._exit(0)


def spawn(body):
    to_child = os.pipe()
    from_child = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(to_child[1])
        os.close(from_child[0])
        try:
            body(to_child[0], from_child[1])
        finally:
            os._exit(3)
    os.close(to_child[0])
    os.close(from_child[1])
    return pid, to_child[1], from_child[0]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Stalled(Exception):
    pass


def recv_until(fd, n, deadline):
    """recv_exact that gives up at `deadline` (time.monotonic()): a stalled child is a result."""
    import select
    buf = b""
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise Stalled
        c = os.read(fd, n - len(buf))
        if not c:
            raise EOFError
        buf += c
    return buf


def recv_obj_until(fd, deadline):
    (n,) = struct.unpack("<I", recv_until(fd, 4, deadline))
    return pickle.loads(recv_until(fd, n, deadline))


def describe_exit(pid):
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return "killed by signal {}".format(os.WTERMSIG(status))
    return "exited with status {}".format(os.WEXITSTATUS(status))


def one_run(world, procs, timeout, stack_kb):
    port = free_port()
    procs = max(1, min(procs, world - 1))
    m = spawn(lambda rd, wr: master_process(world, port, timeout, rd, wr))
    recv_exact(m[2], 1)
    clients = []
    for p in range(procs):
        lo = 1 + (world - 1) * p // procs
        hi = 1 + (world - 1) * (p + 1) // procs
        clients.append(spawn(lambda rd, wr, lo=lo, hi=hi: client_process(lo, hi, world, port, timeout,
                                                                          stack_kb, rd, wr)))
    ready_by = time.monotonic() + timeout.total_seconds() + 60
    t_ready = time.monotonic_ns()
    for i, c in enumerate(clients):
        try:
            recv_until(c[2], 1, ready_by)
        except (Stalled, EOFError):
            print("#   client process {} never finished connecting its ranks; killed".format(i), file=sys.stderr)
            for k in clients + [m]:
                os.kill(k[0], 9)
                os.waitpid(k[0], 0)
            return {"join_ms": 0, "rss_mib": -1, "fds": -1, "requests": 0, "failed": world, "connect_ms":
                    (time.monotonic_ns() - t_ready) / 1e6, "errors": ["stalled while connecting"]}
    connect_ms = (time.monotonic_ns() - t_ready) / 1e6
    t0 = time.monotonic_ns()
    # Every rank gives up at the timeout; past it (and a minute for the failures to come in),
    # what has not answered is reported as stalled.
    deadline = time.monotonic() + timeout.total_seconds() + 60
    os.write(m[1], b"g")
    for c in clients:
        os.write(c[1], b"g")
    reps, errors, died = [], [], []
    for i, c in enumerate(clients):
        try:
            reps.append(recv_obj_until(c[2], deadline))
        except Stalled:
            errors.append("client process {} (ranks {}..) stalled: no result {:.0f} s after the timeout".format(
                i, 1 + (world - 1) * i // procs, 60))
            died.append(c)
        except EOFError:
            errors.append("client process {} died".format(i))
            died.append(c)
    r0 = None
    try:
        recv_until(m[2], 1, deadline)
        os.write(m[1], b"m")
        r0 = recv_obj_until(m[2], deadline)
    except (Stalled, EOFError, BrokenPipeError) as e:
        errors.append("TCPStore master process: " + ("stalled" if isinstance(e, Stalled) else "died"))
    for c in died:
        os.kill(c[0], 9)
    if r0 is None:
        os.kill(m[0], 9)
    for c in clients:
        os.close(c[1])
        os.close(c[2])
    for c in clients:
        st = describe_exit(c[0])
        if c in died:
            errors.append("  that client process " + st)
    os.close(m[1])
    os.close(m[2])
    st = describe_exit(m[0])
    if r0 is None:
        errors.append("  the master process " + st)
        r0 = {"joined_ns": 0, "errors": [], "failed": 1, "requests": 0, "fds": -1, "rss_growth_kib": -1024}
    last = max([r["last_ns"] for r in reps] + [r0["joined_ns"], t0])
    errors = r0["errors"] + [e for r in reps for e in r["errors"]] + errors
    ranks_lost = sum(hi - lo for hi, lo in [(1 + (world - 1) * (clients.index(c) + 1) // procs,
                                              1 + (world - 1) * clients.index(c) // procs) for c in died])
    return {
        "join_ms": (last - t0) / 1e6,
        "rss_mib": r0["rss_growth_kib"] / 1024.0,
        "fds": r0["fds"],
        "requests": max([r["requests"] for r in reps] + [r0["requests"]]),
        "failed": r0["failed"] + sum(r["failed"] for r in reps) + ranks_lost,
        "errors": errors,
        "connect_ms": connect_ms,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1024,4096,16384")
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout-ms", type=int, default=120000)
    ap.add_argument("--stack-kb", type=int, default=256)
    ap.add_argument("--no-header", action="store_true")
    a = ap.parse_args()
    limit = raise_nofile()
    timeout = timedelta(milliseconds=a.timeout_ms)
    if not a.no_header:
        print("system,ranks,procs,reps,join_median_ms,join_min_ms,join_max_ms,rank0_rss_mib,rank0_fds,"
              "requests_per_rank,failed", flush=True)
    bad = 0
    for world in [int(x) for x in a.ranks.split(",")]:
        # No skipping by descriptors here: how TCPStore behaves past the limit is what we measure.
        joins, rss, fds, req, failed = [], [], [], [], 0
        for rep in range(a.reps):
            r = one_run(world, a.procs, timeout, a.stack_kb)
            print("# torch ranks {} rep {}: connect (untimed) {:.0f} ms, join {:.1f} ms, master rss +{:.1f} MiB, {} fds, "
                  "{} requests/rank{}".format(
                world, rep, r["connect_ms"], r["join_ms"], r["rss_mib"], r["fds"], r["requests"],
                ", FAILED ({} of {} ranks)".format(r["failed"], world) if r["failed"] else ""),
                file=sys.stderr, flush=True)
            for e in r["errors"][:8]:
                print("#   " + e.replace("\n", " ")[:300], file=sys.stderr, flush=True)
            joins.append(r["join_ms"])
            rss.append(r["rss_mib"])
            fds.append(r["fds"])
            req.append(r["requests"])
            failed = max(failed, r["failed"])
        bad += failed > 0
        print("torch,{},{},{},{:.1f},{:.1f},{:.1f},{:.1f},{:.0f},{:.0f},{}".format(
            world, a.procs, a.reps, statistics.median(joins), min(joins), max(joins), statistics.median(rss),
            statistics.median(fds), statistics.median(req), failed), flush=True)
    if limit < 2 * 16384:
        print("# RLIMIT_NOFILE hard limit {}: a TCPStore master holds two descriptors per rank".format(limit),
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

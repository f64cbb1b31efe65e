#!/usr/bin/env python3
"""Writes the seed inputs of the fuzz targets into tests/fuzz/corpus/<target>/, and the inputs
that show known, still open defects into tests/fuzz/regressions/<target>/ (docs/testing.md):
once a defect is fixed, its file moves into the corpus and is replayed by every build.

The seeds are valid (and a few nearly valid) frames, hellos and descriptors, so that the fuzzers
start from inputs that reach deep into each parser. Files found by fuzzing that are worth keeping
(a crash once fixed, an input that reaches new code) are added beside them by hand, under a
name that says what they are; this script only rewrites its own seed_* and open_* files.

    tests/fuzz/make_corpus.py
"""
import pathlib
import struct

HERE = pathlib.Path(__file__).resolve().parent

# include/ddp/group/detail/store_protocol.hpp
SET, GET, ADD, CAS, DEL, CHECK, WAIT = range(1, 8)
OK, TIMEOUT, BAD_REQUEST, AUTH_REQUIRED, FULL, TOO_LARGE, FORBIDDEN = range(7)
MAX_FRAME = 64 << 20
# include/ddp/group/detail/mesh.hpp and tests/fuzz/fuzz_mesh_hello.cpp
MESH_MAGIC = 0x30504444
GROUP = 0x6A0B5E11F00D
# include/ddp/group/detail/handshake.hpp
AUTH_MAGIC = 0x41504444
AUTH_STORE, AUTH_MESH = 1, 2
# include/ddp/detail/collective.hpp and include/ddp/dtype.hpp
COLL_MAGIC = 0x43504444
ALLREDUCE, BROADCAST, REDUCE_SCATTER, ALLGATHER, BARRIER = range(1, 6)
F32, F64, F16, BF16, I32, I64 = range(6)
SUM, AVG, MIN, MAX, PROD = range(5)


def u32(v):
    return struct.pack("<I", v)


def i64(v):
    return struct.pack("<q", v)


def frame(code, *fields):
    body = bytes([code]) + b"".join(u32(len(f)) + f for f in fields)
    return u32(len(body)) + body


def requests():
    """A store session's requests, each alone, plus malformed variants."""
    ms = i64(20)  # short server-side waits: a seed must not hold the fuzzer up
    return {
        "set": frame(SET, b"k", b"value"),
        "get_present": frame(SET, b"k", b"v") + frame(GET, b"k", ms),
        "get_missing": frame(GET, b"missing", ms),
        "add": frame(ADD, b"n", i64(5)) + frame(ADD, b"n", i64(-2)),
        "cas": frame(CAS, b"x", b"", b"first") + frame(CAS, b"x", b"first", b"second"),
        "del_check": frame(SET, b"d", b"1") + frame(DEL, b"d") + frame(CHECK, b"d"),
        "wait": frame(SET, b"a", b"") + frame(WAIT, b"a", b"b", ms),
        "truncated": frame(SET, b"key", b"value")[:-3],
        "bad_field_length": u32(9) + bytes([SET]) + u32(100) + b"abcd",
        "zero_length": u32(0),
        "huge_length": u32(MAX_FRAME + 1) + bytes([SET]),
        "unknown_command": frame(42, b"k"),
        "add_short_delta": frame(ADD, b"n", b"\x01"),
        "del_prefix": frame(SET, b"p/a", b"1") + frame(SET, b"p/b", b"2") + frame(SET, b"q", b"3") +
                      frame(DEL, b"p/", b"*") + frame(CHECK, b"q") + frame(DEL, b"", b"*"),
        "del_prefix_bad_mark": frame(SET, b"p/a", b"1") + frame(DEL, b"p/", b"x"),
    }


def store_frame():
    # First byte: how the stream is cut into reads.
    reqs = {**requests(), **{"members_" + k: v for k, v in member_requests().items()}}
    return {name: bytes([i % 17]) + data for i, (name, data) in enumerate(reqs.items())}


def member_requests():
    """A stranger to a store with members (prefix pg/rank/): writes it may not make, reads it
    may, and claims of a taken and of a free rank."""
    ms = i64(20)
    return {
        "forbidden_writes": frame(SET, b"pg/abort", b"stranger") + frame(ADD, b"pg/arrived", i64(1)) +
                            frame(CAS, b"pg/failure", b"", b"x") + frame(DEL, b"pg/id") +
                            frame(SET, b"tcp/1/abort", b"y") + frame(DEL, b"pg/", b"*"),
        "reads": frame(GET, b"pg/rank/0", ms) + frame(CHECK, b"pg/id") + frame(WAIT, b"pg/rank/0", ms),
        "claim_taken": frame(CAS, b"pg/rank/0", b"", b"mine") + frame(SET, b"pg/abort", b"z"),
        "claim_then_write": frame(CAS, b"pg/rank/7", b"", b"t7") + frame(SET, b"pg/abort", b"z") +
                            frame(DEL, b"pg/abort"),
        "claim_not_from_empty": frame(CAS, b"pg/rank/8", b"old", b"t8") + frame(SET, b"k", b"v"),
    }


def store_server():
    # First byte: into how many reads the stream is cut (bits 0-1); bit 4: the store has members.
    seeds = {name: bytes([i % 4]) + data for i, (name, data) in enumerate(requests().items())}
    seeds.update({"members_" + name: bytes([0x10 | (i % 4)]) + data
                  for i, (name, data) in enumerate(member_requests().items())})
    seeds.update({"members_" + name: bytes([0x10 | (i % 4)]) + data
                  for i, (name, data) in enumerate(requests().items()) if name in ("set", "cas", "wait")})
    return seeds


def store_client():
    # First byte: which call (set, get, add, cas, erase, check, wait, erase_prefix); then the answer.
    return {
        "set_ok": bytes([0]) + frame(OK),
        "get_value": bytes([1]) + frame(OK, b"v"),
        "get_timeout": bytes([1]) + frame(TIMEOUT, b"k"),
        "add_ok": bytes([2]) + frame(OK, i64(7)),
        "cas_ok": bytes([3]) + frame(OK, b"v"),
        "erase_ok": bytes([4]) + frame(OK, b"1"),
        "check_ok": bytes([5]) + frame(OK, b"0"),
        "wait_timeout": bytes([6]) + frame(TIMEOUT, b"a", b"b"),
        "erase_prefix_count": bytes([7]) + frame(OK, b"3"),
        "erase_prefix_not_a_count": bytes([7]) + frame(OK, b"12x"),
        "erase_prefix_too_many": bytes([7]) + frame(OK, b"999999"),
        "erase_prefix_again": bytes([7]) + frame(OK, b"4096"),
        "bad_request": bytes([0]) + frame(BAD_REQUEST),
        "set_forbidden": bytes([0]) + frame(FORBIDDEN, b"the store of rank 0 refused to set key 'pg/abort'"),
        "add_forbidden_no_text": bytes([2]) + frame(FORBIDDEN),
        "set_full": bytes([0]) + frame(FULL, b"full"),
        "set_too_large": bytes([0]) + frame(TOO_LARGE, b"too large"),
        "unknown_status": bytes([5]) + frame(FORBIDDEN + 1, b"0"),
        "truncated": bytes([1]) + frame(OK, b"value")[:-2],
    }


def hello(magic=MESH_MAGIC, rank=1, size=2, group=GROUP, to=0):
    # magic, initiator rank, group size, the rank it means to reach, group id
    return struct.pack("<IIIIQ", magic, rank, size, to, group)


def mesh_hello():
    # First byte: bit 0 set, the stranger stays connected (and silent) after its bytes.
    seeds = {
        "member": hello(),
        "wrong_magic": hello(magic=0x12345678),
        "wrong_group": hello(group=GROUP + 1),
        "wrong_size": hello(size=3),
        "rank_zero": hello(rank=0),
        "rank_too_big": hello(rank=2),
        "wrong_target": hello(to=1),
        "truncated": hello()[:10],
        "empty": b"",
    }
    out = {name: bytes([0]) + data for name, data in seeds.items()}
    out["truncated_stalls"] = bytes([1]) + hello()[:10]
    out["member_stays"] = bytes([1]) + hello() + b"more"
    return out


def auth_hello(kind=AUTH_STORE, frm=1, to=0, size=2, group=GROUP):
    return struct.pack("<IBBHIIIIQ", AUTH_MAGIC, 1, kind, 0, frm, to, size, 0, group) + bytes(range(32))


def auth_handshake():
    # First byte: mode (low 2 bits) and piece size (the rest); see fuzz_auth_handshake.cpp.
    proof = u32(AUTH_MAGIC) + u32(0) + bytes(32)
    return {
        "honest": bytes([1 | 4 << 2]) + struct.pack("<H", 0) + b"\x00",
        "honest_tampered_hello": bytes([1 | 7 << 2]) + struct.pack("<H", 30) + b"\x01",
        "honest_tampered_proof": bytes([1]) + struct.pack("<H", 90) + b"\x80",
        "stranger_wrong_proof": bytes([0 | 9 << 2]) + auth_hello() + proof,
        "stranger_no_secret": bytes([2]) + auth_hello(),
        "stranger_plain_request": bytes([0]) + frame(SET, b"k", b"v"),
        "stranger_wrong_kind": bytes([3 | 2 << 2]) + auth_hello(kind=AUTH_STORE) + proof,
        "stranger_mesh": bytes([3]) + auth_hello(kind=AUTH_MESH) + proof,
    }


def desc(kind=ALLREDUCE, dtype=F32, op=SUM, root=0, seq=12, count=1024, magic=COLL_MAGIC):
    return struct.pack("<IBBBBiIQQ", magic, kind, dtype, op, 0, root, 0, seq, count)


def coll_desc():
    d = desc()
    return {
        "equal": d + d,
        "dtype": d + desc(dtype=I32),
        "op": d + desc(op=MAX),
        "seq": d + desc(seq=13),
        "broadcast_root": desc(kind=BROADCAST, root=1) + desc(kind=BROADCAST, root=2),
        "corrupt": d + desc(magic=0),
        "out_of_range_enums": d + desc(kind=200, dtype=77, op=99),
    }


def regressions():
    """Inputs of defects found and not fixed yet, by target: {target: {name: bytes}}, written as
    tests/fuzz/regressions/<target>/open_<name> (docs/testing.md). Once a defect is fixed, its
    file moves into the corpus as fixed_<name> (kept by hand) and its entry leaves this list."""
    return {}


def write(root, target, files, prefix):
    d = HERE / root / target
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob(prefix + "*"):
        old.unlink()
    for name, data in files.items():
        (d / (prefix + name)).write_bytes(data)


def main():
    for target, seeds in [("store_frame", store_frame()), ("store_server", store_server()),
                          ("store_client", store_client()), ("mesh_hello", mesh_hello()),
                          ("auth_handshake", auth_handshake()), ("coll_desc", coll_desc())]:
        write("corpus", target, seeds, "seed_")
    for target, inputs in regressions().items():
        write("regressions", target, inputs, "open_")


if __name__ == "__main__":
    main()

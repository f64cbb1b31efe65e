#!/usr/bin/env python3
"""Which compression pays: the one rule of docs/tuning.md ("Which compression"), as a table.

Per step and f32 bucket bytes B, over H hosts of P ranks, a link of L bytes/s per host, and c the
share of a core each rank has for the conversion (cores per host / P, at most 1: a rank converts
its buckets on one thread):

    f32          2 (H-1)/H B / L
    fp16         (H-1)/H B / L                      + B / (K16 c)
    fp8          (H-1) P B/4 (1 + 4/256) / L        + B / (Kq c) + H P B / (Kd c)
    powersgd     (about 1/100 of the elements) / L  + B / (Kp c)

K16: bench/kernels' "fp16_compress passes", Kq: "fp8 quantize, error feedback", Kd: "fp8 decode
into the sum" (all in f32 bytes per second), Kp: PowerSGD's compute per f32 byte (rank 1; ddp_step
default_powersgd minus default on one host). Pick the smallest of f32, fp16 and fp8 (the same
gradient to 8 or 11 bits, error feedback carrying what fp8 drops); PowerSGD approximates the
gradient by a low rank and trains differently (docs/tuning.md): take it where it beats that pick
and the loss curve allows. No overlap of conversion and wire
is assumed (the pessimistic case); the figures below are this machine's, 256 MiB per array,
-O2 or native (the same since the kernels choose AVX2/AVX-512 at run time).

  bench/compress_rule.py [--k16 2.3] [--kq 3.0] [--kd 4.1] [--kp 1.6] [--bytes 102e6]
                         [--cores-per-rank 1 0.5] [--hosts 2 3 4 8] [--ranks-per-host 1]
"""
import argparse


def times(B, H, P, L, c, k16, kq, kd, kp):
    return {
        "f32": 2 * (H - 1) / H * B / L,
        "fp16": (H - 1) / H * B / L + B / (k16 * c),
        "fp8": (H - 1) * P * B / 4 * (1 + 4 / 256) / L + B / (kq * c) + H * P * B / (kd * c),
        "powersgd": 2 * (H - 1) / H * B / 100 / L + B / (kp * c),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k16", type=float, default=2.3, help="GB/s")
    ap.add_argument("--kq", type=float, default=3.0, help="GB/s")
    ap.add_argument("--kd", type=float, default=4.1, help="GB/s")
    ap.add_argument("--kp", type=float, default=1.6, help="GB/s")
    ap.add_argument("--bytes", type=float, default=102e6, help="f32 gradient bytes (ResNet-50: 102e6, BERT-base: 438e6)")
    ap.add_argument("--links", type=float, nargs="+", default=[1, 10, 25, 100], help="Gbit/s")
    ap.add_argument("--hosts", type=int, nargs="+", default=[2, 3, 4, 8])
    ap.add_argument("--ranks-per-host", type=int, default=1)
    ap.add_argument("--cores-per-rank", type=float, nargs="+", default=[1.0, 0.5])
    a = ap.parse_args()
    G = 1e9
    print("| cores per rank | hosts | link | f32 ms | fp16 ms | fp8 ms | pays | powersgd ms | powersgd / pick |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in a.cores_per_rank:
        for H in a.hosts:
            for gbit in a.links:
                t = times(a.bytes, H, a.ranks_per_host, gbit * G / 8, min(c, 1.0), a.k16 * G, a.kq * G, a.kd * G,
                          a.kp * G)
                best = min(("f32", "fp16", "fp8"), key=t.get)
                print(f"| {c:g} | {H} | {gbit:g} Gbit/s | " + " | ".join(f"{t[k] * 1e3:.0f}" for k in ("f32", "fp16", "fp8")) +
                      f" | {best} | {t['powersgd'] * 1e3:.0f} | {t['powersgd'] / t[best]:.2f} |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A/B of two fwserve binaries at 64 streams, in interleaved rounds (docs/benchmarks.md).

Per architecture and round: binary A under `fwbench --concurrency 64 --duration 8s`
(128-token requests), then binary B the same way; prints each round's tokens/s and B/A,
then the median and range of B/A. Copy the baseline binary aside before rebuilding, e.g.
  cp build/server/fwserve /tmp/fwserve-before && ninja -C build fwserve &&
  scripts/ab_servers.py /tmp/fwserve-before build/server/fwserve --rounds 3
Run it on a quiet machine: this host's speed swings, so only ratios within a round count.
"""
import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ratios import REPO, serve_and_measure  # noqa: E402


def tokens_per_s(build, binary, model_dir, concurrency, duration, flags):
    with tempfile.TemporaryDirectory() as scratch:
        levels = serve_and_measure(build, model_dir, flags, duration, "2s",
                                   os.path.join(scratch, "fwbench.json"), str(concurrency),
                                   binary=binary)
        return levels[concurrency]["output_tokens_per_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="the baseline fwserve binary")
    ap.add_argument("b", help="the fwserve binary compared with it")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--archs", default="aft,fast_weight")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--duration", default="8s")
    ap.add_argument("--server-flags", default="", help="extra flags for both, space-separated")
    ap.add_argument("--a-flags", default="", help="extra flags for A only (e.g. the same binary "
                    "twice, A without and B with a flag)")
    ap.add_argument("--b-flags", default="", help="extra flags for B only")
    ap.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1, got %d" % args.rounds)
    flags = args.server_flags.split()
    for arch in args.archs.split(","):
        model_dir = os.path.join(REPO, "models", "pretrained", arch + "-shakespeare")
        if not os.path.isdir(model_dir):
            ap.error("--archs: no shipped model '%s'" % (arch + "-shakespeare"))
        ratios = []
        for r in range(args.rounds):
            a = tokens_per_s(args.build_dir, args.a, model_dir, args.concurrency, args.duration,
                             flags + args.a_flags.split())
            b = tokens_per_s(args.build_dir, args.b, model_dir, args.concurrency, args.duration,
                             flags + args.b_flags.split())
            ratios.append(b / a)
            print("%s round %d: A %.0f  B %.0f  B/A %.3f" % (arch, r + 1, a, b, b / a), flush=True)
        print("%s: B/A median %.3f (%.3f-%.3f)" % (arch, statistics.median(ratios), min(ratios),
                                                   max(ratios)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

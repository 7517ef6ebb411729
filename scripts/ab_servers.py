#!/usr/bin/env python3
"""A/B of two fwserve binaries at 1 and 64 streams, in interleaved rounds (docs/benchmarks.md).

Per architecture and round: binary A under `fwbench --concurrency 1,64 --duration 8s`
(128-token requests), then binary B the same way; prints each round's tokens/s and ITL
p50 at each level with B/A, then the median and range of each B/A. Copy the baseline binary aside before rebuilding, e.g.
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


def measure(build, binary, model_dir, concurrency, duration, flags):
    """{level: (tokens/s, ITL p50 ms)} for the comma-separated `concurrency` levels."""
    with tempfile.TemporaryDirectory() as scratch:
        levels = serve_and_measure(build, model_dir, flags, duration, "2s",
                                   os.path.join(scratch, "fwbench.json"), concurrency,
                                   binary=binary)
        return {c: (level["output_tokens_per_s"], level["itl_ms"].get("p50", float("nan")))
                for c, level in levels.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="the baseline fwserve binary")
    ap.add_argument("b", help="the fwserve binary compared with it")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--archs", default="aft,fast_weight",
                    help="shipped models (models/pretrained/ARCH-shakespeare)")
    ap.add_argument("--model-dirs", default="",
                    help="comma-separated model directories, in place of --archs (e.g. "
                    "/tmp/fwserve-rwkv7-0.1b, which scripts/bench_mb_sessions.py writes)")
    ap.add_argument("--concurrency", default="1,64", help="comma-separated stream counts")
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
    if args.model_dirs:
        models = [(os.path.basename(d.rstrip("/")), d) for d in args.model_dirs.split(",")]
    else:
        models = [(arch, os.path.join(REPO, "models", "pretrained", arch + "-shakespeare"))
                  for arch in args.archs.split(",")]
    for arch, model_dir in models:
        if not os.path.isdir(model_dir):
            ap.error("no model directory %s" % model_dir)
        tok_ratios, itl_ratios = {}, {}
        for r in range(args.rounds):
            a = measure(args.build_dir, args.a, model_dir, args.concurrency, args.duration,
                        flags + args.a_flags.split())
            b = measure(args.build_dir, args.b, model_dir, args.concurrency, args.duration,
                        flags + args.b_flags.split())
            for c in sorted(a):
                tok_ratios.setdefault(c, []).append(b[c][0] / a[c][0])
                # An ITL p50 of 0 (tokens arriving several to a message) has no ratio.
                itl_ratios.setdefault(c, []).append(
                    b[c][1] / a[c][1] if a[c][1] > 0 else float("nan"))
                print("%s round %d, %d streams: A %.0f tok/s ITL p50 %.3f ms | B %.0f tok/s ITL "
                      "p50 %.3f ms | B/A tok/s %.3f ITL %.3f" % (
                          arch, r + 1, c, a[c][0], a[c][1], b[c][0], b[c][1],
                          tok_ratios[c][-1], itl_ratios[c][-1]), flush=True)
        for c in sorted(tok_ratios):
            t, i = tok_ratios[c], itl_ratios[c]
            print("%s, %d streams: B/A tok/s median %.3f (%.3f-%.3f), ITL p50 median %.3f "
                  "(%.3f-%.3f)" % (arch, c, statistics.median(t), min(t), max(t),
                                   statistics.median(i), min(i), max(i)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

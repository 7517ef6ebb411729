#!/usr/bin/env python3
"""Sums the CUDA kernels of gpu_step_profile's Kineto traces (issue 50).

    profile_summary.py TRACE.json... [--steps N] [--top K]

For each trace: kernels and device time per step (N traced steps, default 5), memory
copies, host launch calls, and the K (default 25) kernels with the most time, each with
its launches and microseconds per step. Kernel names are shortened to 110 characters.
"""
import argparse
import collections
import json


def summarize(path, steps, top):
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    kernels = collections.defaultdict(lambda: [0, 0.0])
    copies = collections.defaultdict(lambda: [0, 0.0])
    launches = collections.Counter()
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "")
        name = e.get("name", "")
        dur = float(e.get("dur", 0))
        if cat == "kernel":
            kernels[name][0] += 1
            kernels[name][1] += dur
        elif cat in ("gpu_memcpy", "gpu_memset"):
            copies[name][0] += 1
            copies[name][1] += dur
        elif cat == "cuda_runtime" or cat == "cuda_driver":
            launches[name] += 1
    total_us = sum(v[1] for v in kernels.values())
    count = sum(v[0] for v in kernels.values())
    print("== %s" % path)
    print("kernels per step: %.1f, kernel time per step: %.1f us (sum of durations)"
          % (count / steps, total_us / steps))
    for name, (n, us) in sorted(copies.items(), key=lambda kv: -kv[1][1]):
        print("  copy %-40s %6.1f per step %8.1f us per step" % (name[:40], n / steps, us / steps))
    runtime = ", ".join("%s %.1f" % (k, v / steps) for k, v in launches.most_common(8))
    print("host runtime calls per step: %s" % runtime)
    print("  %8s %8s %6s  %s" % ("us/step", "launches", "share", "kernel"))
    for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
        print("  %8.1f %8.1f %5.1f%%  %s" % (us / steps, n / steps, 100 * us / max(total_us, 1e-9),
                                              name[:110]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for path in args.traces:
        try:
            summarize(path, args.steps, args.top)
        except (OSError, ValueError) as e:
            print("== %s: unreadable (%s)" % (path, e))


if __name__ == "__main__":
    main()

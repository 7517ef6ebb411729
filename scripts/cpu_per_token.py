#!/usr/bin/env python3
"""Where the server's CPU goes per generated token (issue 24, docs/benchmarks.md).

Starts fwserve on a free loopback port, drives it with fwbench at --concurrency streams
(128-token requests, 64-byte prompts: fwbench's defaults), and reads every thread's CPU
time from /proc/PID/task/*/stat at the start and end of a window inside fwbench's
measured time. Prints, per thread group (engine loop, prefill, stream writer, gRPC's
threads, the rest) and for fwbench itself, the cores it used and its microseconds of
CPU per generated token, and the same for the library's own batched step
(bench/model_bench BM_NativeStep at batch 64 on one thread, where wall time is CPU time)
measured right before in the same round, with the server's tokens/s over the step's at
the default threads (issue 24's target 1). Rounds interleave: step, server, step, ...

Usage: scripts/cpu_per_token.py [--rounds 3] [--archs aft,fast_weight] [--fwserve PATH]
                                [--server-flags "--threads 1"]
Needs a built tree (scripts/build.sh) and a quiet machine: this measures CPU shares.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ratios import ARCH_INDEX, REPO, model_bench, running_fwserve  # noqa: E402
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
GROUPS = (("engine", ("fwserve-engine",)), ("prefill", ("fwserve-prefill",)),
          ("writer", ("fwserve-writer",)))


def thread_cpu(pid):
    """{thread name: CPU seconds} of every thread of `pid` (threads of one name summed)."""
    out = {}
    task_dir = "/proc/%d/task" % pid
    for tid in os.listdir(task_dir):
        try:
            with open(os.path.join(task_dir, tid, "stat")) as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        seconds = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime
        out[name] = out.get(name, 0.0) + seconds
    return out


def process_cpu(pid):
    with open("/proc/%d/stat" % pid) as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def group_of(name):
    for group, names in GROUPS:
        if name in names:
            return group
    if name.startswith(("grpc", "default-execut", "nexting", "event_engine", "resolver")):
        return "grpc"
    return "other"


def library_step(build, arch, threads=None):
    """BM_NativeStep at batch 64: tokens/s with the default intra-op threads, or with
    `threads` (1: its wall time is its CPU time)."""
    name = "BM_NativeStep/%d/64" % ARCH_INDEX[arch]
    return model_bench(build, "^%s(/real_time)?$" % name, 2, threads)[name]["items_per_second"]


def serve(build, fwserve, arch, concurrency, duration, window, flags=()):
    model_dir = os.path.join(REPO, "models", "pretrained", arch + "-shakespeare")
    with tempfile.TemporaryDirectory() as scratch, running_fwserve(
            fwserve, model_dir, flags, os.path.join(scratch, "fwserve.log")) as (server, port):
        result = os.path.join(scratch, "fwbench.json")
        bench = subprocess.Popen(
            [os.path.join(build, "bench", "fwbench"), "--target", "127.0.0.1:%d" % port,
             "--concurrency", str(concurrency), "--duration", "%ds" % duration,
             "--warmup", "2s", "--max_tokens", "128", "--json", result],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # The window: from 1 s into fwbench's measured time to 1 s before its end.
        time.sleep(3.0)
        before, bench_before, t0 = thread_cpu(server.pid), process_cpu(bench.pid), time.time()
        time.sleep(window)
        after, bench_after, t1 = thread_cpu(server.pid), process_cpu(bench.pid), time.time()
        if bench.wait() != 0:
            raise RuntimeError("fwbench failed")
        with open(result) as f:
            tokens_per_s = json.load(f)["levels"][0]["output_tokens_per_s"]
    elapsed = t1 - t0
    cores = {}
    for name, seconds in after.items():
        group = group_of(name)
        cores[group] = cores.get(group, 0.0) + (seconds - before.get(name, 0.0)) / elapsed
    cores["fwbench"] = (bench_after - bench_before) / elapsed
    return tokens_per_s, cores


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--archs", default="aft,fast_weight")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    ap.add_argument("--fwserve", default=None, help="the server binary (default: the build's)")
    ap.add_argument("--server-flags", default="", help="extra fwserve flags, space-separated")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1, got %d" % args.rounds)
    fwserve = args.fwserve or os.path.join(args.build_dir, "server", "fwserve")
    parts = ("engine", "prefill", "writer", "grpc", "other", "fwbench")
    for arch in args.archs.split(","):
        if arch not in ARCH_INDEX:
            ap.error("--archs: unknown architecture '%s'" % arch)
        rows = []
        for r in range(args.rounds):
            step = library_step(args.build_dir, arch)
            step_one_thread = library_step(args.build_dir, arch, threads=1)
            tokens_per_s, cores = serve(args.build_dir, fwserve, arch, args.concurrency, 12, 8.0,
                                        args.server_flags.split())
            rows.append((step, tokens_per_s, cores, step_one_thread))
            print("%s round %d: step %.0f tok/s (1 thread %.0f), server %.0f tok/s (%.2f), "
                  "cores %s" % (arch, r + 1, step, step_one_thread, tokens_per_s,
                                tokens_per_s / step,
                   " ".join("%s=%.2f" % (p, cores.get(p, 0)) for p in parts)), flush=True)
        med = statistics.median
        print("\n%s, %d streams, median of %d rounds (range):" % (arch, args.concurrency,
                                                                args.rounds))
        print("| part | cores | us of CPU per generated token |")
        print("| --- | --- | --- |")
        for p in parts:
            c = [row[2].get(p, 0.0) for row in rows]
            us = [row[2].get(p, 0.0) * 1e6 / row[1] for row in rows]
            print("| %s | %.2f (%.2f-%.2f) | %.1f (%.1f-%.1f) |" %
                  (p, med(c), min(c), max(c), med(us), min(us), max(us)))
        total = [sum(row[2].values()) for row in rows]
        print("| all (server + fwbench) | %.2f (%.2f-%.2f) | |" % (med(total), min(total),
                                                                  max(total)))
        step_us = [1e6 / row[3] for row in rows]
        ratio = [row[1] / row[0] for row in rows]
        print("| library step alone, 1 thread | 1.00 | %.1f (%.1f-%.1f) |" %
              (med(step_us), min(step_us), max(step_us)))
        print("server / step tokens/s: %.2f (%.2f-%.2f)\n" % (med(ratio), min(ratio),
                                                             max(ratio)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

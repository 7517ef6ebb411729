#!/usr/bin/env python3
"""The host path through the front doors, with no model work (issue 48, docs/benchmarks.md).

Starts fwserve with the benchmark-only null step (--benchmark-null-step: no model work,
pre-drawn tokens) on free loopback ports, gRPC and HTTP, and drives it with fwbench at
each stream count over each protocol (--server-pid: the server's CPU per thread from
/proc). Reports per protocol and stream count: tokens/s, the server process's CPU
microseconds per token, the engine thread's, fwbench's own, messages/s and tokens per
message. With --baseline, every round runs the baseline binary then the new one (A, B,
A, B, ...) and the B/A ratios of each round are summarised (median and range).

Usage: scripts/host_path_serving.py [--fwserve build/server/fwserve] [--baseline PATH]
           [--fwbench build/bench/fwbench] [--streams 64,1024,4096] [--protocols grpc,http]
           [--rounds 3] [--duration 5s] [--warmup 2s] [--processes 1]
           [--server-flags "..."] [--json OUT]
Needs a quiet machine: it measures CPU shares. On a 2-core host fwbench shares the cores
with the server, so tokens/s is the pair's; CPU per token is each process's own.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ratios import REPO, free_port, running_fwserve  # noqa: E402

MODEL = os.path.join(REPO, "models", "pretrained", "aft-shakespeare")
FIELDS = (("tokens/s", "output_tokens_per_s"),
          ("server us/tok", "server_cpu_us_per_token"),
          ("engine us/tok", "server_engine_thread_cpu_us_per_token"),
          ("bench us/tok", "bench_cpu_us_per_token"),
          ("msgs/s", "messages_per_s"),
          ("tok/msg", "tokens_per_message"))


def measure(binary, args, streams, tmp, label):
    """One server run: every protocol at every stream count. {(protocol, streams): level}."""
    http_port = free_port()
    top = max(streams)
    flags = ["--benchmark-null-step", "--max-active-streams", str(top),
             "--max-queued-requests", str(2 * top), "--http-listen", "127.0.0.1:%d" % http_port]
    flags += shlex.split(args.server_flags)
    out = os.path.join(tmp, label + ".json")
    with running_fwserve(binary, args.model, flags, os.path.join(tmp, label + ".log")) as (server,
                                                                                        port):
        cmd = [args.fwbench, "--target", "127.0.0.1:%d" % port,
               "--http_target", "127.0.0.1:%d" % http_port,
               "--protocol", args.protocols, "--concurrency", ",".join(map(str, streams)),
               "--duration", args.duration, "--warmup", args.warmup,
               "--max_tokens", str(args.max_tokens), "--processes", str(args.processes),
               "--server_pid", str(server.pid), "--json", out]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        report = json.load(f)
    levels = {}
    for level in report["levels"]:
        if level.get("errors"):
            print("warning: %s %s x%d errors: %s" % (label, level["protocol"],
                                                      level["concurrency"], level["errors"]),
                  file=sys.stderr)
        levels[(level["protocol"], level["concurrency"])] = level
    return levels


def summary(values):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return "%.3g (%.3g-%.3g)" % (statistics.median(values), min(values), max(values))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fwserve", default=os.path.join(REPO, "build", "server", "fwserve"))
    parser.add_argument("--baseline", default="", help="fwserve binary to compare against (A)")
    parser.add_argument("--fwbench", default=os.path.join(REPO, "build", "bench", "fwbench"))
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--streams", default="64,1024,4096")
    parser.add_argument("--protocols", default="grpc,http")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", default="5s")
    parser.add_argument("--warmup", default="2s")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--processes", type=int, default=1, help="fwbench --processes")
    parser.add_argument("--server-flags", default="", help="more fwserve flags, one string")
    parser.add_argument("--json", default="", help="write every level of every round here")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    arms = [("A", args.baseline)] if args.baseline else []
    arms.append(("B", args.fwserve))
    runs = {arm: [] for arm, _ in arms}
    with tempfile.TemporaryDirectory(prefix="fwserve-host-path-") as tmp:
        for r in range(args.rounds):
            for arm, binary in arms:
                print("round %d %s ..." % (r + 1, arm), file=sys.stderr, flush=True)
                runs[arm].append(measure(binary, args, streams, tmp, "%s%d" % (arm, r)))
    keys = sorted(runs["B"][0].keys(), key=lambda k: (k[0] != "grpc", k[1]))
    header = "%-6s %7s %4s" % ("proto", "streams", "arm") + "".join(
        " %22s" % name for name, _ in FIELDS)
    print(header)
    for key in keys:
        for arm, _ in arms:
            row = "%-6s %7d %4s" % (key[0], key[1], arm)
            for _, field in FIELDS:
                row += " %22s" % summary([run[key].get(field) for run in runs[arm] if key in run])
            print(row)
        if args.baseline:
            row = "%-6s %7d %4s" % (key[0], key[1], "B/A")
            for _, field in FIELDS:
                ratios = []
                for a, b in zip(runs["A"], runs["B"]):
                    va, vb = a.get(key, {}).get(field), b.get(key, {}).get(field)
                    if va and vb:
                        ratios.append(vb / va)
                row += " %22s" % summary(ratios)
            print(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({arm: [{"%s/%d" % k: v for k, v in run.items()} for run in arm_runs]
                       for arm, arm_runs in runs.items()}, f, indent=1)


if __name__ == "__main__":
    main()

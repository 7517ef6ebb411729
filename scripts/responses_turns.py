#!/usr/bin/env python3
"""A/B of `/v1/responses` continuations (previous_response_id) between two fwserve binaries.

Per round: binary A, then binary B, each a fresh server with a `dir:` session store and the
HTTP API; `--conversations` client threads each start a conversation and continue it
`--turns` times with previous_response_id (greedy, `--max-output-tokens` each). Reports,
per binary, the continuation latency p50/p90 (ms) and the session-store writes per
continuation (fwserve_session_store_write_duration_seconds_count over the continuations,
read from /metrics), then B/A of the p50 per round and its median and range.

  scripts/responses_turns.py /tmp/fwserve-before build/server/fwserve --rounds 3

Run it on a quiet machine: only ratios within a round count.
"""
import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ratios import REPO, free_port, running_fwserve  # noqa: E402


def post(base, body):
    request = urllib.request.Request(base + "/v1/responses", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def store_writes(metrics_base):
    with urllib.request.urlopen(metrics_base + "/metrics", timeout=30) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("fwserve_session_store_write_duration_seconds_count"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run_binary(binary, model_dir, conversations, turns, max_tokens):
    with tempfile.TemporaryDirectory() as scratch:
        http_port, metrics_port = free_port(), free_port()
        flags = ["--session-store", "dir:" + os.path.join(scratch, "sessions"),
                 "--http-listen", "127.0.0.1:%d" % http_port,
                 "--metrics-listen", "127.0.0.1:%d" % metrics_port]
        with running_fwserve(binary, model_dir, flags, os.path.join(scratch, "fwserve.log")):
            base = "http://127.0.0.1:%d" % http_port
            metrics = "http://127.0.0.1:%d" % metrics_port
            deadline = time.time() + 30
            while True:
                try:
                    urllib.request.urlopen(base + "/health", timeout=5).close()
                    break
                except OSError:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.1)
            firsts = [None] * conversations

            def first(i):
                firsts[i] = post(base, {"input": "ROMEO %d:" % i, "max_output_tokens": max_tokens,
                                        "temperature": 0})

            threads = [threading.Thread(target=first, args=(i,)) for i in range(conversations)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            before = store_writes(metrics)
            latencies = []
            lock = threading.Lock()

            def converse(i):
                previous = firsts[i]
                for turn in range(turns):
                    start = time.perf_counter()
                    previous = post(base, {"input": " And then %d?" % turn,
                                           "previous_response_id": previous["id"],
                                           "max_output_tokens": max_tokens, "temperature": 0})
                    elapsed = (time.perf_counter() - start) * 1000
                    with lock:
                        latencies.append(elapsed)

            threads = [threading.Thread(target=converse, args=(i,)) for i in range(conversations)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            writes = store_writes(metrics) - before
            latencies.sort()
            return {"p50_ms": statistics.median(latencies),
                    "p90_ms": latencies[int(0.9 * (len(latencies) - 1))],
                    "writes_per_turn": writes / len(latencies), "turns": len(latencies)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="the baseline fwserve binary")
    ap.add_argument("b", help="the fwserve binary compared with it")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-output-tokens", type=int, default=16)
    ap.add_argument("--model", default=os.path.join(REPO, "models", "pretrained",
                                                    "aft-shakespeare"))
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1, got %d" % args.rounds)
    ratios = []
    for r in range(args.rounds):
        a = run_binary(args.a, args.model, args.conversations, args.turns, args.max_output_tokens)
        b = run_binary(args.b, args.model, args.conversations, args.turns, args.max_output_tokens)
        ratios.append(b["p50_ms"] / a["p50_ms"])
        print("round %d: A p50 %.1f ms p90 %.1f ms, %.2f writes/turn | B p50 %.1f ms p90 %.1f ms, "
              "%.2f writes/turn | B/A p50 %.3f" % (r + 1, a["p50_ms"], a["p90_ms"],
                                                   a["writes_per_turn"], b["p50_ms"], b["p90_ms"],
                                                   b["writes_per_turn"], ratios[-1]), flush=True)
    print("B/A continuation latency p50: median %.3f (%.3f-%.3f)" % (
        statistics.median(ratios), min(ratios), max(ratios)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

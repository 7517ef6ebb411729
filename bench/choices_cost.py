#!/usr/bin/env python3
"""What `n` choices cost (issue 51; docs/benchmarks.md "Several choices"): one completion
with n choices against n completions of one choice sent at once, on one fwserve, through
the HTTP API, with a long prompt, so that reading the prompt n times would show.

Usage: choices_cost.py FWSERVE MODEL_DIR [--rounds 3] [--n 4] [--prompt-bytes 4096]
                       [--tokens 16] [--threads 2] [--server-flag=--device=cuda ...]

Each round runs, alternating (A, B, A, B, ...), with fresh prompts (a different slice of
the shipped Shakespeare each time, so no kept state helps):
  A  one /v1/completions request with `n` choices of `--tokens` tokens (temperature 1);
  B  `n` requests of one choice each, sent at once.
Printed per round: each arm's wall time and the prompt tokens the server read (the growth
of fwserve_prompt_tokens_total over the arm, from /metrics), then B/A of the wall time,
median and range over the rounds.
"""
import argparse
import json
import os
import re
import statistics
import threading
import time
import urllib.request

from http_fwserve import HttpFwserve

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def post(base, body):
    request = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request) as r:
        return json.load(r)


def prompt_tokens_read(metrics):
    with urllib.request.urlopen(f"{metrics}/metrics") as r:
        text = r.read().decode()
    return sum(float(m) for m in
               re.findall(r"^fwserve_prompt_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fwserve")
    parser.add_argument("model_dir")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-bytes", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--server-flag", action="append", default=[])
    args = parser.parse_args()
    text = open(os.path.join(REPO, "models", "data", "tinyshakespeare.txt"), encoding="utf-8",
                errors="replace").read()
    with HttpFwserve(args.fwserve, args.model_dir, args.threads, metrics=True,
                     flags=args.server_flag) as server:
        base, metrics, model = server.base, server.metrics, server.model
        offset = 0

        def next_prompt():
            nonlocal offset
            offset += args.prompt_bytes
            return text[offset:offset + args.prompt_bytes]

        def body(prompt, n, seed):
            return {"model": model, "prompt": prompt, "max_tokens": args.tokens,
                    "temperature": 1.0, "seed": seed, "n": n}

        post(base, body(next_prompt(), args.n, 1))  # warm
        ratios = []
        for round_ in range(args.rounds):
            before = prompt_tokens_read(metrics)
            start = time.perf_counter()
            reply = post(base, body(next_prompt(), args.n, round_))
            a_wall = time.perf_counter() - start
            a_read = prompt_tokens_read(metrics) - before
            assert len(reply["choices"]) == args.n
            prompt = next_prompt()
            before = prompt_tokens_read(metrics)
            threads = [threading.Thread(target=post, args=(base, body(prompt, 1, round_ * 100 + i)))
                       for i in range(args.n)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            b_wall = time.perf_counter() - start
            b_read = prompt_tokens_read(metrics) - before
            ratios.append(b_wall / a_wall)
            print(f"round {round_ + 1}: A (n={args.n}) {a_wall * 1e3:.1f} ms, {a_read:.0f} prompt "
                  f"tokens read; B ({args.n} x n=1) {b_wall * 1e3:.1f} ms, {b_read:.0f} read; "
                  f"B/A {ratios[-1]:.2f}", flush=True)
        ratios.sort()
        print(f"B/A wall time: median {statistics.median(ratios):.2f} "
              f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}) over {args.rounds} rounds")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""What structured output costs per token (issue 51; docs/benchmarks.md "Structured
output"): a constrained stream's time per generated token over an unconstrained one's,
on one fwserve, through the HTTP API, and whether unconstrained streams sharing a batch
with a constrained one slow down.

Usage: structured_cost.py FWSERVE MODEL_DIR [--rounds 3] [--requests 8] [--tokens 64]
                          [--threads 2] [--batch 4] [--server-flag=--device=cuda ...]

Each round runs, alternating (A, B, A, B, ...):
  A  `--requests` unconstrained chat completions one after another (temperature 1,
     `--tokens` max tokens, a fresh seed each);
  B  the same requests with response_format json_schema (a nested object with bounded
     strings, an array, an enum and integers: what the SDK tests ask for); a reply ends
     when its JSON is whole, so B's token counts are its own;
  C  `--batch` unconstrained streams at once, with one more unconstrained stream beside
     them (restarted until they end);
  D  the same, the stream beside them constrained (so C and D batch as many rows).
Time per token = the requests' wall time / their completion tokens (the prompts are a
few tokens). Printed: each round's B/A and D/C (the unconstrained streams' time per token
only), then the median and range over the rounds.
"""
import argparse
import json
import statistics
import threading
import time
import urllib.request

from http_fwserve import HttpFwserve

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "role": {"type": "string", "enum": ["king", "queen", "fool", "ghost"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "lines": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                  "act": {"type": "integer", "minimum": 1,
                                                          "maximum": 5}},
                 "required": ["city", "act"], "additionalProperties": False},
    },
    "required": ["name", "role", "age", "lines", "home"],
    "additionalProperties": False,
}


def chat(base, model, seed, tokens, constrained):
    body = {"model": model, "messages": [{"role": "user", "content": "A character."}],
            "temperature": 1.0, "seed": seed, "max_tokens": tokens}
    if constrained:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "character", "schema": SCHEMA}}
    request = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request) as r:
        reply = json.load(r)
    return time.perf_counter() - start, reply["usage"]["completion_tokens"]


def sequential(base, model, n, tokens, constrained, seed0):
    wall = generated = 0
    for i in range(n):
        w, t = chat(base, model, seed0 + i, tokens, constrained)
        wall, generated = wall + w, generated + t
    return wall / max(generated, 1)


def concurrent(base, model, batch, tokens, side_constrained, seed0):
    """Time per token of the `batch` unconstrained streams, run at once with one more
    stream beside them (constrained or not), restarted until they end."""
    results = []
    done = threading.Event()

    def unconstrained(i):
        results.append(chat(base, model, seed0 + i, tokens, False))

    def beside():
        i = 0
        while not done.is_set():
            chat(base, model, seed0 + 1000 + i, tokens, side_constrained)
            i += 1

    side = threading.Thread(target=beside)
    side.start()
    threads = [threading.Thread(target=unconstrained, args=(i,)) for i in range(batch)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done.set()
    side.join()
    return wall / max(sum(t for _, t in results), 1) * batch


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fwserve")
    parser.add_argument("model_dir")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--server-flag", action="append", default=[],
                        help="one more fwserve flag (repeatable), e.g. --server-flag=--device=cuda")
    args = parser.parse_args()
    with HttpFwserve(args.fwserve, args.model_dir, args.threads, flags=args.server_flag) as server:
        base, model = server.base, server.model
        sequential(base, model, 2, args.tokens, True, 1)  # warm: the masks' first walks
        ratios, batch_ratios = [], []
        for round_ in range(args.rounds):
            seed = 100 * (round_ + 1)
            a = sequential(base, model, args.requests, args.tokens, False, seed)
            b = sequential(base, model, args.requests, args.tokens, True, seed)
            c = concurrent(base, model, args.batch, args.tokens, False, seed)
            d = concurrent(base, model, args.batch, args.tokens, True, seed)
            ratios.append(b / a)
            batch_ratios.append(d / c)
            print(f"round {round_ + 1}: unconstrained {a * 1e3:.3f} ms/token, constrained "
                  f"{b * 1e3:.3f} ms/token: B/A {b / a:.3f}; {args.batch} unconstrained "
                  f"streams {c * 1e3:.3f} ms/token beside an unconstrained one, {d * 1e3:.3f} "
                  f"beside a constrained one: D/C {d / c:.3f}", flush=True)
        print(f"constrained/unconstrained time per token: median {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f})")
        print(f"unconstrained streams beside a constrained one: median "
              f"{statistics.median(batch_ratios):.3f} (range {min(batch_ratios):.3f}-"
              f"{max(batch_ratios):.3f})")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Issue 27's overload ratios from `scripts/bench-serving.sh overload` output directories.

Usage: scripts/overload_table.py LABEL=DIR [LABEL=DIR ...]

A label may be given several times (one DIR per round of an A/B). Each DIR holds overload-<round>-<client>.json (fwbench --json, levels 1x, 2x, 8x in that
order). Per client, one row per label: the median over the rounds (and range) of goodput
at 2x and 8x over the same run's 1x level, TTFT p50 at 8x, TTFT p99 at 8x over 1x, and
refusals per second at 8x. Ratios are taken within one run, never across runs.
"""
import glob
import json
import os
import re
import statistics
import sys


def cell(values, fmt="{:.2f}"):
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main(args):
    if not args:
        sys.exit(__doc__)
    print("| arm | client | goodput 2x / 1x | goodput 8x / 1x | TTFT p50 at 8x (ms) | "
          "TTFT p99 at 1x (ms) | TTFT p99 8x / 1x | refused/s at 8x | rounds |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    dirs = {}
    for arg in args:
        label, _, directory = arg.partition("=")
        dirs.setdefault(label, []).append(directory)
    for label, directories in dirs.items():
        for client in ("retrying", "naive"):
            rows = {k: [] for k in ("g2", "g8", "p50", "p99_1", "p99r", "ref")}
            files = sorted(path for directory in directories for path in
                           glob.glob(os.path.join(directory, f"overload-*-{client}.json")))
            for path in files:
                levels = json.load(open(path))["levels"]
                if len(levels) < 3:
                    continue
                one, two, eight = levels[0], levels[1], levels[2]
                base = one["output_tokens_per_s"]
                rows["g2"].append(two["output_tokens_per_s"] / base)
                rows["g8"].append(eight["output_tokens_per_s"] / base)
                rows["p50"].append(eight["ttft_ms"]["p50"])
                rows["p99_1"].append(one["ttft_ms"]["p99"])
                rows["p99r"].append(eight["ttft_ms"]["p99"] / one["ttft_ms"]["p99"])
                refused = sum(v for k, v in eight.get("errors", {}).items()
                              if re.search("RESOURCE_EXHAUSTED|DEADLINE", k))
                rows["ref"].append(refused / eight["window_s"])
            print(f"| {label} | {client} | {cell(rows['g2'])} | {cell(rows['g8'])} | "
                  f"{cell(rows['p50'], '{:.0f}')} | {cell(rows['p99_1'], '{:.0f}')} | "
                  f"{cell(rows['p99r'])} | {cell(rows['ref'], '{:.0f}')} | {len(files)} |")


if __name__ == "__main__":
    main(sys.argv[1:])

#!/usr/bin/env python3
"""The compile time a build spent, from its build/.ninja_log: the summed time of every
step (what the build costs on one core; the stable measure of a build's weight, where
wall time swings with the machine's load), the step count, and the slowest steps.

Usage: scripts/ninja_log_summary.py BUILD_DIR [--top N] [--json]
Only the last run of each output counts (ninja appends a line per run).
"""
import argparse
import json
import os
import sys


def read_log(build_dir):
    """{output: seconds} of the newest entry of each output in BUILD_DIR/.ninja_log."""
    steps = {}
    with open(os.path.join(build_dir, ".ninja_log"), encoding="utf-8") as log:
        for line in log:
            if line.startswith("#"):
                continue
            fields = line.rstrip("\n").split("\t")
            if len(fields) < 4:
                continue
            start, end, output = int(fields[0]), int(fields[1]), fields[3]
            steps[output] = (end - start) / 1000.0
    return steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build_dir")
    parser.add_argument("--top", type=int, default=10, help="how many slowest steps to list")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = parser.parse_args()
    try:
        steps = read_log(args.build_dir)
    except OSError as error:
        print(f"ninja_log_summary.py: {error}", file=sys.stderr)
        return 1
    total = sum(steps.values())
    slowest = sorted(steps.items(), key=lambda item: -item[1])[:args.top]
    if args.json:
        print(json.dumps({"summed_seconds": round(total, 1), "steps": len(steps),
                          "slowest": [{"output": o, "seconds": s} for o, s in slowest]}))
        return 0
    print(f"summed compile time: {total:.1f} s over {len(steps)} steps")
    print(f"the {len(slowest)} slowest steps:")
    for output, seconds in slowest:
        print(f"  {seconds:6.1f} s  {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

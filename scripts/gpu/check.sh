#!/usr/bin/env bash
# The GPU machine's checks (issue 26), after scripts/gpu/build.sh: the CUDA model
# equivalence tests, fwserve --device cuda beside a CPU server (generation, Score, a
# session round trip through the CPU server, every shipped model), fwbench at 1, 16,
# 64, 256 and 1024 streams with GPU memory per stream and a 64 KB prefill, and the
# PyTorch eager baseline on the same device; nvidia-smi and the versions used.
# Writes OUT_DIR/report.md and OUT_DIR/report.json (and the raw outputs beside them).
# On a machine without a GPU (or with a CPU LibTorch) it says so, marks the CUDA checks
# "needs a CUDA run" and still runs the rest on the CPU.
#
# Usage: scripts/gpu/check.sh OUT_DIR
# Environment: BUILD_DIR, CHECK_MODEL_TESTS, CHECK_STREAMS, CHECK_DURATION,
# CHECK_BENCH_MODEL, CHECK_TOKENS (scripts/gpu/check.py's docstring).
# Exit status: 0 when no check failed, 1 when one did, 2 on a usage error.
set -euo pipefail
if [[ $# -ne 1 || "$1" == -* ]]; then
  sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
fi
exec python3 "$(dirname "$0")/check.py" "$1"

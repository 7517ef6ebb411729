#!/usr/bin/env bash
# Resident memory and Score time of two fwserve binaries on RWKV-7 0.1B, float32 and bf16
# (docs/benchmarks.md, "RWKV-7 0.1B: the Model keeps 16-bit matrices"):
#   scripts/bench_rwkv7_memory.sh A_BINARY B_BINARY [ROUNDS]
# Per round, per model directory, A then B: the server's VmRSS and RssAnon once healthy,
# the seconds of 3 `fwctl score` calls on the first 1,000 bytes of tinyshakespeare, and
# VmRSS after them. The directories are $MODELS (default /tmp/fwserve-rwkv7-0.1b and
# /tmp/fwserve-rwkv7-0.1b-bf16, written by scripts/bench_mb_sessions.py --shape 0.1b
# [--storage-dtype BF16]). Run on a quiet machine from the repository root, after
# scripts/build.sh (fwctl comes from build/).
set -euo pipefail
[[ $# -ge 2 ]] || { echo "usage: $0 A_BINARY B_BINARY [ROUNDS]" >&2; exit 2; }
binaries=("$1" "$2")
rounds=${3:-3}
read -r -a models <<<"${MODELS:-/tmp/fwserve-rwkv7-0.1b /tmp/fwserve-rwkv7-0.1b-bf16}"
port=$((53000 + RANDOM % 1000))
text=$(head -c 1000 models/data/tinyshakespeare.txt)
fwctl=(build/client/fwctl --target "127.0.0.1:$port")
for round in $(seq 1 "$rounds"); do
  for model in "${models[@]}"; do
    for bin in "${binaries[@]}"; do
      "$bin" --listen "127.0.0.1:$port" --model "$model" >/tmp/bench_rwkv7_memory.log 2>&1 &
      pid=$!
      for _ in $(seq 1 120); do "${fwctl[@]}" health >/dev/null 2>&1 && break; sleep 1; done
      sleep 1
      healthy=$(grep -E 'VmRSS|RssAnon' "/proc/$pid/status" | tr -s ' \t' ' ' | tr '\n' ' ')
      start=$(date +%s.%N)
      for _ in 1 2 3; do "${fwctl[@]}" score "$text" >/dev/null; done
      end=$(date +%s.%N)
      after=$(grep VmRSS "/proc/$pid/status" | tr -s ' \t' ' ')
      echo "round $round $(basename "$model") $bin: ${healthy}score x3 $(echo "$end - $start" | bc) s; after: $after"
      kill "$pid"
      wait "$pid" 2>/dev/null || true
    done
  done
done

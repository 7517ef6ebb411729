#!/usr/bin/env bash
# Prefill benchmark (docs/benchmarks.md, "Prefill through the server"): starts fwserve
# with each decode kernel in turn (native, then libtorch: the LibTorch sequence form the
# server used before), creates sessions with a BYTES-byte prefix of the training text
# through fwctl, and prints prefix tokens per second of each CreateSession (wall time
# of the call, client start-up included), REPEAT times per kernel.
#
# Usage: bench/prefill_bench.sh [BYTES] [REPEAT]   (defaults 65536, 3)
# Environment: MODEL=DIR (default models/pretrained/aft-shakespeare), BUILD_DIR=build,
#              SERVER_FLAGS="..." extra fwserve flags, FWSERVE=PATH (default
#              BUILD_DIR/server/fwserve), KERNELS="native libtorch" (the kernels to run).
set -euo pipefail
cd "$(dirname "$0")/.."
BYTES=${1:-65536}
REPEAT=${2:-3}
MODEL=${MODEL:-models/pretrained/aft-shakespeare}
BUILD_DIR=${BUILD_DIR:-build}
FWSERVE=${FWSERVE:-$BUILD_DIR/server/fwserve}
PREFIX=$(head -c "$BYTES" models/data/tinyshakespeare.txt | tr -d '\\')
for kernel in ${KERNELS:-native libtorch}; do
  port=$((20000 + RANDOM % 40000))
  # shellcheck disable=SC2086  # SERVER_FLAGS is split on purpose
  "$FWSERVE" --model "$MODEL" --listen "127.0.0.1:$port" --metrics-listen= \
    --log-level=warning --decode-kernel="$kernel" ${SERVER_FLAGS:-} &
  pid=$!
  for _ in $(seq 1 100); do
    if "$BUILD_DIR/client/fwctl" --target "127.0.0.1:$port" health >/dev/null 2>&1; then break; fi
    sleep 0.1
  done
  for i in $(seq 1 "$REPEAT"); do
    start=$(date +%s.%N)
    "$BUILD_DIR/client/fwctl" --target "127.0.0.1:$port" session create --prefix "$PREFIX" \
      >/dev/null
    end=$(date +%s.%N)
    python3 -c "import sys; b,s,e=int(sys.argv[1]),float(sys.argv[2]),float(sys.argv[3]); \
print('kernel=%s run=%s bytes=%d seconds=%.3f tokens_per_second=%.0f' % (sys.argv[4], sys.argv[5], b, e-s, b/(e-s)))" \
      "${#PREFIX}" "$start" "$end" "$kernel" "$i"
  done
  kill -TERM "$pid"
  wait "$pid" || true
done

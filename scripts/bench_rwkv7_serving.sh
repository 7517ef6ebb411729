#!/usr/bin/env bash
# RWKV-7 at the 0.1B shape, served (docs/benchmarks.md, "RWKV-7 0.1B: prefill, serving 16
# streams, and memory"; issue 38):
#   1. the server's resident memory once healthy (VmRSS), for each binary given;
#   2. ROUNDS rounds of: model_bench's batch-16 native step (2 s), then fwbench at 16
#      streams for 15 s (5 s warm-up, 64 tokens a request, 16-byte prompts) against the
#      first binary; prints each round's tokens/s and their ratio.
# Usage: [MODEL=DIR] scripts/bench_rwkv7_serving.sh [ROUNDS] [FWSERVE...]
#   The model directory is $MODEL, default /tmp/fwserve-rwkv7-0.1b (scripts/bench_mb_sessions.py
#   --shape 0.1b writes it with `fwmodel init`; with --storage-dtype BF16 the same model in
#   bf16, /tmp/fwserve-rwkv7-0.1b-bf16, which the native kernel keeps in 16 bits); FWSERVE
#   defaults to build/server/fwserve. STEP: the batch-16 step's benchmark, default
#   BM_Rwkv7NativeStep (float32 weights); BM_Rwkv7NativeStepBf16 for the bf16 directory.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
binaries=("${@:-build/server/fwserve}")
model=${MODEL:-/tmp/fwserve-rwkv7-0.1b}
step_bench=${STEP:-BM_Rwkv7NativeStep}
[[ -f $model/config.json ]] || { echo "no $model: run scripts/bench_mb_sessions.py --shape 0.1b" >&2; exit 1; }
port=$((52000 + RANDOM % 1000))
wait_healthy() {
  for _ in $(seq 1 120); do
    build/client/fwctl --target "127.0.0.1:$1" health >/dev/null 2>&1 && return 0
    sleep 1
  done
  return 1
}
for bin in "${binaries[@]}"; do
  "$bin" --listen "127.0.0.1:$port" --model "$model" >/tmp/bench_rwkv7_serving.log 2>&1 &
  pid=$!
  wait_healthy "$port"
  echo "$bin: $(grep VmRSS /proc/$pid/status)"
  kill "$pid"; wait "$pid" 2>/dev/null || true
done
"${binaries[0]}" --listen "127.0.0.1:$port" --model "$model" >/tmp/bench_rwkv7_serving.log 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
wait_healthy "$port"
for r in $(seq 1 "$rounds"); do
  step=$(OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE build/bench/model_bench \
    --benchmark_filter="^$step_bench/16/" --benchmark_min_time=2 --benchmark_format=json \
    2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["benchmarks"][0]["items_per_second"])')
  build/bench/fwbench --target "127.0.0.1:$port" --concurrency 16 --duration 15s --warmup 5s \
    --max_tokens 64 --prompt_bytes 16 --json /tmp/bench_rwkv7_serving.json >/dev/null 2>&1
  served=$(python3 -c 'import json; d=json.load(open("/tmp/bench_rwkv7_serving.json")); print(d["levels"][0]["output_tokens_per_s"])')
  python3 -c "print('round $r: batch-16 step %.1f tokens/s, served at 16 streams %.1f, ratio %.3f (load %s)' % ($step, $served, $served / $step, open('/proc/loadavg').read().split()[0]))"
done

#!/usr/bin/env bash
# Serving with prompts arriving beside the decode (docs/benchmarks.md, "With prompts
# arriving beside the decode"): starts FWSERVE on MODEL_DIR, runs fwbench at 16 streams
# for 8 s (2 s warm-up, 64 tokens a request, PROMPT_BYTES-byte prompts, default 2048) and
# prints tokens/s, TTFT p50 and ITL p50. Alternate two binaries in rounds for an A/B:
#   for r in 1 2 3; do scripts/bench_mixed_prompts.sh A DIR; scripts/bench_mixed_prompts.sh B DIR; done
# Usage: [PROMPT_BYTES=N] scripts/bench_mixed_prompts.sh FWSERVE MODEL_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$1
model=$2
port=$((54000 + RANDOM % 900))
out=$(mktemp)
"$bin" --listen "127.0.0.1:$port" --model "$model" >"$out.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -f "$out" "$out.log"' EXIT
for _ in $(seq 1 180); do
  build/client/fwctl --target "127.0.0.1:$port" health >/dev/null 2>&1 && break
  sleep 0.5
done
build/bench/fwbench --target "127.0.0.1:$port" --concurrency 16 --duration 8s --warmup 2s \
  --max_tokens 64 --prompt_bytes "${PROMPT_BYTES:-2048}" --json "$out" >/dev/null 2>&1
python3 -c 'import json, sys; d = json.load(open(sys.argv[1]))["levels"][0]; print("%.0f tok/s ttft p50 %.1f ms itl p50 %.3f ms" % (d["output_tokens_per_s"], d.get("ttft_ms", {}).get("p50", float("nan")), d["itl_ms"].get("p50", float("nan"))))' "$out"

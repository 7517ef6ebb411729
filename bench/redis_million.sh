#!/usr/bin/env bash
# Many sessions in one Redis: loads N sessions (default 1,000,000) of a tiny model (a few
# KB of state each) into a fresh redis-server, reports the memory Redis needs per
# session beyond the state blob, then starts fwserve on that store and measures
# list / get / continue / delete of random sessions (session_store_bench).
#
# Usage: bench/redis_million.sh [SESSIONS] [OPS]     (from the repo root, after a build)
# Needs redis-server and redis-cli (Debian's redis-server package) and ~6 GB of memory
# for a million sessions. Nothing else may load the machine while it runs.
set -euo pipefail

SESSIONS="${1:-1000000}"
OPS="${2:-1000}"
BUILD="${BUILD_DIR:-build}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

work="$(mktemp -d)"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

redis_port="$(free_port)"
redis-server --bind 127.0.0.1 --port "$redis_port" --save "" --appendonly no --dir "$work" \
  --logfile "$work/redis.log" &
pids+=($!)
for _ in $(seq 50); do redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break; sleep 0.1; done

# The tiny model: AFT, d_model 32, 2 layers: 3 KB of state per session.
model="$work/tiny-aft"
cat > "$work/config.json" <<'JSON'
{"architecture": "aft", "attn_eps": 1e-06, "bos_token_id": 10, "d_ff": 64, "d_model": 32,
 "dconv_kernel": 4, "dpfp_nu": 1, "ffn": "squared_relu", "format_version": 1, "n_heads": 2,
 "n_layers": 2, "norm_eps": 1e-05, "tie_embeddings": false, "tokenizer": "bytes",
 "vocab_size": 256}
JSON
"$BUILD/tools/fwmodel" init "$model" --config "$work/config.json" --seed 1 >/dev/null
"$BUILD/tools/fwmodel" info "$model" | grep "state bytes"

used() { redis-cli -p "$redis_port" info memory | sed -n 's/^used_memory:\([0-9]*\).*/\1/p'; }
before="$(used)"
"$BUILD/bench/session_store_bench" --store "redis://127.0.0.1:$redis_port" --model "$model" \
  --sessions "$SESSIONS" --load_threads 4 --ops 0
after="$(used)"
blob_bytes="$(redis-cli -p "$redis_port" --raw hstrlen "fws:{5e550000000000000000000000000000}:s" blob)"
echo "redis: used_memory $before -> $after bytes for $SESSIONS sessions"
python3 - "$before" "$after" "$SESSIONS" "$blob_bytes" <<'PY'
import sys
before, after, n, blob = (int(x) for x in sys.argv[1:])
per = (after - before) / n
print(f"redis: {per:.0f} bytes per session, of which {blob} the state blob: "
      f"{per - blob:.0f} bytes of overhead per session (keys, hash fields, index entry)")
PY

grpc_port="$(free_port)"
OMP_NUM_THREADS=1 "$BUILD/server/fwserve" --model "$model" --listen "127.0.0.1:$grpc_port" \
  --metrics-listen "127.0.0.1:$(free_port)" --session-store "redis://127.0.0.1:$redis_port" \
  --threads 1 > "$work/fwserve.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  grep -q "listening" "$work/fwserve.log" 2>/dev/null && break
  sleep 0.2
done
"$BUILD/bench/session_store_bench" --store "redis://127.0.0.1:$redis_port" --model "$model" \
  --sessions "$SESSIONS" --load=false --target "127.0.0.1:$grpc_port" --ops "$OPS"

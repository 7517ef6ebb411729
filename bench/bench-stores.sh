#!/usr/bin/env bash
# What the session store and the proxy cost: fwbench --sessions (every request continues
# its stream's own session, so every request ends with a write-through) at 1, 8 and 32
# streams against, in one run:
#   memory    one fwserve, --session-store memory
#   dir       one fwserve, --session-store dir:TMP
#   redis     one fwserve, --session-store redis:// (Redis: appendonly, appendfsync always)
#   haproxy   deploy/haproxy/haproxy.cfg in front of 2 fwserve replicas on that Redis
# Usage: bench/bench-stores.sh [OUT_DIR] [extra fwbench flags]   (repo root, after a build)
# Nothing else may load the machine while it runs (about 5 minutes).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
BUILD="${BUILD_DIR:-build}"
OUT="${1:-$(mktemp -d)}"
shift || true
EXTRA=("$@")
mkdir -p "$OUT"
MODEL="${MODEL:-models/pretrained/aft-shakespeare}"
work="$(mktemp -d)"
pids=()
stop_all() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  pids=()
}
trap 'stop_all; rm -rf "$work"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_log() {  # FILE PATTERN
  for _ in $(seq 150); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.2; done
  echo "timed out waiting for '$2' in $1" >&2; tail -20 "$1" >&2; return 1
}
start_fwserve() {  # PORT STORE LOG
  OMP_NUM_THREADS=1 "$BUILD/server/fwserve" --model "$MODEL" --listen "127.0.0.1:$1" \
    --metrics-listen "127.0.0.1:$(free_port)" --session-store "$2" > "$3" 2>&1 &
  pids+=($!)
  wait_log "$3" "listening"
}
run_fwbench() {  # NAME TARGET
  local name="$1" target="$2"
  echo "== $name"
  "$BUILD/bench/fwbench" --target "$target" --sessions --concurrency 1,8,32 --duration 8s \
    --warmup 2s --repeat 2 --json "$OUT/$name.json" --label "$name" "${EXTRA[@]}" 2>&1 |
    tee "$OUT/$name.txt"
}

redis_port="$(free_port)"
start_redis() {
  redis-server --bind 127.0.0.1 --port "$redis_port" --save "" --appendonly yes \
    --appendfsync always --dir "$work" --logfile "$work/redis.log" &
  pids+=($!)
  for _ in $(seq 50); do redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break; sleep 0.1; done
}

port="$(free_port)"
start_fwserve "$port" memory "$work/memory.log"
run_fwbench memory "127.0.0.1:$port" 
stop_all

mkdir -p "$work/sessions"
start_fwserve "$port" "dir:$work/sessions" "$work/dir.log"
run_fwbench dir "127.0.0.1:$port" 
stop_all

start_redis
start_fwserve "$port" "redis://127.0.0.1:$redis_port" "$work/redis1.log"
run_fwbench redis "127.0.0.1:$port" 
stop_all

start_redis
p1="$(free_port)"; p2="$(free_port)"; proxy="$(free_port)"
start_fwserve "$p1" "redis://127.0.0.1:$redis_port" "$work/replica1.log"
start_fwserve "$p2" "redis://127.0.0.1:$redis_port" "$work/replica2.log"
sed -e '/# BEGIN fwserve replicas/,/# END fwserve replicas/{/^ *server /d}' \
    -e "/# BEGIN fwserve replicas/a\\    server fwserve1 127.0.0.1:$p1\\n    server fwserve2 127.0.0.1:$p2" \
    deploy/haproxy/haproxy.cfg > "$work/haproxy.cfg"
FWSERVE_HAPROXY_BIND="127.0.0.1:$proxy" FWSERVE_HAPROXY_STATS="127.0.0.1:$(free_port)" \
  haproxy -db -f "$work/haproxy.cfg" > "$work/haproxy.log" 2>&1 &
pids+=($!)
sleep 3
run_fwbench haproxy2 "127.0.0.1:$proxy" 
stop_all
echo "results in $OUT"

#!/usr/bin/env bash
# Serving benchmark (docs/benchmarks.md, "Serving (fwbench)"): builds fwserve and fwbench
# if needed, starts the server on a free local port (metrics off, log level warning),
# waits until it listens, runs
#   (a) a concurrency sweep: 1, 8, 32 and 128 streams, no session context;
#   (b) the context comparison: 1 and 8 streams generating at 100 vs 4000 tokens of
#       session context (same run, levels interleaved);
# writes the JSON results, the printed tables and a machine note into OUT_DIR, and stops
# the server with SIGTERM.
#
# With `http` as the first argument it runs the HTTP/SSE vs gRPC comparison instead: the
# server also gets --http-listen on a free port, and fwbench --protocol grpc,http runs
#   (c) streaming: HTTP_CONCURRENCY (64) streams, 128-token requests, ROUNDS (3) rounds of
#       gRPC then HTTP (A,B,A,B,...); fwbench prints each round's HTTP/gRPC ratio (tokens/s,
#       requests/s, TTFT, ITL, request latency, CPU per request) and their median and range;
#   (d) per-request overhead: minimal requests (--max-tokens 1, a 1-byte prompt) in a
#       closed loop at OVERHEAD_CONCURRENCY (1,64), ROUNDS rounds: requests/s, request
#       latency p50/p99 and the server's CPU time per request, per protocol.
#
# With `overload` as the first argument it measures goodput under overload
# (docs/serving.md "Overload"): the server runs with OVERLOAD_SERVER_FLAGS
# (--max-active-streams 16 --max-queued-requests 16), and fwbench runs
#   (e) ROUNDS (3) rounds, each the levels OVERLOAD_LEVELS (16,32,128: 1x, 2x and 8x the
#       16 slots) with the retrying client, then the same with the naive one;
#       tokens/s of completed streams is the goodput, TTFT p99 of admitted requests, and
#       the refusals by code.
#
# With `tenants` it measures fairness under a storm (issue 27): the same server flags
# plus an API keys file with two tenants, storm and light; per round,
#   (f) light alone at TENANT_LIGHT streams (4: half its fair share of the 16 slots),
#       then for each storm size in TENANT_STORM (16,128: the slots, and 8x them; the
#       naive client) storm started first and light measured beside it: light's
#       refusals, and its TTFT p99 beside the storm over alone (beside 16 streams the
#       machine is as busy but the queue is not overloaded: the CPU's share of it).
#
# With `ratios` it prints issue 24's ratios in interleaved rounds (sgemm roof, library
# step, PyTorch loop, fwserve at 64 streams with both GEMM backends; then 1/16/256/1024
# streams, PyTorch batch 1 and sequential 16, the 64 KB prefill): it runs
# `scripts/bench_ratios.py --extended` with the remaining arguments (--rounds, --out, ...).
#
# Usage: scripts/bench-serving.sh [OUT_DIR] [extra fwbench flags...]
#        scripts/bench-serving.sh ratios [bench_ratios.py flags...]
#        scripts/bench-serving.sh http [OUT_DIR] [extra fwbench flags...]
#        scripts/bench-serving.sh overload [OUT_DIR] [extra fwbench flags...]
#        scripts/bench-serving.sh tenants [OUT_DIR] [extra fwbench flags...]
#   OUT_DIR defaults to /tmp/fwbench-results (/tmp/fwbench-http-results for `http`).
# Environment:
#   MODEL=DIR          checkpoint to serve (default: the server's default model)
#   DURATION=10s       measured time per level;  WARMUP=2s  unmeasured time before it
#   CONCURRENCY=1,8,32,128   levels of run (a)
#   CONTEXT_CONCURRENCY=1,8  levels of run (b);  CONTEXTS=100,4000  its context lengths
#   HTTP_CONCURRENCY=64  ROUNDS=3  OVERHEAD_CONCURRENCY=1,64   runs (c) and (d)
#   SERVER_FLAGS="..." extra fwserve flags (e.g. "--threads 1 --batch-wait 1ms")
#   METRICS=1          turn the server's /metrics on (free port) so that fwbench reports
#                      engine statistics (mean batch size, share of time in the model step)
#   LABEL="..."        recorded in the JSON (default: commit and server binary)
#   BUILD_DIR=build    JOBS=2 (parallel build jobs)
#   FWSERVE=PATH       benchmark this fwserve binary instead of building BUILD_DIR's (e.g.
#                      one built from a clean checkout while the tree is being edited)
#   BASELINE=1         first run the PyTorch eager baseline (bench/pytorch_baseline.py: batch
#                      1, 16 sessions one after another, batch 64; 128 tokens; nproc threads)
#                      on the same checkpoint, before the server starts; its JSON lines go to
#                      OUT_DIR/pytorch_baseline.jsonl and stdout. Needs python3-torch
#                      (scripts/install-deps.sh --bench);  PYTHON=python3 runs it
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=sweep
if [[ "${1:-}" == ratios ]]; then
  shift
  exec python3 scripts/bench_ratios.py --extended "$@"
fi
if [[ "${1:-}" == http || "${1:-}" == overload || "${1:-}" == tenants ]]; then
  MODE=$1
  shift
fi
DEFAULT_OUT_DIR=/tmp/fwbench-results
if [[ $MODE == http ]]; then DEFAULT_OUT_DIR=/tmp/fwbench-http-results; fi
if [[ $MODE == overload ]]; then DEFAULT_OUT_DIR=/tmp/fwbench-overload-results; fi
if [[ $MODE == tenants ]]; then DEFAULT_OUT_DIR=/tmp/fwbench-tenants-results; fi
TENANT_LIGHT=${TENANT_LIGHT:-4}
TENANT_STORM=${TENANT_STORM:-16,128}
OVERLOAD_LEVELS=${OVERLOAD_LEVELS:-16,32,128}
OVERLOAD_SERVER_FLAGS=${OVERLOAD_SERVER_FLAGS:-"--max-active-streams 16 --max-queued-requests 16"}
OUT_DIR=${1:-$DEFAULT_OUT_DIR}
if [[ $# -gt 0 ]]; then shift; fi
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-2}
DURATION=${DURATION:-10s}
WARMUP=${WARMUP:-2s}
CONCURRENCY=${CONCURRENCY:-1,8,32,128}
CONTEXT_CONCURRENCY=${CONTEXT_CONCURRENCY:-1,8}
CONTEXTS=${CONTEXTS:-100,4000}
HTTP_CONCURRENCY=${HTTP_CONCURRENCY:-64}
ROUNDS=${ROUNDS:-3}
OVERHEAD_CONCURRENCY=${OVERHEAD_CONCURRENCY:-1,64}
mkdir -p "$OUT_DIR"

# Build (a no-op when up to date).
if [[ ! -f "$BUILD_DIR/build.ninja" && ! -f "$BUILD_DIR/Makefile" ]]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
if [[ -n "${FWSERVE:-}" ]]; then
  cmake --build "$BUILD_DIR" --target fwbench --parallel "$JOBS" >&2
else
  cmake --build "$BUILD_DIR" --target fwserve fwbench --parallel "$JOBS" >&2
  FWSERVE="$BUILD_DIR/server/fwserve"
fi
FWBENCH="$BUILD_DIR/bench/fwbench"

port_is_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
free_port() {
  local port
  for _ in $(seq 1 200); do
    port=$((20000 + RANDOM % 40000))
    if port_is_free "$port"; then
      echo "$port"
      return 0
    fi
  done
  echo "no free port found" >&2
  return 1
}

PORT=$(free_port)
server_args=(--listen "127.0.0.1:$PORT" --log-level warning)
bench_extra=()
if [[ "${METRICS:-0}" == 1 ]]; then
  METRICS_PORT=$(free_port)
  while [[ "$METRICS_PORT" == "$PORT" ]]; do METRICS_PORT=$(free_port); done
  server_args+=(--metrics-listen "127.0.0.1:$METRICS_PORT")
  bench_extra+=(--metrics-target "127.0.0.1:$METRICS_PORT")
else
  server_args+=(--metrics-listen "")
fi
if [[ $MODE == http ]]; then
  HTTP_PORT=$(free_port)
  while [[ "$HTTP_PORT" == "$PORT" || "$HTTP_PORT" == "${METRICS_PORT:-}" ]]; do
    HTTP_PORT=$(free_port)
  done
  server_args+=(--http-listen "127.0.0.1:$HTTP_PORT")
  bench_extra+=(--http-target "127.0.0.1:$HTTP_PORT")
fi
if [[ -n "${MODEL:-}" ]]; then server_args+=(--model "$MODEL"); fi
# shellcheck disable=SC2206  # SERVER_FLAGS is split on purpose
if [[ -n "${SERVER_FLAGS:-}" ]]; then server_args+=($SERVER_FLAGS); fi
# shellcheck disable=SC2206  # split on purpose
if [[ $MODE == overload || $MODE == tenants ]]; then server_args+=($OVERLOAD_SERVER_FLAGS); fi
if [[ $MODE == tenants ]]; then
  # Two tenants, each key in a file of its own (fwbench --api-key-file).
  for tenant in storm light; do
    head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$OUT_DIR/$tenant.key"
    printf 'sha256:%s tenant=%s\n' "$(tr -d '\n' <"$OUT_DIR/$tenant.key" | sha256sum | cut -c1-64)" \
      "$tenant"
  done >"$OUT_DIR/api-keys"
  server_args+=(--api-keys-file "$OUT_DIR/api-keys")
fi

if [[ "${BASELINE:-0}" == 1 ]]; then
  # Same checkpoint as the server: MODEL, else fwserve's default (the shipped aft-shakespeare).
  BASELINE_MODEL=${MODEL:-models/pretrained/aft-shakespeare}
  echo "== PyTorch eager baseline: $BASELINE_MODEL" >&2
  "${PYTHON:-python3}" bench/pytorch_baseline.py "$BASELINE_MODEL" \
    --modes batch1,sequential16,batch64 --tokens 128 --threads "$(nproc)" |
    tee "$OUT_DIR/pytorch_baseline.jsonl"
fi

SERVER_LOG="$OUT_DIR/fwserve.log"
"$FWSERVE" "${server_args[@]}" >"$SERVER_LOG" 2>&1 &
SERVER_PID=$!
stop_server() {
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"
    wait "$SERVER_PID" || true
  fi
}
trap stop_server EXIT

# Wait until the server listens (it loads the model first); fwbench then waits for the
# health check to report SERVING.
for i in $(seq 1 600); do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "fwserve exited during startup; its log:" >&2
    cat "$SERVER_LOG" >&2
    exit 1
  fi
  if ! port_is_free "$PORT" && { [[ $MODE != http ]] || ! port_is_free "$HTTP_PORT"; }; then
    break
  fi
  if [[ $i == 600 ]]; then
    echo "fwserve did not listen on port $PORT within 60 s" >&2
    exit 1
  fi
  sleep 0.1
done

LABEL=${LABEL:-"tree $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo "+local changes"); server $FWSERVE"}
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "label: $LABEL"
  echo "nproc: $(nproc)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
  echo "uptime before: $(uptime)"
  echo "server: $FWSERVE ${server_args[*]}"
} >"$OUT_DIR/machine.txt"

common=(--target "127.0.0.1:$PORT" --duration "$DURATION" --warmup "$WARMUP"
        --server-pid "$SERVER_PID" --label "$LABEL" "${bench_extra[@]}")

if [[ $MODE == tenants ]]; then
  storm_seconds=$(( ${DURATION%s} + ${WARMUP%s} + 4 ))
  for round in $(seq 1 "$ROUNDS"); do
    echo "== (f) tenants round $round: light alone at $TENANT_LIGHT streams" >&2
    "$FWBENCH" "${common[@]}" --api-key-file "$OUT_DIR/light.key" --concurrency "$TENANT_LIGHT" \
      --json "$OUT_DIR/tenants-$round-alone.json" "$@" | tee "$OUT_DIR/tenants-$round-alone.txt"
    for storm in ${TENANT_STORM//,/ }; do
      echo "== (f) tenants round $round: storm at $storm streams, light beside it" >&2
      "$FWBENCH" --target "127.0.0.1:$PORT" --duration "${storm_seconds}s" --warmup 0s \
        --label "$LABEL" --client naive --api-key-file "$OUT_DIR/storm.key" \
        --concurrency "$storm" --seed 7 --json "$OUT_DIR/tenants-$round-storm$storm.json" \
        "$@" >"$OUT_DIR/tenants-$round-storm$storm.txt" &
      storm_pid=$!
      sleep 2
      "$FWBENCH" "${common[@]}" --api-key-file "$OUT_DIR/light.key" \
        --concurrency "$TENANT_LIGHT" --json "$OUT_DIR/tenants-$round-beside$storm.json" "$@" |
        tee "$OUT_DIR/tenants-$round-beside$storm.txt"
      wait "$storm_pid"
    done
  done
elif [[ $MODE == overload ]]; then
  for round in $(seq 1 "$ROUNDS"); do
    for client in retrying naive; do
      echo "== (e) overload round $round, $client client: levels $OVERLOAD_LEVELS" >&2
      "$FWBENCH" "${common[@]}" --client "$client" --concurrency "$OVERLOAD_LEVELS" \
        --json "$OUT_DIR/overload-$round-$client.json" "$@" |
        tee "$OUT_DIR/overload-$round-$client.txt"
    done
  done
elif [[ $MODE == http ]]; then
  echo "== (c) HTTP/SSE vs gRPC streaming: $HTTP_CONCURRENCY streams, $ROUNDS rounds" >&2
  "$FWBENCH" "${common[@]}" --protocol grpc,http --concurrency "$HTTP_CONCURRENCY" \
    --repeat "$ROUNDS" --json "$OUT_DIR/http-vs-grpc.json" "$@" | tee "$OUT_DIR/http-vs-grpc.txt"

  echo "== (d) per-request overhead: max_tokens 1 at concurrency $OVERHEAD_CONCURRENCY" >&2
  "$FWBENCH" "${common[@]}" --protocol grpc,http --concurrency "$OVERHEAD_CONCURRENCY" \
    --max-tokens 1 --prompt-bytes 1 --repeat "$ROUNDS" --json "$OUT_DIR/overhead.json" "$@" |
    tee "$OUT_DIR/overhead.txt"
else
  echo "== (a) concurrency sweep: $CONCURRENCY" >&2
  "$FWBENCH" "${common[@]}" --concurrency "$CONCURRENCY" --json "$OUT_DIR/concurrency.json" "$@" |
    tee "$OUT_DIR/concurrency.txt"

  echo "== (b) context comparison: contexts $CONTEXTS at concurrency $CONTEXT_CONCURRENCY" >&2
  "$FWBENCH" "${common[@]}" --concurrency "$CONTEXT_CONCURRENCY" --context-tokens "$CONTEXTS" \
    --json "$OUT_DIR/context.json" "$@" | tee "$OUT_DIR/context.txt"
fi

echo "uptime after: $(uptime)" >>"$OUT_DIR/machine.txt"
stop_server
trap - EXIT
echo "results in $OUT_DIR (server log: $SERVER_LOG)" >&2

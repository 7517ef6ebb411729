#!/usr/bin/env bash
# Where the CUDA decode step's time goes (issue 50; docs/gpu.md "Profiles"): writes
# RWKV-7 0.1B (random weights, the G1 shape, check.py's REAL_SHAPES) and profiles its step
# at PROFILE_BATCHES (default 1 64 512) and the shipped aft model's at 1 and 64, eagerly
# and as the server's captured in-place step, with gpu_step_profile; then sums the
# traces (scripts/gpu/profile_summary.py) into OUT_DIR/profile.txt.
#   scripts/gpu/profile.sh OUT_DIR        (after scripts/gpu/build.sh)
# Environment: BUILD_DIR (default build-gpu), PROFILE_STORAGE (F32; BF16 as G1 ships),
# and gpu_step_profile's GPU_PROFILE_PREFILL (1024 tokens; 0 skips),
# GPU_PROFILE_PREFILL_CHUNK (256) and GPU_PROFILE_MATRICES (float32; bf16).
set -uo pipefail
out=${1:?usage: scripts/gpu/profile.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/../.."
build=${BUILD_DIR:-build-gpu}
tmp=$(mktemp -d)
python3 - "$tmp/rwkv7.json" <<'PY'
import json, sys
sys.path.insert(0, "scripts/gpu")
import check
json.dump(check.REAL_SHAPES["rwkv7-0.1b"], open(sys.argv[1], "w"))
PY
"$build/tools/fwmodel" init "$tmp/rwkv7" --config "$tmp/rwkv7.json" --seed 1 \
  --storage_dtype "${PROFILE_STORAGE:-F32}" >/dev/null
{
  echo "# RWKV-7 0.1B shape (${PROFILE_STORAGE:-F32} file)"
  "$build/bench/gpu_step_profile" "$tmp/rwkv7" "$tmp" ${PROFILE_BATCHES:-1 64 512}
  for b in ${PROFILE_BATCHES:-1 64 512}; do
    python3 scripts/gpu/profile_summary.py "$tmp/trace-eager-$b.json" "$tmp/trace-graph-$b.json"
  done
  [[ -f "$tmp/trace-prefill.json" ]] && python3 scripts/gpu/profile_summary.py "$tmp/trace-prefill.json"
  rm -f "$tmp/trace-prefill.json"
  mkdir -p "$tmp/aft"
  echo "# aft-shakespeare"
  "$build/bench/gpu_step_profile" models/pretrained/aft-shakespeare "$tmp/aft" 1 64
  python3 scripts/gpu/profile_summary.py "$tmp"/aft/trace-eager-{1,64}.json "$tmp"/aft/trace-graph-{1,64}.json
  [[ -f "$tmp/aft/trace-prefill.json" ]] && python3 scripts/gpu/profile_summary.py "$tmp/aft/trace-prefill.json"
} 2>&1 | tee "$out/profile.txt"
rm -rf "$tmp"

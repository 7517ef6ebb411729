#!/usr/bin/env bash
# A GPU session's kernel check (issue 50; docs/gpu.md "Running it"), shorter than
# device-run.sh: what a change to the fused kernels needs to know first. Through the
# device tool as
#   run(carry=[".gpu-kit"], timeout_s=600, command="scripts/gpu/kernel-run.sh $OUT")
# Steps, each under its own time limit, every result in OUT_DIR:
#   1. scripts/gpu/build.sh                                             build.log
#   2. the kernels against their CPU mirrors without LibTorch (scripts/gpu/*_check.cu,
#      nvcc alone; they also time the launches)                         kernels.log
#   3. fwserve_model_tests: the CUDA equivalence cases, the GPU sampler's, the graphed
#      step's; then compute-sanitizer memcheck on one in-place graph case  model-tests-cuda.log
#   4. scripts/gpu/profile.sh: Kineto tables of the RWKV-7 0.1B and aft steps  profile.txt
#   5. check.py's real-shape section for RWKV-7 0.1B (bf16 file; 1/64/512 streams, a
#      1,024-token prefill, the eager PyTorch baseline)                 real-shape.json
#   6. bench/structured_cost.py on the CUDA server: the shipped aft model and an RWKV-7
#      0.1B with the world vocabulary                                   structured.log
# Environment: KERNEL_RUN_STEPS (default "1 2 3 4 5 6": the steps, in the order given),
# KERNEL_RUN_CHECKS (step 2's "check:kernel" pairs, space-separated; default all three),
# KERNEL_RUN_SANITIZER (1; 0 leaves compute-sanitizer out of step 3), KERNEL_RUN_VOCAB
# (the world vocabulary file for step 6; default tests/data/rwkv/rwkv_vocab_v20230424.txt),
# and check.py's CHECK_REAL_SHAPE_* for step 5.
set -uo pipefail
if [[ $# -ne 1 ]]; then
  sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
fi
out=$1
mkdir -p "$out"
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
start=$(date +%s)
steps=" ${KERNEL_RUN_STEPS:-1 2 3 4 5 6} "
build=build-gpu
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
say() { echo "kernel-run [$(($(date +%s) - start)) s] $*"; }
status=0

step_1() {
  scripts/gpu/build.sh >"$out/build.log" 2>&1 || { tail -60 "$out/build.log"; exit 1; }
  say "built"
}

step_2() {
  {
    for pair in ${KERNEL_RUN_CHECKS:-rwkv7_wkv_check:rwkv7_wkv delta_rule_check:delta_rule_cuda gemv_check:gemv}; do
      check=${pair%%:*} kernel=${pair##*:}
      [[ -f scripts/gpu/$check.cu ]] || continue
      echo "== $check"
      if "$nvcc" -std=c++17 -O3 -arch=native -I . "scripts/gpu/$check.cu" "models/gpu/$kernel.cu" \
          -o "/tmp/$check" && timeout 120 "/tmp/$check"; then
        echo "== $check: ok"
      else
        echo "== $check: FAILED"
        status=1
      fi
    done
  } >"$out/kernels.log" 2>&1
  say "kernel checks: $(grep -c ': ok' "$out/kernels.log") ok, $(grep -c FAILED "$out/kernels.log") failed"
}

step_3() {
  OMP_NUM_THREADS=1 timeout 240 "$build/tests/fwserve_model_tests" \
    --gtest_filter='*CudaEquivalence*:*GpuSample*:*GraphedStep*:*GpuBodies*:*GpuGemv*:*GpuRowCopy*' \
    >"$out/model-tests-cuda.log" 2>&1 || status=1
  say "model tests: $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/model-tests-cuda.log" | tr '\n' ' ')"
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  if [[ -x "$sanitizer" && "${KERNEL_RUN_SANITIZER:-1}" != 0 ]]; then
    timeout 100 "$sanitizer" --tool memcheck --error-exitcode 3 "$build/tests/fwserve_model_tests" \
      --gtest_filter='*CudaEquivalence*InPlaceGraphStepWithSampling*:*GpuSampleCuda*' \
      >"$out/compute-sanitizer.log" 2>&1
    say "compute-sanitizer exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$out/compute-sanitizer.log") clean summaries)"
  fi
}

step_4() {
  PROFILE_BATCHES="1 64 512" timeout 150 scripts/gpu/profile.sh "$out" >/dev/null 2>&1
  say "profile: $(grep -c '^batch' "$out/profile.txt" 2>/dev/null) timed batches"
}

step_5() {
  CHECK_REAL_SHAPES=rwkv7-0.1b timeout 240 python3 - "$out" "$build" <<'PY'
import json, os, secrets, sys
sys.path.insert(0, "scripts/gpu")
import check
out, build = sys.argv[1], os.path.abspath(sys.argv[2])
work = os.path.join(out, "real-shape")
os.makedirs(os.path.join(work, "tmp"), exist_ok=True)
with open(os.path.join(work, "tmp", "session.key"), "w") as f:
    f.write(secrets.token_hex(32) + "\n")
rep = check.Report(work)
check.real_shape(rep, build, "cuda")
json.dump({"real_shape": rep.data.get("real_shape"), "checks": rep.data["checks"]},
          open(os.path.join(out, "real-shape.json"), "w"), indent=1)
PY
  say "real shape: $(python3 -c "import json,sys; d=json.load(open('$out/real-shape.json')); print('; '.join(c['status']+' '+c['name'] for c in d['checks']))" 2>/dev/null)"
  rm -rf "$out/real-shape"
}

step_6() {
  {
    echo "== aft-shakespeare"
    timeout 150 python3 bench/structured_cost.py "$build/server/fwserve" \
      models/pretrained/aft-shakespeare --server-flag=--device=cuda
    vocab=${KERNEL_RUN_VOCAB:-tests/data/rwkv/rwkv_vocab_v20230424.txt}
    if [[ -f "$vocab" ]]; then
      world=/tmp/rwkv7-world
      mkdir -p "$world"
      python3 - "$world" <<'PY'
import json, sys
sys.path.insert(0, "scripts/gpu")
import check
config = dict(check.REAL_SHAPES["rwkv7-0.1b"], tokenizer="rwkv_world")
json.dump(config, open(sys.argv[1] + ".json", "w"))
PY
      cp "$vocab" "$world/rwkv_vocab_v20230424.txt" && "$build/tools/fwmodel" init "$world" --config "$world.json" \
        --seed 1 --storage_dtype BF16 >/dev/null && {
        echo "== RWKV-7 0.1B shape, world vocabulary"
        timeout 200 python3 bench/structured_cost.py "$build/server/fwserve" "$world" \
          --server-flag=--device=cuda --requests 6
      }
    fi
  } >"$out/structured.log" 2>&1
  say "structured: $(grep -ciE 'median' "$out/structured.log") medians"
}
for step in $steps; do
  "step_$step"
done
say "done (exit $status)"
exit $status

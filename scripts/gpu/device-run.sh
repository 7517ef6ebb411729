#!/usr/bin/env bash
# One GPU session's whole device call (docs/gpu.md "Running it"): scripts/gpu/build.sh,
# then scripts/gpu/check.sh shortened to fit the session's 15 minutes of device time,
# then the report and the logs worth reading copied into OUT_DIR (the device tool
# brings back at most 8 files). Run through the device tool as
#   run(carry=[".gpu-kit"], timeout_s=600, command="scripts/gpu/device-run.sh $OUT")
# Environment: the CHECK_* knobs of scripts/gpu/check.py; defaults below.
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
scripts/gpu/build.sh >"$out/build.log" 2>&1
build_status=$?
echo "device-run: build.sh exit $build_status in $(($(date +%s) - start)) s"
if [[ $build_status -ne 0 ]]; then
  tail -60 "$out/build.log"
  exit "$build_status"
fi
report=/tmp/gpu-report
rm -rf "$report"
export CHECK_MODEL_TESTS=${CHECK_MODEL_TESTS:-cuda}
export CHECK_STREAMS=${CHECK_STREAMS:-1,64,1024,4096}
export CHECK_DURATION=${CHECK_DURATION:-3s}
export CHECK_KERNEL_STREAMS=${CHECK_KERNEL_STREAMS:-1,64}
export CHECK_KERNEL_DURATION=${CHECK_KERNEL_DURATION:-2s}
export CHECK_PREFILL_RUNS=${CHECK_PREFILL_RUNS:-1}
export CHECK_SANITIZER_TIMEOUT=${CHECK_SANITIZER_TIMEOUT:-150}
# The next GPU run's A/B (issues 39, 48): the default on CUDA (multi-step decode, K = 4)
# against one token per launch, in every round (overlapped steps lost on the H200 and
# were removed).
export CHECK_AB_ARMS=${CHECK_AB_ARMS-single=--decode-steps-per-launch=1}
# What is left of the call's limit (DEVICE_RUN_SECONDS, 580 s), less time to copy.
left=$(( ${DEVICE_RUN_SECONDS:-580} - ($(date +%s) - start) - 10 ))
timeout --kill-after=5 "$left" scripts/gpu/check.sh "$report"
check_status=$?
echo "device-run: check.sh exit $check_status, $(($(date +%s) - start)) s in all"
for f in report.md report.json report-partial.json model-tests-cuda.log compute-sanitizer.log \
         fwserve-device-cuda.log "fwserve-${CHECK_AB_LABEL:-apart}-cuda.log" \
         fwserve-single-cuda.log; do
  [[ -f "$report/$f" ]] && cp "$report/$f" "$out/"
done
exit "$check_status"

#!/usr/bin/env bash
# The README's test command: installs the Debian packages, builds, and runs the whole
# ctest suite. .ci/run runs exactly this. Then lists the tests that skipped themselves
# (exit 77 where a tool, an engine or a device is missing) as "skipped: N tests: ...".
# Under CI (CI=true) a skipped test fails the run: what README.md says is checked must
# run there. FWSERVE_NO_SKIPS=1 asks the same anywhere; FWSERVE_NO_SKIPS=0 lists only.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
start=$(date +%s)
scripts/build.sh
built=$(date +%s)
# A build directory configured without tests (or with most of them missing) must not
# pass: ctest fails when it finds none, and the count must reach the suite's size.
MIN_TESTS=590
found=$(ctest --test-dir build -N | sed -n 's/^Total Tests: \([0-9]*\)$/\1/p')
if [[ -z "$found" || "$found" -lt "$MIN_TESTS" ]]; then
  echo "scripts/test.sh: ctest lists ${found:-no} tests, fewer than the suite's $MIN_TESTS" >&2
  exit 1
fi
junit="$PWD/build/ctest-junit.xml"
rm -f "$junit"
status=0
ctest --test-dir build --output-on-failure --parallel "$(nproc)" --timeout 600 --no-tests=error \
  --output-junit "$junit" || status=$?
done_at=$(date +%s)
echo "build: $((built - start)) s, tests: $((done_at - built)) s"
# The skipped tests (SKIP_RETURN_CODE or SKIP_REGULAR_EXPRESSION) from ctest's JUnit
# report: a <testcase> with a <skipped> element (DISABLED tests have none), one per
# line as "NAME: REASON" (the test's first output line that mentions a skip).
report=0
skipped=$(python3 - "$junit" <<'PY'
import sys
import xml.etree.ElementTree as ET
try:
    cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
except (OSError, ET.ParseError) as error:
    print("no JUnit report from ctest (%s)" % error)
    sys.exit(3)
for case in cases:
    skipped = case.find("skipped")
    if skipped is None:
        continue
    lines = [line.strip() for line in (case.findtext("system-out") or "").splitlines()]
    reason = next((line for line in lines if "skip" in line.lower()), "") or next(
        (line for line in reversed(lines) if line), skipped.get("message", ""))
    print("%s: %s" % (case.get("name"), reason[:160]))
PY
) || report=$?
if [[ "$report" -ne 0 ]]; then
  count=unknown
  echo "skipped: unknown: $skipped"
elif [[ -n "$skipped" ]]; then
  mapfile -t lines <<<"$skipped"
  count=${#lines[@]}
  names=$(cut -d: -f1 <<<"$skipped" | paste -sd,)
  echo "skipped: $count tests: ${names//,/, }"
  printf '  %s\n' "${lines[@]}"
else
  count=0
  echo "skipped: 0 tests"
fi
if [[ "$status" -ne 0 ]]; then
  exit "$status"
fi
no_skips=${FWSERVE_NO_SKIPS:-}
if [[ -z "$no_skips" && "${CI:-}" == "true" ]]; then
  no_skips=1
fi
if [[ "$count" != 0 && "$no_skips" == "1" ]]; then
  echo "scripts/test.sh: tests were skipped ($count), and skips fail this run" \
    "(CI=${CI:-unset}, FWSERVE_NO_SKIPS=${FWSERVE_NO_SKIPS:-unset})" >&2
  exit 1
fi

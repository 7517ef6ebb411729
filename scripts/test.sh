#!/usr/bin/env bash
# The README's test command: installs the Debian packages, builds, and runs the whole
# ctest suite. .ci/run runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
start=$(date +%s)
scripts/build.sh
built=$(date +%s)
# A build directory configured without tests (or with most of them missing) must not
# pass: ctest fails when it finds none, and the count must reach the suite's size.
MIN_TESTS=480
found=$(ctest --test-dir build -N | sed -n 's/^Total Tests: \([0-9]*\)$/\1/p')
if [[ -z "$found" || "$found" -lt "$MIN_TESTS" ]]; then
  echo "scripts/test.sh: ctest lists ${found:-no} tests, fewer than the suite's $MIN_TESTS" >&2
  exit 1
fi
ctest --test-dir build --output-on-failure --parallel "$(nproc)" --timeout 600 --no-tests=error
done_at=$(date +%s)
echo "build: $((built - start)) s, tests: $((done_at - built)) s"

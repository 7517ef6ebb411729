#!/usr/bin/env bash
# The README's test command: installs the Debian packages, builds, and runs the whole
# ctest suite. .ci/run runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
start=$(date +%s)
scripts/build.sh
built=$(date +%s)
ctest --test-dir build --output-on-failure --parallel "$(nproc)" --timeout 600
done_at=$(date +%s)
echo "build: $((built - start)) s, tests: $((done_at - built)) s"

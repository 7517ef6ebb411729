#!/usr/bin/env bash
# Configures and builds everything (Release, Ninja, ccache when present) into ./build:
# fwserve, the tools, the tests and the benchmarks. The tests and benchmarks are turned
# on explicitly, since scripts/serve.sh may have configured ./build without them (the
# objects it built are reused).
# Usage: scripts/build.sh [extra cmake -D options...]
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DFWSERVE_BUILD_TESTS=ON -DFWSERVE_BUILD_BENCH=ON "$@" >/dev/null
cmake --build build --parallel "$(nproc)"

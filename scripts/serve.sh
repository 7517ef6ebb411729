#!/usr/bin/env bash
# The README's serve command: installs the Debian packages that building fwserve needs
# (scripts/install-deps.sh --build; not the test tools), builds only fwserve and fwctl,
# and starts the fwserve gRPC server with the shipped default model
# (models/pretrained/aft-shakespeare) on 127.0.0.1:50051, the OpenAI-compatible HTTP
# API on http://127.0.0.1:8000 (docs/http.md), metrics on http://127.0.0.1:9464/metrics.
#
# The build directory is ./build, the one scripts/test.sh builds in full: when serve.sh
# configures it first, it does so without the tests and benchmarks (whose packages
# --build does not install), and scripts/build.sh later turns them on and reuses every
# object built here. An already configured ./build is only built (the two targets).
#
# Sessions are durable by default: they are written through to a dir: session store
# under the state directory, $FWSERVE_STATE_DIR, else $XDG_STATE_HOME/fwserve, else
# ./var (so ./var/sessions), and survive a restart or a crash. Pass
# --session-store=memory to keep them in memory only, or --session-store=dir:PATH for
# another place. Other arguments go to fwserve (see `build/server/fwserve --help`).
# Stop it with Ctrl-C (SIGINT) or SIGTERM: in-flight streams drain.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh --build
if [[ ! -f build/CMakeCache.txt ]]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DFWSERVE_BUILD_TESTS=OFF -DFWSERVE_BUILD_BENCH=OFF >/dev/null
fi
cmake --build build --parallel "$(nproc)" --target fwserve fwctl
store_args=()
if [[ " $* " != *" --session-store"* && " $* " != *" --session-dir"* ]]; then
  state_dir="${FWSERVE_STATE_DIR:-${XDG_STATE_HOME:+$XDG_STATE_HOME/fwserve}}"
  state_dir="${state_dir:-$PWD/var}"
  store_args=(--session-store "dir:$state_dir/sessions")
  echo "serve.sh: sessions are stored in $state_dir/sessions (--session-store=dir:...)" >&2
fi
http_args=()
if [[ " $* " != *" --http-listen"* ]]; then
  http_args=(--http-listen 127.0.0.1:8000)
fi
exec ./build/server/fwserve "${store_args[@]}" "${http_args[@]}" "$@"

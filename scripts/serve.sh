#!/usr/bin/env bash
# The README's serve command: installs the Debian packages, builds, and starts the
# fwserve gRPC server with the shipped default model (models/pretrained/aft-shakespeare)
# on 127.0.0.1:50051, metrics on http://127.0.0.1:9464/metrics. Extra arguments go to
# fwserve (see `build/server/fwserve --help`), e.g. --model DIR --session-dir DIR.
# Stop it with Ctrl-C (SIGINT) or SIGTERM: in-flight streams drain, sessions persist
# when --session-dir is set.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
exec ./build/server/fwserve "$@"

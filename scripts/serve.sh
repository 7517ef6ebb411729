#!/usr/bin/env bash
# The README's serve command: installs the Debian packages, builds, and runs the
# shipped default model. Until the gRPC server lands this streams a generation from
# the default checkpoint with `fwmodel generate`; extra arguments are passed through
# (e.g. --prompt "JULIET:" --max-tokens 800 --temperature 0.7).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
DEFAULT_MODEL=models/pretrained/aft-shakespeare
./build/tools/fwmodel info "$DEFAULT_MODEL" | tail -n 3 >&2
exec ./build/tools/fwmodel generate "$DEFAULT_MODEL" --prompt "ROMEO:" --max-tokens 600 "$@"

#!/usr/bin/env bash
# Installs every Debian 12 package that fwserve's build, tests and server need.
# Idempotent: packages already present are left alone. Uses sudo when not root.
set -euo pipefail

PACKAGES=(
  build-essential cmake python3 ninja-build ccache pkg-config git clang-format
  libtorch-dev libopenblas0-openmp
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libssl-dev
  prometheus python3-grpcio python3-protobuf curl
  redis-server haproxy libhiredis-dev
)

SUDO=""
if [[ "$(id -u)" -ne 0 ]]; then SUDO="sudo"; fi

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"

#!/usr/bin/env bash
# Installs every Debian 12 package that fwserve's build, tests and server need.
# Idempotent: packages already present are left alone. Uses sudo when not root.
# Usage: scripts/install-deps.sh           everything (build, tests, tools)
#        scripts/install-deps.sh --build   only what building fwserve and fwctl needs
#                                          (scripts/serve.sh; the image's build stage,
#                                          deploy/docker/)
#        scripts/install-deps.sh --bench   everything, plus python3-torch for the PyTorch
#                                          eager baseline (bench/pytorch_baseline.py,
#                                          BASELINE=1 scripts/bench-serving.sh); the tests
#                                          never need it
set -euo pipefail

# Building fwserve and fwctl (cmake -DFWSERVE_BUILD_TESTS=OFF -DFWSERVE_BUILD_BENCH=OFF).
# libsentencepiece-dev: its header at build time; fwserve dlopens its libsentencepiece0
# at run time (models/tokenizers/sentencepiece_tokenizer.h).
BUILD_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev libopenblas0-openmp libblas-dev libxsmm-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev
  nlohmann-json3-dev libssl-dev libhiredis-dev libcli11-dev libboost-dev
  libsentencepiece-dev
)
# The tests, benchmarks and tools on top of that. The container engine (Podman with
# runc, a local debian:12 base made by mmdebstrap, DNS on compose networks by the
# dnsname plugin), podman-compose and yamllint are for the container and Kubernetes
# tests (tests/deploy/, deploy/README.md); kubectl is added below.
PACKAGES=(
  "${BUILD_PACKAGES[@]}"
  python3 git clang-format
  clang libclang-rt-14-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  prometheus python3-grpcio python3-protobuf curl nodejs
  chromium chromium-driver python3-selenium
  redis-server haproxy
  podman runc mmdebstrap golang-github-containernetworking-plugin-dnsname
  podman-compose yamllint
)
# Only with --bench: the PyTorch eager baseline (bench/pytorch_baseline.py).
BENCH_PACKAGES=(python3-torch)
if [[ "${1:-}" == "--build" ]]; then
  PACKAGES=("${BUILD_PACKAGES[@]}")
elif [[ "${1:-}" == "--bench" ]]; then
  PACKAGES+=("${BENCH_PACKAGES[@]}")
elif [[ $# -gt 0 ]]; then
  echo "usage: $0 [--build | --bench]" >&2
  exit 2
fi
# kubectl renders deploy/k8s for the Kubernetes check (tests/deploy/k8s_check.py):
# Debian's kubernetes-client (kubectl 1.20 with kustomize v2.0.3) unless a kubectl is
# already on PATH (other kubectl packages, e.g. Kubernetes' own "kubectl", also ship
# /usr/bin/kubectl; kubectl 1.20 and 1.32 render the same objects, deploy/README.md).
if [[ "${1:-}" != "--build" ]] && ! command -v kubectl >/dev/null; then
  PACKAGES+=(kubernetes-client)
fi

SUDO=""
if [[ "$(id -u)" -ne 0 ]]; then SUDO="sudo"; fi
ARGS=("$@")
need_sudo() {
  if [[ -n "$SUDO" ]] && ! command -v sudo >/dev/null; then
    echo "install-deps: installing Debian packages needs root, and sudo is not installed:" \
      "run \`su -c '$0 ${ARGS[*]}'\` once, then this command again" >&2
    exit 1
  fi
}

# The npm clients of tests/openai_client (the official openai package, the Vercel AI SDK,
# LangChain JS), at the versions its committed package-lock.json pins (npm ci; nothing is
# fetched when every package the lockfile lists is installed at its version). Debian's
# nodejs; npm from Debian's npm package unless the nodejs build ships one.
install_openai_client() {
  [[ "${1:-}" == "--build" ]] && return 0
  if ! command -v npm >/dev/null; then
    need_sudo
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends npm
  fi
  local dir stale
  dir="$(cd "$(dirname "$0")/../tests/openai_client" && pwd)"
  # The lockfile's packages that are missing or at another version.
  stale=$(node -e "
    const fs = require('fs');
    const lock = require('$dir/package-lock.json');
    const out = [];
    for (const [path, entry] of Object.entries(lock.packages)) {
      if (!path) continue;
      let have = '';
      try { have = JSON.parse(fs.readFileSync('$dir/' + path + '/package.json')).version; } catch (e) {}
      if (have !== entry.version) out.push(path.replace(/^.*node_modules\//, '') + '@' + entry.version);
    }
    console.log(out.join(' '));")
  if [[ -n "$stale" ]]; then
    echo "install-deps: npm ci in tests/openai_client (${stale:0:200})"
    (cd "$dir" && npm ci --no-audit --no-fund)
  fi
}

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#PACKAGES[@]} packages already installed"
  install_openai_client "$@"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
need_sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
install_openai_client "$@"

#!/usr/bin/env bash
# The kit's proof on this machine (issue 26, docs/gpu.md): in a clean debian:12
# container with none of fwserve's -dev packages, scripts/gpu/build.sh builds from the
# kit, offline, against Debian's CPU LibTorch standing in for the GPU machine's
# PyTorch; then the model unit tests and scripts/gpu/check.sh's CPU path run.
#
# Usage: scripts/gpu/prove-in-container.sh [--keep] [OUT_DIR]   (default OUT_DIR:
#        runs/gpu-proof; the container's logs and check.sh's report land there)
#   --keep   keep the export folder of an earlier run (its build-gpu/ and the unpacked
#            kit) and copy the tree over it: only what changed is rebuilt
#
# Two containers, through deploy/docker/engine.sh (Podman here, with the deploy tests'
# local debian:12 made by mmdebstrap when no registry answers, as build-image.sh does):
#   1. base, with the network: what the GPU machine has that Debian also has —
#      build-essential, cmake, ninja-build, python3 — and a CPU LibTorch: libtorch1.13
#      and libtorch-dev's files unpacked without its dependency on libprotobuf-dev (so
#      that protobuf comes from the kit, as it must there), the gflags/glog headers
#      Debian's TorchConfig asks for, and python3-torch for bench/pytorch_baseline.py.
#      Kept as localhost/fwserve-gpu-proof-base (FWSERVE_GPU_PROOF_REBUILD=1 remakes it).
#   2. proof, with --network none: the tree (tracked and untracked files, as
#      build-image.sh exports them) and .gpu-kit's carried files copied in; build.sh,
#      then check.sh, which runs the model tests (the CUDA cases, which skip here, and
#      the rest through ctest) and its CPU path. Runs under `nice -n 10`, JOBS=2.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
engine_sh="$repo/deploy/docker/engine.sh"
keep=0
if [[ "${1:-}" == --keep ]]; then keep=1; shift; fi
out="$(mkdir -p "${1:-$repo/runs/gpu-proof}" && cd "${1:-$repo/runs/gpu-proof}" && pwd)"
base_image=docker.io/library/debian:12
proof_image=localhost/fwserve-gpu-proof-base:latest
export_dir="${FWSERVE_GPU_PROOF_DIR:-${TMPDIR:-/tmp}/fwserve-gpu-proof}"
say() { echo "prove-in-container.sh: $*" | tee -a "$out/proof.log"; }
: > "$out/proof.log"

"$engine_sh" --which >/dev/null || exit 3
[[ -f "$repo/.gpu-kit/SHA256SUMS" ]] || { echo "no .gpu-kit: run scripts/gpu/kit.sh" >&2; exit 1; }

# The local debian:12, as deploy/docker/build-image.sh makes it.
if ! "$engine_sh" image exists "$base_image"; then
  if ! timeout 120 "$engine_sh" pull -q "$base_image" >/dev/null 2>&1; then
    rootfs=$(mktemp --suffix=.tar "${TMPDIR:-/tmp}/fwserve-debian12-rootfs.XXXXXX")
    mmdebstrap --quiet --variant=minbase bookworm "$rootfs"
    "$engine_sh" import "$rootfs" "$base_image" >/dev/null
    rm -f "$rootfs"
  fi
fi

# 1. The base container: the GPU machine's kind of tools, and a CPU LibTorch.
if [[ "${FWSERVE_GPU_PROOF_REBUILD:-0}" == 1 ]] || ! "$engine_sh" image exists "$proof_image"; then
  t0=$(date +%s)
  "$engine_sh" rm -f fwserve-gpu-proof-base >/dev/null 2>&1 || true
  "$engine_sh" run --name fwserve-gpu-proof-base --network host "$base_image" bash -euc '
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends build-essential cmake ninja-build python3 \
      libtorch1.13 libgflags-dev libgoogle-glog-dev python3-torch >/dev/null
    cd /tmp && apt-get download -q libtorch-dev >/dev/null && dpkg-deb -x libtorch-dev_*.deb / \
      && rm libtorch-dev_*.deb
    apt-get clean && rm -rf /var/lib/apt/lists/*
  ' 2>&1 | tail -5 | tee -a "$out/proof.log"
  "$engine_sh" commit -q fwserve-gpu-proof-base "$proof_image" >/dev/null
  "$engine_sh" rm -f fwserve-gpu-proof-base >/dev/null
  say "base image $proof_image made in $(( $(date +%s) - t0 )) s"
fi
size=$("$engine_sh" image inspect --format '{{.Size}}' "$proof_image")
say "base image $proof_image: $((size / 1000000)) MB"

# 2. The proof: the tree and the kit, offline.
[[ $keep -eq 1 ]] || rm -rf "$export_dir"
mkdir -p "$export_dir/src"
git -C "$repo" ls-files -z --cached --others --exclude-standard --deduplicate \
  | (cd "$repo" && tar --null -T - --ignore-failed-read -cf - 2>/dev/null) \
  | tar -x -C "$export_dir/src"
(cd "$repo" && tar -cf - .gpu-kit/debs .gpu-kit/boost-headers.tar.xz .gpu-kit/SHA256SUMS \
   .gpu-kit/MANIFEST.tsv) | tar -x -C "$export_dir/src"
say "exported the tree and the kit to $export_dir/src ($(du -sh "$export_dir/src" | cut -f1))"
mkdir -p "$export_dir/out"
rm -rf "${export_dir:?}/out/"*

t0=$(date +%s)
set +e
"$engine_sh" run --rm --network none -v "$export_dir/src:/src" -v "$export_dir/out:/out" \
  -w /src -e JOBS=2 "$proof_image" bash -c '
    set -o pipefail
    echo "== packages: the kit'"'"'s -dev packages installed here (none expected), and its runtime ones"
    dpkg-query -W -f="\${Package} \${Status}\n" | awk "\$NF == \"installed\" {print \$1}" \
      | sort > /tmp/installed
    tail -n +2 .gpu-kit/MANIFEST.tsv | cut -f1 | sort > /tmp/kit
    dev=$(comm -12 /tmp/kit /tmp/installed | grep -- "-dev$" | tr "\n" " ")
    echo "-dev: ${dev:-(none)}"
    echo "runtime (Debian'"'"'s LibTorch depends on them): $(comm -12 /tmp/kit /tmp/installed \
      | grep -v -- "-dev$" | tr "\n" " ")"
    echo "== build.sh"
    s=$(date +%s)
    nice -n 10 scripts/gpu/build.sh || exit 10
    echo "build.sh took $(( $(date +%s) - s )) s"
    echo "== check.sh (its model tests: the CUDA cases, then the rest through ctest)"
    s=$(date +%s)
    nice -n 10 scripts/gpu/check.sh /out/report
    crc=$?
    echo "check.sh: exit $crc in $(( $(date +%s) - s )) s"
    exit $crc
  ' 2>&1 | tee "$out/container.log"
status=${PIPESTATUS[0]}
set -e
cp -r "$export_dir/out/." "$out/" 2>/dev/null || true
say "proof container: exit $status in $(( $(date +%s) - t0 )) s; logs and report in $out"
say "the build stays in $export_dir/src/build-gpu (rerun with --keep to reuse it)"
exit "$status"

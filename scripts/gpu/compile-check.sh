#!/usr/bin/env bash
# Compiles every models/gpu/*.cu with nvcc for sm_90 (the H100/H200), without linking:
# the CUDA kernels checked on a machine with nvcc but no CUDA LibTorch, where CMake does
# not build them (models/gpu/CMakeLists.txt). Prints each kernel's registers, shared and
# local memory (ptxas -v): a kernel whose per-thread row should live in registers shows
# 0 bytes of stack frame and spill stores. Not part of .ci/run (docs/gpu.md, "CUDA kernels").
#
# Usage: scripts/gpu/compile-check.sh [NVCC]   (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
nvcc="${1:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
if [[ ! -x "$nvcc" ]]; then
  echo "compile-check: no nvcc ($nvcc)" >&2
  exit 2
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
status=0
for cu in "$root"/models/gpu/*.cu; do
  name="$(basename "$cu" .cu)"
  echo "== $name.cu"
  if ! "$nvcc" -std=c++17 -arch=sm_90 -O3 -Werror all-warnings -Xptxas -v -I "$root" \
      -c "$cu" -o "$out/$name.o" 2>&1 | sed 's/^/  /'; then
    status=1
  fi
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
done
if [[ $status -eq 0 ]]; then echo "compile-check: ok"; else echo "compile-check: FAILED"; fi
exit $status

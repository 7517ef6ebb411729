#!/usr/bin/env bash
# Builds fwserve on a machine that has a compiler, CMake, ninja, Python and LibTorch but
# none of fwserve's other dependencies, from the kit that scripts/gpu/kit.sh made
# (.gpu-kit/, carried along; docs/gpu.md). Offline: it downloads nothing.
#
#   1. checks the kit's sha256 sums and unpacks every .deb (and Boost's headers) into
#      the private prefix .gpu-kit/root, never over /;
#   2. fixes what assumes /usr: pkg-config files (prefix, libdir), the BLAS
#      alternatives links, and wrappers for protoc, grpc_cpp_plugin and pkg-config that
#      find the kit's libraries;
#   3. configures CMake against the machine's LibTorch — PyTorch's
#      (`python3 -c 'import torch; print(torch.utils.cmake_prefix_path)'`) when python3
#      has torch with its CMake files, else a system LibTorch (Debian's libtorch-dev), or
#      TORCH_PREFIX=DIR — with the CUDA toolkit when nvcc is found;
#   4. builds fwserve, fwctl, fwmodel, fwbench, model_bench and the model unit tests
#      (fwserve_model_tests, fwserve_core_tests) into build-gpu/.
#
# Usage: scripts/gpu/build.sh [--configure-only]
# Environment: BUILD_DIR (default build-gpu), JOBS (default nproc), TORCH_PREFIX,
#              TORCH_CUDA_ARCH_LIST (default: the GPU's compute capability),
#              CUDA_GRAPHS (ON; OFF builds the CUDA decode step without CUDA Graph
#              capture, should models/kernels/graphed_step.cc not compile against this LibTorch).
# The executables carry the kit's library folders as RPATH (not RUNPATH), so they run
# without LD_LIBRARY_PATH; build-gpu/gpu-build.json records what was used.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
kit="$repo/.gpu-kit"
root="$kit/root"
build="${BUILD_DIR:-$repo/build-gpu}"
jobs="${JOBS:-$(nproc)}"
arch_triplet=x86_64-linux-gnu
lib="$root/usr/lib/$arch_triplet"
start=$(date +%s)
say() { echo "build.sh: $*"; }
die() { echo "build.sh: $*" >&2; exit 1; }

# --- 0. What this machine has --------------------------------------------------------
[[ -f "$kit/SHA256SUMS" ]] || die "no kit at $kit (make it with scripts/gpu/kit.sh, carry .gpu-kit)"
for tool in cmake ninja g++ python3 sha256sum tar; do
  command -v "$tool" >/dev/null || die "$tool is missing"
done
[[ "$(uname -m)" == x86_64 ]] || die "the kit is amd64; this machine is $(uname -m)"
# getconf prints one line ("glibc 2.36"): no early-closing `head` whose SIGPIPE, under
# pipefail, once appended "unknown" to the version and broke gpu-build.json.
glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
glibc=${glibc:-unknown}
say "machine: $(uname -m), glibc $glibc, $(g++ --version | head -1), cmake" \
  "$(cmake --version | head -1 | awk '{print $3}'), ninja $(ninja --version), $(python3 --version)"
if [[ "$glibc" != unknown ]] && [[ "$(printf '%s\n2.36\n' "$glibc" | sort -V | head -1)" != 2.36 ]]; then
  say "WARNING: glibc $glibc is older than Debian 12's 2.36; the kit's libraries may not load"
fi

# --- 1. Unpack -----------------------------------------------------------------------
(cd "$kit" && sha256sum -c --quiet SHA256SUMS) || die "the kit's sha256 sums do not match"
stamp=$(sha256sum "$kit/SHA256SUMS" | cut -d' ' -f1)
if [[ "$(cat "$root/.stamp" 2>/dev/null)" != "$stamp" ]]; then
  rm -rf "$root"
  mkdir -p "$root"
  for deb in "$kit"/debs/*.deb; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$deb" "$root"
    else  # a .deb is an ar archive holding data.tar.*
      tmp=$(mktemp -d)
      (cd "$tmp" && ar x "$deb" && tar -xf data.tar.* -C "$root")
      rm -rf "$tmp"
    fi
  done
  tar -xJf "$kit/boost-headers.tar.xz" -C "$root"

  # --- 2. Fix-ups: what assumes the packages are installed in /usr -------------------
  # pkg-config files: paths under /usr move under the prefix (hiredis.pc says
  # libdir=/usr/lib, but Debian puts the library in the multiarch folder).
  find "$root" -name '*.pc' -print0 | xargs -0 sed -i -E \
    -e "s#^libdir=/usr/lib\$#libdir=/usr/lib/$arch_triplet#" \
    -e "s#(=|-I|-L)/usr(/|\$)#\\1$root/usr\\2#g"
  # The links Debian's alternatives system would make: libblas and cblas.h.
  ln -sfn blas/libblas.so.3 "$lib/libblas.so.3"
  ln -sfn blas/libblas.so "$lib/libblas.so"
  ln -sfn cblas-netlib.h "$root/usr/include/$arch_triplet/cblas.h"
  # Programs of the kit run from wrappers that find the kit's libraries.
  mkdir -p "$root/wrap"
  for prog in protoc grpc_cpp_plugin pkg-config; do
    cat > "$root/wrap/$prog" <<EOF
#!/bin/sh
LD_LIBRARY_PATH="$lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$root/usr/bin/$prog" "\$@"
EOF
    chmod +x "$root/wrap/$prog"
  done
  dangling=$(find "$root" -xtype l | sed "s#^$root##")
  [[ -z "$dangling" ]] || say "links that point outside the kit (left as they are): $dangling"
  echo "$stamp" > "$root/.stamp"
  say "unpacked $(ls "$kit"/debs/*.deb | wc -l) packages into $root ($(du -sh "$root" | cut -f1))"
else
  say "kit already unpacked in $root"
fi
export PKG_CONFIG_LIBDIR="$lib/pkgconfig:$root/usr/share/pkgconfig"
"$root/wrap/protoc" --version >/dev/null || die "the kit's protoc does not run here"

# --- 3. LibTorch and CUDA ------------------------------------------------------------
torch_prefix="${TORCH_PREFIX:-}"
torch_from=TORCH_PREFIX
py_torch=$(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if [[ -z "$torch_prefix" && -n "$py_torch" ]]; then
  candidate=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  if [[ -f "$candidate/Torch/TorchConfig.cmake" ]]; then
    torch_prefix="$candidate"
    torch_from="python3's torch $py_torch"
  fi
fi
if [[ -z "$torch_prefix" ]]; then
  for candidate in /usr/lib/$arch_triplet/cmake /usr/share/cmake /usr/local/share/cmake; do
    if [[ -f "$candidate/Torch/TorchConfig.cmake" ]]; then
      torch_prefix="$candidate"
      torch_from="the system's LibTorch (libtorch-dev)"
      break
    fi
  done
fi
[[ -n "$torch_prefix" ]] || die "no LibTorch: neither python3's torch nor a system TorchConfig.cmake"
torch_abi=$(grep -ohE '_GLIBCXX_USE_CXX11_ABI=[01]' "$torch_prefix/Torch/TorchConfig.cmake" | head -1 || true)
py_abi=$(python3 -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))' 2>/dev/null || echo "n/a")
say "LibTorch: $torch_from, $torch_prefix; TorchConfig $torch_abi, python3 torch ABI $py_abi"
# Debian's libraries (the kit) are built with the C++11 ABI: a LibTorch without it would
# not link with them (std::string in every signature).
[[ "$torch_abi" != *=0 && "$py_abi" != 0 ]] \
  || die "this LibTorch uses _GLIBCXX_USE_CXX11_ABI=0; the kit's libraries need 1"
torch_include=$(dirname "$(dirname "$torch_prefix")")/include
if [[ -d "$torch_include/google/protobuf" ]]; then
  say "WARNING: $torch_include has its own protobuf headers; fwserve's generated code" \
    "must compile against the kit's protobuf 3.21"
fi

# Whether this LibTorch itself has CUDA: python3's torch.version.cuda, else whether
# libtorch_cuda.so lies beside its other libraries.
torch_cuda=$(python3 -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null || true)
if [[ -z "$torch_cuda" ]] && ls "$torch_prefix"/../../lib/libtorch_cuda.so >/dev/null 2>&1; then
  torch_cuda=yes
fi
say "LibTorch CUDA: ${torch_cuda:-none (a CPU LibTorch: the CUDA checks will skip)}"
cuda_args=()
nvcc=$(command -v nvcc || true)
[[ -n "$nvcc" || ! -x /usr/local/cuda/bin/nvcc ]] || nvcc=/usr/local/cuda/bin/nvcc
if [[ -n "$nvcc" ]]; then
  export PATH="$(dirname "$nvcc"):$PATH"
  if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]] && command -v nvidia-smi >/dev/null; then
    TORCH_CUDA_ARCH_LIST=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null \
      | head -1 | tr -d ' ' || true)
  fi
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
  cuda_args=(-DCUDAToolkit_ROOT="$(dirname "$(dirname "$(readlink -f "$nvcc")")")")
  say "CUDA: $("$nvcc" --version | grep -o 'release [0-9.]*'), TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
else
  say "CUDA: no nvcc (a CPU build)"
fi

# --- 4. Configure and build -----------------------------------------------------------
targets=(fwserve fwctl fwmodel fwbench model_bench gpu_step_profile fwserve_model_tests fwserve_core_tests)
configure_start=$(date +%s)
mkdir -p "$build"
cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$root/usr;$torch_prefix" \
  -DCMAKE_LIBRARY_ARCHITECTURE=$arch_triplet \
  -DCMAKE_CXX_FLAGS="-isystem $root/usr/include/$arch_triplet -isystem $root/usr/include" \
  -DCMAKE_BUILD_RPATH="$lib;$lib/blas" \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,--disable-new-dtags -Wl,-rpath-link,$lib -L$lib" \
  -DCMAKE_SHARED_LINKER_FLAGS="-Wl,--disable-new-dtags -Wl,-rpath-link,$lib -L$lib" \
  -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
  -DProtobuf_PROTOC_EXECUTABLE="$root/wrap/protoc" \
  -DGRPC_CPP_PLUGIN="$root/wrap/grpc_cpp_plugin" \
  -DPKG_CONFIG_EXECUTABLE="$root/wrap/pkg-config" \
  -DFWSERVE_MODEL_TESTS_ONLY=ON -DFWSERVE_BUILD_TESTS=ON -DFWSERVE_BUILD_BENCH=ON -DFWSERVE_CUDA_TESTS=ON \
  -DFWSERVE_CUDA_GRAPHS="${CUDA_GRAPHS:-ON}" \
  "${cuda_args[@]}" > "$build/configure.log" 2>&1 \
  || { tail -40 "$build/configure.log"; die "cmake configure failed ($build/configure.log)"; }
build_start=$(date +%s)
say "configured in $((build_start - configure_start)) s ($build/configure.log)"
[[ "${1:-}" != --configure-only ]] || exit 0
say "building ${targets[*]} with $jobs jobs"
cmake --build "$build" --parallel "$jobs" --target "${targets[@]}"
end=$(date +%s)

protoc_version=$("$root/wrap/protoc" --version | awk '{print $2}')
cxx11_abi=${torch_abi#*=}
[[ -n "$cxx11_abi" ]] || cxx11_abi=$py_abi
python3 - "$build/gpu-build.json" <<EOF
import json, sys
json.dump({
  "torch_from": "$torch_from", "torch_prefix": "$torch_prefix",
  "torch_cuda": "$torch_cuda" or None,
  "python_torch": "$py_torch" or None, "cxx11_abi": "$cxx11_abi",
  "cuda_nvcc": "$nvcc" or None, "torch_cuda_arch_list": "${TORCH_CUDA_ARCH_LIST:-}" or None,
  "protoc": "$protoc_version", "glibc": "$glibc",
  "kit_root": "$root", "kit_lib": "$lib", "build_dir": "$build",
  "seconds": {"total": $((end - start)), "configure": $((build_start - configure_start)),
              "build": $((end - build_start))},
}, open(sys.argv[1], "w"), indent=1)
EOF
say "built ${targets[*]} in $((end - build_start)) s (all: $((end - start)) s); $build/gpu-build.json"
# The unpacked prefix lives inside .gpu-kit: a checkout that carries .gpu-kit to a GPU
# machine must not carry it too (64 MiB in all).
say "note: $root holds $(du -sh "$root" | cut -f1); remove it (or rerun kit.sh) before" \
  "carrying .gpu-kit anywhere"

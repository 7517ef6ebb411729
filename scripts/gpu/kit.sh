#!/usr/bin/env bash
# The GPU kit (issue 26), made here on Debian 12: every Debian package fwserve's build
# needs besides LibTorch and CUDA (gRPC with grpc_cpp_plugin, Protobuf with protoc,
# Abseil, re2, c-ares, prometheus-cpp, hiredis, nlohmann-json, CLI11, Boost.Beast's
# headers, GoogleTest/GoogleMock, Google Benchmark, OpenSSL, zlib, BLAS, pkg-config),
# with every dependency that a machine holding only a Debian minbase system and
# build-essential lacks (scripts/gpu/base-packages.txt), downloaded with
# `apt-get download` into the git-ignored .gpu-kit/. scripts/gpu/build.sh unpacks it
# into a private prefix on the GPU machine, which has no network (docs/gpu.md).
#
# Usage: scripts/gpu/kit.sh           (re)make .gpu-kit/ and print its size
#        scripts/gpu/kit.sh --list    print the packages and their sizes; download nothing
#
# Made here:
#   .gpu-kit/debs/*.deb        the packages, as Debian ships them (sha256 checked
#                              against the archive's Packages index)
#   .gpu-kit/boost-headers.tar.xz
#                              libboost1.74-dev's headers that fwserve's Boost users
#                              reach (the compiler's -M closure of every file that
#                              includes <boost/...>, plus boost/config/ whole) and its
#                              CMake package files: the whole .deb is 9.5 MB of a
#                              64 MiB transfer, these are under 2 MB
#   .gpu-kit/MANIFEST.tsv      package, version, architecture, bytes, sha256 (one a line)
#   .gpu-kit/SHA256SUMS        `sha256sum -c` format, for build.sh
# Needs: apt-get (lists updated when missing), g++, and the project's build
# dependencies installed here (scripts/install-deps.sh --build) for the Boost closure.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
kit="$repo/.gpu-kit"

# What fwserve needs (scripts/install-deps.sh's BUILD_PACKAGES, less LibTorch and the
# toolchain, plus the test and benchmark libraries). BLAS: the native decode step calls
# cblas_sgemm through libblas.so.3; the kit takes the reference BLAS (libblas3,
# 0.15 MB) rather than OpenBLAS (6.7 MB): on the GPU machine the CPU path only serves
# as the reference, never as the measured one. libxsmm-dev is left out for the same
# reason: without it CMake builds the native step's GEMMs on cblas_sgemm.
PACKAGES=(
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libre2-dev libc-ares-dev
  prometheus-cpp-dev libhiredis-dev nlohmann-json3-dev libcli11-dev libboost-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libssl-dev zlib1g-dev libblas-dev libblas3 pkg-config
  libsentencepiece-dev libsentencepiece0
)
# Runtime libraries of the base system that the -dev packages' libfoo.so links point
# at: carried too, so the link never depends on the GPU machine's own versions.
ALSO=(libssl3 zlib1g)
# Replaced by boost-headers.tar.xz (see above).
PRUNED=libboost1.74-dev

list_only=0
case "${1:-}" in
  --list) list_only=1 ;;
  "") ;;
  *) echo "usage: $0 [--list]" >&2; exit 2 ;;
esac

tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu-kit.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

if ! apt-cache show --no-all-versions libgrpc++-dev >/dev/null 2>&1; then
  echo "kit.sh: apt lists missing; apt-get update"
  apt-get update -qq
fi

# A dpkg status file that holds exactly the base packages, so that `apt-get -s install`
# prints the packages a base machine would have to add (the "Inst" lines).
grep -v '^#' "$repo/scripts/gpu/base-packages.txt" | sed '/^$/d' > "$tmp/base.txt"
# shellcheck disable=SC2046
apt-cache show --no-all-versions $(cat "$tmp/base.txt") 2>/dev/null \
  | sed '/^Package:/a Status: install ok installed' > "$tmp/status" || true
apt-get -s -o Dir::State::status="$tmp/status" -o APT::Install-Recommends=false \
  -o APT::Install-Suggests=false install "${PACKAGES[@]}" > "$tmp/sim.txt"
awk '/^Inst /{print $2}' "$tmp/sim.txt" > "$tmp/closure.txt"
printf '%s\n' "${ALSO[@]}" >> "$tmp/closure.txt"
sort -u "$tmp/closure.txt" -o "$tmp/closure.txt"

# The candidate's record of each (what apt would install): name=version, size, sha256.
# shellcheck disable=SC2046
apt-cache show --no-all-versions $(cat "$tmp/closure.txt") \
  | awk '/^Package:/{p=$2} /^Version:/{v=$2} /^Size:/{z=$2} /^SHA256:/{h=$2}
         /^$/{if (p) print p"="v, z, h; p=""} END{if (p) print p"="v, z, h}' \
  | sort > "$tmp/records.txt"
cut -d' ' -f1 "$tmp/records.txt" > "$tmp/pinned.txt"
if [[ $(wc -l < "$tmp/pinned.txt") -ne $(wc -l < "$tmp/closure.txt") ]]; then
  echo "kit.sh: apt-cache show found $(wc -l < "$tmp/pinned.txt") of" \
    "$(wc -l < "$tmp/closure.txt") packages" >&2
  exit 1
fi

if [[ $list_only -eq 1 ]]; then
  awk '{split($1, a, "="); printf "%-28s %-34s %9d\n", a[1], a[2], $2; t += $2}
       END{printf "%d packages, %d kB as .debs", NR, t / 1000}' "$tmp/records.txt"
  echo " ($PRUNED is replaced by a smaller headers archive in the kit)"
  exit 0
fi

rm -rf "$kit"
mkdir -p "$kit/debs"
(cd "$kit/debs" && xargs apt-get -o APT::Sandbox::User=root download -q < "$tmp/pinned.txt" >/dev/null)

# Each .deb's sha256 against the archive's index (apt-cache show's SHA256 field).
printf 'package\tversion\tarchitecture\tbytes\tsha256\n' > "$kit/MANIFEST.tsv"
while read -r pinned size want; do
  pkg=${pinned%%=*} ver=${pinned#*=}
  deb=$(ls "$kit/debs/${pkg}_"*.deb)
  have=$(sha256sum "$deb" | cut -d' ' -f1)
  if [[ "$want" != "$have" ]]; then
    echo "kit.sh: $deb: sha256 $have, the archive says $want" >&2
    exit 1
  fi
  arch=$(dpkg-deb -f "$deb" Architecture)
  printf '%s\t%s\t%s\t%s\t%s\n' "$pkg" "$ver" "$arch" "$(stat -c %s "$deb")" "$have" \
    >> "$kit/MANIFEST.tsv"
done < "$tmp/records.txt"

# Boost: keep only the headers fwserve's Boost users reach, and the CMake files.
boost_deb=$(ls "$kit/debs/${PRUNED}_"*.deb)
dpkg-deb -x "$boost_deb" "$tmp/boost"
inc="$tmp/boost/usr/include"
(cd "$repo" && grep -rl --include='*.cc' --include='*.h' '#include <boost/' \
   server bench tests client common tools models 2>/dev/null || true) > "$tmp/boost-users.txt"
: > "$tmp/boost-files.txt"
while read -r src; do
  # -MG: headers generated at build time (protobuf) count as present; LibTorch's are
  # not on this path and are not needed for the Boost closure.
  g++ -std=c++17 -M -MG -DFWSERVE_FUZZ_HTTP_REQUEST -I"$repo" -isystem "$inc" "$repo/$src" 2>/dev/null \
    | tr ' \\' '\n\n' | sed -n "s|^$inc/||p" | grep '^boost/' >> "$tmp/boost-files.txt" || {
      echo "kit.sh: g++ -M $src failed (are the build dependencies installed here?)" >&2
      exit 1
    }
done < "$tmp/boost-users.txt"
(cd "$inc" && find boost/config -type f) >> "$tmp/boost-files.txt"
printf '%s\n' boost/config.hpp boost/version.hpp >> "$tmp/boost-files.txt"
sort -u "$tmp/boost-files.txt" | sed 's|^|usr/include/|' > "$tmp/boost-list.txt"
(cd "$tmp/boost" && find usr/lib -path '*/cmake/*' \( -type f -o -type l \)) >> "$tmp/boost-list.txt"
tar -C "$tmp/boost" -cJf "$kit/boost-headers.tar.xz" -T "$tmp/boost-list.txt"
ver=$(dpkg-deb -f "$boost_deb" Version)
printf '%s\t%s\t%s\t%s\t%s\n' "boost-headers.tar.xz (from $PRUNED)" "$ver" all \
  "$(stat -c %s "$kit/boost-headers.tar.xz")" \
  "$(sha256sum "$kit/boost-headers.tar.xz" | cut -d' ' -f1)" >> "$kit/MANIFEST.tsv"
echo "kit.sh: $PRUNED -> boost-headers.tar.xz: $(grep -c '^usr/include' "$tmp/boost-list.txt")" \
  "headers from $(wc -l < "$tmp/boost-users.txt") source files"
rm "$boost_deb"

(cd "$kit" && sha256sum debs/*.deb boost-headers.tar.xz > SHA256SUMS)
n=$(ls "$kit/debs" | wc -l)
bytes=$(du -cb "$kit/debs" "$kit/boost-headers.tar.xz" | tail -1 | cut -f1)
tree=$(cd "$repo" && git ls-files -z | xargs -0 stat -c %s | awk '{s+=$1} END{print s}')
echo "kit.sh: .gpu-kit: $n packages + boost-headers.tar.xz," \
  "$((bytes / 1024)) KiB ($(awk -v b="$bytes" 'BEGIN{printf "%.1f", b/1048576}') MiB);" \
  "tracked tree $(awk -v b="$tree" 'BEGIN{printf "%.1f", b/1048576}') MiB;" \
  "together $(awk -v b=$((bytes + tree)) 'BEGIN{printf "%.1f", b/1048576}') MiB of the 64 MiB" \
  "a device call carries"
